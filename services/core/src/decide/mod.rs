//! Deciding: one input → events (and intents). One handler per input kind, each in its own
//! file; `advance` is the engine they share, moving a run forward after any change.

mod advance;
mod agent_loop;
mod budget;
mod cancel;
mod child;
mod context;
mod converse;
mod forget;
pub mod fork;
mod precheck;
pub mod reconcile;
mod report;
mod resume;
mod signal;
mod start;
mod template;
mod timer;
mod wind_down;

use serde_json::Value;

use crate::{
    effect::{Effect, Intent, TimerKey},
    event::{Event, EventBody, StepRole},
    evolve::evolve,
    graph::{Graph, Graphs, Node},
    ids,
    input::{Command, CommandBody, Input, StepOutcome, StepReport},
    limits::{self, MeasuredSteps},
    seal::{Plain, Seal},
    state::{Answer, RunState},
    status::RunStatus,
};

pub(crate) use advance::advance;
pub(crate) use agent_loop::is_tool_call;
pub use template::approved_args;
pub(crate) use wind_down::begin_failure;

/// What applying one input produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Applied {
    /// In order: events, intents, timer changes, and the state write (if the run changed).
    pub effects: Vec<Effect>,
    /// The run's state after the input (`None`: the run does not exist).
    pub state: Option<RunState>,
    /// Why the input changed nothing, when it did not (counted by the reducer).
    pub ignored: Option<&'static str>,
    /// With an active seal ([`apply_sealed`]): the run's events as they are written, in
    /// the order emitted — the very copies their hashes were taken over, so the writer
    /// does not seal them again. Empty otherwise (and for answers outside the history,
    /// which carry no payload).
    pub sealed_events: Vec<Event>,
}

/// Applies one input to a run: the whole fold. Pure: no I/O, no clock, no randomness.
///
/// What the input would write is held to [`crate::limits`]; an input that would break
/// a limit is answered as that module says instead of being applied as is.
pub fn apply(state: Option<&RunState>, input: &Input, graphs: &Graphs) -> Applied {
    apply_sealed(state, input, graphs, &Plain)
}

/// [`apply`] for a run whose payloads are written sealed: every event's hash is taken
/// over its sealed form (what Kafka holds). The effects themselves stay plaintext; the
/// writer seals them with the same `seal` (or takes [`Applied::sealed_events`]). The
/// limits are checked on the plaintext: [`crate::limits`] says why sealed records fit.
pub fn apply_sealed(
    state: Option<&RunState>,
    input: &Input,
    graphs: &Graphs,
    seal: &dyn Seal,
) -> Applied {
    apply_measured(state, input, graphs, seal, &mut MeasuredSteps::default())
}

/// [`apply_sealed`], measuring the state it writes with what `measured` remembers of the
/// run's steps (see [`limits::measure_state`]): the same answer, without walking every
/// unchanged step of a long run again per input. `measured` belongs to this run; it is
/// left holding the measures of the state the fold wrote.
pub fn apply_measured(
    state: Option<&RunState>,
    input: &Input,
    graphs: &Graphs,
    seal: &dyn Seal,
    measured: &mut MeasuredSteps,
) -> Applied {
    let applied = apply_unchecked(state, input, graphs, seal);
    match breach(&applied, measured) {
        None => applied,
        Some(reason) => over_limit(state, input, graphs, seal, reason, measured),
    }
}

