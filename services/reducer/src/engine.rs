//! The reducer's state between two polls: the producer, the cache, the graph table, the
//! partition tasks and the open batch. The poll loop (`driver`) and the rebalance callback
//! (`tasks`) both work on it, one at a time, on the polling thread: the callback runs
//! inside `poll`, while the loop does not hold the engine.
//!
//! This module applies inputs to the open batch with the pure fold; `input` decides what
//! an input record is, `txn` commits a batch, `cache` writes sled after the commit.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use crate::txn::TxnProducer;
use rdkafka::consumer::BaseConsumer;
use sortie_core::limits::MeasuredSteps;
use sortie_core::{apply_measured, Effect, Input, RunState, Seal as _};
use sortie_wire::{partition_for, Codec, Record, TraceContext};
use tokio::runtime::Handle;

use crate::batch::{Before, InputRef, Output, PendingBatch, Source};
use crate::convert;
use crate::driver::{Error, ReducerConfig};
use crate::gauges::RunGauges;
use crate::graphs::GraphTable;
use crate::health::Health;
use crate::store::Store;
use crate::tasks::Tasks;

/// Most runs kept in [`Engine::hot`].
pub(crate) const HOT_RUNS: usize = 8_192;

pub(crate) struct Engine {
    pub config: ReducerConfig,
    pub runtime: Handle,
    pub codec: Arc<Codec>,
    pub store: Arc<Store>,
    pub graphs: GraphTable,
    /// The producer of the open transaction, or of the next one.
    pub producer: TxnProducer,
    /// The other producer, whose turn comes after [`Engine::producer`]'s next commit: the
    /// two take turns, transaction by transaction. After a commit the broker writes the
    /// transaction's markers, and until they are written it answers that producer's next
    /// AddPartitionsToTxn and AddOffsetsToTxn with CONCURRENT_TRANSACTIONS, which
    /// librdkafka retries (AddPartitionsToTxn after a fixed 20 ms). Taking turns, a
    /// producer begins again only after a whole other transaction. Still one transaction
    /// open at a time: the next begins after the previous committed, so every record of
    /// the previous is in the log before any of the next (its markers may come after).
    pub turn: TxnProducer,
    /// A `read_uncommitted` client, only for the changelog's high watermarks: the end a
    /// restore reads to (see `restore`). Asked through the `read_committed` input consumer
    /// they would be last stable offsets.
    pub marks: BaseConsumer,
    /// Who may write commands (signatures).
    pub keys: crate::keyring::Keys,
    /// The run data keys, when payloads are sealed (see `sealing`).
    pub run_keys: Option<sortie_seal::RunKeys>,
    /// Signs the commands the fold sends to other runs (a child run's start and cancel).
    pub signer: Option<sortie_wire::signing::Signer>,
    /// Partition count of the co-partitioned topics.
    pub partitions: u32,
    pub tasks: Tasks,
    pub batch: PendingBatch,
    /// Containers of committed batches, for the next open one (see [`crate::batch::Spare`]).
    pub spare: crate::batch::Spare,
    pub gauges: RunGauges,
    pub health: Health,
    /// The signed command ids of the replay window, per owned partition (see `replay`).
    pub replays: crate::replay_window::Replays,
    /// Bounds the producer's blocking calls (see `watchdog`).
    pub watchdog: crate::watchdog::Watchdog,
    /// Committed states of recently changed, unfinished runs of the owned partitions, so
    /// the next input of a busy run is not re-read and re-parsed from sled. Holds only
    /// what Kafka has committed (filled after a commit), bounded by [`HOT_RUNS`], emptied
    /// on every rebalance.
    pub hot: HashMap<String, RunState>,
    /// The JSON of recently written runs' steps, so a run's next state does not write
    /// its unchanged steps again (see `txn::Written`); emptied on every rebalance.
    pub written: crate::txn::Written,
    /// The measures of recently folded, unfinished runs' steps, so the fold does not walk
    /// a run's unchanged steps again to measure its next state; emptied on every
    /// rebalance.
    pub measured: Measured,
    /// The batch whose transaction is open, its records sent, while the open `batch`
    /// folds (see `driver`): at most one.
    pub sending: Option<crate::txn::Sending>,
    /// An error met inside a rebalance callback that must end this incarnation of the
    /// clients (a fenced producer); the loop returns it after the poll.
    pub fatal: Option<Error>,
    /// The input being handled, while it is: the source of every record it makes.
    pub source: Option<InputRef>,
    /// Inputs and runs whose records Kafka refused (see `txn::Refusal`), and how often.
    pub refused: HashMap<Source, Refused>,
    /// Runs whose changelog record does not read back, and why (see `restore`): their
    /// inputs are dead-lettered, `quarantined`.
    pub quarantined: HashMap<String, String>,
    /// Per input partition, the first offset of every batch dropped since the consumer
    /// last sought: where it must seek back to (only what was dropped is read again).
    pub rewind: BTreeMap<(String, i32), i64>,
    /// Per input partition, the next offset committed for it: a batch of timers alone
    /// sends these, so its transaction is fenced by the group generation like any other.
    pub positions: BTreeMap<(String, i32), i64>,
    /// Transactions aborted in a row, and the last reason: the loop backs off, and past
    /// a few the reducer says it is not ready.
    pub aborts: (u32, String),
    /// What the last commit dispatched and what came back since: whether a small batch
    /// waits for the rest (see `convoy`).
    pub convoy: crate::convoy::Convoy,
    /// Which intent topics exist (see `queues`).
    pub queues: crate::queues::KnownTopics,
}

