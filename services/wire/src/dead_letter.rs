//! Building a dead letter: the one place that says what a [`DeadLetter`] keeps of the
//! record it stands for. The reducer and the executor both use it, so a letter is the same
//! whoever wrote it.

use rdkafka::message::{Headers, Message};

use crate::records::{DeadLetter, Header};

/// Original values up to this size travel inside the letter. The letter must itself fit in
/// a record (1 MiB): a larger value stays where it is, and the letter names its topic,
/// partition and offset.
pub const VALUE_CAP: usize = 512 * 1024;

/// The letter for `message`, written by `service` (e.g. `reducer/r-1`), with a reason
/// code a dashboard can group by and a reason a person can read.
pub fn letter(
    message: &impl Message,
    service: String,
    code: &str,
    reason: String,
    failed_at: i64,
) -> DeadLetter {
    DeadLetter {
        reason_code: code.to_owned(),
        reason,
        service,
        original_topic: message.topic().to_owned(),
        original_partition: message.partition(),
        original_offset: message.offset(),
        original_timestamp: message.timestamp().to_millis(),
        original_key: message.key().map(<[u8]>::to_vec),
        original_value: message
            .payload()
            .filter(|v| v.len() <= VALUE_CAP)
            .map(<[u8]>::to_vec),
        original_headers: message
            .headers()
            .map(|h| {
                h.iter()
                    .map(|header| Header {
                        key: header.key.to_owned(),
                        value: header.value.map(<[u8]>::to_vec),
                    })
                    .collect()
            })
            .unwrap_or_default(),
        failed_at,
    }
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
