//! Request extractors whose every rejection is a JSON [`ApiError`]: the caller (bearer
//! token → tenant, principal, roles, groups), a size-capped JSON body read within the
//! body's deadline, path and query parameters; and [`guard_body`], which decides what
//! happens to whatever of a request's body its handler left unread.

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use axum::body::{Body, BodyDataStream, Bytes};
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use futures::{Stream, StreamExt};
use serde::de::DeserializeOwned;
use tokio::time::Instant;

use crate::app::AppState;
use crate::error::ApiError;

/// Who is calling, from the bearer token (a static token or a JWT, see [`crate::auth`]).
#[derive(Debug, Clone)]
pub struct Caller {
    pub tenant: String,
    pub principal: String,
    pub roles: Vec<String>,
    /// Approver groups (the token's `groups`).
    pub groups: Vec<String>,
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        authenticate(&parts.headers, state).await
    }
}

/// The caller a request's `Authorization` header names, or the 401 that refuses it.
async fn authenticate(headers: &HeaderMap, state: &AppState) -> Result<Caller, ApiError> {
    let unauthorized =
        |code: &str, message: &str| ApiError::new(StatusCode::UNAUTHORIZED, code, message);
    let value = headers.get(header::AUTHORIZATION).ok_or_else(|| {
        unauthorized(
            "unauthenticated",
            "an Authorization: Bearer token is required",
        )
    })?;
    let token = value
        .to_str()
        .ok()
        .and_then(|v| {
            let (scheme, token) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        })
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            unauthorized(
                "unauthenticated",
                "the Authorization header must be `Bearer <token>`",
            )
        })?;
    let who = state
        .inner
        .auth
        .authenticate(token)
        .await
        .map_err(|refused| unauthorized("invalid_token", &refused.0))?;
    Ok(Caller {
        tenant: who.tenant,
        principal: who.principal,
        roles: who.roles,
        groups: who.groups,
    })
}

/// When a request's body must have arrived whole: its headers' arrival plus
/// `body_read_timeout` (set by [`guard_body`] on every request that has a body).
#[derive(Debug, Clone, Copy)]
struct BodyDeadline(Instant);

fn body_timeout(state: &AppState) -> ApiError {
    ApiError::new(
        StatusCode::REQUEST_TIMEOUT,
        "body_timeout",
        format!(
            "the request body did not arrive within {} ms of its headers",
            state.config().body_read_timeout.as_millis()
        ),
    )
    .closing()
}

/// A JSON body of at most `max_body_bytes`, read whole by the request's [`BodyDeadline`]
/// (408 `body_timeout` after it). An empty body reads as `null`, so optional bodies can be
/// `Option<T>`.
#[derive(Debug)]
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let cap = state.config().max_body_bytes;
        let too_large = || {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                format!("the request body is larger than {cap} bytes"),
            )
        };
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok());
        if declared.is_some_and(|n| n > cap && n > DRAIN_LIMIT) {
            // Not worth reading: answered at once, and the connection closes.
            return Err(too_large().closing());
        }
        let deadline = req.extensions().get::<BodyDeadline>().map_or_else(
            || Instant::now() + state.config().body_read_timeout,
            |d| d.0,
        );
        let bytes = tokio::time::timeout_at(deadline, read_capped(req.into_body(), cap))
            .await
            .map_err(|_| body_timeout(state))?
            .map_err(|complete| {
                if complete {
                    too_large()
                } else {
                    too_large().closing()
                }
            })?;
        let text: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
            b"null"
        } else {
            &bytes
        };
        serde_json::from_slice(text).map(JsonBody).map_err(|e| {
            use serde_json::error::Category;
            if let Some(too_deep) = crate::limits::too_deep_to_parse(&e) {
                return too_deep;
            }
            match e.classify() {
                Category::Syntax | Category::Eof | Category::Io => {
                    ApiError::bad_request("bad_json", format!("the body is not valid JSON: {e}"))
                }
                Category::Data => {
                    ApiError::bad_request("invalid_request", format!("the body does not fit: {e}"))
                }
            }
        })
    }
}

/// How much of an oversized body is read (and thrown away) before it is refused. A
/// server that answers while the client is still sending and then closes makes the
/// client's kernel see a reset, which can discard the answer before the client reads it
/// (hyper reports `IncompleteMessage`): reading the rest first delivers the JSON error.
const DRAIN_LIMIT: usize = 8 * 1024 * 1024;

