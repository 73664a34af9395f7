//! Parent and child runs ([ADR 0028]): the chain follows a run's family both ways.
//!
//! - **child**: a parent's `$run` operation started one child run per attempt, each id
//!   derived from the parent's tenant, run, operation id and attempt
//!   ([`sortie_core::child::child_run_id`]); the link names them, so a reader follows
//!   the chain downward (`sortie run get <child>`), and checks that the graph's node is
//!   one that starts a child.
//! - **parent**: any operation of a child run happened because the parent's step started
//!   the child. The link names the parent's run, step, operation and attempt (the
//!   child's `RunStarted.parent`) and checks what can be checked: that the child's id is
//!   the one the link derives, that the child was started by its parent (`run:<parent>`),
//!   that the start is a command on `sortie.commands` saying so and signed by a key of
//!   the keyring (the reducer's `--signing-key`), and, given the parent's history
//!   ([`crate::Chain::check_parent`]), that the parent dispatched that operation at that
//!   attempt as a child run (tool `$run`). The parent's own chain is the parent's
//!   operation's: the link prints the command that follows it upward.
//!
//! [ADR 0028]: ../../../docs/adr/0028-a-child-run-is-a-step-whose-result-crosses-partitions.md

use serde_json::{json, Value};
use sortie_core::child::{child_run_id, ParentLink, CHILD_TOOL};
use sortie_core::{Event, EventBody, Graph};
use sortie_wire::records as w;
use sortie_wire::signing::Keyring;

use crate::{link, signed_command, Commands, Expected, Link, Signature};

/// The command that follows a chain upward, to the operation that started a child.
pub fn follow_parent(parent: &ParentLink) -> String {
    format!(
        "sortie audit why {} --run {}",
        parent.operation_id, parent.run_id
    )
}

/// The command that shows a child run (its timeline, its operations).
pub fn follow_child(child_run: &str) -> String {
    format!("sortie run get {child_run}")
}

/// What a `$run` operation is about: the effect's step, as dispatched.
pub(crate) struct Started<'a> {
    pub(crate) tenant: &'a str,
    pub(crate) run_id: &'a str,
    pub(crate) operation_id: &'a str,
    pub(crate) node: &'a str,
    pub(crate) attempts: Vec<u32>,
}

/// The `child` link of a `$run` operation: the child run each attempt started.
pub(crate) fn child_link(started: &Started<'_>, graph: Option<&Graph>, graph_key: &str) -> Link {
    let runs: Vec<Value> = started
        .attempts
        .iter()
        .map(|attempt| {
            let run_id = child_run_id(
                started.tenant,
                started.run_id,
                started.operation_id,
                *attempt,
            );
            json!({"attempt": attempt, "run_id": run_id, "follow": follow_child(&run_id)})
        })
        .collect();
    let node = started.node;
    let (mut problems, mut unchecked) = (Vec::new(), Vec::new());
    let run = match graph.map(|g| g.node(node)) {
        None => {
            unchecked.push(format!(
                "graph {graph_key} is not at hand: whether node {node} starts a child run is not checked"
            ));
            None
        }
        Some(None) => {
            problems.push(format!("graph {graph_key} has no node {node}"));
            None
        }
        Some(Some(n)) if n.run.is_none() => {
            problems.push(format!(
                "dispatched as a child run (tool {CHILD_TOOL}), but node {node} of {graph_key} starts none"
            ));
            None
        }
        Some(Some(n)) => n.run.as_ref(),
    };
    link(
        "child",
        json!({
            "graph": run.map(|r| &r.graph),
            "version": run.and_then(|r| r.version),
            "runs": runs,
        }),
        problems,
        unchecked,
    )
}

/// What the child's own history and the commands topic prove of its parent link; the
/// parent's history completes it ([`parent_link`]).
#[derive(Debug, Clone)]
pub(crate) struct ParentCheck {
    pub(crate) parent: ParentLink,
    tenant: String,
    facts: Value,
    problems: Vec<String>,
    unchecked: Vec<String>,
}

