//! The engine: after any change, move the run forward: dispatch what became ready, register
//! approvals, drive agent loops, wind down (compensations) and finish. Its parts live beside
//! it: `agent_loop`, `template` (arguments), `precheck` and `wind_down`.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::{
    agent_loop::{is_tool_call, next_steps, requested, tool_calls, tool_results},
    precheck::{continue_after_prechecks, precheck, Precheck},
    wind_down::{begin_failure, wind_down},
    Ctx,
};
use crate::{
    event::StepRole,
    graph::{Graph, ModelApi, Node, OnReject},
    signal::{OnWaitTimeout, SignalWait},
    state::{Interrupt, InterruptStatus, RunState, Step, StepStatus, WaitStatus},
    status::RunStatus,
};

// Moved beside this file; the other handlers reach them here.
pub(super) use super::{
    agent_loop::{assistant_message, iteration},
    template::{approved_args, group_name, render},
};

/// Where a graph node stands in a run.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum NodeState {
    /// Its incoming edges are not all decided yet.
    Waiting,
    /// Proposed, in flight, retrying, looping, or awaiting a human.
    Active,
    Done(Value),
    /// Every incoming edge was decided and none was taken (dead path).
    Skipped,
}

/// A new step to propose, decided while the run is only read.
pub(super) struct Proposal<'g> {
    pub(super) node: &'g Node,
    pub(super) step_id: String,
    pub(super) args: Value,
    pub(super) role: StepRole,
    /// Not a step: the wait for a conversation's next message after the answer `step_id`.
    pub(super) opens_turn: bool,
}

pub(crate) fn advance(ctx: &mut Ctx<'_>) {
    let Some(run) = &ctx.state else { return };
    if run.status.is_terminal() {
        return;
    }
    let Some(graph) = ctx.graph() else { return };
    if run.ending.is_some() {
        return wind_down(ctx, graph);
    }
    if let Some(reason) = failure(run, graph) {
        return begin_failure(ctx, reason);
    }
    continue_after_prechecks(ctx, graph);
    let run = ctx.run();

    let (states, proposals, problem) = plan(run, graph);
    if let Some(reason) = problem {
        return begin_failure(ctx, reason);
    }
    let steps = proposals.iter().filter(|p| !p.opens_turn).count();
    if run.steps_taken() + steps > graph.max_steps as usize {
        let reason = format!(
            "the run would exceed the graph's max_steps ({})",
            graph.max_steps
        );
        return begin_failure(ctx, reason);
    }
    let new_tool_calls = proposals
        .iter()
        .filter(|p| matches!(p.role, StepRole::Requested { .. }))
        .count() as u64;
    match super::budget::check(ctx, steps, new_tool_calls) {
        super::budget::Verdict::Go => {}
        super::budget::Verdict::Hold => return hold(ctx),
    }
    ctx.children_to_start = proposals.iter().filter(|p| p.node.run.is_some()).count() as u64;
    ctx.requests_to_dispatch = new_tool_calls;
    for p in proposals {
        if p.opens_turn {
            super::converse::open(ctx, p.node, p.step_id);
        } else {
            ctx.propose(p.node, p.step_id, p.args, p.role);
        }
    }
    if std::mem::take(&mut ctx.wait_satisfied) {
        // A wait that opened took the signals kept for it and is done: plan again (each
        // wait opens once, and a conversation's turns are bounded, so this ends).
        return advance(ctx);
    }

    let run = ctx.run();
    let busy = run.steps.values().any(|s| !s.status.is_settled());
    let settled = states
        .values()
        .all(|s| matches!(s, NodeState::Done(_) | NodeState::Skipped));
    if settled && !busy && run.open_interrupts().next().is_none() {
        let output = final_output(graph, &states);
        ctx.set_status(RunStatus::Succeeded, None, Some(output));
        return;
    }
    let status = if run.open_interrupts().next().is_some() {
        RunStatus::WaitingApproval
    } else if run
        .steps
        .values()
        .any(|s| s.status == StepStatus::NeedsOperator)
    {
        RunStatus::NeedsReconciliation
    } else if run.open_waits().next().is_some() && !busy {
        RunStatus::WaitingSignal
    } else {
        RunStatus::Running
    };
    ctx.set_status(status, None, None);
}

