//! The dev receiver: the services the example graphs (`topology/graphs/`) call, answered
//! by the ledger so every call is recorded (and fsynced) before it is answered.
//!
//! | route | side-effect class in the graphs | answer |
//! |---|---|---|
//! | `POST /orders/read` | `pure` (a read: every call is recorded, none deduped) | the order: `order_id`, `customer_id`, `total`, `currency`, `status`, `items` |
//! | `POST /payments/refund` | `keyed`: a repeated `Idempotency-Key` gets the first answer and refunds nothing | `refund_id`, `status: refunded`, `order_id`, `amount`, `currency` |
//! | `POST /payments/reverse` | `keyed` | `reversal_id`, `refund_id`, `status: reversed`, `amount` |
//! | `POST /notifications/refund` | `idempotent`: the same request again changes nothing | `notification_id`, `channel`, `status: sent`, `customer_id`; a customer id starting `cus-unreachable` is refused with 422 (nothing recorded), so a refund run can be made to fail after its refund and show the reversal |
//! | `GET /status/{operation_id}` | `reconcilable` lookups, for any route | 200 `{"status": "succeeded", "output"}` or 404 |
//! | `POST /v1/chat/completions`, `POST /v1/messages` | the `llm` nodes' model (`base_url: http://127.0.0.1:8090/v1`), OpenAI or Anthropic | the scripted fake model ([`crate::model`]): a call to the first tool, then the second, then a text answer; `GET /v1/fake/requests` lists what it was asked |
//! | `POST /mcp` | the MCP server of `topology/graphs/mcp.yaml` | [`crate::mcp`]: `lookup_order` and `refund` (keyed by the `_meta` operation id) |
//!
//! plus the ledger's own routes (`/ledger`, `/ledger/{operation_id}`, `/effects/{name}`,
//! `/faults`). Answers are deterministic: ids and amounts derive from the request (an
//! order's total from its id), so a replayed demo looks the same.
//!
//! The graphs name `http://127.0.0.1:8090` ([`EXAMPLE_BASE`]); `sortie dev` serves the
//! receiver there, or rewrites the graphs' URLs with [`rebase_urls`] when it listens
//! elsewhere.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::ledger::{self, Ledger, Mode};

/// The base URL the example graphs call.
pub const EXAMPLE_BASE: &str = "http://127.0.0.1:8090";

/// The ledger's `name` of each route's calls.
pub const ORDERS_READ: &str = "orders/read";
pub const PAYMENTS_REFUND: &str = "payments/refund";
pub const PAYMENTS_REVERSE: &str = "payments/reverse";
pub const NOTIFICATIONS_REFUND: &str = "notifications/refund";
/// Customers whose ids start with this cannot be notified (a permanent 422): the refund
/// story then fails after its refund and the refund is reversed.
pub const UNREACHABLE: &str = "cus-unreachable";

/// The dev receiver's routes, recording into `ledger`.
pub fn router(ledger: Arc<Ledger>) -> Router {
    ledger::routes()
        .route("/orders/read", post(read_order))
        .route("/payments/refund", post(refund))
        .route("/payments/reverse", post(reverse))
        .route("/notifications/refund", post(notify))
        .route("/status/{operation_id}", get(status))
        .with_state(ledger.clone())
        .merge(crate::mcp::router(ledger))
        .merge(crate::model::router(crate::model::FakeModel::new()))
}

/// Serves the dev receiver on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    ledger: Arc<Ledger>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(ledger))
        .with_graceful_shutdown(shutdown)
        .await
}

/// Replaces the [`EXAMPLE_BASE`] prefix of every string under `url`/`status_url`/`base_url` keys of
/// a node's `config` with `base` (no trailing slash).
pub fn rebase_urls(config: &mut Value, base: &str) {
    let Value::Object(map) = config else {
        return;
    };
    for key in ["url", "status_url", "base_url"] {
        if let Some(Value::String(url)) = map.get_mut(key) {
            rebase_url(url, base);
        }
    }
}

/// Replaces the [`EXAMPLE_BASE`] prefix of `url` with `base` (no trailing slash).
pub fn rebase_url(url: &mut String, base: &str) {
    if let Some(rest) = url.strip_prefix(EXAMPLE_BASE) {
        *url = format!("{}{rest}", base.trim_end_matches('/'));
    }
}

/// A short, stable id: `prefix` and 16 hex digits of SHA-256 of `seed`.
fn stable_id(prefix: &str, seed: &str) -> String {
    let digest = Sha256::digest(seed.as_bytes());
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}_{hex}")
}

/// A number in `low..low + span` derived from `seed`.
fn stable_number(seed: &str, low: u64, span: u64) -> u64 {
    let digest = Sha256::digest(seed.as_bytes());
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&digest[..8]);
    low + u64::from_be_bytes(bytes) % span
}

