//! OpenAI chat completions: the request, the recorded output, and a streamed answer's
//! chunks put back together.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use super::stream::{self, Assembly, Event};
use super::LlmConfig;
use crate::handler::HandlerError;
use crate::progress::Progress;

/// Request fields taken from the step's args besides `messages` and `tools`.
const PASSED_THROUGH: &[&str] = &[
    "tool_choice",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "response_format",
];

/// The request body; a streamed one asks for the usage in the stream's last chunk.
pub(super) fn request_body(
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
    if let Some(tools) = args.get("tools").filter(|t| !t.is_null()) {
        body.insert("tools".into(), tools.clone());
    }
    for field in PASSED_THROUGH {
        if let Some(value) = args.get(*field).filter(|v| !v.is_null()) {
            body.insert((*field).into(), value.clone());
        }
    }
    if stream {
        body.insert("stream".into(), Value::Bool(true));
        body.insert("stream_options".into(), json!({"include_usage": true}));
    }
    Ok(Value::Object(body))
}

/// The recorded output: the first choice's content, tool calls and finish reason, the
/// token usage, and the model that answered.
pub(super) fn output(response: &Value) -> Result<Value, HandlerError> {
    let choice = response
        .get("choices")
        .and_then(|c| c.get(0))
        .ok_or_else(|| {
            HandlerError::permanent(
                "bad_response",
                format!(
                    "no choices in the model's answer: {}",
                    crate::handlers::receiver_text(&response.to_string())
                ),
            )
        })?;
    let message = &choice["message"];
    Ok(json!({
        "content": message.get("content").cloned().unwrap_or(Value::Null),
        "tool_calls": message.get("tool_calls").cloned().unwrap_or(Value::Array(vec![])),
        "usage": response.get("usage").cloned().unwrap_or(Value::Null),
        "model": response.get("model").cloned().unwrap_or(Value::Null),
        "finish_reason": choice.get("finish_reason").cloned().unwrap_or(Value::Null),
    }))
}

/// A streamed chat completion: `chat.completion.chunk`s until `data: [DONE]`. Only the
/// first choice (`index` 0) is kept, as [`output`] reads only it.
#[derive(Debug, Default)]
pub(super) struct Chunks {
    id: Option<Value>,
    model: Option<Value>,
    /// Whether a chunk carried the first choice (an answer without is `bad_response`).
    choice: bool,
    content: Option<String>,
    /// By the `index` the stream gives each call.
    tool_calls: BTreeMap<u64, ToolCall>,
    finish_reason: Option<Value>,
    usage: Option<Value>,
}

#[derive(Debug, Default)]
struct ToolCall {
    id: Option<String>,
    kind: Option<String>,
    name: String,
    arguments: String,
}

impl Assembly for Chunks {
    const END: &'static str = "`data: [DONE]`";

    fn take(&mut self, event: &Event, progress: &Progress) -> Result<bool, HandlerError> {
        if event.data.trim() == "[DONE]" {
            return Ok(true);
        }
        let chunk = stream::json(event)?;
        if let Some(error) = chunk.get("error").filter(|e| !e.is_null()) {
            return Err(stream::stream_error(error));
        }
        if event.name == "error" {
            return Err(stream::stream_error(&chunk));
        }
        let present = |key: &str| chunk.get(key).filter(|v| !v.is_null()).cloned();
        if let Some(id) = present("id") {
            self.id.get_or_insert(id);
        }
        if let Some(model) = present("model") {
            self.model = Some(model);
        }
        if let Some(usage) = present("usage") {
            self.usage = Some(usage);
        }
        let choices = chunk.get("choices").and_then(Value::as_array);
        for choice in choices.into_iter().flatten() {
            if choice.get("index").and_then(Value::as_u64).unwrap_or(0) != 0 {
                continue;
            }
            self.choice = true;
            let delta = &choice["delta"];
            if let Some(text) = delta["content"].as_str() {
                self.content.get_or_insert_default().push_str(text);
                progress.text(text);
            }
            for piece in delta["tool_calls"].as_array().into_iter().flatten() {
                let index = piece["index"].as_u64().unwrap_or(0);
                let call = self.tool_calls.entry(index).or_default();
                if let Some(id) = piece["id"].as_str().filter(|id| !id.is_empty()) {
                    call.id = Some(id.to_owned());
                }
                if let Some(kind) = piece["type"].as_str().filter(|k| !k.is_empty()) {
                    call.kind = Some(kind.to_owned());
                }
                let function = &piece["function"];
                call.name
                    .push_str(function["name"].as_str().unwrap_or_default());
                call.arguments
                    .push_str(function["arguments"].as_str().unwrap_or_default());
            }
            if let Some(reason) = choice.get("finish_reason").filter(|r| !r.is_null()) {
                self.finish_reason = Some(reason.clone());
            }
        }
        Ok(false)
    }