/// Why `applied` would write more than a run may, if it would: a record past its size
/// limit, or a document nested deeper than every reader reads back.
fn breach(applied: &Applied, measured: &mut MeasuredSteps) -> Option<String> {
    let too_deep = |what: String, depth: usize| {
        (depth > limits::MAX_STORED_DEPTH).then(|| {
            format!(
                "{what} would nest {depth} levels deep, over the {}-level limit",
                limits::MAX_STORED_DEPTH
            )
        })
    };
    for effect in &applied.effects {
        match effect {
            Effect::Emit(event) => {
                let measured = limits::measure(event);
                if measured.bytes > limits::MAX_RECORD_BYTES {
                    return Some(format!(
                        "a {} event of {} bytes would exceed the {}-byte record limit",
                        event.body.name(),
                        measured.bytes,
                        limits::MAX_RECORD_BYTES
                    ));
                }
                if let Some(reason) =
                    too_deep(format!("a {} event", event.body.name()), measured.depth)
                {
                    return Some(reason);
                }
            }
            Effect::Dispatch(intent) => {
                let measured = limits::measure(intent);
                if measured.bytes > limits::MAX_RECORD_BYTES {
                    return Some(format!(
                        "the intent of step {} ({} bytes) would exceed the {}-byte record limit",
                        intent.step_id,
                        measured.bytes,
                        limits::MAX_RECORD_BYTES
                    ));
                }
                if let Some(reason) = too_deep(
                    format!("the intent of step {}", intent.step_id),
                    measured.depth,
                ) {
                    return Some(reason);
                }
            }
            Effect::WriteState => {
                let measured = applied
                    .state
                    .as_ref()
                    .map(|state| limits::measure_state(state, measured))
                    .unwrap_or_default();
                if measured.bytes > limits::MAX_STATE_BYTES {
                    return Some(format!(
                        "the run state would grow to {} bytes, over the {}-byte limit",
                        measured.bytes,
                        limits::MAX_STATE_BYTES
                    ));
                }
                if let Some(reason) = too_deep("the run state".to_owned(), measured.depth) {
                    return Some(reason);
                }
            }
            Effect::Command(command) => {
                let measured = limits::measure(command);
                if measured.bytes > limits::MAX_RECORD_BYTES {
                    return Some(format!(
                        "the {} for run {} ({} bytes) would exceed the {}-byte record limit",
                        command.body.kind(),
                        command.run_id,
                        measured.bytes,
                        limits::MAX_RECORD_BYTES
                    ));
                }
                if let Some(reason) = too_deep(
                    format!("the {} for run {}", command.body.kind(), command.run_id),
                    measured.depth,
                ) {
                    return Some(reason);
                }
            }
            Effect::Report(report) => {
                let measured = limits::measure(report);
                if measured.bytes > limits::MAX_RECORD_BYTES {
                    return Some(format!(
                        "the report to run {} ({} bytes) would exceed the {}-byte record limit",
                        report.run_id,
                        measured.bytes,
                        limits::MAX_RECORD_BYTES
                    ));
                }
            }
            Effect::ArmTimer { .. } | Effect::DisarmTimer { .. } | Effect::Forget { .. } => {}
        }
    }
    None
}

/// The answer to an input that would break a limit (see [`crate::limits`]).
fn over_limit(
    state: Option<&RunState>,
    input: &Input,
    graphs: &Graphs,
    seal: &dyn Seal,
    reason: String,
    measured: &mut MeasuredSteps,
) -> Applied {
    if let Input::StepReport(report) = input {
        if matches!(report.outcome, StepOutcome::Succeeded { .. }) {
            // The output cannot be kept: the step failed, and its node's policy decides.
            let failed = Input::StepReport(StepReport {
                spent: None,
                outcome: StepOutcome::Failed {
                    retryable: false,
                    code: "too_large".into(),
                    message: reason.clone(),
                    retry_after_ms: None,
                },
                ..report.clone()
            });
            let applied = apply_unchecked(state, &failed, graphs, seal);
            if breach(&applied, measured).is_none() {
                return applied;
            }
        }
    }
    let mut ctx = Ctx::new(state.cloned(), input, graphs, seal);
    match input {
        Input::Command(command) => {
            ctx.command_id = Some(command.command_id.clone());
            ctx.reject(command, "too_large", reason);
        }
        Input::StepReport(_) | Input::TimerFired { .. } => {
            if ctx.state.as_ref().is_some_and(|s| !s.status.is_terminal()) {
                ctx.set_status(RunStatus::Failed, Some(reason), None);
            }
        }
    }
    ctx.finish(state, Some("over a limit"))
}

/// Refuses a command before the fold reads it — its signature does not hold, or it is
/// unsigned where signatures are required (`code`: `unauthenticated`). Like a foreign
/// tenant's command, it is answered outside the run's history (seq 0, the command's own
/// tenant): a party that cannot prove who it is writes nothing to the run and learns
/// nothing of it. Pure, so replays answer the same.
pub fn refuse(command: &Command, code: &str, reason: String, graphs: &Graphs) -> Applied {
    let input = Input::Command(command.clone());
    let mut ctx = Ctx::new(None, &input, graphs, &Plain);
    ctx.command_id = Some(command.command_id.clone());
    // A child's start refused here (its signature) tells no parent: who sent it is not
    // known, so neither is the parent link it claims.
    ctx.answer_outside(command, code, reason);
    ctx.finish(None, Some("refused before the fold"))
}

