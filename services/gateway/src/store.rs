//! The gateway's own view store (sled): runs by id, events by (run id, seq), a tenant and a
//! tenant+status index for listing, and the next offset of every partition of run-state and
//! run-events. It is a cache of those topics: each write (a record's effect and the offset
//! after it) is one atomic sled batch, so after a crash the store is at most behind and
//! the view reads on from the offsets it holds.
//!
//! A store is trusted only with its marker (the topic prefix it was built from); without
//! it, or when it does not open, it is wiped and rebuilt from Kafka.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::path::Path;

use serde::{Deserialize, Serialize};
use sortie_core::{Event, EventBody, RunState, RunStatus};

const TREE: &str = "view";
const MARKER: &[u8] = b"m/identity";
const FORMAT: &str = "gateway-view-v1";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the view store failed: {0}")]
    Sled(#[from] sled::Error),
    #[error("the view store holds an undecodable value under {key}: {source}")]
    Corrupt {
        key: String,
        source: serde_json::Error,
    },
    #[error("cannot reset the view store at {path}: {source}")]
    Reset {
        path: String,
        source: std::io::Error,
    },
}

/// Which topic an offset belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    RunState,
    RunEvents,
}

impl Source {
    fn tag(self) -> &'static [u8] {
        match self {
            Source::RunState => b"o/s/",
            Source::RunEvents => b"o/e/",
        }
    }
}

/// A run as the view holds it: its state (folded from events, or the latest changelog
/// record, whichever is further along) and the newest changelog version seen, which tells
/// when every event of a version has been applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredRun {
    pub state: RunState,
    pub changelog_version: i64,
}

/// One atomic change: a record's effect and the offset after it.
#[derive(Debug, Default)]
pub struct Write {
    pub offset: Option<(Source, i32, i64)>,
    /// The run before (for the index) and after.
    pub run: Option<(Option<StoredRun>, StoredRun)>,
    pub events: Vec<Event>,
}

pub struct Store {
    db: sled::Db,
    tree: sled::Tree,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("entries", &self.tree.len())
            .finish_non_exhaustive()
    }
}

impl Store {
    /// Opens the store under `dir` for topics under `identity` (the prefix); wipes it when it
    /// cannot be opened or was built for something else.
    pub fn open(dir: &Path, identity: &str) -> Result<Store, Error> {
        let db = match sled::open(dir) {
            Ok(db) => db,
            Err(error) => {
                tracing::warn!(path = %dir.display(), %error, "The view store does not open; rebuilding it from Kafka.");
                std::fs::remove_dir_all(dir).map_err(|source| Error::Reset {
                    path: dir.display().to_string(),
                    source,
                })?;
                sled::open(dir)?
            }
        };
        let tree = db.open_tree(TREE)?;
        let marker = format!("{FORMAT} {identity}");
        if tree.get(MARKER)?.as_deref() != Some(marker.as_bytes()) {
            if !tree.is_empty() {
                tracing::warn!(path = %dir.display(), "The view store has no marker for these topics; rebuilding it from Kafka.");
            }
            tree.clear()?;
            tree.insert(MARKER, marker.as_bytes())?;
            tree.flush()?;
        }
        Ok(Store { db, tree })
    }

    /// The next offset to read of every partition of `source` that has been read.
    pub fn offsets(&self, source: Source) -> Result<BTreeMap<i32, i64>, Error> {
        let mut out = BTreeMap::new();
        for item in self.tree.scan_prefix(source.tag()) {
            let (key, value) = item?;
            let tail = &key[source.tag().len()..];
            if let (Ok(p), Ok(o)) = (<[u8; 4]>::try_from(tail), <[u8; 8]>::try_from(&*value)) {
                out.insert(i32::from_be_bytes(p), i64::from_be_bytes(o));
            }
        }
        Ok(out)
    }

    pub fn run(&self, run_id: &str) -> Result<Option<StoredRun>, Error> {
        let key = run_key(run_id);
        self.tree
            .get(&key)?
            .map(|bytes| decode(&key, &bytes))
            .transpose()
    }

    pub fn event(&self, run_id: &str, seq: i64) -> Result<Option<Event>, Error> {
        let key = event_key(run_id, seq);
        self.tree
            .get(&key)?
            .map(|bytes| decode(&key, &bytes))
            .transpose()
    }

    /// The runs forked from `run_id`: `{run_id, version, at}` each, by run id.
    pub fn forks(&self, run_id: &str) -> Result<Vec<serde_json::Value>, Error> {
        self.tree
            .scan_prefix(fork_prefix(run_id))
            .map(|item| {
                let (key, value) = item?;
                decode(&key, &value)
            })
            .collect()
    }

