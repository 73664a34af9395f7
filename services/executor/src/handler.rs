//! The handler contract: what a step handler receives ([`Call`]), what it may answer
//! (an output or a typed [`HandlerError`]), how a receiver is asked about an operation
//! ([`Lookup`]), and the registry of handlers by tool name ([`Handlers`]).

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt as _;
use serde_json::Value;
use sortie_wire::records::{SideEffectClass, StepIntent};

/// One attempt of one operation, as a handler sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    /// The stable identity of the side effect: hand it to the receiver as its
    /// idempotency key (the built-in handlers send `Idempotency-Key`).
    pub operation_id: String,
    pub attempt: u32,
    pub tenant: String,
    pub run_id: String,
    pub step_id: String,
    pub node: String,
    pub tool: String,
    pub side_effect: SideEffectClass,
    /// The node's arguments, templates resolved by the reducer.
    pub args: Value,
    /// The node's `config` (endpoint, model, ...), verbatim from the graph.
    pub config: Value,
    /// This attempt's budget. A handler gives up by then, with
    /// [`HandlerError::Unknown`] if its request may have reached the receiver.
    pub timeout: Duration,
    /// Where to report progress while the call runs (an `llm` step streams its text
    /// there): [`crate::progress`].
    pub progress: crate::progress::Progress,
}

impl Call {
    /// The call for an intent. Arguments and config travel as JSON text; text that is not
    /// JSON is a permanent failure of the step (the graph or its input is wrong).
    pub fn from_intent(
        intent: &StepIntent,
        default_timeout: Duration,
    ) -> Result<Call, HandlerError> {
        let parse = |what: &str, text: &str| -> Result<Value, HandlerError> {
            if text.trim().is_empty() {
                return Ok(Value::Object(serde_json::Map::new()));
            }
            serde_json::from_str(text).map_err(|e| {
                HandlerError::permanent(format!("bad_{what}"), format!("{what} is not JSON: {e}"))
            })
        };
        let timeout = intent
            .timeout_ms
            .filter(|ms| *ms > 0)
            .map(|ms| Duration::from_millis(ms as u64))
            .unwrap_or(default_timeout);
        Ok(Call {
            operation_id: intent.operation_id.clone(),
            attempt: u32::try_from(intent.attempt).unwrap_or(0),
            tenant: intent.tenant.clone(),
            run_id: intent.run_id.clone(),
            step_id: intent.step_id.clone(),
            node: intent.node.clone(),
            tool: intent.tool.clone(),
            side_effect: intent.side_effect,
            args: parse("args", &intent.args)?,
            config: parse("config", &intent.config)?,
            timeout,
            progress: Default::default(),
        })
    }
}

/// Why an attempt did not succeed. The variant decides the run's fate, so it is a type:
/// only [`HandlerError::Retryable`] says "this attempt had no effect, try again".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandlerError {
    /// The attempt certainly had no effect and a later one may succeed (connection
    /// refused before sending, 429, 5xx). The reducer applies the node's retry policy.
    #[error("{code}: {message}")]
    Retryable {
        code: String,
        message: String,
        /// The receiver asked to wait at least this long (429 `Retry-After`).
        retry_after: Option<Duration>,
    },
    /// The attempt failed and repeating it will fail again (4xx, bad arguments, an
    /// unknown tool).
    #[error("{code}: {message}")]
    Permanent { code: String, message: String },
    /// The request may or may not have taken effect (timeout or connection lost after
    /// sending). The node's side-effect class decides what happens next.
    #[error("{code}: {message}")]
    Unknown { code: String, message: String },
}

impl HandlerError {
    pub fn retryable(code: impl Into<String>, message: impl Into<String>) -> Self {
        HandlerError::Retryable {
            code: code.into(),
            message: message.into(),
            retry_after: None,
        }
    }

