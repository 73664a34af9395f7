//! What one run may write. Kafka refuses a record over the topics' `max.message.bytes`
//! (1 MiB), and a refused record inside a transaction aborts the whole batch — which would
//! then be replayed forever. So the fold itself keeps every run within these limits,
//! deterministically (the same history decides the same way on every replay):
//!
//! - a run's state (its JSON, the body of its changelog record) stays under
//!   [`MAX_STATE_BYTES`];
//! - every event and intent stays under [`MAX_RECORD_BYTES`];
//! - only the last [`MAX_REJECTED_COMMANDS`] rejected command ids are remembered for
//!   dedupe (accepted ones are bounded by what a run can accept).
//!
//! An input that would break a limit is not applied as is: a command is rejected with code
//! `too_large`; a step result whose output is too large becomes a non-retryable failure of
//! that step (`too_large`), handled by the node's failure policy; anything else fails the
//! run with the reason. Large values belong in a blob store, referenced by URI (SPEC §3).
//!
//! Sealed runs (`crate::seal`) are checked on their plaintext, and still fit: a sealed
//! payload of `L` bytes takes at most `4/3·(L + 28) + 20` (base64 of nonce, ciphertext and
//! tag, in `{"$sealed":"v1.…"}`). An event or intent of [`MAX_RECORD_BYTES`] seals to under
//! 520 KiB; a state of [`MAX_STATE_BYTES`] to under 690 KiB plus ~55 bytes per payload, and
//! every payload of a state sits in a step or interrupt with well over 150 bytes of its own
//! ids, so under 900 KiB — all under the 1 MiB record limit, without sealing anything twice
//! to measure it.

use serde::Serialize;

/// Largest JSON of a run's state.
pub const MAX_STATE_BYTES: usize = 512 * 1024;
/// Largest JSON of one event or one intent.
pub const MAX_RECORD_BYTES: usize = 384 * 1024;
/// Rejected command ids remembered per run.
pub const MAX_REJECTED_COMMANDS: usize = 64;
/// Longest id (run, command, tenant, operation, graph) in bytes.
pub const MAX_ID_BYTES: usize = 256;

/// The length of `value`'s JSON, without building it.
pub fn json_len<T: Serialize + ?Sized>(value: &T) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    match serde_json::to_writer(&mut count, value) {
        Ok(()) => count.0,
        Err(_) => usize::MAX,
    }
}

/// Whether `value` is an id Sortie can carry everywhere it goes: a Kafka key, a sled key
/// (where NUL separates fields), a URL path segment, a log line. Non-empty, at most
/// [`MAX_ID_BYTES`], no control characters.
pub fn check_id(field: &str, value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err(format!("{field} is empty"));
    }
    if value.len() > MAX_ID_BYTES {
        return Err(format!(
            "{field} has {} bytes; at most {MAX_ID_BYTES} are allowed",
            value.len()
        ));
    }
    if let Some(c) = value.chars().find(|c| c.is_control()) {
        return Err(format!(
            "{field} contains the control character U+{:04X}",
            c as u32
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_with_control_characters_or_too_long_are_refused() {
        assert!(check_id("run_id", "run_01").is_ok());
        assert!(check_id("run_id", "").is_err());
        assert!(check_id("run_id", "a\0b").is_err());
        assert!(check_id("run_id", "a\nb").is_err());
        assert!(check_id("run_id", &"x".repeat(MAX_ID_BYTES)).is_ok());
        assert!(check_id("run_id", &"x".repeat(MAX_ID_BYTES + 1)).is_err());
    }

    #[test]
    fn json_len_is_the_length_of_the_json() {
        let value = serde_json::json!({"a": [1, "two", null], "b": "ü"});
        assert_eq!(
            json_len(&value),
            serde_json::to_vec(&value).map(|v| v.len()).unwrap_or(0)
        );
    }
}