/// Most steps' JSON bytes (as measured) [`Measured`] holds; past it, it starts over.
const MEASURED_BYTES: usize = 32 * 1024 * 1024;

/// The measures of recently folded runs' steps, per run
/// ([`sortie_core::limits::MeasuredSteps`]): the fold measures a run's next state with
/// them (`sortie_core::limits::measure_state`). At most [`HOT_RUNS`] runs and
/// [`MEASURED_BYTES`]: the steps it holds stay in memory while it does.
pub(crate) type Measured = crate::per_run::PerRun<MeasuredSteps, HOT_RUNS, MEASURED_BYTES>;

/// An input whose records Kafka refused for what they are (see `txn::Refusal`).
#[derive(Debug, Clone, Default)]
pub(crate) struct Refused {
    /// Times a record of this input was refused.
    pub times: u32,
    /// Why, in Kafka's words.
    pub reason: String,
    /// The input was dead-lettered by reference: if that is refused too, the partition
    /// stops.
    pub lettered: bool,
}

impl Engine {
    pub fn partition_of(&self, run_id: &str) -> i32 {
        partition_for(run_id.as_bytes(), self.partitions)
    }

    /// Encodes with the registry, waiting out a registry outage (bounded).
    pub fn encode<R: Record>(&self, topic: &str, record: &R) -> Result<Vec<u8>, Error> {
        crate::input::encode_patiently(&self.runtime, &self.codec, topic, record)
    }

    /// What made the record being built for `run_id`: the input being handled, or the
    /// run itself (a timer).
    pub fn source_of(&self, run_id: &str) -> Source {
        match &self.source {
            Some(input) => Source::Input(input.clone()),
            None => Source::Run(run_id.to_owned()),
        }
    }

    /// Marks the open batch broken when `result` is an error: an input or timer was met
    /// halfway, so the batch must never commit (see `PendingBatch::broken`).
    pub fn whole<T>(&mut self, result: Result<T, Error>) -> Result<T, Error> {
        if let Err(e) = &result {
            self.batch.broken.get_or_insert_with(|| e.to_string());
        }
        result
    }

    /// Fires the timers of active partitions that are due at `now` into the batch. Not
    /// while a batch is in flight: the timer index in sled does not know yet what that
    /// batch fired, armed or disarmed. An error leaves the batch broken.
    pub fn fire_timers(&mut self, now: i64) -> Result<(), Error> {
        self.source = None;
        let fired = self.fire_due_timers(now);
        self.whole(fired)
    }

    fn fire_due_timers(&mut self, now: i64) -> Result<(), Error> {
        let active = self.tasks.active();
        if active.is_empty() || self.sending.is_some() {
            return Ok(());
        }
        let due = self.store.due_timers(now, &active, self.config.max_batch)?;
        for timer in due {
            if self.batch.fired.iter().any(|f| f == &timer) {
                continue;
            }
            self.batch.touch();
            if let Some(key) = sortie_core::TimerKey::decode(&timer.timer_key) {
                let input = Input::TimerFired {
                    run_id: timer.run_id.clone(),
                    timer: key,
                    at: now,
                };
                let trace = TraceContext::for_run(&timer.run_id);
                self.apply(&input, &trace)?;
            }
            self.batch.fired.push(timer);
        }
        Ok(())
    }

