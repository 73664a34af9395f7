//! A scripted model for dev and tests, in both APIs Sortie speaks: OpenAI chat
//! completions (`POST /v1/chat/completions`) and Anthropic Messages (`POST /v1/messages`,
//! tool calls as `tool_use` blocks, results read from `tool_result` blocks, usage as
//! `input_tokens`/`output_tokens`; before a tool call it says which tool it calls, in a
//! text block).
//!
//! The script is decided by the request alone, so it is deterministic and holds for any
//! number of concurrent conversations (and for a replay, which never calls it): a request
//! with no `role: tool` message gets a tool call to the first offered tool, one with a tool
//! message a call to the second, and any later request (or one offering fewer tools) the
//! final text answer. Arguments are filled from each tool's JSON-schema parameters:
//! `"fake-<name>"` for a string, `1` for a number or integer, `true` for a boolean.
//!
//! It talks, too (conversations): the script counts only what came after the person's
//! last message, a later turn's answer is [`REPLY`] and that message, and a message
//! saying "goodbye" gets a call to [`STOP_TOOL`] when it is offered (never otherwise).
//!
//! `usage` is derived from the request (prompt tokens: a quarter of its characters; 12
//! completion tokens). Every request and the `usage` answered are kept:
//! `GET /v1/fake/requests` lists them, oldest first, for tests to assert on.

use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// The text of the scripted final answer.
pub const FINAL_ANSWER: &str = "Done: both tools answered.";
/// What a later turn's answer starts with, before the person's message.
pub const REPLY: &str = "You said: ";
/// The tool that ends a conversation, as the dev graphs name it.
pub const STOP_TOOL: &str = "end_conversation";

/// Completion tokens of every answer.
pub const COMPLETION_TOKENS: u64 = 12;

/// One call the fake model answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Exchange {
    /// The request body as received.
    pub request: Value,
    /// The `usage` answered.
    pub usage: Value,
    /// The answer's message.
    pub message: Value,
}

/// The fake model's memory of what it was asked.
#[derive(Debug, Default)]
pub struct FakeModel {
    exchanges: Mutex<Vec<Exchange>>,
}

impl FakeModel {
    pub fn new() -> Arc<FakeModel> {
        Arc::new(FakeModel::default())
    }

    /// Every call so far, oldest first.
    pub fn exchanges(&self) -> Vec<Exchange> {
        self.exchanges.lock().map(|e| e.clone()).unwrap_or_default()
    }

    /// The answer to one Anthropic Messages request (the same script), recorded.
    pub fn answer_anthropic(&self, request: &Value) -> Result<Value, String> {
        let messages = request
            .get("messages")
            .and_then(Value::as_array)
            .ok_or("messages must be an array")?;
        if request.get("max_tokens").and_then(Value::as_u64).is_none() {
            return Err("max_tokens is required".into());
        }
        let tools = request
            .get("tools")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let turn = Turn::of(messages);
        let answered = messages[turn.since..]
            .iter()
            .filter(|m| m["role"] == "user")
            .filter_map(|m| m["content"].as_array())
            .flatten()
            .filter(|b| b["type"] == "tool_result")
            .count();
        let (tools, stop) = turn.tools(tools, |t| &t["name"]);
        let pick = match stop {
            Some(stop) if turn.goodbye() && answered == 0 => Some(stop),
            _ => tools.get(answered).filter(|_| answered < 2).cloned(),
        };
        let (content, stop_reason) = match pick {
            Some(tool) => {
                let name = tool["name"].as_str().unwrap_or_default();
                let input = arguments(&tool["input_schema"]);
                (
                    json!([
                        {"type": "text", "text": format!("I will call {name}.")},
                        {"type": "tool_use", "id": format!("toolu_{}_{name}", answered + 1), "name": name, "input": input},
                    ]),
                    "tool_use",
                )
            }
            None => (json!([{"type": "text", "text": turn.answer()}]), "end_turn"),
        };
        let input_tokens = request.to_string().len() as u64 / 4;
        let usage = json!({"input_tokens": input_tokens, "output_tokens": COMPLETION_TOKENS});
        let message = json!({"role": "assistant", "content": content});
        if let Ok(mut exchanges) = self.exchanges.lock() {
            exchanges.push(Exchange {
                request: request.clone(),
                usage: usage.clone(),
                message: message.clone(),
            });
        }
        Ok(json!({
            "id": format!("msg_fake_{}", self.exchanges().len()),
            "type": "message",
            "role": "assistant",
            "model": request.get("model").cloned().unwrap_or(json!("fake")),
            "content": content,
            "stop_reason": stop_reason,
            "usage": usage,
        }))
    }

