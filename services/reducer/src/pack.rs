//! How the store packs run states: one zstd frame per state, compressed against a
//! dictionary the store trains from its own first states.
//!
//! A state is small (~1 KB) and most of it is structure its run shares with every other
//! run of its graph: field names, node ids, tool names, statuses. Compressed alone, a
//! frame learns none of that and builds its entropy tables afresh (half of zstd's time on
//! a 1 KB state). Against a dictionary of the deployment's own states, zstd starts from
//! both. On the bench's 1M distinct states: ~4.5× smaller frames, compressed ~4.5× and
//! unpacked ~3.5× faster (`docs/performance/`), and sled, whose cost grows with the bytes
//! it holds and rewrites, writes a fraction.
//!
//! - **Trained once per store, from what it packs.** Until a store has a dictionary, the
//!   first [`TRAIN_AFTER`] bytes of states packed (each up to [`MAX_SAMPLE`], at least
//!   [`MIN_SAMPLES`] of them) are kept as samples; then a [`DICTIONARY_BYTES`] dictionary
//!   is trained from them (~50 ms, on the thread that packed the last sample), written to
//!   sled under `z/<id>` and flushed, and every later state is packed against it. States
//!   packed before stay plain frames.
//! - **Every frame names its dictionary.** zstd writes the dictionary's id in the frame
//!   header; a plain frame names none. So a store holds frames of both kinds, and unpacking
//!   looks the id up; a frame naming a dictionary the store does not hold is
//!   [`Error::Corrupt`](crate::store::Error::Corrupt), as any unreadable state (the reducer
//!   then wipes and restores the store at its next start).
//! - **Never ahead of its frames.** The dictionary is flushed to disk before the first
//!   frame that uses it is handed out, so no crash leaves a frame without its dictionary.
//!   Dictionaries are only ever removed with the whole store.
//! - **Stale is still correct.** A dictionary trained on yesterday's graphs packs today's
//!   states less well, never wrongly. Retraining is not done (noted in ARCHITECTURE).

use std::cell::RefCell;
use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Instant;

use zstd::zstd_safe::{self, CCtx, CDict, DCtx, DDict};

use crate::store::{Error, Result};

/// Key prefix of the store's dictionaries: `z/` + id (u32 BE) → the dictionary's bytes.
pub(crate) const DICTIONARY_PREFIX: &[u8] = b"z/";

/// The dictionary's size: a few hundred bytes of structure per graph shape fit many graphs.
pub const DICTIONARY_BYTES: usize = 16 * 1024;

/// Samples gathered before the dictionary is trained: zstd asks for ~100× its size; a
/// thousand 1 KB states gave the ratio in the module doc.
pub const TRAIN_AFTER: usize = 1024 * 1024;

/// Samples at least, whatever their bytes: zstd trains on three quarters of them and
/// refuses fewer than five.
pub const MIN_SAMPLES: usize = 8;

/// The most of one state kept as a sample (its start): memory stays bounded, and a store
/// of large states still trains on many of them.
pub const MAX_SAMPLE: usize = 8 * 1024;

/// The zstd level of every frame: the fastest of the standard levels.
const LEVEL: i32 = 1;

/// The largest state a packed entry may claim to unpack to: a corrupt header must not
/// make the reducer allocate gigabytes. Far above any state (the changelog's records are
/// bounded by the broker's `max.message.bytes`).
const MAX_STATE_BYTES: u64 = 256 * 1024 * 1024;

/// A run state as sled stores it: one zstd frame (level 1) of its bytes, the frame
/// header carrying the state's length and the id of the dictionary it was packed against
/// (none: a plain frame).
///
/// sled's cost grows with the bytes it holds: every insert copies the leaf it lands in
/// (up to 16 states) and its I/O threads write each state about four times (deltas,
/// page consolidations, splits). The state is packed once, by whoever makes it: the
/// restore's decoder thread, or the commit that wrote it.
#[derive(Debug, Clone)]
pub struct Packed(pub(crate) Vec<u8>);

