//! Key-encryption keys: what wraps a run's data key.
//!
//! [`Kek`] is the seam for a KMS (AWS KMS, GCP KMS, Vault transit: wrap and unwrap a few
//! dozen bytes under a key that never leaves it). [`Keyring`] is the file-backed one for
//! dev and for deployments that mount their KEKs as a secret:
//!
//! ```yaml
//! # Per tenant, newest first: the first key wraps new data keys, any listed key unwraps.
//! tenants:
//!   acme:
//!     - id: acme-2026-12
//!       key: <base64 of 32 random bytes>
//!   "*":            # any tenant without its own entry (dev)
//!     - id: dev-1
//!       key: <base64>
//! ```
//!
//! Rotating a tenant's KEK: put a new key first, keep the old one listed (it still
//! unwraps the data keys it wrapped), restart the services. A data key stays wrapped by
//! the KEK that wrapped it; removing that KEK makes its runs unreadable (a tenant-wide
//! shred).

use std::collections::BTreeMap;
use std::path::Path;

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use base64::Engine as _;
use serde::{Deserialize, Serialize};

use crate::Error;

/// A data key wrapped by a KEK: which KEK, and its ciphertext.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wrapped {
    /// The id of the KEK that wrapped it.
    pub kek: String,
    /// base64url(nonce ‖ AES-256-GCM ciphertext ‖ tag).
    pub dek: String,
}

/// Wraps and unwraps data keys for a tenant (a KMS, or [`Keyring`]).
pub trait Kek: std::fmt::Debug + Send + Sync + 'static {
    /// Wraps `dek` under the tenant's current KEK; `aad` binds it to its run.
    fn wrap(&self, tenant: &str, aad: &[u8], dek: &[u8; 32]) -> Result<Wrapped, Error>;
    /// Unwraps a data key wrapped by [`Kek::wrap`] with the same `aad`.
    fn unwrap(&self, tenant: &str, aad: &[u8], wrapped: &Wrapped) -> Result<[u8; 32], String>;
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyringFile {
    tenants: BTreeMap<String, Vec<KeyEntry>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyEntry {
    id: String,
    key: String,
}

/// Tenant KEKs from a YAML file (see the module doc).
pub struct Keyring {
    tenants: BTreeMap<String, Vec<(String, [u8; 32])>>,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the keys themselves.
        let ids: BTreeMap<&String, Vec<&String>> = self
            .tenants
            .iter()
            .map(|(t, keys)| (t, keys.iter().map(|(id, _)| id).collect()))
            .collect();
        f.debug_struct("Keyring").field("tenants", &ids).finish()
    }
}

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::URL_SAFE_NO_PAD;

impl Keyring {
    pub fn load(path: &Path) -> Result<Keyring, Error> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Keyring(format!("{}: {e}", path.display())))?;
        Keyring::parse(&text).map_err(|e| Error::Keyring(format!("{}: {e}", path.display())))
    }

    pub fn parse(text: &str) -> Result<Keyring, String> {
        let file: KeyringFile = serde_yaml::from_str(text).map_err(|e| e.to_string())?;
        let mut tenants = BTreeMap::new();
        for (tenant, entries) in file.tenants {
            if entries.is_empty() {
                return Err(format!("tenant {tenant:?} lists no key"));
            }
            let mut keys = Vec::new();
            for entry in entries {
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(entry.key.trim())
                    .or_else(|_| B64.decode(entry.key.trim()))
                    .map_err(|e| format!("key {:?} of tenant {tenant:?}: {e}", entry.id))?;
                let key: [u8; 32] = bytes.try_into().map_err(|b: Vec<u8>| {
                    format!(
                        "key {:?} of tenant {tenant:?} is {} bytes, not 32",
                        entry.id,
                        b.len()
                    )
                })?;
                keys.push((entry.id, key));
            }
            tenants.insert(tenant, keys);
        }
        Ok(Keyring { tenants })
    }

    /// A keyring text with one new random KEK for `tenant` (`*`: every tenant).
    pub fn generate(tenant: &str, id: &str) -> Result<String, Error> {
        Keyring::add(None, tenant, id)
    }

    /// `existing` keyring text (or a new one) with a new random KEK put first for
    /// `tenant`: it wraps new data keys from now on; the older ones still unwrap.
    pub fn add(existing: Option<&str>, tenant: &str, id: &str) -> Result<String, Error> {
        let mut tenants = match existing {
            Some(text) => {
                Keyring::parse(text).map_err(Error::Keyring)?;
                serde_yaml::from_str::<KeyringFile>(text)
                    .map_err(|e| Error::Keyring(e.to_string()))?
                    .tenants
            }
            None => BTreeMap::new(),
        };
        let keys = tenants.entry(tenant.to_owned()).or_default();
        if keys.iter().any(|k| k.id == id) {
            return Err(Error::Keyring(format!(
                "tenant {tenant:?} already has a key {id:?}"
            )));
        }
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).map_err(|e| Error::Keyring(format!("randomness: {e}")))?;
        keys.insert(
            0,
            KeyEntry {
                id: id.to_owned(),
                key: base64::engine::general_purpose::STANDARD.encode(key),
            },
        );
        #[derive(Serialize)]
        struct Out {
            tenants: BTreeMap<String, Vec<KeyEntry>>,
        }
        let yaml =
            serde_yaml::to_string(&Out { tenants }).map_err(|e| Error::Keyring(e.to_string()))?;
        Ok(format!(
            "# Sortie tenant key-encryption keys: per tenant, newest first. Secret.\n{yaml}"
        ))
    }

    fn keys_of(&self, tenant: &str) -> Option<&Vec<(String, [u8; 32])>> {
        self.tenants.get(tenant).or_else(|| self.tenants.get("*"))
    }
}

