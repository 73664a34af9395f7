//! The read view: one task follows every partition of `sortie.run-state` and
//! `sortie.run-events` (`read_committed`, assigned, never a group member, from the offsets
//! in the store) and writes them into the gateway's own [`Store`]. It also hands the
//! reducer's answers (`CommandAccepted` / `CommandRejected`) to the writes waiting for them.
//!
//! Invariants:
//! - a record's effect and the offset after it are one atomic store write, so a restart
//!   reads on from where the store is, never skipping a record;
//! - progress (the next offset per partition) is published only after the store write, so
//!   a read that waited for a position sees the record at that position;
//! - a run's state only moves forward: an event is folded when it is the next one
//!   (`seq == last_event_seq + 1`), a changelog record is taken when it is further along;
//! - one run never stops the view: a run whose stored state or events cannot be read,
//!   folded or stored is quarantined (kept in the store with the reason, counted, logged
//!   once) and the view goes on, answering waiters about it too. Only an error of the
//!   store as a whole stops the view, and `/readyz` then says so.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::OwnedMessage;
use rdkafka::{Message, Offset, TopicPartitionList};
use sortie_core::{Event, EventBody};
use sortie_kafka::read::ReaderContext;
use sortie_kafka::KafkaConfig;
use sortie_model as convert;
use sortie_wire::records as w;
use sortie_wire::{Codec, Record, Topics};
use tokio::sync::{oneshot, watch};

use crate::store::{self, Quarantine, Source, Store, StoredRun, Write};

const METADATA_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kafka: {doing}: {source}")]
    Kafka { doing: String, source: KafkaError },
    #[error("topic {0} does not exist (run `sortie topology apply`)")]
    MissingTopic(String),
    #[error(transparent)]
    Store(#[from] store::Error),
}

fn kafka_error(doing: impl Into<String>) -> impl FnOnce(KafkaError) -> Error {
    move |source| Error::Kafka {
        doing: doing.into(),
        source,
    }
}

/// A place in the run-events log: the answer to a command carries the position of the
/// answering event, and a read can wait until the view has applied it. Written `p2:o1534`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Position {
    pub partition: i32,
    pub offset: i64,
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "p{}:o{}", self.partition, self.offset)
    }
}

impl FromStr for Position {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("{s:?} is not a position like p2:o1534");
        let (p, o) = s.trim().split_once(':').ok_or_else(bad)?;
        let partition = p.strip_prefix('p').and_then(|p| p.parse().ok());
        let offset = o.strip_prefix('o').and_then(|o| o.parse().ok());
        match (partition, offset) {
            (Some(partition), Some(offset)) if partition >= 0 && offset >= 0 => {
                Ok(Position { partition, offset })
            }
            _ => Err(bad()),
        }
    }
}

/// Positions, comma-separated (a client that wrote to several runs may wait for all).
pub fn parse_positions(s: &str) -> Result<Vec<Position>, String> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(str::parse)
        .collect()
}

/// How far the view has read.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    /// Next offset to read per partition of run-events.
    pub events: BTreeMap<i32, i64>,
    /// Next offset to read per partition of run-state.
    pub states: BTreeMap<i32, i64>,
    /// Records applied since start (wakes streams and waiters).
    pub applied: u64,
    /// Caught up with the end of both topics as they were at start.
    pub ready: bool,
    /// The view stopped on a store failure: reads would be stale from now on.
    pub failed: bool,
}

impl Progress {
    pub fn reached(&self, position: &Position) -> bool {
        self.events
            .get(&position.partition)
            .is_some_and(|next| *next > position.offset)
    }
}

/// The code of an [`Answer`] that says the reducer kept a decision for an interrupt not
/// registered yet (`DecisionBuffered`).
pub const BUFFERED: &str = "decision_buffered";

/// The reducer's answer to one command.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// The tenant of the command answered (the answering event's).
    pub tenant: String,
    pub run_id: String,
    pub accepted: bool,
    pub duplicate: bool,
    pub code: String,
    pub reason: String,
    pub state_version: i64,
    pub position: Position,
}

/// A write waiting for its answer: the tenant and run it is about, and where to send the
/// answer.
struct Waiter {
    tenant: String,
    run_id: String,
    tx: oneshot::Sender<Answer>,
}

