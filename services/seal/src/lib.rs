//! Sortie's payload encryption (SPEC §3 "tenant-namespaced encrypted stores"; issue 14
//! items 7 and 8).
//!
//! - Every run gets its own **data key** (DEK, 32 random bytes) the first time anything of
//!   it is sealed: the gateway when it takes a start, or the reducer when it folds one.
//! - A DEK is stored only **wrapped** — AES-256-GCM under its tenant's **key-encryption
//!   key** (KEK) — in a key store ([`keys::RunKeys`], on a `sortie-blob` store: a
//!   directory in dev, an S3 bucket in production). KEKs come from a [`kek::Kek`]: a
//!   keyring file here ([`kek::Keyring`]), a KMS behind the same trait elsewhere.
//! - A run's payloads (input, arguments, outputs, proposals, decisions: the list is
//!   `sortie_core::seal`'s) are written **sealed** with its DEK ([`seal::RunSeal`]);
//!   ids, statuses, hashes and timers stay readable.
//! - **Crypto-shredding**: destroying a run's DEK ([`keys::RunKeys::destroy`]) overwrites
//!   its wrapped copy in the key store with a marker. From then on no reader — reducer,
//!   executor, gateway, auditor — can unseal the run's payloads, on any topic, in any
//!   retained segment or backup; the history's hash chain still verifies, because it was
//!   taken over the sealed bytes.
//!
//! Sealing is deterministic (see [`seal`]): it is what lets the fold hash its history over
//! ciphertext and a replay reproduce it byte for byte.

pub mod kek;
pub mod keys;
pub mod seal;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use keys::{Lookup, PendingKey, RunKeys};
pub use seal::{RunKey, RunSeal, Unopened};
pub use sortie_core::seal::{is_sealed, Seal};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The keyring file is missing, unreadable or malformed.
    #[error("keyring: {0}")]
    Keyring(String),
    /// No key-encryption key for this tenant (and no `*` entry).
    #[error("no key-encryption key for tenant {0:?} in the keyring")]
    NoKek(String),
    /// A wrapped data key that does not unwrap: wrong KEK, a KEK no longer in the
    /// keyring, or a tampered key store.
    #[error("the data key of run {run_id} (tenant {tenant}) does not unwrap: {reason}")]
    Unwrap {
        tenant: String,
        run_id: String,
        reason: String,
    },
    /// A sealed payload that does not open: tampered, another run's, or under another key.
    #[error("a sealed payload of run {run_id} does not open: {reason}")]
    Open { run_id: String, reason: String },
    /// A sealed payload of a run that has no data key in the key store: the store is not
    /// the one it was sealed with (misconfiguration), or the payload was forged.
    #[error("a sealed payload, but its run has no data key in the key store")]
    NoKey,
    /// A prepared key lost the race to store a run's key: another writer made one first.
    #[error("run {run_id} got another data key meanwhile")]
    Raced { run_id: String },
    /// The key store could not be reached; another try may work.
    #[error("key store: {0}")]
    Store(#[from] sortie_blob::Error),
}

/// How a service reaches the run keys: `--seal-keyring`, `--seal-key-store`,
/// `--seal-s3-endpoint`. Absent: payloads are written in plaintext, as before 0.3.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SealConfig {
    /// The keyring file of tenant KEKs ([`kek::Keyring`]).
    pub keyring: PathBuf,
    /// Where wrapped data keys live: `file:///path` or `s3://bucket[/prefix]`.
    pub key_store: String,
    /// An S3-compatible endpoint for `key_store`; absent: AWS.
    #[serde(default)]
    pub s3_endpoint: Option<String>,
    /// How long a reader may keep a looked-up key before asking the store again (a
    /// destroyed key stops working everywhere within this; the writer that destroys it
    /// forgets it at once).
    #[serde(default = "default_cache_ms")]
    pub cache_ms: u64,
}

fn default_cache_ms() -> u64 {
    5_000
}

impl SealConfig {
    pub fn new(keyring: impl Into<PathBuf>, key_store: impl Into<String>) -> SealConfig {
        SealConfig {
            keyring: keyring.into(),
            key_store: key_store.into(),
            s3_endpoint: None,
            cache_ms: default_cache_ms(),
        }
    }

    /// [`SealConfig::open`] for a service starting: logs where the keys are.
    pub fn open_logged(&self) -> Result<RunKeys, Error> {
        let keys = self.open()?;
        tracing::info!(key_store = %keys.location(), "Run payloads are sealed with per-run data keys.");
        Ok(keys)
    }

    /// Opens the keyring and the key store.
    pub fn open(&self) -> Result<RunKeys, Error> {
        let kek = kek::Keyring::load(&self.keyring)?;
        let store = sortie_blob::BlobConfig {
            store: self.key_store.clone(),
            s3_endpoint: self.s3_endpoint.clone(),
            threshold: sortie_blob::DEFAULT_THRESHOLD,
        }
        .open()?;
        Ok(RunKeys::new(
            Arc::new(kek),
            store,
            Duration::from_millis(self.cache_ms),
        ))
    }
}
