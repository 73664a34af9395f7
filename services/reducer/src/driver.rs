//! The exactly-once loop around the fold: the reducer as tasks.
//!
//! One thread owns a consumer (commands + step-results, `read_committed`, range
//! assignment so partition N of both topics lands on the same member) and, through the
//! [`Engine`], a transactional producer. The modules split the loop along Kafka Streams'
//! task model:
//!
//! - `tasks`: ownership. The rebalance callback commits the open batch on revocation and
//!   restores (after stable offsets) on assignment; one task per partition.
//! - `input`: the input policy — skip, dead-letter, forward, or apply with the fold.
//! - `txn`: the transaction of a batch (outputs, run states, offsets) and its failures.
//! - `cache`: the sled write after the commit.
//!
//! Batching is adaptive: a small batch commits as soon as no input is waiting, at once
//! (light load: one input, one short transaction); a batch past a quarter of
//! `max_batch` waits for `max_batch` inputs or `commit_interval` of age (full load).
//!
//! Under load the commit is a pipeline of two: while batch N is in flight (records sent,
//! offsets sent, deliveries coming in) the loop folds N+1, reading runs through N's
//! after-states; between polls it serves N's delivery reports, and once they are in it
//! commits N and writes sled, and only then may N+1 begin its transaction.
//!
//! Invariants:
//! - sled never runs ahead of Kafka: it is written after the commit, so after a crash it
//!   is at most behind, and the restore reads the changelog from its marker.
//! - one transaction open at a time; sled is written for N before N+1's transaction
//!   begins.
//! - an aborted or failed transaction leaves nothing visible to `read_committed` readers;
//!   it takes the batch folded on it along, the consumer seeks back to the first offset
//!   either batch read and their in-memory state is dropped, so the same inputs are
//!   applied again to the same state: same effects.
//! - offsets sent are "last processed + 1", only for partitions owned in the generation
//!   the inputs were read in.
//! - transient failures retry in place with the same clients; only a fenced or fatal
//!   producer rebuilds them (a rejoin of the group).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::Producer;
use rdkafka::Offset;
use sortie_kafka::KafkaConfig;
use sortie_wire::{Codec, CodecConfig, Topics};
use tokio::runtime::Handle;

use crate::batch::{PendingBatch, Source};
use crate::engine::Engine;
use crate::fault::FaultPoint;
use crate::gauges::RunGauges;
use crate::graphs::GraphTable;
use crate::health::Health;
use crate::metrics::{self as meter};
use crate::store::{self, Store};
use crate::tasks::{ReducerContext, Tasks};
use crate::txn::{Deliveries, Failure, TxnProducer};
use crate::watchdog::Watchdog;