    pub fn permanent(code: impl Into<String>, message: impl Into<String>) -> Self {
        HandlerError::Permanent {
            code: code.into(),
            message: message.into(),
        }
    }

    pub fn unknown(code: impl Into<String>, message: impl Into<String>) -> Self {
        HandlerError::Unknown {
            code: code.into(),
            message: message.into(),
        }
    }

    /// Whether another attempt may simply be made: true only for a failure known to have
    /// had no effect. (An unknown outcome is retried or not by its class, in the reducer.)
    pub fn is_retryable(&self) -> bool {
        matches!(self, HandlerError::Retryable { .. })
    }

    /// Whether the outcome is unknown (the request may have taken effect).
    pub fn is_unknown(&self) -> bool {
        matches!(self, HandlerError::Unknown { .. })
    }

    pub fn code(&self) -> &str {
        match self {
            HandlerError::Retryable { code, .. }
            | HandlerError::Permanent { code, .. }
            | HandlerError::Unknown { code, .. } => code,
        }
    }

    pub fn message(&self) -> &str {
        match self {
            HandlerError::Retryable { message, .. }
            | HandlerError::Permanent { message, .. }
            | HandlerError::Unknown { message, .. } => message,
        }
    }

    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            HandlerError::Retryable { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

/// What a receiver knows about an operation (the `reconcilable` contract).
#[derive(Debug, Clone, PartialEq)]
pub enum Lookup {
    /// The receiver has no record of the operation. Calling is safe only on attempt 1 or
    /// when the node's config declares `lookup_authoritative: true`; otherwise a later
    /// attempt reports the outcome unknown (a lost record or a lagging lookup is not
    /// proof the call never happened).
    NotFound,
    /// The operation took effect; this is its output. It is reported without calling.
    Succeeded(Value),
    /// The receiver recorded the operation as failed: it had no effect, so the attempt
    /// the reducer dispatched may call again.
    Failed { code: String, message: String },
    /// This handler cannot ask (for `http`: no `status_url` in the node's config).
    Unsupported,
}

/// A step handler: performs one attempt of a tool call.
///
/// Implement it with `async fn`s and register it under a tool name in [`Handlers`]:
///
/// ```
/// use sortie_executor::{Call, HandlerError, Handlers, StepHandler};
///
/// struct Shout;
///
/// impl StepHandler for Shout {
///     async fn call(&self, call: &Call) -> Result<serde_json::Value, HandlerError> {
///         let text = call.args["text"].as_str().ok_or_else(|| {
///             HandlerError::permanent("bad_args", "args.text must be a string")
///         })?;
///         Ok(serde_json::json!({ "text": text.to_uppercase() }))
///     }
/// }
///
/// let mut handlers = Handlers::builtin();
/// handlers.register("shout", Shout);
/// ```
///
/// A handler makes at most one request to its receiver per call and never retries on its
/// own: the reducer owns retries. Pass [`Call::operation_id`] to the receiver as its
/// idempotency key. If the receiver can answer "what happened to operation X", implement
/// [`StepHandler::lookup`] so `reconcilable` nodes can use it.
pub trait StepHandler: Send + Sync + 'static {
    /// Performs the attempt: the output (any JSON; it is recorded in the run's history,
    /// so replays never call again), or why not.
    fn call(&self, call: &Call) -> impl Future<Output = Result<Value, HandlerError>> + Send;

    /// Asks the receiver what happened to `call.operation_id`. An `Err` means the
    /// receiver could not be asked; the outcome stays unknown.
    fn lookup(&self, call: &Call) -> impl Future<Output = Result<Lookup, HandlerError>> + Send {
        let _ = call;
        std::future::ready(Ok(Lookup::Unsupported))
    }
}

/// [`StepHandler`] with boxed futures, so handlers of different types share one map.
trait DynHandler: Send + Sync {
    fn call<'a>(&'a self, call: &'a Call) -> BoxFuture<'a, Result<Value, HandlerError>>;
    fn lookup<'a>(&'a self, call: &'a Call) -> BoxFuture<'a, Result<Lookup, HandlerError>>;
}

impl<H: StepHandler> DynHandler for H {
    fn call<'a>(&'a self, call: &'a Call) -> BoxFuture<'a, Result<Value, HandlerError>> {
        StepHandler::call(self, call).boxed()
    }

