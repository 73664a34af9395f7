//! The built-in handlers: `http` and `llm` (which share one client and one way of telling
//! outcomes apart), `mcp` (one tool of an MCP server), `echo` and `sleep` for demos and
//! tests.

mod echo;
mod http;
mod llm;
mod mcp;

use std::time::Duration;

use serde_json::Value;

pub use echo::{Echo, Sleep};
pub use http::{Http, HttpConfig};
pub use llm::{Llm, LlmConfig};
pub use mcp::{Mcp, McpConfig};

use crate::handler::HandlerError;

/// The HTTP client the built-in handlers share. Connecting has its own short timeout so
/// that "could not connect" (nothing was sent: retryable) is told apart from "sent, then
/// no answer" (unknown). The per-attempt timeout is set per request.
pub fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(5))
        .user_agent(concat!("sortie-executor/", env!("CARGO_PKG_VERSION")))
        .build()
        .unwrap_or_default()
}

/// Parses a node's `config` into a handler's config type; a mismatch is a permanent
/// failure (the graph is wrong, another attempt will not fix it).
fn config<T: serde::de::DeserializeOwned>(tool: &str, config: &Value) -> Result<T, HandlerError> {
    serde_json::from_value(config.clone())
        .map_err(|e| HandlerError::permanent("bad_config", format!("{tool} config: {e}")))
}

/// The outcome of a request that could not produce a response.
///
/// - could not connect: nothing was sent, so the attempt is a retryable failure;
/// - timed out, or the connection was lost after sending: the receiver may have acted,
///   so the outcome is unknown.
fn transport_error(error: &reqwest::Error) -> HandlerError {
    if error.is_connect() {
        HandlerError::retryable("connect_failed", format!("could not connect: {error}"))
    } else if error.is_builder() {
        HandlerError::permanent(
            "bad_request",
            format!("the request could not be built: {error}"),
        )
    } else if error.is_timeout() {
        HandlerError::unknown("timeout", format!("no answer in time: {error}"))
    } else {
        HandlerError::unknown(
            "connection_lost",
            format!("the connection failed after the request was sent: {error:#}"),
        )
    }
}

/// A response's status, classified: 2xx is `Ok(body)` (JSON when it parses), 429 and 5xx
/// are retryable failures (429 with its `Retry-After`), other statuses are permanent.
/// A body that cannot be read after a 2xx is an unknown outcome: the receiver acted but
/// its answer is lost.
async fn classify(response: reqwest::Response) -> Result<Value, HandlerError> {
    let status = response.status();
    let retry_after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    let body = response.text().await;
    if status.is_success() {
        let text = body.map_err(|e| {
            HandlerError::unknown(
                "body_lost",
                format!("the receiver answered {status} but its body was lost: {e}"),
            )
        })?;
        return Ok(serde_json::from_str(&text)
            .unwrap_or_else(|_| serde_json::json!({"status": status.as_u16(), "body": text})));
    }
    let text = body.unwrap_or_default();
    let message = format!("{status}: {}", truncate(&text, 500));
    Err(if status.as_u16() == 429 {
        HandlerError::Retryable {
            code: "rate_limited".into(),
            message,
            retry_after,
        }
    } else if status.is_server_error() {
        HandlerError::retryable("server_error", message)
    } else if status.is_client_error() {
        HandlerError::permanent("client_error", message)
    } else {
        HandlerError::permanent("unexpected_status", message)
    })
}

fn truncate(text: &str, max: usize) -> &str {
    match text.char_indices().nth(max) {
        Some((i, _)) => &text[..i],
        None => text,
    }
}
