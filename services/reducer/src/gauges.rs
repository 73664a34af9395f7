//! The run gauges (`sortie_runs`, `sortie_interrupts_open`, the oldest open approval's
//! age, operations awaiting an operator), exact for the partitions this instance owns:
//! each partition's tally is rebuilt from the cache after a restore, moved by every
//! committed batch's before/after states, and saved with the batch (with its open
//! interrupts indexed in sled) so a restart does not scan every run again.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use metrics::gauge;
use serde::{Deserialize, Serialize};
use sortie_core::state::{InterruptStatus, StepStatus};
use sortie_core::{RunState, RunStatus};

use crate::metrics::*;
use crate::store::{self, Store};

/// A run's share of the run gauges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Contribution {
    status: RunStatus,
    awaiting_operator: i64,
    open_interrupts: Vec<String>,
    updated_at: i64,
}

impl Contribution {
    pub fn of(state: &RunState) -> Contribution {
        Contribution {
            status: state.status,
            awaiting_operator: state
                .steps
                .values()
                .filter(|s| s.status == StepStatus::NeedsOperator)
                .count() as i64,
            open_interrupts: state
                .open_interrupts()
                .map(|i| i.interrupt_id.clone())
                .collect(),
            updated_at: state.updated_at,
        }
    }

    /// From cached bytes, reading only what the gauges need.
    fn from_bytes(bytes: &[u8]) -> Option<Contribution> {
        #[derive(Deserialize)]
        struct Light {
            status: RunStatus,
            updated_at: i64,
            #[serde(default)]
            steps: HashMap<String, LightStep>,
            #[serde(default)]
            interrupts: HashMap<String, LightInterrupt>,
        }
        #[derive(Deserialize)]
        struct LightStep {
            status: StepStatus,
        }
        #[derive(Deserialize)]
        struct LightInterrupt {
            status: InterruptStatus,
        }
        let light: Light = serde_json::from_slice(bytes).ok()?;
        Some(Contribution {
            status: light.status,
            awaiting_operator: light
                .steps
                .values()
                .filter(|s| s.status == StepStatus::NeedsOperator)
                .count() as i64,
            open_interrupts: light
                .interrupts
                .into_iter()
                .filter(|(_, i)| i.status == InterruptStatus::Open)
                .map(|(id, _)| id)
                .collect(),
            updated_at: light.updated_at,
        })
    }
}

#[derive(Debug, Default)]
struct PartitionTally {
    runs: BTreeMap<RunStatus, i64>,
    awaiting_operator: i64,
    /// (run id, interrupt id) → when it was first seen open (ms).
    open: HashMap<(String, String), i64>,
    /// (opened at, run id, interrupt id): the oldest first.
    by_age: BTreeSet<(i64, String, String)>,
    /// Whether sled's open-interrupt index of the partition holds `open` but for
    /// `unsaved`. `false` for a tally counted by a restore or a scan, or loaded from a
    /// snapshot that carried its open set: the next save writes the index whole.
    indexed: bool,
    /// Changes to `open` since the index was last written, while `indexed`: the latest
    /// per interrupt (`None`: closed).
    unsaved: HashMap<(String, String), Option<i64>>,
}

impl PartitionTally {
    fn add(&mut self, run_id: &str, c: &Contribution) {
        *self.runs.entry(c.status).or_default() += 1;
        self.awaiting_operator += c.awaiting_operator;
        for id in &c.open_interrupts {
            let key = (run_id.to_owned(), id.clone());
            if let std::collections::hash_map::Entry::Vacant(entry) = self.open.entry(key) {
                entry.insert(c.updated_at);
                self.by_age
                    .insert((c.updated_at, run_id.to_owned(), id.clone()));
                if self.indexed {
                    self.unsaved
                        .insert((run_id.to_owned(), id.clone()), Some(c.updated_at));
                }
            }
        }
    }

    fn remove(&mut self, run_id: &str, c: &Contribution, still_open: &[String]) {
        *self.runs.entry(c.status).or_default() -= 1;
        self.awaiting_operator -= c.awaiting_operator;
        for id in &c.open_interrupts {
            if still_open.contains(id) {
                continue; // keeps the time it was first seen open
            }
            let key = (run_id.to_owned(), id.clone());
            if let Some(at) = self.open.remove(&key) {
                self.by_age.remove(&(at, key.0.clone(), key.1.clone()));
                if self.indexed {
                    self.unsaved.insert(key, None);
                }
            }
        }
    }
}

