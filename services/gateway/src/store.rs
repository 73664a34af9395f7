//! The gateway's own view store (sled): runs by id, events by (run id, seq), a tenant and a
//! tenant+status index for listing, the inbox index (a tenant's open interrupts in the
//! order they opened, with what the inbox shows), and the next offset of every partition
//! of run-state and run-events. It is a cache of those topics: each write (a record's effect and the offset
//! after it) is one atomic sled batch, so after a crash the store is at most behind and
//! the view reads on from the offsets it holds.
//!
//! A store is trusted only with its marker (the topic prefix it was built from); without
//! it, or when it does not open, it is wiped and rebuilt from Kafka.
//!
//! Nothing is written that cannot be read back ([`MAX_DEPTH`]). What still cannot be read
//! (a value written by an older build, a damaged entry) or written is an error of that one
//! run ([`Error::run_scoped`]): the view quarantines the run (`q/<run_id>`, with the
//! reason) and serves every other; only an error of the store as a whole stops it.

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::path::Path;

use serde::{Deserialize, Serialize};
use sortie_core::state::Interrupt;
use sortie_core::{Event, EventBody, RunState, RunStatus};

const TREE: &str = "view";
const MARKER: &[u8] = b"m/identity";
/// v2: the inbox index; a store of v1 has none, so it is rebuilt from Kafka.
const FORMAT: &str = "gateway-view-v2";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the view store failed: {0}")]
    Sled(#[from] sled::Error),
    #[error("the view store holds an undecodable value under {key}: {source}")]
    Corrupt {
        key: String,
        source: serde_json::Error,
    },
    #[error("the value for {key} nests {depth} levels deep; the view stores at most {MAX_DEPTH}")]
    TooDeep { key: String, depth: usize },
    #[error("cannot reset the view store at {path}: {source}")]
    Reset {
        path: String,
        source: std::io::Error,
    },
}

impl Error {
    /// Whether the error is about one value (one run's) rather than the store as a whole:
    /// the view sets that run aside and goes on.
    pub fn run_scoped(&self) -> bool {
        matches!(self, Error::Corrupt { .. } | Error::TooDeep { .. })
    }
}

/// The deepest JSON document the store writes. serde_json reads 127 levels back; an answer
/// wraps what is stored in at most two more (an events page: an object and an array), and
/// a client may wrap it again. The fold writes at most
/// [`sortie_core::limits::MAX_STORED_DEPTH`] (a stored run adds one level), so only a
/// record the reducer did not write comes near this.
pub const MAX_DEPTH: usize = 120;

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

/// An open interrupt as the inbox lists it: kept by the view as it writes the run, so the
/// inbox reads one entry per item it shows ([`Store::inbox`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InboxEntry {
    pub tenant: String,
    pub run_id: String,
    pub graph_id: String,
    pub graph_version: u32,
    pub run_status: RunStatus,
    pub interrupt: Interrupt,
    /// When the interrupt opened: its first `Interrupted` event's time, else (the view
    /// has not seen that event, e.g. the changelog came first) the run's last update.
    pub opened_at: i64,
}

/// Runs whose open interrupts the inbox lists: one waiting for approval, or one still
/// running other work with an interrupt open.
fn in_inbox(state: &RunState) -> bool {
    matches!(
        state.status,
        RunStatus::WaitingApproval | RunStatus::Running
    )
}

/// A run the view set aside: it could not read, fold or store it. Kept (`q/<run_id>`) so a
/// restart does not trip over it again; reads of the run answer `run_unreadable`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Quarantine {
    pub run_id: String,
    /// The tenant of the record that could not be applied: reads by another tenant stay 404.
    pub tenant: String,
    pub reason: String,
    /// When (epoch ms) and at which record (`run-events p2:o1534`).
    pub at: i64,
    pub record: String,
}

/// One atomic change: a record's effect and the offset after it.
#[derive(Debug, Default)]
pub struct Write {
    pub offset: Option<(Source, i32, i64)>,
    /// The run before (for the index) and after.
    pub run: Option<(Option<StoredRun>, StoredRun)>,
    pub events: Vec<Event>,
    /// Sets the run aside: its state is dropped (so no list or read shows a stale one) and
    /// nothing more of it is written.
    pub quarantine: Option<Quarantine>,
}

