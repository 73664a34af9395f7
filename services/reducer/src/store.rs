//! The reducer's local sled cache: run states, the timer index by due time, and the
//! `sortie.run-state` changelog offset each partition's cached state reflects.
//!
//! Kafka is the truth; this store is a cache with a marker (SPEC §13). Everything lives
//! in sled's default tree under key prefixes, so one committed batch (states, timers and
//! the changelog offset they reflect) is written with ONE atomic `apply_batch`:
//!
//! ```text
//! r/<run_id>                                          -> run state: a zstd frame of its
//!                                                        JSON (`Packed`)
//! t/<due_at: i64 as u64 ^ 1<<63, BE>/<partition: i32 BE>/<run_id>\0<timer_key> -> empty
//! o/<partition: i32 BE>                               -> next changelog offset, u64 BE
//! g/<partition: i32 BE>                               -> the partition's gauge tally (JSON,
//!                                                        with the changelog offset it reflects)
//! q/<run_id>                                          -> why the run is quarantined: its
//!                                                        changelog record does not read
//!                                                        back (`crate::restore`)
//! z/<id: u32 BE>                                      -> a zstd dictionary the run
//!                                                        states are packed against
//!                                                        (`crate::pack`)
//! m/format                                            -> FORMAT marker
//! ```
//!
//! Local state is never trusted without its marker (KAFKA-7192): an open error, a
//! missing or different marker on a non-empty store, or an entry that cannot be read
//! makes [`Store::open`] wipe the directory and start empty, so the caller restores the
//! assigned partitions from the compacted changelog.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

/// sled's page cache, by default. Its 1 GiB default made the reducer's memory grow with
/// the number of cached runs; the cache is a cache of a cache (Kafka is the truth).
pub const CACHE_CAPACITY: u64 = 64 * 1024 * 1024;

/// The smallest page cache the store opens with: sled panics below 256 bytes, and a panic
/// while opening would wipe a good store.
pub const MIN_CACHE_CAPACITY: u64 = 4096;

/// Written at creation; a store whose marker differs is wiped on open.
/// `/2`: run states packed (zstd); a `/1` store is wiped and restored from the changelog.
const FORMAT: &[u8] = b"sortie-reducer-store/2";

const MARKER_KEY: &[u8] = b"m/format";
const RUN_PREFIX: &[u8] = b"r/";
const TIMER_PREFIX: &[u8] = b"t/";
const OFFSET_PREFIX: &[u8] = b"o/";
const TALLY_PREFIX: &[u8] = b"g/";
const INTERRUPT_PREFIX: &[u8] = b"i/";
const QUARANTINE_PREFIX: &[u8] = b"q/";

/// `t/` + due (8) + `/` + partition (4) + `/`: where the run id starts in a timer key.
const TIMER_RUN_ID_AT: usize = 2 + 8 + 1 + 4 + 1;

/// Errors of the local store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// sled failed to read or write.
    #[error("the local store failed: {0}")]
    Sled(#[from] sled::Error),
    /// The store directory could not be wiped.
    #[error("the local store directory {path} could not be wiped: {source}")]
    Wipe {
        /// The store directory.
        path: PathBuf,
        /// The file system error.
        source: io::Error,
    },
    /// Another handle holds the store's lock (past a short wait); the store is not
    /// wiped from under it.
    #[error("the local store {path} is locked by another process: {source}")]
    Locked {
        /// The store directory.
        path: PathBuf,
        /// sled's lock error.
        source: sled::Error,
    },
    /// sled panicked while opening the directory, even after it was wiped.
    #[error("the local store {path} could not be opened: sled panicked")]
    Panicked {
        /// The store directory.
        path: PathBuf,
    },
    /// A run id with a NUL byte cannot be a timer index key (NUL separates the timer key).
    #[error("run id {0:?} contains a NUL byte and cannot be indexed")]
    InvalidRunId(String),
    /// The store was closed by a reopen that failed.
    #[error("the local store is closed: it could not be opened again")]
    Closed,
    /// An entry in the store does not have the shape this format writes.
    #[error("the local store holds an unreadable entry: {0}")]
    Corrupt(String),
}

pub use crate::pack::Packed;
use crate::pack::{Dictionaries, DICTIONARY_PREFIX};

/// What sled is estimated to keep in memory of `entries` written or read, `bytes` in all:
/// their bytes and 1 KiB an entry (its nodes, keys and bookkeeping): an upper bound of
/// what sled holds of states written one by one until it is opened again (the figures:
/// `docs/performance/log.md`). After a restore, and the
/// count of every cached run that may follow it, the store is opened again
/// ([`Store::reopen`]) once this passes its page cache.
pub fn retained(entries: u64, bytes: u64) -> u64 {
    bytes + 1024 * entries
}

/// Result alias of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A timer whose due time has come, read from the index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DueTimer {
    /// The run-state partition the run belongs to.
    pub partition: i32,
    /// The run.
    pub run_id: String,
    /// The timer's key within the run.
    pub timer_key: String,
    /// When it is due (the same unit the caller armed it with).
    pub due_at: i64,
}

/// The changes of one committed Kafka transaction, applied atomically by [`Store::apply`]
/// (or, behind the commit, by [`Store::apply_behind`]).
///
/// Operations on the same key: the last one wins.
#[derive(Debug, Default, Clone)]
pub struct Batch {
    writes: BTreeMap<Vec<u8>, Write>,
    len: usize,
    invalid: Option<String>,
}

/// One write of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Write {
    /// These bytes, as they are.
    Put(Vec<u8>),
    /// A run state's JSON, packed (against the store's dictionary) when it reaches sled.
    State(Vec<u8>),
    /// A removal.
    Remove,
}

impl Batch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of operations recorded.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no operation was recorded.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Store a run's state bytes, packed here in a plain frame ([`Store::pack`] packs
    /// against the store's dictionary: the reducer's writes go through it).
    pub fn put_run(&mut self, run_id: &str, state: impl AsRef<[u8]>) -> &mut Self {
        self.put_packed(run_id, Packed::new(state.as_ref()))
    }

    /// Store a run's state, packed already (the restore packs on its decoder thread).
    pub fn put_packed(&mut self, run_id: &str, state: Packed) -> &mut Self {
        self.len += 1;
        self.writes.insert(run_key(run_id), Write::Put(state.0));
        self
    }

    /// Store a run's state JSON, packed by the store when it writes it to sled (after
    /// [`Store::apply_behind`], only the last state of a run within the window is packed).
    pub fn put_state(&mut self, run_id: &str, state: Vec<u8>) -> &mut Self {
        self.len += 1;
        self.writes.insert(run_key(run_id), Write::State(state));
        self
    }

    /// Remove a run's state.
    pub fn remove_run(&mut self, run_id: &str) -> &mut Self {
        self.len += 1;
        self.writes.insert(run_key(run_id), Write::Remove);
        self
    }

    /// Index a timer by its due time.
    pub fn arm_timer(
        &mut self,
        partition: i32,
        run_id: &str,
        timer_key: &str,
        due_at: i64,
    ) -> &mut Self {
        let key = || timer_index_key(partition, run_id, timer_key, due_at);
        self.index_write(run_id, key, Some(Vec::new()))
    }

    /// Remove a timer from the index (the same arguments it was armed with).
    pub fn disarm_timer(
        &mut self,
        partition: i32,
        run_id: &str,
        timer_key: &str,
        due_at: i64,
    ) -> &mut Self {
        let key = || timer_index_key(partition, run_id, timer_key, due_at);
        self.index_write(run_id, key, None)
    }

    /// Record the next `sortie.run-state` offset of `partition` this batch's state reflects.
    pub fn set_changelog_offset(&mut self, partition: i32, next_offset: u64) -> &mut Self {
        self.len += 1;
        self.writes.insert(
            offset_key(partition).to_vec(),
            Write::Put(next_offset.to_be_bytes().to_vec()),
        );
        self
    }

    /// Store a partition's gauge tally (see `gauges::RunGauges::save_into`).
    pub fn put_tally(&mut self, partition: i32, tally: Vec<u8>) -> &mut Self {
        self.len += 1;
        self.writes
            .insert(tally_key(partition).to_vec(), Write::Put(tally));
        self
    }

    /// Index an interrupt of a run in `partition` as open since `at` (ms): the gauges'
    /// open-interrupt set, kept in sled with every tally so a restart loads it instead of
    /// counting every cached run.
    pub fn open_interrupt(
        &mut self,
        partition: i32,
        run_id: &str,
        interrupt_id: &str,
        at: i64,
    ) -> &mut Self {
        let key = || interrupt_index_key(partition, run_id, interrupt_id);
        self.index_write(run_id, key, Some(at.to_be_bytes().to_vec()))
    }

    /// Remove an interrupt from the open-interrupt index.
    pub fn close_interrupt(
        &mut self,
        partition: i32,
        run_id: &str,
        interrupt_id: &str,
    ) -> &mut Self {
        let key = || interrupt_index_key(partition, run_id, interrupt_id);
        self.index_write(run_id, key, None)
    }

    /// Writes (`Some`) or removes (`None`) an index entry of `run_id`; nothing, and the
    /// batch refused, when the run id cannot be part of a key.
    fn index_write(
        &mut self,
        run_id: &str,
        key: impl FnOnce() -> Vec<u8>,
        value: Option<Vec<u8>>,
    ) -> &mut Self {
        self.len += 1;
        if self.check_run_id(run_id) {
            let write = match value {
                Some(value) => Write::Put(value),
                None => Write::Remove,
            };
            self.writes.insert(key(), write);
        }
        self
    }

    fn check_run_id(&mut self, run_id: &str) -> bool {
        if run_id.contains('\0') {
            self.invalid.get_or_insert_with(|| run_id.to_owned());
            false
        } else {
            true
        }
    }
}