/// The latest share of every run one partition's restore has read so far, so that a run's
/// later record replaces its earlier one in the tally (a changelog is not always
/// compacted: the bench's holds ~6 records a run). It is what lets a cold restore count
/// the gauges from the states it decodes anyway, instead of reading every cached state
/// back afterwards (~5 s at 1M runs, and sled then kept ~140 MiB of what it read).
///
/// Kept small because a cold restore may hold every run of a partition: a run is a 64-bit
/// hash of its id, its status and its steps awaiting an operator (16 bytes; ~30 MiB for
/// 1M runs while the restore lasts); the whole share only for a run with open
/// interrupts, whose ids the tally keeps. Two run ids with the same hash (odds ~3·10⁻⁸
/// for a restore of 1M runs) would make the gauges count one run too few; nothing else
/// reads this.
#[derive(Debug, Default)]
pub struct Shares {
    plain: HashMap<u64, (RunStatus, u32)>,
    open: HashMap<u64, Contribution>,
}

impl Shares {
    /// Records `share` (`None`: the run is gone) as `run_id`'s latest and returns the one
    /// it replaces, if the restore had read one.
    pub fn replace(&mut self, run_id: &str, share: Option<&Contribution>) -> Option<Contribution> {
        let key = Self::key(run_id);
        // A run is in one of the two maps at most: each insert below follows this removal.
        let before = self.open.remove(&key).or_else(|| {
            self.plain
                .remove(&key)
                .map(|(status, awaiting)| Contribution {
                    status,
                    awaiting_operator: i64::from(awaiting),
                    open_interrupts: Vec::new(),
                    updated_at: 0, // read only for open interrupts
                })
        });
        match share {
            Some(share) if !share.open_interrupts.is_empty() => {
                self.open.insert(key, share.clone());
            }
            Some(share) => {
                let awaiting = u32::try_from(share.awaiting_operator.max(0)).unwrap_or(u32::MAX);
                self.plain.insert(key, (share.status, awaiting));
            }
            None => {}
        }
        before
    }

    fn key(run_id: &str) -> u64 {
        use std::hash::{Hash, Hasher};
        // SipHash with fixed keys: the same run id is the same key for the whole restore.
        let mut hasher = std::hash::DefaultHasher::new();
        run_id.hash(&mut hasher);
        hasher.finish()
    }
}

/// A partition's tally as stored next to the changelog offset it reflects, so a restart
/// does not parse every cached run to count them again. Its open interrupts are in sled's
/// open-interrupt index, written in the same batches (`indexed`), so the snapshot stays a
/// few hundred bytes however many runs wait for approval, and is stored with every commit.
#[derive(Debug, Serialize, Deserialize)]
struct TallySnapshot {
    /// The partition's changelog offset (sled's marker) the tally reflects.
    offset: u64,
    runs: Vec<(RunStatus, i64)>,
    awaiting_operator: i64,
    /// (run id, interrupt id, first seen open at): a snapshot of an earlier build, which
    /// carried its open set here (empty when `indexed`).
    #[serde(default)]
    open: Vec<(String, String, i64)>,
    /// The open set is the partition's open-interrupt index in sled.
    #[serde(default)]
    indexed: bool,
}

/// The gauges of the partitions this instance owns.
#[derive(Debug, Default)]
pub(crate) struct RunGauges {
    partitions: BTreeMap<i32, PartitionTally>,
}

