//! Sortie's client of MCP servers (the Model Context Protocol), over the Streamable HTTP
//! transport, through the official Rust SDK (`rmcp`). Two calls, each in a session of its
//! own (initialize, the request, then the session is closed):
//!
//! - [`call_tool`]: one `tools/call`, for the executor's `mcp` handler. The operation id
//!   travels in the request's `_meta` under [`OPERATION_ID_META`] (with the run id and the
//!   attempt), so a server that wants idempotency can have it. Failures are classified by
//!   whether the tool call can have reached the server ([`Error`]): the executor maps them
//!   onto retryable, permanent and unknown outcomes.
//! - [`list_tools`]: a bounded `tools/list` (pages, tools, bytes), for pinning a server's
//!   tools into a graph version when it is published.
//!
//! This crate holds no run state and never retries: one request per call, as every
//! handler. A session per call costs one more round trip than a session kept open, and
//! buys a stateless executor: any executor takes any step, and nothing of a session
//! survives a crash to be reused wrongly. The SDK's transparent re-initialisation after
//! an expired session is off (it would send the request again).

use std::collections::HashMap;
use std::time::Duration;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, ClientCapabilities, ClientConfig, ErrorCode,
    Implementation, JsonObject, MetaObject, PaginatedRequestParams, RequestMetaObject,
};
use rmcp::service::{ClientInitializeError, RunningService, ServiceError};
use rmcp::transport::streamable_http_client::{
    StreamableHttpClientTransportConfig, StreamableHttpError,
};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{RoleClient, ServiceExt as _};
use serde_json::{Map, Value};
use sortie_core::mcp::PinnedTool;

/// The `_meta` key of a `tools/call` that carries the step's operation id: the same on
/// every attempt of the step, different for a legitimately repeated call. A server that
/// keeps it can answer a repeated call without repeating its effect.
pub const OPERATION_ID_META: &str = "sortie/operation_id";
/// The `_meta` key that carries the run id.
pub const RUN_ID_META: &str = "sortie/run_id";
/// The `_meta` key that carries the attempt number (1, 2, ...).
pub const ATTEMPT_META: &str = "sortie/attempt";

/// Largest answer read from a server (a JSON body or one SSE event). Past it the answer
/// is refused unread; what is kept of a call is then held to `sortie_core::limits`.
pub const MAX_RESPONSE_BYTES: usize = 1024 * 1024;
/// Most `tools/list` pages read from one server.
pub const MAX_LIST_PAGES: usize = 16;

/// Where a server is and the headers every request to it carries (an auth header's value
/// already read from its secret reference by the caller).
#[derive(Clone)]
pub struct Endpoint {
    pub url: String,
    pub headers: Vec<(String, String)>,
}

