//! Anthropic Messages: the request, the recorded output, and a streamed answer's events
//! put back together.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use super::stream::{self, Assembly, Event};
use super::LlmConfig;
use crate::handler::HandlerError;
use crate::progress::Progress;

/// The Anthropic API version sent with every request.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";
/// `max_tokens` of an Anthropic request whose args give none (the API requires one).
pub const ANTHROPIC_DEFAULT_MAX_TOKENS: u64 = 1024;

/// Anthropic request fields taken from the step's args besides `messages` and `tools`.
const ANTHROPIC_PASSED_THROUGH: &[&str] = &[
    "system",
    "tool_choice",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "metadata",
];

pub(super) fn anthropic_body(
    config: &LlmConfig,
    args: &Value,
    stream: bool,
) -> Result<Value, HandlerError> {
    let messages = args
        .get("messages")
        .filter(|m| m.is_array())
        .ok_or_else(|| HandlerError::permanent("bad_args", "llm args.messages must be an array"))?;
    let mut body = Map::new();
    body.insert("model".into(), Value::String(config.model.clone()));
    body.insert("messages".into(), messages.clone());
    body.insert(
        "max_tokens".into(),
        args.get("max_tokens")
            .filter(|v| !v.is_null())
            .cloned()
            .unwrap_or_else(|| Value::from(ANTHROPIC_DEFAULT_MAX_TOKENS)),
    );
    if let Some(tools) = args.get("tools").filter(|t| !t.is_null()) {
        body.insert("tools".into(), tools.clone());
    }
    for field in ANTHROPIC_PASSED_THROUGH {
        if let Some(value) = args.get(*field).filter(|v| !v.is_null()) {
            body.insert((*field).into(), value.clone());
        }
    }
    if stream {
        body.insert("stream".into(), Value::Bool(true));
    }
    Ok(Value::Object(body))
}

/// The recorded output of an Anthropic answer (see the module doc of [`super`]).
pub(super) fn anthropic_output(response: &Value) -> Result<Value, HandlerError> {
    let blocks = response
        .get("content")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            HandlerError::permanent(
                "bad_response",
                format!(
                    "no content blocks in the model's answer: {}",
                    crate::handlers::receiver_text(&response.to_string())
                ),
            )
        })?;
    let texts: Vec<&str> = blocks
        .iter()
        .filter(|b| b["type"] == "text")
        .filter_map(|b| b["text"].as_str())
        .collect();
    let tool_calls: Vec<Value> = blocks
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .map(|b| {
            json!({
                "id": b.get("id").cloned().unwrap_or(Value::Null),
                "type": "function",
                "function": {
                    "name": b.get("name").cloned().unwrap_or(Value::Null),
                    "arguments": b.get("input").cloned().unwrap_or_else(|| json!({})),
                },
            })
        })
        .collect();
    Ok(json!({
        "content": if texts.is_empty() { Value::Null } else { Value::String(texts.join("\n")) },
        "tool_calls": tool_calls,
        "blocks": blocks,
        "usage": anthropic_usage(response.get("usage")),
        "model": response.get("model").cloned().unwrap_or(Value::Null),
        "finish_reason": response.get("stop_reason").cloned().unwrap_or(Value::Null),
    }))
}

/// Anthropic's usage with the counts budgets charge added: `prompt_tokens` = input +
/// cache creation + cache read tokens (what OpenAI's prompt tokens count), and
/// `completion_tokens` = output tokens. A count that is not a whole number is copied as
/// it came, so the fold refuses the step (`usage_refused`) rather than charge a guess.
pub(super) fn anthropic_usage(usage: Option<&Value>) -> Value {
    let Some(Value::Object(usage)) = usage else {
        return usage.cloned().unwrap_or(Value::Null);
    };
    let mut out = usage.clone();
    let mut prompt = Some(0u64);
    let mut bad: Option<Value> = None;
    for key in [
        "input_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
    ] {
        match usage.get(key) {
            None | Some(Value::Null) => {}
            Some(value) => match value.as_u64() {
                Some(n) => prompt = prompt.and_then(|p| p.checked_add(n)),
                None => bad = Some(value.clone()),
            },
        }
    }
    let prompt = match (bad, prompt) {
        (Some(bad), _) => bad,
        (None, Some(sum)) => Value::from(sum),
        (None, None) => Value::from(u64::MAX),
    };
    out.insert("prompt_tokens".into(), prompt);
    out.insert(
        "completion_tokens".into(),
        usage.get("output_tokens").cloned().unwrap_or(Value::Null),
    );
    Value::Object(out)
}