/// The reducer's local cache: one sled database, its default tree, prefixed keys.
#[derive(Debug)]
pub struct Store {
    /// `None` only after a [`Store::reopen`] failed: every call then fails.
    db: RwLock<Option<sled::Db>>,
    /// Where it lives (`None`: a temporary store, never reopened).
    path: Option<PathBuf>,
    cache_capacity: u64,
    durable: bool,
    /// What run states are packed against.
    pub(crate) dictionaries: Dictionaries,
    /// Committed batches not in sled yet ([`Store::apply_behind`]); every read looks here
    /// first, and every other write flushes it first.
    pending: Mutex<Pending>,
}

/// Writes of committed batches held in memory until they go to sled as one batch.
#[derive(Debug, Default)]
struct Pending {
    writes: BTreeMap<Vec<u8>, Write>,
    bytes: usize,
    since: Option<Instant>,
    /// sled's last write was a direct one (a restore's marker, the tallies after it): the
    /// next committed batch goes through at once, so that sled's log holds a batch with
    /// marker and tally together right behind them, as it did before any write was held.
    direct: bool,
}

impl Write {
    fn len(&self) -> usize {
        match self {
            Write::Put(bytes) | Write::State(bytes) => bytes.len(),
            Write::Remove => 0,
        }
    }
}

/// A scan of sled with the writes held behind laid over it (both in key order; a held
/// write wins over sled's entry for the same key, a held removal hides it).
struct Overlay<S: Iterator<Item = sled::Result<(sled::IVec, sled::IVec)>>> {
    sled: std::iter::Peekable<S>,
    held: std::iter::Peekable<std::vec::IntoIter<(Vec<u8>, Write)>>,
}

impl<S: Iterator<Item = sled::Result<(sled::IVec, sled::IVec)>>> Iterator for Overlay<S> {
    type Item = Result<(Vec<u8>, Vec<u8>)>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let take_held = match (self.sled.peek(), self.held.peek()) {
                (None, None) => return None,
                (Some(Err(_)), _) => {
                    let error = self.sled.next()?.err()?;
                    return Some(Err(error.into()));
                }
                (None, Some(_)) => true,
                (Some(_), None) => false,
                (Some(Ok((stored, _))), Some((held, _))) => {
                    if held.as_slice() == stored.as_ref() {
                        self.sled.next(); // the held write replaces it
                        true
                    } else {
                        held.as_slice() < stored.as_ref()
                    }
                }
            };
            if take_held {
                match self.held.next()? {
                    (key, Write::Put(value) | Write::State(value)) => {
                        return Some(Ok((key, value)))
                    }
                    (_, Write::Remove) => continue,
                }
            }
            return self.sled.next().map(|entry| {
                entry
                    .map(|(k, v)| (k.to_vec(), v.to_vec()))
                    .map_err(Error::from)
            });
        }
    }
}

/// How long committed writes may wait in memory before they go to sled: a run written
/// several times meanwhile (a state per step, a step timer armed and disarmed) reaches
/// sled once. A crash loses at most this much of the cache, which the next restore reads
/// from the changelog again (the marker goes with the states). Two seconds hold a
/// bench run's five steps under full load (a step round trip ~200 ms): against 500 ms,
/// the reducer's CPU a step fell ~6 % in alternated runs (the performance log,
/// 2026-12-06).
pub const WRITE_BEHIND: Duration = Duration::from_secs(2);

/// Most bytes held behind (the latest write of each key) before they are written
/// whatever their age.
const WRITE_BEHIND_BYTES: usize = 32 * 1024 * 1024;

/// The open database, for the length of one call.
struct Db<'a>(RwLockReadGuard<'a, Option<sled::Db>>);

impl std::ops::Deref for Db<'_> {
    type Target = sled::Db;

    fn deref(&self) -> &sled::Db {
        self.0.as_ref().expect("checked by Store::db")
    }
}

impl Store {
    /// Open the store at `path`, or wipe it and start empty when it cannot be trusted: an
    /// open error (or sled panic), a missing or different format marker on a non-empty
    /// store, or an entry that cannot be read. A store held by another process's lock is
    /// an error, not wiped.
    pub fn open(path: &Path) -> Result<Store> {
        Store::open_with_cache(path, CACHE_CAPACITY)
    }

    /// [`Store::open`] with sled's page cache set to `cache_capacity` bytes (at least
    /// [`MIN_CACHE_CAPACITY`]).
    pub fn open_with_cache(path: &Path, cache_capacity: u64) -> Result<Store> {
        Store::open_waiting(path, cache_capacity.max(MIN_CACHE_CAPACITY), LOCK_WAIT)
    }

    fn open_waiting(path: &Path, cache_capacity: u64, lock_wait: Duration) -> Result<Store> {
        let open = || open_db(path, cache_capacity, lock_wait);
        let reason = match catch_unwind(open) {
            Ok(Ok(db)) => match verify(&db) {
                Ok(()) => match Store::new(db, Some(path), cache_capacity) {
                    Ok(store) => return Ok(store),
                    Err(error) => format!("its dictionaries cannot be loaded ({error})"),
                },
                Err(reason) => reason,
            },
            Ok(Err(error)) if is_lock_error(&error) => {
                return Err(Error::Locked {
                    path: path.to_owned(),
                    source: error,
                });
            }
            Ok(Err(error)) => format!("sled failed to open it ({error})"),
            Err(_) => "sled panicked while opening it".to_owned(),
        };
        tracing::warn!(
            path = %path.display(),
            %reason,
            "The local store cannot be trusted, so it is wiped and the assigned partitions will be restored from the changelog."
        );
        wipe_dir(path)?;
        let db = match catch_unwind(open) {
            Ok(db) => db?,
            Err(_) => {
                return Err(Error::Panicked {
                    path: path.to_owned(),
                });
            }
        };
        db.insert(MARKER_KEY, FORMAT)?;
        db.flush()?;
        Store::new(db, Some(path), cache_capacity)
    }

    /// A store in a temporary directory that disappears when dropped (tests).
    pub fn temporary() -> Result<Store> {
        let db = sled::Config::new().temporary(true).open()?;
        db.insert(MARKER_KEY, FORMAT)?;
        Store::new(db, None, CACHE_CAPACITY)
    }

    fn new(db: sled::Db, path: Option<&Path>, cache_capacity: u64) -> Result<Store> {
        let dictionaries = Dictionaries::load(&db, crate::pack::TRAIN_AFTER)?;
        Ok(Store {
            db: RwLock::new(Some(db)),
            path: path.map(Path::to_owned),
            cache_capacity,
            durable: false,
            dictionaries,
            pending: Mutex::default(),
        })
    }

    /// Trains the store's dictionary after `bytes` of sampled states instead of
    /// [`crate::pack::TRAIN_AFTER`] (`--store-dictionary-after`).
    pub fn with_dictionary_after(mut self, bytes: usize) -> Store {
        self.dictionaries.train_after = bytes;
        self
    }

    /// Packs a run state as the store holds it: against the store's dictionary, once it
    /// has one (see [`crate::pack`]).
    pub fn pack(&self, state: &[u8]) -> Packed {
        match self.db() {
            Ok(db) => self.dictionaries.pack(state, &db),
            // Nothing will be written to a closed store; a plain frame is still valid.
            Err(_) => Packed::new(state),
        }
    }

