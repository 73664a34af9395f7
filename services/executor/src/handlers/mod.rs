//! The built-in handlers: `http` and `llm` (which share their clients, one per egress
//! policy, and one way of telling outcomes apart), `mcp` (one tool of an MCP server), `echo` and `sleep` for demos and
//! tests.

mod http;
mod llm;
mod local;
mod mcp;

use std::time::Duration;

use serde_json::Value;

pub use http::{Http, HttpConfig};
pub use llm::{Llm, LlmConfig};
pub use local::{Echo, Sleep};
pub use mcp::{Mcp, McpConfig};

use crate::handler::HandlerError;

/// A plain HTTP client of the built-in handlers' kind, with **no egress policy**: for
/// tests and handlers of your own. [`Handlers::builtin`](crate::Handlers::builtin) gives
/// `http` and `llm` the policed clients of [`crate::egress::Clients`] instead.
pub fn http_client() -> reqwest::Client {
    client_builder().build().unwrap_or_default()
}

/// Connecting has its own short timeout so that "could not connect" (nothing was sent:
/// retryable) is told apart from "sent, then no answer" (unknown). The per-attempt
/// timeout is set per request.
pub(crate) fn client_builder() -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(5))
        .user_agent(concat!("sortie-executor/", env!("CARGO_PKG_VERSION")))
}

/// Why a node's `config` does not suit its built-in tool (`http`, `llm`), if it does not:
/// what the handler would answer `bad_config` at the first run, said at publication.
/// Other tools (`echo`, `sleep`, `mcp` nodes, handlers of your own) are not judged here.
pub fn config_problem(tool: &str, value: &Value) -> Option<String> {
    let parsed = match tool {
        "http" => config::<HttpConfig>(tool, value).map(drop),
        "llm" => config::<LlmConfig>(tool, value).map(drop),
        _ => return None,
    };
    parsed.err().map(|e| e.message().to_owned())
}

/// Parses a node's `config` into a handler's config type; a mismatch is a permanent
/// failure (the graph is wrong, another attempt will not fix it).
fn config<T: serde::de::DeserializeOwned>(tool: &str, config: &Value) -> Result<T, HandlerError> {
    serde_json::from_value(config.clone())
        .map_err(|e| HandlerError::permanent("bad_config", format!("{tool} config: {e}")))
}

/// Refuses a secret variable the step's tenant may not read ([`sortie_core::secret`]):
/// for good, before anything is read or sent.
fn secret_allowed(tenant: &str, name: &str) -> Result<(), HandlerError> {
    match sortie_core::secret::refusal(tenant, name) {
        Some(why) => Err(HandlerError::permanent("secret_forbidden", why)),
        None => Ok(()),
    }
}

