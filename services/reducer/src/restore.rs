//! Restoring newly assigned partitions' run states from the compacted `sortie.run-state`
//! changelog into sled: from the cache's marker (warm: reads almost nothing) or from the
//! beginning (cold: a new pod, or a cache that could not be trusted).
//!
//! One consumer reads every partition of an assignment at once, to the end of each (its
//! high watermark at the start, read `read_committed`, so an open transaction of the
//! previous owner is waited out, not skipped). The caller has already fetched the input
//! offsets with stable semantics (KIP-447), so that owner's last transaction is decided
//! and its changelog records are below the high watermark read here (they were
//! acknowledged by every in-sync replica before the commit was asked for).
//!
//! The end must be the *high watermark*, asked `read_uncommitted` (the engine's `marks`
//! client), not the last stable offset: a decided transaction's markers reach the
//! __consumer_offsets partition and each changelog partition independently, so the
//! offsets can be stable while a changelog partition's last stable offset is still below
//! that transaction's records. A restore ending there would consume inputs past the
//! transaction without its states (the runs it started unknown to their new owner). Kafka
//! Streams met the same (KAFKA-10167). `services/reducer` test
//! `a_changelog_transaction_open_at_a_restore_is_waited_out` holds it.
//!
//! A changelog record is our own output: if one cannot be decoded (after waiting out a
//! registry outage), its partition stops there — logged with topic, partition and offset,
//! counted, and reported so the partition is not consumed and the reducer is not ready —
//! rather than being skipped while the marker moves past it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use sortie_core::RunState;
use sortie_kafka::read::{Next, ReadError, ReaderContext};
use sortie_kafka::KafkaConfig;
use sortie_wire::records as w;
use sortie_wire::{Codec, Topics};
use tokio::runtime::Handle;

use crate::convert;
use crate::driver::Error;
use crate::fault::FaultPoint;
use crate::gauges::{Contribution, Shares};
use crate::store::{Batch, Packed, Store};

/// Records per chunk of a restore: their states are written to sled as they are applied,
/// then the chunk's timers and changelog marker in one atomic batch.
const CHUNK: usize = 4_000;

/// How long one assignment's restore may take before it is given up and retried with
/// rebuilt clients. It runs inside the rebalance callback, so it must end well inside
/// `max.poll.interval.ms` (300 s): past that the member would be dropped from the group
/// while still restoring. Giving up loses no work: every chunk is stored with its
/// changelog offset, so the next assignment goes on from there.
const DEADLINE: Duration = Duration::from_secs(120);

/// Records per chunk handed to the decoder thread, and chunks it may be behind.
const DECODE_CHUNK: usize = 256;
const DECODE_AHEAD: usize = 16;

/// The restore consumer's fetch sizes and prefetch bound (see where they are set).
const FETCH_MAX_BYTES: &str = "2097152";
const PARTITION_FETCH_MAX_BYTES: &str = "131072";
const QUEUED_MAX_KBYTES: &str = "16384";
/// How long a partition whose prefetch queue is full waits before it is fetched again
/// (librdkafka's default, 1 s, stalled a restore that had caught up with its queue).
const FETCH_QUEUE_BACKOFF_MS: &str = "10";

/// How often a long restore says how far it is.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// The outcome of restoring an assignment.
#[derive(Debug, Default)]
pub struct Restored {
    /// Changelog records read, per partition.
    pub records: BTreeMap<i32, usize>,
    /// Runs quarantined by this restore: their latest changelog record does not read
    /// back.
    pub quarantined: usize,
    /// Bytes of run state written to the store.
    pub written: u64,
    /// What sled is estimated to keep in memory of this restore's writes
    /// ([`crate::store::retained`]).
    pub unreleased: u64,
}

struct Progress {
    next: i64,
    high: i64,
    warm: bool,
    pending: usize,
    batch: Batch,
    /// Timers armed by the current chunk, per run: a later record of the same run in the
    /// chunk disarms them. They are in the chunk's batch, not in sled yet (a cold
    /// partition does not read the cache at all; a warm one reads the run's state, which
    /// is written at once, for its timers). Chunk-local, so memory stays bounded on a cold
    /// restore of a million runs; across chunks sled has state and timers (warm restores
    /// read them). A stale timer left behind only fires and is ignored.
    armed: HashMap<String, BTreeMap<String, i64>>,
    /// Counted partitions: each run's share of the gauges as this restore last read it.
    shares: Option<Shares>,
}

