//! Sealing one run's payloads with its data key.
//!
//! A sealed payload is `{"$sealed": "v1.<base64url(nonce ‖ ciphertext ‖ tag)>"}`:
//! AES-256-GCM over the payload's canonical JSON, with the run id as associated data (a
//! sealed value pasted into another run does not open).
//!
//! The nonce is **synthetic** (the SIV construction, RFC 5297's idea with GCM): the first
//! 12 bytes of HMAC-SHA-256 under a nonce key, over the run id and the plaintext. So the
//! same payload of the same run always seals to the same bytes, and two different
//! payloads never share a nonce (short of an HMAC collision). That is what the fold
//! needs — it hashes events over their sealed form, and a replay, an aborted and retried
//! transaction or an audit must produce the same bytes — and it costs one thing, said
//! here once: equal payloads within one run are visibly equal in the ciphertext.
//! Encryption and nonce keys are derived from the data key (HMAC-SHA-256 with distinct
//! labels), never the data key itself.

use std::sync::Arc;

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use base64::Engine as _;
use hmac::{Hmac, Mac};
use serde_json::Value;
use sha2::Sha256;
use sortie_core::seal::{sealed_text, Seal, SEALED};

use crate::Error;

const VERSION: &str = "v1.";
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::URL_SAFE_NO_PAD;

fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    for part in parts {
        mac.update(part);
    }
    mac.finalize().into_bytes().into()
}

/// A run's data key, as the two keys sealing uses.
pub struct RunKey {
    enc: [u8; 32],
    nonce: [u8; 32],
}

impl std::fmt::Debug for RunKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RunKey(…)")
    }
}

impl RunKey {
    pub fn from_dek(dek: &[u8; 32]) -> RunKey {
        RunKey {
            enc: hmac(dek, &[b"sortie-seal/v1/encryption"]),
            nonce: hmac(dek, &[b"sortie-seal/v1/nonce"]),
        }
    }

    fn seal(&self, run_id: &str, value: &Value) -> Value {
        let plain = sortie_core::json::canonical(value);
        let aad = run_id.as_bytes();
        let tag = hmac(
            &self.nonce,
            &[&(aad.len() as u64).to_be_bytes(), aad, plain.as_bytes()],
        );
        let nonce = &tag[..12];
        let sealed = Aes256Gcm::new((&self.enc).into())
            .encrypt(
                Nonce::from_slice(nonce),
                Payload {
                    msg: plain.as_bytes(),
                    aad,
                },
            )
            .expect("AES-GCM encrypts any payload under 64 GiB");
        let mut bytes = nonce.to_vec();
        bytes.extend_from_slice(&sealed);
        serde_json::json!({ SEALED: format!("{VERSION}{}", B64.encode(bytes)) })
    }

    fn open(&self, run_id: &str, text: &str) -> Result<Value, String> {
        let body = text
            .strip_prefix(VERSION)
            .ok_or_else(|| "not a v1 sealed value".to_owned())?;
        let bytes = B64.decode(body).map_err(|e| e.to_string())?;
        if bytes.len() < 12 + 16 {
            return Err("too short".into());
        }
        let (nonce, sealed) = bytes.split_at(12);
        let plain = Aes256Gcm::new((&self.enc).into())
            .decrypt(
                Nonce::from_slice(nonce),
                Payload {
                    msg: sealed,
                    aad: run_id.as_bytes(),
                },
            )
            .map_err(|_| "it does not authenticate under the run's key".to_owned())?;
        serde_json::from_slice(&plain).map_err(|e| e.to_string())
    }
}

/// How one run's payloads are written and read.
#[derive(Debug, Clone)]
pub enum RunSeal {
    /// In plaintext: encryption is off, or the run has no data key (started before it
    /// was turned on).
    Plain,
    /// Sealed with the run's data key.
    Key { run_id: String, key: Arc<RunKey> },
    /// The run's data key was destroyed: its payloads are gone. Sealing writes `null`,
    /// opening answers `null`.
    Destroyed { run_id: String },
}

impl Seal for RunSeal {
    fn seal(&self, value: &Value) -> Value {
        match self {
            RunSeal::Plain => value.clone(),
            // Null is not a payload (a forgotten one, or none): nothing to hide.
            _ if value.is_null() => Value::Null,
            RunSeal::Key { run_id, key } => key.seal(run_id, value),
            RunSeal::Destroyed { .. } => Value::Null,
        }
    }