    /// The answer to one request (the script), with the exchange recorded.
    pub fn answer(&self, request: &Value) -> Result<Value, String> {
        let messages = request
            .get("messages")
            .and_then(Value::as_array)
            .ok_or("messages must be an array")?;
        let tools = request
            .get("tools")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let turn = Turn::of(messages);
        let answered = messages[turn.since..]
            .iter()
            .filter(|m| m["role"] == "tool")
            .count();
        let (tools, stop) = turn.tools(tools, |t| &t["function"]["name"]);
        let pick = match stop {
            Some(stop) if turn.goodbye() && answered == 0 => Some(stop),
            _ => tools.get(answered).filter(|_| answered < 2).cloned(),
        };
        let message = match pick {
            Some(tool) => {
                let name = tool["function"]["name"].as_str().unwrap_or_default();
                let arguments = arguments(&tool["function"]["parameters"]);
                json!({
                    "role": "assistant",
                    "content": null,
                    "tool_calls": [{
                        "id": format!("call_{}_{name}", answered + 1),
                        "type": "function",
                        "function": {"name": name, "arguments": arguments.to_string()},
                    }],
                })
            }
            None => json!({"role": "assistant", "content": turn.answer()}),
        };
        let prompt_tokens = request.to_string().len() as u64 / 4;
        let usage = json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": COMPLETION_TOKENS,
            "total_tokens": prompt_tokens + COMPLETION_TOKENS,
        });
        let finish_reason = if message.get("tool_calls").is_some() {
            "tool_calls"
        } else {
            "stop"
        };
        let model = request.get("model").cloned().unwrap_or(json!("fake"));
        if let Ok(mut exchanges) = self.exchanges.lock() {
            exchanges.push(Exchange {
                request: request.clone(),
                usage: usage.clone(),
                message: message.clone(),
            });
        }
        Ok(json!({
            "id": format!("chatcmpl-fake-{}", self.exchanges().len()),
            "object": "chat.completion",
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
            "usage": usage,
        }))
    }
}

/// Where a request's conversation stands: the person's messages, and where the last one is.
struct Turn {
    /// Messages from the person (a `user` message that is not tool results).
    said: usize,
    /// The index of the person's last message (0 if none).
    since: usize,
    last: Option<String>,
}

impl Turn {
    fn of(messages: &[Value]) -> Turn {
        let mut turn = Turn {
            said: 0,
            since: 0,
            last: None,
        };
        for (i, message) in messages.iter().enumerate() {
            if message["role"] != "user" {
                continue;
            }
            let text = match &message["content"] {
                Value::String(text) => Some(text.clone()),
                Value::Array(blocks) if !blocks.iter().any(|b| b["type"] == "tool_result") => {
                    Some(blocks.iter().filter_map(|b| b["text"].as_str()).collect())
                }
                _ => None,
            };
            if let Some(text) = text {
                turn.said += 1;
                turn.since = i;
                turn.last = Some(text);
            }
        }
        turn
    }

    fn goodbye(&self) -> bool {
        self.last
            .as_deref()
            .is_some_and(|t| t.to_lowercase().contains("goodbye"))
    }

    /// The first turn's answer is [`FINAL_ANSWER`]; a later one repeats the message.
    fn answer(&self) -> String {
        match (&self.last, self.said) {
            (Some(text), 2..) => format!("{REPLY}{text}"),
            _ => FINAL_ANSWER.to_owned(),
        }
    }

    /// The offered tools the script calls, and the stop tool if offered.
    fn tools(
        &self,
        tools: Vec<Value>,
        name: impl Fn(&Value) -> &Value,
    ) -> (Vec<Value>, Option<Value>) {
        let (stop, others): (Vec<Value>, Vec<Value>) =
            tools.into_iter().partition(|t| name(t) == STOP_TOOL);
        (others, stop.into_iter().next())
    }
}