    /// The run as this batch sees it, and whether that is the batch's own latest write.
    /// The batch's own state of the run is taken out of it, not copied (a state carries
    /// the run's whole history): the caller puts it, or the fold's answer, back
    /// ([`Engine::put_back`]). Otherwise the state as the batch found it.
    fn take_state(&mut self, run_id: &str) -> Result<(Option<RunState>, bool), Error> {
        if let Some(state) = self.batch.after.remove(run_id) {
            return Ok((Some(state), true));
        }
        if let Some(state) = self.batch.unchanged.remove(run_id) {
            return Ok((Some(state), false));
        }
        self.state_before(run_id).map(|state| (state, false))
    }

    /// The run as this batch sees it, left where it was (a copy).
    pub(crate) fn peek_state(&mut self, run_id: &str) -> Result<Option<RunState>, Error> {
        let (state, from_batch) = self.take_state(run_id)?;
        Ok(state.inspect(|state| self.put_back(run_id, state.clone(), from_batch)))
    }

    /// Hands a state [`Engine::take_state`] gave out back to the batch unchanged.
    fn put_back(&mut self, run_id: &str, state: RunState, from_batch: bool) {
        match from_batch {
            true => self.batch.after.insert(run_id.to_owned(), state),
            false => self.batch.unchanged.insert(run_id.to_owned(), state),
        };
    }

    /// The run as it was before this batch: the batch in flight's (a copy: that batch
    /// still writes it), the hot states (taken: the commit puts the batch's state back),
    /// then sled (which does not have the batch in flight yet). Notes what the commit
    /// needs of it ([`Before`]) the first time.
    fn state_before(&mut self, run_id: &str) -> Result<Option<RunState>, Error> {
        let state = if let Some(after) = self
            .sending
            .as_ref()
            .and_then(|s| s.batch.after.get(run_id))
        {
            self.batch.on_in_flight = true;
            Some(after.clone())
        } else if let Some(hot) = self.hot.remove(run_id) {
            Some(hot)
        } else {
            // Never treat an unreadable cache entry as "no such run": that would start the
            // run's history over. The batch stops here and the run's partition is restored
            // from the changelog (`Engine::recover`).
            let unreadable = |reason: String| Error::UnreadableCache {
                run_id: run_id.to_owned(),
                reason,
            };
            let cached = match self.store.get_run(run_id) {
                Err(crate::store::Error::Corrupt(reason)) => return Err(unreadable(reason)),
                other => other?,
            };
            if cached.is_some() && self.fault_once(crate::fault::FaultPoint::UnreadableCache) {
                return Err(unreadable(
                    "fault injection: reducer.unreadable_cache".into(),
                ));
            }
            match cached {
                Some(bytes) => {
                    let mut state = serde_json::from_slice::<RunState>(&bytes)
                        .map_err(|e| unreadable(e.to_string()))?;
                    // Sled holds what the changelog holds: payloads sealed.
                    self.open_state(&mut state)?;
                    Some(state)
                }
                None => None,
            }
        };
        self.batch
            .before
            .entry(run_id.to_owned())
            .or_insert_with(|| state.as_ref().map(Before::of));
        Ok(state)
    }

    /// Applies one input with the fold and adds its effects to the batch. All of its
    /// records are encoded before any is added, so an input is in the batch whole or not
    /// at all.
    pub fn apply(&mut self, input: &Input, trace: &TraceContext) -> Result<(), Error> {
        if let Some((code, reason)) = self.apply_or_refuse(input, None, None, trace)? {
            // A timer of a quarantined run (its state is not in the cache, so it has no
            // armed timers) or a step result's payload: neither comes this way.
            tracing::error!(
                run_id = input.run_id(),
                code,
                reason,
                "An input was not applied."
            );
        }
        Ok(())
    }