/// The reducer consumer's `fetch.wait.max.ms` unless the Kafka properties set one (see
/// `Reducer::new`).
const FETCH_WAIT_MAX_MS: &str = "100";

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
    /// sled's page cache in bytes. sled holds more than this after a scan of the whole
    /// store; the reducer then opens the store again (see `Store::reopen`).
    pub store_cache_bytes: u64,
    /// Bytes of run states sampled before the store trains its zstd dictionary, if it has
    /// none (see `crate::pack`).
    pub store_dictionary_after: usize,
    pub commit_interval: Duration,
    /// A batch stays open at least this long even when no input is waiting (0: adaptive,
    /// commit as soon as no input waits).
    pub batch_linger: Duration,
    pub max_batch: usize,
    pub max_payload_bytes: usize,
    /// The keyring command signatures are checked against (see `keys`).
    pub keyring: Option<PathBuf>,
    /// Refuse unsigned commands (production); without it they are taken as before.
    pub require_signatures: bool,
    /// The key the reducer signs the commands it produces for other runs with (a child
    /// run's start and cancel); `None`: they go unsigned.
    pub signing_key: Option<PathBuf>,
    /// How long before the broker's time a signed command may have been issued, and how
    /// far after it (clock skew); its id is remembered that long (see `replay`).
    pub command_window: Duration,
    pub command_skew: Duration,
    /// Seal run payloads with per-run data keys (see `sortie_seal`); `None`: plaintext.
    pub seal: Option<sortie_seal::SealConfig>,
    pub session_timeout: Duration,
    /// How long past its own timeout a transactional call may block before the process
    /// ends itself for its supervisor to restart it (see `watchdog`).
    pub stall_grace: Duration,
    /// Die on purpose at this point, on its `fault_after`-th pass (crash tests only; never
    /// set by default).
    pub fault: Option<FaultPoint>,
    pub fault_after: u32,
    /// Start even on a commands topic that keeps producer time (`CreateTime`), with a
    /// warning: only for tests that speak for a client hours later (see
    /// `check_commands_clock`).
    pub allow_create_time: bool,
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
            store_cache_bytes: crate::store::CACHE_CAPACITY,
            store_dictionary_after: crate::pack::TRAIN_AFTER,
            commit_interval: Duration::from_millis(100),
            batch_linger: Duration::ZERO,
            max_batch: 500,
            max_payload_bytes: 1024 * 1024,
            keyring: None,
            require_signatures: false,
            signing_key: None,
            command_window: Duration::from_secs(300),
            command_skew: Duration::from_secs(30),
            seal: None,
            session_timeout: Duration::from_secs(10),
            stall_grace: Duration::from_secs(30),
            fault: None,
            fault_after: 1,
            allow_create_time: false,
        }
    }

    /// The instance's transactional id, `<group>-<instance id>`; also the prefix of its
    /// clients' names.
    pub fn transactional_id(&self) -> String {
        format!("{}-{}", self.group_id, self.instance_id)
    }

    /// The transactional ids of the instance's two producers, which take turns (see
    /// `Engine::turn`): the instance's own, then `<own>#2`. An instance id may not hold a
    /// `#`, so no instance's first id is another's second.
    pub fn transactional_ids(&self) -> Result<[String; 2], Error> {
        if self.instance_id.contains('#') {
            return Err(Error::Setup(format!(
                "the instance id {:?} holds a '#', which marks its second producer's transactional id",
                self.instance_id
            )));
        }
        let own = self.transactional_id();
        let second = format!("{own}#2");
        Ok([own, second])
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
    /// A cached run state that does not read back (see `Engine::recover`).
    #[error("the cached state of run {run_id} cannot be read: {reason}")]
    UnreadableCache { run_id: String, reason: String },
    /// The clients are rebuilt, so that a partition is assigned (and restored) again.
    #[error("{0}")]
    Rebuild(String),
    #[error("{0}")]
    Setup(String),
}

/// Runs the reducer until `shutdown` is set. Blocking: call it from a dedicated thread (or
/// `spawn_blocking`). A fenced or fatal producer makes it rebuild its clients and carry
/// on; it returns only on shutdown, a setup error or a local store failure.
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
    check_commands_clock(&config, &runtime)?;
    let store = Arc::new(
        Store::open_with_cache(&config.data_dir.join("sled"), config.store_cache_bytes)?
            .with_dictionary_after(config.store_dictionary_after),
    );
    let codec = Arc::new(Codec::new(&CodecConfig {
        registry_url: config.registry_url.clone(),
        auto_register: config.auto_register,
    }));
    let watchdog = Watchdog::start(config.stall_grace, "reducer");
    let membership = Watchdog::start(config.stall_grace, "reducer");
    let mut failures = 0u32;
    while !shutdown.load(Ordering::Relaxed) {
        match Reducer::new(
            &config,
            runtime.clone(),
            codec.clone(),
            store.clone(),
            health.clone(),
            watchdog.clone(),
            membership.clone(),
        )
        .and_then(|mut r| r.run(&shutdown))
        {
            Ok(()) => return Ok(()),
            Err(e @ Error::Store(store::Error::Corrupt(_))) => {
                // Never trust it again: the next start wipes it and restores from Kafka.
                tracing::error!(error = %e, "The local store holds an unreadable entry; it is invalidated and will be rebuilt from the changelog at the next start.");
                if let Err(invalidate) = store.invalidate() {
                    tracing::error!(error = %invalidate, "Invalidating the local store failed.");
                }
                return Err(e);
            }
            Err(e @ (Error::Setup(_) | Error::Store(_))) => return Err(e),
            Err(e) => {
                failures += 1;
                health.set(Err(format!("rebuilding the Kafka clients after: {e}")));
                let backoff = Duration::from_millis(200 * u64::from(failures.min(10)));
                tracing::warn!(error = %e, ?backoff, "The reducer's producer cannot go on; rebuilding its Kafka clients.");
                std::thread::sleep(backoff);
            }
        }
    }
    Ok(())
}