/// Nothing new is proposed (a budget holds the run): it waits on its open interrupts, or
/// has begun to end.
fn hold(ctx: &mut Ctx<'_>) {
    let run = ctx.run();
    if run.status.is_terminal() || run.ending.is_some() {
        return;
    }
    if run.open_interrupts().next().is_some() {
        ctx.set_status(RunStatus::WaitingApproval, None, None);
    }
}

/// A terminal failure among the forward steps, if any.
fn failure(run: &RunState, graph: &Graph) -> Option<String> {
    if let Some(step) = run.steps.values().find(|s| {
        s.status == StepStatus::Failed
            && !matches!(
                s.role,
                StepRole::Compensation { .. } | StepRole::Precheck { .. }
            )
    }) {
        return Some(format!(
            "step {} failed: {}",
            step.step_id,
            step.error.as_deref().unwrap_or("no reason given")
        ));
    }
    for interrupt in run.interrupts.values() {
        let rejected_to_fail = interrupt.status == InterruptStatus::Rejected
            && !is_tool_call(run, graph, &interrupt.role)
            && graph
                .node(&interrupt.node)
                .is_some_and(|n| n.on_reject == OnReject::Fail);
        if rejected_to_fail {
            return Some(format!("approval {} was rejected", interrupt.interrupt_id));
        }
        if let Some(node) = graph.node(&interrupt.node) {
            if let (Precheck::Refused(why), OnReject::Fail) =
                (precheck(run, node, interrupt), &node.on_reject)
            {
                return Some(why);
            }
        }
    }
    None
}

/// Walks the graph in topological order and decides what to propose next.
fn plan<'g>(
    run: &RunState,
    graph: &'g Graph,
) -> (
    BTreeMap<&'g str, NodeState>,
    Vec<Proposal<'g>>,
    Option<String>,
) {
    let mut states: BTreeMap<&str, NodeState> = BTreeMap::new();
    let mut proposals = Vec::new();
    for node in graph.topological() {
        let mut decided = true;
        let mut taken = false;
        let mut incoming = 0;
        for edge in graph.incoming(&node.id) {
            incoming += 1;
            match states.get(edge.from.as_str()) {
                Some(NodeState::Done(output)) => {
                    taken |= edge.when.as_ref().is_none_or(|c| c.holds(output));
                }
                Some(NodeState::Skipped) => {}
                _ => decided = false,
            }
        }
        let state = if incoming > 0 && !decided {
            NodeState::Waiting
        } else if incoming > 0 && !taken {
            NodeState::Skipped
        } else {
            match progress(run, graph, node, &mut proposals) {
                Ok(state) => state,
                Err(problem) => return (states, proposals, Some(problem)),
            }
        };
        states.insert(node.id.as_str(), state);
    }
    (states, proposals, None)
}

/// The node `target` runs in place of `node` (its approval was rejected, or its wait
/// expired, with `goto`): where that substitute stands, proposing it the first time.
fn substitute<'g>(
    run: &RunState,
    graph: &'g Graph,
    node: &Node,
    target: &str,
    decided: Option<&Interrupt>,
    out: &mut Vec<Proposal<'g>>,
) -> Result<NodeState, String> {
    let role = StepRole::Substitute {
        for_node: node.id.clone(),
    };
    match run.steps.values().find(|s| s.role == role) {
        Some(step) if step.status == StepStatus::Succeeded => {
            Ok(NodeState::Done(step.output.clone().unwrap_or(Value::Null)))
        }
        Some(_) => Ok(NodeState::Active),
        None => {
            let target = graph
                .node(target)
                .ok_or_else(|| format!("unknown node {target}"))?;
            // A substitute is a node like any other: its own template, rendered once
            // (never the rejected proposal's args, which are values, not a template).
            let args = render(run, None, decided, &target.args);
            out.push(Proposal {
                node: target,
                step_id: run.next_step_id(&target.id),
                args,
                role,
                opens_turn: false,
            });
            Ok(NodeState::Active)
        }
    }
}

