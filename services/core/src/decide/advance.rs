//! The engine: after any change, move the run forward: dispatch what became ready, register
//! approvals, drive agent loops, wind down (compensations) and finish.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::Ctx;
use crate::{
    blob::project,
    event::StepRole,
    graph::{Graph, ModelApi, Node, OnReject},
    json::{self as j, Reference},
    signal::{OnWaitTimeout, SignalWait},
    state::{Interrupt, InterruptStatus, RunState, Step, StepStatus, WaitStatus},
    status::RunStatus,
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

/// One step an agent step asked for.
struct Request {
    node: String,
    args: Value,
}

/// Where one requested step stands: its step, or an approval that never became one.
enum Slot<'r> {
    Step(&'r Step),
    /// Its approval is still open (or was approved in this very input).
    Waiting,
    /// Its approval was rejected: no step will run.
    Rejected,
}

impl<'r> Slot<'r> {
    fn is_done(&self) -> bool {
        match self {
            Slot::Step(step) => step.status == StepStatus::Succeeded,
            Slot::Waiting => false,
            Slot::Rejected => true,
        }
    }

    fn step(&self) -> Option<&'r Step> {
        match self {
            Slot::Step(step) => Some(step),
            Slot::Waiting | Slot::Rejected => None,
        }
    }
}

/// The steps requested by one agent step, by step id (an interrupt counts until its
/// decision: an edited and re-proposed call keeps its step id, so it counts once).
fn requested<'r>(run: &'r RunState, by: &StepRole) -> BTreeMap<&'r str, Slot<'r>> {
    let mut slots: BTreeMap<&str, Slot<'_>> = BTreeMap::new();
    for interrupt in run.interrupts.values().filter(|i| &i.role == by) {
        let slot = slots
            .entry(interrupt.step_id.as_str())
            .or_insert(Slot::Waiting);
        match interrupt.status {
            InterruptStatus::Rejected => *slot = Slot::Rejected,
            InterruptStatus::Open => *slot = Slot::Waiting,
            _ => {}
        }
    }
    for step in run.steps.values().filter(|s| &s.role == by) {
        slots.insert(step.step_id.as_str(), Slot::Step(step));
    }
    slots
}

/// Whether a step in `role` answers a model's tool call, so that a rejection of its
/// approval is told to the model instead of following the tool node's `on_reject`.
pub(crate) fn is_tool_call(run: &RunState, graph: &Graph, role: &StepRole) -> bool {
    let StepRole::Requested { by } = role else {
        return false;
    };
    run.steps
        .get(by)
        .and_then(|step| graph.node(&step.node))
        .is_some_and(|node| graph.is_tool_loop(node))
}

/// The `tool_calls` of a model's answer as requested steps: the function name is the
/// node, its `arguments` (a JSON text, or an object) the step's args.
fn tool_calls(output: &Value) -> Result<Vec<Request>, String> {
    let Some(calls) = output.get("tool_calls").and_then(Value::as_array) else {
        return Ok(Vec::new());
    };
    calls
        .iter()
        .map(|call| {
            let function = &call["function"];
            let node = function["name"]
                .as_str()
                .ok_or_else(|| format!("a tool call without a function name: {call}"))?
                .to_owned();
            let args = match &function["arguments"] {
                Value::String(text) if text.trim().is_empty() => json!({}),
                Value::String(text) => serde_json::from_str(text).map_err(|e| {
                    format!("the model's arguments for {node} are not JSON ({e}): {text}")
                })?,
                Value::Null => json!({}),
                other => other.clone(),
            };
            if !args.is_object() {
                return Err(format!(
                    "the model's arguments for {node} are not an object: {args}"
                ));
            }
            Ok(Request { node, args })
        })
        .collect()
}

/// The answer to one tool call of a model's output.
struct ToolResult {
    call_id: Value,
    /// The text the model reads.
    content: String,
    /// An approver rejected the call: it did not run.
    rejected: bool,
}

