//! The readers' side: fetch a referenced blob, prove it is the one referenced, and put
//! the value (at the reference's `path`) where the reference was.
//!
//! A blob is handed on only if its length is the reference's `size` and its SHA-256 the
//! reference's `sha256`: a tampered or truncated blob is [`ResolveError::Corrupt`], a
//! lost one [`ResolveError::Missing`] — never a value that merely looks fine. A reference
//! is followed only into its reader's own tenant ([`ResolveError::Forbidden`]): a run
//! input that carries a made-up reference to another tenant's blob gets nothing.

use std::collections::BTreeMap;

use futures::future::BoxFuture;
use futures::FutureExt as _;
use serde_json::Value;
pub use sortie_core::blob::has_refs;
use sortie_core::blob::{refs, sha256_hex, BlobRef, JSON_MEDIA_TYPE};
use sortie_core::json::at_path;

use crate::{BlobStore, Error};

/// References inside fetched blobs are followed this deep (Sortie's writers never nest;
/// a value a handler returned might).
pub const MAX_DEPTH: usize = 4;
/// The largest blob a reference may name: over the largest payload any service offloads
/// (an executor reads at most 32 MiB of an answer). A reference naming more is refused
/// before anything is fetched, so no reference makes a reader hold an object it could
/// never take.
pub const MAX_BLOB_BYTES: u64 = 64 * 1024 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// Not a reference a reader may follow (its URI does not name a key, or names
    /// another hash).
    #[error("invalid blob reference {uri}: {problem}")]
    Invalid { uri: String, problem: String },
    /// The reference names another tenant's blob.
    #[error("blob reference {uri} names another tenant's blob")]
    Forbidden { uri: String },
    /// The store has no blob under the key.
    #[error("blob {uri} is missing from the store")]
    Missing { uri: String },
    /// The stored bytes are not the referenced ones.
    #[error("blob {uri} is corrupt: {problem}")]
    Corrupt { uri: String, problem: String },
    /// The store could not be asked; another try may work.
    #[error("blob {uri} could not be read: {problem}")]
    Unavailable { uri: String, problem: String },
    /// A reference to follow, and no store to follow it in.
    #[error("a blob reference ({uri}) needs a blob store, and none is configured")]
    NoStore { uri: String },
}

impl ResolveError {
    /// The step error code an executor reports.
    pub fn code(&self) -> &'static str {
        match self {
            ResolveError::Invalid { .. } => "blob_invalid_reference",
            ResolveError::Forbidden { .. } => "blob_forbidden",
            ResolveError::Missing { .. } => "blob_missing",
            ResolveError::Corrupt { .. } => "blob_corrupt",
            ResolveError::Unavailable { .. } | ResolveError::NoStore { .. } => "blob_unavailable",
        }
    }

    /// Whether another attempt may succeed (the store was down, or this reader has none).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            ResolveError::Unavailable { .. } | ResolveError::NoStore { .. }
        )
    }
}

/// The bytes a reference names, proven by size and hash, from the reader's tenant only.
pub async fn fetch_verified(
    store: &dyn BlobStore,
    reference: &BlobRef,
    tenant: &str,
) -> Result<Vec<u8>, ResolveError> {
    let uri = || reference.uri.clone();
    let key = reference.key().map_err(|problem| ResolveError::Invalid {
        uri: uri(),
        problem,
    })?;
    if key.tenant() != tenant {
        return Err(ResolveError::Forbidden { uri: uri() });
    }
    if reference.size > MAX_BLOB_BYTES {
        return Err(ResolveError::Invalid {
            uri: uri(),
            problem: format!(
                "it names {} bytes; at most {MAX_BLOB_BYTES} are read",
                reference.size
            ),
        });
    }
    let bytes = match store.get(key.as_str()).await {
        Ok(bytes) => bytes,
        Err(Error::NotFound(_)) => return Err(ResolveError::Missing { uri: uri() }),
        Err(Error::InvalidKey { problem, .. }) => {
            return Err(ResolveError::Invalid {
                uri: uri(),
                problem,
            })
        }
        Err(e) => {
            return Err(ResolveError::Unavailable {
                uri: uri(),
                problem: e.to_string(),
            })
        }
    };
    if bytes.len() as u64 != reference.size {
        return Err(ResolveError::Corrupt {
            uri: uri(),
            problem: format!(
                "{} bytes stored, {} referenced",
                bytes.len(),
                reference.size
            ),
        });
    }
    let actual = sha256_hex(&bytes);
    if actual != reference.sha256 {
        return Err(ResolveError::Corrupt {
            uri: uri(),
            problem: format!(
                "the stored bytes hash to {actual}, the reference says {}",
                reference.sha256
            ),
        });
    }
    Ok(bytes)
}

/// `value` with every JSON reference in it replaced by the value it stands for (the
/// blob's JSON at the reference's `path`; `null` when the path is absent, as for any
/// template path). References of other media types are left as they are. Each blob is
/// fetched once per call. A value without references needs no store.
pub async fn resolve(
    store: Option<&dyn BlobStore>,
    tenant: &str,
    value: Value,
) -> Result<Value, ResolveError> {
    resolve_at(store, tenant, value, 0).await
}

