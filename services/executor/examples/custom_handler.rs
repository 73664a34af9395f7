//! A user's own executor binary: the built-in handlers plus two of their own.
//!
//! Against the dev stack (broker, registry, topology, a reducer):
//!
//! ```text
//! cargo run -p sortie-executor --example custom_handler
//! ```
//!
//! then give a graph node `tool: shout` (or `tool: inventory`) on queue `default`. Config
//! comes from the same environment variables as `sortie executor`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use serde_json::{json, Value};
use sortie_executor::{
    Call, ExecutorConfig, HandlerError, Handlers, KafkaConfig, Lookup, StepHandler, Topics,
};

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

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let env = |key: &str, default: &str| std::env::var(key).unwrap_or_else(|_| default.to_owned());
    let mut config = ExecutorConfig::new(
        KafkaConfig::new(env("SORTIE__KAFKA__BOOTSTRAP_SERVERS", "127.0.0.1:9092")),
        env("SORTIE__REGISTRY__URL", "http://127.0.0.1:8081"),
        Topics::new(env("SORTIE__TOPICS__PREFIX", "sortie.")),
        env("SORTIE__EXECUTOR__QUEUES", "default")
            .split(',')
            .map(str::to_owned)
            .collect(),
    );
    config.default_timeout = Duration::from_secs(10);

    let mut handlers = Handlers::builtin();
    handlers
        .register("shout", Shout)
        .register("inventory", Inventory::default());

    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    sortie_executor::run(config, handlers, shutdown).await?;
    Ok(())
}
