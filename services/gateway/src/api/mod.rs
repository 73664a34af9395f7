//! The HTTP API (SPEC §4.3). Writes become `RunCommand`s answered by the reducer; reads
//! come from the local view and can wait for a position (read-your-writes). This module
//! holds the router and the helpers every route shares; each concern is a module below.

mod blobs;
mod decisions;
mod events;
mod fork;
mod history;
mod operator;
mod reads;
mod routes;
mod service;
mod signals;
mod starts;

pub(crate) use history::history;
pub use routes::ROUTES;

use std::collections::BTreeMap;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use sortie_wire::records as w;
use ulid::Ulid;

use crate::app::{now_ms, AppState};
use crate::error::ApiError;
use crate::extract::{Caller, JsonBody, Params};
use crate::limits;
use crate::store::StoredRun;
use crate::view::{self, Answer};

/// Header a read may carry instead of `?min_position=`.
pub const MIN_POSITION_HEADER: &str = "sortie-min-position";
/// Client-chosen command id: retries with the same key are deduplicated by the reducer.
pub const IDEMPOTENCY_HEADER: &str = "idempotency-key";

/// How long a write's answer waits for the rest of its state version to reach the view.
const SETTLE: Duration = Duration::from_secs(2);
const DEFAULT_PAGE: usize = 100;
const MAX_PAGE: usize = 1000;

/// Every route of the API (the list in `routes.rs`, which the OpenAPI document is checked
/// against). Unknown paths and methods answer JSON errors too.
pub fn router(state: AppState) -> Router {
    routes::api(Router::new())
        .merge(crate::ui::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            crate::extract::guard_body,
        ))
        .layer(axum::middleware::from_fn(crate::ui::secure))
        .layer(axum::middleware::from_fn(crate::metrics::observe))
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this route does not take that method",
    )
}

// ---------------------------------------------------------------- ids and helpers

fn valid_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':' | b'@'))
}

fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get(IDEMPOTENCY_HEADER) else {
        return Ok(None);
    };
    value
        .to_str()
        .ok()
        .map(str::trim)
        .filter(|k| (1..=200).contains(&k.len()) && k.bytes().all(|b| b.is_ascii_graphic()))
        .map(|k| Some(k.to_owned()))
        .ok_or_else(|| {
            ApiError::bad_request(
                "invalid_idempotency_key",
                "Idempotency-Key must be 1 to 200 visible ASCII characters",
            )
        })
}

fn command(
    caller: &Caller,
    run_id: &str,
    key: Option<String>,
    body: w::CommandBody,
) -> w::RunCommand {
    w::RunCommand {
        command_id: key.unwrap_or_else(|| format!("cmd_{}", Ulid::generate())),
        tenant: caller.tenant.clone(),
        run_id: run_id.to_owned(),
        issuer: w::Issuer {
            principal: caller.principal.clone(),
            roles: caller.roles.clone(),
            groups: caller.groups.clone(),
        },
        issued_at: now_ms(),
        body,
    }
}

/// The run if the view has it; 404 for a run of another tenant, exactly as for a missing one.
/// A run the view set aside, or whose state does not read, is 500 `run_unreadable` to its
/// own tenant (404 to any other).
fn known_run(app: &AppState, caller: &Caller, run_id: &str) -> Result<Option<StoredRun>, ApiError> {
    let store = &app.view().store;
    let quarantine = store
        .quarantined(run_id)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    if let Some(quarantine) = quarantine {
        return Err(match quarantine.tenant == caller.tenant {
            true => ApiError::run_unreadable(run_id, &quarantine.reason),
            false => ApiError::unknown_run(run_id),
        });
    }
    match store.run(run_id) {
        Ok(Some(run)) if run.state.tenant != caller.tenant => Err(ApiError::unknown_run(run_id)),
        Ok(run) => Ok(run),
        // Not yet set aside (the view has not come back to it since it went bad).
        Err(error) if error.run_scoped() => match store.listed(&caller.tenant, run_id) {
            Ok(true) => Err(ApiError::run_unreadable(run_id, &error.to_string())),
            Ok(false) => Err(ApiError::unknown_run(run_id)),
            Err(error) => Err(ApiError::internal(error.to_string())),
        },
        Err(error) => Err(ApiError::internal(error.to_string())),
    }
}

/// A store read about `run_id` (already known to be the caller's) that failed.
pub(crate) fn read_failed(run_id: &str) -> impl Fn(crate::store::Error) -> ApiError + '_ {
    move |error| match error.run_scoped() {
        true => ApiError::run_unreadable(run_id, &error.to_string()),
        false => ApiError::internal(error.to_string()),
    }
}

pub(crate) fn visible_run(
    app: &AppState,
    caller: &Caller,
    run_id: &str,
) -> Result<StoredRun, ApiError> {
    known_run(app, caller, run_id)?.ok_or_else(|| ApiError::unknown_run(run_id))
}

/// A refused command's error, or the run once the view holds the accepted command's effect.
async fn accepted(
    app: &AppState,
    command: &w::RunCommand,
    answer: &Answer,
) -> Result<Option<StoredRun>, ApiError> {
    if !answer.accepted {
        return Err(ApiError::from_reject(&answer.code, &answer.reason)
            .with("command_id", command.command_id.as_str())
            .with("position", answer.position.to_string()));
    }
    Ok(app
        .settled(answer, SETTLE.min(app.config().answer_timeout))
        .await)
}

fn written(command: &w::RunCommand, answer: &Answer, status: &str) -> Value {
    json!({
        "run_id": command.run_id,
        "status": status,
        "command_id": command.command_id,
        "position": answer.position.to_string(),
        "duplicate": answer.duplicate,
    })
}

/// The query of a read that takes only `?min_position=`.
#[derive(Debug, Default, Deserialize)]
struct ReadQuery {
    #[serde(default)]
    min_position: Option<String>,
}

/// Waits until the view has applied `?min_position=` / the `Sortie-Min-Position` header.
pub(crate) async fn read_after(
    app: &AppState,
    headers: &HeaderMap,
    query: Option<&str>,
) -> Result<(), ApiError> {
    let header = headers
        .get(MIN_POSITION_HEADER)
        .and_then(|v| v.to_str().ok());
    let Some(text) = query.or(header) else {
        return Ok(());
    };
    let positions =
        view::parse_positions(text).map_err(|e| ApiError::bad_request("invalid_position", e))?;
    let timeout = app.config().read_wait_timeout;
    if app.view().reach(&positions, timeout).await {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "view_behind",
            format!(
                "the view did not reach {text} within {} ms",
                timeout.as_millis()
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_checked() {
        assert!(valid_id("run_01J8ZQ"));
        assert!(valid_id("orders:42@acme"));
        assert!(!valid_id(""));
        assert!(!valid_id("a b"));
        assert!(!valid_id(&"x".repeat(129)));
    }
}
