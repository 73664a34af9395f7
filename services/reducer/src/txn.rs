//! The transaction of one batch: its outputs, the final state of every run it changed, and
//! the offsets it consumed, committed together — or not at all.
//!
//! Order inside the transaction, and why:
//! 1. every record is handed to the producer (run states last: one serialisation each,
//!    shared with the cache write);
//! 2. the consumed offsets ("last processed + 1") go in with the consumer's group
//!    metadata. The poll loop only commits between polls and the rebalance callback
//!    commits before it gives partitions up, so that metadata is always the generation the
//!    batch's inputs were read in (KIP-447 fences a zombie's offsets by it);
//! 3. every delivery is awaited (commit_transaction's own flush polls in 100 ms slices);
//! 4. commit.
//!
//! Failures are sorted once, here: an abortable error aborts the transaction and the
//! caller seeks back and carries on with the same clients; a fatal one (fenced by a newer
//! incarnation, an abort that fails) rebuilds them.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use std::sync::Mutex;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext};
use rdkafka::{ClientContext, Message, Offset, TopicPartitionList};
use sortie_core::state::WrittenSteps;
use sortie_core::RunState;
use sortie_kafka::produce::PolledProducer;

use crate::batch::{Output, PendingBatch, Source};
use crate::convert;
use crate::driver::Error;
use crate::engine::Engine;
use crate::fault::{self, FaultPoint};
use crate::metrics as meter;
use crate::per_run::PerRun;

/// Most bytes of step JSON [`Written`] holds; past it, it starts over.
const WRITTEN_BYTES: usize = 32 * 1024 * 1024;

/// The JSON of the steps of recently written runs' states, per run
/// ([`sortie_core::state::WrittenSteps`]): a run's next state copies its unchanged steps
/// from it. Bounded by [`WRITTEN_BYTES`]; a finished run's is dropped.
pub(crate) type Written = PerRun<WrittenSteps, { usize::MAX }, WRITTEN_BYTES>;

impl Written {
    /// `run_id`'s `state` as `serde_json::to_string` writes it.
    fn state_json(&mut self, run_id: &str, state: &RunState) -> serde_json::Result<String> {
        let mut steps = self.take(run_id);
        let json = state.to_json_reusing(&mut steps)?;
        if !state.status.is_terminal() {
            self.keep(run_id, steps);
        }
        Ok(json)
    }
}

/// The reducer's transactional producer, polled by the loop itself: with a background
/// polling thread (`FutureProducer`), `commit_transaction`'s own flush raced that thread
/// for the last delivery reports and often waited out a whole 100 ms poll slice after
/// every delivery had already been awaited. Its waits end at the report that ends them
/// (`PolledProducer::serve`).
pub(crate) type TxnProducer = PolledProducer<Deliveries>;

/// Delivery reports of the open transaction: (record index, partition and offset, or the
/// error).
#[derive(Debug, Default)]
pub(crate) struct Deliveries {
    reports: Mutex<Vec<Report>>,
}

/// One delivery report: the record's index in the transaction, and where it landed.
type Report = (usize, Result<(i32, i64), KafkaError>);

impl ClientContext for Deliveries {}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, index: usize) {
        let report = match result {
            Ok(message) => Ok((message.partition(), message.offset())),
            Err((e, _)) => Err(e.clone()),
        };
        if let Ok(mut reports) = self.reports.lock() {
            reports.push((index, report));
        }
    }
}

impl Deliveries {
    fn take(&self) -> Vec<Report> {
        self.reports
            .lock()
            .map(|mut r| std::mem::take(&mut *r))
            .unwrap_or_default()
    }
}

/// Why a transaction did not commit.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Aborted; the same clients can go on once the consumer is back at the batch's start.
    /// With a [`Refusal`] when Kafka refused one record for what it is.
    Aborted(Error, Option<Box<Refusal>>),
    /// The producer cannot go on (fenced, fatal, or the abort itself failed).
    Fatal(Error),
}