impl RunGauges {
    /// Adds `partition`'s tally, as of its changelog `offset`, to `batch`: the counts, and
    /// what changed in its open-interrupt set since it was last saved — or the whole set,
    /// with the index's stale entries removed, when the index cannot be trusted to match.
    /// `false`: no tally is held. Once the batch is applied, [`RunGauges::saved`] must be
    /// told; until then the same changes are written again by the next save.
    pub fn save_into(
        &self,
        partition: i32,
        offset: u64,
        batch: &mut store::Batch,
        store: &Store,
    ) -> Result<bool, store::Error> {
        let Some(tally) = self.partitions.get(&partition) else {
            return Ok(false);
        };
        // Everything that can fail comes before the first write to `batch`: the index and
        // the counts go in together or not at all.
        let snapshot = TallySnapshot {
            offset,
            runs: tally.runs.iter().map(|(s, n)| (*s, *n)).collect(),
            awaiting_operator: tally.awaiting_operator,
            open: Vec::new(),
            indexed: true,
        };
        let bytes = serde_json::to_vec(&snapshot).map_err(|e| {
            store::Error::Corrupt(format!("the tally of partition {partition}: {e}"))
        })?;
        if tally.indexed {
            for ((run, id), at) in &tally.unsaved {
                match at {
                    Some(at) => batch.open_interrupt(partition, run, id, *at),
                    None => batch.close_interrupt(partition, run, id),
                };
            }
        } else {
            let stored = store.open_interrupts(partition)?;
            for (run, id, _) in stored {
                if !tally.open.contains_key(&(run.clone(), id.clone())) {
                    batch.close_interrupt(partition, &run, &id);
                }
            }
            for ((run, id), at) in &tally.open {
                batch.open_interrupt(partition, run, id, *at);
            }
        }
        batch.put_tally(partition, bytes);
        Ok(true)
    }

    /// The batches of [`RunGauges::save_into`] for `partitions` were applied: their
    /// indexes now match.
    pub fn saved(&mut self, partitions: impl IntoIterator<Item = i32>) {
        for partition in partitions {
            if let Some(tally) = self.partitions.get_mut(&partition) {
                tally.indexed = true;
                tally.unsaved.clear();
            }
        }
    }

    /// Takes `partition`'s tally from a stored snapshot if it reflects exactly the
    /// changelog `offset` the cache is at (its open interrupts from `index`, sled's
    /// open-interrupt index, for a snapshot that says they are there); `false` (nothing
    /// loaded) otherwise, or when the index cannot be read.
    pub fn load(
        &mut self,
        partition: i32,
        bytes: &[u8],
        offset: u64,
        index: impl FnOnce() -> Option<Vec<(String, String, i64)>>,
    ) -> bool {
        let Ok(snapshot) = serde_json::from_slice::<TallySnapshot>(bytes) else {
            return false;
        };
        if snapshot.offset != offset {
            return false;
        }
        let open = if snapshot.indexed {
            match index() {
                Some(open) => open,
                None => return false,
            }
        } else {
            snapshot.open
        };
        let mut tally = PartitionTally {
            runs: snapshot.runs.into_iter().collect(),
            awaiting_operator: snapshot.awaiting_operator,
            indexed: snapshot.indexed,
            ..PartitionTally::default()
        };
        for (run, id, at) in open {
            tally.by_age.insert((at, run.clone(), id.clone()));
            tally.open.insert((run, id), at);
        }
        self.partitions.insert(partition, tally);
        true
    }

    /// Rebuilds the tallies of `restored` partitions from the cache (after their restore).
    pub fn rebuild(
        &mut self,
        restored: &BTreeSet<i32>,
        runs: impl Iterator<Item = (String, Vec<u8>)>,
        partition_of: impl Fn(&str) -> i32,
    ) {
        for partition in restored {
            self.partitions
                .insert(*partition, PartitionTally::default());
        }
        for (run_id, bytes) in runs {
            let partition = partition_of(&run_id);
            let Some(tally) = self.partitions.get_mut(&partition) else {
                continue;
            };
            if !restored.contains(&partition) {
                continue;
            }
            if let Some(c) = Contribution::from_bytes(&bytes) {
                tally.add(&run_id, &c);
            }
        }
    }

    /// Starts `partition`'s tally from nothing (its cache is empty: a cold restore).
    pub fn reset(&mut self, partition: i32) {
        self.partitions.insert(partition, PartitionTally::default());
    }

    /// A run changed to `after` (`None`: absent) from its share `before`, by a commit.
    pub(crate) fn update_from(
        &mut self,
        partition: i32,
        run_id: &str,
        before: Option<&Contribution>,
        after: Option<&RunState>,
    ) {
        let after = after.map(Contribution::of);
        self.change(partition, run_id, before, after.as_ref());
    }

