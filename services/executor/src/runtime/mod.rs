//! The executor loop: consume intents, run handlers with bounded concurrency, report
//! results, commit offsets.
//!
//! # Shape
//!
//! One consumer per queue, each on its own OS thread, in the consumer group
//! `<prefix>executor.<queue>` (so every process serving a queue shares that queue's
//! partitions, whatever other queues it serves). `read_committed`, no auto-commit, no
//! auto offset store, `cooperative-sticky`. Each intent runs as a tokio task; at most
//! `max_in_flight` per queue. Results go to `partition_for(run_id, N)` of
//! `step-results` (N read from metadata at start), keyed by operation id, from one
//! idempotent `acks=all` producer.
//!
//! # Tenants share a queue
//!
//! Intents are read ahead of the free slots and *held* per tenant (`crate::fair`, ADR
//! 0030): a free slot goes to the tenant running the fewest for its weight, and no tenant
//! runs more than its cap (¾ of the slots unless configured), so one tenant's burst or
//! hung steps never keep another's intents from running. A queue holding its bound (by
//! count or bytes) for more than 2 s has its partitions paused while the thread keeps
//! polling, so the member stays in the group. A held intent's offset is tracked like a
//! running one, so no commit passes it. An intent whose attempt's deadline passed while
//! it was held (or in the topic) is not called: it is reported as a retryable failure
//! (`deadline_passed`), since the reducer has already given up on that attempt; that
//! definite outcome lets the reducer retry it, even an `unsafe` step left to an operator.
//!
//! # Offset commits
//!
//! A commit is one position per partition, so a per-partition tracker (`tracker.rs`)
//! commits only up to the lowest offset still in flight: an intent in flight is never
//! skipped by a commit. An offset becomes committable:
//!
//! - `pure` / `idempotent` / `keyed`: when its result is delivered. A crash before that
//!   redelivers the intent and the receiver sees the same operation id again;
//! - `unsafe` / `reconcilable`: when its `STARTED` result is delivered. The task then
//!   *waits until a commit covers its offset* and only then calls the receiver. If a lower
//!   offset of the same partition is still running, that wait includes it (head-of-line
//!   blocking, for these two classes only, bounded by the lower intent's timeout). This is
//!   what makes "commit before call" true: no crash after the call can redeliver it.
//!
//! Commits are synchronous, made by the consumer thread: every `commit_interval`, and at
//! once when a task waits for one.
//!
//! # Rebalances and shutdown
//!
//! On revocation (in the pre-rebalance callback) the thread keeps committing while the
//! revoked partitions' in-flight intents finish, for up to `drain_timeout`; then it
//! commits a last time. Intents still running keep running and still report, but their
//! offsets stay uncommitted, so the new owner gets them again (a duplicate report is
//! ignored by the reducer). A task still waiting for its pre-call commit is told not to
//! call: the intent is handed back. Nothing is lost: an offset is committed only when its
//! work is done or, for the two guarded classes, before a call that is then made.
//!
//! Shutdown stops polling, lets in-flight work finish for up to `drain_timeout` (still
//! committing), then hands back what waits for a commit, aborts what still runs (its
//! offset stays uncommitted: redelivered), commits, and leaves the group.

use sortie_kafka::clock::now_ms;
use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers as _, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{ClientContext, Message, Offset, TopicPartitionList};
use serde_json::Value;
use sortie_kafka::watchdog::Watchdog;
use sortie_kafka::KafkaConfig;
use sortie_wire::records::{self as w, SideEffectClass, StepIntent};
use sortie_wire::{
    partition_for, Codec, CodecConfig, DecodeError, RecordKind, Topics, TraceContext,
};
use tokio::runtime::Handle;
use tokio::sync::oneshot;
use tokio::task::AbortHandle;
use tracing::Instrument as _;

use crate::fair::{FairShare, FairShareConfig};
use crate::fault::{self, FaultPoint};
use crate::handler::{Call, HandlerError, Handlers, Lookup};
use crate::health::Health;
use crate::metrics as meter;
use crate::tracker::PartitionTracker;

mod consume;
mod converse;
mod deltas;
mod dispatch;
mod produce;

use consume::*;
use deltas::Deltas;
use dispatch::*;

/// How long a queue may stay full (as many intents held as it may hold) before its
/// partitions are paused and the consumer polls again; well below `max.poll.interval.ms`.
const PAUSE_WHEN_FULL_FOR: Duration = Duration::from_secs(2);

