//! Conversations: an `llm` node a person talks to, turn after turn.
//!
//! A node with `conversation:` is a tool loop that does not end when the model answers
//! without tool calls: the run opens a wait for the person's next message (a signal, named
//! by `conversation.signal`), and when it arrives calls the model again with the
//! conversation so far. It ends on the person's `end`, at `max_turns`, when no message
//! arrives within `idle`, or when the model calls the node's `stop_tool`.
//!
//! Every model call is a step of the node (`chat#1`, `chat#2`, ...), with its own
//! operation id, class, budget charge and timeline entry. What keeps 200 turns inside a
//! run's limits is that no record carries the whole conversation: a turn's arguments hold
//! only the messages new since the model's previous call, plus a reference
//! (`conversation.history`) to the **transcript** the executor stored for that call (the
//! messages it was given, in the blob store). The executor resolves the reference, appends
//! the new messages, stores the result as the transcript of this call, and gives the model
//! the part of it the node's `context` says ([`prepare`]). The fold never reads a blob.
//! The state keeps the payloads of the latest turn only; an earlier turn's arguments and
//! outputs, its tool calls' and the message that started it are replaced by
//! [`COMPACTED`] when a later turn is dispatched (`evolve`): the events and the transcript
//! keep them.
//!
//! The fold's side is `decide/converse.rs`; this module holds the declaration, the
//! message a person sends, the marker a turn's arguments carry ([`Turn`]), and
//! [`prepare`], which the executor runs on a turn's resolved arguments.

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::duration::Millis;
use crate::graph::ModelApi;
use crate::state::{RunState, Step, StepStatus, WaitStatus};

/// The key of a turn's arguments that carries its [`Turn`] (Sortie's own: the executor
/// takes it out before the handler runs).
pub const ARG: &str = "conversation";
/// What an earlier turn's payloads are replaced with in the state.
pub const COMPACTED: &str = "$compacted";
/// Most turns a conversation may declare.
pub const MAX_TURNS: u32 = 1000;
/// Longest text of one message a person sends, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 32 * 1024;

/// `conversation: {signal, roles, max_turns, idle, context, stop_tool}` on an `llm` node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Conversation {
    /// The signal that carries the person's messages (`{text}`, or `{end: true}`).
    #[serde(default = "default_signal")]
    pub signal: String,
    /// A sender needs one of these roles (empty: any principal of the run's tenant).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub roles: Vec<String>,
    /// The conversation ends after the model's answer of this turn.
    #[serde(default = "default_max_turns")]
    pub max_turns: u32,
    /// How long the run waits for the person's next message before the conversation ends.
    #[serde(default = "default_idle")]
    pub idle: Millis,
    /// What of the conversation so far the model is given.
    #[serde(default, skip_serializing_if = "Context::is_all")]
    pub context: Context,
    /// A tool offered to the model that ends the conversation when it calls it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_tool: Option<String>,
}

fn default_signal() -> String {
    "message".into()
}

fn default_max_turns() -> u32 {
    50
}

fn default_idle() -> Millis {
    Millis(86_400_000)
}

/// `context: all | {last: N} | {last: N, summary: <node>}`: the whole conversation, its
/// last N turns, or a summary of the earlier turns (made by the detached node `summary`,
/// every N turns) and the turns after it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "ContextRepr", into = "ContextRepr")]
pub enum Context {
    #[default]
    All,
    Last(u32),
    Summary {
        last: u32,
        node: String,
    },
}

impl Context {
    fn is_all(&self) -> bool {
        *self == Context::All
    }

    /// The turns the model sees in full (`None`: all of them).
    pub fn last(&self) -> Option<u32> {
        match self {
            Context::All => None,
            Context::Last(n) | Context::Summary { last: n, .. } => Some(*n),
        }
    }