/// The fold's clock is the broker's (ADR 0003): on a commands topic that keeps each
/// producer's own time (`message.timestamp.type: CreateTime`) whoever produces a command
/// chooses its time, and can backdate an approval past its expiry. The reducer refuses
/// to start on one, or on one whose config it cannot read.
fn check_commands_clock(config: &ReducerConfig, runtime: &Handle) -> Result<(), Error> {
    use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
    use rdkafka::client::DefaultClientContext;
    const KEY: &str = "message.timestamp.type";
    let topic = config.topics.commands();
    let admin: AdminClient<DefaultClientContext> = config
        .kafka
        .named(&format!("{}-config-check", config.transactional_id()))
        .client()
        .create()?;
    let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(30)));
    let described = runtime
        .block_on(admin.describe_configs(&[ResourceSpecifier::Topic(&topic)], &options))
        .map_err(|e| e.to_string())
        .and_then(|found| match found.into_iter().next() {
            Some(Ok(resource)) => Ok(resource.get(KEY).and_then(|e| e.value.clone())),
            Some(Err(code)) => Err(code.to_string()),
            None => Err("no answer".to_owned()),
        });
    let kind = described.map_err(|e| {
        Error::Setup(format!(
            "cannot read the configs of the commands topic {topic} to check that the broker stamps commands ({e}); it must exist (`sortie topology apply`) and the reducer's principal needs DESCRIBE_CONFIGS on it"
        ))
    })?;
    if kind.as_deref() == Some("LogAppendTime") {
        return Ok(());
    }
    let kind = kind.unwrap_or_else(|| "unset".to_owned());
    if config.allow_create_time {
        tracing::warn!(topic, kind, "The commands topic keeps producer time: anyone who produces a command chooses its time (allowed by --allow-create-time, for tests only).");
        return Ok(());
    }
    Err(Error::Setup(format!(
        "the commands topic {topic} has {KEY}: {kind}, so whoever produces a command could backdate it; the fold's clock must be the broker's. Run `sortie topology apply` to set {KEY}: LogAppendTime on it"
    )))
}

struct Reducer {
    engine: Arc<Mutex<Engine>>,
    consumer: BaseConsumer<ReducerContext>,
    commit_interval: Duration,
    batch_linger: Duration,
    max_batch: usize,
    gauges_published: Option<Instant>,
    /// When timers, the keyring and the graph table were last looked at.
    housekept: Instant,
    fault: Option<FaultPoint>,
}

/// The longest the loop goes without firing due timers, reloading the keyring and
/// polling the graph table, however busy it is.
const HOUSEKEEPING_EVERY: Duration = Duration::from_millis(200);

impl Reducer {
    fn new(
        config: &ReducerConfig,
        runtime: Handle,
        codec: Arc<Codec>,
        store: Arc<Store>,
        health: Health,
        watchdog: Watchdog,
        membership: Watchdog,
    ) -> Result<Self, Error> {
        // Every client of this instance is named `<transactional id>-<role>`.
        let config = &ReducerConfig {
            kafka: config.kafka.named(&config.transactional_id()),
            ..config.clone()
        };
        let topics = &config.topics;
        let keys = crate::keyring::Keys::open(config.keyring.clone(), config.require_signatures)?;
        let signer = config
            .signing_key
            .as_deref()
            .map(sortie_wire::signing::Signer::load)
            .transpose()
            .map_err(|e| Error::Setup(format!("the reducer's signing key: {e}")))?;
        // The transactional producers (init fences and aborts a previous incarnation's
        // transactions, which the stable offset fetch of the first assignment would
        // otherwise wait out) and the graph table start side by side: all are round
        // trips to the broker, and a restart waits for the slowest only. (The watchdog
        // watches each thread's call on its own.)
        let [first_id, second_id] = config.transactional_ids()?;
        let (producers, graphs) = std::thread::scope(|scope| {
            let init = |id: String, role: &'static str| {
                let watchdog = &watchdog;
                scope.spawn(move || -> Result<TxnProducer, Error> {
                    let producer = TxnProducer::create(
                        &config.kafka.named(role).transactional_producer(&id),
                        Deliveries::default(),
                    )?;
                    let timeout = Duration::from_secs(30);
                    watchdog.bound("init_transactions", timeout, || {
                        producer.init_transactions(timeout)
                    })?;
                    Ok(producer)
                })
            };
            let inits = [init(first_id, "producer"), init(second_id, "producer-2")];
            let graphs_kafka = config.kafka.named("graphs");
            let graphs = GraphTable::open(&graphs_kafka, topics, codec.clone(), runtime.clone())
                .map_err(Error::from)
                .and_then(|mut graphs| {
                    // A graph's gates and classes are a trust root: with a keyring, only
                    // graphs its publisher keys signed (see `sortie_catalog::Trust`).
                    graphs.set_trust(keys.graph_trust());
                    let loaded = graphs.catch_up(Duration::from_secs(30))?;
                    tracing::info!(
                        graphs = loaded,
                        untrusted = graphs.untrusted(),
                        "Graph table loaded."
                    );
                    crate::metrics::graphs_untrusted(graphs.untrusted());
                    Ok(graphs)
                });
            let producers = inits.map(|init| {
                init.join().unwrap_or_else(|_| {
                    Err(Error::Setup("initialising a producer panicked".into()))
                })
            });
            (producers, graphs)
        });
        let [producer, turn] = producers;
        let (producer, turn, graphs) = (producer?, turn?, graphs?);