    /// Up to `limit` events of a run with `seq > after`, in order.
    pub fn events(&self, run_id: &str, after: i64, limit: usize) -> Result<Vec<Event>, Error> {
        let prefix = event_prefix(run_id);
        let start = event_key(run_id, after.saturating_add(1).max(0));
        let mut out = Vec::new();
        for item in self.tree.range(start..) {
            if out.len() >= limit {
                break;
            }
            let (key, value) = item?;
            if !key.starts_with(&prefix) {
                break;
            }
            out.push(decode(&key, &value)?);
        }
        Ok(out)
    }

    /// A tenant's runs in run id order after `after`, optionally of one status, that pass
    /// `keep`; at most `limit`.
    pub fn list(
        &self,
        tenant: &str,
        status: Option<RunStatus>,
        after: Option<&str>,
        limit: usize,
        keep: impl Fn(&StoredRun) -> bool,
    ) -> Result<Vec<StoredRun>, Error> {
        let prefix = match status {
            Some(status) => status_prefix(tenant, status),
            None => tenant_prefix(tenant),
        };
        let start = match after {
            Some(after) => Bound::Excluded([prefix.as_slice(), after.as_bytes()].concat()),
            None => Bound::Included(prefix.clone()),
        };
        let mut out = Vec::new();
        for item in self.tree.range::<Vec<u8>, _>((start, Bound::Unbounded)) {
            if out.len() >= limit {
                break;
            }
            let (key, _) = item?;
            if !key.starts_with(&prefix) {
                break;
            }
            let run_id = String::from_utf8_lossy(&key[prefix.len()..]).into_owned();
            if let Some(run) = self.run(&run_id)? {
                if run.state.tenant == tenant && keep(&run) {
                    out.push(run);
                }
            }
        }
        Ok(out)
    }

    /// Applies one change atomically.
    pub fn write(&self, write: Write) -> Result<(), Error> {
        let mut batch = sled::Batch::default();
        if let Some((source, partition, next)) = write.offset {
            batch.insert(
                [source.tag(), &partition.to_be_bytes()].concat(),
                &next.to_be_bytes(),
            );
        }
        // A forgotten run's events are kept without their payloads, like its state: the
        // ones already stored are rewritten, and those arriving with the news are too.
        let forgotten: Vec<&str> = write
            .events
            .iter()
            .filter(|e| matches!(e.body, EventBody::RunForgotten { .. }))
            .map(|e| e.run_id.as_str())
            .collect();
        for run_id in &forgotten {
            for item in self.tree.scan_prefix(event_prefix(run_id)) {
                let (key, bytes) = item?;
                let mut event: Event = decode(&key, &bytes)?;
                event.forget();
                batch.insert(key, encode(&event));
            }
        }
        for event in &write.events {
            if forgotten.contains(&event.run_id.as_str()) {
                let mut event = event.clone();
                event.forget();
                batch.insert(event_key(&event.run_id, event.seq), encode(&event));
                continue;
            }
            batch.insert(event_key(&event.run_id, event.seq), encode(event));
            // Lineage: a fork's first event names its source; index it under the source.
            if let EventBody::RunStarted {
                forked_from: Some(from),
                ..
            } = &event.body
            {
                if let (Some(source), Some(version)) =
                    (from["run_id"].as_str(), from["version"].as_i64())
                {
                    batch.insert(
                        [fork_prefix(source).as_slice(), event.run_id.as_bytes()].concat(),
                        encode(&serde_json::json!({"run_id": event.run_id, "version": version, "at": event.at})),
                    );
                }
            }
        }
        if let Some((before, after)) = &write.run {
            let state = &after.state;
            if let Some(before) = before {
                let old = &before.state;
                if old.tenant != state.tenant || old.status != state.status {
                    batch.remove(status_key(&old.tenant, old.status, &old.run_id));
                }
                if old.tenant != state.tenant {
                    batch.remove(
                        [tenant_prefix(&old.tenant), old.run_id.clone().into_bytes()].concat(),
                    );
                }
            }
            batch.insert(
                [
                    tenant_prefix(&state.tenant),
                    state.run_id.clone().into_bytes(),
                ]
                .concat(),
                &[],
            );
            batch.insert(status_key(&state.tenant, state.status, &state.run_id), &[]);
            batch.insert(run_key(&state.run_id), encode(after));
        }
        self.tree.apply_batch(batch)?;
        Ok(())
    }

    /// Forgets a run's payloads here and now (its data key was just destroyed by this
    /// gateway): its stored events and state drop them, as they will when the reducer's
    /// `RunForgotten` arrives, so no read of this gateway shows them after the delete.
    pub fn forget_run(&self, run_id: &str, at: i64, reason: &str) -> Result<(), Error> {
        let mut batch = sled::Batch::default();
        for item in self.tree.scan_prefix(event_prefix(run_id)) {
            let (key, bytes) = item?;
            let mut event: Event = decode(&key, &bytes)?;
            event.forget();
            batch.insert(key, encode(&event));
        }
        if let Some(mut run) = self.run(run_id)? {
            if run.state.forgotten.is_none() {
                run.state.forget(at, reason);
            }
            batch.insert(run_key(run_id), encode(&run));
        }
        self.tree.apply_batch(batch)?;
        Ok(())
    }