    /// [`Engine::apply`], or — with `refusal` (code, reason) — the command's answer
    /// outside the run's history instead of the fold (`sortie_core::refuse`):
    /// `unauthenticated` (its signature does not hold, or it is outside its validity
    /// window) or `limit_exceeded` (a payload breaks the shape rule). `signed`: the
    /// command's signature held and it was issued then; its id is remembered, and refused
    /// `replayed` if it was taken already and the run does not know it (see `replay`).
    /// `Ok(Some((code, reason)))`: not applied, the caller dead-letters it — a step
    /// result whose payload does not open (`unsealable`), or any input of a quarantined
    /// run (`quarantined`: its changelog record does not read back, see `restore`).
    pub fn apply_or_refuse(
        &mut self,
        input: &Input,
        refusal: Option<(&'static str, String)>,
        signed: Option<i64>,
        trace: &TraceContext,
    ) -> Result<Option<(&'static str, String)>, Error> {
        let run_id = input.run_id().to_owned();
        if let Some(reason) = self.quarantined.get(&run_id) {
            return Ok(Some((
                "quarantined",
                format!("run {run_id} is quarantined: {reason}"),
            )));
        }
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
        let mut seal = sortie_seal::RunSeal::Plain;
        let (applied, state, from_batch) = match (refusal, input) {
            (Some((code, reason)), Input::Command(command)) => {
                // Refused before the fold: the run's state is not read, no graph waited for.
                tracing::warn!(
                    run_id,
                    command_id = %command.command_id,
                    tenant = %command.tenant,
                    principal = %command.principal,
                    code,
                    reason,
                    "Refusing a command before the fold."
                );
                crate::metrics::command_refused(code);
                let refused = sortie_core::refuse(command, code, reason, self.graphs.graphs());
                (refused, None, false)
            }
            _ => {
                let (state, from_batch) = self.take_state(&run_id)?;
                if let (Some(issued_at), Input::Command(c)) = (signed, input) {
                    let partition = self.partition_of(&run_id);
                    let key = (c.tenant.clone(), c.run_id.clone(), c.command_id.clone());
                    // A command id the run knows is the fold's to answer (once, the same
                    // answer); one it does not know was answered outside it, or long ago.
                    let known = state.as_ref().is_some_and(|s| {
                        s.tenant == c.tenant && s.commands.contains_key(&c.command_id)
                    });
                    if !known && self.replayed(partition, &key) {
                        tracing::warn!(run_id, command_id = %c.command_id, tenant = %c.tenant, principal = %c.principal, "Refusing a signed command whose id was taken already.");
                        crate::metrics::command_refused("replayed");
                        if let Some(state) = state {
                            self.put_back(&run_id, state, from_batch);
                        }
                        let reason = format!(
                            "command {} was answered already; a signed command is taken once (send a new command id)",
                            sortie_core::limits::shown_id(&c.command_id)
                        );
                        let refused =
                            sortie_core::refuse(c, "replayed", reason, self.graphs.graphs());
                        return self
                            .finish_apply(&run_id, input, refused, None, false, &seal, trace);
                    }
                    self.batch
                        .remembered
                        .push(crate::replay_window::Remembered {
                            partition,
                            key,
                            issued_at,
                            at: c.at,
                        });
                }
                let input = match self.sealing(state.as_ref(), input)? {
                    Ok((run_seal, opened)) => {
                        seal = run_seal;
                        opened
                    }
                    Err(reason) => {
                        if let Some(state) = state {
                            self.put_back(&run_id, state, from_batch);
                        }
                        let Input::Command(command) = input else {
                            return Ok(Some(("unsealable", reason)));
                        };
                        tracing::warn!(run_id, command_id = %command.command_id, reason, "Refusing a command whose payload does not open.");
                        let refused = sortie_core::refuse(
                            command,
                            "invalid",
                            format!("its payload does not open: {reason}"),
                            self.graphs.graphs(),
                        );
                        return self
                            .finish_apply(&run_id, input, refused, None, false, &seal, trace);
                    }
                };
                let input = match &input {
                    Input::Command(c) => match self.verify_fork(state.is_some(), c)? {
                        Ok(command) => Input::Command(command),
                        Err(reason) => {
                            tracing::warn!(run_id, command_id = %c.command_id, reason, "Refusing a fork whose source does not hold.");
                            let refused =
                                sortie_core::refuse(c, "bad_fork", reason, self.graphs.graphs());
                            if let Some(state) = state {
                                self.put_back(&run_id, state, from_batch);
                            }
                            return self
                                .finish_apply(&run_id, &input, refused, None, false, &seal, trace);
                        }
                    },
                    _ => input,
                };
                let input = &input;
                if let Input::Command(c) = input {
                    if let sortie_core::CommandBody::StartRun {
                        graph_id,
                        graph_version,
                        ..
                    } = &c.body
                    {
                        if state.is_none()
                            && self
                                .graphs
                                .graphs()
                                .resolve(&c.tenant, graph_id, *graph_version)
                                .is_none()
                        {
                            // A graph published a moment ago may not have reached the table yet.
                            self.graphs.catch_up(Duration::from_secs(5))?;
                        }
                    }
                }
                let mut measured = self.measured.take(&run_id);
                let applied = apply_measured(
                    state.as_ref(),
                    input,
                    self.graphs.graphs(),
                    &seal,
                    &mut measured,
                );
                let finished = applied
                    .state
                    .as_ref()
                    .or(state.as_ref())
                    .is_none_or(|s| s.status.is_terminal());
                if !finished {
                    self.measured.keep(&run_id, measured);
                }
                if self.fault_once(crate::fault::FaultPoint::FailMidFold) {
                    // The run's state is out of the batch and the fold has answered: the
                    // worst moment for an error to meet (`Engine::recover`, driver/pipeline.rs).
                    return Err(Error::Registry(
                        "fault injection: reducer.fail_mid_fold".to_owned(),
                    ));
                }
                self.shred_if_forgotten(state.as_ref(), input, &applied)?;
                if seal.active() {
                    self.batch.seals.insert(run_id.clone(), seal.clone());
                }
                (applied, state, from_batch)
            }
        };
        self.finish_apply(&run_id, input, applied, state, from_batch, &seal, trace)
    }

    /// Adds what the fold decided for one input to the batch, sealed with `seal`.
    #[allow(clippy::too_many_arguments)]
    fn finish_apply(
        &mut self,
        run_id: &str,
        input: &Input,
        mut applied: sortie_core::Applied,
        state: Option<RunState>,
        from_batch: bool,
        seal: &sortie_seal::RunSeal,
        trace: &TraceContext,
    ) -> Result<Option<(&'static str, String)>, Error> {
        let run_id = run_id.to_owned();
        // The state to write is `applied.state`.
        let mut changed = false;
        applied.effects.retain(|e| {
            let write = matches!(e, Effect::WriteState);
            changed |= write;
            !write
        });
        let events: Vec<&sortie_core::Event> = applied
            .effects
            .iter()
            .filter_map(|e| match e {
                Effect::Emit(event) => Some(event),
                _ => None,
            })
            .collect();
        self.batch
            .counts
            .applied(input, applied.ignored, &events, applied.state.as_ref());
        // Back before anything can fail: the batch never loses its view of a run.
        match (changed, state) {
            (true, _) => {
                if let Some(after) = applied.state.take() {
                    self.batch.after.insert(run_id.clone(), after);
                }
            }
            (false, Some(state)) => self.put_back(&run_id, state, from_batch),
            (false, None) => {}
        }
        let partition = self.partition_of(&run_id);
        let source = self.source_of(&run_id);
        let mut outputs = Vec::new();
        for effect in &applied.effects {
            match effect {
                Effect::Emit(event) => {
                    let topic = self.config.topics.run_events();
                    // Under a seal, the fold's own sealed copy (what it hashed). An answer
                    // outside the history (seq 0) has none, and no payload to seal.
                    let written = applied
                        .sealed_events
                        .iter()
                        .find(|s| s.seq == event.seq && event.seq > 0)
                        .unwrap_or(event);
                    let value = self.encode(&topic, &convert::event_to_wire(written))?;
                    outputs.push(Output {
                        topic,
                        partition: Some(partition),
                        key: run_id.clone().into_bytes(),
                        value: Some(value),
                        headers: vec![trace.child(&event.seq.to_string()).header()],
                        source: source.clone(),
                    });
                }
                Effect::Dispatch(intent) => {
                    let topic = self.config.topics.intents(&intent.queue);
                    if !self.queues.exists(&self.marks, &topic) {
                        outputs.push(self.unserved(intent, &topic, trace, &source)?);
                        continue;
                    }
                    self.batch.dispatched.push(&intent.operation_id);
                    let value = match seal.active() {
                        true => {
                            self.encode(&topic, &convert::intent_to_wire(&intent.sealed(seal)))?
                        }
                        false => self.encode(&topic, &convert::intent_to_wire(intent))?,
                    };
                    outputs.push(Output {
                        topic,
                        partition: None,
                        key: intent.operation_id.clone().into_bytes(),
                        value: Some(value),
                        headers: vec![
                            trace
                                .child(&format!("{}/{}", intent.operation_id, intent.attempt))
                                .header(),
                            (
                                sortie_wire::TENANT_HEADER.to_owned(),
                                Some(intent.tenant.clone().into_bytes()),
                            ),
                        ],
                        source: source.clone(),
                    });
                }
                Effect::Command(command) => {
                    outputs.push(self.command_output(command, trace, &source)?);
                }
                Effect::Report(report) => {
                    outputs.push(self.report_output(report, &run_id, trace, &source)?);
                }
                Effect::Forget { operations, .. } => {
                    // The step results hold outputs: tombstoned, so compaction drops them.
                    let topic = self.config.topics.step_results();
                    for operation in operations {
                        outputs.push(Output {
                            topic: topic.clone(),
                            partition: Some(partition),
                            key: operation.clone().into_bytes(),
                            value: None,
                            headers: vec![],
                            source: source.clone(),
                        });
                    }
                }
                // Taken out above; timers are derived from states at commit.
                Effect::WriteState | Effect::ArmTimer { .. } | Effect::DisarmTimer { .. } => {}
            }
        }
        if applied.ignored.is_some() {
            self.batch.ignored += 1;
            tracing::debug!(run_id, reason = applied.ignored, "Input changed nothing.");
        }
        self.batch.outputs.extend(outputs);
        Ok(None)
    }
}

impl Engine {
    /// How another run (a child, a parent) seals its payloads, when payloads are sealed:
    /// its key, made now with `create` (a child's start). A key that cannot be had is an
    /// error of the batch, which aborts.
    fn seal_for(
        &mut self,
        tenant: &str,
        run_id: &str,
        create: bool,
    ) -> Result<Option<sortie_seal::RunSeal>, Error> {
        let Some(keys) = self.run_keys.clone() else {
            return Ok(None);
        };
        match self.lookup(&keys, tenant, run_id, create)? {
            Ok(lookup) => Ok(Some(sortie_seal::RunKeys::seal_of(run_id, &lookup))),
            Err(reason) => Err(Error::Setup(format!(
                "no data key for run {run_id}: {reason}"
            ))),
        }
    }

