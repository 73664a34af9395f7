//! The executor loop: consume intents, run handlers with bounded concurrency, report
//! results, commit offsets.
//!
//! # Shape
//!
//! One consumer per queue, each on its own OS thread, in the consumer group
//! `<prefix>executor.<queue>` (so every process serving a queue shares that queue's
//! partitions, whatever other queues it serves). `read_committed`, no auto-commit, no
//! auto offset store, `cooperative-sticky`. Each intent runs as a tokio task; at most
//! `max_in_flight` per queue (a queue full for more than 2 s has its partitions paused
//! while the thread keeps polling, so the member stays in the group).
//! Results go to `partition_for(run_id, N)` of `step-results` (N read from metadata at
//! start), keyed by operation id, from one idempotent `acks=all` producer.
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
use rdkafka::message::OwnedMessage;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{ClientContext, Message, Offset, TopicPartitionList};
use serde_json::Value;
use sortie_kafka::KafkaConfig;
use sortie_wire::records::{self as w, SideEffectClass, StepIntent};
use sortie_wire::{
    partition_for, Codec, CodecConfig, DecodeError, RecordKind, Topics, TraceContext,
};
use tokio::runtime::Handle;
use tokio::sync::oneshot;
use tokio::task::AbortHandle;
use tracing::Instrument as _;

use crate::fault::{self, FaultPoint};
use crate::handler::{Call, HandlerError, Handlers, Lookup};
use crate::health::Health;
use crate::metrics as meter;
use crate::tracker::PartitionTracker;