    pub async fn flush(&self) -> Result<(), Error> {
        self.db.flush_async().await?;
        Ok(())
    }
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_default()
}

fn decode<T: serde::de::DeserializeOwned>(key: &[u8], bytes: &[u8]) -> Result<T, Error> {
    serde_json::from_slice(bytes).map_err(|source| Error::Corrupt {
        key: String::from_utf8_lossy(key).into_owned(),
        source,
    })
}

fn run_key(run_id: &str) -> Vec<u8> {
    [b"r/".as_slice(), run_id.as_bytes()].concat()
}

fn fork_prefix(run_id: &str) -> Vec<u8> {
    [b"f/".as_slice(), run_id.as_bytes(), &[0]].concat()
}

fn event_prefix(run_id: &str) -> Vec<u8> {
    [b"e/".as_slice(), run_id.as_bytes(), &[0]].concat()
}

fn event_key(run_id: &str, seq: i64) -> Vec<u8> {
    [event_prefix(run_id).as_slice(), &seq.to_be_bytes()].concat()
}

fn tenant_prefix(tenant: &str) -> Vec<u8> {
    [b"t/".as_slice(), tenant.as_bytes(), &[0]].concat()
}

fn status_prefix(tenant: &str, status: RunStatus) -> Vec<u8> {
    [
        b"s/".as_slice(),
        tenant.as_bytes(),
        &[0],
        status.as_str().as_bytes(),
        &[0],
    ]
    .concat()
}

fn status_key(tenant: &str, status: RunStatus, run_id: &str) -> Vec<u8> {
    [status_prefix(tenant, status).as_slice(), run_id.as_bytes()].concat()
}

#[cfg(test)]
mod tests {
    use super::*;
    use sortie_core::EventBody;

    fn state(tenant: &str, run_id: &str, status: RunStatus) -> StoredRun {
        let event = Event {
            tenant: tenant.into(),
            run_id: run_id.into(),
            seq: 1,
            state_version: 1,
            at: 1,
            command_id: None,
            operation_id: None,
            prev_hash: None,
            hash: None,
            body: EventBody::RunStarted {
                graph_id: "g".into(),
                graph_version: 1,
                input: serde_json::json!({}),
                started_by: "me".into(),
                labels: Default::default(),
                budget: None,
                deadline_at: None,
                forked_from: None,
                rules: 0,
            },
        };
        let mut state = sortie_core::evolve(None, &event).expect("started");
        state.status = status;
        StoredRun {
            state,
            changelog_version: 0,
        }
    }

    #[test]
    fn runs_are_listed_per_tenant_and_status_and_the_index_follows_changes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path(), "p.").expect("open");
        let a = state("acme", "run_a", RunStatus::Running);
        let b = state("acme", "run_b", RunStatus::Running);
        let c = state("other", "run_c", RunStatus::Running);
        for run in [&a, &b, &c] {
            store
                .write(Write {
                    run: Some((None, run.clone())),
                    ..Write::default()
                })
                .expect("write");
        }
        let done = state("acme", "run_a", RunStatus::Succeeded);
        store
            .write(Write {
                offset: Some((Source::RunState, 2, 17)),
                run: Some((Some(a.clone()), done)),
                ..Write::default()
            })
            .expect("write");
        let ids = |runs: Vec<StoredRun>| -> Vec<String> {
            runs.into_iter().map(|r| r.state.run_id).collect()
        };
        let all = store.list("acme", None, None, 10, |_| true).expect("list");
        assert_eq!(ids(all), vec!["run_a", "run_b"]);
        let running = store
            .list("acme", Some(RunStatus::Running), None, 10, |_| true)
            .expect("list");
        assert_eq!(ids(running), vec!["run_b"]);
        let after = store
            .list("acme", None, Some("run_a"), 10, |_| true)
            .expect("list");
        assert_eq!(ids(after), vec!["run_b"]);
        assert_eq!(
            store.offsets(Source::RunState).expect("offsets"),
            BTreeMap::from([(2, 17)])
        );
        assert!(store
            .offsets(Source::RunEvents)
            .expect("offsets")
            .is_empty());
        drop(store);
        let again = Store::open(dir.path(), "p.").expect("reopen");
        assert!(
            again.run("run_c").expect("read").is_some(),
            "kept with its marker"
        );
        drop(again);
        let other = Store::open(dir.path(), "q.").expect("reopen for other topics");
        assert!(
            other.run("run_c").expect("read").is_none(),
            "wiped without its marker"
        );
    }
}