impl Write {
    /// Only the offset moves on: `(source, partition, next offset)`.
    pub fn offset(next: (Source, i32, i64)) -> Write {
        Write {
            offset: Some(next),
            ..Write::default()
        }
    }
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

    /// Why the view set `run_id` aside, if it did.
    pub fn quarantined(&self, run_id: &str) -> Result<Option<Quarantine>, Error> {
        let key = quarantine_key(run_id);
        self.tree
            .get(&key)?
            .map(|bytes| decode(&key, &bytes))
            .transpose()
    }

    /// How many runs are set aside.
    pub fn quarantine_count(&self) -> usize {
        self.tree.scan_prefix(b"q/").count()
    }

    /// Whether `run_id` is listed under `tenant` (its state need not be readable).
    pub fn listed(&self, tenant: &str, run_id: &str) -> Result<bool, Error> {
        Ok(self
            .tree
            .contains_key([tenant_prefix(tenant), run_id.as_bytes().to_vec()].concat())?)
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
            // A quarantined run has no state here; one that does not read is left out
            // (its own reads say why).
            let run = match self.run(&run_id) {
                Err(error) if error.run_scoped() => continue,
                run => run?,
            };
            if let Some(run) = run {
                if run.state.tenant == tenant && keep(&run) {
                    out.push(run);
                }
            }
        }
        Ok(out)
    }

    /// Up to `limit` of `tenant`'s open interrupts, oldest first (by when they opened, then
    /// interrupt id). Reads `limit` entries, whatever the number of runs.
    pub fn inbox(&self, tenant: &str, limit: usize) -> Result<Vec<InboxEntry>, Error> {
        let mut out = Vec::new();
        for item in self.tree.scan_prefix(inbox_prefix(tenant)).take(limit) {
            let (key, value) = item?;
            out.push(decode(&key, &value)?);
        }
        Ok(out)
    }

    /// Puts the inbox entries of `state` in place of the run's current ones: removes what
    /// the run had, adds its open interrupts if the inbox lists it. `opened` holds the
    /// opening times this write records.
    fn index_inbox(
        &self,
        batch: &mut sled::Batch,
        run_id: &str,
        state: Option<&RunState>,
        opened: &HashMap<(String, String), i64>,
    ) -> Result<(), Error> {
        for item in self.tree.scan_prefix(listed_prefix(run_id)) {
            let (listed, key) = item?;
            batch.remove(key);
            batch.remove(listed);
        }
        let Some(state) = state.filter(|s| in_inbox(s)) else {
            return Ok(());
        };
        for interrupt in state.open_interrupts() {
            let id = &interrupt.interrupt_id;
            let opened_at = match opened.get(&(run_id.to_owned(), id.clone())) {
                Some(at) => *at,
                None => self
                    .tree
                    .get(opened_key(run_id, id))?
                    .and_then(|v| <[u8; 8]>::try_from(&*v).ok())
                    .map_or(state.updated_at, i64::from_be_bytes),
            };
            let entry = InboxEntry {
                tenant: state.tenant.clone(),
                run_id: run_id.to_owned(),
                graph_id: state.graph_id.clone(),
                graph_version: state.graph_version,
                run_status: state.status,
                interrupt: interrupt.clone(),
                opened_at,
            };
            let key = inbox_key(&state.tenant, opened_at, id, run_id);
            batch.insert(key.clone(), encode(&key, &entry)?);
            batch.insert(listed_key(run_id, id), key);
        }
        Ok(())
    }

    /// An entry listed before its `Interrupted` event was seen (at the run's last update)
    /// moves to when the interrupt opened.
    fn reopen_inbox(
        &self,
        batch: &mut sled::Batch,
        run_id: &str,
        interrupt_id: &str,
        opened_at: i64,
    ) -> Result<(), Error> {
        let Some(old) = self.tree.get(listed_key(run_id, interrupt_id))? else {
            return Ok(());
        };
        let Some(value) = self.tree.get(&old)? else {
            return Ok(());
        };
        let mut entry: InboxEntry = decode(&old, &value)?;
        if entry.opened_at == opened_at {
            return Ok(());
        }
        entry.opened_at = opened_at;
        let key = inbox_key(&entry.tenant, opened_at, interrupt_id, run_id);
        batch.remove(old);
        batch.insert(key.clone(), encode(&key, &entry)?);
        batch.insert(listed_key(run_id, interrupt_id), key);
        Ok(())
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
                let value = encode(&key, &event)?;
                batch.insert(key, value);
            }
        }
        // When interrupts opened: the first `Interrupted` event of each, kept for the inbox.
        let mut opened = HashMap::new();
        for event in &write.events {
            if let EventBody::Interrupted { interrupt_id, .. } = &event.body {
                let id = (event.run_id.clone(), interrupt_id.clone());
                let key = opened_key(&event.run_id, interrupt_id);
                if !opened.contains_key(&id) && !self.tree.contains_key(&key)? {
                    batch.insert(key, &event.at.to_be_bytes());
                    opened.insert(id, event.at);
                }
            }
        }
        for event in &write.events {
            let key = event_key(&event.run_id, event.seq);
            if forgotten.contains(&event.run_id.as_str()) {
                let mut event = event.clone();
                event.forget();
                batch.insert(key.clone(), encode(&key, &event)?);
                continue;
            }
            batch.insert(key.clone(), encode(&key, event)?);
            // Lineage: a fork's first event names its source; index it under the source.
            if let EventBody::RunStarted {
                forked_from: Some(from),
                ..
            } = &event.body
            {
                if let (Some(source), Some(version)) =
                    (from["run_id"].as_str(), from["version"].as_i64())
                {
                    let key = [fork_prefix(source).as_slice(), event.run_id.as_bytes()].concat();
                    let lineage = serde_json::json!({"run_id": event.run_id, "version": version, "at": event.at});
                    batch.insert(key.clone(), encode(&key, &lineage)?);
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
            let key = run_key(&state.run_id);
            batch.insert(key.clone(), encode(&key, after)?);
            self.index_inbox(&mut batch, &state.run_id, Some(state), &opened)?;
        } else {
            for ((run_id, interrupt_id), at) in &opened {
                self.reopen_inbox(&mut batch, run_id, interrupt_id, *at)?;
            }
        }
        if let Some(quarantine) = &write.quarantine {
            let key = quarantine_key(&quarantine.run_id);
            batch.insert(key.clone(), encode(&key, quarantine)?);
            batch.remove(run_key(&quarantine.run_id));
            self.index_inbox(&mut batch, &quarantine.run_id, None, &opened)?;
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
            let value = encode(&key, &event)?;
            batch.insert(key, value);
        }
        if let Some(mut run) = self.run(run_id)? {
            if run.state.forgotten.is_none() {
                run.state.forget(at, reason);
            }
            let key = run_key(run_id);
            batch.insert(key.clone(), encode(&key, &run)?);
        }
        self.tree.apply_batch(batch)?;
        Ok(())
    }

    pub async fn flush(&self) -> Result<(), Error> {
        self.db.flush_async().await?;
        Ok(())
    }
}

