//! Ownership: which partitions this member owns and what state each partition's task is
//! in, changed only by the rebalance callback — Kafka Streams' task model
//! (`TaskManager`: revoke → commit, assign → restore then run).
//!
//! The callback runs inside `poll`, on the polling thread, while the loop does not hold
//! the engine, so the two never interleave:
//!
//! - **Revoke** (eager protocol: everything, before the member rejoins). The open batch
//!   is committed here, with the group metadata of the generation its inputs were read
//!   in, before the partitions are given up; if the assignment was lost (the member was
//!   kicked out) or the commit fails, the batch is dropped: nothing of it is visible and
//!   the next owner reads its inputs again. So no batch ever carries inputs from two
//!   generations, and no offsets of a partition owned by someone else are ever sent.
//! - **Assign.** First the committed input offsets are fetched with stable semantics
//!   (`isolation.level=read_committed` makes librdkafka send OffsetFetch with
//!   `require_stable`, KIP-447): that waits out the previous owner's open transaction.
//!   Then the changelog is restored to its end — its high watermark, asked
//!   `read_uncommitted`, read `read_committed` (see `restore` for why not the last
//!   stable offset) — then the partitions are assigned at exactly those offsets. A run
//!   whose changelog record does not decode is quarantined, not its partition: the
//!   restore goes on, and the run's inputs are dead-lettered (`input`).
//! - **Stop.** A partition whose own records Kafka keeps refusing (see `txn::Refusal`)
//!   is stopped loudly: paused, named by readiness, counted, logged — never a batch
//!   replayed for ever. It starts again when it is next assigned.
//!
//! An open batch that is not whole (`PendingBatch::broken`) is never committed here
//! either: revocation drops it, and the next owner reads its inputs again.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use crate::driver::Error;
use crate::engine::Engine;
use crate::metrics as meter;
use crate::txn::Failure;

/// One partition's task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Task {
    /// Restored; its inputs are consumed.
    Active,
    /// Stopped (records of its own that Kafka keeps refusing): assigned, paused, not
    /// consumed until it is assigned again.
    Stopped(String),
}

/// The partitions this member owns (by their number in the co-partitioned topics).
#[derive(Debug, Default)]
pub(crate) struct Tasks {
    tasks: BTreeMap<i32, Task>,
    /// A member with its assignment in hand (false from a revocation to the next
    /// assignment, and before the first).
    joined: bool,
}

impl Tasks {
    pub fn is_active(&self, partition: i32) -> bool {
        self.tasks.get(&partition) == Some(&Task::Active)
    }

    pub fn active(&self) -> BTreeSet<i32> {
        self.tasks
            .iter()
            .filter(|(_, t)| **t == Task::Active)
            .map(|(p, _)| *p)
            .collect()
    }

    pub fn owned(&self) -> BTreeSet<i32> {
        self.tasks.keys().copied().collect()
    }

    /// Ready: joined, and no owned partition stopped.
    pub fn readiness(&self) -> Result<(), String> {
        if !self.joined {
            return Err("waiting for a partition assignment".to_owned());
        }
        let stopped: Vec<String> = self
            .tasks
            .iter()
            .filter_map(|(p, t)| match t {
                Task::Stopped(reason) => Some(format!("partition {p} stopped: {reason}")),
                Task::Active => None,
            })
            .collect();
        if stopped.is_empty() {
            Ok(())
        } else {
            Err(stopped.join("; "))
        }
    }
}

/// The consumer's context: rebalance callbacks act on the engine.
pub(crate) struct ReducerContext {
    pub commands: String,
    pub engine: Arc<OnceLock<Arc<Mutex<Engine>>>>,
    /// Ends the process when the consumer stays outside a settled group past
    /// `rejoin_timeout` (`Watchdog::watch_membership`).
    pub membership: crate::watchdog::Watchdog,
    pub rejoin_timeout: std::time::Duration,
}

impl ClientContext for ReducerContext {
    fn stats(&self, statistics: rdkafka::Statistics) {
        sortie_kafka::metrics::consumer_lag(&statistics);
        self.membership
            .watch_membership(&statistics, self.rejoin_timeout);
    }
}

impl ConsumerContext for ReducerContext {
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let Some(engine) = self.engine.get() else {
            // Not wired yet (cannot happen: the engine is set before subscribing).
            let _ = consumer.unassign();
            return;
        };
        let Ok(mut engine) = engine.lock() else {
            tracing::error!("The engine lock is poisoned; giving the partitions up.");
            let _ = consumer.unassign();
            return;
        };
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                let assignment = engine.on_assign(consumer, tpl, &self.commands);
                if let Err(e) = consumer.assign(&assignment) {
                    tracing::error!(error = %e, "Assigning the partitions failed.");
                    engine.fatal.get_or_insert(Error::Kafka(e));
                }
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                engine.on_revoke(consumer);
                if let Err(e) = consumer.unassign() {
                    tracing::warn!(error = %e, "Unassigning the partitions failed.");
                }
            }
            other => {
                tracing::warn!(error = ?other, "Rebalance failed; giving the partitions up.");
                engine.on_revoke(consumer);
                let _ = consumer.unassign();
            }
        }
    }
}

