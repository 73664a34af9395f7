//! A run's agent conversations as people read them: for each tool-loop node, the messages
//! it started with, each model answer (its text and the tool calls it asked for), each
//! call's approval as it was asked for and decided, and each call's result, in the order
//! they happened. Derived from the run's events alone (the same history every reader
//! has), in both model APIs; the gateway serves it (`GET /v1/runs/{id}/conversation`, the
//! console's run page) and the CLI prints it (`sortie run get|watch --conversation`).
//!
//! The list only grows as events are added (an approval's decision is an entry of its
//! own), so a live reader prints what is new. Calls are matched to their steps as the fold
//! matches them: the steps one model answer asked for of one node are numbered in the
//! order the model asked.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::{json, Value};

use crate::event::{Event, EventBody, StepRole};
use crate::state::RunState;

/// One entry of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Entry {
    /// The event it comes from.
    pub seq: i64,
    pub at: i64,
    /// The tool-loop node whose conversation it belongs to.
    pub node: String,
    #[serde(flatten)]
    pub body: Body,
}

/// What an entry says.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Body {
    /// A message the conversation started with (`system`, `user`, ...).
    Message { role: String, text: String },
    /// The model's answer: its text and the tools it asked to call.
    Model {
        step_id: String,
        text: Option<String>,
        tool_calls: Vec<ToolCall>,
        model: Option<String>,
        usage: Option<Value>,
    },
    /// A call waits for an approver (`requested`) or was decided (`approved`,
    /// `rejected`, `expired`).
    Approval {
        call_id: Option<String>,
        tool: String,
        step_id: String,
        interrupt_id: String,
        state: String,
        by: Option<String>,
        comment: Option<String>,
    },
    /// What a call's step answered: `succeeded` with the text the model reads, or
    /// `failed` / `unknown` with why.
    ToolResult {
        call_id: Option<String>,
        tool: String,
        step_id: String,
        status: String,
        text: String,
    },
}

/// A tool call of a model answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCall {
    pub id: Option<String>,
    pub tool: String,
    pub arguments: Value,
}

/// What is known of a model step while the events are read.
struct Asked {
    node: String,
    calls: Vec<ToolCall>,
    /// The step ids answering each call, in the model's order per tool.
    taken: BTreeMap<String, Vec<String>>,
}