fn text(body: &Value, key: &str) -> String {
    match &body[key] {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn key_of(headers: &HeaderMap) -> Option<String> {
    headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

fn json_body(body: &Bytes) -> Result<Value, Box<Response>> {
    if body.is_empty() {
        return Ok(json!({}));
    }
    serde_json::from_slice(body).map_err(|e| refused(format!("body is not JSON: {e}")))
}

fn refused(message: String) -> Box<Response> {
    Box::new((StatusCode::BAD_REQUEST, Json(json!({"error": message}))).into_response())
}

/// Records the call under `mode` and answers what was recorded (the first answer for a
/// repeat the mode absorbs).
async fn answer(
    ledger: &Ledger,
    mode: Mode,
    key: Option<String>,
    name: &str,
    body: Value,
    make: impl FnOnce(&Value) -> Value,
) -> Response {
    if mode == Mode::Keyed && key.is_none() {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": format!("{name} needs an Idempotency-Key header")})),
        )
            .into_response();
    }
    let output = make(&body);
    match ledger.record_as(mode, key, name, body, |_, _| output).await {
        Ok(entry) => {
            tracing::info!(
                seq = entry.seq,
                %name,
                operation_id = entry.operation_id.as_deref().unwrap_or(""),
                effect = entry.effect,
                "Call recorded."
            );
            (StatusCode::OK, Json(entry.answer)).into_response()
        }
        Err(e) => {
            tracing::error!(error = %e, "Recording a call failed.");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                Json(json!({"error": e.to_string()})),
            )
                .into_response()
        }
    }
}

async fn read_order(
    State(ledger): State<Arc<Ledger>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let body = match json_body(&body) {
        Ok(body) => body,
        Err(refused) => return *refused,
    };
    let order_id = text(&body, "order_id");
    if order_id.is_empty() {
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({"error": "order_id is required"})),
        )
            .into_response();
    }
    // A read changes nothing: every call is recorded as its own (harmless) call.
    answer(
        &ledger,
        Mode::Plain,
        key_of(&headers),
        ORDERS_READ,
        body,
        |body| {
            let order_id = text(body, "order_id");
            let customer_id = match text(body, "customer_id") {
                given if !given.is_empty() => given,
                _ => stable_id("cus", &order_id),
            };
            let cents = stable_number(&order_id, 1_000, 49_000);
            let total = format!("{}.{:02}", cents / 100, cents % 100);
            json!({
                "order_id": order_id,
                "customer_id": customer_id,
                "status": "delivered",
                "currency": "EUR",
                "total": total,
                "items": [{"sku": stable_id("sku", &order_id), "quantity": 1, "price": total}],
            })
        },
    )
    .await
}

async fn refund(State(ledger): State<Arc<Ledger>>, headers: HeaderMap, body: Bytes) -> Response {
    payment(&ledger, &headers, &body, PAYMENTS_REFUND, |body, key| {
        json!({
            "refund_id": stable_id("re", key),
            "status": "refunded",
            "order_id": body["order_id"],
            "amount": body["amount"],
            "currency": body["currency"],
        })
    })
    .await
}

async fn reverse(State(ledger): State<Arc<Ledger>>, headers: HeaderMap, body: Bytes) -> Response {
    payment(&ledger, &headers, &body, PAYMENTS_REVERSE, |body, key| {
        json!({
            "reversal_id": stable_id("rv", key),
            "refund_id": body["refund_id"],
            "status": "reversed",
            "amount": body["amount"],
        })
    })
    .await
}

/// A payment call: keyed by its `Idempotency-Key` (a repeat gets the first answer and no
/// second effect); `make` builds the answer from the body and the key.
async fn payment(
    ledger: &Ledger,
    headers: &HeaderMap,
    body: &Bytes,
    name: &str,
    make: impl FnOnce(&Value, &str) -> Value,
) -> Response {
    let body = match json_body(body) {
        Ok(body) => body,
        Err(refused) => return *refused,
    };
    let key = key_of(headers);
    let seed = key.clone().unwrap_or_default();
    answer(ledger, Mode::Keyed, key, name, body, |body| {
        make(body, &seed)
    })
    .await
}

async fn notify(State(ledger): State<Arc<Ledger>>, headers: HeaderMap, body: Bytes) -> Response {
    let body = match json_body(&body) {
        Ok(body) => body,
        Err(refused) => return *refused,
    };
    if text(&body, "customer_id").starts_with(UNREACHABLE) {
        return (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(json!({"error": "the customer has no contact channel"})),
        )
            .into_response();
    }
    let seed = body.to_string();
    answer(
        &ledger,
        Mode::Idempotent,
        key_of(&headers),
        NOTIFICATIONS_REFUND,
        body,
        |body| {
            json!({
                "notification_id": stable_id("nt", &seed),
                "channel": "email",
                "status": "sent",
                "customer_id": body["customer_id"],
            })
        },
    )
    .await
}

