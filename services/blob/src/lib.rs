//! Sortie's blob stores: where values too large for a Kafka record go, so that a run's
//! records carry a reference (`sortie_core::blob::BlobRef`) instead (SPEC §3).
//!
//! This crate owns the [`BlobStore`] trait and its two stores — [`fs::FsStore`] (a
//! directory: dev, tests, a single node) and [`s3::S3Store`] (any S3-compatible API:
//! production) — plus the writers' and readers' policy on top of them:
//! [`offload::offload`] (store the large parts of a value, answer the value with
//! references) and [`resolve::resolve`] / [`resolve::fetch_verified`] (fetch, check the
//! hash and size, project the reference's path). It never decides run semantics and is
//! never called by the fold: only the executor and the gateway do I/O here.
//!
//! Keys are `<tenant>/<run_id>/<sha256>` (`sortie_core::blob::BlobKey`); a store takes
//! any key that [`check_key`] accepts and refuses the rest, so a key can never leave the
//! store's root.

use std::sync::Arc;

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};

pub mod fs;
pub mod offload;
pub mod resolve;
pub mod s3;

pub use sortie_core::blob::{BlobKey, BlobRef, JSON_MEDIA_TYPE};

/// The default size above which a value is stored by reference (64 KiB).
pub const DEFAULT_THRESHOLD: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No blob under that key.
    #[error("no blob at {0}")]
    NotFound(String),
    /// Something is already stored under that key ([`BlobStore::put_new`]).
    #[error("a blob exists at {0}")]
    Exists(String),
    /// The key is not one a store takes (`..`, absolute, NUL, empty segment).
    #[error("invalid blob key {key:?}: {problem}")]
    InvalidKey { key: String, problem: String },
    /// The store could not be reached or refused the operation; another try may work.
    #[error("blob store: {0}")]
    Unavailable(String),
    /// The store's configuration is wrong (a bad URL, say).
    #[error("blob store configuration: {0}")]
    Config(String),
}

/// A place for blobs. Every method may be retried: `put` of the same bytes under the same
/// key is idempotent, and the keys Sortie writes are content-addressed.
pub trait BlobStore: std::fmt::Debug + Send + Sync + 'static {
    /// Stores `bytes` under `key`, replacing what was there, durably and atomically: a
    /// reader sees the old value or the new one, never a part.
    fn put<'a>(&'a self, key: &'a str, bytes: Vec<u8>) -> BoxFuture<'a, Result<(), Error>>;
    /// Stores `bytes` under `key` only if nothing is stored there yet, atomically:
    /// of two writers racing, one wins and the other gets [`Error::Exists`] (a run's data
    /// key is made once, whoever makes it first).
    fn put_new<'a>(&'a self, key: &'a str, bytes: Vec<u8>) -> BoxFuture<'a, Result<(), Error>>;
    /// [`BlobStore::put_new`] for many keys at once, each result in the order given; a
    /// store may make them durable together (the directory store syncs once), or send
    /// them concurrently (the default).
    fn put_new_many<'a>(
        &'a self,
        items: Vec<(String, Vec<u8>)>,
    ) -> BoxFuture<'a, Vec<Result<(), Error>>> {
        Box::pin(async move {
            futures::future::join_all(
                items
                    .iter()
                    .map(|(key, bytes)| self.put_new(key, bytes.clone())),
            )
            .await
        })
    }
    /// The bytes under `key`; [`Error::NotFound`] if there are none.
    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Vec<u8>, Error>>;
    /// Whether a blob is stored under `key`.
    fn exists<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool, Error>>;
    /// Deletes every blob whose key is `prefix` or starts with `prefix/` (whole segments:
    /// `t/run_1` never deletes `t/run_10/…`); answers how many were deleted.
    fn delete_prefix<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<u64, Error>>;
    /// Where it stores, for logs (`file:///…`, `s3://bucket/prefix`).
    fn location(&self) -> String;
}

/// Refuses a key (or prefix) that could name something outside the store: it must be
/// non-empty `/`-separated segments, none empty, `.` or `..`, none holding NUL, `\` or a
/// control character, and not start with `/`.
pub fn check_key(key: &str) -> Result<(), Error> {
    let refuse = |problem: &str| {
        Err(Error::InvalidKey {
            key: key.to_owned(),
            problem: problem.to_owned(),
        })
    };
    if key.is_empty() {
        return refuse("empty");
    }
    if key.len() > 1024 {
        return refuse("longer than 1024 bytes");
    }
    if key.starts_with('/') {
        return refuse("absolute");
    }
    for segment in key.split('/') {
        match segment {
            "" => return refuse("an empty segment"),
            "." | ".." => return refuse("a . or .. segment"),
            s if s.chars().any(|c| c.is_control() || c == '\\') => {
                return refuse("a control character or backslash")
            }
            s if s.starts_with(".tmp-") => return refuse("a name reserved for temporary files"),
            _ => {}
        }
    }
    Ok(())
}

/// How a service reaches its blob store: `--blob-store`, `--blob-s3-endpoint`,
/// `--blob-threshold`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlobConfig {
    /// `file:///absolute/path` (or `file://relative/path`), or `s3://bucket[/prefix]`
    /// (region and credentials from the usual AWS environment variables).
    pub store: String,
    /// The endpoint of an S3-compatible server (MinIO, Ceph, a test server); absent: AWS.
    #[serde(default)]
    pub s3_endpoint: Option<String>,
    /// Values whose JSON is larger than this many bytes are stored by reference.
    #[serde(default = "default_threshold")]
    pub threshold: usize,
}

fn default_threshold() -> usize {
    DEFAULT_THRESHOLD
}

impl BlobConfig {
    pub fn new(store: impl Into<String>) -> BlobConfig {
        BlobConfig {
            store: store.into(),
            s3_endpoint: None,
            threshold: DEFAULT_THRESHOLD,
        }
    }

    /// Opens the store (creates a directory store's root).
    pub fn open(&self) -> Result<Arc<dyn BlobStore>, Error> {
        if let Some(path) = self.store.strip_prefix("file://") {
            if self.s3_endpoint.is_some() {
                return Err(Error::Config(
                    "an S3 endpoint is set, but the store is a directory".into(),
                ));
            }
            return Ok(Arc::new(fs::FsStore::open(path)?));
        }
        if let Some(rest) = self.store.strip_prefix("s3://") {
            return Ok(Arc::new(s3::S3Store::open(
                rest,
                self.s3_endpoint.as_deref(),
            )?));
        }
        Err(Error::Config(format!(
            "{:?} is neither file:///path nor s3://bucket/prefix",
            self.store
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_that_could_leave_the_root_are_refused() {
        for bad in [
            "",
            "/etc/passwd",
            "a/../b",
            "..",
            "a/./b",
            "a//b",
            "a/b/",
            "a\0b",
            "a\\b",
            "a/.tmp-1-2",
        ] {
            assert!(check_key(bad).is_err(), "{bad:?}");
        }
        for good in ["a", "acme/run_1/ab", "t%2F/r.x/0f", "t/%2E./x"] {
            assert!(check_key(good).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn configs_name_a_store() {
        assert!(BlobConfig::new("ftp://x").open().is_err());
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("file://{}", dir.path().join("blobs").display());
        let store = BlobConfig::new(url).open().expect("a directory store");
        assert!(store.location().starts_with("file://"));
        assert!(dir.path().join("blobs").is_dir());
    }
}