/// How long a queue may stay full (every slot taken) before its partitions are paused
/// and the consumer polls again; well below `max.poll.interval.ms`.
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
    /// How often completed offsets are committed (guarded classes commit at once).
    pub commit_interval: Duration,
    /// How long revocation and shutdown wait for in-flight intents.
    pub drain_timeout: Duration,
    pub session_timeout: Duration,
    /// An attempt's timeout when the node sets none.
    pub default_timeout: Duration,
    /// Die on purpose at this point (crash tests only; never set by default).
    pub fault: Option<FaultPoint>,
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
            commit_interval: Duration::from_millis(100),
            drain_timeout: Duration::from_secs(10),
            session_timeout: Duration::from_secs(10),
            default_timeout: Duration::from_secs(30),
            fault: None,
        }
    }

    /// The consumer group of every executor serving `queue`.
    pub fn group_id(&self, queue: &str) -> String {
        format!("{}executor.{queue}", self.topics.prefix())
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
    let mut producer_config = config.kafka.producer();
    producer_config
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "1")
        .set("compression.type", "zstd");
    let producer: FutureProducer = producer_config.create()?;
    let result_partitions = {
        let producer = producer.clone();
        let topic = config.topics.step_results();
        tokio::task::spawn_blocking(move || partition_count(producer.client(), &topic))
            .await
            .map_err(|e| Error::Setup(e.to_string()))??
    };

    let worker = Arc::new(Worker {
        config,
        handlers,
        codec,
        producer,
        result_partitions,
        health: health.clone(),
        operations: Mutex::new(HashMap::new()),
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
    let metadata = client.fetch_metadata(Some(topic), Duration::from_secs(10))?;
    metadata
        .topics()
        .first()
        .filter(|t| t.error().is_none())
        .map(|t| t.partitions().len() as u32)
        .filter(|n| *n > 0)
        .ok_or_else(|| {
            Error::Setup(format!(
                "topic {topic} does not exist; run `sortie topology apply`"
            ))
        })
}

// ---------------------------------------------------------------- per-queue state

/// "A commit covers your offset: call" (true) or "hand the intent back" (false).
type Waiter = oneshot::Sender<bool>;

struct Assigned {
    /// Distinguishes this assignment from an earlier one of the same partition, so a task
    /// of a revoked assignment cannot mark offsets of a new one.
    epoch: u64,
    tracker: PartitionTracker<Waiter>,
}

#[derive(Default)]
struct QueueState {
    partitions: HashMap<i32, Assigned>,
    in_flight: usize,
    /// A task waits for a commit: commit now, not at the next interval.
    urgent: bool,
    /// Shutting down: revocation does not wait for in-flight intents.
    closing: bool,
    next_epoch: u64,
    tasks: HashMap<u64, AbortHandle>,
}

/// The state of one queue's consumer, shared with its tasks and rebalance callbacks.
struct Shared {
    topic: String,
    queue: String,
    health: Health,
    state: Mutex<QueueState>,
    changed: Condvar,
    drain_timeout: Duration,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, QueueState> {
        // A poisoned lock means a panic while holding it; the state is still consistent
        // (every update is a single step), so carry on.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Commits every partition's committable position (or only those in `only`) and
    /// releases the waiters it covers. Runs on the consumer thread only, so no revocation
    /// can happen between choosing the positions and recording the commit.
    fn commit<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
        only: Option<&BTreeSet<i32>>,
    ) -> bool {
        let positions: Vec<(i32, i64)> = {
            let mut state = self.lock();
            state.urgent = false;
            state
                .partitions
                .iter()
                .filter(|(p, _)| only.is_none_or(|only| only.contains(p)))
                .filter_map(|(p, a)| a.tracker.to_commit().map(|pos| (*p, pos)))
                .collect()
        };
        if positions.is_empty() {
            return true;
        }
        let mut list = TopicPartitionList::new();
        for (partition, position) in &positions {
            if let Err(e) =
                list.add_partition_offset(&self.topic, *partition, Offset::Offset(*position))
            {
                tracing::warn!(error = %e, "Could not build the offset list.");
                return false;
            }
        }
        match consumer.commit(&list, CommitMode::Sync) {
            Ok(()) => {
                let mut state = self.lock();
                for (partition, position) in positions {
                    if let Some(assigned) = state.partitions.get_mut(&partition) {
                        for waiter in assigned.tracker.committed(position) {
                            let _ = waiter.send(true);
                        }
                    }
                }
                tracing::debug!(topic = %self.topic, ?list, "Offsets committed.");
                true
            }
            Err(e) => {
                tracing::warn!(topic = %self.topic, error = %e, "Committing offsets failed; will retry.");
                let mut state = self.lock();
                state.urgent = state.partitions.values().any(|a| a.tracker.has_waiters());
                false
            }
        }
    }

    /// Revocation: let the partitions' in-flight intents finish (committing as they do)
    /// for up to the drain timeout, commit, then drop the partitions and hand back
    /// whatever still waits for a pre-call commit.
    fn revoke<C: ConsumerContext>(&self, consumer: &BaseConsumer<C>, revoked: &BTreeSet<i32>) {
        let deadline = Instant::now() + self.drain_timeout;
        loop {
            self.commit(consumer, Some(revoked));
            let state = self.lock();
            let pending: usize = revoked
                .iter()
                .filter_map(|p| state.partitions.get(p))
                .map(|a| a.tracker.pending())
                .sum();
            if pending == 0 || state.closing || Instant::now() >= deadline {
                if pending > 0 {
                    tracing::warn!(
                        pending,
                        "Giving up partitions with intents still running: their new owner will run them again."
                    );
                }
                break;
            }
            let _ = self.changed.wait_timeout(state, Duration::from_millis(20));
        }
        self.commit(consumer, Some(revoked));
        let mut state = self.lock();
        for partition in revoked {
            if let Some(mut assigned) = state.partitions.remove(partition) {
                for waiter in assigned.tracker.hand_back() {
                    let _ = waiter.send(false);
                }
            }
        }
    }
}

/// A task's claim on one offset. Dropping it (the task ended, or was aborted) frees its
/// slot; it does not mark the offset done.
struct Ticket {
    shared: Arc<Shared>,
    partition: i32,
    offset: i64,
    epoch: u64,
    task: u64,
}

impl Ticket {
    /// The intent's work is done: its offset may be committed.
    fn done(&self) {
        let mut state = self.shared.lock();
        if let Some(assigned) = state
            .partitions
            .get_mut(&self.partition)
            .filter(|a| a.epoch == self.epoch)
        {
            assigned.tracker.done(self.offset);
        }
        drop(state);
        self.shared.changed.notify_all();
    }

    /// Marks the offset committable before the call and waits for a commit to cover it.
    /// False: the partition was revoked (or the executor is stopping) first; do not call.
    async fn commit_first(&self) -> bool {
        let (tx, rx) = oneshot::channel();
        {
            let mut state = self.shared.lock();
            let closing = state.closing;
            match state
                .partitions
                .get_mut(&self.partition)
                .filter(|a| a.epoch == self.epoch)
            {
                Some(assigned) if !closing => assigned.tracker.done_and_wait(self.offset, tx),
                _ => return false,
            }
            state.urgent = true;
        }
        self.shared.changed.notify_all();
        rx.await.unwrap_or(false)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.in_flight = state.in_flight.saturating_sub(1);
        state.tasks.remove(&self.task);
        drop(state);
        self.shared.changed.notify_all();
    }
}

struct QueueContext {
    shared: Arc<Shared>,
}

impl ClientContext for QueueContext {
    fn stats(&self, statistics: rdkafka::Statistics) {
        sortie_kafka::metrics::consumer_lag(&statistics);
    }
}

impl ConsumerContext for QueueContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(list) = rebalance {
            let revoked: BTreeSet<i32> = list.elements().iter().map(|e| e.partition()).collect();
            tracing::info!(topic = %self.shared.topic, ?revoked, "Partitions revoked; draining them.");
            self.shared.revoke(consumer, &revoked);
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(list) => {
                // librdkafka keeps a partition's pause across its revocation: one paused
                // while the queue was full and handed back (say during a broker outage)
                // would come back paused and never deliver again. New assignments start
                // resumed; the loop pauses them again on its next pass if still full.
                if let Err(e) = consumer.resume(list) {
                    tracing::warn!(topic = %self.shared.topic, error = %e, "Resuming newly assigned partitions failed.");
                }
                let mut state = self.shared.lock();
                for element in list.elements() {
                    state.next_epoch += 1;
                    let epoch = state.next_epoch;
                    state.partitions.insert(
                        element.partition(),
                        Assigned {
                            epoch,
                            tracker: PartitionTracker::default(),
                        },
                    );
                }
                let mut owned: Vec<i32> = state.partitions.keys().copied().collect();
                owned.sort_unstable();
                tracing::info!(topic = %self.shared.topic, ?owned, "Partitions assigned.");
                self.shared.health.consuming(&self.shared.queue, true);
            }
            Rebalance::Revoke(_) => {}
            Rebalance::Error(e) => tracing::warn!(error = %e, "Rebalance failed."),
        }
    }
}