    /// A command the fold sends another run (a child's start or cancel): its payloads
    /// sealed with that run's key (made now for a start), issued now and signed with the
    /// reducer's key, to that run's partition of the commands topic.
    fn command_output(
        &mut self,
        command: &sortie_core::Command,
        trace: &TraceContext,
        source: &Source,
    ) -> Result<Output, Error> {
        let mut input = Input::Command(command.clone());
        let starts = matches!(command.body, sortie_core::CommandBody::StartRun { .. });
        if let Some(seal) = self.seal_for(&command.tenant, &command.run_id, starts)? {
            use sortie_core::Seal as _;
            input.map_payloads(&mut |v| *v = seal.seal(v));
        }
        let Input::Command(sealed) = input else {
            unreachable!("a command stays a command")
        };
        let mut wire = convert::command_to_wire(&sealed);
        // Issued when produced: a re-fold after downtime is not outside the window.
        wire.issued_at = sortie_kafka::clock::now_ms();
        let topic = self.config.topics.commands();
        let value = self.encode(&topic, &wire)?;
        let mut headers = vec![trace.child(&command.command_id).header()];
        if let Some(signer) = &self.signer {
            headers.extend(
                signer
                    .headers(&value)
                    .into_iter()
                    .map(|(name, bytes)| (name.to_owned(), Some(bytes))),
            );
        }
        Ok(Output {
            topic,
            partition: Some(self.partition_of(&command.run_id)),
            key: command.run_id.clone().into_bytes(),
            value: Some(value),
            headers,
            source: source.clone(),
        })
    }