/// A run's share of the gauges before a restored record (as the cache held it, or as an
/// earlier record of the restore had it), and as the record has it (`None`: absent).
pub type Change<'a> = (
    i32,
    &'a str,
    Option<&'a Contribution>,
    Option<&'a Contribution>,
);

/// Asks one end (log start or high watermark) of several partitions of a topic at once;
/// a partition missing from the answer fails the restore.
pub type Ends<'a> = dyn Fn(&str, &[i32], sortie_kafka::End) -> Result<BTreeMap<i32, i64>, rdkafka::error::KafkaError>
    + 'a;

/// What a restore reads with and writes to.
#[derive(Debug, Clone, Copy)]
pub struct Sources<'a> {
    pub kafka: &'a KafkaConfig,
    pub topics: &'a Topics,
    pub codec: &'a Codec,
    pub runtime: &'a Handle,
    pub store: &'a Store,
    /// The reducer's fault point (crash tests) and on which pass it fires.
    pub fault: Option<FaultPoint>,
    pub fault_after: u32,
}

/// Restores `plan` (partition → the next changelog offset sled reflects, `None`: nothing).
/// For the partitions in `count`, every change of a run's share of the gauges is also
/// handed to `observe`: a cold partition's from nothing, a warm one's from what the cache
/// held.
pub fn partitions(
    sources: Sources<'_>,
    plan: &BTreeMap<i32, Option<u64>>,
    count: &std::collections::BTreeSet<i32>,
    observe: &mut dyn FnMut(Change<'_>),
    ends: &Ends<'_>,
) -> Result<Restored, Error> {
    let Sources {
        kafka,
        topics,
        codec,
        runtime,
        store,
        fault,
        fault_after,
    } = sources;
    let mut restored = Restored::default();
    if plan.is_empty() {
        return Ok(restored);
    }
    let topic = topics.run_state();
    let deadline = Instant::now() + DEADLINE;
    let mut progress: BTreeMap<i32, Progress> = BTreeMap::new();
    let mut assignment = TopicPartitionList::new();
    // Asked through the caller's client, every partition in one request: a warm restart
    // with nothing to read creates no consumer at all.
    let all: Vec<i32> = plan.keys().copied().collect();
    let highs = ends(&topic, &all, sortie_kafka::End::Latest)?;
    let cold: Vec<i32> = plan
        .iter()
        .filter(|(_, from)| from.is_none())
        .map(|(partition, _)| *partition)
        .collect();
    // A cold partition starts at its log start, asked here rather than left to the
    // consumer (`Offset::Beginning` makes librdkafka look it up after the first fetch
    // request left, and the partition then waits out that fetch).
    let starts = ends(&topic, &cold, sortie_kafka::End::Earliest)?;
    let unanswered =
        |partition: i32| Error::Setup(format!("no offset of {topic}[{partition}] was answered"));
    for (&partition, &from) in plan {
        let high = *highs.get(&partition).ok_or_else(|| unanswered(partition))?;
        if from.is_none() {
            store.forget_partition(partition)?;
        }
        let next = match from {
            Some(offset) => offset as i64,
            None => *starts
                .get(&partition)
                .ok_or_else(|| unanswered(partition))?,
        };
        restored.records.insert(partition, 0);
        if next >= high {
            // Nothing to read. A cold partition gets its marker now (an empty partition
            // would otherwise be cold at every start, its runs counted by a full scan).
            if from.is_none() {
                let mut batch = Batch::default();
                batch.set_changelog_offset(partition, high.max(0) as u64);
                store.apply(batch)?;
            }
            continue;
        }
        if from.is_some() {
            // States past the marker reach sled before the marker moves: after a crash in
            // between, the tally stored with the marker would no longer reflect the cache,
            // so the next assignment counts the runs instead. The caller stores the tally
            // again once the restore is done.
            store.forget_tally(partition)?;
        }
        assignment.add_partition_offset(&topic, partition, Offset::Offset(next))?;
        progress.insert(
            partition,
            Progress {
                next,
                high,
                warm: from.is_some(),
                pending: 0,
                batch: Batch::default(),
                armed: HashMap::new(),
                shares: count.contains(&partition).then(Shares::default),
            },
        );
    }
    if progress.is_empty() {
        return Ok(restored);
    }
    let mut config = client(kafka, topics, "read_committed");
    config
        // librdkafka decompresses every batch of a fetch response as it arrives, and
        // holds the result until the messages are consumed; its queue limit gates only
        // the next fetch. So a response's size times the changelog's compression ratio
        // is what one fetch can cost in memory: 2 MiB responses keep that bounded even
        // for a changelog of near-identical states (77× in the bench's old synthetic
        // copies: one 64 MiB response was ~1.6 GiB). Within that, 128 KiB a partition
        // (32 KiB before) and a 16 MiB prefetch queue (64 MiB, librdkafka's default)
        // restored 1M distinct states at ~70k/s instead of ~54k, with the peak at
        // ~390 MiB instead of 530–820; the copies restored as fast as before with a
        // peak of ~630 MiB instead of ~500. README "Performance".
        .set("fetch.max.bytes", FETCH_MAX_BYTES)
        .set("max.partition.fetch.bytes", PARTITION_FETCH_MAX_BYTES)
        .set("queued.max.messages.kbytes", QUEUED_MAX_KBYTES)
        .set("fetch.queue.backoff.ms", FETCH_QUEUE_BACKOFF_MS)
        // A partition whose tail is only transaction markers (a warm restart: the last
        // commit's) delivers no message; its end event wakes the read at once instead of
        // a 200 ms poll timeout later.
        .set("enable.partition.eof", "true");
    let consumer: BaseConsumer<ReaderContext> = config.create_with_context(ReaderContext)?;
    consumer.assign(&assignment)?;

    let spans = progress
        .iter()
        .map(|(&k, p)| (k, (p.next, p.high)))
        .collect();
    let mut quarantined: HashSet<String> = store
        .quarantined()?
        .into_iter()
        .map(|(run, _)| run)
        .collect();
    let mut applier = Applier {
        topic: &topic,
        store,
        observe,
        progress: &mut progress,
        restored: &mut restored,
        quarantined: &mut quarantined,
        fault: (fault, fault_after),
    };
    // Decoding (Avro, then the state's JSON) runs on a second thread, a chunk at a time,
    // while this one reads and writes sled: records come back in the order they were
    // read, so every run's records are still applied in offset order.
    let (to_decoder, decoder_in) = mpsc::sync_channel::<Vec<Raw>>(DECODE_AHEAD);
    let (decoder_out, from_decoder) = mpsc::channel::<Vec<Decoded>>();
    let counted = count.clone();
    let reached = std::thread::scope(|scope| -> Result<BTreeMap<i32, i64>, Error> {
        scope.spawn(move || {
            for chunk in decoder_in {
                let decoded = chunk
                    .into_iter()
                    .map(|raw| {
                        let share = counted.contains(&raw.partition);
                        decode(raw, codec, runtime, store, share)
                    })
                    .collect();
                if decoder_out.send(decoded).is_err() {
                    return;
                }
            }
        });
        let mut said = Instant::now();
        let mut read = 0usize;
        let mut pending: Vec<Raw> = Vec::with_capacity(DECODE_CHUNK);
        let reached = sortie_kafka::read::to_end(&consumer, &topic, &spans, deadline, |message| {
            read += 1;
            if said.elapsed() >= PROGRESS_EVERY {
                said = Instant::now();
                let behind: Vec<i32> = applier
                    .progress
                    .iter()
                    .filter(|(_, p)| p.next < p.high)
                    .map(|(partition, _)| *partition)
                    .collect();
                tracing::info!(
                    records = read,
                    ?behind,
                    "Restoring: still reading the changelog."
                );
            }
            let partition = message.partition();
            if !applier.progress.contains_key(&partition) {
                // Not a partition of this restore.
                return Ok(Next::StopPartition);
            }
            *applier.restored.records.entry(partition).or_default() += 1;
            pending.push(Raw {
                partition,
                offset: message.offset(),
                key: message
                    .key()
                    .map(|k| String::from_utf8_lossy(k).into_owned()),
                payload: message.payload().map(<[u8]>::to_vec),
            });
            if pending.len() >= DECODE_CHUNK {
                let chunk = std::mem::replace(&mut pending, Vec::with_capacity(DECODE_CHUNK));
                // Blocks when the decoder is DECODE_AHEAD chunks behind: memory stays
                // bounded.
                to_decoder
                    .send(chunk)
                    .map_err(|_| Error::Setup("the restore's decoder thread stopped".into()))?;
            }
            for decoded in from_decoder.try_iter() {
                applier.apply_all(decoded)?;
            }
            Ok::<_, Error>(Next::More)
        })
        .map_err(|e| match e {
            ReadError::Handler(e) => e,
            ReadError::Kafka(e) => Error::from(e),
            timeout @ ReadError::Timeout { .. } => Error::Setup(format!("restoring: {timeout}")),
        });
        if !pending.is_empty() {
            let _ = to_decoder.send(pending);
        }
        drop(to_decoder);
        let reached = reached?;
        for decoded in from_decoder.iter() {
            applier.apply_all(decoded)?;
        }
        Ok(reached)
    })?;
    for (partition, p) in progress {
        // Transaction markers past the last record count as read.
        let next = reached
            .get(&partition)
            .copied()
            .unwrap_or(p.next)
            .max(p.next);
        if p.pending > 0 {
            before_marker(store, (fault, fault_after))?;
        }
        let mut batch = p.batch;
        batch.set_changelog_offset(partition, next.max(0) as u64);
        store.apply(batch)?;
    }
    // Closing a consumer takes librdkafka ~100 ms; nothing waits for it.
    std::thread::spawn(move || {
        drop(consumer);
        release_freed_memory();
    });
    Ok(restored)
}

/// The `reducer.restore_before_marker` fault point: a chunk's states are in sled, its
/// timers and marker are not. sled is flushed first, as its background flush (every
/// 500 ms) may have been at any moment: a crash here finds those states on disk.
fn before_marker(store: &Store, (fault, after): (Option<FaultPoint>, u32)) -> Result<(), Error> {
    if sortie_kafka::fault::armed(fault, after, FaultPoint::RestoreBeforeMarker) {
        store.flush()?;
    }
    crate::fault::check(fault, after, FaultPoint::RestoreBeforeMarker);
    Ok(())
}

/// Hands the memory freed by a restore back to the OS. librdkafka allocates with the C
/// allocator (the services' Rust allocator is mimalloc), on its broker threads: glibc
/// keeps what those threads' arenas freed — the decompressed fetches of a whole
/// restore — and a reducer stayed at 370–1,380 MiB after a cold restore of 1M runs
/// instead of ~300. Takes ~30 ms, on the thread that closed the consumer.
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let started = Instant::now();
        // SAFETY: `malloc_trim` takes a plain size and only releases free memory of
        // glibc's arenas; it has no preconditions.
        #[allow(unsafe_code)]
        let released = unsafe { libc::malloc_trim(0) } == 1;
        tracing::debug!(
            released,
            millis = started.elapsed().as_millis() as u64,
            "Released the restore's freed memory."
        );
    }
}

