//! Forking a run from one of its checkpoints (time travel): a `StartRun` carrying the
//! source's state at a version starts a new run that keeps what already happened.
//!
//! What the new run carries over, decided here once. Side-effect classes and gates are
//! the **graph's** (the fork runs the source's graph version), never the carried steps'
//! own fields: a carried state says what happened, the graph says what may happen next.
//!
//! - settled steps (succeeded, failed, abandoned) as they were, outputs and operation ids
//!   included: a completed side effect is never run again;
//! - unsettled steps of ungated `pure` and `idempotent` nodes are dispatched again at once
//!   as new operations (the new run id gives them new operation ids), a graph node's
//!   arguments rendered again from the (possibly patched) input;
//! - unsettled steps of gated `pure` and `idempotent` nodes are **proposed again**: a
//!   fresh interrupt in the fork, with the arguments rendered from the fork's input. An
//!   approval given in the source approved the source's arguments, seen by the source's
//!   approver; the fork's may differ (a patched input drops the approver's edits and
//!   payload), so nothing gated runs in a fork without an approval given in the fork;
//! - unsettled `keyed`, `reconcilable` and `unsafe` steps (gated or not), and child runs
//!   in flight, wait for an operator (`NeedsOperator`, keeping the source's operation id
//!   to look it up): the source may have performed them after the checkpoint (a child its
//!   own side effects), and under a new operation id the receiver could not recognise a
//!   repeat;
//! - interrupts whose outcome is history (rejected, expired, superseded, or approved with
//!   their step settled) as they were; an open interrupt, or an approval whose call had
//!   not settled (its precheck or the call itself still to come), is not carried — its
//!   step is proposed again (above). A precheck belongs to the approval it checks: one
//!   of an approval not carried is dropped with it, so a carried precheck can never
//!   release a call. An open budget interrupt is dropped: the fork's own budget check
//!   raises it again if it must.
//!
//! The source state the fork starts from is the source's own: the reducer re-derives it
//! from the source's history carried in the command, held to the head of the source's
//! hash chain that the reducer itself holds ([`verified_source`]).

use serde_json::{json, Value};

use crate::{
    event::StepRole,
    evolve::evolve,
    graph::{Graph, Node, SideEffect},
    input::ForkSource,
    seal::Seal,
    state::{InterruptStatus, RunState, Step, StepStatus},
    TimerKey,
};

/// What a fork takes over from its source, and what it does at once.
pub(crate) struct Plan {
    /// The `forked_from` of the new run's `RunStarted`.
    pub forked_from: Value,
    /// Unsettled steps of ungated pure/idempotent nodes: dispatched again.
    pub redispatch: Vec<Step>,
    /// Gated steps to propose again (a fresh approval in the fork).
    pub propose: Vec<Repropose>,
}

/// A gated step the fork proposes again.
pub(crate) struct Repropose {
    pub node: String,
    pub step_id: String,
    pub role: StepRole,
    /// The carried arguments, for a step that is not a graph node's own (a requested
    /// call, a substitute); a node's own are rendered again from the fork's input.
    pub args: Value,
}

fn gated(node: &Node, role: &StepRole) -> bool {
    node.interrupt_before.is_some() && !matches!(role, StepRole::Compensation { .. })
}

fn repeatable(class: SideEffect) -> bool {
    matches!(class, SideEffect::Pure | SideEffect::Idempotent)
}

/// Decides what a fork of `source` (at its version) on `graph` carries and does.
pub(crate) fn plan(source: &RunState, graph: &Graph) -> Plan {
    let settled = |step_id: &str| {
        source
            .steps
            .get(step_id)
            .is_some_and(|s| s.status.is_settled())
    };
    let mut steps = serde_json::Map::new();
    let mut redispatch = Vec::new();
    let mut propose: Vec<Repropose> = Vec::new();
    let mut interrupts = serde_json::Map::new();
    // The latest proposal for a step (an edit supersedes the earlier one).
    let proposed_args = |step_id: &str| {
        source
            .interrupts
            .values()
            .filter(|i| i.step_id == step_id && i.status != InterruptStatus::Superseded)
            .find_map(|i| i.proposal.get("args").cloned())
    };
    let mut again = |node: &str, step_id: &str, role: &StepRole, args: Value| {
        if !propose.iter().any(|p| p.step_id == step_id) {
            propose.push(Repropose {
                node: node.to_owned(),
                step_id: step_id.to_owned(),
                role: role.clone(),
                args,
            });
        }
    };
    for interrupt in source.interrupts.values() {
        let history = match interrupt.status {
            InterruptStatus::Rejected | InterruptStatus::Expired | InterruptStatus::Superseded => {
                true
            }
            InterruptStatus::Approved => settled(&interrupt.step_id),
            InterruptStatus::Open => false,
        };
        if history {
            interrupts.insert(interrupt.interrupt_id.clone(), json!(interrupt));
            continue;
        }
        if interrupt.node == crate::budget::BUDGET_NODE
            || source.steps.contains_key(&interrupt.step_id)
        {
            // A budget gate is raised again by the fork's own check; a step that exists is
            // decided below, with the step.
            continue;
        }
        let args = interrupt
            .proposal
            .get("args")
            .cloned()
            .unwrap_or(Value::Null);
        again(&interrupt.node, &interrupt.step_id, &interrupt.role, args);
    }
    for step in source.steps.values() {
        if let StepRole::Precheck { of } = &step.role {
            // A precheck checks one approval; that approval is carried only with its
            // settled call.
            if step.status.is_settled() && settled(of) {
                steps.insert(step.step_id.clone(), json!(step));
            }
            continue;
        }
        if step.status.is_settled() {
            steps.insert(step.step_id.clone(), json!(step));
            continue;
        }
        let node = graph.node(&step.node);
        match node {
            // A child run in flight may have acted (its own keyed or unsafe steps): a
            // fresh child would act again, so it waits for an operator like a keyed step.
            Some(node) if repeatable(node.side_effect) && node.run.is_none() => {
                if gated(node, &step.role) {
                    let args = proposed_args(&step.step_id).unwrap_or_else(|| step.args.clone());
                    again(&node.id, &step.step_id, &step.role, args);
                } else {
                    let mut step = Step::clone(step);
                    step.side_effect = node.side_effect;
                    redispatch.push(step);
                }
            }
            _ => {
                let mut waiting = Step::clone(step);
                if let Some(node) = node {
                    waiting.side_effect = node.side_effect;
                }
                waiting.status = StepStatus::NeedsOperator;
                waiting.error = Some(format!(
                    "forked from {} at version {} while this step was {:?}: its outcome there decides",
                    source.run_id, source.version, step.status
                ));
                steps.insert(step.step_id.clone(), json!(waiting));
            }
        }
    }
    let completed: Vec<&String> = source
        .completed
        .iter()
        .filter(|id| steps.contains_key(*id))
        .collect();
    let forked_from = json!({
        "run_id": source.run_id,
        "version": source.version,
        "head": source.last_hash,
        "steps": steps,
        "completed": completed,
        "interrupts": interrupts,
        "redispatch": redispatch.iter().map(|s| &s.step_id).collect::<Vec<_>>(),
        "proposed": propose.iter().map(|p| &p.step_id).collect::<Vec<_>>(),
    });
    Plan {
        forked_from,
        redispatch,
        propose,
    }
}