impl Engine {
    /// Revocation: finish the batch in flight and the open batch while the partitions
    /// are still ours.
    pub fn on_revoke<C: ConsumerContext>(&mut self, consumer: &BaseConsumer<C>) {
        let owned = self.tasks.owned();
        if !self.batch.is_empty() || self.sending.is_some() {
            if consumer.assignment_lost() {
                tracing::warn!(
                    inputs = self.batch.inputs + self.sending.as_ref().map_or(0, |s| s.batch.inputs),
                    "The assignment was lost (this member left the group): the open batches are dropped, the next owner re-reads them."
                );
                self.batch = Default::default();
                if self.sending.is_none() {
                    meter::transaction_failed();
                } else if let Err(e) = self.abort_sending() {
                    tracing::warn!(error = %e, "Aborting the transaction in flight failed; the producer is rebuilt.");
                    self.fatal.get_or_insert(e);
                }
            } else {
                match self.commit_open(consumer) {
                    Ok(()) => {
                        tracing::info!("Committed the open batch before giving the partitions up.")
                    }
                    Err(Failure::Aborted(e, _)) => {
                        tracing::warn!(error = %e, "The open batch did not commit on revocation; the next owner re-reads it.");
                    }
                    Err(Failure::Fatal(e)) => {
                        tracing::warn!(error = %e, "The open batch did not commit on revocation; the producer is rebuilt.");
                        self.fatal.get_or_insert(e);
                    }
                }
            }
        }
        self.save_tallies();
        self.tasks.tasks.clear();
        self.tasks.joined = false;
        // Another member may change these runs before they come back.
        self.hot.clear();
        self.written.clear();
        self.measured.clear();
        self.replays.clear();
        self.refused.clear();
        self.rewind.clear();
        self.positions.clear();
        self.health.set(self.tasks.readiness());
        tracing::info!(partitions = ?owned, "Partitions revoked.");
    }