/// One queue's consumer and its loop.
struct QueueConsumer {
    worker: Arc<Worker>,
    shared: Arc<Shared>,
    consumer: BaseConsumer<QueueContext>,
}

impl QueueConsumer {
    fn new(worker: Arc<Worker>, queue: &str) -> Result<Self, Error> {
        let config = &worker.config;
        let topic = config.topics.intents(queue);
        let shared = Arc::new(Shared {
            topic: topic.clone(),
            queue: queue.to_owned(),
            health: worker.health.clone(),
            state: Mutex::new(QueueState::default()),
            changed: Condvar::new(),
            drain_timeout: config.drain_timeout,
        });
        let mut consumer_config = config.kafka.client();
        consumer_config
            .set("group.id", config.group_id(queue))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("isolation.level", "read_committed")
            .set("auto.offset.reset", "earliest")
            .set("partition.assignment.strategy", "cooperative-sticky")
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
            // Feeds QueueContext::stats: consumer lag per partition.
            .set(
                "statistics.interval.ms",
                sortie_kafka::metrics::STATISTICS_INTERVAL_MS,
            );
        if config.static_membership {
            consumer_config.set("group.instance.id", &config.executor_id);
        }
        let consumer: BaseConsumer<QueueContext> =
            consumer_config.create_with_context(QueueContext {
                shared: shared.clone(),
            })?;
        partition_count(consumer.client(), &topic)?;
        consumer.subscribe(&[&topic])?;
        tracing::info!(%topic, group = %config.group_id(queue), "Subscribed.");
        Ok(Self {
            worker,
            shared,
            consumer,
        })
    }