fn apply_unchecked(
    state: Option<&RunState>,
    input: &Input,
    graphs: &Graphs,
    seal: &dyn Seal,
) -> Applied {
    let mut ctx = Ctx::new(state.cloned(), input, graphs, seal);
    let ignored = match input {
        Input::Command(command) => {
            ctx.command_id = Some(command.command_id.clone());
            command_input(&mut ctx, command);
            if ctx.state.is_none() {
                ctx.tell_parent_of_refusal(command);
            }
            None
        }
        Input::StepReport(report) => report::handle(&mut ctx, report).err(),
        Input::TimerFired { timer, .. } => timer::handle(&mut ctx, timer).err(),
    };
    ctx.finish(state, ignored)
}

fn command_input(ctx: &mut Ctx<'_>, command: &Command) {
    if let Some(run) = &ctx.state {
        if run.tenant != command.tenant {
            // Another tenant's command about this run id: checked before anything else (the
            // command-id memory included, so dedupe is per tenant), answered outside the
            // run's history (seq 0, like an answer about a run that does not exist), so it
            // writes nothing to this run and learns nothing of it — not its tenant, its
            // status or its answers. A start under a taken id is refused as unavailable.
            let (code, reason) = match &command.body {
                CommandBody::StartRun { .. } => (
                    "run_id_unavailable",
                    format!("run id {} cannot be used; choose another", command.run_id),
                ),
                _ => (
                    "unknown_run",
                    format!("run {} does not exist", command.run_id),
                ),
            };
            return ctx.answer_outside(command, code, reason);
        }
        if let Some(answer) = run.commands.get(&command.command_id).cloned() {
            // A duplicate: the same answer again, nothing applied twice.
            match answer {
                Answer::Accepted => ctx.emit(
                    EventBody::CommandAccepted {
                        command_id: command.command_id.clone(),
                        command: command.body.kind().into(),
                        duplicate: true,
                    },
                    None,
                ),
                Answer::Rejected { code, reason } => ctx.reject(command, &code, reason),
            }
            return;
        }
    }
    match &command.body {
        CommandBody::StartRun { .. } => start::handle(ctx, command),
        CommandBody::ForgetRun { .. } => forget::handle(ctx, command),
        body => {
            let Some(run) = &ctx.state else {
                return ctx.reject(
                    command,
                    "unknown_run",
                    format!("run {} does not exist", limits::shown_id(&command.run_id)),
                );
            };
            if run.status.is_terminal() {
                if let CommandBody::SignalRun { signal_id, .. } = body {
                    if run.has_signal(signal_id) {
                        // A sender's retry of a signal the run took before it ended: the
                        // same answer as while it ran, so "taken" is told from "never".
                        return signal::duplicate(ctx, command);
                    }
                }
                let reason = format!("run is {}", run.status.as_str());
                return ctx.reject(command, "bad_state", reason);
            }
            match body {
                CommandBody::ResumeRun { .. } => resume::handle(ctx, command),
                CommandBody::CancelRun { .. } => cancel::handle(ctx, command),
                CommandBody::ReconcileOperation { .. } => reconcile::handle(ctx, command),
                CommandBody::SignalRun { .. } => signal::handle(ctx, command),
                CommandBody::StartRun { .. } | CommandBody::ForgetRun { .. } => {
                    unreachable!("handled above")
                }
            }
        }
    }
}

/// The working set of one `apply`: the evolving state and what has been decided so far.
pub(crate) struct Ctx<'g> {
    pub state: Option<RunState>,
    pub graphs: &'g Graphs,
    /// How the run's payloads are written: event hashes are taken over that form.
    seal: &'g dyn Seal,
    pub at: i64,
    pub tenant: String,
    pub run_id: String,
    pub command_id: Option<String>,
    version: i64,
    events: Vec<Event>,
    /// The history's events as written under an active seal (see [`Applied`]).
    sealed_events: Vec<Event>,
    intents: Vec<Intent>,
    /// Commands for other runs: children's starts and cancels.
    commands: Vec<Command>,
    /// Reports to a parent's step (this child run ended).
    reports: Vec<StepReport>,
    /// A wait opened during this input and took every signal it wanted from those kept
    /// for it: `advance` plans again.
    pub(crate) wait_satisfied: bool,
    /// Child runs still to start in the plan being proposed: the budget left is shared
    /// among them ([`Ctx::start_child`]).
    pub(crate) children_to_start: u64,
    /// Agent-requested steps of that plan not dispatched yet: each will be a tool call,
    /// so a child's share leaves room for them.
    pub(crate) requests_to_dispatch: u64,
}