    /// Assignment: stable offsets, then restore, then the offsets to assign at.
    pub fn on_assign<C: ConsumerContext>(
        &mut self,
        consumer: &BaseConsumer<C>,
        tpl: &TopicPartitionList,
        commands: &str,
    ) -> TopicPartitionList {
        let partitions: BTreeSet<i32> = tpl
            .elements()
            .iter()
            .filter(|e| e.topic() == commands)
            .map(|e| e.partition())
            .collect();
        tracing::info!(
            ?partitions,
            "Partitions assigned; settling offsets and restoring."
        );
        // Revocation settled every batch (the eager protocol revokes before it assigns);
        // a transaction still in flight here would be committed before anything is read.
        if let Err(Failure::Fatal(e)) = self.settle() {
            self.fatal.get_or_insert(e);
            return tpl.clone();
        }
        self.health
            .set(Err(format!("restoring partitions {partitions:?}")));
        let started = Instant::now();
        let committed = match stable_offsets(consumer, tpl)
            .and_then(|committed| from_log_start(&self.marks, committed))
        {
            Ok(committed) => committed,
            Err(e) => {
                // Without settled offsets a restore could fall behind the consumer; give
                // this incarnation up and rejoin with fresh clients.
                tracing::error!(error = %e, "Fetching the committed offsets failed.");
                self.fatal.get_or_insert(Error::Kafka(e));
                return tpl.clone();
            }
        };
        let offsets_ms = started.elapsed().as_millis() as u64;
        let mut plan = BTreeMap::new();
        for partition in &partitions {
            match self.store.changelog_offset(*partition) {
                Ok(from) => {
                    plan.insert(*partition, from);
                }
                Err(e) => {
                    self.fatal.get_or_insert(Error::Store(e));
                    return tpl.clone();
                }
            }
        }
        // The gauges' tallies, kept up to date by the restore: a warm partition's from the
        // snapshot stored with its cache marker, where it reflects exactly that marker; a
        // cold one's from nothing. Only a warm partition without such a snapshot (a crash
        // mid-restore, a cache from an older build) is counted again from the cache
        // afterwards.
        let mut counted = BTreeMap::new();
        for (partition, from) in &plan {
            match from {
                Some(offset) => {
                    if let Ok(Some(bytes)) = self.store.tally(*partition) {
                        let store = &self.store;
                        let index = || store.open_interrupts(*partition).ok();
                        if self.gauges.load(*partition, &bytes, *offset, index) {
                            counted.insert(*partition, "snapshot");
                        }
                    }
                }
                None => {
                    self.gauges.reset(*partition);
                    counted.insert(*partition, "restore");
                }
            }
        }
        let count: BTreeSet<i32> = counted.keys().copied().collect();
        // One deadline for every partition's watermark: a dead leader costs this once, not
        // once per partition, and the whole assignment stays well inside
        // `max.poll.interval.ms` (this runs inside poll).
        let watermarks_by = Instant::now() + WATERMARKS_WAIT;
        let gauges = &mut self.gauges;
        let marks = &self.marks;
        let sources = crate::restore::Sources {
            kafka: &self.config.kafka,
            topics: &self.config.topics,
            codec: &self.codec,
            runtime: &self.runtime,
            store: &self.store,
            fault: self.config.fault,
            fault_after: self.config.fault_after,
        };
        let restored = match crate::restore::partitions(
            sources,
            &plan,
            &count,
            &mut |(partition, run_id, before, after)| {
                gauges.change(partition, run_id, before, after)
            },
            &|topic, partitions, end| {
                sortie_kafka::list_offsets(marks, topic, partitions, end, watermarks_by)
            },
        ) {
            Ok(restored) => restored,
            Err(e) => {
                tracing::error!(error = %e, "Restoring the assigned partitions failed.");
                self.fatal.get_or_insert(e);
                return tpl.clone();
            }
        };
        let took = started.elapsed();
        let records: usize = restored.records.values().sum();
        let warm = plan.values().all(Option::is_some);
        meter::restored(records, warm, took);
        // The signed commands of the replay window, as committed (see `replay`).
        self.read_back_commands(&partitions, &committed);
        for partition in &partitions {
            self.tasks.tasks.insert(*partition, Task::Active);
        }
        self.tasks.joined = true;
        match self.store.quarantined() {
            Ok(runs) => {
                meter::runs_quarantined(runs.len());
                self.quarantined = runs.into_iter().collect();
            }
            Err(e) => {
                self.fatal.get_or_insert(Error::Store(e));
                return tpl.clone();
            }
        }
        for element in committed.elements() {
            if let Offset::Offset(next) = element.offset() {
                self.positions
                    .insert((element.topic().to_owned(), element.partition()), next);
            }
        }
        let uncounted: BTreeSet<i32> = self.tasks.active().difference(&count).copied().collect();
        let mut scanned = 0u64;
        if !uncounted.is_empty() {
            let n = self.partitions;
            let runs = self
                .store
                .runs()
                .filter_map(Result::ok)
                .inspect(|_| scanned += 1);
            self.gauges.rebuild(&uncounted, runs, |run| {
                sortie_wire::partition_for(run.as_bytes(), n)
            });
        }
        let touched = restored.unreleased + crate::store::retained(scanned, 0);
        if touched > self.store.cache_capacity() {
            // sled keeps the nodes a restore wrote, and every node a scan read back from
            // disk, far past its cache's capacity (a reducer settled at ~245 MiB after a
            // cold restore of 1M runs, ~300 MiB after a scan of 1M runs); the store opened
            // again holds what a fresh start would (~145 MiB after that restore).
            let reopening = Instant::now();
            if let Err(e) = self.store.reopen() {
                self.fatal.get_or_insert(Error::Store(e));
                return tpl.clone();
            }
            tracing::info!(
                written_mib = restored.written / (1024 * 1024),
                scanned_runs = scanned,
                millis = reopening.elapsed().as_millis() as u64,
                "Reopened the local store after the restore."
            );
        }
        for (partition, read) in &restored.records {
            let gauges = match counted.get(partition) {
                Some(how) => *how,
                None if uncounted.contains(partition) => "scan",
                None => "none",
            };
            tracing::info!(
                partition,
                records = read,
                warm = plan.get(partition).is_some_and(Option::is_some),
                gauges,
                "Partition restored from the changelog."
            );
        }
        // The tallies now reflect the restored markers: a crash before the next commit
        // that touches a partition finds them there.
        self.save_tallies();
        tracing::info!(
            ?partitions,
            records,
            warm,
            millis = took.as_millis() as u64,
            offsets_ms,
            quarantined = restored.quarantined,
            "Assignment restored; consuming from the committed offsets."
        );
        self.health.set(self.tasks.readiness());
        committed
    }