/// `value`'s JSON, if it reads back: at most [`MAX_DEPTH`] levels deep.
fn encode<T: Serialize>(key: &[u8], value: &T) -> Result<Vec<u8>, Error> {
    let bytes = serde_json::to_vec(value).map_err(|source| Error::Corrupt {
        key: key.escape_ascii().to_string(),
        source,
    })?;
    let depth = depth(&bytes);
    if depth > MAX_DEPTH {
        return Err(Error::TooDeep {
            key: key.escape_ascii().to_string(),
            depth,
        });
    }
    Ok(bytes)
}

/// How deep the containers of a JSON text nest (brackets inside strings do not count).
fn depth(json: &[u8]) -> usize {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for &b in json {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

fn decode<T: serde::de::DeserializeOwned>(key: &[u8], bytes: &[u8]) -> Result<T, Error> {
    serde_json::from_slice(bytes).map_err(|source| Error::Corrupt {
        key: key.escape_ascii().to_string(),
        source,
    })
}

/// `i/<tenant>\0<opened_at><interrupt_id>\0<run_id>`: in the order the inbox lists.
/// The time's sign bit is flipped so that byte order is numeric order.
fn inbox_key(tenant: &str, opened_at: i64, interrupt_id: &str, run_id: &str) -> Vec<u8> {
    let at = (opened_at as u64) ^ (1 << 63);
    [
        inbox_prefix(tenant).as_slice(),
        &at.to_be_bytes(),
        interrupt_id.as_bytes(),
        &[0],
        run_id.as_bytes(),
    ]
    .concat()
}

fn inbox_prefix(tenant: &str) -> Vec<u8> {
    [b"i/".as_slice(), tenant.as_bytes(), &[0]].concat()
}

/// `x/<run_id>\0<interrupt_id>` → the interrupt's inbox key, to take it out again.
fn listed_key(run_id: &str, interrupt_id: &str) -> Vec<u8> {
    [listed_prefix(run_id).as_slice(), interrupt_id.as_bytes()].concat()
}

fn listed_prefix(run_id: &str) -> Vec<u8> {
    [b"x/".as_slice(), run_id.as_bytes(), &[0]].concat()
}

/// `n/<run_id>\0<interrupt_id>` → when the interrupt opened (epoch ms, big-endian).
fn opened_key(run_id: &str, interrupt_id: &str) -> Vec<u8> {
    [
        b"n/".as_slice(),
        run_id.as_bytes(),
        &[0],
        interrupt_id.as_bytes(),
    ]
    .concat()
}

fn quarantine_key(run_id: &str) -> Vec<u8> {
    [b"q/".as_slice(), run_id.as_bytes()].concat()
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
                parent: None,
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

    fn nested(depth: usize) -> serde_json::Value {
        let mut value = serde_json::json!(1);
        for _ in 0..depth {
            value = serde_json::json!({ "a": value });
        }
        value
    }

    #[test]
    fn what_would_not_read_back_is_not_written_and_is_the_runs_own_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path(), "p.").expect("open");
        let mut deep = state("acme", "deep", RunStatus::Running);
        deep.state.input = nested(MAX_DEPTH);
        let refused = store
            .write(Write {
                run: Some((None, deep)),
                ..Write::default()
            })
            .expect_err("too deep");
        assert!(matches!(refused, Error::TooDeep { .. }), "{refused}");
        assert!(refused.run_scoped());
        assert!(
            store.run("deep").expect("read").is_none(),
            "nothing written"
        );
        assert_eq!(depth(br#"{"a": ["[{", {"b": "\"}"}]}"#), 3);

        // A value that does not read (written by an older build, or damaged) is that
        // run's error; a list of its tenant leaves it out and lists the others.
        let good = state("acme", "good", RunStatus::Running);
        let bad = state("acme", "bad", RunStatus::Running);
        for run in [&good, &bad] {
            store
                .write(Write {
                    run: Some((None, run.clone())),
                    ..Write::default()
                })
                .expect("write");
        }
        store
            .tree
            .insert(run_key("bad"), b"{\"state\": [".as_slice())
            .expect("damage");
        let unreadable = store.run("bad").expect_err("does not read");
        assert!(unreadable.run_scoped(), "{unreadable}");
        assert!(store.listed("acme", "bad").expect("index"));
        assert!(!store.listed("other", "bad").expect("index"));
        let listed = store.list("acme", None, None, 10, |_| true).expect("list");
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].state.run_id, "good");

        // Quarantined: kept with its reason, its state dropped.
        let quarantine = Quarantine {
            run_id: "bad".into(),
            tenant: "acme".into(),
            reason: unreadable.to_string(),
            at: 1,
            record: "run-events p0:o7".into(),
        };
        store
            .write(Write {
                quarantine: Some(quarantine.clone()),
                ..Write::offset((Source::RunEvents, 0, 8))
            })
            .expect("quarantine");
        assert_eq!(store.quarantined("bad").expect("read"), Some(quarantine));
        assert_eq!(store.quarantine_count(), 1);
        assert!(store.run("bad").expect("no state").is_none());
        assert_eq!(
            store.offsets(Source::RunEvents).expect("offsets"),
            BTreeMap::from([(0, 8)])
        );
    }

    /// `run` with an interrupt `id` in `status`.
    fn with_interrupt(
        mut run: StoredRun,
        id: &str,
        status: sortie_core::state::InterruptStatus,
    ) -> StoredRun {
        let interrupt = sortie_core::state::Interrupt {
            interrupt_id: id.into(),
            step_id: format!("step-{id}"),
            node: "refund".into(),
            role: sortie_core::event::StepRole::Node,
            proposal: serde_json::json!({"args": {"amount": 5}}),
            proposal_hash: "h".into(),
            reason: "refunds need a human".into(),
            required_role: Some("approver".into()),
            approver_group: None,
            quorum: 1,
            expires_at: None,
            round: 0,
            approvals: vec![],
            status,
            context: None,
            members_only: false,
            payload: None,
            edited_args: None,
        };
        run.state.interrupts.insert(id.into(), interrupt);
        run
    }

    fn interrupted(run_id: &str, interrupt_id: &str, seq: i64, at: i64) -> Event {
        Event {
            tenant: "acme".into(),
            run_id: run_id.into(),
            seq,
            state_version: seq,
            at,
            command_id: None,
            operation_id: None,
            prev_hash: None,
            hash: None,
            body: EventBody::Interrupted {
                interrupt_id: interrupt_id.into(),
                step_id: format!("step-{interrupt_id}"),
                node: "refund".into(),
                proposal: serde_json::json!({}),
                proposal_hash: "h".into(),
                reason: "r".into(),
                required_role: None,
                approver_group: None,
                quorum: 1,
                expires_at: None,
                role: sortie_core::event::StepRole::Node,
                context: None,
                members_only: false,
            },
        }
    }

    #[test]
    fn the_inbox_index_lists_open_interrupts_in_the_order_they_opened_and_follows_changes() {
        use sortie_core::state::InterruptStatus::{Approved, Open};
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path(), "p.").expect("open");
        let listed = |tenant: &str, limit: usize| -> Vec<(String, i64)> {
            store
                .inbox(tenant, limit)
                .expect("inbox")
                .into_iter()
                .map(|e| (e.run_id, e.opened_at))
                .collect()
        };
        // Run a: its interrupt opens with its event (at 50).
        let mut a = with_interrupt(state("acme", "a", RunStatus::Running), "ia", Open);
        a.state.status = RunStatus::WaitingApproval;
        a.state.updated_at = 60;
        store
            .write(Write {
                run: Some((None, a.clone())),
                events: vec![interrupted("a", "ia", 2, 50)],
                ..Write::default()
            })
            .expect("write a");
        // Run b: its changelog record comes first (listed at its last update, 100), its
        // event later (at 10): it moves ahead of a.
        let mut b = with_interrupt(state("acme", "b", RunStatus::Running), "ib", Open);
        b.state.updated_at = 100;
        store
            .write(Write {
                run: Some((None, b.clone())),
                ..Write::default()
            })
            .expect("write b");
        assert_eq!(
            listed("acme", 10),
            vec![("a".into(), 50), ("b".into(), 100)]
        );
        store
            .write(Write {
                events: vec![interrupted("b", "ib", 2, 10)],
                ..Write::default()
            })
            .expect("b's event");
        assert_eq!(listed("acme", 10), vec![("b".into(), 10), ("a".into(), 50)]);
        assert_eq!(
            listed("acme", 1),
            vec![("b".into(), 10)],
            "a page reads its size"
        );
        assert!(listed("other", 10).is_empty());

        // Decided: out of the inbox; a run that ends takes its interrupts along.
        let decided = with_interrupt(a.clone(), "ia", Approved);
        store
            .write(Write {
                run: Some((Some(a), decided)),
                ..Write::default()
            })
            .expect("decide a");
        assert_eq!(listed("acme", 10), vec![("b".into(), 10)]);
        let mut ended = b.clone();
        ended.state.status = RunStatus::Cancelled;
        store
            .write(Write {
                run: Some((Some(b.clone()), ended)),
                ..Write::default()
            })
            .expect("end b");
        assert!(listed("acme", 10).is_empty());

        // A quarantined run leaves the inbox.
        store
            .write(Write {
                run: Some((None, b)),
                ..Write::default()
            })
            .expect("b again");
        assert_eq!(listed("acme", 10).len(), 1);
        store
            .write(Write {
                quarantine: Some(Quarantine {
                    run_id: "b".into(),
                    tenant: "acme".into(),
                    reason: "r".into(),
                    at: 1,
                    record: "run-events p0:o1".into(),
                }),
                ..Write::default()
            })
            .expect("quarantine b");
        assert!(listed("acme", 10).is_empty());
    }
}