/// A streamed message: `message_start`, each content block's `content_block_start`,
/// deltas and `content_block_stop`, `message_delta` (stop reason, final usage) and
/// `message_stop`. `ping` and event types this does not know are skipped, as the API
/// asks of clients.
#[derive(Debug, Default)]
pub(super) struct Events {
    /// The message as `message_start` gave it, `message_delta`s merged in.
    message: Option<Map<String, Value>>,
    /// By the `index` the stream gives each block.
    blocks: BTreeMap<u64, Value>,
    /// A tool use's `input` as it came so far (JSON text, parsed at the block's stop).
    inputs: BTreeMap<u64, String>,
    /// Whether a text block started: the next one's text comes after a newline, as
    /// [`anthropic_output`] joins them.
    texted: bool,
}

impl Assembly for Events {
    const END: &'static str = "`message_stop`";

    fn take(&mut self, event: &Event, progress: &Progress) -> Result<bool, HandlerError> {
        let data = stream::json(event)?;
        let kind = match event.name.as_str() {
            "message" => data["type"].as_str().unwrap_or_default(),
            name => name,
        };
        let index = data["index"].as_u64().unwrap_or(0);
        match kind {
            "message_start" => {
                self.message = Some(data["message"].as_object().cloned().unwrap_or_default());
            }
            "content_block_start" => {
                let block = data["content_block"].clone();
                if block["type"] == "text" {
                    if self.texted {
                        progress.text("\n");
                    }
                    self.texted = true;
                    progress.text(block["text"].as_str().unwrap_or_default());
                }
                self.blocks.insert(index, block);
            }
            "content_block_delta" => {
                let delta = &data["delta"];
                let block = self.blocks.entry(index).or_insert_with(|| json!({}));
                let append = |block: &mut Value, key: &str, piece: &str| {
                    if let Some(block) = block.as_object_mut() {
                        let text = block.entry(key).or_insert_with(|| json!(""));
                        if let Value::String(text) = text {
                            text.push_str(piece);
                        }
                    }
                };
                match delta["type"].as_str().unwrap_or_default() {
                    "text_delta" => {
                        let piece = delta["text"].as_str().unwrap_or_default();
                        append(block, "text", piece);
                        progress.text(piece);
                    }
                    "input_json_delta" => self
                        .inputs
                        .entry(index)
                        .or_default()
                        .push_str(delta["partial_json"].as_str().unwrap_or_default()),
                    "thinking_delta" => append(
                        block,
                        "thinking",
                        delta["thinking"].as_str().unwrap_or_default(),
                    ),
                    "signature_delta" => append(
                        block,
                        "signature",
                        delta["signature"].as_str().unwrap_or_default(),
                    ),
                    "citations_delta" => {
                        if let Some(block) = block.as_object_mut() {
                            let citations = block.entry("citations").or_insert_with(|| json!([]));
                            if let Value::Array(citations) = citations {
                                citations.push(delta["citation"].clone());
                            } else {
                                *citations = json!([delta["citation"]]);
                            }
                        }
                    }
                    _ => {}
                }
            }
            "content_block_stop" => {
                if let Some(input) = self.inputs.remove(&index) {
                    let input = if input.trim().is_empty() {
                        json!({})
                    } else {
                        stream::json(&Event {
                            name: "input_json_delta".into(),
                            data: input,
                        })?
                    };
                    if let Some(block) = self.blocks.get_mut(&index).and_then(Value::as_object_mut)
                    {
                        block.insert("input".into(), input);
                    }
                }
            }
            "message_delta" => {
                let message = self.message.get_or_insert_with(Map::new);
                if let Some(delta) = data["delta"].as_object() {
                    message.extend(delta.iter().map(|(k, v)| (k.clone(), v.clone())));
                }
                if let Some(counts) = data["usage"].as_object() {
                    let usage = message.entry("usage").or_insert_with(|| json!({}));
                    if !usage.is_object() {
                        *usage = json!({});
                    }
                    if let Some(usage) = usage.as_object_mut() {
                        for (key, count) in counts.iter().filter(|(_, v)| !v.is_null()) {
                            usage.insert(key.clone(), count.clone());
                        }
                    }
                }
            }
            "message_stop" => return Ok(true),
            "error" => return Err(stream::stream_error(data.get("error").unwrap_or(&data))),
            _ => {}
        }
        Ok(false)
    }

    fn answer(self) -> Value {
        // Without `message_start` there is no message: no content, as an answer without it.
        let Some(mut message) = self.message else {
            return json!({});
        };
        message.insert(
            "content".into(),
            Value::Array(self.blocks.into_values().collect()),
        );
        Value::Object(message)
    }
}

