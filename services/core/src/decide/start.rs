//! StartRun: create a run pinned to a graph version, or recognise the same request again.

use super::{advance, advance::render, fork, Ctx};
use crate::{
    event::{EventBody, StepRole},
    input::{Command, CommandBody, ForkSource},
    state::RunState,
};

pub(crate) fn handle(ctx: &mut Ctx<'_>, command: &Command) {
    let CommandBody::StartRun {
        graph_id,
        graph_version,
        input,
        labels,
        budget,
        fork,
        parent,
    } = &command.body
    else {
        return;
    };
    if let Some(run) = &ctx.state {
        // Same id + same request = same run; anything else under that id is a conflict.
        // (Another tenant's start never gets here: see `command_input`.)
        // The start names the short id; the run pinned the one it resolved to.
        let resolved = ctx.graphs.resolve(&command.tenant, graph_id, None);
        let named = resolved.map_or_else(|| graph_id.clone(), |g| g.pinned_id());
        let same = (run.graph_id == named || &run.graph_id == graph_id)
            && graph_version.is_none_or(|v| v == run.graph_version)
            && &run.input == input;
        if same {
            ctx.emit(
                EventBody::CommandAccepted {
                    command_id: command.command_id.clone(),
                    command: "StartRun".into(),
                    duplicate: true,
                },
                None,
            );
        } else {
            ctx.reject(
                command,
                "conflict",
                format!(
                    "run {} already exists with a different request",
                    command.run_id
                ),
            );
        }
        return;
    }
    let source = match fork {
        None => None,
        Some(fork) => match source_state(ctx, command, fork, graph_id, *graph_version) {
            Ok(state) => Some(state),
            Err(reason) => return ctx.reject(command, "bad_fork", reason),
        },
    };
    let Some(graph) = ctx
        .graphs
        .resolve(&command.tenant, graph_id, *graph_version)
    else {
        let version = graph_version.map(|v| format!("@{v}")).unwrap_or_default();
        return ctx.reject(
            command,
            "unknown_graph",
            format!(
                "graph {}{version} is not published",
                crate::limits::shown_id(graph_id)
            ),
        );
    };
    if let Some(reason) = graph.access.start_refusal(&graph.id, &command.roles) {
        return ctx.reject(command, "forbidden", reason);
    }
    if let Some(reason) = correlation_refusal(command, graph, labels, fork.is_some()) {
        return ctx.reject(command, "bad_run_id", reason);
    }
    if command.run_id.starts_with(crate::ids::KEYED_PREFIX)
        && !crate::ids::is_keyed_id(
            &command.tenant,
            &command.command_id,
            &command.run_id,
            fork.is_some(),
        )
    {
        let reason = format!(
            "run ids starting {} are derived from the start's Idempotency-Key (its command id); choose another",
            crate::ids::KEYED_PREFIX
        );
        return ctx.reject(command, "bad_run_id", reason);
    }
    if let Some((code, reason)) = child_refusal(command, graph, parent.as_ref()) {
        return ctx.reject(command, code, reason);
    }
    if let Some(Err(problem)) = budget.as_ref().map(crate::budget::Budget::check) {
        // The model layer refuses such a command before the fold; this keeps any other
        // caller of the fold to the same rule.
        return ctx.reject(command, "bad_budget", format!("budget: {problem}"));
    }
    let plan = source.as_ref().map(|s| fork::plan(s, graph));
    let (forked_from, redispatch, propose) = match plan {
        Some(plan) => (Some(plan.forked_from), plan.redispatch, plan.propose),
        None => (None, Vec::new(), Vec::new()),
    };
    ctx.emit(
        EventBody::RunStarted {
            graph_id: graph.pinned_id(),
            graph_version: graph.version,
            input: input.clone(),
            started_by: command.principal.clone(),
            labels: labels.clone(),
            deadline_at: graph.max_duration.map(|d| ctx.at + d.0),
            budget: budget.clone(),
            forked_from,
            rules: crate::budget::RULES,
            parent: parent.clone(),
        },
        None,
    );
    ctx.accept(command);
    for step in redispatch {
        if let Some(node) = graph.node(&step.node) {
            // A graph node's arguments are rendered again: the input may be patched.
            let args = match step.role {
                StepRole::Node => render(ctx.run(), None, None, &node.args),
                _ => step.args,
            };
            ctx.dispatch(node, step.step_id, 1, args, step.role);
        }
    }
    for again in propose {
        if let Some(node) = graph.node(&again.node) {
            // Gated: a fresh interrupt of this run, whatever the source had approved.
            let args = match again.role {
                StepRole::Node => render(ctx.run(), None, None, &node.args),
                _ => again.args,
            };
            ctx.propose(node, again.step_id, args, again.role);
        }
    }
    advance(ctx);
}

