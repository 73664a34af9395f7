//! Every error the API returns: a status and `{"error": {"code", "message"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: String,
    pub message: String,
    /// Extra fields next to code and message (e.g. the `command_id` of a write that timed out).
    pub details: Option<Value>,
    /// Answer with `Connection: close` (the request's body was left unread).
    pub close: bool,
    /// Answer with `Retry-After: <seconds>`.
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status,
            code: code.into(),
            message: message.into(),
            details: None,
            close: false,
            retry_after: None,
        }
    }

    /// The same answer, telling the client when to try again (whole seconds, at least 1).
    pub fn retry_after(mut self, wait: std::time::Duration) -> Self {
        let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        self.retry_after = Some(seconds.max(1));
        self
    }

    /// The same answer, telling the client the connection closes after it.
    pub fn closing(mut self) -> Self {
        self.close = true;
        self
    }

    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        let details = self.details.get_or_insert_with(|| json!({}));
        if let Value::Object(map) = details {
            map.insert(key.to_owned(), value.into());
        }
        self
    }

    pub fn bad_request(code: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    /// The same answer for a missing run and another tenant's run: a tenant never learns
    /// of another's runs.
    pub fn unknown_run(run_id: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "unknown_run",
            format!("run {run_id} does not exist"),
        )
    }

    /// A run that was forgotten (its retention passed, or it was deleted): its payloads
    /// are gone.
    pub fn run_forgotten(run_id: &str) -> Self {
        Self::new(
            StatusCode::GONE,
            "run_forgotten",
            format!("run {run_id} was forgotten: its payloads are gone"),
        )
    }

    /// A run this gateway's view could not read, fold or store, and so set aside
    /// (quarantined): the reducer still holds it, but this view cannot show it. A server
    /// fault, not a client's: 500, never a retry that would help.
    pub fn run_unreadable(run_id: &str, reason: &str) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "run_unreadable",
            format!("run {run_id} cannot be read from this gateway's view: {reason}"),
        )
        .with("run_id", run_id)
    }

    pub fn unavailable(code: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, code, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }

    /// The HTTP answer to a reducer's `CommandRejected` code.
    pub fn from_reject(code: &str, reason: &str) -> Self {
        let status = match code {
            "unknown_run" => StatusCode::NOT_FOUND,
            "unknown_graph" | "invalid_payload" | "bad_run_id" => StatusCode::UNPROCESSABLE_ENTITY,
            "forbidden" | "not_in_group" => StatusCode::FORBIDDEN,
            // The bearer was fine; the reducers do not accept this gateway's signature
            // (no --signing-key, or a key missing from their keyring): a deployment fault.
            "unauthenticated" => StatusCode::BAD_GATEWAY,
            "conflict" | "run_id_unavailable" | "bad_state" | "stale_proposal"
            | "already_decided" | "expired" | "duplicate_approver" | "unknown_interrupt"
            | "unknown_operation" | "unknown_signal" | "not_waiting" | "too_many_signals" => {
                StatusCode::CONFLICT
            }
            // A code this build does not know: the command was refused, so a conflict.
            _ => StatusCode::CONFLICT,
        };
        Self::new(status, code, reason)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut error = json!({"code": self.code, "message": self.message});
        if let (Value::Object(map), Some(Value::Object(extra))) = (&mut error, self.details) {
            map.extend(extra);
        }
        let mut response = (self.status, Json(json!({ "error": error }))).into_response();
        if let Some(seconds) = self.retry_after {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(seconds),
            );
        }
        if self.close {
            response.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        response
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.code,
            self.message
        )
    }
}

impl std::error::Error for ApiError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reducer_codes_map_to_statuses() {
        for (code, status) in [
            ("unknown_run", 404),
            ("unknown_graph", 422),
            ("forbidden", 403),
            ("conflict", 409),
            ("run_id_unavailable", 409),
            ("bad_state", 409),
            ("stale_proposal", 409),
            ("already_decided", 409),
            ("expired", 409),
            ("duplicate_approver", 409),
            ("unknown_interrupt", 409),
            ("unknown_operation", 409),
        ] {
            assert_eq!(
                ApiError::from_reject(code, "r").status.as_u16(),
                status,
                "{code}"
            );
        }
    }
}