/// The outcome of a request that could not produce a response.
///
/// - could not connect: nothing was sent, so the attempt is a retryable failure;
/// - timed out, or the connection was lost after sending: the receiver may have acted,
///   so the outcome is unknown.
/// - the egress policy refused the address (connecting, or a redirect): permanent
///   `egress_forbidden`, and nothing was sent to that address.
fn transport_error(error: &reqwest::Error) -> HandlerError {
    if let Some(refused) = crate::egress::forbidden(error) {
        refused
    } else if error.is_connect() {
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

/// The most of a successful answer's body an `http` or `llm` step reads: a receiver that
/// answers without end must not grow the executor (every tenant's calls on its queue run
/// in it). An answer this large is stored by reference, if kept at all.
pub const MAX_ANSWER_BYTES: usize = 32 * 1024 * 1024;
/// The most of a failed answer's body read (its message keeps [`MAX_RECEIVER_TEXT`]).
const MAX_ERROR_BYTES: usize = 64 * 1024;
/// The most of a receiver's own text (an error body, a recorded failure, a tool's error)
/// a step's error keeps, in characters: enough to say what went wrong, too little to
/// read an internal answer back through the error.
pub const MAX_RECEIVER_TEXT: usize = 256;

/// Why a body was not read whole.
enum Unread {
    /// It was longer than the cap.
    TooLarge,
    Lost(reqwest::Error),
}

/// Reads at most `max` bytes of `response`'s body, chunk by chunk: a longer body is
/// refused as soon as it passes the cap, without reading the rest.
async fn read_capped(mut response: reqwest::Response, max: usize) -> Result<Vec<u8>, Unread> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(Unread::Lost)? {
        if body.len() + chunk.len() > max {
            return Err(Unread::TooLarge);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// A response's status, classified: 2xx is `Ok(body)` (JSON when it parses), 429 and 5xx
/// are retryable failures (429 with its `Retry-After`), other statuses are permanent.
/// A body that cannot be read after a 2xx is an unknown outcome: the receiver acted but
/// its answer is lost. A 2xx body over [`MAX_ANSWER_BYTES`] is not read on: the step
/// fails `answer_too_large`, for good where the call may be made again (`pure`,
/// `idempotent`, `keyed`) and as an unknown outcome where it happened and must not be
/// repeated blindly (`reconcilable`, `unsafe`), as an output past the record's shape is.
async fn classify(
    response: reqwest::Response,
    class: sortie_wire::records::SideEffectClass,
) -> Result<Value, HandlerError> {
    let status = response.status();
    let retry_after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    let max = if status.is_success() {
        MAX_ANSWER_BYTES
    } else {
        MAX_ERROR_BYTES
    };
    let body = read_capped(response, max).await;
    if status.is_success() {
        let bytes = match body {
            Ok(bytes) => bytes,
            Err(Unread::Lost(e)) => {
                return Err(HandlerError::unknown(
                    "body_lost",
                    format!("the receiver answered {status} but its body was lost: {e}"),
                ))
            }
            Err(Unread::TooLarge) => {
                return Err(answer_too_large(status, class, "it was not read"));
            }
        };
        let text = String::from_utf8_lossy(&bytes);
        return Ok(serde_json::from_str(&text)
            .unwrap_or_else(|_| serde_json::json!({"status": status.as_u16(), "body": text})));
    }
    // A failure's body is read for its message only: what a longer one holds is cut.
    let text = match body {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(Unread::TooLarge) => "(a body over 64 KiB, not read)".to_owned(),
        Err(Unread::Lost(_)) => String::new(),
    };
    let message = format!("{status}: {}", receiver_text(&text));
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

/// The failure of a 2xx answer over [`MAX_ANSWER_BYTES`], read whole ([`classify`]) or
/// streamed (`llm`), `unread` saying what of it was not read: `answer_too_large`, for
/// good where the call may be made again (`pure`, `idempotent`, `keyed`) and as an
/// unknown outcome where it happened and must not be repeated blindly (`reconcilable`,
/// `unsafe`).
fn answer_too_large(
    status: reqwest::StatusCode,
    class: sortie_wire::records::SideEffectClass,
    unread: &str,
) -> HandlerError {
    use sortie_wire::records::SideEffectClass;
    let message = format!(
        "the receiver answered {status} with a body over {MAX_ANSWER_BYTES} bytes; {unread}"
    );
    match class {
        SideEffectClass::Reconcilable | SideEffectClass::Unsafe => {
            HandlerError::unknown("answer_too_large", message)
        }
        _ => HandlerError::permanent("answer_too_large", message),
    }
}

/// A receiver's text as a step's error keeps it: at most [`MAX_RECEIVER_TEXT`]
/// characters, a cut marked by its last one, `…`.
pub(crate) fn receiver_text(text: &str) -> String {
    if text.chars().nth(MAX_RECEIVER_TEXT).is_none() {
        return text.to_owned();
    }
    let mut kept: String = text.chars().take(MAX_RECEIVER_TEXT - 1).collect();
    kept.push('…');
    kept
}
