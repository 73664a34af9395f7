//! Forking a run from one of its checkpoints (time travel): a `StartRun` carrying the
//! source's state at a version starts a new run that keeps what already happened.
//!
//! What the new run carries over, decided here once:
//! - settled steps (succeeded, failed, abandoned) as they were, outputs and operation ids
//!   included: a completed side effect is never run again;
//! - unsettled `pure` and `idempotent` steps are dispatched again at once as new
//!   operations (the new run id gives them new operation ids), a graph node's arguments
//!   rendered again from the (possibly patched) input;
//! - unsettled `keyed`, `reconcilable` and `unsafe` steps wait for an operator
//!   (`NeedsOperator`, keeping the source's operation id to look it up): the source may
//!   have performed them after the checkpoint, and under a new operation id the receiver
//!   could not recognise a repeat;
//! - interrupts as they were (an open one stays open, its expiry re-armed); the decisions
//!   already given count.

use serde_json::{json, Value};

use crate::{
    graph::SideEffect,
    state::{InterruptStatus, RunState, Step, StepStatus},
    TimerKey,
};

/// The `forked_from` of the new run's `RunStarted`, from the source state.
pub(crate) fn plan(source: &RunState) -> Value {
    let mut steps = serde_json::Map::new();
    let mut redispatch = Vec::new();
    for step in source.steps.values() {
        if step.status.is_settled() {
            steps.insert(step.step_id.clone(), json!(step));
        } else if matches!(step.side_effect, SideEffect::Pure | SideEffect::Idempotent) {
            redispatch.push(step.step_id.clone());
        } else {
            let mut waiting = step.clone();
            waiting.status = StepStatus::NeedsOperator;
            waiting.error = Some(format!(
                "forked from {} at version {} while this step was {:?}: its outcome there decides",
                source.run_id, source.version, step.status
            ));
            steps.insert(step.step_id.clone(), json!(waiting));
        }
    }
    let completed: Vec<&String> = source
        .completed
        .iter()
        .filter(|id| steps.contains_key(*id))
        .collect();
    json!({
        "run_id": source.run_id,
        "version": source.version,
        "steps": steps,
        "completed": completed,
        "interrupts": source.interrupts,
        "redispatch": redispatch,
    })
}

/// The unsettled pure/idempotent steps of the source, to dispatch again.
pub(crate) fn redispatch(source: &RunState) -> Vec<Step> {
    source
        .steps
        .values()
        .filter(|s| {
            !s.status.is_settled()
                && matches!(s.side_effect, SideEffect::Pure | SideEffect::Idempotent)
        })
        .cloned()
        .collect()
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