impl Packed {
    /// Packs a state's bytes in a plain frame (no dictionary); [`Dictionaries::pack`]
    /// is how the store packs.
    pub fn new(state: &[u8]) -> Packed {
        Packed::with(state, None)
    }

    /// Packs a state's bytes in one frame, against `dictionary` if given.
    fn with(state: &[u8], dictionary: Option<&Dictionary>) -> Packed {
        PACKER.with(|packer| {
            let mut packer = packer.borrow_mut();
            let mut packed = Vec::with_capacity(zstd_safe::compress_bound(state.len()));
            match dictionary {
                Some(dictionary) => {
                    packer.compress_using_cdict(&mut packed, state, &dictionary.compress)
                }
                None => packer.compress(&mut packed, state, LEVEL),
            }
            // zstd fails only when out of memory or on a state over 4 GiB: both beyond
            // any state this reducer has already held in memory.
            .expect("zstd packs a state");
            packed.shrink_to_fit();
            Packed(packed)
        })
    }

    /// The packed size: what sled holds for the state.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Never: even an empty state has a frame header.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The dictionary this state was packed against, if any.
    pub fn dictionary(&self) -> Option<u32> {
        zstd_safe::get_dict_id_from_frame(&self.0).map(NonZeroU32::get)
    }
}

thread_local! {
    // One context each way per thread, for plain frames and dictionary ones alike: making
    // one per state cost more than sled saved.
    static PACKER: RefCell<CCtx<'static>> = RefCell::new(CCtx::create());
    static UNPACKER: RefCell<DCtx<'static>> = RefCell::new(DCtx::create());
}

/// One dictionary, prepared both ways.
struct Dictionary {
    id: u32,
    bytes: Vec<u8>,
    compress: CDict<'static>,
    decompress: DDict<'static>,
}

impl Dictionary {
    fn prepare(id: u32, bytes: &[u8]) -> Option<Dictionary> {
        Some(Dictionary {
            id,
            bytes: bytes.to_vec(),
            compress: CDict::try_create(bytes, LEVEL)?,
            decompress: DDict::try_create(bytes)?,
        })
    }
}

#[derive(Default)]
struct Held {
    by_id: HashMap<u32, Arc<Dictionary>>,
    /// What new states are packed against: the newest dictionary.
    current: Option<Arc<Dictionary>>,
}

#[derive(Default)]
struct Samples {
    data: Vec<u8>,
    sizes: Vec<usize>,
}

/// A store's dictionaries, and the samples its first one is trained from.
pub(crate) struct Dictionaries {
    held: RwLock<Held>,
    /// Still gathering samples (no dictionary yet, none being trained).
    sampling: AtomicBool,
    samples: std::sync::Mutex<Samples>,
    pub(crate) train_after: usize,
}

impl std::fmt::Debug for Dictionaries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = self.held.read().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("Dictionaries")
            .field("ids", &held.by_id.keys().collect::<Vec<_>>())
            .field("current", &held.current.as_ref().map(|d| d.id))
            .finish()
    }
}

impl Dictionaries {
    /// The dictionaries stored in `db` (checked by the store's open: each entry's id is its
    /// key's); the store samples for its first one if it holds none.
    pub(crate) fn load(db: &sled::Db, train_after: usize) -> Result<Dictionaries> {
        let mut held = Held::default();
        for entry in db.scan_prefix(DICTIONARY_PREFIX) {
            let (key, bytes) = entry?;
            let id = dictionary_id(&key, &bytes)
                .ok_or_else(|| Error::Corrupt(format!("dictionary entry {key:?} is malformed")))?;
            let dictionary = Dictionary::prepare(id, &bytes).ok_or_else(|| {
                Error::Corrupt(format!("zstd cannot load dictionary {id} of the store"))
            })?;
            held.by_id.insert(id, Arc::new(dictionary));
        }
        // Ids are random: the newest is not the largest, but a store trains only one.
        held.current = held.by_id.values().max_by_key(|d| d.id).cloned();
        let sampling = held.current.is_none();
        Ok(Dictionaries {
            held: RwLock::new(held),
            sampling: AtomicBool::new(sampling),
            samples: std::sync::Mutex::default(),
            train_after,
        })
    }