    /// A child run's end for its parent's step: a step result, its output sealed with
    /// the parent's key, to the parent's partition of the step results.
    /// In place of an intent for a topic that does not exist: a retryable failure of the
    /// attempt, for the fold to take as any result (see `queues`).
    fn unserved(
        &mut self,
        intent: &sortie_core::Intent,
        topic: &str,
        trace: &TraceContext,
        source: &Source,
    ) -> Result<Output, Error> {
        let report = sortie_core::StepReport {
            spent: None,
            operation_id: intent.operation_id.clone(),
            attempt: intent.attempt,
            tenant: intent.tenant.clone(),
            run_id: intent.run_id.clone(),
            step_id: intent.step_id.clone(),
            outcome: sortie_core::StepOutcome::Failed {
                retryable: true,
                code: crate::queues::UNKNOWN_QUEUE.into(),
                message: format!(
                    "queue {} has no topic ({topic} does not exist): fix the node's queue, or create the topic with `sortie topology apply`",
                    sortie_core::limits::shown_id(&intent.queue)
                ),
                retry_after_ms: None,
            },
            at: sortie_kafka::clock::now_ms(),
        };
        let topic = self.config.topics.step_results();
        let wire = convert::report_to_wire(&report, "reducer");
        let value = self.encode(&topic, &wire)?;
        Ok(Output {
            topic,
            partition: Some(self.partition_of(&report.run_id)),
            key: report.operation_id.clone().into_bytes(),
            value: Some(value),
            headers: vec![trace.child(&report.operation_id).header()],
            source: source.clone(),
        })
    }