/// How an executor process runs.
#[derive(Debug, Clone)]
pub struct ExecutorConfig {
    pub kafka: KafkaConfig,
    pub registry_url: String,
    /// Register schemas when missing (dev, tests).
    pub auto_register: bool,
    pub topics: Topics,
    /// The queues this process serves (`sortie.intents.<queue>` each).
    pub queues: Vec<String>,
    /// Names this process in results (`StepResult.executor`) and, with
    /// `static_membership`, is its `group.instance.id`.
    pub executor_id: String,
    /// Static group membership: a restart with the same `executor_id` within the session
    /// timeout takes its partitions back without waiting for the dead member to expire.
    pub static_membership: bool,
    /// Most intents running at once, per queue.
    pub max_in_flight: usize,
    /// How tenants share each queue's slots: a cap per tenant, weights, and how many
    /// intents may be read ahead and held for their tenant's turn (`crate::fair`).
    pub fair_share: FairShareConfig,
    /// How often completed offsets are committed (guarded classes commit at once).
    pub commit_interval: Duration,
    /// How long revocation and shutdown wait for in-flight intents.
    pub drain_timeout: Duration,
    pub session_timeout: Duration,
    /// An attempt's timeout when the node sets none.
    pub default_timeout: Duration,
    /// How long past its own timeout an offset commit (or a consumer pass) may block
    /// before the process ends itself for its supervisor to restart it (see
    /// `sortie_kafka::watchdog`).
    pub stall_grace: Duration,
    /// Die on purpose at this point (crash tests only; never set by default).
    pub fault: Option<FaultPoint>,
    /// Where large values go: arguments that reference a blob are resolved from it before
    /// the handler runs, and an output over its threshold is stored there and reported
    /// by reference. `None`: outputs stay inline, and a reference in arguments fails the
    /// attempt retryably (`blob_unavailable`).
    pub blobs: Option<sortie_blob::BlobConfig>,
    /// Run payload sealing (see `sortie_seal`): arguments are opened before the handler
    /// sees them, outputs sealed before they are reported. `None`: plaintext.
    pub seal: Option<sortie_seal::SealConfig>,
}

impl ExecutorConfig {
    pub fn new(
        kafka: KafkaConfig,
        registry_url: impl Into<String>,
        topics: Topics,
        queues: Vec<String>,
    ) -> Self {
        Self {
            kafka,
            registry_url: registry_url.into(),
            auto_register: true,
            topics,
            queues,
            executor_id: format!("executor-{}", std::process::id()),
            static_membership: false,
            max_in_flight: 16,
            fair_share: FairShareConfig::default(),
            commit_interval: Duration::from_millis(100),
            drain_timeout: Duration::from_secs(10),
            session_timeout: Duration::from_secs(10),
            default_timeout: Duration::from_secs(30),
            stall_grace: Duration::from_secs(30),
            fault: None,
            blobs: None,
            seal: None,
        }
    }

    /// The consumer group of every executor serving `queue`.
    pub fn group_id(&self, queue: &str) -> String {
        format!("{}executor.{queue}", self.topics.prefix())
    }

    /// How long a synchronous offset commit may take: librdkafka fails one it had to
    /// defer (no coordinator) after `session.timeout.ms`, and one it sent after
    /// `socket.timeout.ms` (60 s unless the properties set it).
    pub fn commit_timeout(&self) -> Duration {
        self.session_timeout + self.kafka.property_ms("socket.timeout.ms", 60_000)
    }