    /// The dictionary new run states are packed against, if the store has one.
    pub fn dictionary(&self) -> Option<u32> {
        self.dictionaries.current()
    }

    /// Writes one entry as is (tests that plant what this format never writes).
    #[cfg(test)]
    pub(crate) fn raw_insert(&self, key: &[u8], value: &[u8]) -> Result<()> {
        self.flush_behind()?;
        self.db()?.insert(key, value)?;
        Ok(())
    }

    fn db(&self) -> Result<Db<'_>> {
        // A poisoned lock only means a caller panicked holding it; sled's own state is
        // whole either way.
        let guard = self.db.read().unwrap_or_else(PoisonError::into_inner);
        if guard.is_none() {
            return Err(Error::Closed);
        }
        Ok(Db(guard))
    }

    /// Closes the database and opens it again, which hands back the memory sled keeps
    /// after bulk writes or a scan of the whole store: a cold restore of 1M runs left the
    /// reducer at 282 MiB after a live load, and the gauges' scan after it at ~300 MiB;
    /// ~150 MiB with the store reopened (`docs/performance/`).
    /// Everything written is flushed first; a store that cannot be opened again is an
    /// error, and every later call fails with [`Error::Closed`] (the reducer exits and
    /// its restart opens — or wipes and restores — the store as at any start).
    ///
    /// It waits for every call and scan in progress; a scan held open on the calling
    /// thread would wait forever.
    pub fn reopen(&self) -> Result<()> {
        self.reopen_waiting(LOCK_WAIT)
    }

    fn reopen_waiting(&self, lock_wait: Duration) -> Result<()> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        self.flush_behind()?;
        let mut slot = self.db.write().unwrap_or_else(PoisonError::into_inner);
        let Some(db) = slot.take() else {
            return Err(Error::Closed);
        };
        db.flush()?;
        // The last handle: sled stops its flusher and releases the file lock (from a
        // background thread, which `open_db` waits out).
        drop(db);
        let db = match open_db(path, self.cache_capacity, lock_wait) {
            Err(error) if is_lock_error(&error) => {
                return Err(Error::Locked {
                    path: path.clone(),
                    source: error,
                });
            }
            other => other?,
        };
        *slot = Some(db);
        Ok(())
    }

    /// Flush after every [`Store::apply`] (default: off). Off, sled flushes in the
    /// background every 500 ms; a crash loses at most those writes, and since each
    /// batch carries its changelog offset, that only makes the warm restore read a bit
    /// more of the changelog.
    pub fn with_durable_writes(mut self, durable: bool) -> Store {
        self.durable = durable;
        self
    }

    /// Apply one committed batch atomically, now (with everything held behind first).
    pub fn apply(&self, batch: Batch) -> Result<()> {
        if let Some(run_id) = batch.invalid {
            return Err(Error::InvalidRunId(run_id));
        }
        self.write_direct(|| self.write_to_sled(batch.writes))
    }

    /// Apply one committed batch behind the commit: held in memory, merged with the
    /// batches after it, and written to sled as one atomic batch once the oldest has
    /// waited [`WRITE_BEHIND`] (or [`WRITE_BEHIND_BYTES`] are held, or any other write
    /// or a scan comes). Reads see it at once. The writes of a run superseded within the
    /// window never reach sled, and its state is packed once: the cache's writes were a
    /// fifth of the reducer's CPU under load, one sled batch per commit.
    ///
    /// Each batch carries its changelog markers, so what reaches sled is always the
    /// committed state of a prefix of the commits: a crash loses the rest, which the next
    /// restore reads again from the changelog, as it would have read the commits sled's
    /// own background flush had not written yet.
    pub fn apply_behind(&self, batch: Batch) -> Result<()> {
        if let Some(run_id) = batch.invalid {
            return Err(Error::InvalidRunId(run_id));
        }
        let due = {
            let mut pending = self.pending();
            let through = std::mem::take(&mut pending.direct) && pending.writes.is_empty();
            pending.since.get_or_insert_with(Instant::now);
            for (key, write) in batch.writes {
                let key_len = key.len();
                pending.bytes += key_len + write.len();
                if let Some(was) = pending.writes.insert(key, write) {
                    // Superseded: no longer held.
                    pending.bytes -= key_len + was.len();
                }
            }
            through
                || self.durable
                || pending.bytes >= WRITE_BEHIND_BYTES
                || pending.since.is_some_and(|at| at.elapsed() >= WRITE_BEHIND)
        };
        if due {
            self.flush_behind()?;
        }
        Ok(())
    }

    /// Writes what [`Store::apply_behind`] holds to sled if the oldest of it has waited
    /// `age` (the reducer's housekeeping, so an idle reducer's cache catches up).
    pub fn flush_behind_older_than(&self, age: Duration) -> Result<()> {
        let due = self.pending().since.is_some_and(|at| at.elapsed() >= age);
        if due {
            self.flush_behind()?;
        }
        Ok(())
    }

    /// Writes what [`Store::apply_behind`] holds to sled, as one atomic batch.
    pub fn flush_behind(&self) -> Result<()> {
        let writes = {
            let mut pending = self.pending();
            pending.since = None;
            pending.bytes = 0;
            if pending.writes.is_empty() {
                return Ok(());
            }
            std::mem::take(&mut pending.writes)
        };
        self.write_to_sled(writes)
    }

    fn write_to_sled(&self, writes: BTreeMap<Vec<u8>, Write>) -> Result<()> {
        let db = self.db()?;
        let mut batch = sled::Batch::default();
        for (key, write) in writes {
            match write {
                Write::Put(value) => batch.insert(key, value),
                Write::State(json) => batch.insert(key, self.dictionaries.pack(&json, &db).0),
                Write::Remove => batch.remove(key),
            }
        }
        db.apply_batch(batch)?;
        if self.durable {
            db.flush()?;
        }
        Ok(())
    }

    fn pending(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What the writes held behind say of `key`: `Some(write)` if they have it.
    fn held(&self, key: &[u8]) -> Option<Write> {
        self.pending().writes.get(key).cloned()
    }

    /// `key`'s bytes as the store has them: the writes held behind first, then sled's
    /// (a run state, packed in sled and maybe not held, is read by `get_run`).
    fn stored(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        match self.held(key) {
            Some(Write::Put(value) | Write::State(value)) => Ok(Some(value)),
            Some(Write::Remove) => Ok(None),
            None => Ok(self.db()?.get(key)?.map(|v| v.to_vec())),
        }
    }

    /// A write that goes to sled at once, outside the committed batches: what is held
    /// behind goes first, and the next committed batch after it goes through too (see
    /// `Pending::direct`).
    fn write_direct(&self, write: impl FnOnce() -> Result<()>) -> Result<()> {
        self.flush_behind()?;
        write()?;
        self.pending().direct = true;
        Ok(())
    }

    /// The entries under `prefix` (and below `end`, if given) with the writes held behind
    /// laid over sled's, in key order (for the index prefixes: a held run state is never
    /// scanned, see `runs`). The held ones in range are copied out of their lock first.
    fn scan_over(
        &self,
        db: &sled::Db,
        prefix: &[u8],
        end: Option<&[u8]>,
    ) -> impl Iterator<Item = Result<(Vec<u8>, Vec<u8>)>> {
        let below = |key: &[u8]| key.starts_with(prefix) && end.is_none_or(|end| key < end);
        let held: Vec<(Vec<u8>, Write)> = self
            .pending()
            .writes
            .range(prefix.to_vec()..)
            .take_while(|(key, _)| below(key))
            .map(|(k, w)| (k.clone(), w.clone()))
            .collect();
        debug_assert!(end.is_none_or(|end| end.starts_with(prefix)));
        let sled = match end {
            Some(end) => db.range(prefix.to_vec()..end.to_vec()),
            None => db.scan_prefix(prefix),
        };
        Overlay {
            sled: sled.peekable(),
            held: held.into_iter().peekable(),
        }
    }

    /// Writes a run's state (`None`: removes it) at once, outside any batch: the restore's
    /// path. A sled batch pins sled's log until it is applied, and the restore's chunks of
    /// 4,000 states ran at ~90k states/s and grew the reducer by ~150 MiB/s; written one
    /// by one, ~140–170k states/s with the reducer's memory flat (`docs/performance/`).
    /// Atomic with nothing: the restore writes a chunk's timers and changelog marker after
    /// its states, and sled recovers a prefix of its log, so a marker that survives a
    /// crash covers every state before it; states past the marker are overwritten when
    /// the changelog is read from the marker again.
    pub fn write_run(&self, run_id: &str, state: Option<Packed>) -> Result<()> {
        self.write_direct(|| {
            let db = self.db()?;
            match state {
                Some(state) => db.insert(run_key(run_id), state.0)?,
                None => db.remove(run_key(run_id))?,
            };
            Ok(())
        })
    }

    /// Quarantines a run whose changelog record does not read back (`reason`), or
    /// releases it (`None`): see `crate::restore`. Written at once, like the restore's
    /// states.
    pub fn set_quarantine(&self, run_id: &str, reason: Option<&str>) -> Result<()> {
        self.write_direct(|| {
            let db = self.db()?;
            let key = [QUARANTINE_PREFIX, run_id.as_bytes()].concat();
            match reason {
                Some(reason) => db.insert(key, reason.as_bytes())?,
                None => db.remove(key)?,
            };
            Ok(())
        })
    }

    /// Every quarantined run and why (a handful at most: a scan of their prefix only).
    pub fn quarantined(&self) -> Result<Vec<(String, String)>> {
        let mut runs = Vec::new();
        for entry in self.db()?.scan_prefix(QUARANTINE_PREFIX) {
            let (key, reason) = entry?;
            runs.push((
                String::from_utf8_lossy(&key[QUARANTINE_PREFIX.len()..]).into_owned(),
                String::from_utf8_lossy(&reason).into_owned(),
            ));
        }
        Ok(runs)
    }

    /// Removes `partition`'s stored gauge tally, so the next assignment counts its runs
    /// from the cache (a restore about to write states past the tally's marker, which the
    /// tally would otherwise be trusted to reflect after a crash).
    pub fn forget_tally(&self, partition: i32) -> Result<()> {
        self.write_direct(|| {
            self.db()?.remove(tally_key(partition))?;
            Ok(())
        })
    }

    /// Write everything pending to disk, what is held behind included (e.g. at shutdown).
    pub fn flush(&self) -> Result<()> {
        self.flush_behind()?;
        self.db()?.flush()?;
        Ok(())
    }

    /// A run's state bytes, if cached.
    pub fn get_run(&self, run_id: &str) -> Result<Option<Vec<u8>>> {
        let key = run_key(run_id);
        match self.held(&key) {
            Some(Write::State(json)) => return Ok(Some(json)),
            Some(Write::Put(packed)) => return self.dictionaries.unpack(run_id, &packed).map(Some),
            Some(Write::Remove) => return Ok(None),
            None => {}
        }
        self.db()?
            .get(key)?
            .map(|v| self.dictionaries.unpack(run_id, &v))
            .transpose()
    }

    /// Every cached run: its id and state bytes (the metrics tally rebuilds from it after
    /// a restore). Includes runs of partitions this instance no longer owns.
    pub fn runs(&self) -> impl Iterator<Item = Result<(String, Vec<u8>)>> + '_ {
        let flushed = self.flush_behind();
        let db = flushed.and_then(|()| self.db());
        let mut entries = db.as_ref().ok().map(|db| db.scan_prefix(RUN_PREFIX));
        let mut closed = db.is_err();
        std::iter::from_fn(move || {
            // The read lock is held while the scan lasts: a reopen waits for it.
            let _open = &db;
            if std::mem::take(&mut closed) {
                return Some(Err(Error::Closed));
            }
            let entry = entries.as_mut()?.next()?;
            Some(entry.map_err(Error::from).and_then(|(key, value)| {
                let run_id = String::from_utf8_lossy(&key[RUN_PREFIX.len()..]).into_owned();
                let state = self.dictionaries.unpack(&run_id, &value)?;
                Ok((run_id, state))
            }))
        })
    }

    /// The next `sortie.run-state` offset of `partition` this cache reflects; `None`
    /// means nothing is cached for it and it must be restored from the beginning.
    pub fn changelog_offset(&self, partition: i32) -> Result<Option<u64>> {
        match self.stored(&offset_key(partition))? {
            None => Ok(None),
            Some(value) => decode_offset(&value).map(Some).ok_or_else(|| {
                Error::Corrupt(format!(
                    "changelog offset of partition {partition} has {} bytes",
                    value.len()
                ))
            }),
        }
    }

    /// A partition's stored gauge tally, if any (it may be stale: the caller checks the
    /// offset it carries).
    pub fn tally(&self, partition: i32) -> Result<Option<Vec<u8>>> {
        self.stored(&tally_key(partition))
    }

    /// The open-interrupt index of `partition`: (run id, interrupt id, open since ms).
    pub fn open_interrupts(&self, partition: i32) -> Result<Vec<(String, String, i64)>> {
        let prefix = interrupt_partition_prefix(partition);
        let mut open = Vec::new();
        let db = self.db()?;
        for entry in self.scan_over(&db, &prefix, None) {
            let (key, value) = entry?;
            let (_, run_id, interrupt_id, at) =
                decode_interrupt(&key, &value).ok_or_else(|| {
                    Error::Corrupt(format!("open-interrupt entry {key:?} is malformed"))
                })?;
            open.push((run_id, interrupt_id, at));
        }
        Ok(open)
    }

    /// Up to `limit` timers with `due_at <= now` of the given partitions, in due order.
    pub fn due_timers(
        &self,
        now: i64,
        partitions: &BTreeSet<i32>,
        limit: usize,
    ) -> Result<Vec<DueTimer>> {
        let mut due = Vec::new();
        if limit == 0 || partitions.is_empty() {
            return Ok(due);
        }
        let db = self.db()?;
        // Keys sort by due time: only those due by `now` are read, of sled's and of the
        // writes held behind (which hold every timer the last half second armed).
        let not_due = now
            .checked_add(1)
            .map(|after| [TIMER_PREFIX, &encode_due(after)].concat());
        for entry in self.scan_over(&db, TIMER_PREFIX, not_due.as_deref()) {
            let (key, _) = entry?;
            let timer = decode_timer_key(&key).ok_or_else(|| corrupt_timer(&key))?;
            if timer.due_at > now {
                break;
            }
            if partitions.contains(&timer.partition) {
                due.push(timer);
                if due.len() == limit {
                    break;
                }
            }
        }
        Ok(due)
    }

    /// Forget a revoked partition: remove its changelog offset, gauge tally, open-interrupt
    /// index and timers in one batch, so a later assignment restores it from the
    /// changelog. Run states stay (they are not keyed by partition); the restore
    /// overwrites them.
    pub fn forget_partition(&self, partition: i32) -> Result<()> {
        self.write_direct(|| {
            let mut writes = sled::Batch::default();
            writes.remove(&offset_key(partition)[..]);
            writes.remove(&tally_key(partition)[..]);
            let db = self.db()?;
            for entry in db.scan_prefix(interrupt_partition_prefix(partition)) {
                writes.remove(entry?.0);
            }
            for entry in db.scan_prefix(TIMER_PREFIX) {
                let (key, _) = entry?;
                let timer = decode_timer_key(&key).ok_or_else(|| corrupt_timer(&key))?;
                if timer.partition == partition {
                    writes.remove(key);
                }
            }
            db.apply_batch(writes)?;
            if self.durable {
                db.flush()?;
            }
            Ok(())
        })
    }

    /// Marks the store untrusted (its marker removed, flushed): the next [`Store::open`]
    /// wipes it and the partitions are restored from the changelog. Called when an entry
    /// cannot be read.
    pub fn invalidate(&self) -> Result<()> {
        self.flush_behind()?;
        let db = self.db()?;
        db.remove(MARKER_KEY)?;
        db.flush()?;
        Ok(())
    }

    /// Clear everything (a cold restore) and rewrite the marker.
    pub fn wipe(&self) -> Result<()> {
        // sled's clear is not atomic: remove the marker first, so a crash halfway leaves
        // a store that the next open wipes instead of trusting. What is held behind is
        // older than the wipe: it goes too.
        *self.pending() = Pending::default();
        let db = self.db()?;
        db.remove(MARKER_KEY)?;
        db.flush()?;
        db.clear()?;
        // The dictionaries stay: states packed against them may be handed out already.
        for (key, bytes) in self.dictionaries.entries() {
            db.insert(key, bytes)?;
        }
        db.insert(MARKER_KEY, FORMAT)?;
        db.flush()?;
        Ok(())
    }

    /// The memory sled's page cache is configured to keep (it keeps more: see
    /// [`Store::reopen`]).
    pub fn cache_capacity(&self) -> u64 {
        self.cache_capacity
    }

    /// Bytes sled uses on disk (for metrics).
    pub fn size_on_disk(&self) -> Result<u64> {
        Ok(self.db()?.size_on_disk()?)
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // Committed writes held behind are worth keeping (a later start reads less of the
        // changelog); losing them is what a crash does, and the restore makes up for it.
        if let Err(e) = self.flush_behind() {
            tracing::warn!(error = %e, "The local store could not write what it held behind.");
        }
    }
}

