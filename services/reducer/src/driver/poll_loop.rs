//! One incarnation of the reducer's clients (the transactional producers, the consumer,
//! the graph table) and the poll loop that drives them: batching, housekeeping, shutdown.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::Producer;
use sortie_wire::Codec;
use tokio::runtime::Handle;

use super::pipeline::rewinding;
use super::{Error, ReducerConfig};
use crate::batch::PendingBatch;
use crate::engine::Engine;
use crate::fault::FaultPoint;
use crate::gauges::RunGauges;
use crate::graphs::GraphTable;
use crate::health::Health;
use crate::store::Store;
use crate::tasks::{ReducerContext, Tasks};
use crate::txn::{Deliveries, TxnProducer};
use crate::watchdog::Watchdog;

/// The reducer consumer's `fetch.wait.max.ms` unless the Kafka properties set one (see
/// `Reducer::new`).
const FETCH_WAIT_MAX_MS: &str = "100";

pub(super) struct Reducer {
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
    pub(super) fn new(
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

    pub(super) fn run(&mut self, shutdown: &AtomicBool) -> Result<(), Error> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