    fn answer(self) -> Value {
        let mut message = Map::new();
        message.insert("role".into(), json!("assistant"));
        // A tool call's message has no text: `null`, as a non-streaming answer says it
        // (the stream may open with `"content": ""`).
        let content = self
            .content
            .filter(|c| !c.is_empty() || self.tool_calls.is_empty());
        message.insert("content".into(), content.map_or(Value::Null, Value::String));
        if !self.tool_calls.is_empty() {
            let calls = self.tool_calls.into_values().map(|call| {
                json!({
                    "id": call.id,
                    "type": call.kind.unwrap_or_else(|| "function".to_owned()),
                    "function": {"name": call.name, "arguments": call.arguments},
                })
            });
            message.insert("tool_calls".into(), Value::Array(calls.collect()));
        }
        let mut answer = Map::new();
        answer.insert("object".into(), json!("chat.completion"));
        for (key, value) in [
            ("id", self.id),
            ("model", self.model),
            ("usage", self.usage),
        ] {
            if let Some(value) = value {
                answer.insert(key.into(), value);
            }
        }
        if self.choice {
            answer.insert(
                "choices".into(),
                json!([{
                    "index": 0,
                    "message": message,
                    "finish_reason": self.finish_reason,
                }]),
            );
        }
        Value::Object(answer)
    }
}

#[cfg(test)]
mod tests {
    use super::super::stream::tests::{assemble, recorded};
    use super::*;

    #[test]
    fn the_request_carries_model_messages_tools_and_known_options() {
        let config = LlmConfig {
            base_url: "http://x/v1".into(),
            model: "tiny".into(),
            api_key_env: None,
            api: None,
            stream: None,
        };
        let body = request_body(
            &config,
            &json!({
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function"}],
                "temperature": 0,
                "unrelated": true,
                "stream": false
            }),
            false,
        )
        .expect("body");
        assert_eq!(body["model"], "tiny");
        assert_eq!(body["messages"][0]["content"], "hi");
        assert_eq!(body["tools"][0]["type"], "function");
        assert_eq!(body["temperature"], 0);
        assert!(body.get("unrelated").is_none());
        assert!(body.get("stream").is_none());
        assert_eq!(
            request_body(&config, &json!({}), false)
                .expect_err("no messages")
                .code(),
            "bad_args"
        );
        let streamed = request_body(&config, &json!({"messages": []}), true).expect("body");
        assert_eq!(streamed["stream"], true);
        assert_eq!(streamed["stream_options"], json!({"include_usage": true}));
    }