        let wiring = Arc::new(OnceLock::new());
        // A new incarnation joins afresh: whatever the last one's consumer was doing, its
        // membership is no longer watched.
        let rejoin_timeout = config.kafka.rejoin_timeout(config.session_timeout);
        membership.hold(crate::watchdog::REJOINING, rejoin_timeout, false);
        let context = ReducerContext {
            commands: topics.commands(),
            engine: wiring.clone(),
            membership,
            rejoin_timeout,
        };
        // Range gives partition N of commands and of step-results to the same member: one
        // writer per run (cooperative-sticky does not guarantee that). read_committed also
        // makes OffsetFetch require stable offsets (KIP-447): see `tasks`. Statistics feed
        // ReducerContext::stats (consumer lag per partition).
        let mut consumer_config = config.kafka.named("consumer").group_member(
            &config.group_id,
            "range",
            config.session_timeout,
            config
                .static_membership
                .then_some(config.instance_id.as_str()),
        );
        if !config.kafka.properties.contains_key("fetch.wait.max.ms") {
            // librdkafka keeps one fetch request in flight per broker, and a partition
            // assigned meanwhile waits for it to come back: with the default (500 ms)
            // every rebalance could add half a second before the first input. An idle
            // reducer asks 10 times a second instead of twice; under load fetches return
            // with data long before either.
            consumer_config.set("fetch.wait.max.ms", FETCH_WAIT_MAX_MS);
        }
        let consumer: BaseConsumer<ReducerContext> =
            consumer_config.create_with_context(context)?;

