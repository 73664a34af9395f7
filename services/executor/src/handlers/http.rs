//! `http`: POSTs the step's args as JSON to `config.url` with
//! `Idempotency-Key: <operation id>`; answers status lookups from `config.status_url`.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

use super::{classify, config, read_capped, receiver_text, transport_error, Unread};
use crate::egress::Clients;
use crate::handler::{Call, HandlerError, Lookup, StepHandler};

/// A node's `config` for the `http` tool.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// The POST target.
    pub url: String,
    /// Status lookups: `GET {status_url}/{operation_id}` answers 200
    /// `{"status": "succeeded", "output": ...}` or `{"status": "failed", "error"?: ...}`,
    /// or 404 when the receiver has no record of the operation. Needed by `reconcilable`
    /// nodes. See `lookup_authoritative` for what a 404 is taken to mean.
    #[serde(default)]
    pub status_url: Option<String>,
    /// The receiver's "not found" (404, `unknown`, `not_found`) proves the operation
    /// never reached it, so a later attempt may call. Without it "not found" leaves the
    /// outcome unknown and the run waits for an operator: a receiver that lost its
    /// record, or a lookup that lags the call, would otherwise cause a second effect.
    #[serde(default)]
    pub lookup_authoritative: bool,
    /// Extra request headers.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

/// The `http` handler.
#[derive(Debug, Clone)]
pub struct Http {
    clients: Clients,
}

impl Http {
    /// Over policed [`Clients`], or a `reqwest::Client` used as it is (no egress policy).
    pub fn new(clients: impl Into<Clients>) -> Self {
        Self {
            clients: clients.into(),
        }
    }
}

/// The most of a status lookup's answer read: it may carry the operation's output.
const MAX_LOOKUP_BYTES: usize = super::MAX_ANSWER_BYTES;
/// The most of a receiver's failure code a recorded failure keeps, in characters.
const MAX_CODE_CHARS: usize = 64;

impl StepHandler for Http {
    async fn call(&self, call: &Call) -> Result<Value, HandlerError> {
        let config: HttpConfig = config("http", &call.config)?;
        let mut request = self
            .clients
            .for_url(&call.tenant, &config.url)?
            .post(&config.url)
            .timeout(call.timeout)
            .header("Idempotency-Key", &call.operation_id)
            .header("X-Sortie-Run-Id", &call.run_id)
            .header("X-Sortie-Attempt", call.attempt.to_string())
            .json(&call.args);
        for (name, value) in &config.headers {
            request = request.header(name, value);
        }
        match request.send().await {
            Ok(response) => classify(response, call.side_effect).await,
            Err(error) => Err(transport_error(&error)),
        }
    }

    async fn lookup(&self, call: &Call) -> Result<Lookup, HandlerError> {
        let config: HttpConfig = config("http", &call.config)?;
        let Some(status_url) = &config.status_url else {
            return Ok(Lookup::Unsupported);
        };
        let url = format!(
            "{}/{}",
            status_url.trim_end_matches('/'),
            encode_segment(&call.operation_id)
        );
        let lost = |e: reqwest::Error| match crate::egress::forbidden(&e) {
            Some(refused) => refused,
            None => HandlerError::unknown("lookup_failed", format!("GET {url}: {e}")),
        };
        let response = self
            .clients
            .for_url(&call.tenant, &url)?
            .get(&url)
            .timeout(call.timeout)
            .send()
            .await
            .map_err(lost)?;
        if response.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(Lookup::NotFound);
        }
        if !response.status().is_success() {
            return Err(HandlerError::unknown(
                "lookup_failed",
                format!("GET {url} answered {}", response.status()),
            ));
        }
        let bytes =
            read_capped(response, MAX_LOOKUP_BYTES)
                .await
                .map_err(|unread| match unread {
                    Unread::TooLarge => HandlerError::unknown(
                        "lookup_failed",
                        format!(
                            "GET {url} answered over {MAX_LOOKUP_BYTES} bytes; it was not read"
                        ),
                    ),
                    Unread::Lost(e) => lost(e),
                })?;
        // What the answer holds reaches the run only as a lookup's outcome: a body that
        // is not one is never copied into the error (it may be anything the URL serves).
        let body: Value = serde_json::from_slice(&bytes).map_err(|e| {
            HandlerError::unknown(
                "lookup_failed",
                format!(
                    "GET {url} answered {} bytes that are not JSON: {e}",
                    bytes.len()
                ),
            )
        })?;
        match body["status"].as_str() {
            Some("succeeded") => Ok(Lookup::Succeeded(body["output"].clone())),
            Some("failed") => Ok(Lookup::Failed {
                code: body["code"]
                    .as_str()
                    .unwrap_or("failed")
                    .chars()
                    .take(MAX_CODE_CHARS)
                    .collect(),
                message: receiver_text(
                    body["error"]
                        .as_str()
                        .unwrap_or("the receiver recorded a failure"),
                ),
            }),
            Some("unknown" | "not_found") => Ok(Lookup::NotFound),
            _ => Err(HandlerError::unknown(
                "lookup_failed",
                format!("GET {url} answered no status (succeeded, failed, unknown or not_found)"),
            )),
        }
    }
}