    fn run(self, runtime: &Handle, stop: &AtomicBool) {
        let max = self.worker.config.max_in_flight;
        let interval = self.worker.config.commit_interval;
        let mut last_commit = Instant::now();
        let mut next_task = 0u64;
        let mut paused = false;
        let mut full_since: Option<Instant> = None;
        while !stop.load(Ordering::Relaxed) {
            let (urgent, in_flight) = {
                let state = self.shared.lock();
                (state.urgent, state.in_flight)
            };
            meter::in_flight(&self.shared.queue, in_flight);
            if urgent || last_commit.elapsed() >= interval {
                self.shared.commit(&self.consumer, None);
                last_commit = Instant::now();
            }
            // Full: wait for a slot without polling — briefly. A queue that stays full
            // (slow tools) pauses its assignment and polls on: not polling at all would
            // exceed max.poll.interval.ms (the member would be kicked out with work in
            // flight), while paused partitions deliver nothing and rebalances are served.
            // Not paused at once: a resumed partition waits for the broker's next fetch
            // (up to fetch.wait.max.ms), which would throttle fast tools to a batch per
            // fetch. Paused again on every pass, so partitions assigned meanwhile are too.
            let full = in_flight >= max;
            if !full {
                full_since = None;
                if paused {
                    self.set_paused(false);
                    paused = false;
                }
            } else if full_since.get_or_insert_with(Instant::now).elapsed() < PAUSE_WHEN_FULL_FOR {
                let state = self.shared.lock();
                if state.in_flight >= max && !state.urgent {
                    let _ = self
                        .shared
                        .changed
                        .wait_timeout(state, Duration::from_millis(50));
                }
                continue;
            } else {
                self.set_paused(true);
                paused = true;
            }
            let timeout = if full {
                Duration::from_millis(20)
            } else if in_flight > 0 {
                Duration::from_millis(10)
            } else {
                Duration::from_millis(100)
            };
            match self.consumer.poll(timeout) {
                None => {}
                Some(Err(e)) => {
                    tracing::warn!(topic = %self.shared.topic, error = %e, "Consumer error.")
                }
                Some(Ok(message)) => {
                    let message = message.detach();
                    next_task += 1;
                    self.dispatch(runtime, message, next_task);
                }
            }
        }
        self.drain();
    }

    /// Pauses (or resumes) every partition assigned now. A record fetched before a pause
    /// may still arrive: it is dispatched (one over the limit) rather than skipped.
    fn set_paused(&self, pause: bool) {
        let Ok(assignment) = self.consumer.assignment() else {
            return;
        };
        if assignment.count() == 0 {
            return;
        }
        let result = if pause {
            self.consumer.pause(&assignment)
        } else {
            self.consumer.resume(&assignment)
        };
        if let Err(e) = result {
            tracing::warn!(topic = %self.shared.topic, pause, error = %e, "Pausing or resuming the queue's partitions failed.");
        }
    }

    /// Hands one intent to a task. A record of a partition this consumer does not own
    /// (it can only be a leftover of a revoked assignment) is left alone: not tracked,
    /// never committed, delivered again to the owner.
    fn dispatch(&self, runtime: &Handle, message: OwnedMessage, task: u64) {
        let mut state = self.shared.lock();
        let Some(assigned) = state.partitions.get_mut(&message.partition()) else {
            return;
        };
        assigned.tracker.track(message.offset());
        meter::intent(&self.shared.queue);
        let ticket = Ticket {
            shared: self.shared.clone(),
            partition: message.partition(),
            offset: message.offset(),
            epoch: assigned.epoch,
            task,
        };
        state.in_flight += 1;
        let handle = runtime.spawn(self.worker.clone().process(ticket, message));
        state.tasks.insert(task, handle.abort_handle());
    }

    /// Shutdown: finish in-flight intents (committing as they complete) for up to the
    /// drain timeout; hand back or abort the rest; commit; leave the group.
    fn drain(self) {
        let deadline = Instant::now() + self.worker.config.drain_timeout;
        loop {
            self.shared.commit(&self.consumer, None);
            let state = self.shared.lock();
            if state.in_flight == 0 || Instant::now() >= deadline {
                break;
            }
            let _ = self
                .shared
                .changed
                .wait_timeout(state, Duration::from_millis(20));
        }
        let aborted: Vec<AbortHandle> = {
            let mut state = self.shared.lock();
            state.closing = true;
            for assigned in state.partitions.values_mut() {
                for waiter in assigned.tracker.hand_back() {
                    let _ = waiter.send(false);
                }
            }
            state.tasks.drain().map(|(_, handle)| handle).collect()
        };
        if !aborted.is_empty() {
            tracing::warn!(
                intents = aborted.len(),
                topic = %self.shared.topic,
                "Handing back intents still running at shutdown: they will be delivered again."
            );
        }
        for handle in aborted {
            handle.abort();
        }
        self.shared.commit(&self.consumer, None);
        self.consumer.unsubscribe();
        // Dropping the consumer closes it: it leaves the group (unless static).
    }
}

