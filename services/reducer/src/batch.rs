//! What one batch has decided while it waits for its transaction: the records to produce,
//! the consumed offsets, and the runs as they were and as they are now.
//!
//! A batch lives in memory only. Nothing of it is visible anywhere until its transaction
//! commits, so dropping it (an abort, a revocation whose commit failed) is always safe:
//! its inputs are read again from the committed offsets and give the same effects.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use sortie_core::RunState;

use crate::gauges::Contribution;
use crate::metrics::BatchCounts;
use crate::store::DueTimer;

/// One record to produce in the batch's transaction.
#[derive(Debug)]
pub(crate) struct Output {
    pub topic: String,
    /// `None`: the producer's partitioner decides (intents, dead letters).
    pub partition: Option<i32>,
    pub key: Vec<u8>,
    /// `None`: a tombstone (a forgotten run's step results).
    pub value: Option<Vec<u8>>,
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    /// What made this record: if Kafka refuses it, that input (or run) is the one to set
    /// aside, not the whole partition's traffic (see `txn::Refusal`).
    pub source: Source,
}

/// Where an input record was read: a consumed offset of `commands` or `step-results`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct InputRef {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
}

impl std::fmt::Display for InputRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}[{}]@{}", self.topic, self.partition, self.offset)
    }
}

/// What a record the reducer produces came from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Source {
    /// Applying (or dead-lettering, or forwarding) this input.
    Input(InputRef),
    /// A run's own progress with no input behind it: its state record, a fired timer.
    Run(String),
}

/// The consumed range of one input partition in this batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Consumed {
    /// The first offset this batch read: where to seek back to if it aborts.
    pub first: i64,
    /// Last processed + 1: the offset committed with the transaction.
    pub next: i64,
}

/// What the commit needs of a run as it was before this batch: its armed timers (the
/// timer index changes by the difference) and its share of the gauges. Not the state: a
/// copy of every state a batch read was ~6 % of the reducer's CPU under load.
#[derive(Debug)]
pub(crate) struct Before {
    pub timers: BTreeMap<String, i64>,
    pub gauge: Contribution,
}