/// A client of the restore's (never subscribes, never commits) with `isolation`: the
/// reader is `read_committed`, the engine's watermark client `read_uncommitted`.
pub(crate) fn client(kafka: &KafkaConfig, topics: &Topics, isolation: &str) -> ClientConfig {
    let mut config = kafka.client();
    config
        .set("group.id", format!("{}restore", topics.prefix()))
        .set("enable.auto.commit", "false")
        .set("isolation.level", isolation)
        .set("allow.auto.create.topics", "false");
    config
}

/// One changelog record as read, before decoding.
struct Raw {
    partition: i32,
    offset: i64,
    key: Option<String>,
    payload: Option<Vec<u8>>,
}

/// One changelog record after the decoder thread.
struct Decoded {
    partition: i32,
    offset: i64,
    key: Option<String>,
    /// `None`: a tombstone. Else the state, or why it does not decode.
    value: Option<Result<Restoring, String>>,
}

/// What the applying thread needs of a decoded state.
struct Restoring {
    /// The changelog's JSON, packed for sled here (against the store's dictionary),
    /// off the applying thread.
    state: Packed,
    timers: BTreeMap<String, i64>,
    /// The run's share of the gauges, for a counted partition. The state itself is
    /// dropped on the decoder thread, which allocated it, so the applying thread never
    /// spends its time freeing states (see `docs/performance/log.md`).
    share: Option<Contribution>,
}