// ---------------------------------------------------------------- the work

/// What every task of the process shares.
struct Worker {
    config: ExecutorConfig,
    handlers: Handlers,
    codec: Codec,
    producer: FutureProducer,
    result_partitions: u32,
    health: Health,
    /// A lock per reconcilable operation with an attempt here ([`Worker::exclusive`]).
    operations: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Worker {
    async fn process(self: Arc<Self>, ticket: Ticket, message: OwnedMessage) {
        let started_at = now_ms();
        let intent = match self.decode(&message).await {
            Ok(intent) => intent,
            Err(error) => {
                self.dead_letter(&message, &error).await;
                ticket.done();
                return;
            }
        };
        let trace = message
            .headers()
            .and_then(|h| {
                use rdkafka::message::Headers as _;
                TraceContext::from_headers(h.iter().map(|h| (h.key, h.value)))
            })
            .unwrap_or_else(|| TraceContext::for_run(&intent.run_id));
        let span = tracing::info_span!(
            "intent",
            run_id = %intent.run_id,
            operation_id = %intent.operation_id,
            attempt = intent.attempt,
            step_id = %intent.step_id,
            tool = %intent.tool,
            trace_id = %trace.trace_id,
        );
        TRACE
            .scope(
                trace,
                self.perform(&ticket, &intent, started_at).instrument(span),
            )
            .await;
    }

    async fn perform(&self, ticket: &Ticket, intent: &StepIntent, started_at: i64) {
        let fault = |point| fault::check(self.config.fault, point, &intent.operation_id);
        let call = match Call::from_intent(intent, self.config.default_timeout) {
            Ok(call) => call,
            Err(error) => {
                self.report(intent, Err(error), started_at).await;
                ticket.done();
                return;
            }
        };
        if !self.handlers.contains(&call.tool) {
            let error = HandlerError::permanent(
                "unknown_tool",
                format!("no handler for tool {:?} in this executor", call.tool),
            );
            self.report(intent, Err(error), started_at).await;
            ticket.done();
            return;
        }
        tracing::debug!(class = ?intent.side_effect, "Intent received.");
        match intent.side_effect {
            SideEffectClass::Pure | SideEffectClass::Idempotent | SideEffectClass::Keyed => {
                fault(FaultPoint::BeforeCall);
                let outcome = self.timed_call(&call).await;
                fault(FaultPoint::AfterCall);
                self.report(intent, outcome, started_at).await;
                fault(FaultPoint::AfterResult);
                ticket.done();
                return;
            }
            SideEffectClass::Reconcilable | SideEffectClass::Unsafe => {}
        }
        // Guarded classes: record STARTED, commit the intent, then call.
        self.send_result(&self.result(intent, w::StepStatus::Started, started_at))
            .await;
        meter::result(&intent.tool, "started");
        if !ticket.commit_first().await {
            meter::handed_back();
            tracing::info!(
                "Handing the intent back: its offset could not be committed before the call."
            );
            return;
        }
        // Reconcilable: ask the receiver first, one attempt of the operation at a time.
        // Committing an intent only waits for earlier intents to *reach* their call, so
        // an attempt that timed out before anyone picked it up and its successor can both
        // get here together; without the lock both lookups say "never seen" and both call.
        let _one_attempt_at_a_time = match intent.side_effect {
            SideEffectClass::Reconcilable => {
                let guard = self.exclusive(&intent.operation_id).await;
                if let Some(known) = self.ask_first(&call).await {
                    self.report(intent, known, started_at).await;
                    return;
                }
                Some(guard)
            }
            _ => None,
        };
        fault(FaultPoint::BeforeCall);
        let outcome = self.timed_call(&call).await;
        fault(FaultPoint::AfterCall);
        self.report(intent, outcome, started_at).await;
        fault(FaultPoint::AfterResult);
    }

    /// Holds the operation's lock: attempts of one reconcilable operation ask and call one
    /// after the other, so a later attempt's lookup sees what an earlier one did.
    async fn exclusive(&self, operation_id: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = {
            let mut operations = self.operations.lock().unwrap_or_else(|e| e.into_inner());
            if operations.len() > 4096 {
                // Forget locks nobody holds or waits for.
                operations.retain(|_, lock| Arc::strong_count(lock) > 1);
            }
            operations
                .entry(operation_id.to_owned())
                .or_default()
                .clone()
        };
        lock.lock_owned().await
    }

    /// One handler call, timed for [`meter::STEP_SECONDS`].
    async fn timed_call(&self, call: &Call) -> Result<Value, HandlerError> {
        let started = Instant::now();
        let outcome = self.handlers.call(call).await;
        let kind = match &outcome {
            Ok(_) => "succeeded",
            Err(HandlerError::Unknown { .. }) => "unknown",
            Err(e) if e.is_retryable() => "retryable",
            Err(_) => "permanent",
        };
        meter::call(&call.tool, kind, started.elapsed());
        outcome
    }

    /// `reconcilable`: asks the receiver before calling. `Some(outcome)` settles the
    /// attempt without a call; `None` means calling is safe.
    ///
    /// - succeeded → that output, no call;
    /// - never seen, or recorded as failed (so it had no effect) → call;
    /// - the handler cannot ask: call on attempt 1 (no earlier attempt can have reached
    ///   the receiver: its offset is committed only before a call), otherwise unknown;
    /// - the receiver could not be asked → unknown: the reducer pauses the run for an
    ///   operator rather than risk a second effect.
    async fn ask_first(&self, call: &Call) -> Option<Result<Value, HandlerError>> {
        match self.handlers.lookup(call).await {
            Ok(Lookup::Succeeded(output)) => {
                tracing::info!("The receiver already has the operation; recording its outcome without calling.");
                Some(Ok(output))
            }
            Ok(Lookup::NotFound) => None,
            Ok(Lookup::Failed { code, message }) => {
                tracing::info!(%code, %message, "The receiver recorded the operation as failed; calling again.");
                None
            }
            Ok(Lookup::Unsupported) if call.attempt <= 1 => None,
            Ok(Lookup::Unsupported) => Some(Err(HandlerError::unknown(
                "not_reconcilable",
                "a later attempt of a reconcilable step, but its handler cannot ask the receiver (no status_url)",
            ))),
            Err(error @ HandlerError::Permanent { .. }) => Some(Err(error)),
            Err(error) => Some(Err(HandlerError::unknown(
                "lookup_failed",
                format!("the receiver could not be asked: {error}"),
            ))),
        }
    }

    fn result(&self, intent: &StepIntent, status: w::StepStatus, started_at: i64) -> w::StepResult {
        w::StepResult {
            operation_id: intent.operation_id.clone(),
            attempt: intent.attempt,
            tenant: intent.tenant.clone(),
            run_id: intent.run_id.clone(),
            step_id: intent.step_id.clone(),
            status,
            retryable: false,
            output: None,
            error: None,
            executor: self.config.executor_id.clone(),
            started_at,
            finished_at: None,
        }
    }

    async fn report(
        &self,
        intent: &StepIntent,
        outcome: Result<Value, HandlerError>,
        started_at: i64,
    ) {
        let mut result = match &outcome {
            Ok(_) => self.result(intent, w::StepStatus::Succeeded, started_at),
            Err(HandlerError::Unknown { .. }) => {
                self.result(intent, w::StepStatus::Unknown, started_at)
            }
            Err(_) => self.result(intent, w::StepStatus::Failed, started_at),
        };
        result.finished_at = Some(now_ms());
        match outcome {
            Ok(output) => result.output = Some(output.to_string()),
            Err(error) => {
                result.retryable = error.is_retryable();
                result.error = Some(w::StepError {
                    code: error.code().to_owned(),
                    message: error.message().to_owned(),
                    retry_after_ms: error.retry_after().map(|d| d.as_millis() as i64),
                });
            }
        }
        self.send_result(&result).await;
        let status = match result.status {
            w::StepStatus::Succeeded => "succeeded",
            w::StepStatus::Unknown => "unknown",
            w::StepStatus::Started => "started",
            _ => "failed",
        };
        meter::result(&intent.tool, status);
        match &result.error {
            None => tracing::info!(status = ?result.status, "Reported the attempt's outcome."),
            Some(error) => tracing::info!(
                status = ?result.status,
                retryable = result.retryable,
                code = %error.code,
                message = %error.message,
                "Reported the attempt's outcome."
            ),
        }
    }

    /// Produces a result to the run's canonical partition and waits for its delivery,
    /// retrying until it is delivered (at shutdown the task is aborted instead; its
    /// offset then stays uncommitted).
    async fn send_result(&self, result: &w::StepResult) {
        let topic = self.config.topics.step_results();
        let partition = partition_for(result.run_id.as_bytes(), self.result_partitions);
        let trace = TRACE
            .try_with(Clone::clone)
            .unwrap_or_else(|_| TraceContext::for_run(&result.run_id))
            .child(&format!(
                "{}/{}/{:?}",
                result.operation_id, result.attempt, result.status
            ));
        let trace_value = trace.header_value();
        let mut backoff = Duration::from_millis(100);
        loop {
            let error = match self.codec.encode(&topic, result).await {
                Ok(bytes) => {
                    let headers =
                        rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
                            key: sortie_wire::trace::TRACEPARENT,
                            value: Some(trace_value.as_bytes()),
                        });
                    let record = FutureRecord::to(&topic)
                        .key(&result.operation_id)
                        .payload(&bytes)
                        .partition(partition)
                        .headers(headers);
                    match self.producer.send(record, Duration::from_secs(30)).await {
                        Ok(_) => return,
                        Err((error, _)) => error.to_string(),
                    }
                }
                Err(error) => error.to_string(),
            };
            tracing::warn!(%error, ?backoff, "Producing a result failed; retrying.");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    /// Decodes an intent, waiting out a schema registry outage (never dead-letters for it).
    async fn decode(&self, message: &OwnedMessage) -> Result<StepIntent, DecodeError> {
        let mut backoff = Duration::from_millis(100);
        loop {
            match self.codec.decode::<StepIntent>(message.payload()).await {
                Err(error) if error.is_retryable() => {
                    tracing::warn!(%error, ?backoff, "Schema registry unavailable; retrying the decode.");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
                other => return other,
            }
        }
    }

    async fn dead_letter(&self, message: &OwnedMessage, error: &DecodeError) {
        use rdkafka::message::Headers as _;
        tracing::warn!(
            topic = message.topic(),
            partition = message.partition(),
            offset = message.offset(),
            code = error.reason_code(),
            %error,
            "Dead-lettering an undecodable intent."
        );
        let headers = message
            .headers()
            .map(|h| {
                h.iter()
                    .map(|header| w::Header {
                        key: header.key.to_owned(),
                        value: header.value.map(<[u8]>::to_vec),
                    })
                    .collect()
            })
            .unwrap_or_default();
        let letter = w::DeadLetter {
            reason_code: error.reason_code().to_owned(),
            reason: error.to_string(),
            service: format!("executor/{}", self.config.executor_id),
            original_topic: message.topic().to_owned(),
            original_partition: message.partition(),
            original_offset: message.offset(),
            original_timestamp: message.timestamp().to_millis(),
            original_key: message.key().map(<[u8]>::to_vec),
            original_value: message.payload().map(<[u8]>::to_vec),
            original_headers: headers,
            failed_at: now_ms(),
        };
        let topic = self.config.topics.dead_letters();
        let key = message.key().unwrap_or_default();
        let mut backoff = Duration::from_millis(100);
        loop {
            let error = match self.codec.encode(&topic, &letter).await {
                Ok(bytes) => {
                    let record = FutureRecord::to(&topic).key(key).payload(&bytes);
                    match self.producer.send(record, Duration::from_secs(30)).await {
                        Ok(_) => {
                            meter::dead_letter(error.reason_code());
                            return;
                        }
                        Err((error, _)) => error.to_string(),
                    }
                }
                Err(error) => error.to_string(),
            };
            tracing::warn!(%error, ?backoff, "Producing a dead letter failed; retrying.");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }
}
