//! The exactly-once loop around the fold.
//!
//! One thread owns a consumer (commands + step-results, `read_committed`, range
//! assignment so partition N of both topics lands on the same member) and a transactional
//! producer. Each batch — up to `max_batch` inputs or `commit_interval`, whichever comes
//! first, plus the timers due now — is applied with `sortie_core::apply`, and its outputs
//! (intents, run events, the final run states, dead letters, forwarded records) and the
//! consumed offsets are committed in ONE transaction. Only then is sled written, in one
//! atomic batch together with the changelog offsets it reflects.
//!
//! Invariants:
//! - sled never runs ahead of Kafka: it is written after the commit, so after a crash it
//!   is at most behind, and the restore reads the changelog from its marker.
//! - an aborted or failed transaction leaves nothing visible to `read_committed` readers;
//!   the consumer is rewound to the committed offsets and the batch's in-memory state is
//!   dropped, so the same inputs are applied again to the same state: same effects.
//! - offsets sent are "last processed + 1".

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::future::join_all;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, Headers, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{ClientContext, Message, Offset, TopicPartitionList};
use sortie_core::{apply, Effect, Input, RunState};
use sortie_kafka::KafkaConfig;
use sortie_wire::records as w;
use sortie_wire::{partition_for, Codec, CodecConfig, DecodeError, Record, Topics, TraceContext};
use tokio::runtime::Handle;

use crate::convert;
use crate::fault::{self, FaultPoint};
use crate::graphs::GraphTable;
use crate::health::Health;
use crate::metrics::{self as meter, BatchCounts, RunGauges};
use crate::store::{self, Store};

/// How a reducer instance runs.
#[derive(Debug, Clone)]
pub struct ReducerConfig {
    pub kafka: KafkaConfig,
    pub registry_url: String,
    /// Register schemas when missing (dev, tests).
    pub auto_register: bool,
    pub topics: Topics,
    /// Consumer group of all reducers.
    pub group_id: String,
    /// Stable per instance: the transactional id is derived from it, so a restarted
    /// instance fences and aborts its previous incarnation.
    pub instance_id: String,
    /// Use `group.instance.id` (static membership: a restart within the session timeout
    /// keeps the assignment without a rebalance).
    pub static_membership: bool,
    pub data_dir: PathBuf,
    pub commit_interval: Duration,
    pub max_batch: usize,
    pub max_payload_bytes: usize,
    pub session_timeout: Duration,
    /// Die on purpose at this point, on its `fault_after`-th pass (crash tests only; never
    /// set by default).
    pub fault: Option<FaultPoint>,
    pub fault_after: u32,
}

impl ReducerConfig {
    pub fn new(
        kafka: KafkaConfig,
        registry_url: impl Into<String>,
        topics: Topics,
        data_dir: PathBuf,
    ) -> Self {
        Self {
            kafka,
            registry_url: registry_url.into(),
            auto_register: true,
            group_id: format!("{}reducer", topics.prefix()),
            topics,
            instance_id: "0".into(),
            static_membership: false,
            data_dir,
            commit_interval: Duration::from_millis(100),
            max_batch: 500,
            max_payload_bytes: 1024 * 1024,
            session_timeout: Duration::from_secs(10),
            fault: None,
            fault_after: 1,
        }
    }