    /// Every dictionary held, as stored: `(key, bytes)`.
    pub(crate) fn entries(&self) -> Vec<([u8; 6], Vec<u8>)> {
        let held = self.held.read().unwrap_or_else(PoisonError::into_inner);
        held.by_id
            .values()
            .map(|d| (dictionary_key(d.id), d.bytes.clone()))
            .collect()
    }

    /// The dictionary new states are packed against, if the store has one.
    pub(crate) fn current(&self) -> Option<u32> {
        let held = self.held.read().unwrap_or_else(PoisonError::into_inner);
        held.current.as_ref().map(|d| d.id)
    }

    /// Packs a state against the current dictionary (plain while there is none, and then
    /// kept as a sample; the sample that completes the set trains the dictionary, which
    /// `db` stores before it is used).
    pub(crate) fn pack(&self, state: &[u8], db: &sled::Db) -> Packed {
        let current = {
            let held = self.held.read().unwrap_or_else(PoisonError::into_inner);
            held.current.clone()
        };
        if let Some(dictionary) = current {
            return Packed::with(state, Some(&dictionary));
        }
        if self.sampling.load(Ordering::Relaxed) {
            self.sample(state, db);
        }
        Packed::new(state)
    }

    fn sample(&self, state: &[u8], db: &sled::Db) {
        let full = {
            let mut samples = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
            if !self.sampling.load(Ordering::Relaxed) {
                return;
            }
            let sample = &state[..state.len().min(MAX_SAMPLE)];
            samples.data.extend_from_slice(sample);
            samples.sizes.push(sample.len());
            if samples.data.len() < self.train_after || samples.sizes.len() < MIN_SAMPLES {
                return;
            }
            // This thread trains; nobody samples any more.
            self.sampling.store(false, Ordering::Relaxed);
            std::mem::take(&mut *samples)
        };
        let started = Instant::now();
        match self.train(&full, db) {
            Ok(id) => tracing::info!(
                dictionary = id,
                samples = full.sizes.len(),
                sampled_bytes = full.data.len(),
                millis = started.elapsed().as_millis() as u64,
                "Trained the store's zstd dictionary: run states are packed against it from now on."
            ),
            // Plain frames are only bigger: the store goes on without one until restarted.
            Err(reason) => tracing::warn!(
                samples = full.sizes.len(),
                %reason,
                "No zstd dictionary could be made for the store: run states stay packed alone."
            ),
        }
    }

    fn train(&self, samples: &Samples, db: &sled::Db) -> Result<u32, String> {
        let bytes = zstd::dict::from_continuous(&samples.data, &samples.sizes, DICTIONARY_BYTES)
            .map_err(|e| format!("zstd could not train one: {e}"))?;
        let id = zstd_safe::get_dict_id_from_dict(&bytes)
            .ok_or("the trained dictionary has no id")?
            .get();
        let dictionary =
            Dictionary::prepare(id, &bytes).ok_or("zstd cannot load the trained dictionary")?;
        let key = dictionary_key(id);
        // On disk before any frame names it: a crash must not leave frames without it.
        db.compare_and_swap(key, None as Option<&[u8]>, Some(bytes))
            .map_err(|e| format!("sled could not store it: {e}"))?
            .map_err(|_| format!("the store already holds a dictionary {id}"))?;
        db.flush()
            .map_err(|e| format!("sled could not flush it: {e}"))?;
        let dictionary = Arc::new(dictionary);
        let mut held = self.held.write().unwrap_or_else(PoisonError::into_inner);
        held.by_id.insert(id, dictionary.clone());
        held.current = Some(dictionary);
        Ok(id)
    }

