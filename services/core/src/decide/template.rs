//! A node's argument template rendered against a run, and the human input of a decided
//! approval filled into the arguments of the call it approved.

use serde_json::Value;

use crate::{
    blob::project,
    graph::Node,
    json::{self as j, Reference},
    state::{Interrupt, RunState, Step, StepStatus, WaitStatus},
};

use super::agent_loop::iteration;

/// Fills a node's argument template from the run input, earlier outputs, (for a
/// compensation) the step being compensated, and the human input of a decided interrupt.
/// Without an interrupt, `$interrupt.payload` references stay as they are: a gated node's
/// proposal shows them, and the approval fills them in ([`fill_interrupt`]).
///
/// A path that leads into a blob reference (a large input or output stored by reference)
/// renders as that reference narrowed by the rest of the path ([`project`]): the fold
/// never reads a blob; the executor resolves the reference before the handler runs.
pub(super) fn render(
    run: &RunState,
    compensated: Option<&Step>,
    interrupt: Option<&Interrupt>,
    template: &Value,
) -> Value {
    let latest_output = |node: &str, part: &str| -> Option<Value> {
        if let Some(wait) = run.waits.values().find(|w| {
            w.node == node
                && matches!(w.status, WaitStatus::Done | WaitStatus::Expired)
                && !run.is_turn_wait(w)
        }) {
            // A wait has no args; its output is what it took (`timed_out` when its
            // deadline passed, its goto substitute's output being the substitute's own).
            return (part == "output").then(|| wait.output());
        }
        let step = run
            .steps
            .values()
            .filter(|s| s.node == node && s.status == StepStatus::Succeeded)
            .max_by_key(|s| iteration(&s.step_id))?;
        match part {
            "args" => Some(step.args.clone()),
            // A conversation's output once it ended: its last answer, `turns`, `ended_by`.
            _ => match crate::converse::ended_by(run, step) {
                Some(by) => Some(crate::converse::ended_output(step, by)),
                None => step.output.clone(),
            },
        }
    };
    j::render(template, &|reference| match reference {
        Reference::Input(path) => project(&run.input, path),
        Reference::Step { node, part, path } => {
            latest_output(node, part).and_then(|v| project(&v, path))
        }
        Reference::Compensated { part, path } => {
            let step = compensated?;
            let whole = if *part == "args" {
                Some(step.args.clone())
            } else {
                step.output.clone()
            };
            whole.and_then(|v| project(&v, path))
        }
        Reference::Interrupt(path) => match interrupt {
            Some(i) => i.payload.as_ref().and_then(|p| project(p, path)),
            None if path.is_empty() => Some(Value::String("$interrupt.payload".into())),
            None => Some(Value::String(format!("$interrupt.payload.{path}"))),
        },
    })
}

/// An approver group as a gate names it: a name, or a template reference to the run's
/// input (`$input.manager`: each hire has another manager), rendered against `run`. A
/// reference that renders to no string stays as written, which no principal's group
/// matches: a members-only gate then waits for its deadline rather than open to anyone.
pub(super) fn group_name(run: &RunState, group: &str) -> String {
    if !group.starts_with('$') {
        return group.to_owned();
    }
    match render(run, None, None, &Value::String(group.to_owned())) {
        Value::String(name) if !name.is_empty() => name,
        _ => group.to_owned(),
    }
}

/// The arguments an approved call runs with: `args` (the proposal's, or the approver's
/// edit) where every position the node's template holds an `$interrupt.payload` reference,
/// and the arguments still hold that reference, gets the decision's human input.
fn fill_interrupt(template: &Value, args: &Value, payload: Option<&Value>) -> Value {
    match (template, args) {
        (Value::String(t), Value::String(a)) if t == a => match j::reference(t) {
            Some(Ok(Reference::Interrupt(path))) => payload
                .and_then(|p| project(p, path))
                .unwrap_or(Value::Null),
            _ => args.clone(),
        },
        (Value::Object(t), Value::Object(a)) => Value::Object(
            a.iter()
                .map(|(k, v)| {
                    let filled = match t.get(k) {
                        Some(tv) => fill_interrupt(tv, v, payload),
                        None => v.clone(),
                    };
                    (k.clone(), filled)
                })
                .collect(),
        ),
        (Value::Array(t), Value::Array(a)) => Value::Array(
            a.iter()
                .enumerate()
                .map(|(i, v)| match t.get(i) {
                    Some(tv) => fill_interrupt(tv, v, payload),
                    None => v.clone(),
                })
                .collect(),
        ),
        _ => args.clone(),
    }
}

/// What the approved call of `interrupt` runs with: the proposal's arguments (or the
/// approver's edit) with the decision's human input filled in where the node's template
/// asks for it. An audit holds a dispatch to it (`sortie-why`).
pub fn approved_args(node: &Node, interrupt: &Interrupt) -> Value {
    let args = interrupt
        .edited_args
        .clone()
        .or_else(|| interrupt.proposal.get("args").cloned())
        .unwrap_or_default();
    fill_interrupt(&node.args, &args, interrupt.payload.as_ref())
}
