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
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext};
use rdkafka::{ClientContext, Message, Offset, TopicPartitionList};

use crate::batch::Output;
use crate::convert;
use crate::driver::Error;
use crate::engine::Engine;
use crate::fault::{self, FaultPoint};

/// The reducer's transactional producer. A `BaseProducer` polled by the loop itself:
/// with a background polling thread (`FutureProducer`), `commit_transaction`'s own flush
/// raced that thread for the last delivery reports and often waited out a whole 100 ms
/// poll slice after every delivery had already been awaited.
pub(crate) type TxnProducer = BaseProducer<Deliveries>;

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
    Aborted(Error),
    /// The producer cannot go on (fenced, fatal, or the abort itself failed).
    Fatal(Error),
}

/// What a committed transaction leaves for the cache write.
#[derive(Debug)]
pub(crate) struct Committed {
    /// The run-state partition → next changelog offset the committed states reach.
    pub changelog: BTreeMap<i32, u64>,
    /// Each changed run's state as serialised once for the changelog, for sled.
    pub states: Vec<(String, Vec<u8>)>,
    pub took: Duration,
    pub records: usize,
    /// Where the transaction's time went, ms: encode states, begin + produce, send
    /// offsets, await deliveries, commit.
    pub phases: [u64; 5],
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

impl Engine {
    /// Commits the open batch in one transaction. On `Err` nothing of it is visible to
    /// `read_committed` readers and the batch is gone from the engine (the caller seeks
    /// back). On `Ok` the caller writes the cache.
    pub fn commit_batch<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
    ) -> Result<Committed, Failure> {
        let started = Instant::now();
        // Nothing sealed with a key of this batch's may be produced before the key is.
        self.persist_new_keys().map_err(Failure::Aborted)?;
        let batch = &self.batch;
        let run_state_topic = self.config.topics.run_state();
        let mut run_ids: Vec<&String> = batch.after.keys().collect();
        run_ids.sort();
        let mut states = Vec::with_capacity(run_ids.len());
        let mut state_outputs = Vec::with_capacity(run_ids.len());
        for run_id in run_ids {
            let state = &batch.after[run_id];
            let sealed = batch.seals.get(run_id).map(|seal| state.sealed(seal));
            let state = sealed.as_ref().unwrap_or(state);
            let json = serde_json::to_string(state).map_err(|e| {
                Failure::Aborted(Error::Setup(format!("run state of {run_id}: {e}")))
            })?;
            let record = convert::state_to_wire_json(state, json);
            let value = self
                .encode(&run_state_topic, &record)
                .map_err(Failure::Aborted)?;
            state_outputs.push(Output {
                topic: run_state_topic.clone(),
                partition: Some(self.partition_of(run_id)),
                key: run_id.clone().into_bytes(),
                value: Some(value),
                headers: vec![],
            });
            // The same JSON goes to sled (sealed, as in the changelog): one serialisation
            // per state.
            states.push((run_id.clone(), record.state.into_bytes()));
        }

        let ms = |at: Instant| at.elapsed().as_millis() as u64;
        let mut phases = [0u64; 5];
        phases[0] = ms(started);
        let phase = Instant::now();
        let producer = &self.producer;
        producer.context().take(); // nothing of an earlier transaction is pending
        retrying("begin", || producer.begin_transaction()).map_err(|e| self.abort_after(e))?;
        let outputs: Vec<&Output> = batch.outputs.iter().chain(&state_outputs).collect();
        for (index, output) in outputs.iter().enumerate() {
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
                        producer.poll(Duration::from_millis(5));
                        record = back;
                    }
                    Err((e, _)) => return Err(self.abort_after(e)),
                }
            }
        }
        let mut offsets = TopicPartitionList::new();
        for ((topic, partition), consumed) in &batch.offsets {
            offsets
                .add_partition_offset(topic, *partition, Offset::Offset(consumed.next))
                .map_err(|e| self.abort_after(e))?;
        }
        phases[1] = ms(phase);
        let phase = Instant::now();
        if offsets.count() > 0 {
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
        let phase = Instant::now();
        // Every delivery report, served on this thread, before the commit: then
        // commit_transaction's flush has nothing left to wait for.
        let mut changelog: BTreeMap<i32, u64> = BTreeMap::new();
        let records = outputs.len();
        let mut reported = 0;
        let deadline = Instant::now() + Duration::from_secs(30);
        while reported < records {
            producer.poll(Duration::from_millis(5));
            for (index, report) in producer.context().take() {
                reported += 1;
                match report {
                    Ok((partition, offset)) => {
                        if outputs[index].topic == run_state_topic {
                            let next = (offset + 1) as u64;
                            let entry = changelog.entry(partition).or_insert(next);
                            *entry = (*entry).max(next);
                        }
                    }
                    Err(e) => return Err(self.abort_after(e)),
                }
            }
            if reported < records && Instant::now() > deadline {
                return Err(self.abort_after(KafkaError::MessageProduction(
                    RDKafkaErrorCode::MessageTimedOut,
                )));
            }
        }
        phases[3] = ms(phase);
        let phase = Instant::now();
        let fault = |point| fault::check(self.config.fault, self.config.fault_after, point);
        fault(FaultPoint::BeforeCommit);
        let timeout = Duration::from_secs(15);
        retrying("commit", || {
            self.watchdog.bound("commit_transaction", timeout, || {
                producer.commit_transaction(timeout)
            })
        })
        .map_err(|e| self.abort_after(e))?;
        phases[4] = ms(phase);
        fault(FaultPoint::AfterCommit);
        Ok(Committed {
            changelog,
            states,
            took: started.elapsed(),
            records,
            phases,
        })
    }

    /// Blocks this thread for good at `point` if it is the configured fault: a wedged
    /// librdkafka call, for the watchdog's test.
    fn hang_if(&self, point: FaultPoint) {
        if fault::fires(self.config.fault, self.config.fault_after, point) {
            loop {
                std::thread::park();
            }
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
        let timeout = Duration::from_secs(10);
        let aborted = self.watchdog.bound("abort_transaction", timeout, || {
            self.producer.abort_transaction(timeout)
        });
        match aborted {
            Ok(()) => Failure::Aborted(Error::Kafka(e)),
            Err(abort) if matches!(&abort, KafkaError::Transaction(inner) if inner.code() == RDKafkaErrorCode::State) =>
            {
                // No transaction was open (begin failed): nothing to abort.
                Failure::Aborted(Error::Kafka(e))
            }
            Err(abort) => {
                tracing::warn!(error = %abort, "Aborting the transaction failed; the producer is rebuilt.");
                Failure::Fatal(Error::Kafka(abort))
            }
        }
    }
}