    #[test]
    fn the_output_is_content_tool_calls_usage_model_and_finish_reason() {
        let answer = json!({
            "id": "chatcmpl-1",
            "model": "tiny-2",
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": null,
                            "tool_calls": [{"id": "c1", "type": "function",
                                            "function": {"name": "refund", "arguments": "{}"}}]},
                "finish_reason": "tool_calls"
            }],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
        });
        let out = output(&answer).expect("output");
        assert_eq!(out["content"], Value::Null);
        assert_eq!(out["tool_calls"][0]["function"]["name"], "refund");
        assert_eq!(out["usage"]["total_tokens"], 10);
        assert_eq!(out["model"], "tiny-2");
        assert_eq!(out["finish_reason"], "tool_calls");
        assert_eq!(
            output(&json!({"error": "x"}))
                .expect_err("no choices")
                .code(),
            "bad_response"
        );
    }

    /// A text answer as OpenAI streams it (CRLF line ends, a keep-alive comment), and the
    /// same answer not streamed.
    const TEXT_STREAM: &str = "\
data: {\"id\":\"chatcmpl-9\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-x-2024\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\",\"refusal\":null},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\r\n\r\n\
data: {\"id\":\"chatcmpl-9\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-x-2024\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Your refund\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\r\n\r\n\
: keep-alive\r\n\r\n\
data: {\"id\":\"chatcmpl-9\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-x-2024\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" of 30 € is\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\r\n\r\n\
data: {\"id\":\"chatcmpl-9\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-x-2024\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" on its way.\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\r\n\r\n\
data: {\"id\":\"chatcmpl-9\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-x-2024\",\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"stop\"}],\"usage\":null}\r\n\r\n\
data: {\"id\":\"chatcmpl-9\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-x-2024\",\"choices\":[],\"usage\":{\"prompt_tokens\":21,\"completion_tokens\":9,\"total_tokens\":30,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\r\n\r\n\
data: [DONE]\r\n\r\n";

    fn text_answer() -> Value {
        json!({
            "id": "chatcmpl-9",
            "object": "chat.completion",
            "created": 1,
            "model": "gpt-x-2024",
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": null,
                         "message": {"role": "assistant", "content": "Your refund of 30 € is on its way.", "refusal": null}}],
            "usage": {"prompt_tokens": 21, "completion_tokens": 9, "total_tokens": 30,
                      "prompt_tokens_details": {"cached_tokens": 0}}
        })
    }

    /// Text, then two tool calls whose arguments arrive in pieces.
    const TOOLS_STREAM: &str = "\
data: {\"id\":\"chatcmpl-7\",\"object\":\"chat.completion.chunk\",\"model\":\"gpt-x-2024\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"Checking.\"},\"finish_reason\":null}]}