/// Decodes a record fully — Avro, then the state's JSON into a [`RunState`] — so a state
/// this build cannot read stops its partition here, at the restore, not at the run's
/// next input.
fn decode(raw: Raw, codec: &Codec, runtime: &Handle, store: &Store, share: bool) -> Decoded {
    let value = raw.payload.map(|payload| {
        runtime
            .block_on(codec.decode_patiently::<w::RunState>(Some(&payload), None))
            .map_err(|e| e.to_string())
            .and_then(|r| {
                let mut state = convert::state_from_wire(&r).map_err(|e| e.0)?;
                let share = share.then(|| Contribution::of(&state));
                Ok(Restoring {
                    state: store.pack(r.state.as_bytes()),
                    timers: std::mem::take(&mut state.timers),
                    share,
                })
            })
    });
    Decoded {
        partition: raw.partition,
        offset: raw.offset,
        key: raw.key,
        value,
    }
}

/// Applies decoded records to sled, in the order they were read.
struct Applier<'a> {
    topic: &'a str,
    store: &'a Store,
    observe: &'a mut dyn FnMut(Change<'_>),
    progress: &'a mut BTreeMap<i32, Progress>,
    restored: &'a mut Restored,
    /// Runs quarantined in the store: a later record of theirs that reads releases them.
    quarantined: &'a mut HashSet<String>,
    /// The configured fault point and its pass.
    fault: (Option<FaultPoint>, u32),
}