/// One result per tool call of `output`, in the model's order, carrying the output of the
/// step that answered it (a call's steps of one node are numbered in the order the model
/// asked), or that an approver rejected it.
fn tool_results(
    output: &Value,
    slots: &BTreeMap<&str, Slot<'_>>,
) -> Result<Vec<ToolResult>, String> {
    let mut by_node: BTreeMap<&str, Vec<(&str, &Slot<'_>)>> = BTreeMap::new();
    for (step_id, slot) in slots {
        let node = step_id.rsplit_once('#').map_or(*step_id, |(n, _)| n);
        by_node.entry(node).or_default().push((step_id, slot));
    }
    for answered in by_node.values_mut() {
        answered.sort_by_key(|(step_id, _)| iteration(step_id));
        answered.reverse(); // popped from the back: lowest iteration first
    }
    let calls = output
        .get("tool_calls")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut results = Vec::new();
    for call in &calls {
        let name = call["function"]["name"].as_str().unwrap_or_default();
        let Some((step_id, slot)) = by_node.get_mut(name).and_then(Vec::pop) else {
            return Err(format!("no step answered the model's call to {name}"));
        };
        let (content, rejected) = match slot {
            Slot::Step(step) => (result_text(step), false),
            Slot::Rejected => (
                j::canonical(&json!({
                    "rejected": true,
                    "message": format!("an approver rejected this call ({step_id}); it did not run"),
                })),
                true,
            ),
            Slot::Waiting => return Err(format!("step {step_id} has not answered")),
        };
        results.push(ToolResult {
            call_id: call.get("id").cloned().unwrap_or(Value::Null),
            content,
            rejected,
        });
    }
    Ok(results)
}

/// What the model reads of a tool step's output ([`crate::mcp::model_text`]).
fn result_text(step: &Step) -> String {
    crate::mcp::model_text(&step.tool, step.output.as_ref().unwrap_or(&Value::Null))
}

/// The assistant message's content blocks of an Anthropic answer: as recorded (`blocks`,
/// what the model sent, which it must be shown again as it was), else made from the
/// recorded text and tool calls.
/// A model's answer as the assistant message of the next call, in `api`'s shape.
pub(super) fn assistant_message(api: ModelApi, output: &Value) -> Value {
    match api {
        ModelApi::OpenAi => {
            let mut message = json!({
                "role": "assistant",
                "content": output.get("content").cloned().unwrap_or(Value::Null),
            });
            if let Some(calls) = output
                .get("tool_calls")
                .filter(|c| c.as_array().is_some_and(|c| !c.is_empty()))
            {
                message["tool_calls"] = calls.clone();
            }
            message
        }
        ModelApi::Anthropic => json!({"role": "assistant", "content": assistant_blocks(output)}),
    }
}

fn assistant_blocks(output: &Value) -> Value {
    if let Some(blocks) = output.get("blocks").filter(|b| b.is_array()) {
        return blocks.clone();
    }
    let mut blocks = Vec::new();
    if let Some(text) = output.get("content").and_then(Value::as_str) {
        if !text.is_empty() {
            blocks.push(json!({"type": "text", "text": text}));
        }
    }
    for call in output
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let input = match &call["function"]["arguments"] {
            Value::String(text) => serde_json::from_str(text).unwrap_or_else(|_| json!({})),
            Value::Null => json!({}),
            other => other.clone(),
        };
        blocks.push(json!({
            "type": "tool_use",
            "id": call.get("id").cloned().unwrap_or(Value::Null),
            "name": call["function"]["name"],
            "input": input,
        }));
    }
    Value::Array(blocks)
}

/// `next_steps` an agent step asked for: `[{"node": ..., "args": {...}}]`.
fn next_steps(output: &Value) -> Vec<Request> {
    output
        .get("next_steps")
        .and_then(Value::as_array)
        .map(|items| {
            items
                .iter()
                .filter_map(|item| {
                    let node = item.get("node")?.as_str()?.to_owned();
                    let args = item.get("args").cloned().unwrap_or_else(|| json!({}));
                    Some(Request { node, args })
                })
                .collect()
        })
        .unwrap_or_default()
}

pub(super) fn iteration(step_id: &str) -> u32 {
    step_id
        .rsplit_once('#')
        .and_then(|(_, n)| n.parse().ok())
        .unwrap_or(0)
}

/// Fills a node's argument template from the run input, earlier outputs, (for a
/// compensation) the step being compensated, and the human input of a decided interrupt.
/// Without an interrupt, `$interrupt.payload` references stay as they are: a gated node's
/// proposal shows them, and the approval fills them in ([`fill_interrupt`]).
///
/// A path that leads into a blob reference (a large input or output stored by reference)
/// renders as that reference narrowed by the rest of the path ([`project`]): the fold
/// never reads a blob; the executor resolves the reference before the handler runs.
pub(crate) fn render(
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
pub(crate) fn group_name(run: &RunState, group: &str) -> String {
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
pub(crate) fn fill_interrupt(template: &Value, args: &Value, payload: Option<&Value>) -> Value {
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

/// Where the precheck of an approved interrupt stands.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Precheck {
    /// No precheck, or it is still running.
    Pending,
    /// It answered `ok: true`: the approved call may run.
    Passed,
    /// It failed or did not answer `ok: true`: the call never runs; `on_reject` applies.
    Refused(String),
}

pub(crate) fn precheck(run: &RunState, node: &Node, interrupt: &Interrupt) -> Precheck {
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
fn continue_after_prechecks(ctx: &mut Ctx<'_>, graph: &Graph) {
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
fn wind_down(ctx: &mut Ctx<'_>, graph: &Graph) {
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
