//! `llm`: one model call, in the API the node's config names (`api`): OpenAI chat
//! completions (the default, [`openai`]) or Anthropic Messages ([`anthropic`]). The
//! response — content, tool calls, token usage — is the step's output, recorded in the
//! run's history, so a replay never calls (or bills) the model again.
//!
//! The output has one shape for both APIs, so the fold reads either the same way:
//! `content` (the text), `tool_calls` (OpenAI's shape; an Anthropic `tool_use` block's
//! `input` becomes `function.arguments` as an object), `usage`, `model`,
//! `finish_reason`. An Anthropic answer keeps its content blocks as `blocks` (the
//! assistant message the fold sends back, as the API requires) and its usage is recorded
//! as the API gave it plus `prompt_tokens` (input, cache creation and cache read tokens)
//! and `completion_tokens` (output tokens), the counts budgets charge, as for OpenAI.
//!
//! The answer is streamed unless the config says `stream: false`: the request asks for
//! server-sent events, each piece of text goes to the call's
//! [`Progress`](crate::progress::Progress) as it arrives, and the events are put back
//! together into the JSON the API answers when it does not stream ([`stream`]), so the
//! recorded output is the same either way. A failed status is classified before anything
//! is streamed, and a 2xx that is not `text/event-stream` (a server that does not stream)
//! is read as a whole answer.

mod anthropic;
mod openai;
mod stream;

use serde::Deserialize;
use serde_json::Value;

use super::{classify, config, secret_allowed, transport_error};
use crate::egress::Clients;
use crate::handler::{Call, HandlerError, StepHandler};