/// The view: its store, its progress, and the writes waiting for answers.
pub struct View {
    pub store: Store,
    progress: watch::Sender<Progress>,
    /// command id → waiting writes. Ids and run ids come from clients (`Idempotency-Key`,
    /// `run_id`), so two tenants may race the same pair: an answer goes only to writes of
    /// its own tenant about its own run.
    waiters: Mutex<HashMap<String, Vec<Waiter>>>,
    /// End offsets of (run-state, run-events) at start: ready once both are reached.
    targets: (BTreeMap<i32, i64>, BTreeMap<i32, i64>),
    /// Runs set aside (see [`Quarantine`]), in the store.
    quarantined: AtomicUsize,
}

impl fmt::Debug for View {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("View")
            .field("store", &self.store)
            .field("progress", &*self.progress.borrow())
            .finish_non_exhaustive()
    }
}

impl View {
    pub fn progress(&self) -> watch::Receiver<Progress> {
        self.progress.subscribe()
    }

    /// How many runs the view has set aside.
    pub fn quarantined(&self) -> usize {
        self.quarantined.load(Ordering::Relaxed)
    }

    /// Registers a write of `tenant` waiting for the answer to `command_id` about `run_id`.
    /// Register before publishing, so the answer cannot slip past.
    pub fn expect(
        &self,
        command_id: &str,
        tenant: &str,
        run_id: &str,
    ) -> oneshot::Receiver<Answer> {
        let (tx, rx) = oneshot::channel();
        self.waiters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(command_id.to_owned())
            .or_default()
            .push(Waiter {
                tenant: tenant.to_owned(),
                run_id: run_id.to_owned(),
                tx,
            });
        rx
    }

    /// Drops waiters for `command_id` that gave up.
    pub fn forget(&self, command_id: &str) {
        let mut waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(list) = waiters.get_mut(command_id) {
            list.retain(|w| !w.tx.is_closed());
            if list.is_empty() {
                waiters.remove(command_id);
            }
        }
    }