/// Percent-encodes everything but unreserved characters (RFC 3986), for a path segment.
fn encode_segment(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use axum::extract::State;
    use axum::http::{HeaderMap, StatusCode};
    use axum::response::IntoResponse;
    use axum::routing::{get, post};
    use axum::{Json, Router};
    use sortie_wire::records::SideEffectClass;

    use super::*;

    async fn serve(router: Router) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, router).await });
        format!("http://{addr}")
    }

    fn call(config: Value, timeout: Duration) -> Call {
        Call {
            operation_id: "op/1".into(),
            attempt: 1,
            tenant: "acme".into(),
            run_id: "run-1".into(),
            step_id: "pay#1".into(),
            node: "pay".into(),
            tool: "http".into(),
            side_effect: SideEffectClass::Keyed,
            args: serde_json::json!({"amount": 5}),
            config,
            timeout,
            progress: Default::default(),
        }
    }

    async fn answer(
        State(seen): State<Arc<AtomicUsize>>,
        headers: HeaderMap,
        Json(body): Json<Value>,
    ) -> impl IntoResponse {
        seen.fetch_add(1, Ordering::SeqCst);
        let key = headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        match body["amount"].as_i64() {
            Some(5) => (StatusCode::OK, Json(serde_json::json!({"key": key}))).into_response(),
            Some(429) => (
                StatusCode::TOO_MANY_REQUESTS,
                [("retry-after", "3")],
                "slow down",
            )
                .into_response(),
            Some(503) => (StatusCode::SERVICE_UNAVAILABLE, "later").into_response(),
            Some(400) => (StatusCode::BAD_REQUEST, "no").into_response(),
            Some(200) => (StatusCode::OK, "plain text").into_response(),
            _ => {
                tokio::time::sleep(Duration::from_secs(5)).await;
                StatusCode::OK.into_response()
            }
        }
    }

    /// A receiver that answers 200 and never stops writing (a hostile or broken one): the
    /// step fails `answer_too_large` once the body passes the cap — for good for a `keyed`
    /// call, unknown for an `unsafe` one (it happened) — and the rest is never read. Seen
    /// red: with the cap skipped (and a 1 s timeout, so the machine survives it), the
    /// body was read until the timeout cut it, `body_lost`.
    #[tokio::test]
    async fn an_endless_answer_is_cut_at_the_cap() {
        async fn endless() -> impl IntoResponse {
            let chunk = axum::body::Bytes::from(vec![b'x'; 1 << 20]);
            let stream =
                futures::stream::repeat_with(move || Ok::<_, std::io::Error>(chunk.clone()));
            axum::body::Body::from_stream(stream)
        }
        let base = serve(Router::new().route("/endless", post(endless))).await;
        let config = serde_json::json!({"url": format!("{base}/endless")});
        let mut keyed = call(config, Duration::from_secs(60));
        let error = Http::new(crate::handlers::http_client())
            .call(&keyed)
            .await
            .expect_err("refused");
        assert_eq!(error.code(), "answer_too_large");
        assert!(!error.is_retryable());
        assert!(!matches!(error, HandlerError::Unknown { .. }));
        keyed.side_effect = SideEffectClass::Unsafe;
        let error = Http::new(crate::handlers::http_client())
            .call(&keyed)
            .await
            .expect_err("refused");
        assert!(matches!(error, HandlerError::Unknown { .. }), "{error:?}");
    }

    #[tokio::test]
    async fn statuses_are_told_apart() {
        let seen = Arc::new(AtomicUsize::new(0));
        let base = serve(
            Router::new()
                .route("/x", post(answer))
                .with_state(seen.clone()),
        )
        .await;
        let http = Http::new(super::super::http_client());
        let config = serde_json::json!({"url": format!("{base}/x")});
        let mut c = call(config, Duration::from_secs(2));

        assert_eq!(
            http.call(&c).await,
            Ok(serde_json::json!({"key": "op/1"})),
            "2xx: the JSON answer, and the key was sent"
        );
        c.args = serde_json::json!({"amount": 200});
        assert_eq!(
            http.call(&c).await,
            Ok(serde_json::json!({"status": 200, "body": "plain text"}))
        );
        c.args = serde_json::json!({"amount": 429});
        let error = http.call(&c).await.expect_err("429");
        assert!(error.is_retryable());
        assert_eq!(error.code(), "rate_limited");
        assert_eq!(error.retry_after(), Some(Duration::from_secs(3)));
        c.args = serde_json::json!({"amount": 503});
        let error = http.call(&c).await.expect_err("503");
        assert!(error.is_retryable());
        assert_eq!(error.code(), "server_error");
        c.args = serde_json::json!({"amount": 400});
        let error = http.call(&c).await.expect_err("400");
        assert!(!error.is_retryable() && !error.is_unknown());
        assert_eq!(error.code(), "client_error");
        c.args = serde_json::json!({"amount": 1});
        c.timeout = Duration::from_millis(200);
        let error = http.call(&c).await.expect_err("timeout");
        assert!(error.is_unknown(), "{error:?}");
        assert_eq!(error.code(), "timeout");
        assert_eq!(
            seen.load(Ordering::SeqCst),
            6,
            "one request per call, never more"
        );
    }

    #[tokio::test]
    async fn refused_connections_are_retryable_and_bad_config_is_permanent() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        drop(listener);
        let http = Http::new(super::super::http_client());
        let error = http
            .call(&call(
                serde_json::json!({"url": format!("http://{addr}/x")}),
                Duration::from_secs(2),
            ))
            .await
            .expect_err("refused");
        assert!(error.is_retryable(), "{error:?}");
        assert_eq!(error.code(), "connect_failed");
        let error = http
            .call(&call(
                serde_json::json!({"uri": "typo"}),
                Duration::from_secs(2),
            ))
            .await
            .expect_err("bad config");
        assert_eq!(error.code(), "bad_config");
    }

    #[tokio::test]
    async fn lookups_read_the_status_endpoint() {
        let base = serve(Router::new().route(
            "/status/{id}",
            get(
                |axum::extract::Path(id): axum::extract::Path<String>| async move {
                    match id.as_str() {
                        "done" => (
                            StatusCode::OK,
                            Json(serde_json::json!({"status": "succeeded", "output": {"n": 1}})),
                        )
                            .into_response(),
                        "bad" => (
                            StatusCode::OK,
                            Json(serde_json::json!({"status": "failed", "error": "declined"})),
                        )
                            .into_response(),
                        "down" => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
                        _ => StatusCode::NOT_FOUND.into_response(),
                    }
                },
            ),
        ))
        .await;
        let http = Http::new(super::super::http_client());
        let config =
            serde_json::json!({"url": format!("{base}/x"), "status_url": format!("{base}/status")});
        let mut c = call(config, Duration::from_secs(2));
        c.operation_id = "done".into();
        assert_eq!(
            http.lookup(&c).await,
            Ok(Lookup::Succeeded(serde_json::json!({"n": 1})))
        );
        c.operation_id = "bad".into();
        assert!(matches!(http.lookup(&c).await, Ok(Lookup::Failed { .. })));
        c.operation_id = "never".into();
        assert_eq!(http.lookup(&c).await, Ok(Lookup::NotFound));
        c.operation_id = "down".into();
        assert!(http.lookup(&c).await.expect_err("5xx").is_unknown());
        c.config = serde_json::json!({"url": format!("{base}/x")});
        assert_eq!(http.lookup(&c).await, Ok(Lookup::Unsupported));
    }

    /// A receiver's text reaches the step's error cut to 256 characters, and a lookup's
    /// answer that is not one never reaches it: an error is not a way to read what a URL
    /// serves. Seen red with the cut at 500 characters and the answer copied into the
    /// lookup's error, as they were.
    #[tokio::test]
    async fn a_receivers_text_in_an_error_is_bounded() {
        let long = format!("{}SECRET-AT-THE-END", "x".repeat(300));
        let base =
            serve(
                Router::new()
                    .route(
                        "/x",
                        post(move || async move { (StatusCode::BAD_REQUEST, long) }),
                    )
                    .route(
                        "/status/{id}",
                        get(move || async move {
                            Json(serde_json::json!({"body": "internal: SECRET"}))
                        }),
                    ),
            )
            .await;
        let http = Http::new(super::super::http_client());
        let config =
            serde_json::json!({"url": format!("{base}/x"), "status_url": format!("{base}/status")});
        let c = call(config, Duration::from_secs(2));
        let error = http.call(&c).await.expect_err("400");
        let text = error
            .message()
            .strip_prefix("400 Bad Request: ")
            .expect("the status first");
        assert_eq!(text.chars().count(), super::super::MAX_RECEIVER_TEXT);
        assert!(text.ends_with('…') && !text.contains("SECRET"), "{text}");
        let error = http.lookup(&c).await.expect_err("no status");
        assert_eq!(error.code(), "lookup_failed");
        assert!(!error.message().contains("SECRET"), "{error}");
    }

    #[test]
    fn segments_are_percent_encoded() {
        assert_eq!(encode_segment("op/1 x"), "op%2F1%20x");
        assert_eq!(encode_segment("abc-_.~9"), "abc-_.~9");
    }
}