    /// Unpacks a state packed by [`Dictionaries::pack`] or [`Packed::new`].
    pub(crate) fn unpack(&self, run_id: &str, packed: &[u8]) -> Result<Vec<u8>> {
        let corrupt = |why: String| Error::Corrupt(format!("cached state of run {run_id}: {why}"));
        let len = match zstd_safe::get_frame_content_size(packed) {
            Ok(Some(len)) if len <= MAX_STATE_BYTES => len as usize,
            Ok(Some(len)) => return Err(corrupt(format!("it claims {len} bytes"))),
            Ok(None) | Err(_) => return Err(corrupt("no zstd frame with its size".to_owned())),
        };
        let dictionary = match zstd_safe::get_dict_id_from_frame(packed) {
            None => None,
            Some(id) => {
                let held = self.held.read().unwrap_or_else(PoisonError::into_inner);
                let dictionary = held.by_id.get(&id.get()).cloned().ok_or_else(|| {
                    corrupt(format!(
                        "it was packed against zstd dictionary {id}, which the store does not hold"
                    ))
                })?;
                Some(dictionary)
            }
        };
        let mut state = Vec::with_capacity(len);
        UNPACKER
            .with(|unpacker| {
                let mut unpacker = unpacker.borrow_mut();
                match &dictionary {
                    Some(dictionary) => {
                        unpacker.decompress_using_ddict(&mut state, packed, &dictionary.decompress)
                    }
                    None => unpacker.decompress(&mut state, packed),
                }
            })
            .map_err(|code| corrupt(zstd_safe::get_error_name(code).to_owned()))?;
        if state.len() == len {
            Ok(state)
        } else {
            Err(corrupt(format!("{} bytes, not {len}", state.len())))
        }
    }
}

/// `z/` + id.
pub(crate) fn dictionary_key(id: u32) -> [u8; 6] {
    let mut key = [0; 6];
    key[..2].copy_from_slice(DICTIONARY_PREFIX);
    key[2..].copy_from_slice(&id.to_be_bytes());
    key
}