    /// Waits until `done` holds for the view (checked after every applied record), at most
    /// `timeout`. True when it held.
    pub async fn wait_until(&self, timeout: Duration, mut done: impl FnMut(&Self) -> bool) -> bool {
        let mut progress = self.progress();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            progress.borrow_and_update();
            if done(self) {
                return true;
            }
            match tokio::time::timeout_at(deadline, progress.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return done(self),
            }
        }
    }

    /// Waits until the view has applied every position, at most `timeout`.
    pub async fn reach(&self, positions: &[Position], timeout: Duration) -> bool {
        if positions.is_empty() {
            return true;
        }
        let mut progress = self.progress();
        let deadline = tokio::time::Instant::now() + timeout;
        let reached = |p: &Progress| positions.iter().all(|pos| p.reached(pos));
        tokio::time::timeout_at(deadline, progress.wait_for(reached))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    fn publish(&self, source: Source, partition: i32, next: i64, applied: bool) {
        let mut caught_up_now = None;
        self.progress.send_if_modified(|p| {
            let map = match source {
                Source::RunState => &mut p.states,
                Source::RunEvents => &mut p.events,
            };
            let entry = map.entry(partition).or_insert(0);
            let moved = next > *entry;
            *entry = (*entry).max(next);
            if applied {
                p.applied += 1;
            }
            let was_ready = p.ready;
            p.ready = p.ready
                || caught_up(&p.states, &self.targets.0) && caught_up(&p.events, &self.targets.1);
            if p.ready && !was_ready {
                caught_up_now = Some(p.applied);
            }
            moved || applied || p.ready != was_ready
        });
        if let Some(applied) = caught_up_now {
            tracing::info!(
                applied,
                "The view caught up with run-state and run-events; ready."
            );
        }
    }

    fn answer(&self, answer: Answer, command_id: &str) {
        let mut waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        let Some(list) = waiters.get_mut(command_id) else {
            return;
        };
        let (mine, others): (Vec<_>, Vec<_>) = list
            .drain(..)
            .partition(|w| w.run_id == answer.run_id && w.tenant == answer.tenant);
        *list = others;
        if list.is_empty() {
            waiters.remove(command_id);
        }
        drop(waiters);
        for waiter in mine {
            let _ = waiter.tx.send(answer.clone());
        }
    }

    /// Folds a run-event in: stores it, moves the run's state on, answers a waiting write.
    fn apply_event(&self, partition: i32, offset: i64, event: Option<Event>) -> Result<(), Error> {
        let next = (Source::RunEvents, partition, offset + 1);
        let answer = event.as_ref().and_then(|event| {
            let position = Position { partition, offset };
            let (command_id, accepted, duplicate, code, reason) = match &event.body {
                EventBody::CommandAccepted {
                    command_id,
                    duplicate,
                    ..
                } => (command_id, true, *duplicate, String::new(), String::new()),
                EventBody::CommandRejected {
                    command_id,
                    code,
                    reason,
                    ..
                } => (command_id, false, false, code.clone(), reason.clone()),
                // A decision on an interrupt not registered yet: the reducer keeps it (its
                // final answer comes when the interrupt opens). That is its answer now.
                EventBody::DecisionBuffered { interrupt_id, .. } => {
                    let command_id = event.command_id.as_ref()?;
                    let reason = format!("kept until interrupt {interrupt_id} opens");
                    (command_id, true, false, BUFFERED.to_owned(), reason)
                }
                _ => return None,
            };
            let answer = Answer {
                tenant: event.tenant.clone(),
                run_id: event.run_id.clone(),
                accepted,
                duplicate,
                code,
                reason,
                state_version: event.state_version,
                position,
            };
            Some((command_id.clone(), answer))
        });
        match event.filter(|e| e.seq > 0) {
            // seq 0 answers a command about a run that does not exist: not part of any
            // history.
            None => self.store.write(Write::offset(next))?,
            Some(event) => {
                let (tenant, run_id) = (event.tenant.clone(), event.run_id.clone());
                let folded = self.fold_event(next, event);
                self.quarantine_on(folded, next, &tenant, &run_id)?;
            }
        }
        self.publish(Source::RunEvents, partition, offset + 1, true);
        // The answer goes out whatever became of the run in the view: a quarantined run's
        // writer still hears what the reducer said.
        if let Some((command_id, answer)) = answer {
            self.answer(answer, &command_id);
        }
        Ok(())
    }

    fn fold_event(&self, next: (Source, i32, i64), event: Event) -> Result<(), store::Error> {
        if self.store.quarantined(&event.run_id)?.is_some() {
            return self.store.write(Write::offset(next));
        }
        let mut write = Write::offset(next);
        let before = self.store.run(&event.run_id)?;
        if let Some(after) = fold(&self.store, before.clone(), &event)? {
            write.run = Some((before, after));
        }
        write.events.push(event);
        self.store.write(write)
    }

    /// Takes a changelog record when it is further along than what the events gave.
    fn apply_state(
        &self,
        partition: i32,
        offset: i64,
        record: Option<w::RunState>,
    ) -> Result<(), Error> {
        let next = (Source::RunState, partition, offset + 1);
        let decoded = record.and_then(|record| match convert::state_from_wire(&record) {
            Ok(state) => Some((record.tenant, record.version, state)),
            Err(error) => {
                tracing::warn!(partition, offset, %error, "Skipped a run-state record the view cannot read.");
                None
            }
        });
        match decoded {
            None => self.store.write(Write::offset(next))?,
            Some((tenant, version, state)) => {
                let run_id = state.run_id.clone();
                let taken = self.take_state(next, version, state);
                self.quarantine_on(taken, next, &tenant, &run_id)?;
            }
        }
        self.publish(Source::RunState, partition, offset + 1, true);
        Ok(())
    }

    fn take_state(
        &self,
        next: (Source, i32, i64),
        version: i64,
        state: sortie_core::RunState,
    ) -> Result<(), store::Error> {
        let mut write = Write::offset(next);
        if self.store.quarantined(&state.run_id)?.is_some() {
            return self.store.write(write);
        }
        let before = self.store.run(&state.run_id)?;
        let after = match &before {
            Some(b) if b.state.last_event_seq >= state.last_event_seq => StoredRun {
                state: b.state.clone(),
                changelog_version: b.changelog_version.max(version),
            },
            _ => StoredRun {
                changelog_version: before
                    .as_ref()
                    .map_or(version, |b| b.changelog_version.max(version)),
                state,
            },
        };
        if before.as_ref() != Some(&after) {
            write.run = Some((before, after));
        }
        self.store.write(write)
    }

    /// `applied` when it went through; when what failed was one run's own (a value that
    /// does not read back or cannot be stored), that run is set aside and the offset moves
    /// on all the same. Any other error is the store's as a whole.
    fn quarantine_on(
        &self,
        applied: Result<(), store::Error>,
        next: (Source, i32, i64),
        tenant: &str,
        run_id: &str,
    ) -> Result<(), Error> {
        match applied {
            Err(error) if error.run_scoped() => {
                self.set_aside(next, tenant, run_id, &error.to_string())
            }
            other => Ok(other?),
        }
    }

    /// Quarantines `run_id` (once: a run already set aside only moves the offset on).
    fn set_aside(
        &self,
        next: (Source, i32, i64),
        tenant: &str,
        run_id: &str,
        reason: &str,
    ) -> Result<(), Error> {
        let write = Write::offset(next);
        if matches!(self.store.quarantined(run_id), Ok(Some(_))) {
            return Ok(self.store.write(write)?);
        }
        let (source, partition, offset) = (next.0, next.1, next.2 - 1);
        let topic = match source {
            Source::RunState => "run-state",
            Source::RunEvents => "run-events",
        };
        let record = format!("{topic} p{partition}:o{offset}");
        let quarantine = Quarantine {
            run_id: run_id.to_owned(),
            tenant: tenant.to_owned(),
            reason: sortie_core::limits::clip(reason, 1024).to_owned(),
            at: sortie_kafka::clock::now_ms(),
            record: record.clone(),
        };
        self.store.write(Write {
            quarantine: Some(quarantine),
            ..write
        })?;
        let count = self.quarantined.fetch_add(1, Ordering::Relaxed) + 1;
        crate::metrics::quarantined_runs(count);
        tracing::error!(
            %run_id,
            %tenant,
            %record,
            %reason,
            "The view cannot read or store this run: it is quarantined (its reads answer run_unreadable) and the view goes on with every other run."
        );
        Ok(())
    }

    /// A run-event of `run_id` that does not convert: its run's history has a hole the
    /// view cannot fill, so the run is set aside rather than left behind in silence.
    fn unreadable_event(
        &self,
        partition: i32,
        offset: i64,
        tenant: &str,
        run_id: &str,
        reason: &str,
    ) -> Result<(), Error> {
        let next = (Source::RunEvents, partition, offset + 1);
        self.set_aside(next, tenant, run_id, reason)?;
        self.publish(Source::RunEvents, partition, offset + 1, true);
        Ok(())
    }
}

