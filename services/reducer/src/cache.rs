//! The cache write after a commit: the batch's run states, their timers, the changelog
//! offsets they reflect and the gauges' tallies (with their open-interrupt index) at those
//! offsets, in ONE atomic store batch — held behind the commit for up to
//! `store::WRITE_BEHIND` and merged with the next ones before it reaches sled
//! (`Store::apply_behind`; reads see it at once).
//!
//! It happens only after Kafka has the transaction, so sled is never ahead of Kafka; a
//! crash before it reaches sled leaves sled behind, and the next restore reads the
//! changelog from the older marker (SPEC §13).

use std::collections::BTreeMap;

use crate::batch::PendingBatch;
use crate::driver::Error;
use crate::engine::{Engine, HOT_RUNS};
use crate::store;
use crate::txn::Committed;

impl Engine {
    /// Writes a committed batch to sled and publishes its metrics; the batch is consumed.
    pub fn write_cache(&mut self, batch: PendingBatch, committed: Committed) -> Result<(), Error> {
        // Committed: the command ids it took are taken (see `replay`).
        for r in &batch.remembered {
            self.replays
                .remember(r.partition, r.key.clone(), r.issued_at, r.at);
        }
        let mut sled = store::Batch::default();
        for (run_id, bytes) in committed.states {
            let Some(state) = batch.after.get(&run_id) else {
                continue;
            };
            let partition = self.partition_of(&run_id);
            let old: BTreeMap<&String, &i64> = batch
                .before
                .get(&run_id)
                .and_then(Option::as_ref)
                .map(|b| b.timers.iter().collect())
                .unwrap_or_default();
            for (key, due) in &old {
                if state.timers.get(*key) != Some(*due) {
                    sled.disarm_timer(partition, &run_id, key, **due);
                }
            }
            for (key, due) in &state.timers {
                if old.get(key) != Some(&due) {
                    sled.arm_timer(partition, &run_id, key, *due);
                }
            }
            sled.put_state(&run_id, bytes);
        }
        for timer in &batch.fired {
            let still = batch
                .after
                .get(&timer.run_id)
                .map(|s| s.timers.get(&timer.timer_key) == Some(&timer.due_at));
            if still != Some(true) {
                sled.disarm_timer(
                    timer.partition,
                    &timer.run_id,
                    &timer.timer_key,
                    timer.due_at,
                );
            }
        }
        // The gauges follow the cache: once this batch is folded into them, each tally
        // reflects exactly the marker it is stored with below. (Nothing reads the
        // gauges between here and the write: if the write fails, the reducer stops.)
        for (run_id, state) in &batch.after {
            let partition = self.partition_of(run_id);
            let before = batch.before.get(run_id).and_then(Option::as_ref);
            self.gauges
                .update_from(partition, run_id, before.map(|b| &b.gauge), Some(state));
        }
        // Every commit stores the tally of each partition whose marker it moves, with the
        // changes to the partition's open-interrupt index, so a restart after a crash
        // starts from them instead of counting every cached run (a scan of the store:
        // ~5 s at 1M runs), however many runs wait for approval.
        for (partition, next) in &committed.changelog {
            sled.set_changelog_offset(*partition, *next);
            self.gauges
                .save_into(*partition, *next, &mut sled, &self.store)?;
        }
        self.store.apply_behind(sled)?;
        self.gauges.saved(committed.changelog.keys().copied());
        tracing::debug!(
            inputs = batch.inputs,
            outputs = committed.records,
            runs = batch.after.len(),
            ignored = batch.ignored,
            dead_letters = batch.dead_letters,
            commit_ms = committed.took.as_millis() as u64,
            blocked_ms = committed.blocked.as_millis() as u64,
            phases_ms = ?committed.phases,
            began_us = committed.span_us.0,
            committed_us = committed.span_us.1,
            "Batch committed."
        );
        batch
            .counts
            .committed(batch.inputs + batch.fired.len(), committed.took);
        self.convoy.committed(batch.dispatched);
        // Committed states, changed or read: the next batch starts from them.
        let PendingBatch {
            before,
            mut after,
            mut unchanged,
            seals,
            ..
        } = batch;
        for (run_id, state) in after.drain().chain(unchanged.drain()) {
            if state.status.is_terminal() {
                self.hot.remove(&run_id);
                continue;
            }
            if self.hot.len() >= HOT_RUNS && !self.hot.contains_key(&run_id) {
                // Crude but bounded: start over rather than track recency.
                self.hot.clear();
            }
            self.hot.insert(run_id, state);
        }
        self.spare.keep_maps(before, after, unchanged, seals);
        Ok(())
    }
}