data: {\"id\":\"chatcmpl-7\",\"object\":\"chat.completion.chunk\",\"model\":\"gpt-x-2024\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_a\",\"type\":\"function\",\"function\":{\"name\":\"lookup_order\",\"arguments\":\"\"}}]},\"finish_reason\":null}]}

data: {\"id\":\"chatcmpl-7\",\"object\":\"chat.completion.chunk\",\"model\":\"gpt-x-2024\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"order\"}}]},\"finish_reason\":null}]}

data: {\"id\":\"chatcmpl-7\",\"object\":\"chat.completion.chunk\",\"model\":\"gpt-x-2024\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"_id\\\": \\\"o7\\\"}\"}}]},\"finish_reason\":null}]}

data: {\"id\":\"chatcmpl-7\",\"object\":\"chat.completion.chunk\",\"model\":\"gpt-x-2024\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":1,\"id\":\"call_b\",\"type\":\"function\",\"function\":{\"name\":\"refund\",\"arguments\":\"{\\\"amo\"}}]},\"finish_reason\":null}]}

data: {\"id\":\"chatcmpl-7\",\"object\":\"chat.completion.chunk\",\"model\":\"gpt-x-2024\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":1,\"function\":{\"arguments\":\"unt\\\": 30}\"}}]},\"finish_reason\":null}]}

data: {\"id\":\"chatcmpl-7\",\"object\":\"chat.completion.chunk\",\"model\":\"gpt-x-2024\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}

data: {\"id\":\"chatcmpl-7\",\"object\":\"chat.completion.chunk\",\"model\":\"gpt-x-2024\",\"choices\":[],\"usage\":{\"prompt_tokens\":80,\"completion_tokens\":31,\"total_tokens\":111}}

data: [DONE]

";

    fn tools_answer() -> Value {
        json!({
            "id": "chatcmpl-7",
            "object": "chat.completion",
            "model": "gpt-x-2024",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {"id": "call_a", "type": "function",
                     "function": {"name": "lookup_order", "arguments": "{\"order_id\": \"o7\"}"}},
                    {"id": "call_b", "type": "function",
                     "function": {"name": "refund", "arguments": "{\"amount\": 30}"}}
                ]
            }}],
            "usage": {"prompt_tokens": 80, "completion_tokens": 31, "total_tokens": 111}
        })
    }

    #[test]
    fn a_streamed_answer_is_recorded_as_the_same_answer_not_streamed() {
        for (text, answer, pieces) in [
            (
                TEXT_STREAM,
                text_answer(),
                vec!["Your refund", " of 30 € is", " on its way."],
            ),
            (TOOLS_STREAM, tools_answer(), vec!["Checking."]),
        ] {
            // Chunks of every size: events, lines, CRLFs and characters split anywhere.
            for size in [1, 2, 3, 7, 100, text.len()] {
                let (progress, seen) = recorded();
                let assembled = assemble(Chunks::default(), text, size, &progress)
                    .unwrap_or_else(|e| panic!("chunks of {size}: {e:?}"));
                assert_eq!(
                    output(&assembled).expect("output"),
                    output(&answer).expect("output"),
                    "chunks of {size}"
                );
                assert_eq!(*seen.lock().expect("seen"), pieces, "chunks of {size}");
            }
        }
    }

    #[test]
    fn a_tool_call_without_text_records_null_content() {
        let stream = "\
data: {\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"index\":0,\"id\":\"c1\",\"type\":\"function\",\"function\":{\"name\":\"refund\",\"arguments\":\"\"}}]},\"finish_reason\":null}]}

data: {\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{}\"}}]},\"finish_reason\":\"tool_calls\"}]}

data: [DONE]

";
        let out =
            output(&assemble(Chunks::default(), stream, 9, &Default::default()).expect("answer"))
                .expect("output");
        assert_eq!(out["content"], Value::Null);
        assert_eq!(
            out["tool_calls"],
            json!([{"id": "c1", "type": "function", "function": {"name": "refund", "arguments": "{}"}}])
        );
        assert_eq!(out["usage"], Value::Null);
        assert_eq!(out["finish_reason"], "tool_calls");
    }

    #[test]
    fn a_cut_bad_or_failed_stream_fails_as_its_body_would() {
        // Cut before `[DONE]`: the answer may be incomplete.
        let cut = TEXT_STREAM.split("data: [DONE]").next().expect("head");
        let error = assemble(Chunks::default(), cut, 50, &Default::default()).expect_err("cut");
        assert_eq!(error.code(), "body_lost");
        assert!(error.is_unknown());
        // An event that is not JSON.
        let error = assemble(
            Chunks::default(),
            "data: {\"choices\": [\n\ndata: [DONE]\n\n",
            50,
            &Default::default(),
        )
        .expect_err("bad");
        assert_eq!(error.code(), "bad_response");
        assert!(!error.is_retryable() && !error.is_unknown());
        // An error reported in the stream.
        let error = assemble(
            Chunks::default(),
            "data: {\"error\": {\"message\": \"overloaded\", \"type\": \"server_error\"}}\n\n",
            50,
            &Default::default(),
        )
        .expect_err("error");
        assert_eq!(error.code(), "stream_error");
        assert!(error.is_unknown());
        // `[DONE]` alone: no choices, as an answer without them.
        let answer = assemble(
            Chunks::default(),
            "data: [DONE]\n\n",
            50,
            &Default::default(),
        )
        .expect("answer");
        assert_eq!(
            output(&answer).expect_err("no choices").code(),
            "bad_response"
        );
    }
}
