//! The run keys: each run's data key, wrapped, in a key store — and its destruction.
//!
//! A run's entry is one object, `runs/<sha256(tenant ‖ 0 ‖ run_id)>` (fixed-length, so any
//! tenant or run id is a valid name), holding JSON:
//! `{"v":1,"tenant","run_id","kek","dek"}` while the key lives, and
//! `{"v":1,"tenant","run_id","destroyed_at"}` once destroyed. It is created with a
//! create-if-absent write, so of a gateway and a reducer (or a fenced zombie) making the
//! same run's key at once, exactly one key wins and everyone uses it; destroying
//! overwrites the wrapped key with the marker, so it can never be made again for that
//! run id either.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sha2::Digest as _;
use sortie_blob::BlobStore;

use crate::kek::{Kek, Wrapped};
use crate::seal::{RunKey, RunSeal};
use crate::Error;

/// What the key store holds for a run.
#[derive(Debug, Clone)]
pub enum Lookup {
    /// Its data key.
    Key(Arc<RunKey>),
    /// Nothing: the run has no key (started while encryption was off, or not started).
    Missing,
    /// Its key was destroyed at this time (epoch ms).
    Destroyed { at: i64 },
}

#[derive(Debug, Serialize, Deserialize)]
struct Entry {
    v: u32,
    tenant: String,
    run_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    kek: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    dek: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    destroyed_at: Option<i64>,
}

/// A run key made by [`RunKeys::prepare`], not stored yet.
#[derive(Debug, Clone)]
pub struct PendingKey {
    pub tenant: String,
    pub run_id: String,
    entry: Vec<u8>,
    pub key: Arc<RunKey>,
}

/// The run keys of one service: the key store, the KEKs, and a short cache.
#[derive(Debug, Clone)]
pub struct RunKeys {
    kek: Arc<dyn Kek>,
    store: Arc<dyn BlobStore>,
    ttl: Duration,
    cache: Arc<Mutex<Cache>>,
}

/// (tenant, run id) → what the store said, and when.
type Cache = HashMap<(String, String), (Lookup, Instant)>;

/// Past this many cached runs the cache starts over (it is a cache, not a table).
const CACHE_RUNS: usize = 100_000;

impl RunKeys {
    pub fn new(kek: Arc<dyn Kek>, store: Arc<dyn BlobStore>, ttl: Duration) -> RunKeys {
        RunKeys {
            kek,
            store,
            ttl,
            cache: Arc::default(),
        }
    }

    /// Where the wrapped keys are, for logs.
    pub fn location(&self) -> String {
        self.store.location()
    }

    fn name(tenant: &str, run_id: &str) -> String {
        let mut hash = sha2::Sha256::new();
        hash.update(tenant.as_bytes());
        hash.update([0]);
        hash.update(run_id.as_bytes());
        format!("runs/{}", sortie_core::json::hex(&hash.finalize()))
    }

    fn aad(tenant: &str, run_id: &str) -> Vec<u8> {
        let mut aad = b"sortie-dek/v1\0".to_vec();
        aad.extend_from_slice(tenant.as_bytes());
        aad.push(0);
        aad.extend_from_slice(run_id.as_bytes());
        aad
    }

    fn cached(&self, tenant: &str, run_id: &str) -> Option<Lookup> {
        let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        let (lookup, at) = cache.get(&(tenant.to_owned(), run_id.to_owned()))?;
        (at.elapsed() < self.ttl).then(|| lookup.clone())
    }

    fn remember(&self, tenant: &str, run_id: &str, lookup: &Lookup) {
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if cache.len() >= CACHE_RUNS {
            cache.clear();
        }
        cache.insert(
            (tenant.to_owned(), run_id.to_owned()),
            (lookup.clone(), Instant::now()),
        );
    }

    /// Forgets the cached key of a run (its key was destroyed elsewhere).
    pub fn evict(&self, tenant: &str, run_id: &str) {
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        cache.remove(&(tenant.to_owned(), run_id.to_owned()));
    }

    fn decode(&self, tenant: &str, run_id: &str, bytes: &[u8]) -> Result<Lookup, Error> {
        let unwrap = |reason: String| Error::Unwrap {
            tenant: tenant.to_owned(),
            run_id: run_id.to_owned(),
            reason,
        };
        let entry: Entry = serde_json::from_slice(bytes).map_err(|e| unwrap(e.to_string()))?;
        if entry.tenant != tenant || entry.run_id != run_id {
            return Err(unwrap("the entry names another run".into()));
        }
        if let Some(at) = entry.destroyed_at {
            return Ok(Lookup::Destroyed { at });
        }
        let (Some(kek), Some(dek)) = (entry.kek, entry.dek) else {
            return Err(unwrap("the entry holds no key".into()));
        };
        let dek = self
            .kek
            .unwrap(tenant, &Self::aad(tenant, run_id), &Wrapped { kek, dek })
            .map_err(unwrap)?;
        Ok(Lookup::Key(Arc::new(RunKey::from_dek(&dek))))
    }