        let partitions = sortie_kafka::read::partition_ids(
            consumer.client(),
            &topics.commands(),
            Duration::from_secs(10),
        )?
        .len() as u32;
        if partitions == 0 {
            return Err(Error::Setup(format!(
                "topic {} does not exist; run `sortie topology apply`",
                topics.commands()
            )));
        }
        // The restore's end is the changelog's high watermark, asked read_uncommitted
        // (see `restore`); this client does nothing else (never subscribes or commits).
        let marks: BaseConsumer =
            crate::restore::client(&config.kafka.named("marks"), topics, "read_uncommitted")
                .create()?;
        let run_keys = config
            .seal
            .as_ref()
            .map(|seal| seal.open_logged().map_err(|e| Error::Setup(e.to_string())))
            .transpose()?;
        let engine = Arc::new(Mutex::new(Engine {
            config: ReducerConfig {
                // The engine's own clients are the restore's readers.
                kafka: config.kafka.named("restore"),
                ..config.clone()
            },
            run_keys,
            signer,
            runtime,
            codec,
            store,
            graphs,
            producer,
            turn,
            marks,
            keys,
            partitions,
            tasks: Tasks::default(),
            batch: PendingBatch::default(),
            spare: Default::default(),
            gauges: RunGauges::default(),
            health,
            watchdog,
            hot: Default::default(),
            written: Default::default(),
            queues: Default::default(),
            measured: Default::default(),
            replays: crate::replay_window::Replays::new(config.keyring.as_ref().map(|_| {
                crate::replay_window::Window {
                    before_ms: config.command_window.as_millis() as i64,
                    skew_ms: config.command_skew.as_millis() as i64,
                }
            })),
            sending: None,
            fatal: None,
            source: None,
            refused: Default::default(),
            quarantined: Default::default(),
            rewind: Default::default(),
            positions: Default::default(),
            aborts: (0, String::new()),
            convoy: Default::default(),
        }));
        let _ = wiring.set(engine.clone());
        consumer.subscribe(&[&topics.commands(), &topics.step_results()])?;
        tracing::info!(transactional_id = %config.transactional_id(), partitions, "Reducer started.");
        Ok(Self {
            engine,
            consumer,
            commit_interval: config.commit_interval,
            batch_linger: config.batch_linger,
            max_batch: config.max_batch.max(1),
            gauges_published: None,
            housekept: Instant::now(),
            fault: config.fault,
        })
    }

    fn engine(&self) -> Result<MutexGuard<'_, Engine>, Error> {
        self.engine
            .lock()
            .map_err(|_| Error::Setup("the engine lock is poisoned".into()))
    }

    fn run(&mut self, shutdown: &AtomicBool) -> Result<(), Error> {
        while !shutdown.load(Ordering::Relaxed) {
            // Wait for input only when nothing is open or in flight: an open batch commits
            // as soon as no input is waiting (adaptive batching), and a transaction in
            // flight has deliveries to serve.
            let wait = {
                let engine = self.engine()?;
                poll_wait(
                    engine.sending.is_some(),
                    (!engine.batch.is_empty())
                        .then(|| engine.batch.opened.unwrap_or_else(Instant::now)),
                    self.batch_linger,
                    engine.convoy.hold().unwrap_or_default(),
                    self.commit_interval,
                )
            };
            // Only once it holds partitions: a member that left after joining. (The fault
            // is checked first: the loop's every pass goes through here.)
            if self.fault == Some(FaultPoint::LeaveGroup)
                && !self.engine()?.tasks.owned().is_empty()
                && crate::fault::fires_once(self.fault, 1, FaultPoint::LeaveGroup)
            {
                self.consumer.unsubscribe();
            }
            // Rebalance callbacks run inside this poll, on this thread.
            let polled = self.consumer.poll(wait);
            let mut engine = self.engine()?;
            if let Some(e) = engine.fatal.take() {
                return Err(e);
            }
            let idle = match polled {
                None => true,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "Consumer error.");
                    true
                }
                Some(Ok(message)) => {
                    let message = message.detach();
                    if let Err(e) = engine.handle(&message) {
                        engine.recover(e, &self.consumer)?;
                    }
                    false
                }
            };
            if engine.sending.is_some() {
                // The transaction in flight: serve its deliveries and commit it once they
                // are all in. With no input waiting, wait on the producer (a delivery
                // report wakes it at once): an input that arrives meanwhile could not be
                // committed before this transaction anyway, and a loop that spun here took
                // CPU from the broker on two cores.
                let wait = match idle {
                    true => Duration::from_millis(10),
                    false => Duration::ZERO,
                };
                rewinding(&mut engine, &self.consumer, |e| e.progress(wait))?;
            }
            // Housekeeping: whenever the loop is idle, and at least every
            // HOUSEKEEPING_EVERY under input that never stops — then the batch in flight
            // is finished first, as timers fire only when none is.
            let overdue = self.housekept.elapsed() >= HOUSEKEEPING_EVERY;
            let mut housekept = false;
            if engine.batch.is_empty() || idle || overdue {
                engine.graphs.poll();
                crate::metrics::graphs_untrusted(engine.graphs.untrusted());
                if engine.keys.refresh() {
                    let trust = engine.keys.graph_trust();
                    engine.graphs.set_trust(trust);
                }
                if overdue && engine.sending.is_some() {
                    rewinding(&mut engine, &self.consumer, Engine::settle)?;
                }
                if let Err(e) = engine.fire_timers(sortie_kafka::clock::now_ms()) {
                    engine.recover(e, &self.consumer)?;
                }
                // An idle loop commits nothing that would write the cache held behind.
                engine
                    .store
                    .flush_behind_older_than(crate::store::WRITE_BEHIND)?;
                housekept = true;
            }
            let full = engine.batch.inputs >= self.max_batch
                || engine
                    .batch
                    .opened
                    .is_some_and(|at| at.elapsed() >= self.commit_interval);
            let lingered = engine
                .batch
                .opened
                .is_none_or(|at| at.elapsed() >= self.batch_linger);
            if !engine.batch.is_empty() {
                if full {
                    // Full: the transaction in flight (if any) is finished first.
                    rewinding(&mut engine, &self.consumer, |e| {
                        e.settle()?;
                        e.start_sending(&self.consumer)
                    })?;
                } else if idle
                    && lingered
                    && engine.sending.is_none()
                    && engine.batch.inputs < (self.max_batch / 4).max(2)
                    && engine.convoy.hold().is_none()
                {
                    // Small (light load): commit as soon as nothing waits, and at once:
                    // there is nothing to fold meanwhile, and in an A/B the overlap cost
                    // the light load's round trip ~15 %. A batch that grew past a quarter
                    // of max_batch (and past one input) is under load: it waits for max_batch or
                    // commit_interval, as fewer, bigger transactions cost the broker less
                    // per input, and then goes in flight while the next one folds.
                    rewinding(&mut engine, &self.consumer, |e| {
                        e.start_sending(&self.consumer)?;
                        e.settle()
                    })?;
                }
            }
            drop(engine);
            if housekept {
                self.housekept = Instant::now();
            }
            self.observe();
        }
        let mut engine = self.engine()?;
        engine.health.set(Err("shutting down".to_owned()));
        rewinding(&mut engine, &self.consumer, |e| {
            e.commit_open(&self.consumer)
        })?;
        engine.save_tallies();
        engine.store.flush()?;
        drop(engine);
        self.consumer.unsubscribe();
        Ok(())
    }

    /// After a pass of the loop: readiness and, at most once a second, the run gauges.
    fn observe(&mut self) {
        if self
            .gauges_published
            .is_some_and(|at| at.elapsed() < Duration::from_secs(1))
        {
            return;
        }
        if let Ok(mut engine) = self.engine.lock() {
            let readiness = engine.readiness();
            engine.health.set(readiness);
            let owned = engine.tasks.active();
            engine.gauges.publish(&owned, sortie_kafka::clock::now_ms());
        }
        self.gauges_published = Some(Instant::now());
    }
}