    fn active(&self) -> bool {
        !matches!(self, RunSeal::Plain)
    }
}

impl RunSeal {
    pub fn is_destroyed(&self) -> bool {
        matches!(self, RunSeal::Destroyed { .. })
    }

    /// Opens one payload in place if it is sealed; a plaintext payload stays as it is.
    pub fn open(&self, value: &mut Value) -> Result<(), Error> {
        let Some(text) = sealed_text(value) else {
            return Ok(());
        };
        *value = match self {
            RunSeal::Key { run_id, key } => {
                key.open(run_id, text).map_err(|reason| Error::Open {
                    run_id: run_id.clone(),
                    reason,
                })?
            }
            RunSeal::Destroyed { .. } => Value::Null,
            RunSeal::Plain => return Err(Error::NoKey),
        };
        Ok(())
    }

    /// Opens every payload `each` hands over (`|f| state.map_payloads(f)`, an event's, an
    /// input's) in place. Those that do not open stay sealed; the others are opened all
    /// the same, and the answer says how many failed and why the first did.
    pub fn open_all(&self, each: impl FnOnce(&mut dyn FnMut(&mut Value))) -> Result<(), Unopened> {
        let mut failed: Option<Unopened> = None;
        each(&mut |value| {
            if let Err(error) = self.open(value) {
                match &mut failed {
                    Some(failed) => failed.count += 1,
                    None => {
                        failed = Some(Unopened {
                            count: 1,
                            first: error,
                        })
                    }
                }
            }
        });
        failed.map_or(Ok(()), Err)
    }
}

/// Payloads that did not open ([`RunSeal::open_all`]).
#[derive(Debug)]
pub struct Unopened {
    pub count: usize,
    pub first: Error,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn seal_of(run: &str, dek: u8) -> RunSeal {
        RunSeal::Key {
            run_id: run.into(),
            key: Arc::new(RunKey::from_dek(&[dek; 32])),
        }
    }

    #[test]
    fn a_payload_seals_the_same_every_time_and_opens_to_itself() {
        let seal = seal_of("run-1", 1);
        let payload = json!({"card": "4111 1111 1111 1111", "amount": 12});
        let sealed = seal.seal(&payload);
        assert_eq!(sealed, seal.seal(&payload), "deterministic");
        assert!(!sealed.to_string().contains("4111"));
        assert_ne!(sealed, seal.seal(&json!({"card": "x"})));
        let mut opened = sealed.clone();
        seal.open(&mut opened).expect("test");
        assert_eq!(opened, payload);
        assert_eq!(seal.seal(&Value::Null), Value::Null);
    }

    #[test]
    fn a_sealed_payload_does_not_open_in_another_run_or_under_another_key() {
        let sealed = seal_of("run-1", 1).seal(&json!("secret"));
        assert!(seal_of("run-2", 1).open(&mut sealed.clone()).is_err());
        assert!(seal_of("run-1", 2).open(&mut sealed.clone()).is_err());
        let mut tampered = sealed.clone();
        let text = tampered[SEALED].as_str().expect("test").to_owned();
        let last = text.chars().last().expect("test");
        let flipped = if last == 'A' { 'B' } else { 'A' };
        tampered[SEALED] = json!(format!("{}{flipped}", &text[..text.len() - 1]));
        assert!(seal_of("run-1", 1).open(&mut tampered).is_err());
        assert!(RunSeal::Plain.open(&mut sealed.clone()).is_err());
        let mut gone = sealed;
        RunSeal::Destroyed {
            run_id: "run-1".into(),
        }
        .open(&mut gone)
        .expect("test");
        assert_eq!(gone, Value::Null);
    }

    #[test]
    fn open_all_opens_what_opens_and_counts_the_rest() {
        let seal = seal_of("r", 3);
        let good = seal.seal(&json!({"x": 1}));
        let foreign = seal_of("other", 3).seal(&json!("no"));
        let mut values = [good, foreign.clone(), json!("plain")];
        let failed = seal
            .open_all(|f| values.iter_mut().for_each(f))
            .expect_err("one does not open");
        assert_eq!(failed.count, 1);
        assert!(matches!(failed.first, Error::Open { .. }));
        assert_eq!(values, [json!({"x": 1}), foreign, json!("plain")]);
        let mut fine = [seal.seal(&json!(2))];
        seal.open_all(|f| fine.iter_mut().for_each(f))
            .expect("opens");
        assert_eq!(fine, [json!(2)]);
    }
}