/// The conversations of a run's events (in seq order).
pub fn of(events: &[Event]) -> Vec<Entry> {
    let mut out = Vec::new();
    // Model steps: step id → what they asked.
    let mut asked: BTreeMap<String, Asked> = BTreeMap::new();
    // Every dispatched step: step id → (tool, role).
    let mut steps: BTreeMap<String, (String, StepRole)> = BTreeMap::new();
    let mut started: Vec<String> = Vec::new();
    let mut interrupts: BTreeMap<String, (String, StepRole, String)> = BTreeMap::new();
    for event in events {
        let entry = |node: &str, body: Body| Entry {
            seq: event.seq,
            at: event.at,
            node: node.to_owned(),
            body,
        };
        match &event.body {
            EventBody::StepDispatched {
                step_id,
                node,
                tool,
                args,
                role,
                ..
            } => {
                steps.insert(step_id.clone(), (tool.clone(), role.clone()));
                if is_model_step(tool, args) && !asked.contains_key(step_id) {
                    asked.insert(
                        step_id.clone(),
                        Asked {
                            node: node.clone(),
                            calls: Vec::new(),
                            taken: BTreeMap::new(),
                        },
                    );
                    if !started.contains(node) {
                        started.push(node.clone());
                        for (role, text) in opening(args) {
                            out.push(entry(node, Body::Message { role, text }));
                        }
                    }
                }
            }
            EventBody::SignalReceived {
                step_id, payload, ..
            } => {
                // A person's next message to a conversation, after the answer `step_id`.
                if let Some(model) = asked.get(step_id) {
                    let text = match crate::converse::message(payload) {
                        Ok(crate::converse::Message {
                            text: Some(text), ..
                        }) => text,
                        _ => "(ends the conversation)".to_owned(),
                    };
                    out.push(entry(
                        &model.node,
                        Body::Message {
                            role: "user".into(),
                            text,
                        },
                    ));
                }
            }
            EventBody::StepSucceeded {
                step_id, output, ..
            } => {
                if let Some(model) = asked.get_mut(step_id) {
                    model.calls = tool_calls(output);
                    out.push(entry(
                        &model.node,
                        Body::Model {
                            step_id: step_id.clone(),
                            text: output
                                .get("content")
                                .and_then(Value::as_str)
                                .filter(|t| !t.is_empty())
                                .map(str::to_owned),
                            tool_calls: model.calls.clone(),
                            model: output
                                .get("model")
                                .and_then(Value::as_str)
                                .map(str::to_owned),
                            usage: output.get("usage").filter(|u| !u.is_null()).cloned(),
                        },
                    ));
                } else if let Some((node, call_id, tool)) = call_of(&mut asked, &steps, step_id) {
                    let tool_name = steps.get(step_id).map(|s| s.0.as_str()).unwrap_or("");
                    out.push(entry(
                        &node,
                        Body::ToolResult {
                            call_id,
                            tool,
                            step_id: step_id.clone(),
                            status: "succeeded".into(),
                            text: result_text(tool_name, output),
                        },
                    ));
                }
            }
            EventBody::StepFailed {
                step_id,
                code,
                message,
                retryable,
                retry_at,
                ..
            } => {
                if let Some((node, call_id, tool)) = call_of(&mut asked, &steps, step_id) {
                    let status = if *retryable && retry_at.is_some() {
                        "failed, will retry"
                    } else {
                        "failed"
                    };
                    out.push(entry(
                        &node,
                        Body::ToolResult {
                            call_id,
                            tool,
                            step_id: step_id.clone(),
                            status: status.into(),
                            text: format!("{code}: {message}"),
                        },
                    ));
                }
            }
            EventBody::StepOutcomeUnknown {
                step_id,
                message,
                needs_operator,
                ..
            } => {
                if let Some((node, call_id, tool)) = call_of(&mut asked, &steps, step_id) {
                    let status = if *needs_operator {
                        "unknown, needs an operator"
                    } else {
                        "unknown, will retry"
                    };
                    out.push(entry(
                        &node,
                        Body::ToolResult {
                            call_id,
                            tool,
                            step_id: step_id.clone(),
                            status: status.into(),
                            text: message.clone(),
                        },
                    ));
                }
            }
            EventBody::OperationReconciled {
                step_id,
                succeeded,
                output,
                error,
                by,
            } => {
                if let Some((node, call_id, tool)) = call_of(&mut asked, &steps, step_id) {
                    let tool_name = steps.get(step_id).map(|s| s.0.as_str()).unwrap_or("");
                    let text = match (succeeded, output, error) {
                        (true, Some(output), _) => result_text(tool_name, output),
                        (_, _, Some(error)) => error.clone(),
                        _ => String::new(),
                    };
                    let status = if *succeeded { "succeeded" } else { "failed" };
                    out.push(entry(
                        &node,
                        Body::ToolResult {
                            call_id,
                            tool,
                            step_id: step_id.clone(),
                            status: format!("{status} (recorded by {by})"),
                            text,
                        },
                    ));
                }
            }
            EventBody::Interrupted {
                interrupt_id,
                step_id,
                node,
                role,
                ..
            } => {
                interrupts.insert(
                    interrupt_id.clone(),
                    (step_id.clone(), role.clone(), node.clone()),
                );
                if let Some((by, call_id, tool)) = requested_call(&mut asked, role, node, step_id) {
                    out.push(entry(
                        &by,
                        Body::Approval {
                            call_id,
                            tool,
                            step_id: step_id.clone(),
                            interrupt_id: interrupt_id.clone(),
                            state: "requested".into(),
                            by: None,
                            comment: None,
                        },
                    ));
                }
            }
            EventBody::InterruptDecided {
                interrupt_id,
                approve,
                decided_by,
                comment,
                is_final,
                ..
            } => {
                let Some((step_id, role, node)) = interrupts.get(interrupt_id).cloned() else {
                    continue;
                };
                if !is_final {
                    continue;
                }
                if let Some((by, call_id, tool)) =
                    requested_call(&mut asked, &role, &node, &step_id)
                {
                    out.push(entry(
                        &by,
                        Body::Approval {
                            call_id,
                            tool,
                            step_id,
                            interrupt_id: interrupt_id.clone(),
                            state: if *approve { "approved" } else { "rejected" }.into(),
                            by: Some(decided_by.clone()),
                            comment: comment.clone(),
                        },
                    ));
                }
            }
            EventBody::InterruptExpired { interrupt_id, .. } => {
                let Some((step_id, role, node)) = interrupts.get(interrupt_id).cloned() else {
                    continue;
                };
                if let Some((by, call_id, tool)) =
                    requested_call(&mut asked, &role, &node, &step_id)
                {
                    out.push(entry(
                        &by,
                        Body::Approval {
                            call_id,
                            tool,
                            step_id,
                            interrupt_id: interrupt_id.clone(),
                            state: "expired".into(),
                            by: None,
                            comment: None,
                        },
                    ));
                }
            }
            _ => {}
        }
    }
    out
}

