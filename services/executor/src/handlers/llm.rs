//! `llm`: one OpenAI-compatible chat completion. The response — content, tool calls,
//! token usage — is the step's output, recorded in the run's history, so a replay never
//! calls (or bills) the model again.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::{classify, config, transport_error};
use crate::handler::{Call, HandlerError, StepHandler};

/// A node's `config` for the `llm` tool.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlmConfig {
    /// e.g. `https://api.openai.com/v1`; the handler POSTs to `{base_url}/chat/completions`.
    pub base_url: String,
    pub model: String,
    /// Name of the environment variable holding the API key (sent as a bearer token).
    /// The key itself never appears in a graph.
    #[serde(default)]
    pub api_key_env: Option<String>,
}

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
    client: reqwest::Client,
}

impl Llm {
    pub fn new(client: reqwest::Client) -> Self {
        Self { client }
    }
}

impl StepHandler for Llm {
    async fn call(&self, call: &Call) -> Result<Value, HandlerError> {
        let config: LlmConfig = config("llm", &call.config)?;
        let body = request_body(&config, &call.args)?;
        let url = format!("{}/chat/completions", config.base_url.trim_end_matches('/'));
        let mut request = self
            .client
            .post(&url)
            .timeout(call.timeout)
            .header("Idempotency-Key", &call.operation_id)
            .json(&body);
        if let Some(name) = &config.api_key_env {
            let key = std::env::var(name).map_err(|_| {
                HandlerError::permanent(
                    "bad_config",
                    format!("llm config: environment variable {name} is not set"),
                )
            })?;
            request = request.bearer_auth(key);
        }
        let response = match request.send().await {
            Ok(response) => classify(response).await?,
            Err(error) => return Err(transport_error(&error)),
        };
        output(&response)
    }
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
                format!("no choices in the model's answer: {response}"),
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
}