/// Where a node that waits for a signal stands: not open yet (open it), open, done with
/// its output, or expired (its `goto` substitute, or the failure path).
fn waiting<'g>(
    run: &RunState,
    graph: &'g Graph,
    node: &'g Node,
    declared: &SignalWait,
    out: &mut Vec<Proposal<'g>>,
) -> Result<NodeState, String> {
    let Some(wait) = run.waits.values().find(|w| w.node == node.id) else {
        out.push(Proposal {
            node,
            step_id: run.next_step_id(&node.id),
            args: json!({}),
            role: StepRole::Node,
            opens_turn: false,
        });
        return Ok(NodeState::Active);
    };
    match (wait.status, &declared.on_timeout) {
        (WaitStatus::Done, _) => Ok(NodeState::Done(wait.output())),
        (WaitStatus::Expired, OnWaitTimeout::Goto(target)) => {
            substitute(run, graph, node, target, None, out)
        }
        // Open; closed by a wind-down; expired to fail (the failure path decides).
        _ => Ok(NodeState::Active),
    }
}

/// Where one ready graph node stands, adding the proposals it needs.
fn progress<'g>(
    run: &RunState,
    graph: &'g Graph,
    node: &'g Node,
    out: &mut Vec<Proposal<'g>>,
) -> Result<NodeState, String> {
    if let Some(declared) = &node.wait {
        return waiting(run, graph, node, declared, out);
    }
    // Approval first: an open one holds the node; a rejected one may send it elsewhere.
    let interrupts: Vec<_> = run
        .interrupts
        .values()
        .filter(|i| i.node == node.id && i.role == StepRole::Node)
        .collect();
    if interrupts.iter().any(|i| i.status == InterruptStatus::Open) {
        return Ok(NodeState::Active);
    }
    let rejected = interrupts
        .iter()
        .find(|i| {
            i.status == InterruptStatus::Rejected
                || matches!(precheck(run, node, i), Precheck::Refused(_))
        })
        .copied();
    if let Some(rejected) = rejected {
        let OnReject::Goto(target) = &node.on_reject else {
            return Ok(NodeState::Active); // the failure path handles it
        };
        return substitute(run, graph, node, target, Some(rejected), out);
    }
    if interrupts
        .iter()
        .any(|i| i.status == InterruptStatus::Expired)
    {
        return Ok(NodeState::Active); // the expiry path decided the run's fate
    }

    let latest = run
        .steps
        .values()
        .filter(|s| s.node == node.id && s.role == StepRole::Node)
        .max_by_key(|s| iteration(&s.step_id));
    let Some(latest) = latest else {
        let pending_approval = interrupts
            .iter()
            .any(|i| i.status == InterruptStatus::Approved);
        if !pending_approval {
            let mut args = render(run, None, None, &node.args);
            if graph.is_tool_loop(node) {
                if let Value::Object(map) = &mut args {
                    map.entry("tools").or_insert_with(|| graph.tool_specs(node));
                }
            }
            if let Some(conversation) = &node.conversation {
                super::converse::first_call(node, conversation, &mut args);
            }
            out.push(Proposal {
                node,
                step_id: run.next_step_id(&node.id),
                args,
                role: StepRole::Node,
                opens_turn: false,
            });
        }
        return Ok(NodeState::Active);
    };
    if latest.status != StepStatus::Succeeded {
        return Ok(NodeState::Active);
    }
    let output = latest.output.clone().unwrap_or(Value::Null);
    if let Some(conversation) = &node.conversation {
        if let Some(state) = super::converse::progress(run, graph, node, conversation, latest, out)?
        {
            return Ok(state);
        }
    }
    let tool_loop = graph.is_tool_loop(node);
    let requests = if !tool_loop {
        next_steps(&output)
    } else {
        tool_calls(&output).map_err(|e| format!("step {}: {e}", latest.step_id))?
    };
    if requests.is_empty() || !graph.requests_steps(node) {
        return Ok(NodeState::Done(output));
    }

    // An agent loop: run the requested steps, then invoke the node again with their results.
    let by = StepRole::Requested {
        by: latest.step_id.clone(),
    };
    let slots = requested(run, &by);
    if slots.is_empty() {
        let mut taken: BTreeMap<String, u32> = BTreeMap::new();
        for request in requests {
            let name = request.node;
            if !graph.may_request(node, &name) {
                return Err(format!(
                    "step {} asked for node {name:?}, which node {} may not request",
                    latest.step_id, node.id
                ));
            }
            let target = graph
                .node(&name)
                .ok_or_else(|| format!("unknown node {name}"))?;
            let base = iteration(&run.next_step_id(&name));
            let offset = taken.entry(name.clone()).or_insert(0);
            let step_id = format!("{name}#{}", base + *offset);
            *offset += 1;
            out.push(Proposal {
                node: target,
                step_id,
                args: request.args,
                role: by.clone(),
                opens_turn: false,
            });
        }
        return Ok(NodeState::Active);
    }
    if !slots.values().all(|slot| slot.is_done()) {
        return Ok(NodeState::Active);
    }
    let args = if !tool_loop {
        let mut ordered: Vec<&Step> = slots.values().filter_map(|slot| slot.step()).collect();
        ordered.sort_by_key(|c| (c.node.clone(), iteration(&c.step_id)));
        let results: Vec<Value> = ordered
            .iter()
            .map(|c| json!({"node": c.node, "step_id": c.step_id, "args": c.args, "output": c.output}))
            .collect();
        let first = run
            .steps
            .values()
            .filter(|s| s.node == node.id && s.role == StepRole::Node)
            .min_by_key(|s| iteration(&s.step_id))
            .map(|s| s.args.clone())
            .unwrap_or_else(|| json!({}));
        let mut args = first;
        if let Value::Object(map) = &mut args {
            map.insert("iteration".into(), json!(iteration(&latest.step_id) + 1));
            map.insert("previous_output".into(), output);
            map.insert("results".into(), Value::Array(results));
        }
        args
    } else {
        // A tool loop: the conversation so far (the previous call's messages), the
        // model's answer, and one tool message per call, in the order the model asked.
        // A conversation's call carries only what is new since the previous call, beside
        // the reference to that call's transcript.
        let mut args = latest.args.clone();
        let mut messages = match node.conversation {
            Some(_) => Vec::new(),
            None => args
                .get("messages")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default(),
        };
        let results = tool_results(&output, &slots)?;
        match node.model_api() {
            ModelApi::OpenAi => {
                messages.push(assistant_message(ModelApi::OpenAi, &output));
                messages.extend(results.into_iter().map(
                    |r| json!({"role": "tool", "tool_call_id": r.call_id, "content": r.content}),
                ));
            }
            ModelApi::Anthropic => {
                messages.push(assistant_message(ModelApi::Anthropic, &output));
                let blocks: Vec<Value> = results
                    .into_iter()
                    .map(|r| {
                        let mut block = json!({
                            "type": "tool_result",
                            "tool_use_id": r.call_id,
                            "content": r.content,
                        });
                        if r.rejected {
                            block["is_error"] = json!(true);
                        }
                        block
                    })
                    .collect();
                messages.push(json!({"role": "user", "content": blocks}));
            }
        }
        if let Value::Object(map) = &mut args {
            map.insert("messages".into(), Value::Array(messages));
        }
        if node.conversation.is_some() {
            super::converse::continue_from(latest, &mut args)?;
        }
        args
    };
    out.push(Proposal {
        node,
        step_id: run.next_step_id(&node.id),
        args,
        role: StepRole::Node,
        opens_turn: false,
    });
    Ok(NodeState::Active)
}

fn final_output(graph: &Graph, states: &BTreeMap<&str, NodeState>) -> Value {
    let mut out = serde_json::Map::new();
    for (node, state) in states {
        if let NodeState::Done(output) = state {
            if graph.outgoing(node).next().is_none() {
                out.insert((*node).to_owned(), output.clone());
            }
        }
    }
    Value::Object(out)
}