/// The source state a fork starts from, checked against the command.
fn source_state(
    ctx: &Ctx<'_>,
    command: &Command,
    fork: &ForkSource,
    graph_id: &str,
    graph_version: Option<u32>,
) -> Result<RunState, String> {
    let state: RunState = serde_json::from_value(fork.state.clone()).map_err(|e| {
        // serde's message may quote the value: only its start is kept.
        let e = e.to_string();
        format!(
            "the fork's source state does not read as a run state: {}",
            crate::limits::clip(&e, 160)
        )
    })?;
    if state.tenant != command.tenant
        || state.run_id != fork.run_id
        || state.version != fork.version
    {
        return Err(format!(
            "the fork's source state is not run {} at version {} of this tenant",
            crate::limits::shown_id(&fork.run_id),
            fork.version
        ));
    }
    // The command names the graph as its tenant does (short id); the source pinned the
    // id it resolved to then.
    let named = ctx
        .graphs
        .resolve(&command.tenant, graph_id, Some(state.graph_version))
        .map(|g| g.pinned_id());
    let same_graph = state.graph_id == graph_id || named.as_deref() == Some(&state.graph_id);
    if !same_graph || graph_version.is_some_and(|v| v != state.graph_version) {
        return Err(format!(
            "a fork runs the source's graph {}@{}",
            state.graph_id, state.graph_version
        ));
    }
    if fork.run_id == command.run_id {
        return Err("a fork needs a run id of its own".into());
    }
    Ok(state)
}

/// Why `command` may not start a run under its run id, for a graph with a `correlation`
/// or an id of the correlated form: a correlated graph's run (a fork aside, which is
/// addressed by its own id) must carry the label and take the id derived from it; a
/// `cor_` id is taken only as so derived, so no tenant can hold another's correlated id.
fn correlation_refusal(
    command: &Command,
    graph: &crate::graph::Graph,
    labels: &std::collections::BTreeMap<String, String>,
    forked: bool,
) -> Option<String> {
    use crate::ids::{correlated_run_id, CORRELATED_PREFIX};
    let derived = match (&graph.correlation, forked) {
        (Some(label), false) => {
            let Some(value) = labels.get(label) else {
                return Some(format!(
                    "graph {} names its runs by their {label} label: a start must carry it",
                    graph.id
                ));
            };
            Some(correlated_run_id(&command.tenant, &graph.id, label, value))
        }
        _ => None,
    };
    match derived {
        Some(id) if id != command.run_id => Some(format!(
            "graph {} names its runs by their {} label: this run's id is {id}",
            graph.id,
            graph.correlation.as_deref().unwrap_or_default()
        )),
        Some(_) => None,
        None if command.run_id.starts_with(CORRELATED_PREFIX) => Some(format!(
            "run ids starting {CORRELATED_PREFIX} are derived from a correlation label; choose another"
        )),
        None => None,
    }
}

/// Why `command` may not start a child run, or a run under a child's id: a `sub_` id is
/// taken only by a start its parent run sends whose parent link derives it (in the
/// start's own tenant), and a
/// child's graph must leave `access` open — its start and cancel come from the parent
/// run, which holds no roles of its own.
fn child_refusal(
    command: &Command,
    graph: &crate::graph::Graph,
    parent: Option<&crate::child::ParentLink>,
) -> Option<(&'static str, String)> {
    use crate::child::CHILD_PREFIX;
    match parent {
        None if command.run_id.starts_with(CHILD_PREFIX) => Some((
            "bad_run_id",
            format!(
                "run ids starting {CHILD_PREFIX} are child runs' ids, derived by their parent; choose another"
            ),
        )),
        None => None,
        Some(link) if link.child_id(&command.tenant) != command.run_id => Some((
            "bad_run_id",
            "a child run's id is the one its parent link derives".to_owned(),
        )),
        // Only the parent starts its child: an operation id can be computed ahead from
        // its arguments, so anyone could otherwise take the child's id first.
        Some(link) if command.principal != crate::child::parent_principal(&link.run_id) => Some((
            "forbidden",
            format!(
                "a child run is started by its parent run ({}) only",
                crate::child::parent_principal(&crate::limits::shown_id(&link.run_id))
            ),
        )),
        Some(_) if !graph.access.start.is_empty() || !graph.access.cancel.is_empty() => Some((
            "forbidden",
            format!(
                "graph {} limits who starts or cancels its runs (access), so it cannot run as a child",
                graph.id
            ),
        )),
        Some(_) => None,
    }
}
