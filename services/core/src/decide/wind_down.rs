//! Winding a run down after a failure or a cancel: wait for the outcomes in flight,
//! compensate completed steps latest first, then end.

use super::{template::render, Ctx};
use crate::{
    event::StepRole,
    graph::Graph,
    state::{RunState, Step, StepStatus},
    status::RunStatus,
};

/// A forward step failed for good: wind down (compensations) or fail at once.
pub(crate) fn begin_failure(ctx: &mut Ctx<'_>, reason: String) {
    let Some(graph) = ctx.graph() else { return };
    if needs_wind_down(ctx.run(), graph) {
        ctx.cancel_children(&reason);
        ctx.set_status(RunStatus::Compensating, Some(reason), None);
        wind_down(ctx, graph);
    } else {
        ctx.set_status(RunStatus::Failed, Some(reason), None);
    }
}

fn needs_wind_down(run: &RunState, graph: &Graph) -> bool {
    run.steps
        .values()
        .any(|s| s.status.is_in_flight() || s.status == StepStatus::NeedsOperator)
        || next_compensation(run, graph).is_some()
}

/// The next completed step to compensate (latest first), and its compensation step if one
/// was already dispatched.
fn next_compensation<'r>(run: &'r RunState, graph: &Graph) -> Option<(&'r Step, Option<&'r Step>)> {
    for step_id in run.completed.iter().rev() {
        let Some(step) = run.steps.get(step_id) else {
            continue;
        };
        if matches!(step.role, StepRole::Compensation { .. }) {
            continue;
        }
        let Some(node) = graph.node(&step.node) else {
            continue;
        };
        if node.compensate_with.is_none() {
            continue;
        }
        let role = StepRole::Compensation {
            of: step.step_id.clone(),
        };
        let compensation = run.steps.values().find(|s| s.role == role);
        if compensation.is_some_and(|c| c.status == StepStatus::Succeeded) {
            continue;
        }
        return Some((step, compensation.map(|c| &**c)));
    }
    None
}

/// Cancelling or failing: wait for in-flight outcomes, then compensate completed steps one
/// at a time in reverse order of completion, then end.
///
/// While it waits, the run's status says on whom: `needs_reconciliation` while any
/// outcome is an operator's to record (a step `NeedsOperator`, forward or compensation),
/// otherwise `cancelling` or `compensating`. A run that is winding down is never left
/// waiting on nobody: every wait is an attempt in flight (its result or its timeout will
/// come), a retry's timer, or an operator.
pub(super) fn wind_down(ctx: &mut Ctx<'_>, graph: &Graph) {
    let run = ctx.run();
    let Some(ending) = run.ending.clone() else {
        return;
    };
    let waiting = if run
        .steps
        .values()
        .any(|s| s.status == StepStatus::NeedsOperator)
    {
        RunStatus::NeedsReconciliation
    } else if ending.cancelled {
        RunStatus::Cancelling
    } else {
        RunStatus::Compensating
    };
    let forward_busy = run.steps.values().any(|s| {
        !matches!(s.role, StepRole::Compensation { .. })
            && (s.status.is_in_flight() || s.status == StepStatus::NeedsOperator)
    });
    if forward_busy {
        // in-flight outcomes are recorded first: cancel is not undo
        return ctx.set_status(waiting, None, None);
    }
    let compensated = run
        .steps
        .values()
        .filter(|s| {
            matches!(s.role, StepRole::Compensation { .. }) && s.status == StepStatus::Succeeded
        })
        .count();
    match next_compensation(run, graph) {
        Some((step, None)) => {
            let Some(node) = graph.node(&step.node) else {
                return;
            };
            let Some(target) = node.compensate_with.as_ref().and_then(|c| graph.node(c)) else {
                return;
            };
            let args = render(run, Some(step), None, &target.args);
            let step_id = run.next_step_id(&target.id);
            let role = StepRole::Compensation {
                of: step.step_id.clone(),
            };
            ctx.set_status(waiting, None, None);
            ctx.propose(target, step_id, args, role);
        }
        Some((step, Some(compensation))) => {
            if compensation.status == StepStatus::Failed
                || compensation.status == StepStatus::Abandoned
            {
                let reason = format!(
                    "{}; compensation of {} failed: {} (compensated {compensated} steps before it)",
                    ending.reason,
                    step.step_id,
                    compensation.error.as_deref().unwrap_or("no reason given"),
                );
                end(ctx, ending.cancelled, reason);
            } else {
                // in flight, retrying, or awaiting an operator
                ctx.set_status(waiting, None, None);
            }
        }
        None => {
            let reason = if compensated > 0 {
                format!(
                    "{}; compensation completed ({compensated} steps)",
                    ending.reason
                )
            } else {
                ending.reason.clone()
            };
            end(ctx, ending.cancelled, reason);
        }
    }
}

fn end(ctx: &mut Ctx<'_>, cancelled: bool, reason: String) {
    let status = if cancelled {
        RunStatus::Cancelled
    } else {
        RunStatus::Failed
    };
    ctx.set_status(status, Some(reason), None);
}