    /// The run's key as the store has it now (cached for the TTL).
    pub async fn get(&self, tenant: &str, run_id: &str) -> Result<Lookup, Error> {
        if let Some(lookup) = self.cached(tenant, run_id) {
            return Ok(lookup);
        }
        let lookup = match self.store.get(&Self::name(tenant, run_id)).await {
            Ok(bytes) => self.decode(tenant, run_id, &bytes)?,
            Err(sortie_blob::Error::NotFound(_)) => Lookup::Missing,
            Err(e) => return Err(e.into()),
        };
        self.remember(tenant, run_id, &lookup);
        Ok(lookup)
    }

    /// The run's key, made now if it has none: of writers racing, one key wins. A
    /// destroyed key stays destroyed.
    pub async fn get_or_create(&self, tenant: &str, run_id: &str) -> Result<Lookup, Error> {
        match self.get(tenant, run_id).await? {
            Lookup::Missing => {}
            found => return Ok(found),
        }
        let pending = self.prepare(tenant, run_id)?;
        let name = Self::name(tenant, run_id);
        match self.store.put_new(&name, pending.entry).await {
            Ok(()) => {
                let lookup = Lookup::Key(pending.key);
                self.remember(tenant, run_id, &lookup);
                Ok(lookup)
            }
            Err(sortie_blob::Error::Exists(_)) => {
                // Someone else made it first: theirs is the run's key.
                self.evict(tenant, run_id);
                self.get(tenant, run_id).await
            }
            Err(e) => Err(e.into()),
        }
    }

    /// A new key for a run the store has none for, made in memory only: usable at once,
    /// stored by [`RunKeys::persist`] — the reducer's group commit, so a batch of new
    /// runs costs one store flush instead of one durable write each. Nothing sealed with
    /// it may become visible before `persist` succeeded.
    pub fn prepare(&self, tenant: &str, run_id: &str) -> Result<PendingKey, Error> {
        let mut dek = [0u8; 32];
        getrandom::fill(&mut dek).map_err(|e| Error::Keyring(format!("randomness: {e}")))?;
        let wrapped = self.kek.wrap(tenant, &Self::aad(tenant, run_id), &dek)?;
        let entry = Entry {
            v: 1,
            tenant: tenant.to_owned(),
            run_id: run_id.to_owned(),
            kek: Some(wrapped.kek),
            dek: Some(wrapped.dek),
            destroyed_at: None,
        };
        Ok(PendingKey {
            tenant: tenant.to_owned(),
            run_id: run_id.to_owned(),
            entry: serde_json::to_vec(&entry).expect("an entry serialises"),
            key: Arc::new(RunKey::from_dek(&dek)),
        })
    }

    /// Stores prepared keys, each only if its run has none yet, all durable on return.
    /// [`Error::Raced`] if any run got another key meanwhile (a gateway, a fenced zombie):
    /// what was sealed with the prepared one must be thrown away and sealed again.
    pub async fn persist(&self, keys: &[PendingKey]) -> Result<(), Error> {
        if keys.is_empty() {
            return Ok(());
        }
        let items = keys
            .iter()
            .map(|k| (Self::name(&k.tenant, &k.run_id), k.entry.clone()))
            .collect();
        let results = self.store.put_new_many(items).await;
        let mut raced = None;
        for (key, result) in keys.iter().zip(results) {
            match result {
                Ok(()) => self.remember(&key.tenant, &key.run_id, &Lookup::Key(key.key.clone())),
                Err(sortie_blob::Error::Exists(_)) => {
                    self.evict(&key.tenant, &key.run_id);
                    raced = Some(key.run_id.clone());
                }
                Err(e) => return Err(e.into()),
            }
        }
        match raced {
            Some(run_id) => Err(Error::Raced { run_id }),
            None => Ok(()),
        }
    }

    /// Destroys the run's key (crypto-shredding): its wrapped copy is overwritten with a
    /// marker, and no key can be made for the run again. Idempotent.
    pub async fn destroy(&self, tenant: &str, run_id: &str, at: i64) -> Result<(), Error> {
        let entry = Entry {
            v: 1,
            tenant: tenant.to_owned(),
            run_id: run_id.to_owned(),
            kek: None,
            dek: None,
            destroyed_at: Some(at),
        };
        let bytes = serde_json::to_vec(&entry).expect("an entry serialises");
        self.store.put(&Self::name(tenant, run_id), bytes).await?;
        self.remember(tenant, run_id, &Lookup::Destroyed { at });
        tracing::info!(tenant, run_id, "Run data key destroyed.");
        Ok(())
    }