    /// The node that writes the summary, for `{summary}`.
    pub fn summary_node(&self) -> Option<&str> {
        match self {
            Context::Summary { node, .. } => Some(node),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
enum ContextRepr {
    Word(String),
    Last {
        last: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        summary: Option<String>,
    },
}

impl TryFrom<ContextRepr> for Context {
    type Error = String;

    fn try_from(repr: ContextRepr) -> Result<Self, String> {
        match repr {
            ContextRepr::Word(word) if word == "all" => Ok(Context::All),
            ContextRepr::Word(word) => Err(format!(
                "conversation.context is `all`, `{{last: N}}` or `{{last: N, summary: <node>}}`, not {word:?}"
            )),
            ContextRepr::Last { last, summary: None } => Ok(Context::Last(last)),
            ContextRepr::Last {
                last,
                summary: Some(node),
            } => Ok(Context::Summary { last, node }),
        }
    }
}

impl From<Context> for ContextRepr {
    fn from(value: Context) -> Self {
        match value {
            Context::All => ContextRepr::Word("all".into()),
            Context::Last(last) => ContextRepr::Last {
                last,
                summary: None,
            },
            Context::Summary { last, node } => ContextRepr::Last {
                last,
                summary: Some(node),
            },
        }
    }
}

/// A person's message: `{text}` (the next turn), `{end: true}` (the conversation ends), or
/// both (the model answers this last message, then the conversation ends).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub text: Option<String>,
    pub end: bool,
}

/// The message a signal's payload is, or why it is none (the answer names the field, never
/// the payload).
pub fn message(payload: &Value) -> Result<Message, String> {
    let Value::Object(map) = payload else {
        return Err("a message is an object: {\"text\": ...} or {\"end\": true}".into());
    };
    if let Some(other) = map.keys().find(|k| *k != "text" && *k != "end") {
        return Err(format!(
            "a message has the fields text and end, not {}",
            crate::limits::shown_id(other)
        ));
    }
    let text = match map.get("text") {
        None | Some(Value::Null) => None,
        Some(Value::String(text)) if text.trim().is_empty() => {
            return Err("payload.text is empty".into())
        }
        Some(Value::String(text)) if text.len() > MAX_MESSAGE_BYTES => {
            return Err(format!(
                "payload.text is longer than {MAX_MESSAGE_BYTES} bytes"
            ))
        }
        Some(Value::String(text)) => Some(text.clone()),
        Some(_) => return Err("payload.text must be a string".into()),
    };
    let end = match map.get("end") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(end)) => *end,
        Some(_) => return Err("payload.end must be a boolean".into()),
    };
    if text.is_none() && !end {
        return Err("a message has a text, or end: true".into());
    }
    Ok(Message { text, end })
}

/// What a turn's arguments carry under [`ARG`]: where the conversation stands, for the
/// executor (`history`, `context`, `summary`) and for the fold, which reads its own
/// earlier turns from the state without the graph (`turn`, `max_turns`, `stop_tool`,
/// `closing`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    /// 1 for the first turn; every tool-loop call of a turn has the turn's number.
    pub turn: u32,
    pub max_turns: u32,
    /// The transcript of the model's previous call (a blob reference), `null` in the
    /// first call: `messages` continue it.
    #[serde(default)]
    pub history: Value,
    /// The turns the model sees in full (absent: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_tool: Option<String>,
    /// The person's message of this turn said `end`: the conversation ends with its answer.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub closing: bool,
    /// The summary of the turns up to `summary.turns`, when the context has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<Summary>,
    /// Set on a summary step's arguments instead: summarize up to this turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summarize: Option<u32>,
    /// On a summary step: the model's answer that ends `history` (its last turn's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<Value>,
}

/// A summary of a conversation's first `turns` turns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    pub turns: u32,
    pub text: String,
}

