//! The precheck of an approved call: where it stands, and the approved calls it lets run.

use serde_json::Value;

use super::{template::approved_args, Ctx};
use crate::{
    event::StepRole,
    graph::{Graph, Node},
    state::{Interrupt, InterruptStatus, RunState, StepStatus},
};

/// Where the precheck of an approved interrupt stands.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Precheck {
    /// No precheck, or it is still running.
    Pending,
    /// It answered `ok: true`: the approved call may run.
    Passed,
    /// It failed or did not answer `ok: true`: the call never runs; `on_reject` applies.
    Refused(String),
}

pub(super) fn precheck(run: &RunState, node: &Node, interrupt: &Interrupt) -> Precheck {
    if interrupt.status != InterruptStatus::Approved || node.precheck.is_none() {
        return Precheck::Pending;
    }
    let role = StepRole::Precheck {
        of: interrupt.step_id.clone(),
    };
    let Some(step) = run.steps.values().find(|s| s.role == role) else {
        return Precheck::Pending;
    };
    match step.status {
        StepStatus::Succeeded => {
            let output = step.output.clone().unwrap_or(Value::Null);
            if output.get("ok") == Some(&Value::Bool(true)) {
                Precheck::Passed
            } else {
                let why = output
                    .get("reason")
                    .and_then(Value::as_str)
                    .map(|r| format!(": {r}"))
                    .unwrap_or_default();
                Precheck::Refused(format!(
                    "precheck {} refused step {} (ok is not true){why}",
                    step.step_id, interrupt.step_id
                ))
            }
        }
        StepStatus::Failed | StepStatus::Abandoned => Precheck::Refused(format!(
            "precheck {} of step {} failed: {}",
            step.step_id,
            interrupt.step_id,
            step.error.as_deref().unwrap_or("no reason given")
        )),
        _ => Precheck::Pending,
    }
}

/// Approved calls whose precheck passed and that have not run yet: dispatch them.
pub(super) fn continue_after_prechecks(ctx: &mut Ctx<'_>, graph: &Graph) {
    let run = ctx.run();
    let ready: Vec<(&Node, Interrupt)> = run
        .interrupts
        .values()
        .filter(|i| !run.steps.contains_key(&i.step_id))
        .filter_map(|i| {
            let node = graph.node(&i.node)?;
            (precheck(run, node, i) == Precheck::Passed).then(|| (node, i.clone()))
        })
        .collect();
    for (node, interrupt) in ready {
        let args = approved_args(node, &interrupt);
        ctx.dispatch(
            node,
            interrupt.step_id.clone(),
            1,
            args,
            interrupt.role.clone(),
        );
    }
}