/// The parent link of the run whose history this is, checked as far as the run's own
/// history and `sortie.commands` go; `None` for a run that is no child.
pub(crate) fn parent_check(
    history: &[Event],
    keyring: Option<&Keyring>,
    commands: &mut dyn Commands,
) -> Option<ParentCheck> {
    let (start, parent, started_by) = history.iter().find_map(|e| match &e.body {
        EventBody::RunStarted {
            parent: Some(parent),
            started_by,
            ..
        } => Some((e, parent, started_by)),
        _ => None,
    })?;
    let (tenant, run_id) = (start.tenant.as_str(), start.run_id.as_str());
    let (mut problems, mut unchecked) = (Vec::new(), Vec::new());
    let derived = parent.child_id(tenant);
    if derived != run_id {
        problems.push(format!(
            "run {run_id} is not the child run its parent link derives ({derived}): no parent step started it"
        ));
    }
    let principal = sortie_core::child::parent_principal(&parent.run_id);
    if *started_by != principal {
        problems.push(format!(
            "run {run_id} was started by {started_by}, not by its parent ({principal})"
        ));
    }
    // The start on sortie.commands: a StartRun carrying this very link, issued as the
    // parent, signed by a key of the keyring (the reducer's).
    let command_id = start.command_id.clone().unwrap_or_default();
    let says = |body: &w::CommandBody| match body {
        w::CommandBody::StartRun(start) => start
            .parent
            .as_deref()
            .and_then(|text| serde_json::from_str::<ParentLink>(text).ok())
            .is_some_and(|link| link == *parent),
        _ => false,
    };
    let (signature, record, _) = signed_command(
        commands,
        keyring,
        run_id,
        &command_id,
        start.at,
        Expected {
            tenant,
            principal: started_by,
            noun: "start",
            verb: "started",
            says: &says,
        },
    );
    match &signature {
        Signature::Verified(_) => {}
        Signature::Broken(why) => problems.push(format!("the child's start: {why}")),
        Signature::Unchecked(why) => unchecked.push(format!("the child's start: {why}")),
    }
    let (key_id, status) = signature.facts();
    let facts = json!({
        "run_id": parent.run_id,
        "step_id": parent.step_id,
        "operation_id": parent.operation_id,
        "attempt": parent.attempt,
        "child_run_id": run_id,
        "derived_run_id": derived,
        "started_by": started_by,
        "start_command": {
            "command_id": command_id,
            "at": start.at,
            "key_id": key_id,
            "signature": status,
            "record": record,
        },
        "dispatch": Value::Null,
        "follow": follow_parent(parent),
    });
    Some(ParentCheck {
        parent: parent.clone(),
        tenant: tenant.to_owned(),
        facts,
        problems,
        unchecked,
    })
}

/// The `parent` link: `check`, and with the parent's history (an empty one: the parent
/// run has none where the caller looked), that the parent dispatched the operation.
pub(crate) fn parent_link(check: &ParentCheck, parent_history: Option<&[Event]>) -> Link {
    let mut facts = check.facts.clone();
    let mut problems = check.problems.clone();
    let mut unchecked = check.unchecked.clone();
    let parent = &check.parent;
    match parent_history {
        None => unchecked.push(format!(
            "the history of run {} is not at hand: that it dispatched operation {} (attempt {}) is not checked",
            parent.run_id, parent.operation_id, parent.attempt
        )),
        Some(history) => match dispatch_in(parent, &check.tenant, history) {
            Ok(dispatch) => facts["dispatch"] = dispatch,
            Err(why) => problems.push(why),
        },
    }
    link("parent", facts, problems, unchecked)
}

/// The parent's dispatch of the operation and attempt that started the child, as a child
/// run of `step_id`.
fn dispatch_in(parent: &ParentLink, tenant: &str, history: &[Event]) -> Result<Value, String> {
    let (run, op, attempt) = (&parent.run_id, &parent.operation_id, parent.attempt);
    if history.is_empty() {
        return Err(format!(
            "run {run} has no history: no run dispatched operation {op} to start this child"
        ));
    }
    if let Some(other) = history
        .iter()
        .find(|e| e.run_id != *run || e.tenant != tenant)
    {
        return Err(format!(
            "the history given as run {run}'s (tenant {tenant}) holds an event of run {} (tenant {})",
            other.run_id, other.tenant
        ));
    }
    let dispatches: Vec<(&Event, &str, u32, &str, &str)> = history
        .iter()
        .filter(|e| e.operation_id.as_deref() == Some(op.as_str()))
        .filter_map(|e| match &e.body {
            EventBody::StepDispatched {
                step_id,
                attempt,
                tool,
                node,
                ..
            } => Some((e, step_id.as_str(), *attempt, tool.as_str(), node.as_str())),
            _ => None,
        })
        .collect();
    if dispatches.is_empty() {
        return Err(format!(
            "run {run} dispatched no operation {op}: no step of it started this child"
        ));
    }
    let Some(&(event, step_id, _, tool, node)) = dispatches.iter().find(|d| d.2 == attempt) else {
        return Err(format!(
            "run {run} dispatched operation {op}, but never attempt {attempt}"
        ));
    };
    if step_id != parent.step_id {
        return Err(format!(
            "run {run} dispatched operation {op} as step {step_id}, not {}",
            parent.step_id
        ));
    }
    if tool != CHILD_TOOL {
        return Err(format!(
            "run {run} dispatched operation {op} to tool {tool}, which starts no child run"
        ));
    }
    Ok(json!({"seq": event.seq, "at": event.at, "node": node, "tool": tool}))
}