fn caught_up(next: &BTreeMap<i32, i64>, targets: &BTreeMap<i32, i64>) -> bool {
    targets
        .iter()
        .all(|(p, end)| next.get(p).copied().unwrap_or(0) >= *end)
}

/// The run after `event`, `None` when it changes nothing (already reflected, or a gap the
/// changelog will close).
fn fold(
    store: &Store,
    before: Option<StoredRun>,
    event: &Event,
) -> Result<Option<StoredRun>, store::Error> {
    let changelog_version = before.as_ref().map_or(0, |b| b.changelog_version);
    let mut state = before.map(|b| b.state);
    let last = state.as_ref().map_or(0, |s| s.last_event_seq);
    if event.seq <= last {
        return Ok(None);
    }
    for seq in last + 1..event.seq {
        match store.event(&event.run_id, seq)? {
            Some(earlier) => state = sortie_core::evolve(state, &earlier),
            None => return Ok(None),
        }
    }
    Ok(sortie_core::evolve(state, event).map(|state| StoredRun {
        state,
        changelog_version,
    }))
}

/// Partition ids of a topic and the end offset of each.
fn layout(kafka: &KafkaConfig, group: &str, topic: &str) -> Result<BTreeMap<i32, i64>, Error> {
    let consumer: BaseConsumer = kafka
        .client()
        .set("group.id", group)
        .set("isolation.level", "read_committed")
        .create()
        .map_err(kafka_error("creating a metadata client"))?;
    let partitions = sortie_kafka::read::partition_ids(consumer.client(), topic, METADATA_TIMEOUT)
        .map_err(kafka_error(format!("fetching the metadata of {topic}")))?;
    if partitions.is_empty() {
        return Err(Error::MissingTopic(topic.to_owned()));
    }
    let marks = sortie_kafka::read::watermarks(
        &consumer,
        topic,
        partitions,
        std::time::Instant::now() + METADATA_TIMEOUT,
    )
    .map_err(kafka_error(format!("fetching the offsets of {topic}")))?;
    Ok(marks.into_iter().map(|(p, (_, high))| (p, high)).collect())
}

