//! `llm`: one model call, in the API the node's config names (`api`): OpenAI chat
//! completions (the default) or Anthropic Messages. The response — content, tool calls,
//! token usage — is the step's output, recorded in the run's history, so a replay never
//! calls (or bills) the model again.
//!
//! The output has one shape for both APIs, so the fold reads either the same way:
//! `content` (the text), `tool_calls` (OpenAI's shape; an Anthropic `tool_use` block's
//! `input` becomes `function.arguments` as an object), `usage`, `model`,
//! `finish_reason`. An Anthropic answer keeps its content blocks as `blocks` (the
//! assistant message the fold sends back, as the API requires) and its usage is recorded
//! as the API gave it plus `prompt_tokens` (input, cache creation and cache read tokens)
//! and `completion_tokens` (output tokens), the counts budgets charge, as for OpenAI.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::{classify, config, secret_allowed, transport_error};
use crate::egress::Clients;
use crate::handler::{Call, HandlerError, StepHandler};

/// A node's `config` for the `llm` tool.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlmConfig {
    /// e.g. `https://api.openai.com/v1`; the handler POSTs to `{base_url}/chat/completions`.
    pub base_url: String,
    pub model: String,
    /// Name of the environment variable holding the API key (a bearer token for OpenAI,
    /// `x-api-key` for Anthropic). The key itself never appears in a graph.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// `openai` (absent) or `anthropic`.
    #[serde(default)]
    pub api: Option<String>,
}

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

/// The `llm` handler.
#[derive(Debug, Clone)]
pub struct Llm {
    clients: Clients,
}

impl Llm {
    /// Over policed [`Clients`], or a `reqwest::Client` used as it is (no egress policy).
    pub fn new(clients: impl Into<Clients>) -> Self {
        Self {
            clients: clients.into(),
        }
    }
}

impl StepHandler for Llm {
    async fn call(&self, call: &Call) -> Result<Value, HandlerError> {
        let config: LlmConfig = config("llm", &call.config)?;
        let anthropic = match config.api.as_deref() {
            None | Some("openai") => false,
            Some("anthropic") => true,
            Some(other) => {
                return Err(HandlerError::permanent(
                    "bad_config",
                    format!("llm config: api is openai or anthropic, not {other:?}"),
                ))
            }
        };
        let base = config.base_url.trim_end_matches('/');
        let url = if anthropic {
            format!("{base}/messages")
        } else {
            format!("{base}/chat/completions")
        };
        let client = self.clients.for_url(&call.tenant, &url)?;
        let mut request = if anthropic {
            client
                .post(url)
                .header("anthropic-version", ANTHROPIC_VERSION)
                .json(&anthropic_body(&config, &call.args)?)
        } else {
            client.post(url).json(&request_body(&config, &call.args)?)
        };
        request = request
            .timeout(call.timeout)
            .header("Idempotency-Key", &call.operation_id);
        if let Some(name) = &config.api_key_env {
            secret_allowed(&call.tenant, name)?;
            let key = crate::secrets::read(name).ok_or_else(|| {
                HandlerError::permanent(
                    "bad_config",
                    format!("llm config: secret {name} is set neither in this executor's environment nor in its secrets directory"),
                )
            })?;
            request = if anthropic {
                request.header("x-api-key", key)
            } else {
                request.bearer_auth(key)
            };
        }
        let response = match request.send().await {
            Ok(response) => classify(response, call.side_effect).await?,
            Err(error) => return Err(transport_error(&error)),
        };
        if anthropic {
            anthropic_output(&response)
        } else {
            output(&response)
        }
    }
}

fn anthropic_body(config: &LlmConfig, args: &Value) -> Result<Value, HandlerError> {
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
    Ok(Value::Object(body))
}

/// The recorded output of an Anthropic answer (see the module doc).
fn anthropic_output(response: &Value) -> Result<Value, HandlerError> {
    let blocks = response
        .get("content")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            HandlerError::permanent(
                "bad_response",
                format!(
                    "no content blocks in the model's answer: {}",
                    super::receiver_text(&response.to_string())
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
            serde_json::json!({
                "id": b.get("id").cloned().unwrap_or(Value::Null),
                "type": "function",
                "function": {
                    "name": b.get("name").cloned().unwrap_or(Value::Null),
                    "arguments": b.get("input").cloned().unwrap_or_else(|| serde_json::json!({})),
                },
            })
        })
        .collect();
    Ok(serde_json::json!({
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
fn anthropic_usage(usage: Option<&Value>) -> Value {
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

fn request_body(config: &LlmConfig, args: &Value) -> Result<Value, HandlerError> {
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
    Ok(Value::Object(body))
}

/// The recorded output: the first choice's content, tool calls and finish reason, the
/// token usage, and the model that answered.
fn output(response: &Value) -> Result<Value, HandlerError> {
    let choice = response
        .get("choices")
        .and_then(|c| c.get(0))
        .ok_or_else(|| {
            HandlerError::permanent(
                "bad_response",
                format!(
                    "no choices in the model's answer: {}",
                    super::receiver_text(&response.to_string())
                ),
            )
        })?;
    let message = &choice["message"];
    Ok(serde_json::json!({
        "content": message.get("content").cloned().unwrap_or(Value::Null),
        "tool_calls": message.get("tool_calls").cloned().unwrap_or(Value::Array(vec![])),
        "usage": response.get("usage").cloned().unwrap_or(Value::Null),
        "model": response.get("model").cloned().unwrap_or(Value::Null),
        "finish_reason": choice.get("finish_reason").cloned().unwrap_or(Value::Null),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_carries_model_messages_tools_and_known_options() {
        let config = LlmConfig {
            base_url: "http://x/v1".into(),
            model: "tiny".into(),
            api_key_env: None,
            api: None,
        };
        let body = request_body(
            &config,
            &serde_json::json!({
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function"}],
                "temperature": 0,
                "unrelated": true
            }),
        )
        .expect("body");
        assert_eq!(body["model"], "tiny");
        assert_eq!(body["messages"][0]["content"], "hi");
        assert_eq!(body["tools"][0]["type"], "function");
        assert_eq!(body["temperature"], 0);
        assert!(body.get("unrelated").is_none());
        assert_eq!(
            request_body(&config, &serde_json::json!({}))
                .expect_err("no messages")
                .code(),
            "bad_args"
        );
    }

    #[test]
    fn the_output_is_content_tool_calls_usage_model_and_finish_reason() {
        let answer = serde_json::json!({
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
            output(&serde_json::json!({"error": "x"}))
                .expect_err("no choices")
                .code(),
            "bad_response"
        );
    }

    #[test]
    fn an_anthropic_answer_is_recorded_in_the_same_shape_with_its_blocks() {
        let answer = serde_json::json!({
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
        let odd = anthropic_usage(Some(
            &serde_json::json!({"input_tokens": -3, "output_tokens": 1}),
        ));
        assert_eq!(odd["prompt_tokens"], -3);
        assert_eq!(
            anthropic_output(&serde_json::json!({"type": "error"}))
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
        };
        let body = anthropic_body(
            &config,
            &serde_json::json!({
                "system": "be brief",
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": "t", "input_schema": {"type": "object"}}],
                "seed": 1
            }),
        )
        .expect("body");
        assert_eq!(body["max_tokens"], ANTHROPIC_DEFAULT_MAX_TOKENS);
        assert_eq!(body["system"], "be brief");
        assert_eq!(body["tools"][0]["name"], "t");
        assert!(body.get("seed").is_none());
    }
}