/// The source's state at `fork.version`, as the source's own history makes it — never
/// as the command claims it. `head` is the source run's current state as the reducer
/// holds it (its own fold of the source's inputs), `seal` the source's seal (hashes are
/// over the sealed events, see `sortie_core::seal`).
///
/// - Without a carried history, only the source's current version can be forked: that
///   state is `head` itself.
/// - With one, the history must be the source's whole history as the head knows it:
///   seq 1 to the head's last, each event's hash its own content's (sealed), each
///   `prev_hash` the previous event's, and the last hash the head's. The hash chain
///   then proves every event is the one the reducer wrote; folding them up to the
///   version gives the state at that version.
///
/// Pure: the same head, command and seal always give the same answer.
pub fn verified_source(
    head: &RunState,
    fork: &ForkSource,
    seal: &dyn Seal,
) -> Result<RunState, String> {
    let name = crate::limits::shown_id(&fork.run_id);
    if head.forgotten.is_some() {
        return Err(format!(
            "run {name} was forgotten: its payloads are gone, so it cannot be forked"
        ));
    }
    let Some(history) = &fork.history else {
        return if fork.version == head.version {
            Ok(head.clone())
        } else {
            Err(format!(
                "a fork of run {name} at version {} (it is at {}) must carry the run's history",
                fork.version, head.version
            ))
        };
    };
    if history.len() as i64 != head.last_event_seq {
        return Err(format!(
            "the carried history of run {name} has {} events, the run has {}: fork again from its latest history",
            history.len(),
            head.last_event_seq
        ));
    }
    let mut prev: Option<String> = None;
    for (i, event) in history.iter().enumerate() {
        let seq = i as i64 + 1;
        if event.seq != seq || event.run_id != head.run_id || event.tenant != head.tenant {
            return Err(format!(
                "event {seq} of the carried history is not event {seq} of run {name}"
            ));
        }
        let mut hash = event.sealed(seal).compute_hash();
        if event.hash.as_deref() != Some(hash.as_str()) && seal.active() {
            // Written before free texts were sealed: its hash is over plain texts.
            hash = event.sealed_before_texts(seal).compute_hash();
        }
        if event.prev_hash != prev || event.hash.as_deref() != Some(hash.as_str()) {
            return Err(format!(
                "event {seq} of the carried history of run {name} does not hash to its chain"
            ));
        }
        prev = Some(hash);
    }
    if prev != head.last_hash {
        return Err(format!(
            "the carried history of run {name} does not end at the run's chain head"
        ));
    }
    let state = history
        .iter()
        .filter(|e| e.state_version <= fork.version)
        .fold(None, evolve);
    match state {
        Some(state) if state.version == fork.version => Ok(state),
        _ => Err(format!("run {name} has no version {}", fork.version)),
    }
}

/// Applies a `forked_from` to a new run's state (in `evolve`).
pub(crate) fn carry(state: &mut RunState, fork: &Value) {
    if let Some(steps) = fork
        .get("steps")
        .and_then(|s| serde_json::from_value(s.clone()).ok())
    {
        state.steps = steps;
    }
    if let Some(completed) = fork
        .get("completed")
        .and_then(|s| serde_json::from_value(s.clone()).ok())
    {
        state.completed = completed;
    }
    if let Some(interrupts) = fork
        .get("interrupts")
        .and_then(|s| serde_json::from_value(s.clone()).ok())
    {
        state.interrupts = interrupts;
    }
    for interrupt in state.interrupts.values() {
        // Histories written before forks stopped carrying open interrupts.
        if let (InterruptStatus::Open, Some(due)) = (interrupt.status, interrupt.expires_at) {
            state.timers.insert(
                TimerKey::ApprovalExpiry {
                    interrupt_id: interrupt.interrupt_id.clone(),
                    round: interrupt.round,
                }
                .encode(),
                due,
            );
        }
    }
    state.forked_from = Some(json!({"run_id": fork["run_id"], "version": fork["version"]}));
}