#[cfg(test)]
mod tests {
    use super::super::stream::tests::{assemble, recorded};
    use super::*;

    #[test]
    fn an_anthropic_answer_is_recorded_in_the_same_shape_with_its_blocks() {
        let answer = json!({
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "claude-x",
            "content": [
                {"type": "text", "text": "Let me look that up."},
                {"type": "tool_use", "id": "toolu_1", "name": "lookup_order", "input": {"order_id": "o1"}}
            ],
            "stop_reason": "tool_use",
            "usage": {"input_tokens": 100, "output_tokens": 20, "cache_read_input_tokens": 50}
        });
        let out = anthropic_output(&answer).expect("output");
        assert_eq!(out["content"], "Let me look that up.");
        assert_eq!(out["tool_calls"][0]["id"], "toolu_1");
        assert_eq!(out["tool_calls"][0]["function"]["name"], "lookup_order");
        assert_eq!(
            out["tool_calls"][0]["function"]["arguments"]["order_id"],
            "o1"
        );
        assert_eq!(out["blocks"], answer["content"]);
        assert_eq!(out["usage"]["prompt_tokens"], 150);
        assert_eq!(out["usage"]["completion_tokens"], 20);
        assert_eq!(out["usage"]["input_tokens"], 100);
        assert_eq!(out["finish_reason"], "tool_use");
        assert_eq!(out["model"], "claude-x");
        // A count that is not a whole number reaches the fold as it came (refused there).
        let odd = anthropic_usage(Some(&json!({"input_tokens": -3, "output_tokens": 1})));
        assert_eq!(odd["prompt_tokens"], -3);
        assert_eq!(
            anthropic_output(&json!({"type": "error"}))
                .expect_err("no content")
                .code(),
            "bad_response"
        );
    }

    #[test]
    fn an_anthropic_request_has_max_tokens_system_and_tools() {
        let config = LlmConfig {
            base_url: "http://x/v1".into(),
            model: "claude-x".into(),
            api_key_env: None,
            api: Some("anthropic".into()),
            stream: None,
        };
        let body = anthropic_body(
            &config,
            &json!({
                "system": "be brief",
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": "t", "input_schema": {"type": "object"}}],
                "seed": 1
            }),
            false,
        )
        .expect("body");
        assert_eq!(body["max_tokens"], ANTHROPIC_DEFAULT_MAX_TOKENS);
        assert_eq!(body["system"], "be brief");
        assert_eq!(body["tools"][0]["name"], "t");
        assert!(body.get("seed").is_none());
        assert!(body.get("stream").is_none());
        let streamed = anthropic_body(&config, &json!({"messages": []}), true).expect("body");
        assert_eq!(streamed["stream"], true);
    }