impl Failure {
    pub fn aborted(error: Error) -> Failure {
        Failure::Aborted(error, None)
    }
}

/// Kafka refused one record of a transaction for what it is, not for a passing reason:
/// producing it again will be refused again. The record's source is set aside (see
/// `input`): an input is dead-lettered by reference, a run's own record stops its
/// partition — never a batch replayed and refused for ever.
#[derive(Debug, Clone)]
pub(crate) struct Refusal {
    pub source: Source,
    pub kind: RefusalKind,
    pub reason: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RefusalKind {
    /// The record itself: too large, invalid, against the topic's policy.
    Record,
    /// Where it goes: the topic does not exist, or may not be written by this reducer.
    /// A deployment's fault, not the input's: its partition stops until that is fixed.
    Destination,
}

/// Whether `e`, reported for one record, is a refusal of that record (see [`Refusal`]).
fn refusal_kind(e: &KafkaError) -> Option<RefusalKind> {
    use RDKafkaErrorCode as C;
    let KafkaError::MessageProduction(code) = e else {
        return None;
    };
    match code {
        C::MessageSizeTooLarge
        | C::InvalidMessageSize
        | C::MessageBatchTooLarge
        | C::InvalidMessage
        | C::InvalidRecord
        | C::PolicyViolation => Some(RefusalKind::Record),
        C::UnknownTopicOrPartition
        | C::UnknownTopic
        | C::UnknownPartition
        | C::InvalidTopic
        | C::TopicAuthorizationFailed => Some(RefusalKind::Destination),
        _ => None,
    }
}

/// What a committed transaction leaves for the cache write.
#[derive(Debug)]
pub(crate) struct Committed {
    /// The run-state partition → next changelog offset the committed states reach.
    pub changelog: BTreeMap<i32, u64>,
    /// Each changed run's state as serialised once for the changelog, for sled.
    pub states: Vec<(String, Vec<u8>)>,
    /// From the start of the transaction to the commit answer (the next batch folds
    /// during part of it).
    pub took: Duration,
    /// How long the loop was held by this transaction (start, the deliveries it still
    /// had to wait for, the commit): what the pipeline did not overlap.
    pub blocked: Duration,
    pub records: usize,
    /// Where the transaction's time went, ms: encode states, begin + produce, send
    /// offsets, await deliveries, commit.
    pub phases: [u64; 5],
    /// When the transaction began and when its commit was answered, µs since the epoch
    /// (the wall clock its records' timestamps are taken from): how the bench places
    /// each record in the transaction that carried it.
    pub span_us: (i64, i64),
}

/// How often a retriable transactional call is tried before the batch is aborted.
const RETRIES: u32 = 5;

fn is_fatal(e: &KafkaError) -> bool {
    matches!(e, KafkaError::Transaction(inner) if inner.is_fatal())
}

fn is_retriable(e: &KafkaError) -> bool {
    matches!(e, KafkaError::Transaction(inner) if inner.is_retriable() && !inner.txn_requires_abort())
}

/// Runs a transactional call, retrying what librdkafka says may be retried.
fn retrying<T>(
    what: &str,
    mut call: impl FnMut() -> Result<T, KafkaError>,
) -> Result<T, KafkaError> {
    let mut pause = Duration::from_millis(10);
    let mut tries = 0;
    loop {
        match call() {
            Err(e) if is_retriable(&e) && tries < RETRIES => {
                tries += 1;
                // Each try can block for its whole timeout (a coordinator that died): a
                // retry is always logged, so a slow transaction is never a silent one.
                tracing::warn!(what, error = %e, tries, "Retriable transactional error; retrying.");
                std::thread::sleep(pause);
                pause *= 2;
            }
            other => return other,
        }
    }
}

/// A batch whose transaction is open: every record handed to the producer, its offsets
/// sent, its deliveries coming in. The loop folds the next batch meanwhile (see
/// `driver`); nothing of this one is visible until [`Engine::finish_sending`] commits it.
#[derive(Debug)]
pub(crate) struct Sending {
    /// The batch, kept for the cache write after the commit and for reading its runs'
    /// after-states while the next batch folds.
    pub batch: PendingBatch,
    /// Each changed run's state as serialised once for the changelog, for sled.
    states: Vec<(String, Vec<u8>)>,
    /// What made each record handed to the producer, by its index.
    sources: Vec<Source>,
    /// Records handed to the producer; those from `first_state` on are run states.
    records: usize,
    first_state: usize,
    reported: usize,
    changelog: BTreeMap<i32, u64>,
    started: Instant,
    /// `started` on the wall clock, µs since the epoch.
    began_us: i64,
    /// When the deliveries started being awaited (after the offsets were sent).
    pub sent: Instant,
    /// How long the loop has been held by this transaction so far.
    blocked: Duration,
    phases: [u64; 5],
}

impl Sending {
    pub fn delivered(&self) -> bool {
        self.reported >= self.records
    }
}

/// How long a transaction waits for its deliveries before it is aborted.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(30);

fn ms(at: Instant) -> u64 {
    at.elapsed().as_millis() as u64
}

impl Engine {
    /// Opens the transaction of the open batch and hands it every record and the
    /// consumed offsets, without waiting for the deliveries: the batch moves to
    /// [`Engine::sending`]. Only one transaction is open at a time: the caller has
    /// finished the previous one. On `Err` the transaction is aborted and the batch is
    /// gone (the caller seeks back).
    pub fn start_sending<C: ConsumerContext>(
        &mut self,
        consumer: &BaseConsumer<C>,
    ) -> Result<(), Failure> {
        debug_assert!(self.sending.is_none(), "one open transaction at a time");
        if let Some(why) = &self.batch.broken {
            // An input of it was met halfway: committing would lose that input and write
            // states behind their events. Nothing of it was produced; it is read again.
            let failure = Failure::aborted(Error::Setup(format!(
                "the open batch is not whole ({why}); it is dropped, never committed"
            )));
            let batch = std::mem::take(&mut self.batch);
            self.dropped(&batch);
            meter::transaction_failed();
            return Err(failure);
        }
        let started = Instant::now();
        let began_us = sortie_kafka::clock::now_us();
        let mut written = std::mem::take(&mut self.written);
        let result = self.send_open(consumer, started, began_us, &mut written);
        self.written = written;
        let mut batch = std::mem::replace(&mut self.batch, PendingBatch::reusing(&mut self.spare));
        match result {
            Ok(mut sending) => {
                // The producer holds copies of the records now.
                self.spare.keep_outputs(std::mem::take(&mut batch.outputs));
                sending.batch = batch;
                self.sending = Some(sending);
                Ok(())
            }
            Err(failure) => {
                self.dropped(&batch);
                meter::transaction_failed();
                Err(failure)
            }
        }
    }