/// The partition count of a topic.
pub async fn partitions(kafka: &KafkaConfig, topics: &Topics, topic: &str) -> Result<u32, Error> {
    let (kafka, group, topic) = (
        kafka.clone(),
        format!("{}gateway", topics.prefix()),
        topic.to_owned(),
    );
    let ends = tokio::task::spawn_blocking(move || layout(&kafka, &group, &topic))
        .await
        .map_err(|e| Error::MissingTopic(format!("(metadata task failed: {e})")))??;
    Ok(ends.len() as u32)
}

/// Opens the view over `store` and starts following the topics. The returned task ends
/// when `shutdown` turns true.
pub async fn start(
    kafka: &KafkaConfig,
    topics: &Topics,
    codec: Arc<Codec>,
    store: Store,
    run_keys: Option<sortie_seal::RunKeys>,
    shutdown: watch::Receiver<bool>,
) -> Result<(Arc<View>, tokio::task::JoinHandle<()>), Error> {
    let group = format!("{}gateway", topics.prefix());
    let (state_topic, events_topic) = (topics.run_state(), topics.run_events());
    let (k, g, s, e) = (
        kafka.clone(),
        group.clone(),
        state_topic.clone(),
        events_topic.clone(),
    );
    let (state_ends, event_ends) = tokio::task::spawn_blocking(move || {
        Ok::<_, Error>((layout(&k, &g, &s)?, layout(&k, &g, &e)?))
    })
    .await
    .map_err(|e| Error::MissingTopic(format!("(metadata task failed: {e})")))??;

    let stored_states = store.offsets(Source::RunState)?;
    let stored_events = store.offsets(Source::RunEvents)?;
    let consumer: StreamConsumer<ReaderContext> = kafka
        .client()
        .set("group.id", &group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "true")
        .set("isolation.level", "read_committed")
        .set("auto.offset.reset", "earliest")
        .create_with_context(ReaderContext)
        .map_err(kafka_error("creating the view consumer"))?;
    let mut assignment = TopicPartitionList::new();
    for (topic, ends, stored) in [
        (&state_topic, &state_ends, &stored_states),
        (&events_topic, &event_ends, &stored_events),
    ] {
        for partition in ends.keys() {
            let offset = stored
                .get(partition)
                .map_or(Offset::Beginning, |o| Offset::Offset(*o));
            assignment
                .add_partition_offset(topic, *partition, offset)
                .map_err(kafka_error(format!("assigning {topic}")))?;
        }
    }
    consumer
        .assign(&assignment)
        .map_err(kafka_error("assigning the view's partitions"))?;

    let ready = caught_up(&stored_states, &state_ends) && caught_up(&stored_events, &event_ends);
    let (progress, _) = watch::channel(Progress {
        events: stored_events,
        states: stored_states,
        applied: 0,
        ready,
        failed: false,
    });
    let quarantined = store.quarantine_count();
    crate::metrics::quarantined_runs(quarantined);
    if quarantined > 0 {
        tracing::warn!(
            quarantined,
            "The view holds quarantined runs; their reads answer run_unreadable."
        );
    }
    let view = Arc::new(View {
        store,
        progress,
        waiters: Mutex::new(HashMap::new()),
        targets: (state_ends, event_ends),
        quarantined: AtomicUsize::new(quarantined),
    });
    tracing::info!(
        ready,
        state_partitions = view.targets.0.len(),
        event_partitions = view.targets.1.len(),
        "The view follows run-state and run-events from its stored offsets."
    );
    let follower = Follower {
        view: view.clone(),
        consumer,
        codec,
        run_keys,
        state_topic,
        events_topic,
        shutdown,
    };
    let task = tokio::spawn(follower.run());
    Ok((view, task))
}

struct Follower {
    view: Arc<View>,
    consumer: StreamConsumer<ReaderContext>,
    codec: Arc<Codec>,
    /// Opens sealed payloads as they come in (`None`: they are kept as they are).
    run_keys: Option<sortie_seal::RunKeys>,
    state_topic: String,
    events_topic: String,
    shutdown: watch::Receiver<bool>,
}

