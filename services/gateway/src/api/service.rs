//! The routes about the gateway itself rather than a run: liveness, readiness, the
//! caller the bearer token speaks for, and the OpenAPI document.

use axum::response::{IntoResponse, Response};

use super::*;
use crate::openapi;

pub(super) async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

pub(super) async fn readyz(State(app): State<AppState>) -> Response {
    let progress = app.view().progress().borrow().clone();
    if progress.failed {
        ApiError::unavailable(
            "view_failed",
            "the view's store failed; restart the gateway",
        )
        .into_response()
    } else if progress.ready {
        // Quarantined runs do not make the gateway unready: every other run is served.
        Json(json!({"status": "ready", "quarantined_runs": app.view().quarantined()}))
            .into_response()
    } else {
        ApiError::unavailable(
            "not_ready",
            "the view has not caught up with run-state and run-events yet",
        )
        .into_response()
    }
}

/// Who the bearer token speaks for (the console shows it, and checks a token at sign-in).
pub(super) async fn me(caller: Caller) -> Json<Value> {
    Json(json!({
        "tenant": caller.tenant,
        "principal": caller.principal,
        "roles": caller.roles,
        "groups": caller.groups,
    }))
}

pub(super) async fn openapi_json() -> Json<Value> {
    Json(openapi::document())
}