fn resolve_at<'a>(
    store: Option<&'a dyn BlobStore>,
    tenant: &'a str,
    value: Value,
    depth: usize,
) -> BoxFuture<'a, Result<Value, ResolveError>> {
    async move {
        let found: Vec<BlobRef> = refs(&value)
            .into_iter()
            .filter(|r| r.media_type == JSON_MEDIA_TYPE)
            .collect();
        let Some(first) = found.first() else {
            return Ok(value);
        };
        let Some(store) = store else {
            return Err(ResolveError::NoStore {
                uri: first.uri.clone(),
            });
        };
        if depth >= MAX_DEPTH {
            return Err(ResolveError::Invalid {
                uri: first.uri.clone(),
                problem: format!("references nested more than {MAX_DEPTH} deep"),
            });
        }
        let mut contents: BTreeMap<String, Value> = BTreeMap::new();
        for reference in &found {
            if contents.contains_key(&reference.uri) {
                continue;
            }
            let bytes = fetch_verified(store, reference, tenant).await?;
            let parsed: Value =
                serde_json::from_slice(&bytes).map_err(|e| ResolveError::Corrupt {
                    uri: reference.uri.clone(),
                    problem: format!("not JSON: {e}"),
                })?;
            let parsed = resolve_at(Some(store), tenant, parsed, depth + 1).await?;
            contents.insert(reference.uri.clone(), parsed);
        }
        Ok(substitute(value, &contents))
    }
    .boxed()
}

fn substitute(value: Value, contents: &BTreeMap<String, Value>) -> Value {
    if let Some(reference) = BlobRef::from_value(&value) {
        return match contents.get(&reference.uri) {
            Some(whole) => at_path(whole, reference.path.as_deref().unwrap_or(""))
                .cloned()
                .unwrap_or(Value::Null),
            None => value,
        };
    }
    match value {
        Value::Array(items) => {
            Value::Array(items.into_iter().map(|v| substitute(v, contents)).collect())
        }
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| (k, substitute(v, contents)))
                .collect(),
        ),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::FsStore;
    use crate::offload::offload;
    use serde_json::json;
    use sortie_core::blob::{project, BlobKey};

    fn store() -> (tempfile::TempDir, FsStore) {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = FsStore::open(dir.path()).expect("store");
        (dir, store)
    }

    #[tokio::test]
    async fn offloaded_values_resolve_to_themselves_and_paths_project() {
        let (_dir, store) = store();
        let value = json!({"doc": {"text": "y".repeat(5_000), "total": 42}, "n": 1});
        let carried = offload(&store, "acme", "run_1", value.clone(), 1_000)
            .await
            .expect("offload");
        assert_ne!(carried, value);
        assert_eq!(
            resolve(Some(&store), "acme", carried.clone()).await,
            Ok(value.clone())
        );
        let args = json!({
            "total": project(&carried, "doc.total"),
            "missing": project(&carried, "doc.nope"),
            "twice": [project(&carried, "doc"), project(&carried, "doc.text")],
        });
        let resolved = resolve(Some(&store), "acme", args).await.expect("resolve");
        assert_eq!(resolved["total"], json!(42));
        assert_eq!(resolved["missing"], Value::Null);
        assert_eq!(resolved["twice"][0], value["doc"]);
        // Plain values need no store.
        assert_eq!(
            resolve(None, "acme", json!({"a": 1})).await,
            Ok(json!({"a": 1}))
        );
    }

    #[tokio::test]
    async fn tampered_lost_foreign_and_unreachable_blobs_are_refused() {
        let (dir, store) = store();
        let carried = offload(&store, "acme", "run_1", json!("z".repeat(2_000)), 100)
            .await
            .expect("offload");
        let reference = BlobRef::from_value(&carried).expect("a reference");
        let key = reference.key().expect("key");
        let file = dir.path().join(key.as_str());

        // Same length, one byte changed: only the hash can tell.
        let mut bytes = std::fs::read(&file).expect("blob");
        bytes[10] = b'y';
        std::fs::write(&file, &bytes).expect("tamper");
        let err = resolve(Some(&store), "acme", carried.clone())
            .await
            .expect_err("refused");
        assert_eq!(err.code(), "blob_corrupt", "{err}");
        assert!(!err.is_retryable());

        bytes.push(b' ');
        std::fs::write(&file, &bytes).expect("truncate");
        let err = resolve(Some(&store), "acme", carried.clone())
            .await
            .expect_err("refused");
        assert_eq!(err.code(), "blob_corrupt", "{err}");

        std::fs::remove_file(&file).expect("lose");
        let err = resolve(Some(&store), "acme", carried.clone())
            .await
            .expect_err("refused");
        assert_eq!(err.code(), "blob_missing", "{err}");

        let err = resolve(Some(&store), "globex", carried.clone())
            .await
            .expect_err("refused");
        assert_eq!(err.code(), "blob_forbidden", "{err}");

        // A reference naming more than any service stores is refused before the fetch
        // (seen red with the cap skipped: the fetch ran and answered blob_missing).
        let mut huge = reference.clone();
        huge.size = MAX_BLOB_BYTES + 1;
        let err = fetch_verified(&store, &huge, "acme")
            .await
            .expect_err("refused");
        assert_eq!(err.code(), "blob_invalid_reference", "{err}");

        let err = resolve(None, "acme", carried.clone())
            .await
            .expect_err("refused");
        assert!(err.is_retryable(), "{err}");

        // A reference whose hash is not its URI's.
        let other = BlobKey::for_bytes("acme", "run_1", b"other");
        let mut forged = reference.clone();
        forged.uri = format!("sortie-blob:{other}");
        let err = resolve(Some(&store), "acme", forged.to_value())
            .await
            .expect_err("refused");
        assert_eq!(err.code(), "blob_invalid_reference", "{err}");
    }
}
