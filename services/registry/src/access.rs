//! Who may change the registry. Reads (GET, and the POSTs that only look up a schema or
//! check compatibility) stay open: serializers and deserializers everywhere need them.
//! Writes (register, delete, set a compatibility level) need the write token when one is
//! configured; without one they are open only on a loopback listener (the dev stack and
//! the tests), and refused on any other, so a registry reachable from the network is
//! never writable by anyone who can reach it.
//!
//! The token is accepted as `Authorization: Bearer <token>` or as the password of Basic
//! auth (any user name), which is what Confluent clients send with `bearer.auth.token` or
//! `basic.auth.user.info`.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;

use crate::http::ApiError;

/// The write policy of one listener.
#[derive(Clone, PartialEq, Eq)]
pub enum Writes {
    /// Anyone may write (a loopback listener without a token).
    Open,
    /// Writes carry this token.
    Token(String),
    /// No write is accepted (a listener beyond loopback without a token).
    Closed,
}

impl std::fmt::Debug for Writes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Writes::Open => "Open",
            Writes::Token(_) => "Token(..)",
            Writes::Closed => "Closed",
        })
    }
}

impl Writes {
    /// The policy for a listener on `addr` with the configured `token` (an empty token is
    /// none).
    pub fn for_listener(addr: SocketAddr, token: Option<String>) -> Writes {
        match token.filter(|t| !t.is_empty()) {
            Some(token) => Writes::Token(token),
            None if addr.ip().is_loopback() => Writes::Open,
            None => Writes::Closed,
        }
    }
}

/// Whether a request may change the registry's state.
fn is_write(method: &Method, path: &str) -> bool {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    match *method {
        Method::GET | Method::HEAD | Method::OPTIONS => false,
        // `POST /subjects/{subject}` looks a schema up; `POST /compatibility/...` checks one.
        Method::POST => {
            !(segments.len() == 2 && segments[0] == "subjects")
                && segments.first() != Some(&"compatibility")
        }
        _ => true,
    }
}

/// The token the request presents, if any.
fn presented(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, credentials) = value.split_once(' ')?;
    if scheme.eq_ignore_ascii_case("bearer") {
        return Some(credentials.trim().to_owned());
    }
    if scheme.eq_ignore_ascii_case("basic") {
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(credentials.trim())
            .ok()?;
        let decoded = String::from_utf8(decoded).ok()?;
        return decoded
            .split_once(':')
            .map(|(_, password)| password.to_owned());
    }
    None
}

/// Compares without stopping at the first differing byte.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |diff, (x, y)| diff | (x ^ y))
            == 0
}

/// The middleware that applies `writes` to every request.
pub(crate) async fn guard(
    State(writes): State<Arc<Writes>>,
    request: Request,
    next: Next,
) -> Response {
    if !is_write(request.method(), request.uri().path()) {
        return next.run(request).await;
    }
    match &*writes {
        Writes::Open => next.run(request).await,
        Writes::Token(token) if presented(request.headers()).is_some_and(|p| same(&p, token)) => {
            next.run(request).await
        }
        Writes::Token(_) => ApiError::unauthorized().into_response(),
        Writes::Closed => ApiError::writes_closed().into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_and_compatibility_checks_are_reads() {
        assert!(!is_write(&Method::POST, "/subjects/orders-value"));
        assert!(!is_write(
            &Method::POST,
            "/compatibility/subjects/orders-value/versions/latest"
        ));
        assert!(!is_write(&Method::GET, "/subjects/orders-value/versions"));
        assert!(is_write(&Method::POST, "/subjects/orders-value/versions"));
        assert!(is_write(&Method::DELETE, "/subjects/orders-value"));
        assert!(is_write(&Method::PUT, "/config"));
    }

    #[test]
    fn the_listener_decides_without_a_token() {
        let local: SocketAddr = "127.0.0.1:8081".parse().expect("addr");
        let any: SocketAddr = "0.0.0.0:8081".parse().expect("addr");
        assert_eq!(Writes::for_listener(local, None), Writes::Open);
        assert_eq!(Writes::for_listener(any, None), Writes::Closed);
        assert_eq!(
            Writes::for_listener(any, Some(String::new())),
            Writes::Closed
        );
        assert_eq!(
            Writes::for_listener(any, Some("t".into())),
            Writes::Token("t".into())
        );
    }
}