    /// How long one pass of a queue's consumer loop may take: a poll serves the rebalance
    /// callbacks, and a revocation drains for up to `drain_timeout` around two commits.
    pub fn pass_timeout(&self) -> Duration {
        self.drain_timeout + 2 * self.commit_timeout() + Duration::from_secs(10)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kafka: {0}")]
    Kafka(#[from] KafkaError),
    #[error("schema registry: {0}")]
    Registry(String),
    #[error("{0}")]
    Setup(String),
    #[error("the consumer of queue {0} stopped unexpectedly")]
    ConsumerDied(String),
    #[error(transparent)]
    Blobs(#[from] sortie_blob::Error),
}

/// Runs the executor until `shutdown` resolves, then drains and returns.
pub async fn run(
    config: ExecutorConfig,
    handlers: Handlers,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), Error> {
    run_with_health(config, handlers, shutdown, Health::default()).await
}

tokio::task_local! {
    /// The trace of the intent a task works on; its results carry it on.
    static TRACE: TraceContext;
}

/// [`run`], reporting readiness to `health` (see [`crate::health`]).
pub async fn run_with_health(
    config: ExecutorConfig,
    handlers: Handlers,
    shutdown: impl Future<Output = ()> + Send,
    health: Health,
) -> Result<(), Error> {
    if config.queues.is_empty() {
        return Err(Error::Setup("no queue to serve".into()));
    }
    if config.max_in_flight == 0 {
        return Err(Error::Setup("max_in_flight must be at least 1".into()));
    }
    let blobs = config.blobs.as_ref().map(|b| b.open()).transpose()?;
    if let Some(store) = &blobs {
        tracing::info!(
            store = %store.location(),
            threshold = config.blobs.as_ref().map_or(0, |b| b.threshold),
            "Large outputs go to the blob store."
        );
    }
    let run_keys = config
        .seal
        .as_ref()
        .map(|seal| seal.open_logged().map_err(|e| Error::Setup(e.to_string())))
        .transpose()?;
    let codec = Codec::new(&CodecConfig {
        registry_url: config.registry_url.clone(),
        auto_register: config.auto_register,
    });
    for (topic, kind) in [
        (config.topics.step_results(), RecordKind::StepResult),
        (config.topics.dead_letters(), RecordKind::DeadLetter),
    ] {
        codec
            .prepare(&topic, kind, Duration::from_secs(60))
            .await
            .map_err(|e| Error::Registry(e.to_string()))?;
    }
    // Batching and compression yield to the properties file (as the reducer's do);
    // idempotence and acks, which keep a result from being lost or doubled, do not.
    let [compression] = sortie_kafka::COMPRESSION;
    let mut producer_config = config
        .kafka
        .named(&format!(
            "{}executor-{}-producer",
            config.topics.prefix(),
            config.executor_id
        ))
        .producer_with(&[("linger.ms", "1"), compression]);
    producer_config
        .set("enable.idempotence", "true")
        .set("acks", "all");
    let producer: FutureProducer = producer_config.create()?;
    let result_partitions = {
        let producer = producer.clone();
        let topic = config.topics.step_results();
        tokio::task::spawn_blocking(move || partition_count(producer.client(), &topic))
            .await
            .map_err(|e| Error::Setup(e.to_string()))??
    };

    // Progress deltas go to the run's partition of step-deltas, co-partitioned with
    // step-results; a topology applied before the topic existed runs without them.
    let deltas = {
        let topic = config.topics.step_deltas();
        let (client, probe) = (producer.clone(), topic.clone());
        match tokio::task::spawn_blocking(move || partition_count(client.client(), &probe))
            .await
            .map_err(|e| Error::Setup(e.to_string()))?
        {
            Ok(partitions) => {
                let codec = Codec::new(&CodecConfig {
                    registry_url: config.registry_url.clone(),
                    auto_register: config.auto_register,
                });
                codec
                    .prepare(&topic, RecordKind::StepDelta, Duration::from_secs(60))
                    .await
                    .map_err(|e| Error::Registry(e.to_string()))?;
                Some(Deltas::start(producer.clone(), codec, topic, partitions))
            }
            Err(error) => {
                tracing::warn!(%error, "Running without progress deltas (the model's text as it is written): apply the topology to create the topic.");
                None
            }
        }
    };
    let worker = Arc::new(Worker {
        config,
        handlers,
        codec,
        producer,
        deltas,
        result_partitions,
        health: health.clone(),
        operations: Default::default(),
        blobs,
        run_keys,
    });
    health.serving(&worker.config.queues);
    let runtime = Handle::current();
    let stop = Arc::new(AtomicBool::new(false));
    let (ended_tx, mut ended) = tokio::sync::mpsc::unbounded_channel::<String>();
    let mut threads = Vec::new();
    for queue in worker.config.queues.clone() {
        let consumer = {
            let worker = worker.clone();
            let queue = queue.clone();
            tokio::task::spawn_blocking(move || QueueConsumer::new(worker, &queue))
                .await
                .map_err(|e| Error::Setup(e.to_string()))??
        };
        let (stop, runtime, ended_tx) = (stop.clone(), runtime.clone(), ended_tx.clone());
        let health = health.clone();
        let thread = std::thread::Builder::new()
            .name(format!("executor-{queue}"))
            .spawn(move || {
                consumer.run(&runtime, &stop);
                health.consuming(&queue, false);
                let _ = ended_tx.send(queue);
            })
            .map_err(|e| Error::Setup(format!("spawning the consumer thread: {e}")))?;
        threads.push(thread);
    }
    tracing::info!(
        queues = ?worker.config.queues,
        executor = %worker.config.executor_id,
        tools = ?worker.handlers.tools().collect::<Vec<_>>(),
        result_partitions,
        "Executor started."
    );
    let outcome = tokio::select! {
        _ = shutdown => Ok(()),
        Some(queue) = ended.recv() => Err(Error::ConsumerDied(queue)),
    };
    tracing::info!("Shutting down: finishing in-flight intents.");
    health.stopping();
    stop.store(true, Ordering::Relaxed);
    let producer = worker.producer.clone();
    tokio::task::spawn_blocking(move || {
        for thread in threads {
            let _ = thread.join();
        }
        let _ = producer.flush(Duration::from_secs(10));
    })
    .await
    .map_err(|e| Error::Setup(e.to_string()))?;
    tracing::info!("Executor stopped.");
    outcome
}

fn partition_count<C: ClientContext>(
    client: &rdkafka::client::Client<C>,
    topic: &str,
) -> Result<u32, Error> {
    match sortie_kafka::read::partition_ids(client, topic, Duration::from_secs(10))?.len() {
        0 => Err(Error::Setup(format!(
            "topic {topic} does not exist; run `sortie topology apply`"
        ))),
        n => Ok(n as u32),
    }
}