use anthropic::ANTHROPIC_VERSION;

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
    /// Whether the answer is streamed (absent: yes). The recorded output is the same.
    #[serde(default)]
    pub stream: Option<bool>,
}

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
        let streamed = config.stream.unwrap_or(true);
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
                .json(&anthropic::anthropic_body(&config, &call.args, streamed)?)
        } else {
            client
                .post(url)
                .json(&openai::request_body(&config, &call.args, streamed)?)
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
        let response = request.send().await.map_err(|e| transport_error(&e))?;
        let class = call.side_effect;
        let response =
            if streamed && response.status().is_success() && stream::is_event_stream(&response) {
                if anthropic {
                    stream::read(
                        response,
                        anthropic::Events::default(),
                        class,
                        &call.progress,
                    )
                    .await?
                } else {
                    stream::read(response, openai::Chunks::default(), class, &call.progress).await?
                }
            } else {
                classify(response, class).await?
            };
        if anthropic {
            anthropic::anthropic_output(&response)
        } else {
            openai::output(&response)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use axum::body::{Body, Bytes};
    use axum::extract::State;
    use axum::http::{header, StatusCode};
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;
    use axum::{Json, Router};
    use serde_json::json;
    use sortie_wire::records::SideEffectClass;

    use super::stream::tests::recorded;
    use super::*;

    /// A model whose answer to each request is the next of `answers`, each request kept.
    async fn model(answers: Vec<Response>) -> (String, Arc<Mutex<Vec<Value>>>) {
        type Shared = (Arc<Mutex<Vec<Value>>>, Arc<Mutex<Vec<Response>>>);
        async fn answer(
            State((seen, answers)): State<Shared>,
            Json(body): Json<Value>,
        ) -> Response {
            seen.lock().expect("seen").push(body);
            let mut answers = answers.lock().expect("answers");
            if answers.is_empty() {
                StatusCode::GONE.into_response()
            } else {
                answers.remove(0)
            }
        }
        let seen = Arc::new(Mutex::new(Vec::new()));
        let router = Router::new()
            .route("/v1/chat/completions", post(answer))
            .route("/v1/messages", post(answer))
            .with_state((seen.clone(), Arc::new(Mutex::new(answers))));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, router).await });
        (format!("http://{addr}/v1"), seen)
    }

    /// An event stream of `pieces`, each its own chunk; `end: false` cuts the connection
    /// after them (once they were sent) instead of ending the body.
    fn events(pieces: &[&str], end: bool) -> Response {
        use futures::StreamExt as _;
        let chunks: Vec<Result<Bytes, std::io::Error>> = pieces
            .iter()
            .map(|p| Ok(Bytes::from(p.to_string())))
            .collect();
        let cut = futures::stream::once(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            Err(std::io::Error::other("cut"))
        })
        .filter(move |_| std::future::ready(!end));
        (
            [(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")],
            Body::from_stream(futures::stream::iter(chunks).chain(cut)),
        )
            .into_response()
    }

    fn call(config: Value) -> Call {
        Call {
            operation_id: "op-llm".into(),
            attempt: 1,
            tenant: "acme".into(),
            run_id: "run-1".into(),
            step_id: "think#1".into(),
            node: "think".into(),
            tool: "llm".into(),
            side_effect: SideEffectClass::Pure,
            args: json!({"messages": [{"role": "user", "content": "hi"}]}),
            config,
            timeout: Duration::from_secs(10),
            progress: Default::default(),
        }
    }

    fn answer() -> Value {
        json!({
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "tiny",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "Hello there."}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        })
    }

    const HELLO: &[&str] = &[
        "data: {\"model\":\"tiny\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n",
        "data: {\"model\":\"tiny\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello\"},\"finish_reason\":null}]}\n\n",
        "data: {\"model\":\"tiny\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" there.\"},\"finish_reason\":\"stop\"}]}\n\n",
        "data: {\"model\":\"tiny\",\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}\n\n",
        "data: [DONE]\n\n",
    ];

    /// Streamed (the default), not streamed (`stream: false`), and streamed to a server
    /// that answers JSON anyway: the same output; only the stream reports text.
    #[tokio::test]
    async fn a_streamed_answer_is_recorded_as_the_json_one_and_its_text_reported() {
        let (base, seen) = model(vec![
            events(HELLO, true),
            Json(answer()).into_response(),
            Json(answer()).into_response(),
        ])
        .await;
        let llm = Llm::new(crate::handlers::http_client());
        let want = openai::output(&answer()).expect("output");
        for (stream, text) in [
            (None, vec!["Hello", " there."]),
            (Some(false), vec![]),
            (None, vec![]),
        ] {
            let mut call = call(json!({"base_url": base, "model": "tiny", "stream": stream}));
            let (progress, reported) = recorded();
            call.progress = progress;
            assert_eq!(llm.call(&call).await.expect("answer"), want, "{stream:?}");
            assert_eq!(*reported.lock().expect("reported"), text, "{stream:?}");
        }
        let seen = seen.lock().expect("seen");
        assert_eq!(seen[0]["stream"], true);
        assert_eq!(seen[0]["stream_options"]["include_usage"], true);
        assert!(seen[1].get("stream").is_none() && seen[1].get("stream_options").is_none());
    }

    /// A failed status is classified as for a whole answer, before any streaming; a stream
    /// cut off is a lost body; a bad config field is refused.
    #[tokio::test]
    async fn failures_are_those_of_a_whole_answer() {
        let (base, seen) = model(vec![
            (
                StatusCode::TOO_MANY_REQUESTS,
                [("retry-after", "2")],
                "slow down",
            )
                .into_response(),
            events(&HELLO[..2], false),
            events(&HELLO[..3], true),
            (StatusCode::BAD_REQUEST, "no").into_response(),
        ])
        .await;
        let llm = Llm::new(crate::handlers::http_client());
        let openai = call(json!({"base_url": base, "model": "tiny"}));
        let error = llm.call(&openai).await.expect_err("429");
        assert_eq!(error.code(), "rate_limited");
        assert_eq!(error.retry_after(), Some(Duration::from_secs(2)));
        for _ in 0..2 {
            // Cut mid-stream, then ended without `[DONE]`.
            let error = llm.call(&openai).await.expect_err("cut");
            assert_eq!(error.code(), "body_lost");
            assert!(error.is_unknown(), "{error:?}");
        }
        let anthropic = call(json!({"base_url": base, "model": "c", "api": "anthropic"}));
        let error = llm.call(&anthropic).await.expect_err("400");
        assert_eq!(error.code(), "client_error");
        assert_eq!(seen.lock().expect("seen")[3]["stream"], true);
        let error = llm
            .call(&call(
                json!({"base_url": base, "model": "tiny", "stream": "yes"}),
            ))
            .await
            .expect_err("bad config");
        assert_eq!(error.code(), "bad_config");
        assert_eq!(seen.lock().expect("seen").len(), 4);
    }
}
