//! An agent loop's requests: the steps an agent step asks for (`next_steps`, or a model's
//! tool calls), where each stands, and the messages the model's next call reads.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::{
    event::StepRole,
    graph::{Graph, ModelApi},
    json as j,
    state::{InterruptStatus, RunState, Step, StepStatus},
};

/// One step an agent step asked for.
pub(super) struct Request {
    pub(super) node: String,
    pub(super) args: Value,
}

/// Where one requested step stands: its step, or an approval that never became one.
pub(super) enum Slot<'r> {
    Step(&'r Step),
    /// Its approval is still open (or was approved in this very input).
    Waiting,
    /// Its approval was rejected: no step will run.
    Rejected,
}

impl<'r> Slot<'r> {
    pub(super) fn is_done(&self) -> bool {
        match self {
            Slot::Step(step) => step.status == StepStatus::Succeeded,
            Slot::Waiting => false,
            Slot::Rejected => true,
        }
    }

    pub(super) fn step(&self) -> Option<&'r Step> {
        match self {
            Slot::Step(step) => Some(step),
            Slot::Waiting | Slot::Rejected => None,
        }
    }
}

/// The steps requested by one agent step, by step id (an interrupt counts until its
/// decision: an edited and re-proposed call keeps its step id, so it counts once).
pub(super) fn requested<'r>(run: &'r RunState, by: &StepRole) -> BTreeMap<&'r str, Slot<'r>> {
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
pub(super) fn tool_calls(output: &Value) -> Result<Vec<Request>, String> {
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
pub(super) struct ToolResult {
    pub(super) call_id: Value,
    /// The text the model reads.
    pub(super) content: String,
    /// An approver rejected the call: it did not run.
    pub(super) rejected: bool,
}

/// One result per tool call of `output`, in the model's order, carrying the output of the
/// step that answered it (a call's steps of one node are numbered in the order the model
/// asked), or that an approver rejected it.
pub(super) fn tool_results(
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

/// The assistant message's content blocks of an Anthropic answer: as recorded (`blocks`,
/// what the model sent, which it must be shown again as it was), else made from the
/// recorded text and tool calls.
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
pub(super) fn next_steps(output: &Value) -> Vec<Request> {
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
