//! A small MCP server for the dev stack (`POST /mcp` on the dev receiver): the Streamable
//! HTTP transport in its plainest form (every answer `application/json`, no session, no
//! server-sent events), enough for `topology/graphs/mcp.yaml` to run in `sortie dev`.
//! The integration tests use a server of the official Python SDK instead
//! (`tests/python/mcp_server.py`): this one only stands in for a shop's server here.
//!
//! Tools, each call recorded in the ledger before it is answered, keyed by the operation
//! id the caller put in the request's `_meta` (`sortie/operation_id`):
//!
//! | tool | ledger name | what it does |
//! |---|---|---|
//! | `lookup_order(order_id)` | `mcp/lookup_order` | reads an order (every call recorded) |
//! | `refund(order_id, amount)` | `mcp/refund` | moves money; a repeated operation id gets the first answer and refunds nothing |

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::ledger::{Ledger, Mode};

/// The ledger name of `lookup_order` calls.
pub const LOOKUP_ORDER: &str = "mcp/lookup_order";
/// The ledger name of `refund` calls.
pub const REFUND: &str = "mcp/refund";
/// The `_meta` key Sortie puts the operation id under.
pub const OPERATION_ID_META: &str = "sortie/operation_id";

const PROTOCOL_VERSIONS: &[&str] = &["2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05"];

/// The server's tools, as `tools/list` answers them.
pub fn tools() -> Value {
    json!([
        {
            "name": "lookup_order",
            "description": "Reads an order: its total, currency and status.",
            "inputSchema": {
                "type": "object",
                "properties": {"order_id": {"type": "string", "description": "The order's id, e.g. ord-1."}},
                "required": ["order_id"]
            }
        },
        {
            "name": "refund",
            "description": "Refunds an amount on an order. Moves money.",
            "inputSchema": {
                "type": "object",
                "properties": {
                    "order_id": {"type": "string", "description": "The order's id."},
                    "amount": {"type": "number", "description": "The amount to refund."}
                },
                "required": ["order_id", "amount"]
            }
        }
    ])
}

/// The `/mcp` route, recording into `ledger`.
pub fn router(ledger: Arc<Ledger>) -> Router {
    Router::new()
        .route("/mcp", post(rpc).delete(|| async { StatusCode::OK }))
        .with_state(ledger)
}

async fn rpc(State(ledger): State<Arc<Ledger>>, Json(message): Json<Value>) -> Response {
    let id = message.get("id").cloned();
    let method = message["method"].as_str().unwrap_or_default();
    let Some(id) = id else {
        // A notification (`notifications/initialized`, a cancel): nothing to answer.
        return StatusCode::ACCEPTED.into_response();
    };
    let params = &message["params"];
    let outcome = match method {
        "initialize" => {
            let asked = params["protocolVersion"].as_str().unwrap_or_default();
            let version = PROTOCOL_VERSIONS
                .iter()
                .find(|v| **v == asked)
                .copied()
                .unwrap_or(PROTOCOL_VERSIONS[0]);
            Ok(json!({
                "protocolVersion": version,
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "sortie-dev-shop", "version": env!("CARGO_PKG_VERSION")}
            }))
        }
        "ping" => Ok(json!({})),
        "tools/list" => Ok(json!({"tools": tools()})),
        "tools/call" => call(&ledger, params).await,
        other => Err((-32601, format!("method {other:?} is not served here"))),
    };
    let body = match outcome {
        Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
        Err((code, message)) => {
            json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
        }
    };
    Json(body).into_response()
}

fn text_result(text: String, structured: Value) -> Value {
    json!({"content": [{"type": "text", "text": text}], "structuredContent": structured, "isError": false})
}

async fn call(ledger: &Ledger, params: &Value) -> Result<Value, (i64, String)> {
    let arguments = params.get("arguments").cloned().unwrap_or(json!({}));
    let operation_id = params["_meta"][OPERATION_ID_META]
        .as_str()
        .map(str::to_owned);
    let order_id = arguments["order_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let (name, mode, output) = match params["name"].as_str().unwrap_or_default() {
        "lookup_order" => {
            if order_id.is_empty() {
                return Ok(
                    json!({"content": [{"type": "text", "text": "order_id is required"}], "isError": true}),
                );
            }
            let order = json!({"order_id": order_id, "total": "42.00", "currency": "EUR", "status": "delivered"});
            let text = format!("Order {order_id}: delivered, total 42.00 EUR.");
            (LOOKUP_ORDER, Mode::Plain, text_result(text, order))
        }
        "refund" => {
            let amount = arguments["amount"].as_f64().unwrap_or(0.0);
            let refund_id = format!(
                "re_{}",
                operation_id
                    .as_deref()
                    .unwrap_or("none")
                    .chars()
                    .rev()
                    .take(12)
                    .collect::<String>()
            );
            let structured = json!({"refund_id": refund_id, "order_id": order_id, "amount": amount, "status": "refunded"});
            let text = format!("Refunded {amount} on order {order_id} ({refund_id}).");
            (REFUND, Mode::Keyed, text_result(text, structured))
        }
        other => return Err((-32602, format!("unknown tool {other:?}"))),
    };
    let body = json!({"tool": params["name"], "arguments": arguments});
    match ledger
        .record_as(mode, operation_id, name, body, |_, _| output)
        .await
    {
        Ok(entry) => Ok(entry.answer),
        Err(e) => Err((-32603, format!("the ledger could not record the call: {e}"))),
    }
}