impl Applier<'_> {
    fn apply_all(&mut self, decoded: Vec<Decoded>) -> Result<(), Error> {
        for record in decoded {
            self.apply(record)?;
        }
        Ok(())
    }

    fn apply(&mut self, record: Decoded) -> Result<(), Error> {
        let Decoded {
            partition,
            offset,
            key,
            value,
        } = record;
        let store = self.store;
        let Some(p) = self.progress.get_mut(&partition) else {
            return Ok(()); // not a partition of this restore
        };
        p.next = offset + 1;
        let Some(key) = key else {
            return Ok(());
        };
        if let Some(armed) = p.armed.remove(&key) {
            // An earlier record of this restore armed these.
            for (timer, due) in &armed {
                p.batch.disarm_timer(partition, &key, timer, *due);
            }
        }
        let counted = p.shares.is_some();
        let share = match &value {
            Some(Ok(restoring)) => restoring.share.as_ref(),
            _ => None,
        };
        // An undecodable record takes the run out of the gauges, as a tombstone does.
        let mut before = match &mut p.shares {
            Some(shares) => shares.replace(&key, share),
            None => None,
        };
        if !matches!(value, Some(Err(_))) && self.quarantined.remove(&key) {
            // Its latest record reads: the run is back.
            store.set_quarantine(&key, None)?;
            tracing::info!(
                run_id = key,
                "A quarantined run's changelog record reads again; it is released."
            );
        }
        if p.warm {
            // The cache holds an older state of this run: its timers go.
            if let Some(old) = store.get_run(&key)? {
                let old: RunState = serde_json::from_slice(&old).map_err(|e| {
                    crate::store::Error::Corrupt(format!("cached state of run {key}: {e}"))
                })?;
                for (timer, due) in &old.timers {
                    p.batch.disarm_timer(partition, &key, timer, *due);
                }
                if counted && before.is_none() {
                    before = Some(Contribution::of(&old));
                }
            }
        }
        match value {
            None => {
                store.write_run(&key, None)?;
                if counted {
                    (self.observe)((partition, &key, before.as_ref(), None));
                }
            }
            Some(Ok(Restoring {
                state,
                timers,
                share,
            })) => {
                for (timer, due) in &timers {
                    p.batch.arm_timer(partition, &key, timer, *due);
                }
                if !timers.is_empty() {
                    p.armed.insert(key.clone(), timers);
                }
                self.restored.written += state.len() as u64;
                self.restored.unreleased += crate::store::retained(1, state.len() as u64);
                store.write_run(&key, Some(state))?;
                if let Some(share) = &share {
                    (self.observe)((partition, &key, before.as_ref(), Some(share)));
                }
            }
            Some(Err(e)) => {
                // One unreadable record is one run, not the partition: the run is
                // quarantined (its inputs are dead-lettered, see `Engine::handle`), the
                // others are restored and served.
                let topic = self.topic;
                let reason = format!(
                    "{topic}[{partition}] offset {offset}: the record of run {key} does not decode: {e}"
                );
                tracing::error!(
                    topic,
                    partition,
                    offset,
                    run_id = key,
                    error = %e,
                    "A changelog record does not decode: its run is quarantined, the partition goes on."
                );
                store.write_run(&key, None)?;
                store.set_quarantine(&key, Some(&reason))?;
                if counted {
                    (self.observe)((partition, &key, before.as_ref(), None));
                }
                self.quarantined.insert(key);
                self.restored.quarantined += 1;
            }
        }
        p.pending += 1;
        if p.pending >= CHUNK {
            // The chunk's states are in sled already; its timers and marker follow.
            before_marker(store, self.fault)?;
            let mut batch = std::mem::take(&mut p.batch);
            batch.set_changelog_offset(partition, p.next as u64);
            store.apply(batch)?;
            p.pending = 0;
            p.armed.clear();
        }
        Ok(())
    }
}