impl Turn {
    /// The marker `args` carry, if they are a turn's (or a summary's).
    pub fn of(args: &Value) -> Option<Turn> {
        serde_json::from_value(args.get(ARG)?.clone()).ok()
    }

    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

/// The spec of the tool that ends a conversation, in the node's API.
pub fn stop_tool_spec(api: ModelApi, name: &str) -> Value {
    let description = "Ends the conversation: call it when the person's request is \
                       complete or they said goodbye.";
    let parameters = json!({
        "type": "object",
        "properties": {"reason": {"type": "string", "description": "Why it ends."}},
        "required": [],
    });
    match api {
        ModelApi::OpenAi => json!({
            "type": "function",
            "function": {"name": name, "description": description, "parameters": parameters},
        }),
        ModelApi::Anthropic => {
            json!({"name": name, "description": description, "input_schema": parameters})
        }
    }
}

/// A person's text as the next user message (the same in both APIs).
pub fn user_message(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

/// Whether `output` (a model's answer) calls the tool `stop_tool`.
pub fn calls_stop_tool(output: &Value, stop_tool: Option<&str>) -> bool {
    let Some(stop) = stop_tool else { return false };
    output
        .get("tool_calls")
        .and_then(Value::as_array)
        .is_some_and(|calls| calls.iter().any(|c| c["function"]["name"] == stop))
}

/// How a conversation whose latest model call is `latest` ended (`person`, `max_turns`,
/// `idle`, `model`), or `None` while it goes on. Read from the state alone: the turn's
/// marker and the wait for the message after it.
pub fn ended_by(run: &RunState, latest: &Step) -> Option<&'static str> {
    if latest.status != StepStatus::Succeeded {
        return None;
    }
    let turn = Turn::of(&latest.args)?;
    let output = latest.output.as_ref()?;
    if calls_stop_tool(output, turn.stop_tool.as_deref()) {
        return Some("model");
    }
    let has_calls = output
        .get("tool_calls")
        .and_then(Value::as_array)
        .is_some_and(|c| !c.is_empty());
    if has_calls {
        return None;
    }
    if turn.closing {
        return Some("person");
    }
    match run.waits.get(&latest.step_id) {
        Some(wait) if wait.status == WaitStatus::Done && wait.received.is_empty() => Some("idle"),
        Some(wait) if wait.status == WaitStatus::Done => {
            let said = wait.received.first().map(|r| message(&r.payload));
            match said {
                Some(Ok(Message {
                    text: None,
                    end: true,
                })) => Some("person"),
                _ => None,
            }
        }
        Some(_) => None,
        None if turn.turn >= turn.max_turns => Some("max_turns"),
        None => None,
    }
}

/// The output of a conversation that ended: the model's last answer with `turns` and
/// `ended_by`.
pub fn ended_output(latest: &Step, by: &str) -> Value {
    let mut output = latest.output.clone().unwrap_or(Value::Null);
    let turns = Turn::of(&latest.args).map_or(0, |t| t.turn);
    if let Value::Object(map) = &mut output {
        map.insert("turns".into(), json!(turns));
        map.insert("ended_by".into(), json!(by));
    }
    output
}

/// A turn's or summary's arguments as the executor hands them to the handler, and the
/// transcript it stores for this call.
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    pub args: Value,
    /// The messages this call continues the conversation with: `history` and the new
    /// `messages` (`None` for a summary, which adds nothing to the conversation).
    pub transcript: Option<Value>,
}

/// Runs on a conversation call's arguments after their blob references were resolved
/// (`history` is then the previous transcript, a list of messages): the whole
/// conversation is `history` followed by `messages`, the model is given what the
/// context lets it see, and a summary call gets the turns it summarizes as text.
/// Arguments without the [`ARG`] marker are returned as they are.
pub fn prepare(mut args: Value, api: ModelApi) -> Result<Prepared, String> {
    let Some(turn) = Turn::of(&args) else {
        return Ok(Prepared {
            args,
            transcript: None,
        });
    };
    let Value::Object(map) = &mut args else {
        return Err("a conversation's arguments are an object".into());
    };
    map.remove(ARG);
    let history = match &turn.history {
        Value::Null => Vec::new(),
        Value::Array(items) => items.clone(),
        _ => return Err("conversation.history is not a list of messages (not resolved?)".into()),
    };
    let mut whole = history;
    if let Some(upto) = turn.summarize {
        // A summary call: its own `messages` are its instructions; what it summarizes is
        // the transcript and the answer that ends it, as text.
        whole.extend(turn.answer.iter().cloned());
        let covered = turn.summary.as_ref().map_or(0, |s| s.turns);
        let text = summary_request(&whole, covered, upto, turn.summary.as_ref());
        let mut messages = match map.remove("messages") {
            Some(Value::Array(items)) if !items.is_empty() => items,
            _ => vec![
                json!({"role": "system", "content": "Summarize the conversation below \
                 for the assistant that continues it: the facts, decisions and open \
                 questions, in a few sentences."}),
            ],
        };
        if api == ModelApi::Anthropic {
            messages.retain(|m| m["role"] != "system");
            map.entry("system").or_insert_with(|| {
                json!("Summarize the conversation for the assistant that continues it.")
            });
        }
        messages.push(user_message(&text));
        map.insert("messages".into(), Value::Array(messages));
        return Ok(Prepared {
            args,
            transcript: None,
        });
    }
    match map.remove("messages") {
        None | Some(Value::Null) => {}
        Some(Value::Array(items)) => whole.extend(items),
        Some(_) => return Err("messages must be a list".into()),
    }
    let (lead, turns) = split_turns(&whole);
    let skip = match (&turn.summary, turn.last) {
        (Some(summary), _) => (summary.turns as usize).min(turns.len()),
        (None, Some(last)) => turns.len().saturating_sub(last as usize),
        (None, None) => 0,
    };
    let mut given: Vec<Value> = lead.to_vec();
    if let Some(summary) = &turn.summary {
        let note = format!(
            "Summary of the conversation's first {} turns: {}",
            summary.turns, summary.text
        );
        match api {
            ModelApi::OpenAi => given.push(json!({"role": "system", "content": note})),
            ModelApi::Anthropic => {
                let system = match map.get("system").and_then(Value::as_str) {
                    Some(system) => format!("{system}\n\n{note}"),
                    None => note,
                };
                map.insert("system".into(), Value::String(system));
            }
        }
    }
    for messages in &turns[skip..] {
        given.extend(messages.iter().cloned());
    }
    map.insert("messages".into(), Value::Array(given));
    Ok(Prepared {
        args,
        transcript: Some(Value::Array(whole)),
    })
}