impl std::fmt::Debug for Endpoint {
    // Header values are secrets: never printed.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("url", &self.url)
            .field(
                "headers",
                &self.headers.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// One `tools/call`.
#[derive(Debug, Clone)]
pub struct ToolCall {
    pub tool: String,
    pub arguments: Map<String, Value>,
    pub operation_id: String,
    pub run_id: String,
    pub attempt: u32,
}

/// Why a request did not give an answer, by what the server can have done.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The request never reached the server (it could not be connected to, or the
    /// session could not be opened): another attempt may simply be made.
    #[error("{0}")]
    NotSent(String),
    /// The server refused the request and will refuse it again: an HTTP 4xx, or a
    /// JSON-RPC error that says the request is wrong (unknown tool, invalid arguments,
    /// unknown method), or a protocol version it does not speak.
    #[error("{0}")]
    Refused(String),
    /// The server answered that it did not do it, for now: HTTP 429 or 5xx, a JSON-RPC
    /// internal error, an expired session.
    #[error("{message}")]
    Busy {
        message: String,
        retry_after: Option<Duration>,
    },
    /// The request was sent and no usable answer came back: the tool may have run.
    #[error("{0}")]
    Lost(String),
    /// The answer was larger than [`MAX_RESPONSE_BYTES`], or a listing broke its bounds.
    #[error("{0}")]
    TooLarge(String),
}

/// What a server answered to a `tools/call`: the result as MCP writes it (`content`,
/// `structuredContent`; `isError` and `_meta` are taken out), and whether the tool
/// reported an error (`isError`).
#[derive(Debug, Clone, PartialEq)]
pub struct CallOutcome {
    pub result: Value,
    pub is_error: bool,
}

impl CallOutcome {
    /// The text of the result's text content, joined by new lines (what an error result
    /// says, typically).
    pub fn text(&self) -> String {
        text_of(&self.result)
    }
}

/// The text items of a result's `content`, joined by new lines.
pub fn text_of(result: &Value) -> String {
    result
        .get("content")
        .and_then(Value::as_array)
        .map(|items| {
            items
                .iter()
                .filter_map(|i| i.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_default()
}

type Client = RunningService<RoleClient, ClientConfig>;

fn client_info() -> ClientConfig {
    ClientConfig::new(
        ClientCapabilities::default(),
        Implementation::new("sortie", env!("CARGO_PKG_VERSION")),
    )
}

/// The HTTP client a session runs over, as [`call_tool`] and [`list_tools`] build it: a
/// caller that needs more of it (the executor's egress policy: its resolver and redirect
/// check) builds on this and hands the client to [`call_tool_via`].
pub fn client_builder() -> reqwest13::ClientBuilder {
    reqwest13::Client::builder()
        .connect_timeout(Duration::from_secs(5))
        .user_agent(concat!("sortie/", env!("CARGO_PKG_VERSION")))
}

fn default_client() -> Result<reqwest13::Client, Error> {
    client_builder()
        .build()
        .map_err(|e| Error::NotSent(format!("building the HTTP client: {e}")))
}

/// Opens a session (`initialize`, `notifications/initialized`). Nothing of a tool call
/// has been sent yet, so a failure here is [`Error::NotSent`] or [`Error::Refused`].
async fn connect(endpoint: &Endpoint, client: reqwest13::Client) -> Result<Client, Error> {
    let mut headers = HashMap::new();
    for (name, value) in &endpoint.headers {
        let name = http::HeaderName::try_from(name.as_str())
            .map_err(|e| Error::Refused(format!("header name {name:?}: {e}")))?;
        let value = http::HeaderValue::try_from(value.as_str())
            .map_err(|_| Error::Refused(format!("the value of header {name} is not valid")))?;
        headers.insert(name, value);
    }
    let config = StreamableHttpClientTransportConfig::with_uri(endpoint.url.as_str())
        .custom_headers(headers)
        .max_json_response_size(MAX_RESPONSE_BYTES)
        .max_sse_event_size(MAX_RESPONSE_BYTES)
        .max_error_response_size(4096)
        .reinit_on_expired_session(false);
    let transport = StreamableHttpClientTransport::with_client(client, config);
    client_info()
        .serve(transport)
        .await
        .map_err(|e| initialize_error(&endpoint.url, e))
}

/// Closes a session in the background: the answer is in hand, the step need not wait.
fn close(mut client: Client) {
    tokio::spawn(async move {
        let _ = client.close_with_timeout(Duration::from_secs(2)).await;
    });
}

/// Calls one tool. `timeout` bounds the whole exchange; past it, a call already sent is
/// [`Error::Lost`].
pub async fn call_tool(
    endpoint: &Endpoint,
    call: &ToolCall,
    timeout: Duration,
) -> Result<CallOutcome, Error> {
    call_tool_via(endpoint, call, timeout, default_client()?).await
}

/// [`call_tool`] over `client` (built on [`client_builder`]), for this one session.
pub async fn call_tool_via(
    endpoint: &Endpoint,
    call: &ToolCall,
    timeout: Duration,
    client: reqwest13::Client,
) -> Result<CallOutcome, Error> {
    let deadline = tokio::time::Instant::now() + timeout;
    let client = tokio::time::timeout_at(deadline, connect(endpoint, client))
        .await
        .map_err(|_| {
            Error::NotSent(format!(
                "{}: the session was not opened within {timeout:?}; the tool was not called",
                endpoint.url
            ))
        })??;
    let mut meta = Map::new();
    meta.insert(
        OPERATION_ID_META.into(),
        Value::from(call.operation_id.as_str()),
    );
    meta.insert(RUN_ID_META.into(), Value::from(call.run_id.as_str()));
    meta.insert(ATTEMPT_META.into(), Value::from(call.attempt));
    let mut params = CallToolRequestParams::new(call.tool.clone())
        .with_arguments(JsonObject::from_iter(call.arguments.clone()));
    params.meta = Some(RequestMetaObject(MetaObject(meta)));
    let answer = tokio::time::timeout_at(deadline, client.peer().call_tool_once(params)).await;
    close(client);
    let response = match answer {
        Err(_) => {
            return Err(Error::Lost(format!(
                "tools/call {} sent to {}: no answer within {timeout:?}",
                call.tool, endpoint.url
            )))
        }
        Ok(Err(error)) => return Err(call_error(&call.tool, error)),
        Ok(Ok(response)) => response,
    };
    let result = match response {
        CallToolResponse::Complete(result) => result,
        CallToolResponse::InputRequired(_) => {
            return Err(Error::Refused(format!(
                "tools/call {} asked for input (elicitation, sampling, roots), which Sortie does not give",
                call.tool
            )))
        }
        // The server made it a task: it runs, and this call cannot follow it.
        _ => {
            return Err(Error::Lost(format!(
                "tools/call {} answered with a task, which Sortie does not follow: the tool may run",
                call.tool
            )))
        }
    };
    let mut value = serde_json::to_value(&result).map_err(|e| {
        Error::Lost(format!(
            "tools/call {}: the result cannot be written back as JSON: {e}",
            call.tool
        ))
    })?;
    let is_error = result.is_error == Some(true);
    if let Value::Object(map) = &mut value {
        map.remove("isError");
        map.remove("_meta");
        map.remove("resultType");
    }
    Ok(CallOutcome {
        result: value,
        is_error,
    })
}

/// Reads a server's tools, every page, within bounds: at most [`MAX_LIST_PAGES`] pages
/// and `max_tools` tools (more is [`Error::TooLarge`]: a tool list is pinned whole or not
/// at all). Each tool is kept as its name, description and input schema.
pub async fn list_tools(
    endpoint: &Endpoint,
    max_tools: usize,
    timeout: Duration,
) -> Result<Vec<PinnedTool>, Error> {
    let deadline = tokio::time::Instant::now() + timeout;
    let client = tokio::time::timeout_at(deadline, connect(endpoint, default_client()?))
        .await
        .map_err(|_| {
            Error::NotSent(format!(
                "{}: the session was not opened within {timeout:?}",
                endpoint.url
            ))
        })??;
    let listed = tokio::time::timeout_at(deadline, pages(&client, &endpoint.url, max_tools)).await;
    close(client);
    listed.map_err(|_| {
        Error::Lost(format!(
            "tools/list of {}: no answer within {timeout:?}",
            endpoint.url
        ))
    })?
}

async fn pages(client: &Client, url: &str, max_tools: usize) -> Result<Vec<PinnedTool>, Error> {
    let mut tools = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..MAX_LIST_PAGES {
        let params = PaginatedRequestParams::default().with_cursor(cursor.take());
        let page = client
            .peer()
            .list_tools(Some(params))
            .await
            .map_err(|e| call_error("tools/list", e))?;
        for tool in page.tools {
            if tools.len() == max_tools {
                return Err(Error::TooLarge(format!(
                    "{url} lists more than {max_tools} tools; offer a subset (tools: [...]) or split the server"
                )));
            }
            tools.push(PinnedTool {
                name: tool.name.to_string(),
                description: tool.description.map(|d| d.to_string()),
                input_schema: Value::Object(
                    tool.input_schema
                        .as_ref()
                        .clone()
                        .into_iter()
                        .collect::<Map<String, Value>>(),
                ),
            });
        }
        match page.next_cursor {
            Some(next) if !next.is_empty() => cursor = Some(next),
            _ => return Ok(tools),
        }
    }
    Err(Error::TooLarge(format!(
        "{url} lists tools over more than {MAX_LIST_PAGES} pages"
    )))
}

fn initialize_error(url: &str, error: ClientInitializeError) -> Error {
    let text = format!("opening a session with {url}: {error}");
    match &error {
        ClientInitializeError::JsonRpcError(_)
        | ClientInitializeError::NoCompatibleProtocolVersion { .. } => Error::Refused(text),
        ClientInitializeError::TransportError { error, .. } => match transport_kind(error) {
            // Nothing of a tool call was sent in any case.
            Kind::Refused => Error::Refused(text),
            Kind::TooLarge => Error::TooLarge(text),
            Kind::Busy(_) | Kind::NotSent | Kind::Lost => Error::NotSent(text),
        },
        _ => Error::NotSent(text),
    }
}

/// A failure of a request sent in an open session (`tools/call`, `tools/list`).
fn call_error(what: &str, error: ServiceError) -> Error {
    let text = format!("{what}: {error}");
    match &error {
        ServiceError::McpError(data) => {
            let text = format!(
                "{what}: the server answered error {}: {}",
                data.code.0, data.message
            );
            // The request itself is wrong (or names a tool the server lacks): it was not
            // run and never will be. Anything else the server says went wrong is its own.
            if [
                ErrorCode::PARSE_ERROR,
                ErrorCode::INVALID_REQUEST,
                ErrorCode::METHOD_NOT_FOUND,
                ErrorCode::INVALID_PARAMS,
            ]
            .contains(&data.code)
            {
                Error::Refused(text)
            } else {
                Error::Busy {
                    message: text,
                    retry_after: None,
                }
            }
        }
        ServiceError::TransportSend(dynamic) => match transport_kind(dynamic) {
            Kind::NotSent => Error::NotSent(text),
            Kind::Refused => Error::Refused(text),
            Kind::Busy(retry_after) => Error::Busy {
                message: text,
                retry_after,
            },
            Kind::TooLarge => Error::TooLarge(text),
            Kind::Lost => Error::Lost(text),
        },
        _ => Error::Lost(text),
    }
}

enum Kind {
    NotSent,
    Refused,
    Busy(Option<Duration>),
    TooLarge,
    Lost,
}

/// What a transport failure says about the request, read from the HTTP client's error
/// under it. What cannot be told apart is [`Kind::Lost`]: the request may have arrived.
fn transport_kind(error: &(dyn std::error::Error + 'static)) -> Kind {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(error) = source {
        if let Some(http) = error.downcast_ref::<StreamableHttpError<reqwest13::Error>>() {
            return match http {
                StreamableHttpError::HttpStatus(status) => {
                    if status.status == 429 || status.status >= 500 {
                        Kind::Busy(
                            status
                                .retry_after
                                .as_deref()
                                .and_then(|s| s.trim().parse::<u64>().ok())
                                .map(Duration::from_secs),
                        )
                    } else {
                        Kind::Refused
                    }
                }
                // The server no longer knows the session: it did not take the request.
                StreamableHttpError::SessionExpired => Kind::Busy(None),
                StreamableHttpError::AuthRequired(_)
                | StreamableHttpError::InsufficientScope(_)
                | StreamableHttpError::ReservedHeaderConflict(_) => Kind::Refused,
                // A 4xx without a JSON-RPC body (the SDK words it `HTTP <status>: ...`).
                StreamableHttpError::UnexpectedServerResponse(text)
                    if text.starts_with("HTTP 4") =>
                {
                    Kind::Refused
                }
                StreamableHttpError::ResponseBodyTooLarge { .. } => Kind::TooLarge,
                StreamableHttpError::Client(e) if e.is_connect() => Kind::NotSent,
                StreamableHttpError::Client(e) if e.is_builder() => Kind::Refused,
                _ => Kind::Lost,
            };
        }
        if let Some(e) = error.downcast_ref::<reqwest13::Error>() {
            if e.is_connect() {
                return Kind::NotSent;
            }
        }
        source = error.source();
    }
    Kind::Lost
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::{Arc, Mutex};

    use axum::extract::State;
    use axum::http::StatusCode;
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;
    use axum::{Json, Router};
    use serde_json::json;

    use super::*;

    /// What the test server does with a `tools/call`.
    #[derive(Clone, Copy)]
    enum Then {
        Answer,
        ToolError,
        Status(u16),
        RpcError(i64),
        Hang,
        Huge,
    }

    #[derive(Clone)]
    struct Server {
        then: Then,
        calls: Arc<Mutex<Vec<Value>>>,
    }

    async fn rpc(State(server): State<Server>, Json(message): Json<Value>) -> Response {
        let Some(id) = message.get("id").cloned() else {
            return StatusCode::ACCEPTED.into_response();
        };
        let result = match message["method"].as_str().unwrap_or_default() {
            "initialize" => json!({
                "protocolVersion": message["params"]["protocolVersion"],
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "test", "version": "1"}
            }),
            "tools/list" => {
                let cursor = message["params"]["cursor"].as_str().unwrap_or("");
                let tool = |name: &str| json!({"name": name, "description": format!("does {name}"), "inputSchema": {"type": "object"}});
                match cursor {
                    "" => json!({"tools": [tool("a"), tool("b")], "nextCursor": "2"}),
                    _ => json!({"tools": [tool("c")]}),
                }
            }
            "tools/call" => {
                server.calls.lock().unwrap().push(message["params"].clone());
                match server.then {
                    Then::Answer => json!({"content": [{"type": "text", "text": "ok"}], "structuredContent": {"n": 1}}),
                    Then::ToolError => json!({"content": [{"type": "text", "text": "no such order"}], "isError": true}),
                    Then::Status(code) => {
                        return (StatusCode::from_u16(code).unwrap(), "nope").into_response()
                    }
                    Then::RpcError(code) => {
                        return Json(json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": "bad"}})).into_response()
                    }
                    Then::Hang => {
                        tokio::time::sleep(Duration::from_secs(30)).await;
                        json!({})
                    }
                    Then::Huge => {
                        json!({"content": [{"type": "text", "text": "x".repeat(MAX_RESPONSE_BYTES + 1)}]})
                    }
                }
            }
            _ => json!({}),
        };
        Json(json!({"jsonrpc": "2.0", "id": id, "result": result})).into_response()
    }

    async fn serve(then: Then) -> (Endpoint, Arc<Mutex<Vec<Value>>>) {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let app = Router::new().route("/mcp", post(rpc)).with_state(Server {
            then,
            calls: calls.clone(),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        let endpoint = Endpoint {
            url: format!("http://{addr}/mcp"),
            headers: vec![("Authorization".into(), "Bearer s3cret".into())],
        };
        (endpoint, calls)
    }

    fn call() -> ToolCall {
        ToolCall {
            tool: "refund".into(),
            arguments: serde_json::from_value(json!({"amount": 3})).unwrap(),
            operation_id: "op-7".into(),
            run_id: "run-1".into(),
            attempt: 2,
        }
    }

    #[tokio::test]
    async fn a_call_carries_the_operation_id_in_meta_and_returns_the_result() {
        let (endpoint, calls) = serve(Then::Answer).await;
        let outcome = call_tool(&endpoint, &call(), Duration::from_secs(10))
            .await
            .unwrap();
        assert!(!outcome.is_error);
        assert_eq!(outcome.result["content"][0]["text"], "ok");
        assert_eq!(outcome.result["structuredContent"]["n"], 1);
        assert!(outcome.result.get("isError").is_none());
        let calls = calls.lock().unwrap();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["name"], "refund");
        assert_eq!(calls[0]["arguments"]["amount"], 3);
        assert_eq!(calls[0]["_meta"][OPERATION_ID_META], "op-7");
        assert_eq!(calls[0]["_meta"][RUN_ID_META], "run-1");
        assert_eq!(calls[0]["_meta"][ATTEMPT_META], 2);
        assert!(
            !format!("{endpoint:?}").contains("s3cret"),
            "secrets are not printed"
        );
    }

    #[tokio::test]
    async fn failures_are_told_apart_by_what_the_server_can_have_done() {
        let (endpoint, _) = serve(Then::ToolError).await;
        let outcome = call_tool(&endpoint, &call(), Duration::from_secs(10))
            .await
            .unwrap();
        assert!(outcome.is_error);
        assert_eq!(outcome.text(), "no such order");

        for (then, expected) in [
            (Then::Status(500), "busy"),
            (Then::Status(429), "busy"),
            (Then::Status(400), "refused"),
            (Then::RpcError(-32602), "refused"),
            (Then::RpcError(-32603), "busy"),
        ] {
            let (endpoint, calls) = serve(then).await;
            let error = call_tool(&endpoint, &call(), Duration::from_secs(10))
                .await
                .unwrap_err();
            let kind = match error {
                Error::Busy { .. } => "busy",
                Error::Refused(_) => "refused",
                Error::NotSent(_) => "not sent",
                Error::Lost(_) => "lost",
                Error::TooLarge(_) => "too large",
            };
            assert_eq!(kind, expected, "{error}");
            assert_eq!(calls.lock().unwrap().len(), 1);
        }

        // An answer past the bound is refused unread (held to MAX_RESPONSE_BYTES).
        let (endpoint, _) = serve(Then::Huge).await;
        let error = call_tool(&endpoint, &call(), Duration::from_secs(10))
            .await
            .unwrap_err();
        assert!(matches!(error, Error::TooLarge(_)), "{error}");

        let (endpoint, calls) = serve(Then::Hang).await;
        let error = call_tool(&endpoint, &call(), Duration::from_millis(800))
            .await
            .unwrap_err();
        assert!(matches!(error, Error::Lost(_)), "{error}");
        assert_eq!(calls.lock().unwrap().len(), 1, "sent once, never again");

        // Nobody listens: nothing was sent.
        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/mcp", closed.local_addr().unwrap());
        drop(closed);
        let error = call_tool(
            &Endpoint {
                url,
                headers: vec![],
            },
            &call(),
            Duration::from_secs(5),
        )
        .await
        .unwrap_err();
        assert!(matches!(error, Error::NotSent(_)), "{error}");
    }

    #[tokio::test]
    async fn a_listing_follows_pages_within_its_bounds() {
        let (endpoint, _) = serve(Then::Answer).await;
        let tools = list_tools(&endpoint, 10, Duration::from_secs(10))
            .await
            .unwrap();
        let names: Vec<_> = tools.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert_eq!(tools[0].description.as_deref(), Some("does a"));
        assert_eq!(tools[0].input_schema, json!({"type": "object"}));
        let error = list_tools(&endpoint, 2, Duration::from_secs(10))
            .await
            .unwrap_err();
        assert!(matches!(error, Error::TooLarge(_)), "{error}");
    }
}
