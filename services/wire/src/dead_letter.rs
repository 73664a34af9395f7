//! Building a dead letter: the one place that says what a [`DeadLetter`] keeps of the
//! record it stands for. The reducer and the executor both use it, so a letter is the same
//! whoever wrote it.
//!
//! A letter is itself a record Kafka must take, whatever the record it stands for held:
//! a hostile record's key, headers or reason text never make its letter too large to
//! produce (a refused letter would abort the transaction it is in, and the same record
//! would be read and refused again, for ever). Each part is bounded — the value by
//! [`VALUE_CAP`], the key by [`KEY_CAP`], the headers by [`HEADERS_CAP`] and
//! [`HEADER_BYTES_CAP`], the reason by [`REASON_CAP`] — and what was cut is said in the
//! reason, with the SHA-256 of a cut key. The topic, partition and offset always travel:
//! the original can be found where it is.

use rdkafka::message::{Headers, Message};
use sha2::{Digest, Sha256};

use crate::records::{DeadLetter, Header};

/// Original values up to this size travel inside the letter. The letter must itself fit in
/// a record (1 MiB): a larger value stays where it is, and the letter names its topic,
/// partition and offset.
pub const VALUE_CAP: usize = 512 * 1024;
/// The longest original key a letter (and its record's key) carries; a longer one is cut.
pub const KEY_CAP: usize = 1024;
/// Most original headers a letter carries, and most bytes in them (names and values).
pub const HEADERS_CAP: usize = 32;
pub const HEADER_BYTES_CAP: usize = 16 * 1024;
/// The longest reason a letter carries.
pub const REASON_CAP: usize = 4096;

/// The letter for `message`, written by `service` (e.g. `reducer/r-1`), with a reason
/// code a dashboard can group by and a reason a person can read. Bounded: see the module.
pub fn letter(
    message: &impl Message,
    service: String,
    code: &str,
    reason: String,
    failed_at: i64,
) -> DeadLetter {
    let mut notes = Vec::new();
    let original_key = message.key().map(|key| {
        if key.len() > KEY_CAP {
            notes.push(format!(
                "key of {} bytes cut to {KEY_CAP} (sha256 {})",
                key.len(),
                hex(&Sha256::digest(key))
            ));
        }
        key[..key.len().min(KEY_CAP)].to_vec()
    });
    let mut original_headers = Vec::new();
    if let Some(headers) = message.headers() {
        let mut bytes = 0;
        let mut dropped = 0;
        for header in headers.iter() {
            let size = header.key.len() + header.value.map_or(0, <[u8]>::len);
            if original_headers.len() >= HEADERS_CAP || bytes + size > HEADER_BYTES_CAP {
                dropped += 1;
                continue;
            }
            bytes += size;
            original_headers.push(Header {
                key: header.key.to_owned(),
                value: header.value.map(<[u8]>::to_vec),
            });
        }
        if dropped > 0 {
            notes.push(format!("{dropped} of {} headers left out", headers.count()));
        }
    }
    let value = message.payload();
    if value.is_some_and(|v| v.len() > VALUE_CAP) {
        notes.push("value left out: read it at the original offset".to_owned());
    }
    DeadLetter {
        original_key,
        original_value: value.filter(|v| v.len() <= VALUE_CAP).map(<[u8]>::to_vec),
        original_headers,
        ..by_reference(
            message,
            service,
            code,
            with_notes(clip(reason, REASON_CAP - 1024), &notes),
            failed_at,
        )
    }
}

/// A letter that names where `message` is and why it is set aside, and carries nothing
/// of it: for an input whose own bytes may be what Kafka refuses.
pub fn by_reference(
    message: &impl Message,
    service: String,
    code: &str,
    reason: String,
    failed_at: i64,
) -> DeadLetter {
    DeadLetter {
        reason_code: code.to_owned(),
        reason: clip(reason, REASON_CAP),
        service,
        original_topic: message.topic().to_owned(),
        original_partition: message.partition(),
        original_offset: message.offset(),
        original_timestamp: message.timestamp().to_millis(),
        original_key: None,
        original_value: None,
        original_headers: Vec::new(),
        failed_at,
    }
}