/// The id of a dictionary entry whose key names the id its bytes carry.
pub(crate) fn dictionary_id(key: &[u8], bytes: &[u8]) -> Option<u32> {
    let id = u32::from_be_bytes(key.strip_prefix(DICTIONARY_PREFIX)?.try_into().ok()?);
    (zstd_safe::get_dict_id_from_dict(bytes).map(NonZeroU32::get) == Some(id)).then_some(id)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::store::{Batch, Store};

    /// A run state of one graph shape with its own payload and ids, as a deployment's
    /// states are: the structure shared, the values not.
    fn state(i: usize) -> Vec<u8> {
        let token = |salt: usize| -> String {
            let mut x = (i * 7919 + salt * 104_729) as u64 ^ 0x9E37_79B9_7F4A_7C15;
            (0..40)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    char::from(
                        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
                            [(x % 62) as usize],
                    )
                })
                .collect()
        };
        format!(
            r#"{{"tenant":"acme","run_id":"run-{i:08}","graph_id":"triage","status":"RUNNING","steps":{{"classify#1":{{"operation_id":"{}","tool":"llm.classify","status":"succeeded","output":{{"label":"{}"}}}},"notify#1":{{"operation_id":"{}","tool":"slack.post","status":"dispatched","args":{{"text":"{}"}}}}}}}}"#,
            token(1),
            token(2),
            token(3),
            token(4)
        )
        .into_bytes()
    }

    /// A temporary store that has trained its dictionary (after 16 KiB of samples).
    fn trained_store() -> Store {
        let store = Store::temporary().unwrap().with_dictionary_after(16 * 1024);
        let mut i = 0;
        while store.dictionary().is_none() {
            store.pack(&state(i));
            i += 1;
        }
        store
    }

    fn put(store: &Store, i: usize) -> Packed {
        let packed = store.pack(&state(i));
        let mut batch = Batch::new();
        batch.put_packed(&format!("run-{i:08}"), packed.clone());
        store.apply(batch).unwrap();
        packed
    }

    /// The first states go out plain and are sampled; the sample that completes the set
    /// trains the dictionary, stored before any frame names it; later states are packed
    /// against it, much smaller; every state unpacks, before and after the store is
    /// closed and opened again, and the reopened store packs against the same dictionary.
    /// (Red with the dictionary not written to sled: the reopened store could not unpack
    /// the later states.)
    #[test]
    fn a_store_trains_its_dictionary_from_its_first_states_and_keeps_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path())
            .unwrap()
            .with_dictionary_after(64 * 1024);
        let mut first_with = None;
        let mut packed = Vec::new();
        for i in 0..600 {
            let p = put(&store, i);
            if p.dictionary().is_some() && first_with.is_none() {
                first_with = Some(i);
            }
            packed.push(p);
        }
        let id = store
            .dictionary()
            .expect("a dictionary after 64 KiB of samples");
        let first_with = first_with.expect("states packed against it");
        // The state that completes 64 KiB of samples is the last one packed plain.
        let mut sampled = 0;
        let completes = (0..)
            .find(|i| {
                sampled += state(*i).len();
                sampled >= 64 * 1024
            })
            .unwrap();
        assert_eq!(first_with, completes + 1);
        assert!(packed[..first_with]
            .iter()
            .all(|p| p.dictionary().is_none()));
        assert!(packed[first_with..]
            .iter()
            .all(|p| p.dictionary() == Some(id)));
        let plain: usize = (first_with..600)
            .map(|i| Packed::new(&state(i)).len())
            .sum();
        let against: usize = packed[first_with..].iter().map(Packed::len).sum();
        assert!(
            against * 2 < plain,
            "against the dictionary {against} B, plain {plain} B"
        );
        let all_unpack = |store: &Store| {
            for i in 0..600 {
                let got = store.get_run(&format!("run-{i:08}")).unwrap();
                assert_eq!(got.as_deref(), Some(&state(i)[..]), "run {i}");
            }
        };
        all_unpack(&store);
        drop(store);

        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.dictionary(), Some(id));
        all_unpack(&store);
        assert_eq!(put(&store, 600).dictionary(), Some(id));
        // A wipe keeps the dictionary: frames packed against it may be in flight.
        store.wipe().unwrap();
        let p = put(&store, 601);
        drop(store);
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(p.dictionary(), Some(id));
        assert_eq!(store.get_run("run-00000601").unwrap(), Some(state(601)));
    }

    /// A frame naming a dictionary the store does not hold is an unreadable state (the
    /// reducer then wipes and restores the store), not a panic or garbage.
    #[test]
    fn a_state_packed_against_a_dictionary_the_store_lacks_is_corrupt() {
        let trained = trained_store();
        let foreign = trained.pack(&state(0));
        assert!(foreign.dictionary().is_some());

        let store = Store::temporary().unwrap();
        let mut batch = Batch::new();
        batch.put_packed("run-x", foreign);
        store.apply(batch).unwrap();
        match store.get_run("run-x") {
            Err(Error::Corrupt(why)) => assert!(why.contains("dictionary"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    /// A dictionary entry whose bytes are not the dictionary its key names makes the store
    /// untrusted: it is wiped on open.
    #[test]
    fn a_malformed_dictionary_entry_wipes_the_store_on_open() {
        let trained = trained_store();
        let (key, bytes) = trained.dictionaries.entries().remove(0);
        let mut other_key = key;
        other_key[5] ^= 1;
        for (key, value) in [
            (other_key.to_vec(), bytes.clone()),
            (key.to_vec(), bytes[..100].to_vec()),
            (b"z/\0\0\0".to_vec(), bytes.clone()),
        ] {
            let dir = tempfile::tempdir().unwrap();
            {
                let store = Store::open(dir.path()).unwrap();
                let mut batch = Batch::new();
                batch.put_run("run-1", b"s");
                store.apply(batch).unwrap();
                store.raw_insert(&key, &value).unwrap();
                store.flush().unwrap();
            }
            let store = Store::open(dir.path()).unwrap();
            assert_eq!(store.get_run("run-1").unwrap(), None, "key {key:?}");
            assert_eq!(store.dictionary(), None);
        }
    }
}