/// The body if it holds at most `cap` bytes (which may exceed [`DRAIN_LIMIT`]: a
/// gateway with a blob store takes large inputs). A larger one is read on to its end and
/// thrown away, up to [`DRAIN_LIMIT`]: `Err(true)` when it was read whole, `Err(false)`
/// when it was cut off (or failed) and the connection should close.
async fn read_capped(body: axum::body::Body, cap: usize) -> Result<Vec<u8>, bool> {
    use futures::StreamExt;
    let mut stream = body.into_data_stream();
    let mut kept = Vec::new();
    let mut seen = 0usize;
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else {
            return Err(false);
        };
        seen += chunk.len();
        if seen > cap && seen > DRAIN_LIMIT {
            return Err(false);
        }
        if seen <= cap {
            kept.extend_from_slice(&chunk);
        }
    }
    if seen > cap {
        Err(true)
    } else {
        Ok(kept)
    }
}

/// The middleware around every route: it sets the request's [`BodyDeadline`], and decides
/// what becomes of whatever of the body its handler left unread (it refused the request
/// before its body: no token, a bad path, a route that takes none).
///
/// - **Not authenticated** (no token, or one that does not hold): the body is never read.
///   The answer says `Connection: close` and hyper closes the connection after it, so a
///   client without a token can make the gateway read nothing but its headers.
/// - **Authenticated**: the rest is read and thrown away before the answer goes out, by
///   the body's deadline and up to [`DRAIN_LIMIT`]. hyper would otherwise close the
///   connection after the answer without saying so, and the client's next request on it
///   is lost (`connection closed before message completed`), or the close resets a client
///   still sending and its answer with it. Past the deadline or the limit, or when the
///   answer already closes, the answer says `Connection: close`.
pub(crate) async fn guard_body(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    let headers = request.headers();
    let has_body = headers.contains_key(header::TRANSFER_ENCODING)
        || headers
            .get(header::CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() != b"0");
    if !has_body {
        return next.run(request).await;
    }
    let deadline = Instant::now() + state.config().body_read_timeout;
    request.extensions_mut().insert(BodyDeadline(deadline));
    let authorization: HeaderMap = request
        .headers()
        .get_all(header::AUTHORIZATION)
        .iter()
        .map(|v| (header::AUTHORIZATION, v.clone()))
        .collect();
    let (parts, body) = request.into_parts();
    let slot = Arc::new(Mutex::new(Some(body.into_data_stream())));
    let request = Request::from_parts(parts, Body::from_stream(Unread(slot.clone())));
    let mut response = next.run(request).await;
    let closing = response
        .headers()
        .get(header::CONNECTION)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
    let rest = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
    let Some(mut rest) = rest.filter(|_| !closing) else {
        return response;
    };
    let authenticated = response.status() != StatusCode::UNAUTHORIZED
        && authenticate(&authorization, &state).await.is_ok();
    let whole = authenticated
        && tokio::time::timeout_at(deadline, async {
            let mut seen = 0usize;
            while let Some(chunk) = rest.next().await {
                seen += chunk.as_ref().map_or(0, Bytes::len);
                if chunk.is_err() || seen > DRAIN_LIMIT {
                    return false;
                }
            }
            true
        })
        .await
        .unwrap_or(false);
    if !whole {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// The request body as its handler reads it, leaving what it does not read in the slot.
struct Unread(Arc<Mutex<Option<BodyDataStream>>>);

impl Stream for Unread {
    type Item = Result<Bytes, axum::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let mut slot = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match slot.as_mut() {
            Some(body) => body.poll_next_unpin(cx),
            None => Poll::Ready(None),
        }
    }
}

/// Path parameters.
#[derive(Debug)]
pub struct Params<T>(pub T);

impl<T: DeserializeOwned + Send> FromRequestParts<AppState> for Params<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(v)| Params(v))
            .map_err(|e| ApiError::bad_request("invalid_path", e.body_text()))
    }
}

/// Query parameters.
#[derive(Debug)]
pub struct QueryParams<T>(pub T);

impl<T: DeserializeOwned> FromRequestParts<AppState> for QueryParams<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(v)| QueryParams(v))
            .map_err(|e| ApiError::bad_request("invalid_query", e.body_text()))
    }
}