/// The key of a letter's own record: the original key, cut to [`KEY_CAP`].
pub fn letter_key(message: &impl Message) -> Vec<u8> {
    let key = message.key().unwrap_or_default();
    key[..key.len().min(KEY_CAP)].to_vec()
}

fn with_notes(reason: String, notes: &[String]) -> String {
    match notes.is_empty() {
        true => reason,
        false => format!("{reason} ({})", notes.join("; ")),
    }
}

/// `text` cut to at most `max` bytes at a character boundary.
fn clip(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use rdkafka::message::{OwnedHeaders, OwnedMessage, Timestamp};

    use super::*;

    fn message(value: Vec<u8>) -> OwnedMessage {
        let headers = OwnedHeaders::new().insert(rdkafka::message::Header {
            key: "traceparent",
            value: Some("00-abc".as_bytes()),
        });
        OwnedMessage::new(
            Some(value),
            Some(b"run-1".to_vec()),
            "t.commands".to_owned(),
            Timestamp::CreateTime(7),
            3,
            42,
            Some(headers),
        )
    }

    #[test]
    fn a_letter_keeps_where_the_record_was_and_what_it_held() {
        let letter = letter(
            &message(b"abc".to_vec()),
            "reducer/r".into(),
            "undecodable",
            "bad".into(),
            9,
        );
        assert_eq!(
            (
                letter.original_topic.as_str(),
                letter.original_partition,
                letter.original_offset
            ),
            ("t.commands", 3, 42)
        );
        assert_eq!(letter.original_timestamp, Some(7));
        assert_eq!(letter.original_key.as_deref(), Some(&b"run-1"[..]));
        assert_eq!(letter.original_value.as_deref(), Some(&b"abc"[..]));
        assert_eq!(letter.original_headers.len(), 1);
        assert_eq!(letter.original_headers[0].key, "traceparent");
        assert_eq!(
            (letter.reason_code.as_str(), letter.failed_at),
            ("undecodable", 9)
        );
    }

    /// Checked red: with the key and headers copied whole, the letter of a 600 KiB key
    /// is over a megabyte and Kafka refuses it.
    #[test]
    fn a_hostile_key_headers_and_reason_never_make_a_letter_too_large() {
        let mut headers = OwnedHeaders::new();
        for i in 0..200 {
            headers = headers.insert(rdkafka::message::Header {
                key: &format!("h{i}"),
                value: Some(&vec![b'x'; 4096][..]),
            });
        }
        let message = OwnedMessage::new(
            Some(vec![7; VALUE_CAP]),
            Some(vec![b'k'; 600 * 1024]),
            "t.commands".to_owned(),
            Timestamp::CreateTime(7),
            3,
            42,
            Some(headers),
        );
        let letter = letter(
            &message,
            "reducer/r".into(),
            "invalid",
            "é".repeat(100_000),
            9,
        );
        assert_eq!(letter.original_key.as_ref().map(Vec::len), Some(KEY_CAP));
        assert!(letter.original_headers.len() <= HEADERS_CAP);
        assert!(letter.reason.len() <= REASON_CAP);
        let carried = letter.original_value.as_ref().map_or(0, Vec::len)
            + letter.original_key.as_ref().map_or(0, Vec::len)
            + letter
                .original_headers
                .iter()
                .map(|h| h.key.len() + h.value.as_ref().map_or(0, Vec::len))
                .sum::<usize>()
            + letter.reason.len();
        assert!(carried < 600 * 1024, "{carried} bytes");
        assert_eq!(letter_key(&message).len(), KEY_CAP);
        let reference = by_reference(&message, "reducer/r".into(), "unproducible", "r".into(), 9);
        assert_eq!(
            (
                reference.original_key,
                reference.original_value,
                reference.original_offset
            ),
            (None, None, 42)
        );
    }

    #[test]
    fn a_value_over_the_cap_stays_where_it_is() {
        let letter = letter(
            &message(vec![1; VALUE_CAP + 1]),
            "executor/e".into(),
            "oversized",
            "big".into(),
            9,
        );
        assert_eq!(letter.original_value, None);
        assert_eq!(letter.original_offset, 42);
    }
}