/// The model message that asked for the step `step_id` of `node` (a call an `llm` step
/// requested, e.g. the one an approval is about): `{"step_id", "text", "tool_call"}`
/// from the run's state; `None` for any other step.
pub fn asking_message(run: &RunState, role: &StepRole, node: &str, step_id: &str) -> Option<Value> {
    let StepRole::Requested { by } = role else {
        return None;
    };
    let requester = run.steps.get(by)?;
    let output = requester.output.as_ref()?;
    let calls = tool_calls(output);
    // The requested step ids of `node` by `by`, in order: the model's order of its calls.
    let mut ids: Vec<&str> = run
        .steps
        .values()
        .filter(|s| &s.role == role && s.node == node)
        .map(|s| s.step_id.as_str())
        .chain(
            run.interrupts
                .values()
                .filter(|i| &i.role == role && i.node == node)
                .map(|i| i.step_id.as_str()),
        )
        .collect();
    ids.sort_by_key(|id| iteration(id));
    ids.dedup();
    let rank = ids.iter().position(|id| *id == step_id)?;
    let call = calls.iter().filter(|c| c.tool == node).nth(rank);
    Some(json!({
        "step_id": by,
        "text": output.get("content").and_then(Value::as_str),
        "tool_call": call,
    }))
}

fn iteration(step_id: &str) -> u32 {
    step_id
        .rsplit_once('#')
        .and_then(|(_, n)| n.parse().ok())
        .unwrap_or(0)
}

/// Whether a dispatched step is a model call: the `llm` tool, or any step whose
/// arguments hold a conversation (`messages`).
fn is_model_step(tool: &str, args: &Value) -> bool {
    tool == crate::budget::LLM_TOOL || args.get("messages").is_some_and(Value::is_array)
}

/// The messages a conversation starts with: `system` (Anthropic's top-level field),
/// then `messages` with their text.
fn opening(args: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    if let Some(system) = args.get("system") {
        out.push(("system".to_owned(), text_of(system)));
    }
    for message in args
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let role = message["role"].as_str().unwrap_or("?").to_owned();
        out.push((role, text_of(&message["content"])));
    }
    out
}

/// The text of a message's content: a string, or the text blocks of a list of blocks
/// (other blocks as their JSON).
fn text_of(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .map(|b| match b.get("text").and_then(Value::as_str) {
                Some(text) => text.to_owned(),
                None => crate::json::canonical(b),
            })
            .collect::<Vec<_>>()
            .join("\n"),
        Value::Null => String::new(),
        other => crate::json::canonical(other),
    }
}

/// The tool calls of a recorded model answer (OpenAI's shape, which the `llm` handler
/// records for both APIs), arguments parsed when they are JSON text.
fn tool_calls(output: &Value) -> Vec<ToolCall> {
    output
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|call| {
            let arguments = match &call["function"]["arguments"] {
                Value::String(text) => {
                    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.clone()))
                }
                other => other.clone(),
            };
            ToolCall {
                id: call.get("id").and_then(Value::as_str).map(str::to_owned),
                tool: call["function"]["name"].as_str().unwrap_or("").to_owned(),
                arguments,
            }
        })
        .collect()
}

/// The model step and call a requested step answers, by its role: `(node of the model
/// step, call id, tool)`.
fn requested_call(
    asked: &mut BTreeMap<String, Asked>,
    role: &StepRole,
    node: &str,
    step_id: &str,
) -> Option<(String, Option<String>, String)> {
    let StepRole::Requested { by } = role else {
        return None;
    };
    let model = asked.get_mut(by)?;
    let taken = model.taken.entry(node.to_owned()).or_default();
    if !taken.iter().any(|s| s == step_id) {
        taken.push(step_id.to_owned());
        taken.sort_by_key(|id| iteration(id));
    }
    let rank = taken.iter().position(|s| s == step_id)?;
    let call = model.calls.iter().filter(|c| c.tool == node).nth(rank);
    Some((
        model.node.clone(),
        call.and_then(|c| c.id.clone()),
        node.to_owned(),
    ))
}

fn call_of(
    asked: &mut BTreeMap<String, Asked>,
    steps: &BTreeMap<String, (String, StepRole)>,
    step_id: &str,
) -> Option<(String, Option<String>, String)> {
    let (_, role) = steps.get(step_id)?;
    let node = step_id.rsplit_once('#').map_or(step_id, |(n, _)| n);
    requested_call(asked, role, node, step_id)
}

/// What the model reads of a tool step's output, as the fold writes it into the next
/// call's messages.
fn result_text(tool: &str, output: &Value) -> String {
    crate::mcp::model_text(tool, output)
}