    pub fn transactional_id(&self) -> String {
        format!("{}-{}", self.group_id, self.instance_id)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kafka: {0}")]
    Kafka(#[from] KafkaError),
    #[error("local store: {0}")]
    Store(#[from] store::Error),
    #[error("graph table: {0}")]
    Graphs(#[from] crate::graphs::Error),
    #[error("schema registry: {0}")]
    Registry(String),
    #[error("this instance was fenced by a newer one with the same transactional id")]
    Fenced,
    #[error("{0}")]
    Setup(String),
}

/// Partitions this instance owns, shared with the rebalance callbacks.
#[derive(Default)]
struct Ownership {
    partitions: BTreeSet<i32>,
    /// Assigned but not yet restored from the changelog.
    pending_restore: BTreeSet<i32>,
    /// A member with its assignment in hand (false from a revocation to the next assignment).
    joined: bool,
}

struct ReducerContext {
    commands: String,
    ownership: Arc<Mutex<Ownership>>,
}

impl ClientContext for ReducerContext {
    fn stats(&self, statistics: rdkafka::Statistics) {
        sortie_kafka::metrics::consumer_lag(&statistics);
    }
}

impl ConsumerContext for ReducerContext {
    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let Ok(mut own) = self.ownership.lock() else {
            return;
        };
        match rebalance {
            Rebalance::Assign(list) => {
                for element in list
                    .elements()
                    .iter()
                    .filter(|e| e.topic() == self.commands)
                {
                    own.partitions.insert(element.partition());
                    own.pending_restore.insert(element.partition());
                }
                own.joined = true;
                tracing::info!(partitions = ?own.partitions, "Partitions assigned.");
            }
            Rebalance::Revoke(list) => {
                for element in list
                    .elements()
                    .iter()
                    .filter(|e| e.topic() == self.commands)
                {
                    own.partitions.remove(&element.partition());
                    own.pending_restore.remove(&element.partition());
                }
                own.joined = false;
                tracing::info!(partitions = ?own.partitions, "Partitions revoked.");
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "Rebalance failed."),
        }
    }
}

/// One record to produce in the batch's transaction.
struct Output {
    topic: String,
    partition: Option<i32>,
    key: Vec<u8>,
    value: Vec<u8>,
    headers: Vec<(String, Option<Vec<u8>>)>,
}

/// What one batch has decided, waiting for its commit.
#[derive(Default)]
struct PendingBatch {
    inputs: usize,
    outputs: Vec<Output>,
    /// (topic, partition) → next offset to consume.
    offsets: BTreeMap<(String, i32), i64>,
    /// Runs as they were in sled before this batch (None: new), and as they are now.
    before: HashMap<String, Option<RunState>>,
    after: HashMap<String, RunState>,
    /// Timers fired this batch (removed from the index whatever the fold decided).
    fired: Vec<store::DueTimer>,
    ignored: usize,
    dead_letters: usize,
    /// Metrics of this batch, published only if it commits.
    counts: BatchCounts,
}

/// Runs the reducer until `shutdown` is set. Blocking: call it from a dedicated thread (or
/// `spawn_blocking`). Recoverable Kafka trouble (a fenced producer, a failed commit) makes
/// it rebuild its clients and carry on; it returns only on shutdown or a setup error.
pub fn run(config: ReducerConfig, runtime: Handle, shutdown: Arc<AtomicBool>) -> Result<(), Error> {
    run_with_health(config, runtime, shutdown, Health::default())
}

/// [`run`], reporting readiness to `health` (see [`crate::health`]).
pub fn run_with_health(
    config: ReducerConfig,
    runtime: Handle,
    shutdown: Arc<AtomicBool>,
    health: Health,
) -> Result<(), Error> {
    let store = Arc::new(Store::open(&config.data_dir.join("sled"))?);
    let codec = Arc::new(Codec::new(&CodecConfig {
        registry_url: config.registry_url.clone(),
        auto_register: config.auto_register,
    }));
    let mut failures = 0u32;
    while !shutdown.load(Ordering::Relaxed) {
        match Reducer::new(&config, runtime.clone(), codec.clone(), store.clone())
            .and_then(|mut r| r.with_health(health.clone()).run(&shutdown))
        {
            Ok(()) => return Ok(()),
            Err(e @ (Error::Setup(_) | Error::Store(_))) => return Err(e),
            Err(e) => {
                failures += 1;
                health.set(Err(format!("rebuilding the Kafka clients after: {e}")));
                let backoff = Duration::from_millis(200 * u64::from(failures.min(10)));
                tracing::warn!(error = %e, ?backoff, "The reducer loop failed; rebuilding its Kafka clients.");
                std::thread::sleep(backoff);
            }
        }
    }
    Ok(())
}

struct Reducer<'c> {
    config: &'c ReducerConfig,
    runtime: Handle,
    codec: Arc<Codec>,
    store: Arc<Store>,
    graphs: GraphTable,
    consumer: BaseConsumer<ReducerContext>,
    producer: FutureProducer,
    ownership: Arc<Mutex<Ownership>>,
    partitions: u32,
    health: Health,
    gauges: RunGauges,
    gauges_published: Option<Instant>,
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl<'c> Reducer<'c> {
    fn new(
        config: &'c ReducerConfig,
        runtime: Handle,
        codec: Arc<Codec>,
        store: Arc<Store>,
    ) -> Result<Self, Error> {
        let topics = &config.topics;
        let mut graphs = GraphTable::open(&config.kafka, topics, codec.clone(), runtime.clone())?;
        let loaded = graphs.catch_up(Duration::from_secs(30))?;
        tracing::info!(graphs = loaded, "Graph table loaded.");

        let ownership = Arc::new(Mutex::new(Ownership::default()));
        let context = ReducerContext {
            commands: topics.commands(),
            ownership: ownership.clone(),
        };
        let mut consumer_config = config.kafka.client();
        consumer_config
            .set("group.id", &config.group_id)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("isolation.level", "read_committed")
            .set("auto.offset.reset", "earliest")
            // Range gives partition N of commands and of step-results to the same member:
            // one writer per run. cooperative-sticky does not guarantee that.
            .set("partition.assignment.strategy", "range")
            .set(
                "session.timeout.ms",
                config.session_timeout.as_millis().to_string(),
            )
            .set(
                "heartbeat.interval.ms",
                (config.session_timeout.as_millis() / 4)
                    .max(500)
                    .to_string(),
            )
            .set("allow.auto.create.topics", "false")
            // Feeds ReducerContext::stats: consumer lag per partition.
            .set(
                "statistics.interval.ms",
                sortie_kafka::metrics::STATISTICS_INTERVAL_MS,
            );
        if config.static_membership {
            consumer_config.set("group.instance.id", &config.instance_id);
        }
        let consumer: BaseConsumer<ReducerContext> =
            consumer_config.create_with_context(context)?;

        let mut producer_config = config.kafka.producer();
        producer_config
            .set("transactional.id", config.transactional_id())
            .set("enable.idempotence", "true")
            .set("transaction.timeout.ms", "15000")
            .set("linger.ms", "2")
            .set("compression.type", "zstd");
        let producer: FutureProducer = producer_config.create()?;
        producer.init_transactions(Duration::from_secs(30))?;

        let metadata =
            consumer.fetch_metadata(Some(&topics.commands()), Duration::from_secs(10))?;
        let partitions = metadata
            .topics()
            .first()
            .map(|t| t.partitions().len() as u32)
            .filter(|n| *n > 0)
            .ok_or_else(|| {
                Error::Setup(format!(
                    "topic {} does not exist; run `sortie topology apply`",
                    topics.commands()
                ))
            })?;
        consumer.subscribe(&[&topics.commands(), &topics.step_results()])?;
        tracing::info!(transactional_id = %config.transactional_id(), partitions, "Reducer started.");
        Ok(Self {
            config,
            runtime,
            codec,
            store,
            graphs,
            consumer,
            producer,
            ownership,
            partitions,
            health: Health::default(),
            gauges: RunGauges::default(),
            gauges_published: None,
        })
    }

    fn with_health(&mut self, health: Health) -> &mut Self {
        self.health = health;
        self
    }

    /// After a pass of the loop: readiness (joined, everything restored, polled since) and,
    /// at most once a second, the run gauges.
    fn observe(&mut self) {
        let (readiness, owned) = match self.ownership.lock() {
            Ok(own) if !own.joined => (
                Err("waiting for a partition assignment".to_owned()),
                own.partitions.clone(),
            ),
            Ok(own) if !own.pending_restore.is_empty() => (
                Err(format!("restoring partitions {:?}", own.pending_restore)),
                own.partitions.clone(),
            ),
            Ok(own) => (Ok(()), own.partitions.clone()),
            Err(_) => (Err("ownership state poisoned".to_owned()), BTreeSet::new()),
        };
        self.health.set(readiness);
        if self
            .gauges_published
            .is_none_or(|at| at.elapsed() >= Duration::from_secs(1))
        {
            self.gauges.publish(&owned, now_ms());
            self.gauges_published = Some(Instant::now());
        }
    }

    fn run(&mut self, shutdown: &AtomicBool) -> Result<(), Error> {
        while !shutdown.load(Ordering::Relaxed) {
            self.restore_pending()?;
            self.graphs.poll();
            let mut batch = PendingBatch::default();
            self.fire_timers(&mut batch)?;
            let deadline = Instant::now() + self.config.commit_interval;
            while batch.inputs < self.config.max_batch {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                match self.consumer.poll(left) {
                    None => break,
                    Some(Err(e)) => tracing::warn!(error = %e, "Consumer error."),
                    Some(Ok(message)) => {
                        let message = message.detach();
                        self.handle(&message, &mut batch)?;
                    }
                }
                if !self
                    .ownership
                    .lock()
                    .map(|o| o.pending_restore.is_empty())
                    .unwrap_or(true)
                {
                    break; // a rebalance happened: restore before going on
                }
            }
            if batch.inputs > 0 || !batch.fired.is_empty() {
                if let Err(e) = self.commit(batch) {
                    meter::transaction_failed();
                    self.rewind();
                    return Err(e);
                }
            }
            self.observe();
        }
        self.health.set(Err("shutting down".to_owned()));
        self.consumer.unsubscribe();
        Ok(())
    }

    /// Restores newly assigned partitions from `sortie.run-state`: from sled's marker (warm)
    /// or the beginning (cold). Nothing of a partition is applied before its restore.
    fn restore_pending(&mut self) -> Result<(), Error> {
        let pending: Vec<i32> = match self.ownership.lock() {
            Ok(own) => own.pending_restore.iter().copied().collect(),
            Err(_) => return Ok(()),
        };
        for partition in pending.iter().copied() {
            let started = Instant::now();
            let from = self.store.changelog_offset(partition)?;
            let restored = crate::restore::partition(
                &self.config.kafka,
                &self.config.topics,
                &self.codec,
                &self.runtime,
                &self.store,
                partition,
                from,
            )?;
            tracing::info!(
                partition,
                records = restored,
                warm = from.is_some(),
                millis = started.elapsed().as_millis() as u64,
                "Partition restored from the changelog."
            );
            meter::restored(restored, from.is_some(), started.elapsed());
            if let Ok(mut own) = self.ownership.lock() {
                own.pending_restore.remove(&partition);
            }
        }
        if !pending.is_empty() {
            let restored: BTreeSet<i32> = pending.iter().copied().collect();
            let n = self.partitions;
            let runs = self.store.runs().filter_map(Result::ok);
            self.gauges
                .rebuild(&restored, runs, |run| partition_for(run.as_bytes(), n));
            self.gauges_published = None;
        }
        Ok(())
    }

    fn owned(&self) -> BTreeSet<i32> {
        self.ownership
            .lock()
            .map(|o| o.partitions.clone())
            .unwrap_or_default()
    }

    fn fire_timers(&mut self, batch: &mut PendingBatch) -> Result<(), Error> {
        let now = now_ms();
        let due = self
            .store
            .due_timers(now, &self.owned(), self.config.max_batch)?;
        for timer in due {
            if let Some(key) = sortie_core::TimerKey::decode(&timer.timer_key) {
                let input = Input::TimerFired {
                    run_id: timer.run_id.clone(),
                    timer: key,
                    at: now,
                };
                let trace = TraceContext::for_run(&timer.run_id);
                self.apply(&input, &trace, batch)?;
            }
            batch.fired.push(timer);
        }
        Ok(())
    }

    fn state_of(&self, run_id: &str, batch: &mut PendingBatch) -> Result<Option<RunState>, Error> {
        if let Some(state) = batch.after.get(run_id) {
            return Ok(Some(state.clone()));
        }
        if let Some(before) = batch.before.get(run_id) {
            return Ok(before.clone());
        }
        let stored = match self.store.get_run(run_id)? {
            Some(bytes) => serde_json::from_slice::<RunState>(&bytes).ok(),
            None => None,
        };
        batch.before.insert(run_id.to_owned(), stored.clone());
        Ok(stored)
    }

    fn apply(
        &mut self,
        input: &Input,
        trace: &TraceContext,
        batch: &mut PendingBatch,
    ) -> Result<(), Error> {
        let run_id = input.run_id().to_owned();
        let span = tracing::info_span!(
            "apply",
            run_id = %run_id,
            operation_id = tracing::field::Empty,
            trace_id = %trace.trace_id,
        );
        match input {
            Input::StepReport(r) => {
                span.record("operation_id", r.operation_id.as_str());
            }
            Input::Command(sortie_core::Command {
                body: sortie_core::CommandBody::ReconcileOperation { operation_id, .. },
                ..
            }) => {
                span.record("operation_id", operation_id.as_str());
            }
            _ => {}
        }
        let _entered = span.enter();
        let state = self.state_of(&run_id, batch)?;
        if let Input::Command(c) = input {
            if let sortie_core::CommandBody::StartRun {
                graph_id,
                graph_version,
                ..
            } = &c.body
            {
                if state.is_none() && self.graphs.graphs().get(graph_id, *graph_version).is_none() {
                    // A graph published a moment ago may not have reached the table yet.
                    self.graphs.catch_up(Duration::from_secs(5))?;
                }
            }
        }
        let applied = apply(state.as_ref(), input, self.graphs.graphs());
        let events: Vec<&sortie_core::Event> = applied
            .effects
            .iter()
            .filter_map(|e| match e {
                Effect::Emit(event) => Some(event),
                _ => None,
            })
            .collect();
        batch
            .counts
            .applied(input, applied.ignored, &events, applied.state.as_ref());
        if applied.ignored.is_some() {
            batch.ignored += 1;
            tracing::debug!(run_id, reason = applied.ignored, "Input changed nothing.");
        }
        let partition = partition_for(run_id.as_bytes(), self.partitions);
        for effect in applied.effects {
            match effect {
                Effect::Emit(event) => {
                    let value = self.encode(
                        &self.config.topics.run_events(),
                        &convert::event_to_wire(&event),
                    )?;
                    batch.outputs.push(Output {
                        topic: self.config.topics.run_events(),
                        partition: Some(partition),
                        key: run_id.clone().into_bytes(),
                        value,
                        headers: vec![trace.child(&event.seq.to_string()).header()],
                    });
                }
                Effect::Dispatch(intent) => {
                    let topic = self.config.topics.intents(&intent.queue);
                    let value = self.encode(&topic, &convert::intent_to_wire(&intent))?;
                    batch.outputs.push(Output {
                        topic,
                        partition: None,
                        key: intent.operation_id.clone().into_bytes(),
                        value,
                        headers: vec![trace
                            .child(&format!("{}/{}", intent.operation_id, intent.attempt))
                            .header()],
                    });
                }
                Effect::WriteState(state) => {
                    batch.after.insert(run_id.clone(), *state);
                }
                Effect::ArmTimer { .. } | Effect::DisarmTimer { .. } => {} // derived from states at commit
            }
        }
        Ok(())
    }

    fn encode<R: Record>(&self, topic: &str, record: &R) -> Result<Vec<u8>, Error> {
        let mut backoff = Duration::from_millis(100);
        loop {
            match self.runtime.block_on(self.codec.encode(topic, record)) {
                Ok(bytes) => return Ok(bytes),
                Err(e) if e.is_retryable() && backoff < Duration::from_secs(10) => {
                    tracing::warn!(topic, error = %e, "Schema registry unavailable; retrying.");
                    std::thread::sleep(backoff);
                    backoff *= 2;
                }
                Err(e) => return Err(Error::Registry(e.to_string())),
            }
        }
    }

    fn decode<R: Record>(&self, payload: Option<&[u8]>) -> Result<R, DecodeError> {
        let mut backoff = Duration::from_millis(100);
        loop {
            match self.runtime.block_on(self.codec.decode::<R>(payload)) {
                Err(e) if e.is_retryable() => {
                    // The bytes may be fine: never dead-letter because the registry is down.
                    tracing::warn!(error = %e, "Schema registry unavailable while decoding; retrying.");
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
                other => return other,
            }
        }
    }

    fn handle(&mut self, message: &OwnedMessage, batch: &mut PendingBatch) -> Result<(), Error> {
        let topic = message.topic().to_owned();
        batch
            .offsets
            .insert((topic.clone(), message.partition()), message.offset() + 1);
        batch.inputs += 1;
        let at = message.timestamp().to_millis().unwrap_or_else(now_ms);
        if message.payload().map_or(0, <[u8]>::len) > self.config.max_payload_bytes {
            let reason = format!(
                "value of {} bytes exceeds the {} byte cap",
                message.payload().map_or(0, <[u8]>::len),
                self.config.max_payload_bytes
            );
            return self.dead_letter(message, "oversized", reason, batch);
        }
        let key = message
            .key()
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .unwrap_or_default();
        let (run_id, input) = if topic == self.config.topics.commands() {
            match self.decode::<w::RunCommand>(message.payload()) {
                Err(e) => return self.dead_letter(message, e.reason_code(), e.to_string(), batch),
                Ok(command) => {
                    let run_id = command.run_id.clone();
                    match convert::command_from_wire(command) {
                        Err(e) => return self.dead_letter(message, "invalid", e.0, batch),
                        Ok(mut command) => {
                            command.at = at;
                            (run_id, Input::Command(command))
                        }
                    }
                }
            }
        } else {
            match self.decode::<w::StepResult>(message.payload()) {
                Err(e) => return self.dead_letter(message, e.reason_code(), e.to_string(), batch),
                Ok(result) => {
                    let run_id = result.run_id.clone();
                    match convert::report_from_wire(result, at) {
                        Err(e) => return self.dead_letter(message, "invalid", e.0, batch),
                        Ok(report) => (run_id, Input::StepReport(report)),
                    }
                }
            }
        };
        if topic == self.config.topics.commands() && key != run_id {
            let reason = format!("record key {key:?} is not the command's run id {run_id:?}");
            return self.dead_letter(message, "invalid", reason, batch);
        }
        let canonical = partition_for(run_id.as_bytes(), self.partitions);
        if canonical != message.partition() {
            // Produced by a client with another partitioner: move it to the run's partition
            // (once, inside this transaction) and let that partition's owner apply it.
            tracing::info!(
                topic,
                run_id,
                from = message.partition(),
                to = canonical,
                "Forwarding a misrouted record to its run's partition."
            );
            batch.outputs.push(Output {
                topic,
                partition: Some(canonical),
                key: message.key().unwrap_or_default().to_vec(),
                value: message.payload().unwrap_or_default().to_vec(),
                headers: headers_of(message),
            });
            batch.counts.forwarded();
            return Ok(());
        }
        let trace = message
            .headers()
            .and_then(|h| TraceContext::from_headers(h.iter().map(|h| (h.key, h.value))))
            .unwrap_or_else(|| TraceContext::for_run(&run_id));
        self.apply(&input, &trace, batch)
    }

    fn dead_letter(
        &self,
        message: &OwnedMessage,
        code: &str,
        reason: String,
        batch: &mut PendingBatch,
    ) -> Result<(), Error> {
        tracing::warn!(
            topic = message.topic(),
            partition = message.partition(),
            offset = message.offset(),
            code,
            reason,
            "Dead-lettering a record."
        );
        let letter = w::DeadLetter {
            reason_code: code.to_owned(),
            reason,
            service: format!("reducer/{}", self.config.instance_id),
            original_topic: message.topic().to_owned(),
            original_partition: message.partition(),
            original_offset: message.offset(),
            original_timestamp: message.timestamp().to_millis(),
            original_key: message.key().map(<[u8]>::to_vec),
            original_value: message.payload().map(<[u8]>::to_vec),
            original_headers: headers_of(message)
                .into_iter()
                .map(|(key, value)| w::Header { key, value })
                .collect(),
            failed_at: now_ms(),
        };
        let topic = self.config.topics.dead_letters();
        let value = self.encode(&topic, &letter)?;
        batch.outputs.push(Output {
            topic,
            partition: None,
            key: message.key().unwrap_or_default().to_vec(),
            value,
            headers: vec![],
        });
        batch.dead_letters += 1;
        batch.counts.dead_letter(code);
        Ok(())
    }

    /// The transaction: outputs, run states, offsets; then sled.
    fn commit(&mut self, batch: PendingBatch) -> Result<(), Error> {
        let started = Instant::now();
        let run_state_topic = self.config.topics.run_state();
        let mut outputs = batch.outputs;
        let mut run_ids: Vec<&String> = batch.after.keys().collect();
        run_ids.sort();
        for run_id in run_ids {
            let state = &batch.after[run_id];
            let value = self.encode(&run_state_topic, &convert::state_to_wire(state))?;
            outputs.push(Output {
                topic: run_state_topic.clone(),
                partition: Some(partition_for(run_id.as_bytes(), self.partitions)),
                key: run_id.clone().into_bytes(),
                value,
                headers: vec![],
            });
        }

        self.producer.begin_transaction().map_err(txn_error)?;
        let mut deliveries = Vec::with_capacity(outputs.len());
        for output in &outputs {
            let mut headers = OwnedHeaders::new();
            for (key, value) in &output.headers {
                headers = headers.insert(Header {
                    key,
                    value: value.as_deref(),
                });
            }
            let mut record = FutureRecord::to(&output.topic)
                .key(&output.key)
                .payload(&output.value)
                .headers(headers);
            if let Some(p) = output.partition {
                record = record.partition(p);
            }
            match self.producer.send_result(record) {
                Ok(delivery) => deliveries.push((output.topic == run_state_topic, delivery)),
                Err((e, _)) => {
                    self.abort();
                    return Err(Error::Kafka(e));
                }
            }
        }
        let mut offsets = TopicPartitionList::new();
        for ((topic, partition), next) in &batch.offsets {
            offsets.add_partition_offset(topic, *partition, Offset::Offset(*next))?;
        }
        if offsets.count() > 0 {
            let metadata = self
                .consumer
                .group_metadata()
                .ok_or_else(|| Error::Setup("no consumer group metadata".into()))?;
            if let Err(e) = self.producer.send_offsets_to_transaction(
                &offsets,
                &metadata,
                Duration::from_secs(10),
            ) {
                self.abort();
                return Err(txn_error(e));
            }
        }
        // Drain deliveries before committing: commit_transaction's own flush polls in
        // 100 ms slices (SPEC §13).
        let results = self.runtime.block_on(join_all(
            deliveries
                .into_iter()
                .map(|(is_state, d)| async move { (is_state, d.await) }),
        ));
        let mut changelog: BTreeMap<i32, u64> = BTreeMap::new();
        for (is_state, result) in results {
            match result {
                Ok(Ok(delivery)) => {
                    if is_state {
                        let next = (delivery.offset + 1) as u64;
                        let entry = changelog.entry(delivery.partition).or_insert(next);
                        *entry = (*entry).max(next);
                    }
                }
                Ok(Err((e, _))) => {
                    self.abort();
                    return Err(Error::Kafka(e));
                }
                Err(_) => {
                    self.abort();
                    return Err(Error::Setup("a delivery was cancelled".into()));
                }
            }
        }
        let fault = |point| fault::check(self.config.fault, self.config.fault_after, point);
        fault(FaultPoint::BeforeCommit);
        if let Err(e) = self.producer.commit_transaction(Duration::from_secs(15)) {
            self.abort();
            return Err(txn_error(e));
        }
        let committed = started.elapsed();
        fault(FaultPoint::AfterCommit);

        // Kafka has it; now the cache.
        let mut sled = store::Batch::default();
        for (run_id, state) in &batch.after {
            let partition = partition_for(run_id.as_bytes(), self.partitions);
            let before = batch.before.get(run_id).cloned().flatten();
            let old: BTreeMap<&String, &i64> = before
                .as_ref()
                .map(|b| b.timers.iter().collect())
                .unwrap_or_default();
            for (key, due) in &old {
                if state.timers.get(*key) != Some(*due) {
                    sled.disarm_timer(partition, run_id, key, **due);
                }
            }
            for (key, due) in &state.timers {
                if old.get(key) != Some(&due) {
                    sled.arm_timer(partition, run_id, key, *due);
                }
            }
            match serde_json::to_vec(state) {
                Ok(bytes) => {
                    sled.put_run(run_id, bytes);
                }
                Err(e) => {
                    tracing::error!(run_id, error = %e, "Run state does not serialize; the cache will miss it.")
                }
            }
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
        for (partition, next) in changelog {
            sled.set_changelog_offset(partition, next);
        }
        self.store.apply(sled)?;
        for (run_id, state) in &batch.after {
            let partition = partition_for(run_id.as_bytes(), self.partitions);
            let before = batch.before.get(run_id).and_then(Option::as_ref);
            self.gauges.update(partition, run_id, before, state);
        }
        batch
            .counts
            .committed(batch.inputs + batch.fired.len(), committed);
        tracing::debug!(
            inputs = batch.inputs,
            outputs = outputs.len(),
            runs = batch.after.len(),
            ignored = batch.ignored,
            dead_letters = batch.dead_letters,
            commit_ms = committed.as_millis() as u64,
            "Batch committed."
        );
        Ok(())
    }

    fn abort(&self) {
        if let Err(e) = self.producer.abort_transaction(Duration::from_secs(10)) {
            tracing::warn!(error = %e, "Aborting the transaction failed.");
        }
    }

    /// After a failed batch: go back to the committed offsets; the batch's state was never
    /// written anywhere, so re-reading gives the same inputs against the same state.
    fn rewind(&self) {
        let Ok(assignment) = self.consumer.assignment() else {
            return;
        };
        if let Ok(committed) = self
            .consumer
            .committed_offsets(assignment, Duration::from_secs(10))
        {
            for element in committed.elements() {
                let offset = match element.offset() {
                    Offset::Offset(o) => Offset::Offset(o),
                    _ => Offset::Beginning,
                };
                if let Err(e) = self.consumer.seek(
                    element.topic(),
                    element.partition(),
                    offset,
                    Duration::from_secs(5),
                ) {
                    tracing::warn!(error = %e, "Seek after an aborted batch failed.");
                }
            }
        }
    }
}

fn txn_error(e: KafkaError) -> Error {
    match &e {
        KafkaError::Transaction(inner) if inner.is_fatal() => Error::Fenced,
        _ => Error::Kafka(e),
    }
}

fn headers_of(message: &OwnedMessage) -> Vec<(String, Option<Vec<u8>>)> {
    message
        .headers()
        .map(|h| {
            h.iter()
                .map(|header| (header.key.to_owned(), header.value.map(<[u8]>::to_vec)))
                .collect()
        })
        .unwrap_or_default()
}