    /// Stores the gauge tally of every active partition with the changelog offset it
    /// reflects (between commits the tally and the cache agree), so the next assignment
    /// of these partitions to this member need not count their runs again.
    pub fn save_tallies(&mut self) {
        let mut batch = crate::store::Batch::default();
        let mut saving = Vec::new();
        for partition in self.tasks.active() {
            if let Ok(Some(offset)) = self.store.changelog_offset(partition) {
                match self
                    .gauges
                    .save_into(partition, offset, &mut batch, &self.store)
                {
                    Ok(true) => saving.push(partition),
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(partition, error = %e, "Reading the open-interrupt index failed; the next assignment counts the runs again.");
                    }
                }
            }
        }
        if !batch.is_empty() {
            match self.store.apply(batch) {
                Ok(()) => self.gauges.saved(saving),
                Err(e) => {
                    tracing::warn!(error = %e, "Storing the gauge tallies failed; the next assignment counts the runs again.");
                }
            }
        }
    }

    /// Stops `partition` loudly: paused on both input topics, its task stopped (named by
    /// readiness), counted and logged. Nothing of it is read until it is assigned again.
    pub fn stop_partition<C: ConsumerContext>(
        &mut self,
        consumer: &BaseConsumer<C>,
        partition: i32,
        reason: String,
    ) {
        tracing::error!(
            partition,
            reason,
            "The partition stops: it is not consumed until it is assigned again (see the runbook)."
        );
        meter::partition_stopped();
        self.tasks.tasks.insert(partition, Task::Stopped(reason));
        let mut paused = TopicPartitionList::new();
        paused.add_partition(&self.config.topics.commands(), partition);
        paused.add_partition(&self.config.topics.step_results(), partition);
        if let Err(e) = consumer.pause(&paused) {
            tracing::warn!(partition, error = %e, "Pausing the stopped partition failed; its records are skipped instead.");
        }
        self.health.set(self.readiness());
    }
}

/// How long an assignment waits for the changelog partitions' watermarks, all together.
const WATERMARKS_WAIT: Duration = Duration::from_secs(30);

/// The partitions of `committed` without a committed offset start at their log start,
/// asked here in one request per topic, as `auto.offset.reset=earliest` would. Left to
/// librdkafka (an `Invalid` offset), such a partition is looked up again after the
/// assignment's first fetch request has left, and waits that fetch out
/// (`fetch.wait.max.ms`): on a restart where the first input sat in a partition nobody
/// had committed yet, that was a second before the first commit.
fn from_log_start(
    marks: &BaseConsumer,
    mut committed: TopicPartitionList,
) -> Result<TopicPartitionList, KafkaError> {
    let mut unset: BTreeMap<String, Vec<i32>> = BTreeMap::new();
    for element in committed.elements() {
        if !matches!(element.offset(), Offset::Offset(_)) {
            unset
                .entry(element.topic().to_owned())
                .or_default()
                .push(element.partition());
        }
    }
    let deadline = Instant::now() + WATERMARKS_WAIT;
    for (topic, partitions) in &unset {
        let starts = sortie_kafka::list_offsets(
            marks,
            topic,
            partitions,
            sortie_kafka::End::Earliest,
            deadline,
        )?;
        for (partition, start) in starts {
            committed.set_partition_offset(topic, partition, Offset::Offset(start))?;
        }
    }
    Ok(committed)
}

/// How long an assignment waits for stable committed offsets, all tries together.
const OFFSETS_WAIT: Duration = Duration::from_secs(60);

/// The committed offsets of `tpl`, stable (see the module doc). Retried while the
/// coordinator settles, within [`OFFSETS_WAIT`] in all: every step of an assignment is
/// bounded and logs when it waits, and together they stay inside `max.poll.interval.ms`.
fn stable_offsets<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    tpl: &TopicPartitionList,
) -> Result<TopicPartitionList, KafkaError> {
    let mut pause = Duration::from_millis(100);
    let mut tries = 0;
    let deadline = Instant::now() + OFFSETS_WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match consumer.committed_offsets(
            tpl.clone(),
            left.clamp(Duration::from_secs(1), Duration::from_secs(15)),
        ) {
            Ok(committed) => {
                let mut assignment = TopicPartitionList::new();
                for element in committed.elements() {
                    let offset = match element.offset() {
                        Offset::Offset(o) => Offset::Offset(o),
                        // Nothing committed yet: auto.offset.reset (earliest) decides.
                        _ => Offset::Invalid,
                    };
                    assignment.add_partition_offset(
                        element.topic(),
                        element.partition(),
                        offset,
                    )?;
                }
                return Ok(assignment);
            }
            Err(e) if Instant::now() + pause < deadline => {
                tries += 1;
                tracing::warn!(error = %e, tries, "Committed offsets not available yet; retrying.");
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            Err(e) => return Err(e),
        }
    }
}