/// Runs `step` (a commit, or progress of the transaction in flight). If it aborted, what
/// it dropped — the batch in flight and the open batch folded on it, or the open batch
/// alone — is read again: the consumer seeks back to the first offset each dropped batch
/// read ([`Engine::dropped`]), never to a batch that committed. A refused record sets its
/// source aside ([`Engine::refused`]); aborts in a row back off. The same clients go on;
/// a fatal failure returns.
fn rewinding<C: ConsumerContext>(
    engine: &mut Engine,
    consumer: &BaseConsumer<C>,
    step: impl FnOnce(&mut Engine) -> Result<(), Failure>,
) -> Result<(), Error> {
    match step(engine) {
        Ok(()) => Ok(()),
        Err(Failure::Fatal(e)) => Err(e),
        Err(Failure::Aborted(e, refusal)) => {
            tracing::warn!(error = %e, "The batch was aborted; reading its inputs again.");
            if let Some(refusal) = refusal {
                engine.refused(*refusal, consumer);
            }
            seek_back(engine, consumer)?;
            engine.back_off(&e.to_string());
            Ok(())
        }
    }
}

/// Seeks the consumer back to where the dropped batches began (see [`Engine::dropped`]).
fn seek_back<C: ConsumerContext>(
    engine: &mut Engine,
    consumer: &BaseConsumer<C>,
) -> Result<(), Error> {
    for ((topic, partition), first) in std::mem::take(&mut engine.rewind) {
        if !engine.tasks.is_active(partition) {
            // Stopped or gone: nothing of it is read until it is assigned again.
            continue;
        }
        if let Err(e) = consumer.seek(
            &topic,
            partition,
            Offset::Offset(first),
            Duration::from_secs(5),
        ) {
            // Without the seek the batch's inputs would be skipped: rebuild instead.
            tracing::warn!(topic, partition, error = %e, "Seeking back after a dropped batch failed.");
            return Err(Error::Kafka(e));
        }
    }
    Ok(())
}

/// How long a pass of the loop waits for input: not at all with a transaction in flight
/// (its deliveries are served) or with an open batch past its linger and its hold (it
/// commits when no input is waiting: adaptive batching); an open batch still lingering
/// (`opened` then, `linger` long) or held for the last commit's results (`held` left, see
/// `convoy`) waits what is left of the longer, no longer — an input arriving ends the
/// wait; with nothing open, up to the commit interval (at most 100 ms, so housekeeping
/// runs).
fn poll_wait(
    in_flight: bool,
    opened: Option<Instant>,
    linger: Duration,
    held: Duration,
    commit_interval: Duration,
) -> Duration {
    match opened {
        _ if in_flight => Duration::ZERO,
        None => commit_interval.min(Duration::from_millis(100)),
        Some(at) => linger.saturating_sub(at.elapsed()).max(held),
    }
}

/// Most aborted transactions in a row before the reducer says it is not ready.
const ABORTS_BEFORE_UNREADY: u32 = 3;

/// The commit pipeline: at most one batch in flight (its transaction open, its records
/// sent) while the next one folds. See ARCHITECTURE "The transaction boundary".
impl Engine {
    /// Serves the deliveries of the transaction in flight for up to `wait`, and once
    /// they are all in, commits it and writes the cache.
    pub(crate) fn progress(&mut self, wait: Duration) -> Result<(), Failure> {
        let Some(mut sending) = self.sending.take() else {
            return Ok(());
        };
        match self.serve_deliveries(&mut sending, wait) {
            Ok(delivered) => {
                if delivered
                    && self.fault_armed(FaultPoint::AbortInFlight)
                    && !self.batch.on_in_flight
                    && sending.sent.elapsed() < Duration::from_millis(500)
                {
                    // Test only: a batch is held in flight (up to half a second) until the
                    // next one has read a run from it; `settle` then aborts it.
                    self.sending = Some(sending);
                    return Ok(());
                }
                self.sending = Some(sending);
                match delivered {
                    true => self.settle(),
                    false => Ok(()),
                }
            }
            Err(failure) => Err(self.failed(failure, Some(&sending.batch))),
        }
    }