impl Kek for Keyring {
    fn wrap(&self, tenant: &str, aad: &[u8], dek: &[u8; 32]) -> Result<Wrapped, Error> {
        let (id, kek) = self
            .keys_of(tenant)
            .and_then(|keys| keys.first())
            .ok_or_else(|| Error::NoKek(tenant.to_owned()))?;
        let mut nonce = [0u8; 12];
        getrandom::fill(&mut nonce).map_err(|e| Error::Keyring(format!("randomness: {e}")))?;
        let cipher = Aes256Gcm::new(kek.into());
        let sealed = cipher
            .encrypt(Nonce::from_slice(&nonce), Payload { msg: dek, aad })
            .map_err(|_| Error::Keyring("wrapping failed".into()))?;
        let mut out = nonce.to_vec();
        out.extend_from_slice(&sealed);
        Ok(Wrapped {
            kek: id.clone(),
            dek: B64.encode(out),
        })
    }

    fn unwrap(&self, tenant: &str, aad: &[u8], wrapped: &Wrapped) -> Result<[u8; 32], String> {
        let keys = self
            .keys_of(tenant)
            .ok_or_else(|| format!("no key-encryption key for tenant {tenant:?}"))?;
        let (_, kek) = keys
            .iter()
            .find(|(id, _)| *id == wrapped.kek)
            .ok_or_else(|| format!("its KEK {:?} is not in the keyring", wrapped.kek))?;
        let bytes = B64.decode(&wrapped.dek).map_err(|e| e.to_string())?;
        if bytes.len() < 12 {
            return Err("too short".into());
        }
        let (nonce, sealed) = bytes.split_at(12);
        let dek = Aes256Gcm::new(kek.into())
            .decrypt(Nonce::from_slice(nonce), Payload { msg: sealed, aad })
            .map_err(|_| "it does not authenticate under its KEK".to_owned())?;
        dek.try_into().map_err(|_| "it is not 32 bytes".to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wrapped_key_unwraps_for_its_run_and_tenant_only() {
        let ring = Keyring::parse(&Keyring::generate("*", "k1").expect("test")).expect("test");
        let dek = [7u8; 32];
        let wrapped = ring.wrap("acme", b"acme/run-1", &dek).expect("test");
        assert_eq!(
            ring.unwrap("acme", b"acme/run-1", &wrapped).expect("test"),
            dek
        );
        assert!(ring.unwrap("acme", b"acme/run-2", &wrapped).is_err());
        let other = Keyring::parse(&Keyring::generate("*", "k1").expect("test")).expect("test");
        assert!(other.unwrap("acme", b"acme/run-1", &wrapped).is_err());
    }

    #[test]
    fn a_keyring_is_refused_with_a_short_key_or_no_keys() {
        assert!(Keyring::parse("tenants:\n  a:\n    - id: k\n      key: AAAA\n").is_err());
        assert!(Keyring::parse("tenants:\n  a: []\n").is_err());
        assert!(format!(
            "{:?}",
            Keyring::parse(&Keyring::generate("a", "k").expect("test")).expect("test")
        )
        .contains("\"k\""));
    }

    #[test]
    fn a_rotated_keyring_wraps_with_the_new_key_and_still_unwraps_with_the_old() {
        let first = Keyring::generate("acme", "k1").expect("test");
        let old = Keyring::parse(&first).expect("test");
        let wrapped = old.wrap("acme", b"r", &[1; 32]).expect("test");
        let second = Keyring::add(Some(&first), "acme", "k2").expect("test");
        assert!(Keyring::add(Some(&second), "acme", "k2").is_err());
        let new = Keyring::parse(&second).expect("test");
        assert_eq!(new.wrap("acme", b"r", &[1; 32]).expect("test").kek, "k2");
        assert_eq!(new.unwrap("acme", b"r", &wrapped).expect("test"), [1; 32]);
    }
}