    fn lookup<'a>(&'a self, call: &'a Call) -> BoxFuture<'a, Result<Lookup, HandlerError>> {
        StepHandler::lookup(self, call).boxed()
    }
}

/// Handlers by tool name (the node's `tool`).
#[derive(Clone, Default)]
pub struct Handlers {
    map: BTreeMap<String, Arc<dyn DynHandler>>,
}

impl std::fmt::Debug for Handlers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handlers")
            .field("tools", &self.map.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Handlers {
    /// No handlers at all.
    pub fn new() -> Self {
        Self::default()
    }

    /// `http`, `llm`, `mcp`, `echo` and `sleep`, the first three held to the default
    /// egress policy: no loopback, private, link-local or other non-public address
    /// ([`crate::egress`]).
    pub fn builtin() -> Self {
        Self::builtin_with(&crate::egress::Egress::default())
    }

    /// [`Handlers::builtin`] with `egress`'s allowances.
    pub fn builtin_with(egress: &crate::egress::Egress) -> Self {
        let clients = crate::egress::Clients::new(egress);
        let mut handlers = Self::new();
        handlers
            .register("http", crate::handlers::Http::new(clients.clone()))
            .register("llm", crate::handlers::Llm::new(clients.clone()))
            .register("mcp", crate::handlers::Mcp::new(clients))
            .register("echo", crate::handlers::Echo)
            .register("sleep", crate::handlers::Sleep);
        handlers
    }

    /// Registers (or replaces) the handler of `tool`.
    pub fn register(&mut self, tool: impl Into<String>, handler: impl StepHandler) -> &mut Self {
        self.map.insert(tool.into(), Arc::new(handler));
        self
    }

    pub fn contains(&self, tool: &str) -> bool {
        self.map.contains_key(tool)
    }

    pub fn tools(&self) -> impl Iterator<Item = &str> {
        self.map.keys().map(String::as_str)
    }

    /// Runs `call.tool`'s handler. An unknown tool is a permanent failure
    /// (`unknown_tool`); a panicking handler is an unknown outcome (`handler_panicked`:
    /// it may have sent its request); a handler still busy one second past the call's
    /// timeout is an unknown outcome too (`handler_timeout`).
    pub async fn call(&self, call: &Call) -> Result<Value, HandlerError> {
        let handler = self.get(call)?;
        let limit = call.timeout + Duration::from_secs(1);
        match tokio::time::timeout(
            limit,
            std::panic::AssertUnwindSafe(handler.call(call)).catch_unwind(),
        )
        .await
        {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(HandlerError::unknown(
                "handler_panicked",
                format!("the {} handler panicked", call.tool),
            )),
            Err(_) => Err(HandlerError::unknown(
                "handler_timeout",
                format!("the {} handler did not finish within {limit:?}", call.tool),
            )),
        }
    }

    /// Asks `call.tool`'s receiver about the operation (see [`StepHandler::lookup`]).
    pub async fn lookup(&self, call: &Call) -> Result<Lookup, HandlerError> {
        let handler = self.get(call)?;
        let limit = call.timeout + Duration::from_secs(1);
        match tokio::time::timeout(
            limit,
            std::panic::AssertUnwindSafe(handler.lookup(call)).catch_unwind(),
        )
        .await
        {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(HandlerError::unknown(
                "lookup_panicked",
                format!("the {} handler's lookup panicked", call.tool),
            )),
            Err(_) => Err(HandlerError::unknown(
                "lookup_timeout",
                format!(
                    "the {} handler's lookup did not finish within {limit:?}",
                    call.tool
                ),
            )),
        }
    }

    fn get(&self, call: &Call) -> Result<&Arc<dyn DynHandler>, HandlerError> {
        self.map.get(&call.tool).ok_or_else(|| {
            HandlerError::permanent(
                "unknown_tool",
                format!("no handler for tool {:?} in this executor", call.tool),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(tool: &str) -> Call {
        Call {
            operation_id: "op-1".into(),
            attempt: 1,
            tenant: "acme".into(),
            run_id: "run-1".into(),
            step_id: "a#1".into(),
            node: "a".into(),
            tool: tool.into(),
            side_effect: SideEffectClass::Pure,
            args: serde_json::json!({"text": "hi"}),
            config: serde_json::json!({}),
            timeout: Duration::from_millis(200),
            progress: Default::default(),
        }
    }

    struct Shout;
    impl StepHandler for Shout {
        async fn call(&self, call: &Call) -> Result<Value, HandlerError> {
            Ok(serde_json::json!({"text": call.args["text"].as_str().unwrap_or("").to_uppercase()}))
        }
    }

    struct Panics;
    impl StepHandler for Panics {
        async fn call(&self, _call: &Call) -> Result<Value, HandlerError> {
            panic!("boom")
        }
    }

    struct Hangs;
    impl StepHandler for Hangs {
        async fn call(&self, _call: &Call) -> Result<Value, HandlerError> {
            std::future::pending().await
        }
    }

    #[tokio::test]
    async fn a_registered_handler_runs_and_an_unknown_tool_is_permanent() {
        let mut handlers = Handlers::builtin();
        handlers.register("shout", Shout);
        assert_eq!(
            handlers.call(&call("shout")).await,
            Ok(serde_json::json!({"text": "HI"}))
        );
        let error = handlers.call(&call("nope")).await.expect_err("an error");
        assert_eq!(error.code(), "unknown_tool");
        assert!(!error.is_retryable() && !error.is_unknown());
        assert_eq!(
            handlers.lookup(&call("shout")).await,
            Ok(Lookup::Unsupported),
            "lookup defaults to unsupported"
        );
    }

    #[tokio::test]
    async fn a_panicking_or_hanging_handler_is_an_unknown_outcome() {
        let mut handlers = Handlers::new();
        handlers.register("panics", Panics).register("hangs", Hangs);
        assert_eq!(
            handlers
                .call(&call("panics"))
                .await
                .expect_err("an error")
                .code(),
            "handler_panicked"
        );
        tokio::time::pause();
        assert_eq!(
            handlers
                .call(&call("hangs"))
                .await
                .expect_err("an error")
                .code(),
            "handler_timeout"
        );
    }

    #[test]
    fn a_call_parses_args_and_config_and_takes_the_intent_timeout() {
        let mut intent = StepIntent {
            operation_id: "op".into(),
            attempt: 2,
            tenant: "t".into(),
            run_id: "r".into(),
            step_id: "s#1".into(),
            node: "s".into(),
            graph_id: "g".into(),
            graph_version: 1,
            tool: "echo".into(),
            queue: "default".into(),
            side_effect: SideEffectClass::Keyed,
            args: r#"{"a":1}"#.into(),
            config: String::new(),
            timeout_ms: Some(1500),
            issued_at: 0,
            lookup_only: false,
        };
        let call = Call::from_intent(&intent, Duration::from_secs(30)).expect("call");
        assert_eq!(call.args["a"], 1);
        assert_eq!(call.config, serde_json::json!({}));
        assert_eq!(call.timeout, Duration::from_millis(1500));
        assert_eq!(call.attempt, 2);
        intent.timeout_ms = None;
        intent.args = "{not json".into();
        let error = Call::from_intent(&intent, Duration::from_secs(30)).expect_err("an error");
        assert_eq!(error.code(), "bad_args");
    }
}