    /// How `run_id`'s payloads are sealed, from a lookup.
    pub fn seal_of(run_id: &str, lookup: &Lookup) -> RunSeal {
        match lookup {
            Lookup::Key(key) => RunSeal::Key {
                run_id: run_id.to_owned(),
                key: key.clone(),
            },
            Lookup::Missing => RunSeal::Plain,
            Lookup::Destroyed { .. } => RunSeal::Destroyed {
                run_id: run_id.to_owned(),
            },
        }
    }

    /// The run's seal as the store has it now.
    pub async fn seal(&self, tenant: &str, run_id: &str) -> Result<RunSeal, Error> {
        Ok(Self::seal_of(run_id, &self.get(tenant, run_id).await?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kek::Keyring;
    use serde_json::json;
    use sortie_core::Seal as _;

    fn keys(dir: &std::path::Path, ttl: Duration) -> RunKeys {
        let ring = Keyring::parse(&Keyring::generate("*", "k1").expect("test")).expect("test");
        let store = sortie_blob::fs::FsStore::open(dir).expect("test");
        RunKeys::new(Arc::new(ring), Arc::new(store), ttl)
    }

    #[tokio::test]
    async fn racing_creators_share_one_key_and_a_destroyed_key_is_never_made_again() {
        let dir = tempfile::tempdir().expect("test");
        let a = keys(dir.path(), Duration::ZERO);
        let b = RunKeys {
            cache: Arc::default(),
            ..a.clone()
        };
        let (ka, kb) = tokio::join!(a.get_or_create("t", "r"), b.get_or_create("t", "r"));
        let (sa, sb) = (
            RunKeys::seal_of("r", &ka.expect("test")),
            RunKeys::seal_of("r", &kb.expect("test")),
        );
        let sealed = sa.seal(&json!({"x": 1}));
        assert_eq!(sealed, sb.seal(&json!({"x": 1})), "one key for the run");
        assert!(matches!(
            a.get("t", "other").await.expect("test"),
            Lookup::Missing
        ));
        assert!(
            matches!(a.get("u", "r").await.expect("test"), Lookup::Missing),
            "per tenant"
        );

        b.destroy("t", "r", 9).await.expect("test");
        let after = a.get("t", "r").await.expect("test");
        assert!(matches!(after, Lookup::Destroyed { at: 9 }));
        let mut opened = sealed;
        RunKeys::seal_of("r", &after)
            .open(&mut opened)
            .expect("test");
        assert_eq!(opened, serde_json::Value::Null, "the payload is gone");
        assert!(matches!(
            a.get_or_create("t", "r").await.expect("test"),
            Lookup::Destroyed { .. }
        ));
        // A prepared key is usable before it is stored, and loses to a key made meanwhile.
        let pending = a.prepare("t", "late").expect("prepared");
        let pending_seal = RunKeys::seal_of("late", &Lookup::Key(pending.key.clone()));
        let made = b.get_or_create("t", "late").await.expect("made");
        assert!(matches!(
            a.persist(std::slice::from_ref(&pending)).await,
            Err(Error::Raced { .. })
        ));
        let winner = RunKeys::seal_of("late", &a.get("t", "late").await.expect("stored"));
        assert_eq!(
            winner.seal(&json!(1)),
            RunKeys::seal_of("late", &made).seal(&json!(1)),
            "the stored key is the one made first"
        );
        assert_ne!(winner.seal(&json!(1)), pending_seal.seal(&json!(1)));
        // Prepared keys of new runs are stored together and found afterwards.
        let fresh = [
            a.prepare("t", "n1").expect("n1"),
            a.prepare("t", "n2").expect("n2"),
        ];
        a.persist(&fresh).await.expect("stored");
        for k in &fresh {
            let found = b.get("t", &k.run_id).await.expect("found");
            assert_eq!(
                RunKeys::seal_of(&k.run_id, &found).seal(&json!(2)),
                RunKeys::seal_of(&k.run_id, &Lookup::Key(k.key.clone())).seal(&json!(2))
            );
        }
        // Nothing of the key is left in the store.
        let name = RunKeys::name("t", "r");
        let left = std::fs::read_to_string(dir.path().join(name)).expect("test");
        assert!(!left.contains("dek"), "{left}");
    }
}