    fn report_output(
        &mut self,
        report: &sortie_core::StepReport,
        child: &str,
        trace: &TraceContext,
        source: &Source,
    ) -> Result<Output, Error> {
        let mut report = report.clone();
        if let sortie_core::StepOutcome::Succeeded { output } = &mut report.outcome {
            if let Some(seal) = self.seal_for(&report.tenant, &report.run_id, false)? {
                use sortie_core::Seal as _;
                *output = seal.seal(output);
            }
        }
        let topic = self.config.topics.step_results();
        let wire = convert::report_to_wire(&report, &format!("run:{child}"));
        let value = self.encode(&topic, &wire)?;
        Ok(Output {
            topic,
            partition: Some(self.partition_of(&report.run_id)),
            key: report.operation_id.clone().into_bytes(),
            value: Some(value),
            headers: vec![trace.child(&report.operation_id).header()],
            source: source.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sortie_core::limits::measure_state;
    use sortie_core::state::Step;
    use std::sync::Arc;

    /// A run's measures holding one step of `payload` bytes of arguments.
    fn measures(payload: usize) -> MeasuredSteps {
        let mut state = crate::gauges::tests::state(sortie_core::RunStatus::Running, &[], 0);
        let step: Step = serde_json::from_value(serde_json::json!({
            "step_id": "s#1", "node": "s", "operation_id": "op", "attempt": 1,
            "tool": "echo", "queue": "default", "side_effect": "pure",
            "args": "x".repeat(payload), "role": "Node", "status": "in_flight",
            "output": null, "error": null
        }))
        .expect("step");
        state.steps.insert("s#1".into(), Arc::new(step));
        let mut measured = MeasuredSteps::default();
        measure_state(&state, &mut measured);
        measured
    }

    /// Seen red with `take` leaving the bytes counted: the holder then started over long
    /// before it held its bound.
    #[test]
    fn held_measures_count_their_steps_bytes_and_start_over_past_the_bound() {
        let mut held = Measured::default();
        let big = MEASURED_BYTES / 4;
        for round in 0..8 {
            let run = format!("run-{}", round % 3);
            let steps = held.take(&run);
            assert!(round < 3 || !steps.is_empty(), "round {round}: kept");
            held.keep(&run, measures(big));
        }
        assert_eq!(held.len(), 3);
        assert_eq!(held.bytes(), held.counted());
        // A fourth run past the bound: started over, holding that run alone.
        held.keep("run-3", measures(big));
        assert_eq!(held.len(), 1);
        assert!(held.bytes() > big && held.bytes() < MEASURED_BYTES / 3);
    }
}