enum Decoded<R> {
    Record(R),
    /// Undecodable for good: skipped, the offset moves on.
    Skip,
    /// Shutting down while the registry was unreachable.
    Stop,
}

impl Follower {
    async fn run(mut self) {
        loop {
            let received = tokio::select! {
                _ = self.shutdown.wait_for(|stop| *stop) => break,
                received = self.consumer.recv() => received.map(|m| m.detach()),
            };
            let outcome = match received {
                Ok(message) => self.take(message).await,
                Err(KafkaError::PartitionEOF(_)) => {
                    self.at_end();
                    Ok(true)
                }
                Err(error) => {
                    tracing::warn!(%error, "Reading the run topics failed; reading on.");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    Ok(true)
                }
            };
            match outcome {
                Ok(true) => {}
                Ok(false) => break,
                Err(error) => {
                    // The store as a whole failed (one run's trouble quarantines that run):
                    // reading on would leave it behind without knowing.
                    tracing::error!(%error, "The view store failed; the view stops.");
                    self.view.progress.send_modify(|p| {
                        p.ready = false;
                        p.failed = true;
                    });
                    break;
                }
            }
        }
        if let Err(error) = self.view.store.flush().await {
            tracing::warn!(%error, "Flushing the view store failed.");
        }
        tracing::info!("The view stopped.");
    }

    /// At the end of a partition the position may be past the last record (transaction
    /// markers); it counts for readiness.
    fn at_end(&self) {
        let Ok(positions) = self.consumer.position() else {
            return;
        };
        for element in positions.elements() {
            let Offset::Offset(next) = element.offset() else {
                continue;
            };
            let source = if element.topic() == self.state_topic {
                Source::RunState
            } else if element.topic() == self.events_topic {
                Source::RunEvents
            } else {
                continue;
            };
            self.view.publish(source, element.partition(), next, false);
        }
    }

    /// Applies one record; false when shutting down.
    async fn take(&mut self, message: OwnedMessage) -> Result<bool, Error> {
        let (partition, offset) = (message.partition(), message.offset());
        if message.topic() == self.events_topic {
            let event = match self.decode::<w::RunEvent>(&message).await {
                Decoded::Record(record) => {
                    let (tenant, run_id) = (record.tenant.clone(), record.run_id.clone());
                    match convert::event_from_wire(record) {
                        Ok(mut event) => {
                            if let Some(seal) = self.seal_of(&event.tenant, &event.run_id).await {
                                if let Err(unopened) = seal.open_all(|f| event.map_payloads(f)) {
                                    tracing::warn!(error = %unopened.first, partition, offset, run_id = %event.run_id, "Payloads of a run event do not open; the view keeps them sealed.");
                                }
                            }
                            Some(event)
                        }
                        Err(error) => {
                            let reason = format!("a run event does not read: {error}");
                            self.view
                                .unreadable_event(partition, offset, &tenant, &run_id, &reason)?;
                            return Ok(true);
                        }
                    }
                }
                Decoded::Skip => None,
                Decoded::Stop => return Ok(false),
            };
            self.view.apply_event(partition, offset, event)?;
        } else {
            let record = match self.decode::<w::RunState>(&message).await {
                Decoded::Record(mut record) => {
                    if let Some(seal) = self.seal_of(&record.tenant, &record.run_id).await {
                        if let Ok(mut state) =
                            serde_json::from_str::<sortie_core::RunState>(&record.state)
                        {
                            if let Err(unopened) = seal.open_all(|f| state.map_payloads(f)) {
                                tracing::warn!(error = %unopened.first, partition, offset, run_id = %record.run_id, "Payloads of a run state do not open; the view keeps them sealed.");
                            }
                            if let Ok(json) = serde_json::to_string(&state) {
                                record.state = json;
                            }
                        }
                    }
                    Some(record)
                }
                Decoded::Skip => None,
                Decoded::Stop => return Ok(false),
            };
            self.view.apply_state(partition, offset, record)?;
        }
        Ok(true)
    }