/// sled releases its file lock from a background thread shortly after the last handle
/// is dropped, so a reopen in the same process can briefly see it locked: wait that out.
const LOCK_WAIT: Duration = Duration::from_secs(5);

fn open_db(path: &Path, cache_capacity: u64, lock_wait: Duration) -> sled::Result<sled::Db> {
    let deadline = Instant::now() + lock_wait;
    loop {
        match sled::Config::new()
            .path(path)
            .cache_capacity(cache_capacity)
            .open()
        {
            Err(error) if is_lock_error(&error) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

fn is_lock_error(error: &sled::Error) -> bool {
    matches!(error, sled::Error::Io(e) if e.to_string().contains("could not acquire lock"))
}

/// Why an opened database cannot be trusted, if it cannot.
fn verify(db: &sled::Db) -> Result<(), String> {
    let check = || -> sled::Result<Result<(), String>> {
        if db.tree_names().len() > 1 {
            return Ok(Err("it holds trees this format never writes".to_owned()));
        }
        match db.get(MARKER_KEY)? {
            Some(marker) if marker == FORMAT => {}
            Some(marker) => {
                return Ok(Err(format!(
                    "its format marker is {:?}, not {:?}",
                    String::from_utf8_lossy(&marker),
                    String::from_utf8_lossy(FORMAT)
                )));
            }
            None if db.is_empty() => {
                db.insert(MARKER_KEY, FORMAT)?;
                db.flush()?;
                return Ok(Ok(()));
            }
            None => return Ok(Err("it has no format marker".to_owned())),
        }
        // Read every entry but the run states once: a page sled cannot read shows up now,
        // not mid-restore. Run states (the bulk: a million runs cost seconds of every
        // start) are checked when read; one that cannot be is reported as
        // `Error::Corrupt`, and the reducer then calls `invalidate`, so the next start
        // wipes and restores.
        let after_runs: &[u8] = b"r0"; // the first key past every `r/` key
        for entry in db.range(..RUN_PREFIX).chain(db.range(after_runs..)) {
            let (key, value) = entry?;
            if let Some(reason) = malformed(&key, &value) {
                return Ok(Err(reason));
            }
        }
        Ok(Ok(()))
    };
    match catch_unwind(AssertUnwindSafe(check)) {
        Ok(Ok(verdict)) => verdict,
        Ok(Err(error)) => Err(format!("an entry cannot be read ({error})")),
        Err(_) => Err("sled panicked while reading it".to_owned()),
    }
}

fn malformed(key: &[u8], value: &[u8]) -> Option<String> {
    if key == MARKER_KEY {
        None
    } else if let Some(run_id) = key.strip_prefix(RUN_PREFIX) {
        std::str::from_utf8(run_id)
            .err()
            .map(|_| format!("run key {key:?} is not UTF-8"))
    } else if key.starts_with(TIMER_PREFIX) {
        decode_timer_key(key)
            .is_none()
            .then(|| format!("timer key {key:?} is malformed"))
    } else if key.starts_with(TALLY_PREFIX) {
        (key.len() != TALLY_PREFIX.len() + 4)
            .then(|| format!("gauge tally entry {key:?} is malformed"))
    } else if key.starts_with(INTERRUPT_PREFIX) {
        decode_interrupt(key, value)
            .is_none()
            .then(|| format!("open-interrupt entry {key:?} is malformed"))
    } else if key.starts_with(DICTIONARY_PREFIX) {
        crate::pack::dictionary_id(key, value)
            .is_none()
            .then(|| format!("dictionary entry {key:?} is malformed"))
    } else if key.starts_with(OFFSET_PREFIX) {
        (key.len() != OFFSET_PREFIX.len() + 4 || decode_offset(value).is_none())
            .then(|| format!("changelog offset entry {key:?} is malformed"))
    } else {
        Some(format!("key {key:?} has an unknown prefix"))
    }
}

/// Renames the directory aside before deleting it, so a crash mid-wipe never leaves a
/// half-deleted store at `path`.
fn wipe_dir(path: &Path) -> Result<()> {
    let error = |source| Error::Wipe {
        path: path.to_owned(),
        source,
    };
    let mut aside = path.as_os_str().to_owned();
    aside.push(".wiped");
    let aside = PathBuf::from(aside);
    remove_if_exists(&aside).map_err(error)?;
    match std::fs::rename(path, &aside) {
        Ok(()) => {
            // `path` is already clean; a leftover aside is removed by the next wipe.
            if let Err(e) = remove_if_exists(&aside) {
                tracing::warn!(
                    path = %aside.display(),
                    error = %e,
                    "The wiped local store could not be deleted; the next wipe retries."
                );
            }
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(error(e)),
    }
}

fn remove_if_exists(path: &Path) -> io::Result<()> {
    let result = if path.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
    match result {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

fn run_key(run_id: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(RUN_PREFIX.len() + run_id.len());
    key.extend_from_slice(RUN_PREFIX);
    key.extend_from_slice(run_id.as_bytes());
    key
}

fn tally_key(partition: i32) -> [u8; 6] {
    let mut key = [0; 6];
    key[..2].copy_from_slice(TALLY_PREFIX);
    key[2..].copy_from_slice(&partition.to_be_bytes());
    key
}

fn interrupt_partition_prefix(partition: i32) -> [u8; 6] {
    let mut key = [0; 6];
    key[..2].copy_from_slice(INTERRUPT_PREFIX);
    key[2..].copy_from_slice(&partition.to_be_bytes());
    key
}

/// `i/` + partition (4) + run id + `\0` + interrupt id.
fn interrupt_index_key(partition: i32, run_id: &str, interrupt_id: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(6 + run_id.len() + 1 + interrupt_id.len());
    key.extend_from_slice(&interrupt_partition_prefix(partition));
    key.extend_from_slice(run_id.as_bytes());
    key.push(0);
    key.extend_from_slice(interrupt_id.as_bytes());
    key
}

/// (partition, run id, interrupt id, open since) of an open-interrupt entry.
fn decode_interrupt(key: &[u8], value: &[u8]) -> Option<(i32, String, String, i64)> {
    let rest = key.strip_prefix(INTERRUPT_PREFIX)?;
    let partition = i32::from_be_bytes(rest.get(..4)?.try_into().ok()?);
    let rest = rest.get(4..)?;
    let split = rest.iter().position(|b| *b == 0)?;
    let run_id = std::str::from_utf8(&rest[..split]).ok()?;
    let interrupt_id = std::str::from_utf8(&rest[split + 1..]).ok()?;
    let at = i64::from_be_bytes(value.try_into().ok()?);
    Some((partition, run_id.to_owned(), interrupt_id.to_owned(), at))
}

fn offset_key(partition: i32) -> [u8; 6] {
    let mut key = [0; 6];
    key[..2].copy_from_slice(OFFSET_PREFIX);
    key[2..].copy_from_slice(&partition.to_be_bytes());
    key
}

fn decode_offset(value: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(value.try_into().ok()?))
}

/// Flipping the sign bit makes big-endian byte order match `i64` order, negatives included.
fn encode_due(due_at: i64) -> [u8; 8] {
    ((due_at as u64) ^ (1 << 63)).to_be_bytes()
}

fn decode_due(bytes: [u8; 8]) -> i64 {
    (u64::from_be_bytes(bytes) ^ (1 << 63)) as i64
}

fn timer_index_key(partition: i32, run_id: &str, timer_key: &str, due_at: i64) -> Vec<u8> {
    let mut key = Vec::with_capacity(TIMER_RUN_ID_AT + run_id.len() + 1 + timer_key.len());
    key.extend_from_slice(TIMER_PREFIX);
    key.extend_from_slice(&encode_due(due_at));
    key.push(b'/');
    key.extend_from_slice(&partition.to_be_bytes());
    key.push(b'/');
    key.extend_from_slice(run_id.as_bytes());
    key.push(0);
    key.extend_from_slice(timer_key.as_bytes());
    key
}

fn decode_timer_key(key: &[u8]) -> Option<DueTimer> {
    let rest = key.strip_prefix(TIMER_PREFIX)?;
    let due_at = decode_due(rest.get(..8)?.try_into().ok()?);
    if rest.get(8) != Some(&b'/') || rest.get(13) != Some(&b'/') {
        return None;
    }
    let partition = i32::from_be_bytes(rest.get(9..13)?.try_into().ok()?);
    let ids = rest.get(14..)?;
    let nul = ids.iter().position(|&b| b == 0)?;
    Some(DueTimer {
        partition,
        run_id: std::str::from_utf8(&ids[..nul]).ok()?.to_owned(),
        timer_key: std::str::from_utf8(&ids[nul + 1..]).ok()?.to_owned(),
        due_at,
    })
}

fn corrupt_timer(key: &[u8]) -> Error {
    Error::Corrupt(format!("timer key {key:?} is malformed"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn parts(ps: &[i32]) -> BTreeSet<i32> {
        ps.iter().copied().collect()
    }

    fn timer(partition: i32, run_id: &str, timer_key: &str, due_at: i64) -> DueTimer {
        DueTimer {
            partition,
            run_id: run_id.to_owned(),
            timer_key: timer_key.to_owned(),
            due_at,
        }
    }

    #[test]
    fn round_trip_of_runs_timers_and_offsets() {
        let store = Store::temporary().unwrap();
        let mut batch = Batch::new();
        batch
            .put_run("run-1", b"state-1")
            .put_run("run-2", b"state-2")
            .arm_timer(0, "run-1", "approval", 100)
            .set_changelog_offset(0, 42);
        store.apply(batch).unwrap();

        assert_eq!(store.get_run("run-1").unwrap(), Some(b"state-1".to_vec()));
        assert_eq!(store.get_run("run-2").unwrap(), Some(b"state-2".to_vec()));
        assert_eq!(store.get_run("run-3").unwrap(), None);
        assert_eq!(store.changelog_offset(0).unwrap(), Some(42));
        assert_eq!(store.changelog_offset(1).unwrap(), None);
        assert_eq!(
            store.due_timers(100, &parts(&[0]), 10).unwrap(),
            vec![timer(0, "run-1", "approval", 100)]
        );

        let mut batch = Batch::new();
        batch
            .remove_run("run-2")
            .put_run("run-1", b"state-1b")
            .set_changelog_offset(0, 43);
        store.apply(batch).unwrap();
        assert_eq!(store.get_run("run-1").unwrap(), Some(b"state-1b".to_vec()));
        assert_eq!(store.get_run("run-2").unwrap(), None);
        assert_eq!(store.changelog_offset(0).unwrap(), Some(43));
        assert!(store.size_on_disk().unwrap() > 0);
    }

    /// Seen red counting every write held, superseded ones too: a run written again and
    /// again within the window sent the held writes to sled long before their time.
    #[test]
    fn held_bytes_count_the_latest_write_of_each_key_only() {
        let store = Store::temporary().unwrap();
        // The first batch after a direct write goes through; the rest are held.
        store.apply_behind(Batch::new()).unwrap();
        let state = vec![b'x'; 1024 * 1024];
        for offset in 0..(2 * WRITE_BEHIND_BYTES / state.len()) as u64 {
            let mut batch = Batch::new();
            batch
                .put_state("run-1", state.clone())
                .set_changelog_offset(0, offset);
            store.apply_behind(batch).unwrap();
        }
        let pending = store.pending();
        assert_eq!(pending.writes.len(), 2, "one state and one marker, held");
        let held: usize = pending.writes.iter().map(|(k, w)| k.len() + w.len()).sum();
        assert_eq!(pending.bytes, held);
    }

    /// Checked red: with `get_run` reading sled only, the held state is not seen; with
    /// the overlay ignoring held removals, the disarmed timer still fires; with every
    /// batch held, the one after a direct write is not in sled.
    #[test]
    fn batches_held_behind_are_read_at_once_and_reach_sled_merged() {
        let store = Store::temporary().unwrap();
        let mut first = Batch::new();
        first
            .put_run("run-1", b"old")
            .arm_timer(0, "run-1", "step-a", 100)
            .arm_timer(0, "run-2", "approval", 50)
            .set_changelog_offset(0, 9);
        store.apply(first).unwrap();
        // The first committed batch after a direct write goes through at once...
        let mut through = Batch::new();
        through.set_changelog_offset(0, 10);
        store.apply_behind(through).unwrap();
        assert!(store.pending().writes.is_empty(), "written through");

        // ...the next ones are held.
        let mut held = Batch::new();
        held.put_state("run-1", b"{\"v\":1}".to_vec())
            .disarm_timer(0, "run-1", "step-a", 100)
            .arm_timer(0, "run-1", "step-b", 80)
            .open_interrupt(0, "run-2", "int-1", 7)
            .put_tally(0, b"tally".to_vec())
            .set_changelog_offset(0, 11);
        store.apply_behind(held).unwrap();
        let mut later = Batch::new();
        later
            .put_state("run-1", b"{\"v\":2}".to_vec())
            .put_state("run-3", b"{\"v\":3}".to_vec())
            .remove_run("run-3")
            .set_changelog_offset(0, 12);
        store.apply_behind(later).unwrap();

        // Read at once, as if written: the latest of each key, removals included.
        let read = |store: &Store| {
            (
                store.get_run("run-1").unwrap(),
                store.get_run("run-3").unwrap(),
                store.changelog_offset(0).unwrap(),
                store.tally(0).unwrap(),
                store.due_timers(1_000, &parts(&[0]), 10).unwrap(),
                store.open_interrupts(0).unwrap(),
            )
        };
        let expected = (
            Some(b"{\"v\":2}".to_vec()),
            None,
            Some(12),
            Some(b"tally".to_vec()),
            vec![
                timer(0, "run-2", "approval", 50),
                timer(0, "run-1", "step-b", 80),
            ],
            vec![("run-2".to_owned(), "int-1".to_owned(), 7)],
        );
        assert_eq!(read(&store), expected);
        // …while sled still holds the first batch alone.
        let db = store.db().unwrap();
        assert_eq!(
            db.get(offset_key(0)).unwrap().map(|v| v.to_vec()),
            Some(10u64.to_be_bytes().to_vec())
        );
        drop(db);

        store
            .flush_behind_older_than(Duration::from_secs(3600))
            .unwrap();
        assert!(
            !store.pending().writes.is_empty(),
            "too young to be written"
        );
        store.flush_behind().unwrap();
        assert!(store.pending().writes.is_empty());
        assert_eq!(read(&store), expected);
        // In sled now, the state packed (a zstd frame), not the JSON.
        let packed = store.db().unwrap().get(run_key("run-1")).unwrap().unwrap();
        assert_ne!(packed.as_ref(), b"{\"v\":2}");
        assert_eq!(store.db().unwrap().get(run_key("run-3")).unwrap(), None);
    }

    #[test]
    fn a_direct_write_goes_after_what_is_held_behind() {
        let store = Store::temporary().unwrap();
        let mut held = Batch::new();
        held.put_state("run-1", b"{\"held\":true}".to_vec());
        store.apply_behind(held).unwrap();
        // The restore's path: a later write wins over an older held one.
        store
            .write_run("run-1", Some(Packed::new(b"restored")))
            .unwrap();
        assert_eq!(store.get_run("run-1").unwrap(), Some(b"restored".to_vec()));
        store.flush_behind().unwrap();
        assert_eq!(store.get_run("run-1").unwrap(), Some(b"restored".to_vec()));
    }

    #[test]
    fn a_batch_is_all_there_after_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = Store::open(dir.path()).unwrap();
            let mut batch = Batch::new();
            for i in 0..200 {
                batch.put_run(&format!("run-{i}"), vec![7; 100]);
                batch.arm_timer(i % 3, &format!("run-{i}"), "timeout", i64::from(i));
            }
            batch
                .set_changelog_offset(0, 1000)
                .set_changelog_offset(1, 2000);
            store.apply(batch).unwrap();
            store.flush().unwrap();
        }
        let store = Store::open(dir.path()).unwrap();
        for i in 0..200 {
            assert_eq!(
                store.get_run(&format!("run-{i}")).unwrap(),
                Some(vec![7; 100])
            );
        }
        assert_eq!(store.changelog_offset(0).unwrap(), Some(1000));
        assert_eq!(store.changelog_offset(1).unwrap(), Some(2000));
        assert_eq!(
            store
                .due_timers(i64::MAX, &parts(&[0, 1, 2]), usize::MAX)
                .unwrap()
                .len(),
            200
        );
    }

    #[test]
    fn a_store_reopened_in_place_keeps_everything_and_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_with_cache(dir.path(), 4096).unwrap();
        let mut batch = Batch::new();
        for i in 0..500 {
            batch.put_run(&format!("run-{i}"), vec![7; 1000]);
        }
        batch
            .arm_timer(2, "run-1", "timeout", 5)
            .set_changelog_offset(2, 500)
            .put_tally(2, b"{}".to_vec());
        store.apply(batch).unwrap();
        assert_eq!(store.cache_capacity(), 4096);

        store.reopen().unwrap();
        assert_eq!(store.runs().filter_map(Result::ok).count(), 500);
        assert_eq!(store.get_run("run-499").unwrap(), Some(vec![7; 1000]));
        assert_eq!(store.changelog_offset(2).unwrap(), Some(500));
        assert_eq!(store.tally(2).unwrap(), Some(b"{}".to_vec()));
        assert_eq!(
            store.due_timers(5, &parts(&[2]), 10).unwrap(),
            vec![timer(2, "run-1", "timeout", 5)]
        );
        let mut batch = Batch::new();
        batch.remove_run("run-0").set_changelog_offset(2, 501);
        store.apply(batch).unwrap();
        store.reopen().unwrap();
        assert_eq!(store.get_run("run-0").unwrap(), None);
        assert_eq!(store.changelog_offset(2).unwrap(), Some(501));
        drop(store);
        // And a later start trusts it.
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.changelog_offset(2).unwrap(), Some(501));
        assert_eq!(store.runs().count(), 499);
        // A temporary store has nowhere to be reopened from: a no-op.
        let temporary = Store::temporary().unwrap();
        temporary
            .apply(Batch::new().put_run("r", b"s").clone())
            .unwrap();
        temporary.reopen().unwrap();
        assert_eq!(temporary.get_run("r").unwrap(), Some(b"s".to_vec()));
    }

    #[test]
    fn a_store_that_cannot_be_reopened_fails_every_later_call() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        store
            .apply(Batch::new().put_run("run-1", b"s").clone())
            .unwrap();
        // A handle kept past the reopen keeps sled's file lock.
        let leaked = (*store.db().unwrap()).clone();
        let error = store.reopen_waiting(Duration::from_millis(50)).unwrap_err();
        assert!(matches!(error, Error::Locked { .. }), "{error}");
        assert!(matches!(store.get_run("run-1"), Err(Error::Closed)));
        assert!(matches!(
            store.apply(Batch::new().put_run("run-2", b"s").clone()),
            Err(Error::Closed)
        ));
        assert!(matches!(store.runs().next(), Some(Err(Error::Closed))));
        assert!(matches!(store.reopen(), Err(Error::Closed)));
        drop(leaked);
        drop(store);
        // Nothing written was lost: the next start reads it.
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.get_run("run-1").unwrap(), Some(b"s".to_vec()));
    }

    #[test]
    fn durable_writes_survive_reopen_without_an_explicit_flush() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = Store::open(dir.path()).unwrap().with_durable_writes(true);
            let mut batch = Batch::new();
            batch.put_run("run-1", b"s").set_changelog_offset(3, 9);
            store.apply(batch).unwrap();
        }
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.get_run("run-1").unwrap(), Some(b"s".to_vec()));
        assert_eq!(store.changelog_offset(3).unwrap(), Some(9));
    }

    #[test]
    fn due_timers_are_in_due_order_filtered_and_limited() {
        let store = Store::temporary().unwrap();
        let mut batch = Batch::new();
        batch
            .arm_timer(1, "b", "t", 0)
            .arm_timer(0, "a", "t", -5)
            .arm_timer(0, "a", "u", i64::MIN)
            .arm_timer(2, "c", "t", -1)
            .arm_timer(0, "d", "t", 7)
            .arm_timer(1, "e", "t", 10)
            .arm_timer(0, "f", "t", i64::MAX);
        store.apply(batch).unwrap();

        let all = parts(&[0, 1, 2]);
        assert_eq!(
            store.due_timers(7, &all, 100).unwrap(),
            vec![
                timer(0, "a", "u", i64::MIN),
                timer(0, "a", "t", -5),
                timer(2, "c", "t", -1),
                timer(1, "b", "t", 0),
                timer(0, "d", "t", 7),
            ]
        );
        assert_eq!(
            store.due_timers(0, &parts(&[1, 2]), 100).unwrap(),
            vec![timer(2, "c", "t", -1), timer(1, "b", "t", 0)]
        );
        assert_eq!(
            store.due_timers(100, &all, 2).unwrap(),
            vec![timer(0, "a", "u", i64::MIN), timer(0, "a", "t", -5)]
        );
        assert_eq!(store.due_timers(-6, &all, 100).unwrap().len(), 1);
        assert!(store.due_timers(100, &parts(&[5]), 100).unwrap().is_empty());
        assert!(store.due_timers(100, &all, 0).unwrap().is_empty());
        assert_eq!(store.due_timers(i64::MAX, &all, 100).unwrap().len(), 7);
    }

    /// Seen red with the scan bounded one due time too early (`now` instead of `now + 1`):
    /// the timers due exactly now, held and stored, are not found.
    #[test]
    fn due_timers_read_held_and_stored_timers_due_by_now_and_no_later() {
        let store = Store::temporary().unwrap();
        let mut stored = Batch::new();
        stored
            .arm_timer(0, "a", "t", 10)
            .arm_timer(0, "b", "t", 30)
            .set_changelog_offset(0, 1);
        store.apply(stored).unwrap();
        let mut through = Batch::new();
        through.set_changelog_offset(0, 2);
        store.apply_behind(through).unwrap();
        let mut held = Batch::new();
        held.arm_timer(0, "c", "t", 20)
            .arm_timer(0, "d", "t", 10)
            .disarm_timer(0, "b", "t", 30)
            .arm_timer(0, "e", "t", i64::MAX)
            .set_changelog_offset(0, 3);
        store.apply_behind(held).unwrap();
        assert!(!store.pending().writes.is_empty(), "held behind");

        let all = parts(&[0]);
        assert!(store.due_timers(9, &all, 10).unwrap().is_empty());
        assert_eq!(
            store.due_timers(10, &all, 10).unwrap(),
            vec![timer(0, "a", "t", 10), timer(0, "d", "t", 10)]
        );
        assert_eq!(
            store.due_timers(29, &all, 10).unwrap(),
            vec![
                timer(0, "a", "t", 10),
                timer(0, "d", "t", 10),
                timer(0, "c", "t", 20)
            ]
        );
        // The disarmed one (held) stays gone; the last due time is reached.
        assert_eq!(store.due_timers(i64::MAX - 1, &all, 10).unwrap().len(), 3);
        assert_eq!(store.due_timers(i64::MAX, &all, 10).unwrap().len(), 4);
    }

    #[test]
    fn disarm_removes_only_that_timer() {
        let store = Store::temporary().unwrap();
        let mut batch = Batch::new();
        batch
            .arm_timer(0, "run-1", "approval", 5)
            .arm_timer(0, "run-1", "retry", 5);
        store.apply(batch).unwrap();
        let mut batch = Batch::new();
        batch.disarm_timer(0, "run-1", "approval", 5);
        store.apply(batch).unwrap();
        assert_eq!(
            store.due_timers(10, &parts(&[0]), 10).unwrap(),
            vec![timer(0, "run-1", "retry", 5)]
        );
    }

    #[test]
    fn a_run_id_with_nul_is_rejected_and_nothing_is_written() {
        let store = Store::temporary().unwrap();
        let mut batch = Batch::new();
        batch.put_run("ok", b"x").arm_timer(0, "a\0b", "t", 1);
        assert!(matches!(store.apply(batch), Err(Error::InvalidRunId(_))));
        assert_eq!(store.get_run("ok").unwrap(), None);
    }

    #[test]
    fn forget_partition_removes_its_offset_and_timers_only() {
        let store = Store::temporary().unwrap();
        let mut batch = Batch::new();
        batch
            .put_run("run-1", b"s")
            .arm_timer(0, "run-1", "t", 1)
            .arm_timer(0, "run-1", "u", 50)
            .arm_timer(1, "run-2", "t", 2)
            .set_changelog_offset(0, 10)
            .set_changelog_offset(1, 20);
        store.apply(batch).unwrap();
        store.forget_partition(0).unwrap();
        assert_eq!(store.changelog_offset(0).unwrap(), None);
        assert_eq!(store.changelog_offset(1).unwrap(), Some(20));
        assert_eq!(
            store.due_timers(100, &parts(&[0, 1]), 10).unwrap(),
            vec![timer(1, "run-2", "t", 2)]
        );
        assert_eq!(store.get_run("run-1").unwrap(), Some(b"s".to_vec()));
    }

    #[test]
    fn wipe_clears_everything_and_keeps_the_marker() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = Store::open(dir.path()).unwrap();
            let mut batch = Batch::new();
            batch
                .put_run("run-1", b"s")
                .arm_timer(0, "run-1", "t", 1)
                .set_changelog_offset(0, 10);
            store.apply(batch).unwrap();
            store.wipe().unwrap();
            assert_eq!(store.get_run("run-1").unwrap(), None);
            assert_eq!(store.changelog_offset(0).unwrap(), None);
            assert!(store.due_timers(100, &parts(&[0]), 10).unwrap().is_empty());
            let mut batch = Batch::new();
            batch.put_run("run-2", b"t");
            store.apply(batch).unwrap();
            store.flush().unwrap();
        }
        // The marker survived the wipe: reopening keeps the data.
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.get_run("run-2").unwrap(), Some(b"t".to_vec()));
    }

    #[test]
    fn states_are_stored_packed_and_read_back_whole() {
        let golden: serde_json::Value =
            serde_json::from_str(include_str!("../../../tests/golden/refund-approved.json"))
                .unwrap();
        let state = serde_json::to_vec(&golden["state"]).unwrap();
        let store = Store::temporary().unwrap();
        let mut batch = Batch::new();
        batch.put_run("run-1", &state).put_run("empty", b"");
        store.apply(batch).unwrap();
        assert_eq!(store.get_run("run-1").unwrap(), Some(state.clone()));
        assert_eq!(store.get_run("empty").unwrap(), Some(Vec::new()));
        let stored = store.db().unwrap().get(run_key("run-1")).unwrap().unwrap();
        assert!(
            stored.len() * 2 < state.len(),
            "{} bytes stored for a {}-byte state",
            stored.len(),
            state.len()
        );
        let runs: Vec<_> = store.runs().collect::<Result<_>>().unwrap();
        assert_eq!(
            runs,
            vec![
                ("empty".to_owned(), Vec::new()),
                ("run-1".to_owned(), state)
            ]
        );
    }

    #[test]
    fn a_cached_state_that_does_not_unpack_is_corrupt() {
        let store = Store::temporary().unwrap();
        // Unpacked JSON (what a `/1` store held), a cut frame, and a frame header that
        // claims 1 TiB: each is an error, and the last allocates nothing.
        let packed = Packed::new(br#"{"run_id":"r"}"#).0;
        let mut huge = vec![0x28, 0xb5, 0x2f, 0xfd, 0xe0];
        huge.extend_from_slice(&(1u64 << 40).to_le_bytes());
        for (run_id, value, says) in [
            ("json", br#"{"run_id":"r"}"#.to_vec(), "no zstd frame"),
            ("cut", packed[..packed.len() - 2].to_vec(), ""),
            ("huge", huge, "it claims 1099511627776 bytes"),
        ] {
            store.raw_insert(&run_key(run_id), &value).unwrap();
            match store.get_run(run_id) {
                Err(Error::Corrupt(why)) => {
                    assert!(why.contains(run_id) && why.contains(says), "{why}")
                }
                other => panic!("{run_id}: {other:?}"),
            }
        }
        assert!(store.runs().any(|r| matches!(r, Err(Error::Corrupt(_)))));
    }

    #[test]
    fn a_db_without_the_marker_is_wiped_on_open() {
        let dir = tempfile::tempdir().unwrap();
        {
            let db = sled::open(dir.path()).unwrap();
            db.insert(run_key("run-1"), b"stale".to_vec()).unwrap();
            db.insert(offset_key(0), &5u64.to_be_bytes()).unwrap();
            db.flush().unwrap();
        }
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.get_run("run-1").unwrap(), None);
        assert_eq!(store.changelog_offset(0).unwrap(), None);
        drop(store);
        // The fresh store has its marker: it is trusted on the next open.
        let store = Store::open(dir.path()).unwrap();
        let mut batch = Batch::new();
        batch.put_run("run-2", b"s");
        store.apply(batch).unwrap();
        store.flush().unwrap();
        drop(store);
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.get_run("run-2").unwrap(), Some(b"s".to_vec()));
    }

    /// The open-interrupt index survives a reopen (its entries are checked, not wiped),
    /// and forgetting a partition removes its entries only.
    #[test]
    fn the_open_interrupt_index_is_kept_and_forgotten_per_partition() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = Store::open(dir.path()).unwrap();
            let mut batch = Batch::new();
            batch
                .open_interrupt(1, "run/a", "int_1", 1_000)
                .open_interrupt(1, "run/b", "int_2", -5)
                .open_interrupt(2, "run/c", "int_3", 7)
                .close_interrupt(1, "run/b", "int_2")
                .open_interrupt(1, "run/b", "int_4", 9);
            store.apply(batch).unwrap();
            store.flush().unwrap();
        }
        let store = Store::open(dir.path()).unwrap();
        let open = |p| store.open_interrupts(p).unwrap();
        assert_eq!(
            open(1),
            [
                ("run/a".to_owned(), "int_1".to_owned(), 1_000),
                ("run/b".to_owned(), "int_4".to_owned(), 9)
            ]
        );
        store.forget_partition(1).unwrap();
        assert!(open(1).is_empty());
        assert_eq!(open(2), [("run/c".to_owned(), "int_3".to_owned(), 7)]);
    }

    #[test]
    fn a_db_with_another_marker_or_unknown_keys_is_wiped_on_open() {
        for (key, value) in [
            (MARKER_KEY, &b"sortie-reducer-store/0"[..]),
            (&b"x/unknown"[..], &b""[..]),
            (&b"t/short"[..], &b""[..]),
            (&b"i/\0\0\0\x01run\0interrupt"[..], &b"short"[..]),
            (&b"i/\0\0\0\x01no-separator"[..], &[0u8; 8][..]),
        ] {
            let dir = tempfile::tempdir().unwrap();
            {
                let store = Store::open(dir.path()).unwrap();
                let mut batch = Batch::new();
                batch.put_run("run-1", b"s");
                store.apply(batch).unwrap();
                store.raw_insert(key, value).unwrap();
                store.flush().unwrap();
            }
            let store = Store::open(dir.path()).unwrap();
            assert_eq!(store.get_run("run-1").unwrap(), None, "key {key:?}");
        }
    }

    #[test]
    fn a_corrupted_directory_is_wiped_and_reopened_empty() {
        for victim in ["conf", "db"] {
            let dir = tempfile::tempdir().unwrap();
            {
                let store = Store::open(dir.path()).unwrap();
                let mut batch = Batch::new();
                batch.put_run("run-1", b"s").set_changelog_offset(0, 7);
                store.apply(batch).unwrap();
                store.flush().unwrap();
            }
            std::fs::write(dir.path().join(victim), vec![0xA5; 4096]).unwrap();
            let store = Store::open(dir.path()).unwrap();
            assert_eq!(store.get_run("run-1").unwrap(), None, "{victim}");
            assert_eq!(store.changelog_offset(0).unwrap(), None, "{victim}");
            // Usable after the wipe.
            let mut batch = Batch::new();
            batch.put_run("run-2", b"t");
            store.apply(batch).unwrap();
            assert_eq!(store.get_run("run-2").unwrap(), Some(b"t".to_vec()));
        }
    }

    #[test]
    fn a_store_locked_by_a_live_handle_is_not_wiped() {
        let dir = tempfile::tempdir().unwrap();
        let first = Store::open(dir.path()).unwrap();
        let mut batch = Batch::new();
        batch.put_run("run-1", b"s");
        first.apply(batch).unwrap();
        assert!(matches!(
            Store::open_waiting(dir.path(), CACHE_CAPACITY, Duration::from_millis(50)),
            Err(Error::Locked { .. })
        ));
        assert_eq!(first.get_run("run-1").unwrap(), Some(b"s".to_vec()));
    }

    #[test]
    fn due_time_encoding_orders_like_i64() {
        let values = [i64::MIN, -1_000, -1, 0, 1, 1_000, i64::MAX];
        for pair in values.windows(2) {
            assert!(encode_due(pair[0]) < encode_due(pair[1]));
        }
        for v in values {
            assert_eq!(decode_due(encode_due(v)), v);
        }
    }
}
