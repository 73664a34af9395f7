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
//! `usage` is derived from the request (prompt tokens: a quarter of its characters, its
//! `stream` and `stream_options` left out; 12 completion tokens). Every request and the
//! message and `usage` answered are kept: `GET /v1/fake/requests` lists them, oldest first,
//! for tests to assert on.
//!
//! It streams (server-sent events) a request with `"stream": true`, in that API's format:
//! OpenAI `chat.completion.chunk`s ending with `data: [DONE]`, the usage in a last chunk
//! of its own when `stream_options.include_usage` asks for it; Anthropic's
//! `message_start`, `ping`, each block's `content_block_start`, deltas and
//! `content_block_stop`, `message_delta` (stop reason, output tokens) and
//! `message_stop`. The answer is the one it gives unstreamed (same text, tool calls and
//! usage), the text a delta per word and a tool call's arguments in pieces. A model
//! whose name ends in `-slow` (e.g. `fake-agent-slow`) waits [`SLOW_PAUSE`] between
//! deltas, so a test sees text arrive before the step ends; any other streams at once.

mod anthropic;
mod openai;
mod stream;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use self::anthropic::anthropic_events;
use self::openai::openai_events;
use self::stream::event_stream;

/// The text of the scripted final answer.
pub const FINAL_ANSWER: &str = "Done: both tools answered.";
/// What a later turn's answer starts with, before the person's message.
pub const REPLY: &str = "You said: ";
/// The tool that ends a conversation, as the dev graphs name it.
pub const STOP_TOOL: &str = "end_conversation";

/// Completion tokens of every answer.
pub const COMPLETION_TOKENS: u64 = 12;

/// What a model name ends with to stream slowly.
pub const SLOW_SUFFIX: &str = "-slow";
/// The wait between a slow model's deltas.
pub const SLOW_PAUSE: Duration = Duration::from_millis(200);

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
}

/// A request's prompt tokens: a quarter of its characters, whether it streams left out
/// (a streamed answer's usage is the unstreamed one's).
fn prompt_tokens(request: &Value) -> u64 {
    let mut counted = request.clone();
    if let Some(fields) = counted.as_object_mut() {
        fields.remove("stream");
        fields.remove("stream_options");
    }
    counted.to_string().len() as u64 / 4
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
        Ok(answer) if request["stream"] == true => {
            let usage = request["stream_options"]["include_usage"] == true;
            event_stream(openai_events(&answer, usage), &request)
        }
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
        Ok(answer) if request["stream"] == true => {
            event_stream(anthropic_events(&answer), &request)
        }
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

    use super::stream::words;
    use super::*;

    pub fn tool(name: &str) -> Value {
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

    /// The executor's `llm` handler against the served fake model, both APIs through a
    /// whole script: streamed, the recorded output is the unstreamed one and the text
    /// arrives a word at a time; a `-slow` model's first words arrive well before its end.
    #[tokio::test]
    async fn the_llm_handler_streams_the_script_and_records_the_same_output() {
        use sortie_executor::{Call, Delta, Progress, StepHandler as _};
        use std::time::Instant;

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}/v1", listener.local_addr().unwrap());
        let fake = FakeModel::new();
        tokio::spawn(serve(listener, fake.clone(), std::future::pending()));
        let llm = sortie_executor::handlers::Llm::new(sortie_executor::handlers::http_client());
        let call = |api: &str, model: &str, stream: bool, messages: &Value| {
            let tools = if api == "anthropic" {
                json!([{"name": "a", "input_schema": {"type": "object", "properties": {"order_id": {"type": "string"}}}},
                       {"name": "b", "input_schema": {"type": "object"}}])
            } else {
                json!([tool("a"), tool("b")])
            };
            Call {
                operation_id: "op".into(),
                attempt: 1,
                tenant: "t".into(),
                run_id: "r".into(),
                step_id: "think#1".into(),
                node: "think".into(),
                tool: "llm".into(),
                side_effect: sortie_wire::records::SideEffectClass::Pure,
                args: json!({"messages": messages, "tools": tools}),
                config: json!({"base_url": base, "model": model, "api": api, "stream": stream}),
                timeout: Duration::from_secs(20),
                progress: Progress::default(),
            }
        };
        for api in ["openai", "anthropic"] {
            let mut messages = json!([{"role": "user", "content": "hi"}]);
            for turn in 0..3 {
                let whole = llm
                    .call(&call(api, "fake", false, &messages))
                    .await
                    .unwrap();
                let mut streamed = call(api, "fake", true, &messages);
                let seen = Arc::new(Mutex::new(Vec::new()));
                let sink = seen.clone();
                streamed.progress = Progress::new(move |delta| {
                    if let Delta::Text(text) = delta {
                        sink.lock().unwrap().push(text);
                    }
                });
                let output = llm.call(&streamed).await.unwrap();
                assert_eq!(output, whole, "{api}, turn {turn}");
                let seen = seen.lock().unwrap().clone();
                match output["content"].as_str() {
                    Some(text) => {
                        assert_eq!(seen.concat(), text, "{api}, turn {turn}");
                        assert!(seen.len() > 1, "{api}, turn {turn}: {seen:?}");
                    }
                    None => assert!(seen.is_empty()),
                }
                // The next request answers the call (or, after the text, ends the script).
                let call_id = output["tool_calls"][0]["id"].clone();
                let next = if api == "anthropic" {
                    vec![
                        json!({"role": "assistant", "content": output["blocks"]}),
                        json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": "{}"}]}),
                    ]
                } else {
                    vec![
                        json!({"role": "assistant", "content": output["content"], "tool_calls": output["tool_calls"]}),
                        json!({"role": "tool", "tool_call_id": call_id, "content": "{}"}),
                    ]
                };
                messages.as_array_mut().unwrap().extend(next);
            }
            let exchanges = fake.exchanges();
            let last = &exchanges[exchanges.len() - 2..];
            assert_eq!(last[0].usage, last[1].usage, "{api}");
            assert_eq!(last[0].message, last[1].message, "{api}");
        }
        assert_eq!(fake.exchanges().len(), 12);

        // Slow: the first text arrives at least a pause per later delta before the end.
        let mut slow = call(
            "openai",
            "fake-agent-slow",
            true,
            &json!([{"role": "user", "content": "hi"}]),
        );
        slow.args["tools"] = json!([]);
        let first = Arc::new(Mutex::new(None));
        let sink = first.clone();
        slow.progress = Progress::new(move |_| {
            sink.lock().unwrap().get_or_insert_with(Instant::now);
        });
        let output = llm.call(&slow).await.unwrap();
        let ended = Instant::now();
        assert_eq!(output["content"], FINAL_ANSWER);
        assert_eq!(output["model"], "fake-agent-slow");
        let first = first.lock().unwrap().expect("text arrived");
        let pauses = words(FINAL_ANSWER).len() as u32 - 1;
        assert!(
            ended - first >= SLOW_PAUSE * pauses - Duration::from_millis(50),
            "{:?}",
            ended - first
        );
    }
}