    /// Notes that `batch` was dropped uncommitted: the consumer must seek back to the
    /// first offset it read of each partition (see `driver::pipeline::rewinding`).
    pub fn dropped(&mut self, batch: &PendingBatch) {
        self.rewind_to(crate::batch::first_offsets([batch]));
    }

    /// Notes first offsets of dropped inputs to seek back to (the earliest wins).
    pub fn rewind_to(&mut self, first: BTreeMap<(String, i32), i64>) {
        for (at, offset) in first {
            self.rewind
                .entry(at)
                .and_modify(|f| *f = (*f).min(offset))
                .or_insert(offset);
        }
    }

    fn send_open<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
        started: Instant,
        began_us: i64,
        written: &mut Written,
    ) -> Result<Sending, Failure> {
        // Nothing sealed with a key of this batch's may be produced before the key is.
        self.persist_new_keys().map_err(Failure::aborted)?;
        let batch = &self.batch;
        let run_state_topic = self.config.topics.run_state();
        let mut run_ids: Vec<&String> = batch.after.keys().collect();
        run_ids.sort();
        let mut states = Vec::with_capacity(run_ids.len());
        let mut state_outputs = Vec::with_capacity(run_ids.len());
        for run_id in run_ids {
            let state = &batch.after[run_id];
            let sealed = batch.seals.get(run_id).map(|seal| state.sealed(seal));
            let json = match &sealed {
                // Sealed anew for this write: no step of it was written before.
                Some(sealed) => {
                    written.take(run_id);
                    serde_json::to_string(sealed)
                }
                None => written.state_json(run_id, state),
            };
            let state = sealed.as_ref().unwrap_or(state);
            let json = json.map_err(|e| {
                Failure::aborted(Error::Setup(format!("run state of {run_id}: {e}")))
            })?;
            let record = convert::state_to_wire_json(state, json);
            let value = self
                .encode(&run_state_topic, &record)
                .map_err(Failure::aborted)?;
            state_outputs.push(Output {
                topic: run_state_topic.clone(),
                partition: Some(self.partition_of(run_id)),
                key: run_id.clone().into_bytes(),
                value: Some(value),
                headers: vec![],
                source: Source::Run(run_id.clone()),
            });
            // The same JSON goes to sled (sealed, as in the changelog; packed there): one
            // serialisation per state.
            states.push((run_id.clone(), record.state.into_bytes()));
        }

        let mut phases = [0u64; 5];
        phases[0] = ms(started);
        let phase = Instant::now();
        let producer = &self.producer;
        producer.context().take(); // nothing of an earlier transaction is pending
        retrying("begin", || producer.begin_transaction()).map_err(|e| self.abort_after(e))?;
        let outputs = batch.outputs.iter().chain(&state_outputs);
        let sources: Vec<Source> = outputs.clone().map(|o| o.source.clone()).collect();
        for (index, output) in outputs.enumerate() {
            let mut headers = OwnedHeaders::new();
            for (key, value) in &output.headers {
                headers = headers.insert(Header {
                    key,
                    value: value.as_deref(),
                });
            }
            let mut record = BaseRecord::with_opaque_to(&output.topic, index)
                .key(&output.key)
                .headers(headers);
            if let Some(value) = &output.value {
                record = record.payload(value);
            }
            if let Some(p) = output.partition {
                record = record.partition(p);
            }
            loop {
                match producer.send(record) {
                    Ok(()) => break,
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                        // The local queue is full: serve delivery reports, then try again.
                        producer.serve(Duration::from_millis(5));
                        record = back;
                    }
                    Err((e, _)) => return Err(self.abort_refused(e, &sources[index])),
                }
            }
        }
        let mut offsets = TopicPartitionList::new();
        for ((topic, partition), next) in
            crate::batch::offsets_to_send(batch, &self.positions, &self.config.topics.commands())
        {
            offsets
                .add_partition_offset(&topic, partition, Offset::Offset(next))
                .map_err(|e| self.abort_after(e))?;
        }
        phases[1] = ms(phase);
        let phase = Instant::now();
        if offsets.count() > 0 {
            // The loop polls only between batches and the rebalance callback finishes
            // this transaction before it gives partitions up: this is the generation the
            // batch's inputs were read in.
            let Some(metadata) = consumer.group_metadata() else {
                return Err(self.abort_after(KafkaError::Global(RDKafkaErrorCode::State)));
            };
            let timeout = Duration::from_secs(10);
            retrying("send offsets", || {
                self.watchdog
                    .bound("send_offsets_to_transaction", timeout, || {
                        self.hang_if(FaultPoint::HangInSendOffsets);
                        producer.send_offsets_to_transaction(&offsets, &metadata, timeout)
                    })
            })
            .map_err(|e| self.abort_after(e))?;
        }
        phases[2] = ms(phase);
        Ok(Sending {
            batch: PendingBatch::default(),
            states,
            sources,
            records: batch.outputs.len() + state_outputs.len(),
            first_state: batch.outputs.len(),
            reported: 0,
            changelog: BTreeMap::new(),
            started,
            began_us,
            sent: Instant::now(),
            blocked: started.elapsed(),
            phases,
        })
    }

    /// Serves the delivery reports of the open transaction for up to `wait` (on this
    /// thread: then `commit_transaction`'s own flush has nothing left to wait for).
    /// `Ok(true)`: every record is delivered. A failed delivery, or deliveries that do not
    /// come within [`DELIVERY_TIMEOUT`], abort the transaction.
    pub fn serve_deliveries(&self, sending: &mut Sending, wait: Duration) -> Result<bool, Failure> {
        let producer = &self.producer;
        let deadline = Instant::now() + wait;
        if sending.delivered() {
            // The last report came in an earlier call: nothing is left to wait for (a
            // wait here would sit out `wait` for an event that never comes).
            return Ok(true);
        }
        loop {
            // Returns at the first report (or error) served, so the loop below sees
            // each report as it comes.
            producer.serve(deadline.saturating_duration_since(Instant::now()));
            for (index, report) in producer.context().take() {
                sending.reported += 1;
                match report {
                    Ok((partition, offset)) => {
                        if index >= sending.first_state {
                            let next = (offset + 1) as u64;
                            let entry = sending.changelog.entry(partition).or_insert(next);
                            *entry = (*entry).max(next);
                        }
                    }
                    Err(e) => {
                        let source = sending.sources.get(index).cloned();
                        return Err(match source {
                            Some(source) => self.abort_refused(e, &source),
                            None => self.abort_after(e),
                        });
                    }
                }
            }
            if sending.delivered() {
                return Ok(true);
            }
            if sending.sent.elapsed() > DELIVERY_TIMEOUT {
                return Err(self.abort_after(KafkaError::MessageProduction(
                    RDKafkaErrorCode::MessageTimedOut,
                )));
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
        }
    }

    /// Awaits the rest of the deliveries and commits. On `Err` the transaction is
    /// aborted; on `Ok` the caller writes the cache.
    pub fn finish_sending(
        &self,
        mut sending: Sending,
    ) -> Result<(PendingBatch, Committed), Failure> {
        let held = Instant::now();
        while !self.serve_deliveries(&mut sending, Duration::from_millis(100))? {}
        sending.phases[3] = ms(sending.sent);
        let phase = Instant::now();
        let fault = |point| fault::check(self.config.fault, self.config.fault_after, point);
        fault(FaultPoint::BeforeCommit);
        let timeout = Duration::from_secs(15);
        let producer = &self.producer;
        retrying("commit", || {
            self.watchdog.bound("commit_transaction", timeout, || {
                producer.commit_transaction(timeout)
            })
        })
        .map_err(|e| self.abort_after(e))?;
        sending.phases[4] = ms(phase);
        let committed_us = sortie_kafka::clock::now_us();
        sending.blocked += held.elapsed();
        fault(FaultPoint::AfterCommit);
        let committed = Committed {
            changelog: sending.changelog,
            states: sending.states,
            took: sending.started.elapsed(),
            blocked: sending.blocked,
            records: sending.records,
            phases: sending.phases,
            span_us: (sending.began_us, committed_us),
        };
        Ok((sending.batch, committed))
    }

    /// Aborts the transaction in flight, if any, without waiting for it (the assignment
    /// was lost: its offsets would be refused). `Err`: the producer cannot go on.
    pub fn abort_sending(&mut self) -> Result<(), Error> {
        if self.sending.take().is_none() {
            return Ok(());
        }
        meter::transaction_failed();
        self.abort_open().map_err(Error::Kafka)
    }

    /// Whether the configured fault is `point` and still to be taken.
    pub(crate) fn fault_armed(&self, point: FaultPoint) -> bool {
        sortie_kafka::fault::armed(self.config.fault, self.config.fault_after, point)
    }

    /// Whether the configured fault `point` is taken now (once; see `fault`).
    pub(crate) fn fault_once(&self, point: FaultPoint) -> bool {
        fault::fires_once(self.config.fault, self.config.fault_after, point)
    }

    /// Aborts the producer's open transaction, under the watchdog's bound.
    fn abort_open(&self) -> Result<(), KafkaError> {
        let timeout = Duration::from_secs(10);
        self.watchdog.bound("abort_transaction", timeout, || {
            self.producer.abort_transaction(timeout)
        })
    }

    /// Blocks this thread for good at `point` if it is the configured fault: a wedged
    /// librdkafka call, for the watchdog's test.
    fn hang_if(&self, point: FaultPoint) {
        fault::hang(self.config.fault, self.config.fault_after, point);
    }

    /// Aborts the open transaction after `e`, reported for the record made by `source`:
    /// if it is a refusal of that record, the failure says so (see [`Refusal`]).
    pub fn abort_refused(&self, e: KafkaError, source: &Source) -> Failure {
        let refusal = refusal_kind(&e).map(|kind| Refusal {
            source: source.clone(),
            kind,
            reason: e.to_string(),
        });
        match (self.abort_after(e), refusal) {
            (Failure::Aborted(error, None), Some(refusal)) => {
                Failure::Aborted(error, Some(Box::new(refusal)))
            }
            (failure, _) => failure,
        }
    }

    /// Aborts the open transaction after `e`. A fatal error, or an abort that fails,
    /// leaves a producer that cannot go on.
    pub fn abort_after(&self, e: KafkaError) -> Failure {
        if is_fatal(&e) {
            tracing::warn!(error = %e, "The transactional producer hit a fatal error (fenced by a newer incarnation?).");
            return Failure::Fatal(Error::Fenced);
        }
        tracing::warn!(error = %e, "Aborting the batch's transaction.");
        match self.abort_open() {
            Ok(()) => Failure::aborted(Error::Kafka(e)),
            Err(abort) if matches!(&abort, KafkaError::Transaction(inner) if inner.code() == RDKafkaErrorCode::State) =>
            {
                // No transaction was open (begin failed): nothing to abort.
                Failure::aborted(Error::Kafka(e))
            }
            Err(abort) => {
                tracing::warn!(error = %abort, "Aborting the transaction failed; the producer is rebuilt.");
                Failure::Fatal(Error::Kafka(abort))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use sortie_core::RunStatus;

    use super::*;

    fn state(steps: &[&str]) -> RunState {
        let mut state = crate::gauges::tests::state(RunStatus::Running, &[], 0);
        for id in steps {
            let step = serde_json::from_value(serde_json::json!({
                "step_id": id, "node": "n", "operation_id": format!("op-{id}"), "attempt": 1,
                "tool": "echo", "queue": "default", "side_effect": "pure",
                "args": {"text": "é\"\n"}, "role": "Node", "status": "in_flight",
                "output": null, "error": null
            }))
            .expect("step");
            state.steps.insert((*id).to_owned(), step);
        }
        state
    }

    #[test]
    fn states_are_written_as_serde_json_writes_them_and_finished_runs_are_not_kept() {
        let mut written = Written::default();
        let mut run = state(&["a#1", "b#1"]);
        let first = written.state_json("r", &run).expect("json");
        assert_eq!(first, serde_json::to_string(&run).expect("json"));
        let held = written.bytes();
        assert!(held > 0);

        // A later state: one step changed (copied, as the fold does), one added.
        let step = Arc::make_mut(run.steps.get_mut("a#1").expect("step"));
        step.status = sortie_core::state::StepStatus::Succeeded;
        step.output = Some(serde_json::json!({"text": "done"}));
        run.steps.insert("c#1".into(), run.steps["b#1"].clone());
        let second = written.state_json("r", &run).expect("json");
        assert_eq!(second, serde_json::to_string(&run).expect("json"));
        assert!(written.bytes() > held);

        run.status = RunStatus::Succeeded;
        let last = written.state_json("r", &run).expect("json");
        assert_eq!(last, serde_json::to_string(&run).expect("json"));
        assert_eq!((written.len(), written.bytes()), (0, 0));
    }
}
