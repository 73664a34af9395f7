//! An executor binary of your own: Sortie's built-in handlers (`http`, `llm`, `mcp`,
//! `echo`, `sleep`) plus two of yours, with every flag, environment variable and endpoint
//! of `sortie executor` (`--queue`, `--kafka-properties`, `--seal-*`, `/healthz`,
//! `/metrics`, ...): `my-executor --help` lists them.
//!
//! ```text
//! cargo run -- --queue custom
//! ```
//!
//! then give a graph node `tool: shout` (or `tool: inventory`) and `queue: custom`
//! (docs/guides/custom-handlers.md).

use std::collections::HashMap;
use std::sync::Mutex;

use serde_json::{json, Value};
use sortie_executor::{Call, HandlerError, Lookup, StepHandler};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    sortie_executor::command::main(|egress| {
        let mut handlers = sortie_executor::Handlers::builtin_with(egress);
        handlers
            .register("shout", Shout)
            .register("inventory", Inventory::default());
        handlers
    })
    .await
}

/// The simplest handler: no receiver, the output is computed from the args.
struct Shout;

impl StepHandler for Shout {
    async fn call(&self, call: &Call) -> Result<Value, HandlerError> {
        let text = call.args["text"]
            .as_str()
            .ok_or_else(|| HandlerError::permanent("bad_args", "args.text must be a string"))?;
        Ok(json!({ "text": text.to_uppercase() }))
    }
}

/// A handler whose "receiver" remembers operations by id, so it can be declared
/// `keyed` (it dedupes) or `reconcilable` (it answers lookups). A real one would call a
/// service with `call.operation_id` as the idempotency key.
#[derive(Default)]
struct Inventory {
    reserved: Mutex<HashMap<String, Value>>,
}

impl StepHandler for Inventory {
    async fn call(&self, call: &Call) -> Result<Value, HandlerError> {
        let sku = call.args["sku"]
            .as_str()
            .ok_or_else(|| HandlerError::permanent("bad_args", "args.sku must be a string"))?;
        let mut reserved = self.reserved.lock().unwrap_or_else(|e| e.into_inner());
        let answer = reserved
            .entry(call.operation_id.clone())
            .or_insert_with(|| json!({ "sku": sku, "reservation": call.operation_id }));
        Ok(answer.clone())
    }

    async fn lookup(&self, call: &Call) -> Result<Lookup, HandlerError> {
        let reserved = self.reserved.lock().unwrap_or_else(|e| e.into_inner());
        Ok(match reserved.get(&call.operation_id) {
            Some(answer) => Lookup::Succeeded(answer.clone()),
            None => Lookup::NotFound,
        })
    }
}