/// The messages before the first turn (system and developer messages), and the turns:
/// each begins with a person's message (a `user` message that is not tool results).
pub fn split_turns(messages: &[Value]) -> (&[Value], Vec<&[Value]>) {
    let starts: Vec<usize> = messages
        .iter()
        .enumerate()
        .filter(|(_, m)| is_turn_start(m))
        .map(|(i, _)| i)
        .collect();
    let Some(&first) = starts.first() else {
        return (messages, Vec::new());
    };
    let mut turns = Vec::with_capacity(starts.len());
    for (k, &start) in starts.iter().enumerate() {
        let end = starts.get(k + 1).copied().unwrap_or(messages.len());
        turns.push(&messages[start..end]);
    }
    (&messages[..first], turns)
}

/// A person's message: role `user`, not a list of `tool_result` blocks.
fn is_turn_start(message: &Value) -> bool {
    if message["role"] != "user" {
        return false;
    }
    match &message["content"] {
        Value::Array(blocks) => !blocks.iter().any(|b| b["type"] == "tool_result"),
        _ => true,
    }
}

/// The text a summary call is given: the summary so far and the turns after it up to
/// `upto`, one line a message.
fn summary_request(whole: &[Value], covered: u32, upto: u32, summary: Option<&Summary>) -> String {
    let (_, turns) = split_turns(whole);
    let mut text = String::new();
    if let Some(summary) = summary {
        text.push_str(&format!(
            "Summary of the first {} turns:\n{}\n\n",
            summary.turns, summary.text
        ));
    }
    text.push_str("Conversation to add to it:\n");
    let from = (covered as usize).min(turns.len());
    let to = (upto as usize).min(turns.len());
    for messages in turns.get(from..to).unwrap_or_default() {
        for m in messages.iter() {
            let role = m["role"].as_str().unwrap_or("?");
            text.push_str(role);
            text.push_str(": ");
            text.push_str(&message_text(m));
            text.push('\n');
        }
    }
    text
}

/// A message's text: its content string, its text blocks, or its tool calls named.
fn message_text(message: &Value) -> String {
    let mut parts: Vec<String> = Vec::new();
    match &message["content"] {
        Value::String(text) => parts.push(text.clone()),
        Value::Array(blocks) => {
            for block in blocks {
                match block["type"].as_str() {
                    Some("text") => parts.push(block["text"].as_str().unwrap_or("").to_owned()),
                    Some("tool_use") => parts.push(format!("(calls {})", block["name"])),
                    Some("tool_result") => {
                        parts.push(format!("(tool result: {})", block["content"]))
                    }
                    _ => {}
                }
            }
        }
        _ => {}
    }
    for call in message["tool_calls"].as_array().into_iter().flatten() {
        parts.push(format!("(calls {})", call["function"]["name"]));
    }
    parts.join(" ")
}