/// Arguments for a tool, from its JSON-schema parameters.
fn arguments(parameters: &Value) -> Value {
    let mut out = serde_json::Map::new();
    if let Some(properties) = parameters.get("properties").and_then(Value::as_object) {
        for (name, schema) in properties {
            let value = match schema.get("type").and_then(Value::as_str) {
                Some("number" | "integer") => json!(1),
                Some("boolean") => json!(true),
                _ => json!(format!("fake-{name}")),
            };
            out.insert(name.clone(), value);
        }
    }
    Value::Object(out)
}

/// The fake model's routes.
pub fn router(model: Arc<FakeModel>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(complete))
        .route("/v1/messages", post(messages))
        .route("/v1/fake/requests", get(requests))
        .with_state(model)
}

async fn complete(State(model): State<Arc<FakeModel>>, Json(request): Json<Value>) -> Response {
    match model.answer(&request) {
        Ok(answer) => Json(answer).into_response(),
        Err(error) => (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": {"message": error}})),
        )
            .into_response(),
    }
}

async fn messages(State(model): State<Arc<FakeModel>>, Json(request): Json<Value>) -> Response {
    match model.answer_anthropic(&request) {
        Ok(answer) => Json(answer).into_response(),
        Err(error) => (
            StatusCode::BAD_REQUEST,
            Json(json!({"type": "error", "error": {"type": "invalid_request_error", "message": error}})),
        )
            .into_response(),
    }
}

async fn requests(State(model): State<Arc<FakeModel>>) -> Json<Vec<Exchange>> {
    Json(model.exchanges())
}

/// Serves the fake model alone on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    model: Arc<FakeModel>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(model))
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn tool(name: &str) -> Value {
        json!({"type": "function", "function": {"name": name, "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "string"}, "amount": {"type": "number"}}
        }}})
    }

    #[test]
    fn the_script_calls_the_first_tool_then_the_second_then_answers() {
        let model = FakeModel::default();
        let mut request = json!({
            "model": "fake",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [tool("a"), tool("b")],
        });
        let first = model.answer(&request).expect("first");
        let call = &first["choices"][0]["message"]["tool_calls"][0];
        assert_eq!(call["function"]["name"], "a");
        assert_eq!(
            serde_json::from_str::<Value>(call["function"]["arguments"].as_str().unwrap()).unwrap(),
            json!({"order_id": "fake-order_id", "amount": 1})
        );
        request["messages"]
            .as_array_mut()
            .unwrap()
            .push(json!({"role": "tool", "tool_call_id": "call_1_a", "content": "{}"}));
        let second = model.answer(&request).expect("second");
        assert_eq!(
            second["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
            "b"
        );
        request["messages"]
            .as_array_mut()
            .unwrap()
            .push(json!({"role": "tool", "tool_call_id": "call_2_b", "content": "{}"}));
        let last = model.answer(&request).expect("last");
        assert_eq!(last["choices"][0]["message"]["content"], FINAL_ANSWER);
        assert_eq!(last["choices"][0]["finish_reason"], "stop");
        assert_eq!(model.exchanges().len(), 3);
        assert_eq!(
            model.exchanges()[2].usage["completion_tokens"],
            COMPLETION_TOKENS
        );
    }

    #[test]
    fn a_later_turn_repeats_the_message_and_goodbye_calls_the_stop_tool() {
        let model = FakeModel::default();
        let stop = json!({"type": "function", "function": {"name": STOP_TOOL, "parameters": {"type": "object"}}});
        let mut request = json!({
            "model": "fake",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [stop],
        });
        let first = model.answer(&request).unwrap();
        assert_eq!(first["choices"][0]["message"]["content"], FINAL_ANSWER);
        let messages = request["messages"].as_array_mut().unwrap();
        messages.push(json!({"role": "assistant", "content": FINAL_ANSWER}));
        messages.push(json!({"role": "user", "content": "order 7"}));
        let second = model.answer(&request).unwrap();
        assert_eq!(
            second["choices"][0]["message"]["content"],
            "You said: order 7"
        );
        let messages = request["messages"].as_array_mut().unwrap();
        messages.push(json!({"role": "user", "content": "Goodbye!"}));
        let last = model.answer(&request).unwrap();
        assert_eq!(
            last["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
            STOP_TOOL
        );
    }
}