/// A status lookup for any operation the receiver took (the `reconcilable` contract).
async fn status(
    State(ledger): State<Arc<Ledger>>,
    UrlPath(operation_id): UrlPath<String>,
) -> Response {
    match ledger.status(&operation_id).await {
        Some(entry) => Json(json!({
            "status": "succeeded",
            "output": entry.answer,
            "seq": entry.seq,
        }))
        .into_response(),
        None => (StatusCode::NOT_FOUND, Json(json!({"status": "not_found"}))).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::Snapshot;

    async fn start(dir: &std::path::Path) -> String {
        let ledger = Arc::new(Ledger::open(dir.join("dev.jsonl"), Mode::Keyed).expect("open"));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(serve(listener, ledger, std::future::pending()));
        url
    }

    async fn post(url: &str, key: Option<&str>, body: Value) -> (u16, Value) {
        let mut request = reqwest::Client::new().post(url).json(&body);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        let response = request.send().await.expect("post");
        (
            response.status().as_u16(),
            response.json().await.unwrap_or(Value::Null),
        )
    }

    /// Seen red: with `Mode::Plain` instead of `Mode::Keyed` in `refund`, the repeated key
    /// refunds twice and the effect count below is 2.
    #[tokio::test]
    async fn a_repeated_refund_key_gets_the_first_answer_and_refunds_once() {
        let dir = tempfile::tempdir().expect("dir");
        let base = start(dir.path()).await;
        let (code, order) = post(
            &format!("{base}/orders/read"),
            Some("op-read"),
            json!({"order_id": "ord-1", "customer_id": "cus-1"}),
        )
        .await;
        assert_eq!(code, 200);
        assert_eq!(order["order_id"], "ord-1");
        assert_eq!(order["currency"], "EUR");
        let (_, again) = post(
            &format!("{base}/orders/read"),
            None,
            json!({"order_id": "ord-1", "customer_id": "cus-1"}),
        )
        .await;
        assert_eq!(order, again, "an order reads the same every time");

        let refund = json!({"order_id": "ord-1", "amount": order["total"], "currency": "EUR"});
        let (code, first) = post(
            &format!("{base}/payments/refund"),
            Some("op-refund"),
            refund.clone(),
        )
        .await;
        assert_eq!(code, 200);
        assert!(first["refund_id"]
            .as_str()
            .is_some_and(|id| id.starts_with("re_")));
        let (_, repeat) = post(
            &format!("{base}/payments/refund"),
            Some("op-refund"),
            refund.clone(),
        )
        .await;
        assert_eq!(first, repeat, "a repeated key gets the first answer");

        let found = reqwest::get(format!("{base}/status/op-refund"))
            .await
            .expect("status");
        assert_eq!(found.status().as_u16(), 200);
        let found: Value = found.json().await.expect("json");
        assert_eq!(
            found["output"], first,
            "the lookup reports the first answer"
        );
        let missing = reqwest::get(format!("{base}/status/op-none"))
            .await
            .expect("status");
        assert_eq!(missing.status().as_u16(), 404);

        let snapshot: Snapshot = reqwest::get(format!("{base}/ledger"))
            .await
            .expect("ledger")
            .json()
            .await
            .expect("snapshot");
        assert_eq!(
            (snapshot.effects("op-refund"), snapshot.calls("op-refund")),
            (1, 2),
            "the repeated key refunded twice"
        );
        let (code, _) = post(&format!("{base}/payments/refund"), None, refund).await;
        assert_eq!(code, 400, "a refund needs a key");
    }

    #[tokio::test]
    async fn notifications_absorb_the_same_request_and_reversals_are_keyed() {
        let dir = tempfile::tempdir().expect("dir");
        let base = start(dir.path()).await;
        let note = json!({"customer_id": "c", "order_id": "o", "refund_id": "re_1"});
        let (_, first) = post(
            &format!("{base}/notifications/refund"),
            Some("n1"),
            note.clone(),
        )
        .await;
        let (_, second) = post(&format!("{base}/notifications/refund"), Some("n1"), note).await;
        assert_eq!(first, second);
        assert_eq!(first["status"], "sent");
        let reversal = json!({"refund_id": "re_1", "amount": "12.00"});
        let (_, a) = post(
            &format!("{base}/payments/reverse"),
            Some("r1"),
            reversal.clone(),
        )
        .await;
        let (_, b) = post(&format!("{base}/payments/reverse"), Some("r1"), reversal).await;
        assert_eq!(a, b);
        assert_eq!(a["status"], "reversed");
        let snapshot: Snapshot = reqwest::get(format!("{base}/ledger"))
            .await
            .expect("ledger")
            .json()
            .await
            .expect("snapshot");
        assert_eq!(snapshot.total_effects(), 2);
    }

    #[test]
    fn rebase_urls_moves_only_the_example_base() {
        let mut config = json!({
            "url": "http://127.0.0.1:8090/orders/read",
            "status_url": "http://127.0.0.1:8090/status",
            "model": "x",
        });
        rebase_urls(&mut config, "http://127.0.0.1:5555/");
        assert_eq!(config["url"], "http://127.0.0.1:5555/orders/read");
        assert_eq!(config["status_url"], "http://127.0.0.1:5555/status");
        let mut other = json!({"url": "https://example.com/x"});
        rebase_urls(&mut other, "http://127.0.0.1:5555");
        assert_eq!(other["url"], "https://example.com/x");
    }
}