impl<'g> Ctx<'g> {
    fn new(state: Option<RunState>, input: &Input, graphs: &'g Graphs, seal: &'g dyn Seal) -> Self {
        let tenant = match (&state, input) {
            (Some(run), _) => run.tenant.clone(),
            (None, Input::Command(c)) => c.tenant.clone(),
            (None, Input::StepReport(r)) => r.tenant.clone(),
            (None, Input::TimerFired { .. }) => String::new(),
        };
        let version = state.as_ref().map_or(0, |s| s.version) + 1;
        Self {
            state,
            graphs,
            seal,
            at: input.at(),
            tenant,
            run_id: input.run_id().to_owned(),
            command_id: None,
            version,
            events: Vec::new(),
            sealed_events: Vec::new(),
            intents: Vec::new(),
            commands: Vec::new(),
            reports: Vec::new(),
            wait_satisfied: false,
            children_to_start: 0,
            requests_to_dispatch: 0,
        }
    }

    pub fn run(&self) -> &RunState {
        self.state
            .as_ref()
            .expect("a handler only asks for the run after checking it exists")
    }

    /// The graph version the run pinned.
    pub fn graph(&self) -> Option<&'g Graph> {
        let run = self.state.as_ref()?;
        self.graphs.get(&run.graph_id, Some(run.graph_version))
    }

    /// Appends an event to the history and folds it into the working state at once, so
    /// later decisions of the same input see it.
    /// Records `command`'s decision on its interrupt (`command` is a ResumeRun; anything
    /// else records nothing).
    pub(crate) fn decided(
        &mut self,
        command: &Command,
        is_final: bool,
        edited_args: Option<Value>,
    ) {
        let CommandBody::ResumeRun {
            interrupt_id,
            proposal_hash,
            approve,
            payload,
            comment,
            ..
        } = &command.body
        else {
            return;
        };
        self.emit(
            EventBody::InterruptDecided {
                interrupt_id: interrupt_id.clone(),
                proposal_hash: proposal_hash.clone(),
                approve: *approve,
                decided_by: command.principal.clone(),
                payload: payload.clone(),
                comment: comment.clone(),
                is_final,
                edited_args,
            },
            None,
        );
    }

    pub fn emit(&mut self, body: EventBody, operation_id: Option<String>) {
        let exists = self.state.is_some() || matches!(body, EventBody::RunStarted { .. });
        let (seq, prev_hash) = match &self.state {
            Some(run) => (run.last_event_seq + 1, run.last_hash.clone()),
            None if exists => (1, None),
            None => (0, None),
        };
        let mut event = Event {
            tenant: self.tenant.clone(),
            run_id: self.run_id.clone(),
            seq,
            state_version: if exists { self.version } else { 0 },
            at: self.at,
            command_id: self.command_id.clone(),
            operation_id,
            prev_hash,
            hash: None,
            body,
        };
        if exists {
            // Over the event as Kafka holds it, so the chain verifies without the key.
            if self.seal.active() {
                let mut sealed = event.sealed(self.seal);
                sealed.hash = Some(sealed.compute_hash());
                event.hash = sealed.hash.clone();
                self.sealed_events.push(sealed);
            } else {
                event.hash = Some(event.compute_hash());
            }
            self.state = evolve(self.state.take(), &event);
        }
        self.events.push(event);
    }

    pub fn accept(&mut self, command: &Command) {
        self.emit(
            EventBody::CommandAccepted {
                command_id: command.command_id.clone(),
                command: command.body.kind().into(),
                duplicate: false,
            },
            None,
        );
    }

    /// Rejects `command` with an answer that is not part of the run's history: seq 0,
    /// no state version, no hash, the command's own tenant; the state does not change.
    pub(crate) fn answer_outside(&mut self, command: &Command, code: &str, reason: String) {
        let reason = limits::clip(&reason, limits::MAX_REASON_BYTES).to_owned();
        self.events.push(Event {
            tenant: command.tenant.clone(),
            run_id: self.run_id.clone(),
            seq: 0,
            state_version: 0,
            at: self.at,
            command_id: Some(command.command_id.clone()),
            operation_id: None,
            prev_hash: None,
            hash: None,
            body: EventBody::CommandRejected {
                command_id: command.command_id.clone(),
                command: command.body.kind().into(),
                code: code.into(),
                reason,
            },
        });
    }

    /// Rejects `command` in the run's history. The reason is cut to
    /// [`limits::MAX_REASON_BYTES`]: the run keeps it (as the answer to a duplicate) and a
    /// rejection must never grow a run with what a client sent.
    pub fn reject(&mut self, command: &Command, code: &str, reason: String) {
        let reason = limits::clip(&reason, limits::MAX_REASON_BYTES).to_owned();
        self.emit(
            EventBody::CommandRejected {
                command_id: command.command_id.clone(),
                command: command.body.kind().into(),
                code: code.into(),
                reason,
            },
            None,
        );
    }

    pub fn set_status(&mut self, status: RunStatus, reason: Option<String>, output: Option<Value>) {
        let current = self.run().status;
        if current == status {
            return;
        }
        debug_assert!(
            current.can_become(status),
            "illegal transition {current:?} -> {status:?}"
        );
        if !current.can_become(status) {
            return;
        }
        // A finished run of a graph with a retention is forgotten that long after; a
        // child run with its parent.
        let forget_at = self
            .graph()
            .and_then(|g| g.retention)
            .filter(|_| status.is_terminal() && self.run().parent.is_none())
            .map(|retention| self.at.saturating_add(retention.0));
        self.emit(
            EventBody::RunStatusChanged {
                status,
                reason,
                output,
                forget_at,
            },
            None,
        );
        if status.is_terminal() {
            self.report_to_parent();
        }
        if status.is_terminal() {
            // Early decisions whose interrupt never came get their answer now.
            let waiting = self.run().buffered.clone();
            for decision in waiting {
                let current = self.command_id.replace(decision.command_id.clone());
                self.emit(
                    EventBody::CommandRejected {
                        command_id: decision.command_id,
                        command: "ResumeRun".into(),
                        code: "unknown_interrupt".into(),
                        reason: format!(
                            "the run ended before interrupt {} was registered",
                            limits::shown_id(&decision.interrupt_id)
                        ),
                    },
                    None,
                );
                self.command_id = current;
            }
        }
    }

    /// Either asks for approval (the node has `interrupt_before`) or dispatches attempt 1.
    pub fn propose(&mut self, node: &Node, step_id: String, args: Value, role: StepRole) {
        self.propose_edited(node, step_id, args, role, None)
    }

    /// [`Ctx::propose`], for arguments an approver edited from `edited_from`: the new
    /// interrupt shows the arguments it replaces and the difference.
    pub fn propose_edited(
        &mut self,
        node: &Node,
        step_id: String,
        args: Value,
        role: StepRole,
        edited_from: Option<&Value>,
    ) {
        if node.wait.is_some() {
            signal::open(self, node, step_id.clone(), &role);
            let done = self
                .run()
                .waits
                .get(&step_id)
                .is_some_and(|w| w.status == crate::state::WaitStatus::Done);
            self.wait_satisfied |= done;
            return;
        }
        match (&node.interrupt_before, &role) {
            (Some(approval), role) if !matches!(role, StepRole::Compensation { .. }) => {
                let proposal = serde_json::json!({
                    "node": node.id,
                    "step_id": step_id,
                    "tool": node.tool,
                    "args": args,
                });
                let proposal_hash = ids::proposal_hash(&proposal);
                let interrupt_id = ids::interrupt_id(&self.run_id, &step_id, &proposal_hash);
                let context = context::of(self.run(), node, &args, role, edited_from);
                self.emit(
                    EventBody::Interrupted {
                        interrupt_id: interrupt_id.clone(),
                        step_id,
                        node: node.id.clone(),
                        proposal,
                        proposal_hash,
                        reason: approval.reason.clone(),
                        required_role: approval.required_role.clone(),
                        approver_group: approval
                            .group
                            .as_ref()
                            .or(approval.approver_group.as_ref())
                            .map(|g| advance::group_name(self.run(), g)),
                        quorum: approval.quorum,
                        expires_at: Some(self.at + approval.timeout.0),
                        role: role.clone(),
                        context: Some(context),
                        members_only: approval.group.is_some(),
                    },
                    None,
                );
                resume::apply_buffered(self, &interrupt_id);
            }
            _ => self.dispatch(node, step_id, 1, args, role),
        }
    }

    /// Dispatches one attempt of a step: the event and the intent.
    pub fn dispatch(
        &mut self,
        node: &Node,
        step_id: String,
        attempt: u32,
        args: Value,
        role: StepRole,
    ) {
        self.dispatch_attempt(node, step_id, attempt, args, role, false)
    }

    /// [`Ctx::dispatch`]; with `lookup_only`, the attempt only asks the receiver what
    /// became of the operation (a `reconcilable` step of a run winding down).
    pub fn dispatch_attempt(
        &mut self,
        node: &Node,
        step_id: String,
        attempt: u32,
        args: Value,
        role: StepRole,
        lookup_only: bool,
    ) {
        let Some(graph) = self.graph() else { return };
        let operation_id =
            ids::operation_id(&self.tenant, &self.run_id, &step_id, &node.tool, &args);
        // A guarded step always has a timer (rules 2): its pre-call commit means a lost
        // attempt is never redelivered, so only the timer notices it.
        let guarded = matches!(
            node.side_effect,
            crate::SideEffect::Unsafe | crate::SideEffect::Reconcilable
        );
        let timeout = node.timeout.or_else(|| {
            (guarded && self.run().rules >= 2).then_some(crate::budget::GUARDED_TIMEOUT)
        });
        let timeout_at = timeout.map(|t| self.at + t.0);
        if let Some(child) = &node.run {
            self.start_child(child, &step_id, &operation_id, attempt, &args);
        }
        if attempt == 1 && matches!(role, StepRole::Requested { .. }) {
            self.requests_to_dispatch = self.requests_to_dispatch.saturating_sub(1);
        }
        if node.run.is_none() {
            self.intents.push(Intent {
                operation_id: operation_id.clone(),
                attempt,
                tenant: self.tenant.clone(),
                run_id: self.run_id.clone(),
                step_id: step_id.clone(),
                node: node.id.clone(),
                graph_id: graph.pinned_id(),
                graph_version: graph.version,
                tool: node.tool.clone(),
                queue: node.queue.clone(),
                side_effect: node.side_effect,
                args: args.clone(),
                config: graph.step_config(node),
                timeout_ms: node.timeout.map(|t| t.0),
                issued_at: self.at,
                lookup_only,
            });
        }
        self.emit(
            EventBody::StepDispatched {
                step_id,
                node: node.id.clone(),
                attempt,
                tool: node.tool.clone(),
                queue: node.queue.clone(),
                side_effect: node.side_effect,
                args,
                role,
                timeout_at,
                lookup_only,
            },
            Some(operation_id),
        );
    }

    fn finish(self, before: Option<&RunState>, ignored: Option<&'static str>) -> Applied {
        let forgotten = self
            .events
            .iter()
            .any(|e| matches!(e.body, EventBody::RunForgotten { .. }));
        let mut effects: Vec<Effect> = self.events.into_iter().map(Effect::Emit).collect();
        effects.extend(self.intents.into_iter().map(Effect::Dispatch));
        effects.extend(self.commands.into_iter().map(Effect::Command));
        effects.extend(self.reports.into_iter().map(Effect::Report));
        let changed = self.state.as_ref() != before;
        if let (Some(after), true) = (&self.state, changed) {
            let old = before.map(|b| &b.timers);
            for (key, due) in &after.timers {
                if old.and_then(|t| t.get(key)) != Some(due) {
                    if let Some(timer) = TimerKey::decode(key) {
                        effects.push(Effect::ArmTimer {
                            run_id: after.run_id.clone(),
                            timer,
                            due_at: *due,
                        });
                    }
                }
            }
            for key in old.into_iter().flat_map(|t| t.keys()) {
                if !after.timers.contains_key(key) {
                    if let Some(timer) = TimerKey::decode(key) {
                        effects.push(Effect::DisarmTimer {
                            run_id: after.run_id.clone(),
                            timer,
                        });
                    }
                }
            }
            effects.push(Effect::WriteState);
        }
        if let (Some(before), true) = (before, forgotten) {
            let mut operations: Vec<String> = before
                .steps
                .values()
                .map(|s| s.operation_id.clone())
                .collect();
            operations.sort();
            operations.dedup();
            effects.push(Effect::Forget {
                run_id: before.run_id.clone(),
                operations,
            });
        }
        let ignored = if effects.is_empty() {
            ignored.or(Some("no change"))
        } else {
            None
        };
        Applied {
            effects,
            state: self.state,
            ignored,
            sealed_events: self.sealed_events,
        }
    }
}