/// Replaces a compacted turn's payload (see the module's doc).
pub fn compacted() -> Value {
    let mut map = Map::new();
    map.insert(COMPACTED.into(), Value::Bool(true));
    Value::Object(map)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn m(role: &str, content: &str) -> Value {
        json!({"role": role, "content": content})
    }

    #[test]
    fn messages_are_text_or_end() {
        assert_eq!(
            message(&json!({"text": "hi"})).unwrap(),
            Message {
                text: Some("hi".into()),
                end: false
            }
        );
        assert!(message(&json!({"end": true})).unwrap().end);
        assert!(message(&json!({})).is_err());
        assert!(message(&json!({"text": 3})).is_err());
        assert!(message(&json!({"text": "hi", "role": "system"})).is_err());
        assert!(message(&json!({"text": "x".repeat(MAX_MESSAGE_BYTES + 1)})).is_err());
        assert!(message(&json!("hi")).is_err());
    }

    #[test]
    fn the_model_sees_the_last_turns_whole() {
        let history = json!([
            m("system", "be brief"),
            m("user", "one"),
            m("assistant", "1"),
            m("user", "two"),
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "function": {"name": "look"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "found"},
            m("assistant", "2"),
        ]);
        let args = json!({
            "messages": [m("user", "three")],
            "temperature": 0,
            ARG: {"turn": 3, "max_turns": 10, "history": history, "last": 2},
        });
        let prepared = prepare(args, ModelApi::OpenAi).unwrap();
        let given = prepared.args["messages"].as_array().unwrap();
        assert_eq!(given[0], m("system", "be brief"));
        assert_eq!(
            given[1],
            m("user", "two"),
            "turn two is kept whole: {given:?}"
        );
        assert_eq!(given.len(), 6);
        assert_eq!(prepared.args["temperature"], 0);
        assert!(prepared.args.get(ARG).is_none());
        assert_eq!(prepared.transcript.unwrap().as_array().unwrap().len(), 8);
    }

    #[test]
    fn a_summary_replaces_the_turns_it_covers() {
        let history = json!([
            m("user", "one"),
            m("assistant", "1"),
            m("user", "two"),
            m("assistant", "2")
        ]);
        let args = json!({
            "messages": [m("user", "three")],
            ARG: {"turn": 3, "max_turns": 10, "history": history, "last": 1,
                  "summary": {"turns": 2, "text": "they counted"}},
        });
        let prepared = prepare(args.clone(), ModelApi::OpenAi).unwrap();
        let given = prepared.args["messages"].as_array().unwrap();
        assert_eq!(given.len(), 2);
        assert!(given[0]["content"]
            .as_str()
            .unwrap()
            .contains("they counted"));
        let anthropic = prepare(args, ModelApi::Anthropic).unwrap();
        assert!(anthropic.args["system"]
            .as_str()
            .unwrap()
            .contains("they counted"));
        assert_eq!(anthropic.args["messages"].as_array().unwrap().len(), 1);
    }

    #[test]
    fn a_summary_call_gets_the_turns_to_summarize_as_text() {
        let history = json!([
            m("user", "one"),
            m("assistant", "1"),
            m("user", "two"),
            m("assistant", "2")
        ]);
        let args = json!({
            "messages": [m("system", "Summarize tersely.")],
            ARG: {"turn": 3, "max_turns": 10, "history": history, "summarize": 2,
                  "summary": {"turns": 1, "text": "they began"}, "answer": m("assistant", "2b")},
        });
        let prepared = prepare(args, ModelApi::OpenAi).unwrap();
        assert_eq!(prepared.transcript, None);
        let messages = prepared.args["messages"].as_array().unwrap();
        assert_eq!(messages[0], m("system", "Summarize tersely."));
        let text = messages.last().unwrap()["content"].as_str().unwrap();
        assert!(
            text.contains("they began") && text.contains("user: two"),
            "{text}"
        );
        assert!(text.contains("assistant: 2b"), "{text}");
        assert!(!text.contains("user: one"), "{text}");
    }

    #[test]
    fn arguments_without_a_marker_pass_through() {
        let args = json!({"messages": [m("user", "hi")]});
        assert_eq!(prepare(args.clone(), ModelApi::OpenAi).unwrap().args, args);
    }
}