    /// A run's share changed from `before` to `after` (`None`: absent).
    pub fn change(
        &mut self,
        partition: i32,
        run_id: &str,
        before: Option<&Contribution>,
        after: Option<&Contribution>,
    ) {
        let tally = self.partitions.entry(partition).or_default();
        if let Some(before) = before {
            let still_open = after.map_or(&[][..], |a| &a.open_interrupts);
            tally.remove(run_id, before, still_open);
        }
        if let Some(after) = after {
            tally.add(run_id, after);
        }
    }

    /// Sets the gauges for the partitions in `owned` (forgetting the others).
    pub fn publish(&mut self, owned: &BTreeSet<i32>, now_ms: i64) {
        self.partitions.retain(|p, _| owned.contains(p));
        gauge!(OWNED_PARTITIONS).set(owned.len() as f64);
        let mut runs: BTreeMap<RunStatus, i64> = BTreeMap::new();
        let (mut open, mut awaiting, mut oldest) = (0usize, 0i64, None::<i64>);
        for tally in self.partitions.values() {
            for (status, n) in &tally.runs {
                *runs.entry(*status).or_default() += n;
            }
            open += tally.open.len();
            awaiting += tally.awaiting_operator;
            if let Some((at, _, _)) = tally.by_age.first() {
                oldest = Some(oldest.map_or(*at, |o: i64| o.min(*at)));
            }
        }
        for status in [
            RunStatus::Running,
            RunStatus::WaitingApproval,
            RunStatus::NeedsReconciliation,
            RunStatus::Cancelling,
            RunStatus::Compensating,
            RunStatus::Succeeded,
            RunStatus::Failed,
            RunStatus::Cancelled,
        ] {
            let n = runs.get(&status).copied().unwrap_or(0).max(0);
            gauge!(RUNS, "status" => status.as_str()).set(n as f64);
        }
        gauge!(INTERRUPTS_OPEN).set(open as f64);
        gauge!(AWAITING_OPERATOR).set(awaiting.max(0) as f64);
        let age = oldest.map_or(0.0, |at| (now_ms - at).max(0) as f64 / 1000.0);
        gauge!(INTERRUPT_OLDEST_AGE).set(age);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A run of no steps, `status`, with `open` interrupts, last updated `at` (the txn
    /// tests build on it too).
    pub(crate) fn state(status: RunStatus, open: &[&str], at: i64) -> RunState {
        let mut state: RunState = serde_json::from_value(serde_json::json!({
            "tenant": "t", "run_id": "r", "graph_id": "g", "graph_version": 1,
            "status": status, "version": 1, "last_event_seq": 1, "last_hash": null,
            "created_at": 0, "updated_at": at, "started_by": "x", "labels": {},
            "input": null, "deadline_at": null, "steps": {}, "completed": [],
            "interrupts": {}, "timers": {}, "commands": {}, "ending": null, "output": null
        }))
        .expect("state");
        for id in open {
            let interrupt = serde_json::from_value(serde_json::json!({
                "interrupt_id": id, "step_id": "s#1", "node": "s", "role": "Node",
                "proposal": null, "proposal_hash": "h", "reason": "r",
                "required_role": null, "approver_group": null, "quorum": 1,
                "expires_at": null, "round": 0, "approvals": [], "status": "open"
            }))
            .expect("interrupt");
            state.interrupts.insert((*id).to_owned(), interrupt);
        }
        state
    }

    #[test]
    fn a_tally_follows_a_run_through_an_approval() {
        let mut gauges = RunGauges::default();
        let running = state(RunStatus::Running, &[], 1_000);
        let waiting = state(RunStatus::WaitingApproval, &["i1"], 2_000);
        let still = state(RunStatus::WaitingApproval, &["i1"], 3_000);
        let done = state(RunStatus::Succeeded, &[], 4_000);
        let update = |gauges: &mut RunGauges, before: Option<&RunState>, after: &RunState| {
            let before = before.map(Contribution::of);
            gauges.change(0, "r", before.as_ref(), Some(&Contribution::of(after)));
        };
        update(&mut gauges, None, &running);
        update(&mut gauges, Some(&running), &waiting);
        update(&mut gauges, Some(&waiting), &still);
        let tally = &gauges.partitions[&0];
        assert_eq!(tally.runs[&RunStatus::WaitingApproval], 1);
        assert_eq!(tally.runs[&RunStatus::Running], 0);
        // The interrupt keeps the time it was first seen open.
        assert_eq!(tally.open.get(&("r".into(), "i1".into())), Some(&2_000));
        update(&mut gauges, Some(&still), &done);
        let tally = &gauges.partitions[&0];
        assert!(tally.open.is_empty() && tally.by_age.is_empty());
        assert_eq!(tally.runs[&RunStatus::Succeeded], 1);
        assert_eq!(tally.runs[&RunStatus::WaitingApproval], 0);
    }

    /// A cold restore counts a run once, by its last record, however many it reads.
    #[test]
    fn a_restore_counts_each_run_by_its_latest_record() {
        let mut gauges = RunGauges::default();
        let mut shares = Shares::default();
        let mut read = |gauges: &mut RunGauges, run: &str, state: Option<&RunState>| {
            let after = state.map(Contribution::of);
            let before = shares.replace(run, after.as_ref());
            gauges.change(0, run, before.as_ref(), after.as_ref());
        };
        gauges.reset(0);
        let running = state(RunStatus::Running, &[], 1_000);
        let waiting = state(RunStatus::WaitingApproval, &["i1"], 2_000);
        let done = state(RunStatus::Succeeded, &[], 3_000);
        read(&mut gauges, "a", Some(&running));
        read(&mut gauges, "b", Some(&running));
        read(&mut gauges, "a", Some(&waiting));
        read(&mut gauges, "b", Some(&waiting));
        read(&mut gauges, "b", Some(&done));
        read(&mut gauges, "c", Some(&waiting));
        read(&mut gauges, "c", None); // a tombstone: forgotten
        let tally = &gauges.partitions[&0];
        assert_eq!(tally.runs[&RunStatus::Running], 0);
        assert_eq!(tally.runs[&RunStatus::WaitingApproval], 1);
        assert_eq!(tally.runs[&RunStatus::Succeeded], 1);
        // Only a's interrupt is still open, since it was first seen open.
        assert_eq!(tally.open.len(), 1);
        assert_eq!(tally.open.get(&("a".into(), "i1".into())), Some(&2_000));
        assert_eq!(tally.by_age.len(), 1);
    }

    /// A tally's non-zero counts, and its open interrupts, the oldest first.
    type Counted = (Vec<(RunStatus, i64)>, Vec<(i64, String, String)>);

    /// What a restart loads: the counts, and every open interrupt with the time it was
    /// first seen open, from the stored tally and the open-interrupt index in sled.
    fn loaded(store: &Store, partition: i32, offset: u64) -> Option<Counted> {
        let bytes = store.tally(partition).expect("tally")?;
        let mut gauges = RunGauges::default();
        let index = || store.open_interrupts(partition).ok();
        if !gauges.load(partition, &bytes, offset, index) {
            return None;
        }
        Some(counted(&gauges, partition))
    }

    fn counted(gauges: &RunGauges, partition: i32) -> Counted {
        let tally = &gauges.partitions[&partition];
        let runs = tally
            .runs
            .iter()
            .map(|(s, n)| (*s, *n))
            .filter(|(_, n)| *n != 0)
            .collect();
        (runs, tally.by_age.iter().cloned().collect())
    }

    fn save(gauges: &mut RunGauges, store: &Store, partition: i32, offset: u64) {
        let mut batch = store::Batch::default();
        assert!(gauges
            .save_into(partition, offset, &mut batch, store)
            .expect("save"));
        store.apply(batch).expect("apply");
        gauges.saved([partition]);
    }

    /// A partition's open interrupts go to sled's index as changes with each save (the
    /// whole set only when the index cannot be trusted), and a restart loads exactly the
    /// tally it had: 200 runs waiting for approval, then 150 of them decided, then a tally
    /// counted again whose save removes the index's stale entries.
    /// Red-proofed: with the changes not written (only the counts), the loads after the
    /// second save found 200 open interrupts instead of 50.
    #[test]
    fn open_interrupts_are_indexed_in_sled_with_every_save_and_loaded_back() {
        let store = Store::temporary().expect("store");
        let mut gauges = RunGauges::default();
        let expected = |gauges: &RunGauges| counted(gauges, 3);
        gauges.reset(3);
        let runs: Vec<String> = (0..200).map(|i| format!("run-{i}")).collect();
        for (i, run) in runs.iter().enumerate() {
            let waiting = state(RunStatus::WaitingApproval, &["i1"], 1_000 + i as i64);
            gauges.change(3, run, None, Some(&Contribution::of(&waiting)));
        }
        save(&mut gauges, &store, 3, 10);
        assert_eq!(store.open_interrupts(3).expect("index").len(), 200);
        assert_eq!(loaded(&store, 3, 10), Some(expected(&gauges)));
        assert_eq!(
            loaded(&store, 3, 11),
            None,
            "a tally of another offset is not loaded"
        );

        for (i, run) in runs.iter().enumerate().take(150) {
            let before = Contribution::of(&state(
                RunStatus::WaitingApproval,
                &["i1"],
                1_000 + i as i64,
            ));
            let done = state(RunStatus::Succeeded, &[], 5_000);
            gauges.change(3, run, Some(&before), Some(&Contribution::of(&done)));
        }
        let mut batch = store::Batch::default();
        assert!(gauges.save_into(3, 20, &mut batch, &store).expect("save"));
        assert!(
            batch.len() < 160,
            "changes, not the whole set: {} writes",
            batch.len()
        );
        store.apply(batch).expect("apply");
        gauges.saved([3]);
        let (counts, open) = loaded(&store, 3, 20).expect("loaded");
        assert_eq!((counts.clone(), open.clone()), expected(&gauges));
        assert_eq!(open.len(), 50);
        assert_eq!(open[0], (1_150, "run-150".to_owned(), "i1".to_owned()));

        // Counted again (a scan after a crash mid-restore) with one run fewer waiting: the
        // save writes the whole set and removes what the index held beyond it.
        let mut recounted = RunGauges::default();
        recounted.reset(3);
        for (i, run) in runs.iter().enumerate().skip(151) {
            let waiting = state(RunStatus::WaitingApproval, &["i1"], 1_000 + i as i64);
            recounted.change(3, run, None, Some(&Contribution::of(&waiting)));
        }
        save(&mut recounted, &store, 3, 30);
        assert_eq!(loaded(&store, 3, 30), Some(expected(&recounted)));
        assert_eq!(store.open_interrupts(3).expect("index").len(), 49);
    }

    /// A snapshot stored by the build before the index carried its open set: it loads,
    /// and the next save moves the set into the index.
    #[test]
    fn a_snapshot_with_its_open_set_loads_and_is_indexed_at_the_next_save() {
        let store = Store::temporary().expect("store");
        let legacy = serde_json::json!({
            "offset": 7, "runs": [["WAITING_APPROVAL", 1]], "awaiting_operator": 0,
            "open": [["run-a", "i1", 1_234]]
        });
        let mut batch = store::Batch::default();
        batch.put_tally(1, serde_json::to_vec(&legacy).expect("json"));
        store.apply(batch).expect("apply");
        let mut gauges = RunGauges::default();
        let bytes = store.tally(1).expect("tally").expect("stored");
        assert!(gauges.load(1, &bytes, 7, || None), "the index is not read");
        assert_eq!(gauges.partitions[&1].open.len(), 1);
        save(&mut gauges, &store, 1, 7);
        assert_eq!(
            store.open_interrupts(1).expect("index"),
            [("run-a".to_owned(), "i1".to_owned(), 1_234)]
        );
        let (_, open) = loaded(&store, 1, 7).expect("loaded");
        assert_eq!(open, [(1_234, "run-a".to_owned(), "i1".to_owned())]);
    }

    #[test]
    fn a_rebuild_reads_cached_states_of_restored_partitions_only() {
        let mut gauges = RunGauges::default();
        let waiting =
            serde_json::to_vec(&state(RunStatus::WaitingApproval, &["i1"], 5)).expect("json");
        let runs = vec![("a".to_owned(), waiting.clone()), ("b".to_owned(), waiting)];
        gauges.rebuild(&BTreeSet::from([1]), runs.into_iter(), |run| {
            i32::from(run == "a")
        });
        assert_eq!(gauges.partitions.len(), 1);
        assert_eq!(gauges.partitions[&1].runs[&RunStatus::WaitingApproval], 1);
        assert_eq!(gauges.partitions[&1].open.len(), 1);
    }
}