    /// The seal to open `run_id`'s payloads with, if payloads are sealed here. An
    /// unreachable key store is waited out, like an unreachable registry (the view must
    /// not keep payloads sealed for good because of an outage); `None` when shutting down
    /// meanwhile, or when the run's key cannot be had (no KEK for its tenant, a key that
    /// does not unwrap): its payloads then stay sealed in the view.
    async fn seal_of(&mut self, tenant: &str, run_id: &str) -> Option<sortie_seal::RunSeal> {
        let keys = self.run_keys.clone()?;
        let mut pause = Duration::from_millis(100);
        loop {
            match keys.seal(tenant, run_id).await {
                Ok(seal) => return Some(seal),
                Err(sortie_seal::Error::Store(e)) => {
                    tracing::warn!(run_id, error = %e, "Key store unavailable; the view waits.");
                    tokio::select! {
                        _ = self.shutdown.wait_for(|stop| *stop) => return None,
                        () = tokio::time::sleep(pause) => {}
                    }
                    pause = (pause * 2).min(Duration::from_secs(5));
                }
                Err(e) => {
                    tracing::warn!(run_id, error = %e, "A run's data key cannot be had; its payloads stay sealed in the view.");
                    return None;
                }
            }
        }
    }

    async fn decode<R: Record>(&mut self, message: &OwnedMessage) -> Decoded<R> {
        let decoded = tokio::select! {
            _ = self.shutdown.wait_for(|stop| *stop) => return Decoded::Stop,
            decoded = self.codec.decode_patiently::<R>(message.payload(), None) => decoded,
        };
        match decoded {
            Ok(record) => Decoded::Record(record),
            Err(error) => {
                tracing::warn!(
                    topic = message.topic(),
                    partition = message.partition(),
                    offset = message.offset(),
                    %error,
                    "Skipped a record the view cannot decode."
                );
                Decoded::Skip
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_read_back_what_they_print() {
        let p = Position {
            partition: 2,
            offset: 1534,
        };
        assert_eq!(p.to_string(), "p2:o1534");
        assert_eq!("p2:o1534".parse::<Position>(), Ok(p));
        assert!("2:1534".parse::<Position>().is_err());
        assert!("p-1:o3".parse::<Position>().is_err());
        assert_eq!(
            parse_positions("p0:o1,p2:o9").expect("two"),
            vec![
                Position {
                    partition: 0,
                    offset: 1
                },
                Position {
                    partition: 2,
                    offset: 9
                }
            ]
        );
        let progress = Progress {
            events: BTreeMap::from([(2, 1535)]),
            ..Progress::default()
        };
        assert!(progress.reached(&p));
        assert!(!progress.reached(&Position {
            partition: 2,
            offset: 1535
        }));
    }

    fn view(dir: &std::path::Path) -> View {
        View {
            store: Store::open(dir, "p.").expect("open"),
            progress: watch::channel(Progress::default()).0,
            waiters: Mutex::new(HashMap::new()),
            targets: (BTreeMap::new(), BTreeMap::new()),
            quarantined: AtomicUsize::new(0),
        }
    }

    /// Seen red: with TooDeep no longer run-scoped, the first quarantine stopped the view.
    #[test]
    fn one_runs_error_quarantines_it_and_only_the_stores_own_stops_the_view() {
        let dir = tempfile::tempdir().expect("tempdir");
        let view = view(dir.path());
        let next = (Source::RunEvents, 0, 8);
        let one_run = store::Error::TooDeep {
            key: "r/deep".into(),
            depth: 130,
        };
        view.quarantine_on(Err(one_run), next, "acme", "deep")
            .expect("the view goes on");
        assert_eq!(view.quarantined(), 1);
        let kept = view.store.quarantined("deep").expect("read").expect("kept");
        assert_eq!(
            (kept.tenant.as_str(), kept.record.as_str()),
            ("acme", "run-events p0:o7")
        );
        assert_eq!(
            view.store.offsets(Source::RunEvents).expect("offsets"),
            BTreeMap::from([(0, 8)]),
            "the offset moved on with it"
        );
        // Once: the same run again only moves the offset.
        let again = store::Error::TooDeep {
            key: "r/deep".into(),
            depth: 130,
        };
        view.quarantine_on(Err(again), (Source::RunEvents, 0, 9), "acme", "deep")
            .expect("the view goes on");
        assert_eq!(view.quarantined(), 1);

        let whole = store::Error::Sled(sled::Error::Unsupported("the disk is gone".into()));
        assert!(!whole.run_scoped());
        assert!(
            view.quarantine_on(Err(whole), (Source::RunEvents, 0, 10), "acme", "other")
                .is_err(),
            "the store as a whole stops the view"
        );
        assert_eq!(view.quarantined(), 1);
    }
}