    /// A text answer as the Messages API streams it.
    const TEXT_STREAM: &str = "\
event: message_start\r
data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_01\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude-x-1\",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":25,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":10,\"output_tokens\":1}}}\r
\r
event: content_block_start\r
data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\r
\r
event: ping\r
data: {\"type\": \"ping\"}\r
\r
event: content_block_delta\r
data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\r
\r
event: content_block_delta\r
data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\", wörld!\"}}\r
\r
event: content_block_stop\r
data: {\"type\":\"content_block_stop\",\"index\":0}\r
\r
event: message_delta\r
data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":15}}\r
\r
event: message_stop\r
data: {\"type\":\"message_stop\"}\r
\r
";

    fn text_answer() -> Value {
        json!({
            "id": "msg_01",
            "type": "message",
            "role": "assistant",
            "model": "claude-x-1",
            "content": [{"type": "text", "text": "Hello, wörld!"}],
            "stop_reason": "end_turn",
            "stop_sequence": null,
            "usage": {"input_tokens": 25, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 10, "output_tokens": 15}
        })
    }

    /// Text, then two tool uses whose input arrives in pieces.
    const TOOLS_STREAM: &str = "\
event: message_start
data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_02\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude-x-1\",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":472,\"output_tokens\":2}}}

event: content_block_start
data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}

event: content_block_delta
data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"I will look\"}}

event: content_block_delta
data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\" it up.\"}}

event: content_block_stop
data: {\"type\":\"content_block_stop\",\"index\":0}

event: content_block_start
data: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_a\",\"name\":\"lookup_order\",\"input\":{}}}

event: content_block_delta
data: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"\"}}

event: content_block_delta
data: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"order_id\\\": \\\"o\"}}

event: content_block_delta
data: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"7\\\"}\"}}

event: content_block_stop
data: {\"type\":\"content_block_stop\",\"index\":1}

event: content_block_start
data: {\"type\":\"content_block_start\",\"index\":2,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_b\",\"name\":\"ping_ops\",\"input\":{}}}

event: content_block_delta
data: {\"type\":\"content_block_delta\",\"index\":2,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"\"}}

event: content_block_stop
data: {\"type\":\"content_block_stop\",\"index\":2}

event: message_delta
data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"tool_use\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":89}}

event: message_stop
data: {\"type\":\"message_stop\"}

";

    fn tools_answer() -> Value {
        json!({
            "id": "msg_02",
            "type": "message",
            "role": "assistant",
            "model": "claude-x-1",
            "content": [
                {"type": "text", "text": "I will look it up."},
                {"type": "tool_use", "id": "toolu_a", "name": "lookup_order", "input": {"order_id": "o7"}},
                {"type": "tool_use", "id": "toolu_b", "name": "ping_ops", "input": {}}
            ],
            "stop_reason": "tool_use",
            "stop_sequence": null,
            "usage": {"input_tokens": 472, "output_tokens": 89}
        })
    }

    #[test]
    fn a_streamed_message_is_recorded_as_the_same_message_not_streamed() {
        for (text, answer, pieces) in [
            (TEXT_STREAM, text_answer(), vec!["Hello", ", wörld!"]),
            (TOOLS_STREAM, tools_answer(), vec!["I will look", " it up."]),
        ] {
            for size in [1, 2, 3, 7, 100, text.len()] {
                let (progress, seen) = recorded();
                let assembled = assemble(Events::default(), text, size, &progress)
                    .unwrap_or_else(|e| panic!("chunks of {size}: {e:?}"));
                assert_eq!(assembled, answer, "chunks of {size}");
                assert_eq!(
                    anthropic_output(&assembled).expect("output"),
                    anthropic_output(&answer).expect("output"),
                    "chunks of {size}"
                );
                assert_eq!(*seen.lock().expect("seen"), pieces, "chunks of {size}");
            }
        }
    }

    #[test]
    fn text_blocks_stream_with_the_newline_that_joins_them() {
        let stream = "\
event: message_start
data: {\"type\":\"message_start\",\"message\":{\"model\":\"m\",\"content\":[],\"usage\":{\"input_tokens\":1}}}

event: content_block_start
data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}

event: content_block_delta
data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"one\"}}

event: content_block_start
data: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}

event: content_block_delta
data: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"text_delta\",\"text\":\"two\"}}

event: message_stop
data: {\"type\":\"message_stop\"}

";
        let (progress, seen) = recorded();
        let out =
            anthropic_output(&assemble(Events::default(), stream, 5, &progress).expect("answer"))
                .expect("output");
        assert_eq!(out["content"], "one\ntwo");
        assert_eq!(seen.lock().expect("seen").concat(), "one\ntwo");
    }

    #[test]
    fn a_cut_bad_or_failed_stream_fails_as_its_body_would() {
        let cut = TOOLS_STREAM
            .split("event: message_delta")
            .next()
            .expect("head");
        let error = assemble(Events::default(), cut, 64, &Default::default()).expect_err("cut");
        assert_eq!(error.code(), "body_lost");
        assert!(error.is_unknown());
        // A tool use's input that is not JSON once whole (`{"order_id": "o""7"}`).
        let bad_input = TOOLS_STREAM.replace(r#"\"o""#, r#"\"o\"\"""#);
        let error =
            assemble(Events::default(), &bad_input, 64, &Default::default()).expect_err("bad");
        assert_eq!(error.code(), "bad_response");
        assert!(!error.is_retryable() && !error.is_unknown());
        let overloaded = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"content\":[]}}\n\n\
                          event: error\ndata: {\"type\": \"error\", \"error\": {\"type\": \"overloaded_error\", \"message\": \"Overloaded\"}}\n\n";
        let error =
            assemble(Events::default(), overloaded, 64, &Default::default()).expect_err("error");
        assert_eq!(error.code(), "stream_error");
        assert!(error.is_unknown());
        assert!(error.message().contains("overloaded_error"), "{error:?}");
        // `message_stop` without `message_start`: no content, as an answer without it.
        let answer = assemble(
            Events::default(),
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
            64,
            &Default::default(),
        )
        .expect("answer");
        assert_eq!(
            anthropic_output(&answer).expect_err("no content").code(),
            "bad_response"
        );
    }
}