impl Before {
    pub fn of(state: &RunState) -> Before {
        Before {
            timers: state.timers.clone(),
            gauge: Contribution::of(state),
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct PendingBatch {
    /// When the first input (or timer) entered the batch.
    pub opened: Option<Instant>,
    pub inputs: usize,
    pub outputs: Vec<Output>,
    /// (topic, partition) → what this batch consumed of it.
    pub offsets: BTreeMap<(String, i32), Consumed>,
    /// Runs as they were before this batch (None: new), and as they are now.
    pub before: HashMap<String, Option<Before>>,
    pub after: HashMap<String, RunState>,
    /// Runs this batch read and left as they were (nothing to write): a later input of
    /// the run in this batch takes its state from here, not from sled again.
    pub unchanged: HashMap<String, RunState>,
    /// How each changed run's payloads are written (its data key), for the state write.
    pub seals: HashMap<String, sortie_seal::RunSeal>,
    /// Run keys this batch made, stored before its transaction produces anything.
    pub new_keys: Vec<sortie_seal::PendingKey>,
    /// Signed command ids this batch took, remembered once it commits (see `replay`).
    pub remembered: Vec<crate::replay_window::Remembered>,
    /// Timers fired this batch (removed from the index whatever the fold decided).
    pub fired: Vec<DueTimer>,
    pub ignored: usize,
    pub dead_letters: usize,
    /// Intents this batch dispatched (see `convoy`).
    pub dispatched: crate::convoy::Dispatched,
    /// Some run was read from the batch in flight's after-states: this batch cannot
    /// outlive an abort of that one.
    pub on_in_flight: bool,
    /// Metrics of this batch, published only if it commits.
    pub counts: BatchCounts,
    /// Why an input or timer of this batch was not applied whole (an error met halfway:
    /// the key store, the registry, the cache). A broken batch is never committed: it is
    /// dropped and its inputs are read again (see `Engine::start_sending`).
    pub broken: Option<String>,
}

/// The emptied containers of earlier batches, kept for the next ones. Under load a batch
/// folds hundreds of runs: grown from nothing every batch, its maps and record list
/// rehashed and reallocated up to their size each time, often on fresh pages the kernel
/// had to zero (`Engine::finish_apply` went from 14–16 % of the reducer's samples under
/// the bench's full load to 10 %; the performance log, 2026-12-06 morning). Kept, they
/// keep their capacity — at most a batch's worth of entries each.
#[derive(Debug, Default)]
pub(crate) struct Spare {
    outputs: Vec<Output>,
    before: HashMap<String, Option<Before>>,
    after: HashMap<String, RunState>,
    unchanged: HashMap<String, RunState>,
    seals: HashMap<String, sortie_seal::RunSeal>,
}

impl Spare {
    /// Keeps the record list of a batch whose transaction has its records.
    pub fn keep_outputs(&mut self, mut outputs: Vec<Output>) {
        outputs.clear();
        self.outputs = outputs;
    }

    /// Keeps a committed batch's maps, emptied (the caller has drained its states).
    pub fn keep_maps(
        &mut self,
        mut before: HashMap<String, Option<Before>>,
        mut after: HashMap<String, RunState>,
        mut unchanged: HashMap<String, RunState>,
        mut seals: HashMap<String, sortie_seal::RunSeal>,
    ) {
        before.clear();
        after.clear();
        unchanged.clear();
        seals.clear();
        self.before = before;
        self.after = after;
        self.unchanged = unchanged;
        self.seals = seals;
    }
}

impl PendingBatch {
    /// An empty batch, on the containers `spare` kept (taken from it).
    pub fn reusing(spare: &mut Spare) -> PendingBatch {
        let Spare {
            outputs,
            before,
            after,
            unchanged,
            seals,
        } = std::mem::take(spare);
        PendingBatch {
            outputs,
            before,
            after,
            unchanged,
            seals,
            ..PendingBatch::default()
        }
    }

    pub fn is_empty(&self) -> bool {
        self.inputs == 0 && self.fired.is_empty()
    }

    /// Marks the batch as open (the first input or timer); idempotent.
    pub fn touch(&mut self) {
        self.opened.get_or_insert_with(Instant::now);
    }

    /// Records that the input at `offset` of `topic[partition]` is part of this batch.
    pub fn consumed(&mut self, topic: &str, partition: i32, offset: i64) {
        self.touch();
        self.inputs += 1;
        self.offsets
            .entry((topic.to_owned(), partition))
            .and_modify(|c| c.next = offset + 1)
            .or_insert(Consumed {
                first: offset,
                next: offset + 1,
            });
    }
}

/// Per input partition, the first offset any of `batches` read: where an abort of the
/// batch in flight seeks back to, since the open batch was folded on it and goes too. A
/// partition only the later batch read must be rewound as well, or its inputs are lost.
pub(crate) fn first_offsets<'a>(
    batches: impl IntoIterator<Item = &'a PendingBatch>,
) -> BTreeMap<(String, i32), i64> {
    let mut first: BTreeMap<(String, i32), i64> = BTreeMap::new();
    for batch in batches {
        for (at, consumed) in &batch.offsets {
            first
                .entry(at.clone())
                .and_modify(|f| *f = (*f).min(consumed.first))
                .or_insert(consumed.first);
        }
    }
    first
}

/// The offsets a batch's transaction sends: what it consumed ("last processed + 1"), and
/// for a partition it only fired timers of, the offset already committed there
/// (`positions`, by input topic and partition). A transaction of timers alone thus still
/// carries the group's metadata, and a zombie's is fenced by its stale generation
/// (KIP-447) like any other.
pub(crate) fn offsets_to_send(
    batch: &PendingBatch,
    positions: &BTreeMap<(String, i32), i64>,
    commands: &str,
) -> BTreeMap<(String, i32), i64> {
    let mut offsets: BTreeMap<(String, i32), i64> = batch
        .offsets
        .iter()
        .map(|(at, consumed)| (at.clone(), consumed.next))
        .collect();
    for timer in &batch.fired {
        let at = (commands.to_owned(), timer.partition);
        if let (false, Some(next)) = (offsets.contains_key(&at), positions.get(&at)) {
            offsets.insert(at, *next);
        }
    }
    offsets
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seen red with `keep_outputs` and `keep_maps` keeping their containers without
    /// emptying them: the next batch would have begun with a committed batch's records
    /// and states as its own.
    #[test]
    fn a_batch_on_a_committed_batchs_containers_begins_empty_and_keeps_their_room() {
        let mut spare = Spare::default();
        let output = |n: usize| Output {
            topic: "run-events".into(),
            partition: Some(0),
            key: format!("run-{n}").into_bytes(),
            value: Some(vec![1, 2, 3]),
            headers: vec![],
            source: Source::Run(format!("run-{n}")),
        };
        spare.keep_outputs((0..300).map(output).collect());
        let runs = |n: usize| (0..n).map(|i| format!("run-{i}"));
        let state = crate::gauges::tests::state(sortie_core::RunStatus::Running, &[], 0);
        spare.keep_maps(
            runs(300).map(|r| (r, None)).collect(),
            runs(300).map(|r| (r, state.clone())).collect(),
            runs(300).map(|r| (r, state.clone())).collect(),
            runs(300)
                .map(|r| (r, sortie_seal::RunSeal::Plain))
                .collect(),
        );
        let batch = PendingBatch::reusing(&mut spare);
        assert!(batch.is_empty());
        assert!(batch.outputs.is_empty() && batch.outputs.capacity() >= 300);
        assert!(batch.before.is_empty() && batch.before.capacity() >= 300);
        assert!(batch.after.is_empty() && batch.after.capacity() >= 300);
        assert!(batch.unchanged.is_empty() && batch.unchanged.capacity() >= 300);
        assert!(batch.seals.is_empty() && batch.seals.capacity() >= 300);
        // Taken, not shared: the next batch gets containers of its own.
        let next = PendingBatch::reusing(&mut spare);
        assert_eq!(next.after.capacity(), 0);
        assert_eq!(next.outputs.capacity(), 0);
    }

    /// Checked red: without the committed positions, a batch of timers alone sends no
    /// offsets (and so no group metadata: a zombie's transaction would commit).
    #[test]
    fn a_batch_of_timers_alone_sends_its_partitions_committed_offsets() {
        let timer = |partition| DueTimer {
            partition,
            run_id: "r".into(),
            timer_key: "k".into(),
            due_at: 1,
        };
        let positions: BTreeMap<(String, i32), i64> = [
            (("commands".to_owned(), 0), 10),
            (("commands".to_owned(), 1), 20),
            (("step-results".to_owned(), 1), 30),
        ]
        .into_iter()
        .collect();
        let timers = PendingBatch {
            fired: vec![timer(1)],
            ..PendingBatch::default()
        };
        let sent = offsets_to_send(&timers, &positions, "commands");
        assert_eq!(
            sent,
            [(("commands".to_owned(), 1), 20)].into_iter().collect()
        );

        // A batch that consumed the partition sends what it consumed, not the position.
        let mut both = PendingBatch::default();
        both.consumed("commands", 1, 25);
        both.fired = vec![timer(1)];
        let sent = offsets_to_send(&both, &positions, "commands");
        assert_eq!(
            sent,
            [(("commands".to_owned(), 1), 26)].into_iter().collect()
        );
    }

    /// Checked red: with only the first batch's offsets, partition 1 is not rewound.
    #[test]
    fn an_abort_rewinds_every_partition_either_batch_read_to_its_first_offset() {
        let mut in_flight = PendingBatch::default();
        in_flight.consumed("commands", 0, 10);
        in_flight.consumed("commands", 0, 11);
        in_flight.consumed("step-results", 2, 40);
        let mut open = PendingBatch::default();
        open.consumed("commands", 0, 12);
        open.consumed("commands", 1, 7);
        open.consumed("step-results", 2, 41);
        let first = first_offsets([&in_flight, &open]);
        let expected: BTreeMap<(String, i32), i64> = [
            (("commands".to_owned(), 0), 10),
            (("commands".to_owned(), 1), 7),
            (("step-results".to_owned(), 2), 40),
        ]
        .into_iter()
        .collect();
        assert_eq!(first, expected);
    }
}