    /// Finishes the transaction in flight, if any: the rest of its deliveries, the
    /// commit, then the cache write — sled is written only after Kafka has the
    /// transaction, and before the next one begins.
    pub(crate) fn settle(&mut self) -> Result<(), Failure> {
        let Some(sending) = self.sending.take() else {
            return Ok(());
        };
        if self.batch.on_in_flight && self.fault_once(FaultPoint::AbortInFlight) {
            let refused = KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut);
            let failure = self.abort_after(refused);
            return Err(self.failed(failure, Some(&sending.batch)));
        }
        let first = crate::batch::first_offsets([&sending.batch]);
        match self.finish_sending(sending) {
            Ok((batch, committed)) => {
                // The other producer begins the next transaction: this one's commit
                // markers may still be being written (see `Engine::turn`).
                std::mem::swap(&mut self.producer, &mut self.turn);
                self.committed(&batch);
                self.write_cache(batch, committed).map_err(Failure::Fatal)
            }
            Err(failure) => {
                self.rewind_to(first);
                Err(self.failed(failure, None))
            }
        }
    }

    /// A batch committed: its offsets are the partitions' committed positions now, and
    /// the transactions no longer fail in a row.
    fn committed(&mut self, batch: &PendingBatch) {
        for (at, consumed) in &batch.offsets {
            self.positions.insert(at.clone(), consumed.next);
        }
        let committed = &self.positions;
        // Refusals of inputs now behind the committed offsets are settled.
        self.refused.retain(|source, _| match source {
            Source::Input(at) => committed
                .get(&(at.topic.clone(), at.partition))
                .is_none_or(|next| at.offset >= *next),
            Source::Run(_) => true,
        });
        if self.aborts.0 > 0 {
            tracing::info!(
                after = self.aborts.0,
                "A transaction committed after aborted ones."
            );
            self.aborts = (0, String::new());
        }
    }

    /// Commits everything: the transaction in flight, then the open batch, waiting for
    /// both (revocation, shutdown).
    pub(crate) fn commit_open<C: ConsumerContext>(
        &mut self,
        consumer: &BaseConsumer<C>,
    ) -> Result<(), Failure> {
        self.settle()?;
        if !self.batch.is_empty() {
            self.start_sending(consumer)?;
            self.settle()?;
        }
        Ok(())
    }

    /// The transaction in flight (`in_flight`) did not commit: the open batch, folded on
    /// its states, goes with it, and both are read again.
    fn failed(&mut self, failure: Failure, in_flight: Option<&PendingBatch>) -> Failure {
        meter::transaction_failed();
        if let Some(in_flight) = in_flight {
            self.dropped(in_flight);
        }
        let dropped = std::mem::take(&mut self.batch);
        if !dropped.is_empty() {
            tracing::warn!(
                inputs = dropped.inputs,
                "The open batch was folded on an aborted one; it is read again too."
            );
            self.dropped(&dropped);
        }
        failure
    }

    /// Drops the open batch because an input or timer of it failed halfway (`error`),
    /// and says what the loop does next: the same clients go on, reading the dropped
    /// inputs again after a back-off (the registry, the key store or a graph may be
    /// back), while the batch in flight, which was whole, still commits. An unreadable
    /// cache entry also has its partition rebuilt from the changelog. Only a failure of
    /// the store itself returns.
    pub(crate) fn recover<C: ConsumerContext>(
        &mut self,
        error: Error,
        consumer: &BaseConsumer<C>,
    ) -> Result<(), Error> {
        let batch = std::mem::take(&mut self.batch);
        tracing::warn!(
            error = %error,
            inputs = batch.inputs,
            timers = batch.fired.len(),
            "An input could not be applied whole; the open batch is dropped, never committed, and read again."
        );
        meter::transaction_failed();
        self.dropped(&batch);
        match error {
            Error::UnreadableCache { run_id, reason } => {
                // One unreadable entry is not the whole cache: the entry goes, and its
                // run's partition is restored from the changelog at the next assignment
                // (the clients are rebuilt for it) while the others start from the cache.
                let partition = self.partition_of(&run_id);
                tracing::error!(run_id, partition, reason, "A cached run state cannot be read; its partition is restored from the changelog.");
                meter::cache_entry_unreadable();
                self.store.write_run(&run_id, None)?;
                self.store.forget_partition(partition)?;
                Err(Error::Rebuild(format!(
                    "partition {partition} is restored again: the cached state of run {run_id} cannot be read ({reason})"
                )))
            }
            Error::Store(e) => Err(Error::Store(e)),
            other => {
                self.back_off(&other.to_string());
                seek_back(self, consumer)
            }
        }
    }

    /// Counts an aborted transaction or dropped batch and sleeps a little, longer for
    /// each one in a row, so a failure that repeats is not a spin; past
    /// [`ABORTS_BEFORE_UNREADY`] in a row, readiness says why.
    pub(crate) fn back_off(&mut self, reason: &str) {
        self.aborts.0 += 1;
        self.aborts.1 = reason.to_owned();
        let n = self.aborts.0;
        let pause = Duration::from_millis(50 * 2u64.pow(n.min(7) - 1)).min(Duration::from_secs(5));
        if n >= ABORTS_BEFORE_UNREADY {
            tracing::error!(in_a_row = n, reason, ?pause, "Transactions keep failing; the reducer backs off and is not ready until one commits.");
        }
        self.health.set(self.readiness());
        std::thread::sleep(pause);
    }

    /// Ready: every owned partition active, and transactions committing.
    pub(crate) fn readiness(&self) -> Result<(), String> {
        let tasks = self.tasks.readiness();
        if self.aborts.0 >= ABORTS_BEFORE_UNREADY {
            let failing = format!(
                "{} transactions in a row did not commit, the last: {}",
                self.aborts.0, self.aborts.1
            );
            return Err(match tasks {
                Ok(()) => failing,
                Err(stopped) => format!("{stopped}; {failing}"),
            });
        }
        tasks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(instance_id: &str) -> ReducerConfig {
        let topics = Topics::new("t.");
        ReducerConfig {
            instance_id: instance_id.into(),
            ..ReducerConfig::new(KafkaConfig::new("127.0.0.1:9092"), "", topics, ".".into())
        }
    }

    /// Checked red: with the wait it replaced (10 ms whenever a linger was set), a batch
    /// lingering 3 ms waited 10 before it could commit.
    #[test]
    fn a_lingering_batch_waits_only_what_its_linger_has_left() {
        let linger = Duration::from_millis(3);
        let interval = Duration::from_millis(100);
        let now = Instant::now();
        let wait = poll_wait(false, Some(now), linger, Duration::ZERO, interval);
        assert!(wait <= linger && wait > Duration::ZERO, "{wait:?}");
        // A batch held for the last commit's results waits what the hold has left, past
        // its linger; with a transaction in flight or nothing open, the hold is moot.
        let held = Duration::from_millis(5);
        let long_ago = now - Duration::from_millis(50);
        assert_eq!(
            poll_wait(false, Some(long_ago), linger, held, interval),
            held
        );
        assert_eq!(poll_wait(false, Some(now), linger, held, interval), held);
        assert_eq!(
            poll_wait(true, Some(now), linger, held, interval),
            Duration::ZERO
        );
        assert_eq!(poll_wait(false, None, linger, held, interval), interval);
        assert_eq!(
            poll_wait(false, Some(long_ago), linger, Duration::ZERO, interval),
            Duration::ZERO
        );
        assert_eq!(
            poll_wait(false, Some(now), Duration::ZERO, Duration::ZERO, interval),
            Duration::ZERO
        );
        assert_eq!(
            poll_wait(true, Some(now), linger, Duration::ZERO, interval),
            Duration::ZERO
        );
        assert_eq!(
            poll_wait(true, None, linger, Duration::ZERO, interval),
            Duration::ZERO
        );
        assert_eq!(
            poll_wait(false, None, linger, Duration::ZERO, interval),
            interval
        );
        let slow = Duration::from_secs(1);
        assert_eq!(
            poll_wait(false, None, linger, Duration::ZERO, slow),
            Duration::from_millis(100)
        );
    }

    #[test]
    fn the_first_producer_keeps_the_instances_transactional_id_and_the_second_is_marked() {
        let ids = config("reducer-0").transactional_ids().expect("ids");
        // The first is the id every earlier version used: an upgrade fences the old one.
        assert_eq!(ids, ["t.reducer-reducer-0", "t.reducer-reducer-0#2"]);
        let other = config("reducer-0#2").transactional_ids();
        assert!(
            matches!(other, Err(Error::Setup(ref why)) if why.contains("'#'")),
            "an instance id whose first id would be another's second is refused: {other:?}"
        );
    }
}
