//! The HTTP API (SPEC §4.3). Writes become `RunCommand`s answered by the reducer; reads
//! come from the local view and can wait for a position (read-your-writes).

mod routes;
mod signals;

pub use routes::ROUTES;

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{self, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use sortie_core::{Event, RunStatus};
use sortie_wire::records as w;
use ulid::Ulid;

use crate::app::{now_ms, AppState};
use crate::error::ApiError;
use crate::extract::{Caller, JsonBody, Params, QueryParams};
use crate::store::StoredRun;
use crate::view::{self, Answer, Progress};
use crate::{limits, openapi, render};

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

async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn readyz(State(app): State<AppState>) -> Response {
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
async fn me(caller: Caller) -> Json<Value> {
    Json(json!({
        "tenant": caller.tenant,
        "principal": caller.principal,
        "roles": caller.roles,
        "groups": caller.groups,
    }))
}

async fn openapi_json() -> Json<Value> {
    Json(openapi::document())
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

// ---------------------------------------------------------------- writes

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StartRequest {
    graph_id: String,
    #[serde(default)]
    graph_version: Option<u32>,
    #[serde(default)]
    input: Option<Value>,
    #[serde(default)]
    checkpoint_ns: Option<String>,
    #[serde(default)]
    run_id: Option<String>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    /// The run's own spend limits, over its tenant's default.
    #[serde(default)]
    budget: Option<sortie_core::budget::Limits>,
}

async fn start_run(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    JsonBody(body): JsonBody<StartRequest>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    if body
        .checkpoint_ns
        .as_ref()
        .is_some_and(|ns| *ns != caller.tenant)
    {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "tenant_mismatch",
            "checkpoint_ns must be the tenant of the bearer token",
        ));
    }
    if body.graph_id.trim().is_empty() {
        return Err(ApiError::bad_request(
            "invalid_request",
            "graph_id is empty",
        ));
    }
    limits::labels(&body.labels)?;
    // Before the graph is looked up: a refusal that costs nothing comes first.
    if let Some(input) = &body.input {
        app.check_payload("input", input)?;
    }
    let key = idempotency_key(&headers)?;
    let chosen = body.run_id.is_some();
    let mut run_id = match (body.run_id, &key) {
        (Some(id), _) if valid_id(&id) => id,
        (Some(_), _) => {
            return Err(ApiError::bad_request(
                "invalid_run_id",
                "run_id must be 1 to 128 characters of A-Z a-z 0-9 _ - . : @",
            ))
        }
        // A retried start without a run id must name the same run, or the reducer (which
        // deduplicates per run) would start a second one. The id is derived from the key in
        // a form the reducer checks (`key_`), so nobody takes it first by guessing the key;
        // a retry of a start made before that form keeps its older id.
        (None, Some(key)) => {
            let digest = sortie_core::json::sha256_hex(&[&caller.tenant, key]);
            let older = format!("run_{}", &digest[..26]);
            match known_run(&app, &caller, &older) {
                Ok(Some(_)) => older,
                _ => sortie_core::ids::keyed_run_id(&caller.tenant, key),
            }
        }
        (None, None) => format!("run_{}", Ulid::generate()),
    };
    let graphs = &app.inner.graphs;
    if graphs.knows(&caller.tenant, &body.graph_id, body.graph_version) == Some(false) {
        graphs.refresh(Duration::from_secs(3)).await;
        if graphs.knows(&caller.tenant, &body.graph_id, body.graph_version) == Some(false) {
            let version = body
                .graph_version
                .map(|v| format!("@{v}"))
                .unwrap_or_default();
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "unknown_graph",
                format!("graph {}{version} is not published", body.graph_id),
            ));
        }
    }
    // The graph's own rule, before publishing (the fold checks it again).
    let mut access = graphs.access(&caller.tenant, &body.graph_id, body.graph_version);
    if access.is_none() {
        // The table has not loaded this graph yet (a gateway just started).
        graphs.refresh(Duration::from_secs(3)).await;
        access = graphs.access(&caller.tenant, &body.graph_id, body.graph_version);
    }
    if let Some(reason) = access.and_then(|a| a.start_refusal(&body.graph_id, &caller.roles)) {
        return Err(ApiError::new(StatusCode::FORBIDDEN, "forbidden", reason));
    }
    // A graph with a correlation label names its runs by it (a retry names the same run).
    if let (false, Some(Some(label))) = (
        chosen,
        graphs.correlation(&caller.tenant, &body.graph_id, body.graph_version),
    ) {
        run_id = signals::correlated(&caller.tenant, &body.graph_id, &label, &body.labels)?;
    }
    // Before anything is stored or published: a start past the tenant's rate costs nothing.
    app.admit_start(&caller.tenant)?;
    let input = body.input.unwrap_or_else(|| json!({}));
    let input = app.payload(&caller.tenant, &run_id, "input", input).await?;
    let input = app.seal(&caller.tenant, &run_id, input, true).await?;
    let budget = app
        .inner
        .config
        .budgets
        .for_run(&caller.tenant, body.budget.as_ref())
        .map_err(|reason| ApiError::bad_request("bad_budget", reason))?;
    let command = command(
        &caller,
        &run_id,
        key,
        w::CommandBody::StartRun(w::StartRun {
            graph_id: body.graph_id,
            graph_version: body.graph_version.map(|v| v as i32),
            input: sortie_core::json::canonical(&input),
            labels: body.labels,
            budget: budget.as_ref().map(sortie_model::budget_text),
            fork: None,
            parent: None,
        }),
    );
    let answer = app.submit(&command).await?;
    let run = accepted(&app, &command, &answer).await?;
    let status = run.map_or(RunStatus::Running, |r| r.state.status);
    Ok((
        StatusCode::CREATED,
        Json(written(&command, &answer, status.as_str())),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
enum DecisionIn {
    Approve,
    Reject,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResumeRequest {
    decision: DecisionIn,
    /// May be omitted when exactly one interrupt of the run is open.
    #[serde(default)]
    interrupt_id: Option<String>,
    /// The proposal the client approves; defaults to the one the view shows.
    #[serde(default)]
    proposal_hash: Option<String>,
    /// The human's input, delivered to the node (`$interrupt.payload`).
    #[serde(default)]
    payload: Option<Value>,
    /// Arguments to run instead of the proposal's.
    #[serde(default)]
    edited_args: Option<Value>,
    #[serde(default)]
    comment: Option<String>,
}

/// The open interrupt a decision without `interrupt_id` is for: the only one open.
fn only_open_interrupt(run: Option<&StoredRun>, run_id: &str) -> Result<String, ApiError> {
    let Some(run) = run else {
        return Err(ApiError::unknown_run(run_id));
    };
    let open: Vec<_> = run.state.open_interrupts().collect();
    match open.as_slice() {
        [only] => Ok(only.interrupt_id.clone()),
        [] => Err(ApiError::new(
            StatusCode::CONFLICT,
            "no_open_interrupt",
            format!("run {run_id} has no open interrupt to decide"),
        )),
        several => Err(ApiError::new(
            StatusCode::CONFLICT,
            "ambiguous_interrupt",
            format!(
                "run {run_id} has {} open interrupts: name one with interrupt_id",
                several.len()
            ),
        )
        .with(
            "open_interrupts",
            several
                .iter()
                .map(|i| json!({"interrupt_id": i.interrupt_id, "node": i.node, "proposal_hash": i.proposal_hash}))
                .collect::<Vec<_>>(),
        )),
    }
}

/// `payload` and `edited_args` as the reducer reads them. Before 0.2 the payload carried
/// edited arguments; a client of that time sends a whole argument object (the proposal's
/// fields, some changed) and no `edited_args`. Such a payload is still read as an edit;
/// any other payload is the human's input.
fn decision_inputs(
    payload: Option<Value>,
    edited_args: Option<Value>,
    proposed: Option<&Value>,
) -> (Option<Value>, Option<Value>) {
    let legacy_edit = match (&payload, &edited_args, proposed) {
        (Some(Value::Object(p)), None, Some(Value::Object(args))) => {
            !args.is_empty()
                && p.len() == args.len()
                && p.keys().all(|k| args.contains_key(k))
                && p != args
        }
        _ => false,
    };
    if legacy_edit {
        (None, payload)
    } else {
        (payload, edited_args)
    }
}

async fn resume_run(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Params(run_id): Params<String>,
    JsonBody(body): JsonBody<ResumeRequest>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let key = idempotency_key(&headers)?;
    limits::payload_opt("edited_args", body.edited_args.as_ref())?;
    limits::text("comment", body.comment.as_deref())?;
    let run = known_run(&app, &caller, &run_id)?;
    let interrupt_id = match body.interrupt_id {
        Some(id) => id,
        None => only_open_interrupt(run.as_ref(), &run_id)?,
    };
    let interrupt = run
        .as_ref()
        .and_then(|r| r.state.interrupts.get(&interrupt_id));
    let proposal_hash = match (body.proposal_hash, &run) {
        (Some(hash), _) => hash,
        (None, None) => return Err(ApiError::unknown_run(&run_id)),
        (None, Some(_)) => interrupt.map(|i| i.proposal_hash.clone()).ok_or_else(|| {
            ApiError::new(
                StatusCode::CONFLICT,
                "unknown_interrupt",
                format!(
                    "interrupt {interrupt_id} is not known on this run (pass proposal_hash, or min_position on a read first)"
                ),
            )
        })?,
    };
    let (payload, edited_args) = decision_inputs(
        body.payload,
        body.edited_args,
        interrupt.and_then(|i| i.proposal.get("args")),
    );
    let payload = match payload {
        Some(payload) => {
            let payload = app
                .payload(&caller.tenant, &run_id, "payload", payload)
                .await?;
            Some(app.seal(&caller.tenant, &run_id, payload, false).await?)
        }
        None => None,
    };
    let edited_args = match edited_args {
        Some(args) => {
            // A legacy edit (see `decision_inputs`) came as the payload.
            limits::payload("edited_args", &args)?;
            Some(app.seal(&caller.tenant, &run_id, args, false).await?)
        }
        None => None,
    };
    let decision = match body.decision {
        DecisionIn::Approve => w::Decision::Approve,
        DecisionIn::Reject => w::Decision::Reject,
    };
    let command = command(
        &caller,
        &run_id,
        key,
        w::CommandBody::ResumeRun(w::ResumeRun {
            interrupt_id: interrupt_id.clone(),
            proposal_hash,
            decision,
            payload: payload.as_ref().map(sortie_core::json::canonical),
            comment: body.comment,
            edited_args: edited_args.as_ref().map(sortie_core::json::canonical),
            payload_is_input: true,
        }),
    );
    let answer = app.submit(&command).await?;
    let decision = match decision {
        w::Decision::Approve => "approve",
        w::Decision::Reject => "reject",
    };
    if answer.code == view::BUFFERED {
        // Kept for an interrupt not registered yet: 202, the final answer comes on the
        // run's events under the same command id.
        let mut out = written(&command, &answer, "buffered");
        out["interrupt_id"] = interrupt_id.into();
        out["decision"] = decision.into();
        out["buffered"] = true.into();
        return Ok((StatusCode::ACCEPTED, Json(out)));
    }
    let run = accepted(&app, &command, &answer).await?;
    let mut out = written(
        &command,
        &answer,
        run.map_or("running", |r| r.state.status.as_str()),
    );
    out["interrupt_id"] = interrupt_id.into();
    out["decision"] = decision.into();
    Ok((StatusCode::OK, Json(out)))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CancelRequest {
    #[serde(default)]
    reason: Option<String>,
}

async fn cancel_run(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Params(run_id): Params<String>,
    JsonBody(body): JsonBody<Option<CancelRequest>>,
) -> Result<Json<Value>, ApiError> {
    let key = idempotency_key(&headers)?;
    let reason = body.unwrap_or_default().reason;
    limits::text("reason", reason.as_deref())?;
    if let Some(run) = known_run(&app, &caller, &run_id)? {
        let (graph, version) = (&run.state.graph_id, run.state.graph_version);
        let access = app.inner.graphs.pinned_access(graph, version);
        if let Some(reason) = access.and_then(|a| a.cancel_refusal(graph, &caller.roles)) {
            return Err(ApiError::new(StatusCode::FORBIDDEN, "forbidden", reason));
        }
    }
    let command = command(
        &caller,
        &run_id,
        key,
        w::CommandBody::CancelRun(w::CancelRun { reason }),
    );
    let answer = app.submit(&command).await?;
    let run = accepted(&app, &command, &answer).await?;
    let status = match run.map(|r| r.state.status) {
        Some(RunStatus::Cancelled) => "cancelled",
        _ => "cancelling",
    };
    Ok(Json(written(&command, &answer, status)))
}

/// 403 unless the caller holds the operator role (the fold refuses the same for a raw
/// Kafka command).
fn require_operator(caller: &Caller, what: &str) -> Result<(), ApiError> {
    let operator = sortie_core::decide::reconcile::OPERATOR_ROLE;
    if caller.roles.iter().any(|r| r == operator) {
        return Ok(());
    }
    Err(ApiError::new(
        StatusCode::FORBIDDEN,
        "forbidden",
        format!("{what} needs the {operator} role"),
    ))
}

#[derive(Debug, Default, Deserialize)]
struct DeleteQuery {
    /// Why (recorded in the run's `RunForgotten` event).
    #[serde(default)]
    reason: Option<String>,
}

/// `DELETE /v1/runs/{run_id}`: forget a finished run now (a deletion request). With
/// sealing on, the run's data key is destroyed first — crypto-shredding: its payloads on
/// every topic, in every retained segment and backup, no longer open anywhere — then a
/// `ForgetRun` drops them from its state and tombstones its step results, as when a
/// retention passes. Its history (ids, statuses, hashes) stays, and still verifies.
/// Needs the operator role; a run still going is 409 (cancel it first), and so is a child
/// run (it is forgotten with its parent, which sends it a `ForgetRun`). Idempotent.
async fn delete_run(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Params(run_id): Params<String>,
    QueryParams(query): QueryParams<DeleteQuery>,
) -> Result<Json<Value>, ApiError> {
    let key = idempotency_key(&headers)?;
    limits::text("reason", query.reason.as_deref())?;
    let run = visible_run(&app, &caller, &run_id)?;
    require_operator(&caller, "deleting a run")?;
    if !run.state.status.is_terminal() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "bad_state",
            format!(
                "run {run_id} is {}; cancel it before deleting it",
                run.state.status.as_str()
            ),
        ));
    }
    // Refused before its key is destroyed: a child is forgotten with its parent.
    if let Some(parent) = &run.state.parent {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "bad_state",
            format!(
                "run {run_id} is a child of run {}: it is forgotten with its parent; delete the parent",
                parent.run_id
            ),
        ));
    }
    let reason = query.reason.filter(|r| !r.trim().is_empty());
    let command = command(
        &caller,
        &run_id,
        key,
        w::CommandBody::ForgetRun(w::ForgetRun { reason }),
    );
    // Refused before anything is forgotten here.
    limits::as_the_reducer_reads(&command)?;
    let at = sortie_kafka::clock::now_ms();
    // This gateway stops showing the payloads first: whatever fails after this, a
    // deletion that was asked for is never undone here. Then the key (the shred), then the
    // fold (which destroys the key too, so a ForgetRun from a raw producer shreds as
    // well). A delete that did not answer 200 must be retried: until the reducer's
    // RunForgotten arrives, other gateways may still show what they opened before.
    app.view()
        .store
        .forget_run(&run_id, at, &format!("deleted by {}", caller.principal))
        .map_err(read_failed(&run_id))?;
    let shredded = match &app.inner.run_keys {
        Some(keys) => {
            keys.destroy(&run.state.tenant, &run_id, at)
                .await
                .map_err(|e| {
                    ApiError::unavailable(
                        "key_store_unavailable",
                        format!("the run's data key could not be destroyed; retry the delete: {e}"),
                    )
                })?;
            true
        }
        None => false,
    };
    let answer = app.submit(&command).await?;
    accepted(&app, &command, &answer).await?;
    let mut out = written(&command, &answer, run.state.status.as_str());
    out["forgotten"] = true.into();
    out["shredded"] = shredded.into();
    Ok(Json(out))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
enum OutcomeIn {
    Succeeded,
    Failed,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReconcileRequest {
    outcome: OutcomeIn,
    /// The operation's output (what the receiver did), as JSON.
    #[serde(default)]
    result: Option<Value>,
    #[serde(default)]
    error: Option<String>,
}

async fn reconcile(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Params((run_id, operation_id)): Params<(String, String)>,
    JsonBody(body): JsonBody<ReconcileRequest>,
) -> Result<Json<Value>, ApiError> {
    let key = idempotency_key(&headers)?;
    limits::payload_opt("result", body.result.as_ref())?;
    limits::text("error", body.error.as_deref())?;
    known_run(&app, &caller, &run_id)?;
    // The reducer checks it too (a raw Kafka command); here nothing is published.
    require_operator(&caller, "reconciling an operation")?;
    let outcome = match body.outcome {
        OutcomeIn::Succeeded => w::ReconcileOutcome::Succeeded,
        OutcomeIn::Failed => w::ReconcileOutcome::Failed,
    };
    let result = match body.result {
        Some(result) => Some(app.seal(&caller.tenant, &run_id, result, false).await?),
        None => None,
    };
    let command = command(
        &caller,
        &run_id,
        key,
        w::CommandBody::ReconcileOperation(w::ReconcileOperation {
            operation_id: operation_id.clone(),
            outcome,
            output: result.as_ref().map(sortie_core::json::canonical),
            error: body.error,
        }),
    );
    let answer = app.submit(&command).await?;
    let run = accepted(&app, &command, &answer).await?;
    let mut out = written(
        &command,
        &answer,
        run.map_or("running", |r| r.state.status.as_str()),
    );
    out["operation_id"] = operation_id.into();
    Ok(Json(out))
}

// ---------------------------------------------------------------- reads

#[derive(Debug, Default, Deserialize)]
struct ReadQuery {
    #[serde(default)]
    min_position: Option<String>,
}

async fn get_run(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Params(run_id): Params<String>,
    QueryParams(query): QueryParams<ReadQuery>,
) -> Result<Json<Value>, ApiError> {
    read_after(&app, &headers, query.min_position.as_deref()).await?;
    let run = visible_run(&app, &caller, &run_id)?;
    let mut out = render::run(&run.state);
    out["forks"] = app
        .view()
        .store
        .forks(&run_id)
        .map_err(read_failed(&run_id))?
        .into();
    Ok(Json(out))
}

#[derive(Debug, Default, Deserialize)]
struct ListQuery {
    #[serde(default)]
    status: Option<String>,
    #[serde(default)]
    graph_id: Option<String>,
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default)]
    after: Option<String>,
    /// `key=value`: only runs carrying this label.
    #[serde(default)]
    label: Option<String>,
    /// Unix ms: only runs created at or after.
    #[serde(default)]
    created_after: Option<i64>,
    /// Unix ms: only runs created before.
    #[serde(default)]
    created_before: Option<i64>,
    #[serde(default)]
    min_position: Option<String>,
}

fn parse_status(text: &str) -> Option<RunStatus> {
    RunStatus::ALL
        .into_iter()
        .find(|s| s.as_str().eq_ignore_ascii_case(text))
}

async fn list_runs(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    QueryParams(query): QueryParams<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    read_after(&app, &headers, query.min_position.as_deref()).await?;
    let status = query
        .status
        .as_deref()
        .filter(|s| !s.is_empty())
        .map(|s| {
            parse_status(s).ok_or_else(|| {
                ApiError::bad_request("invalid_query", format!("unknown status {s:?}"))
            })
        })
        .transpose()?;
    let limit = query.limit.unwrap_or(50).clamp(1, 500);
    let graph_id = query.graph_id.filter(|g| !g.is_empty());
    let label = query
        .label
        .filter(|l| !l.is_empty())
        .map(|l| match l.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
            _ => Err(ApiError::bad_request(
                "invalid_query",
                format!("label must be key=value, not {l:?}"),
            )),
        })
        .transpose()?;
    let (from, until) = (query.created_after, query.created_before);
    let runs = app
        .view()
        .store
        .list(
            &caller.tenant,
            status,
            query.after.as_deref(),
            limit + 1,
            |run| {
                let state = &run.state;
                graph_id.as_ref().is_none_or(|g| *g == state.graph_id)
                    && label
                        .as_ref()
                        .is_none_or(|(k, v)| state.labels.get(k) == Some(v))
                    && from.is_none_or(|t| state.created_at >= t)
                    && until.is_none_or(|t| state.created_at < t)
            },
        )
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let more = runs.len() > limit;
    let runs = &runs[..runs.len().min(limit)];
    Ok(Json(json!({
        "runs": runs.iter().map(|r| render::summary(&r.state)).collect::<Vec<_>>(),
        "next_after": if more { runs.last().map(|r| r.state.run_id.clone()) } else { None },
    })))
}

#[derive(Debug, Default, Deserialize)]
struct EventsQuery {
    #[serde(default)]
    after: Option<i64>,
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default)]
    min_position: Option<String>,
}

fn wants_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/event-stream"))
}

async fn events(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Params(run_id): Params<String>,
    QueryParams(query): QueryParams<EventsQuery>,
) -> Result<Response, ApiError> {
    if wants_stream(&headers) {
        return events_stream(
            State(app),
            caller,
            headers,
            Params(run_id),
            QueryParams(query),
        )
        .await
        .map(IntoResponse::into_response);
    }
    read_after(&app, &headers, query.min_position.as_deref()).await?;
    visible_run(&app, &caller, &run_id)?;
    let after = query.after.unwrap_or(0).max(0);
    let limit = query.limit.unwrap_or(DEFAULT_PAGE).clamp(1, MAX_PAGE);
    let mut page = app
        .view()
        .store
        .events(&run_id, after, limit + 1)
        .map_err(read_failed(&run_id))?;
    let more = page.len() > limit;
    page.truncate(limit);
    let next_after = page.last().map_or(after, |e| e.seq);
    Ok(Json(json!({
        "run_id": run_id,
        "events": page.iter().map(render::event).collect::<Vec<_>>(),
        "next_after": next_after,
        "has_more": more,
    }))
    .into_response())
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConversationQuery {
    #[serde(default)]
    min_position: Option<String>,
}

/// The run's agent conversations (`sortie_core::conversation`), from its events.
async fn conversation(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Params(run_id): Params<String>,
    QueryParams(query): QueryParams<ConversationQuery>,
) -> Result<Json<Value>, ApiError> {
    read_after(&app, &headers, query.min_position.as_deref()).await?;
    visible_run(&app, &caller, &run_id)?;
    let mut events = Vec::new();
    let mut after = 0;
    loop {
        let page = app
            .view()
            .store
            .events(&run_id, after, MAX_PAGE)
            .map_err(|e| ApiError::internal(e.to_string()))?;
        let Some(last) = page.last() else { break };
        after = last.seq;
        events.extend(page);
    }
    Ok(Json(json!({
        "run_id": run_id,
        "entries": sortie_core::conversation::of(&events),
        "last_seq": after,
    })))
}

async fn events_stream(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Params(run_id): Params<String>,
    QueryParams(query): QueryParams<EventsQuery>,
) -> Result<Sse<impl futures::Stream<Item = Result<sse::Event, Infallible>>>, ApiError> {
    read_after(&app, &headers, query.min_position.as_deref()).await?;
    visible_run(&app, &caller, &run_id)?;
    let last_event_id = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<i64>().ok());
    let after = last_event_id.or(query.after).unwrap_or(0).max(0);
    let slot = app.stream_slot(&caller.tenant).ok_or_else(|| {
        ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_streams",
            format!(
                "tenant {} has {} live event streams open, the most allowed; close one first",
                caller.tenant,
                app.config().max_streams_per_tenant
            ),
        )
    })?;
    Ok(Sse::new(live(app, run_id, after, slot)).keep_alive(KeepAlive::default()))
}

struct Cursor {
    app: AppState,
    run_id: String,
    after: i64,
    buffer: VecDeque<Event>,
    progress: tokio::sync::watch::Receiver<Progress>,
    stopping: tokio::sync::watch::Receiver<bool>,
    /// Held for the stream's life: the stream drops it when it ends or its client leaves.
    _slot: crate::app::StreamSlot,
}

/// The run's events after `after`, then every new one as the view applies it, until the
/// client leaves or the gateway stops.
fn live(
    app: AppState,
    run_id: String,
    after: i64,
    slot: crate::app::StreamSlot,
) -> impl futures::Stream<Item = Result<sse::Event, Infallible>> {
    let cursor = Cursor {
        _slot: slot,
        progress: app.view().progress(),
        stopping: app.stopping(),
        app,
        run_id,
        after,
        buffer: VecDeque::new(),
    };
    futures::stream::unfold(cursor, |mut c| async move {
        loop {
            if let Some(event) = c.buffer.pop_front() {
                c.after = event.seq;
                let data = serde_json::to_string(&render::event(&event)).unwrap_or_default();
                let item = sse::Event::default()
                    .id(event.seq.to_string())
                    .event(event.body.name())
                    .data(data);
                return Some((Ok(item), c));
            }
            if *c.stopping.borrow() {
                return None;
            }
            // Mark the progress seen before reading, so a change after the read wakes us.
            c.progress.borrow_and_update();
            match c.app.view().store.events(&c.run_id, c.after, 256) {
                Ok(events) if !events.is_empty() => {
                    c.buffer.extend(events);
                    continue;
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(run_id = %c.run_id, %error, "An event stream ends: the view store failed.");
                    return None;
                }
            }
            tokio::select! {
                changed = c.progress.changed() => if changed.is_err() { return None },
                _ = c.stopping.wait_for(|stop| *stop) => return None,
            }
        }
    })
}

async fn checkpoint(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Params((run_id, checkpoint_id)): Params<(String, String)>,
    QueryParams(query): QueryParams<ReadQuery>,
) -> Result<Json<Value>, ApiError> {
    read_after(&app, &headers, query.min_position.as_deref()).await?;
    let run = visible_run(&app, &caller, &run_id)?;
    let unknown = || {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_checkpoint",
            format!("checkpoint {checkpoint_id} does not exist (ids are ckpt_{run_id}_<version>)"),
        )
    };
    let version: i64 = checkpoint_id
        .strip_prefix(&format!("ckpt_{run_id}_"))
        .and_then(|v| v.parse().ok())
        .filter(|v| (1..=run.state.version).contains(v))
        .ok_or_else(unknown)?;
    let state = state_at(&app, &run_id, version)?.ok_or_else(unknown)?;
    Ok(Json(render::checkpoint(&state, version)))
}

/// A blob the run references (its input, an output, a decision's payload stored by
/// reference), to the run's own tenant: the bytes exactly as stored, with the media type
/// of the reference. Only a hash the run's state references is served (through that
/// reference's key, so a fork serves what it carries from its source); the bytes are
/// checked against the reference's size and hash before they are sent.
async fn blob(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Params((run_id, sha256)): Params<(String, String)>,
    QueryParams(query): QueryParams<ReadQuery>,
) -> Result<Response, ApiError> {
    read_after(&app, &headers, query.min_position.as_deref()).await?;
    let run = visible_run(&app, &caller, &run_id)?;
    let unknown = || {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_blob",
            format!("run {run_id} references no blob {sha256}"),
        )
    };
    if !sortie_core::blob::is_sha256_hex(&sha256) {
        return Err(unknown());
    }
    let state = serde_json::to_value(&run.state).map_err(|e| ApiError::internal(e.to_string()))?;
    let reference = sortie_core::blob::refs(&state)
        .into_iter()
        .find(|r| r.sha256 == sha256)
        .ok_or_else(unknown)?;
    let Some(store) = app.inner.blobs.as_deref() else {
        return Err(ApiError::unavailable(
            "blob_store_unavailable",
            "this gateway has no blob store configured (--blob-store)",
        ));
    };
    use sortie_blob::resolve::ResolveError as E;
    let bytes = sortie_blob::resolve::fetch_verified(store, &reference, &caller.tenant)
        .await
        .map_err(|e| match e {
            E::Missing { .. } => ApiError::new(StatusCode::NOT_FOUND, "blob_missing", e.to_string()),
            E::Unavailable { .. } | E::NoStore { .. } => {
                ApiError::unavailable("blob_store_unavailable", e.to_string())
            }
            E::Forbidden { .. } => unknown(),
            E::Corrupt { .. } | E::Invalid { .. } => {
                tracing::error!(run_id = %run_id, error = %e, "A referenced blob failed its check; not served.");
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.code(), e.to_string())
            }
        })?;
    // Served as a download, never as a page: a run's data is whatever its tenant (or a
    // receiver) wrote, so a browser that opens this URL must not run or render it.
    let content_type = if is_json_media_type(&reference.media_type) {
        "application/json"
    } else {
        "application/octet-stream"
    };
    Ok((
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
            (
                header::CONTENT_DISPOSITION,
                HeaderValue::from_static("attachment"),
            ),
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(BLOB_CONTENT_SECURITY_POLICY),
            ),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
            (
                header::ETAG,
                HeaderValue::from_str(&format!("\"{sha256}\""))
                    .map_err(|e| ApiError::internal(e.to_string()))?,
            ),
        ],
        bytes,
    )
        .into_response())
}

/// The blob route's policy: nothing loads, and the document is sandboxed (no script, no
/// origin of its own) should a browser render it anyway.
const BLOB_CONTENT_SECURITY_POLICY: &str = "default-src 'none'; sandbox";

/// Whether a blob's stored media type is JSON (`application/json`, parameters aside):
/// the one type the blob route names; any other is served as
/// `application/octet-stream`, whatever the reference says.
fn is_json_media_type(media_type: &str) -> bool {
    media_type
        .split(';')
        .next()
        .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("application/json"))
}

/// The run's state after `version`: every version is recoverable from history, by
/// folding the events up to it.
/// Every event of `run_id`'s history in the view, in order.
pub(crate) fn history(app: &AppState, run_id: &str) -> Result<Vec<sortie_core::Event>, ApiError> {
    let mut out: Vec<sortie_core::Event> = Vec::new();
    loop {
        let page = app
            .view()
            .store
            .events(run_id, out.len() as i64, 512)
            .map_err(|e| ApiError::internal(e.to_string()))?;
        if page.is_empty() {
            return Ok(out);
        }
        for event in page {
            if event.seq != out.len() as i64 + 1 {
                return Err(ApiError::new(
                    StatusCode::GONE,
                    "history_incomplete",
                    format!("the view lacks event {} of this run", out.len() + 1),
                ));
            }
            out.push(event);
        }
    }
}

fn state_at(
    app: &AppState,
    run_id: &str,
    version: i64,
) -> Result<Option<sortie_core::RunState>, ApiError> {
    let mut state = None;
    let mut after = 0;
    'fold: loop {
        let page = app
            .view()
            .store
            .events(run_id, after, 512)
            .map_err(read_failed(run_id))?;
        if page.is_empty() {
            break;
        }
        for event in page {
            if event.seq != after + 1 {
                return Err(ApiError::new(
                    StatusCode::GONE,
                    "history_incomplete",
                    format!("the view lacks event {} of this run", after + 1),
                ));
            }
            if event.state_version > version {
                break 'fold;
            }
            after = event.seq;
            state = sortie_core::evolve(state, &event);
        }
    }
    Ok(state.filter(|s: &sortie_core::RunState| s.version == version))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ForkRequest {
    /// The source's state version to start from (`ckpt_<run>_<version>`).
    at_version: i64,
    /// A JSON merge patch (RFC 7386) applied to the source's input.
    #[serde(default)]
    input_patch: Option<Value>,
    #[serde(default)]
    run_id: Option<String>,
    /// Labels of the new run; the source's when absent.
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
}

/// RFC 7386: objects merge key by key, `null` removes, anything else replaces.
fn merge_patch(target: Value, patch: &Value) -> Value {
    match (target, patch) {
        (Value::Object(mut map), Value::Object(changes)) => {
            for (key, change) in changes {
                if change.is_null() {
                    map.remove(key);
                } else {
                    let current = map.remove(key).unwrap_or(Value::Null);
                    map.insert(key.clone(), merge_patch(current, change));
                }
            }
            Value::Object(map)
        }
        (Value::Null, Value::Object(_)) => merge_patch(json!({}), patch),
        (_, other) => other.clone(),
    }
}

/// `POST /v1/runs/{run_id}/fork`: a new run from one of this run's checkpoints. The new
/// run keeps the steps completed by then (never run again) and records its lineage.
async fn fork_run(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Params(run_id): Params<String>,
    JsonBody(body): JsonBody<ForkRequest>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let key = idempotency_key(&headers)?;
    limits::payload_opt("input_patch", body.input_patch.as_ref())?;
    if let Some(labels) = &body.labels {
        limits::labels(labels)?;
    }
    let run = visible_run(&app, &caller, &run_id)?;
    if let Some(forgotten) = &run.state.forgotten {
        // Its checkpoints keep the run's shape only: a fork would start without payloads.
        return Err(ApiError::new(
            StatusCode::GONE,
            "run_forgotten",
            format!(
                "run {run_id} was forgotten ({}) at {}: its payloads are gone, so it cannot be forked",
                forgotten.reason, forgotten.at
            ),
        ));
    }
    let unknown = || {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_checkpoint",
            format!(
                "run {run_id} has no version {} (1 to {})",
                body.at_version, run.state.version
            ),
        )
    };
    if !(1..=run.state.version).contains(&body.at_version) {
        return Err(unknown());
    }
    let source = state_at(&app, &run_id, body.at_version)?.ok_or_else(unknown)?;
    // The reducer checks a fork against the source's chain head, which only the owner of
    // the source's partition holds: the fork's run id is on that partition too.
    let partition = app.partition_of(&run_id);
    let new_id = match (body.run_id, &key) {
        (Some(id), _) if valid_id(&id) && id != run_id => {
            if app.partition_of(&id) != partition {
                return Err(ApiError::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "fork_partition",
                    format!(
                        "run_id {id} is on another partition than run {run_id}: a fork's run id must be on its source's partition (leave run_id out and the gateway picks one)"
                    ),
                ));
            }
            id
        }
        (Some(_), _) => {
            return Err(ApiError::bad_request(
                "invalid_run_id",
                "run_id must be 1 to 128 characters of A-Z a-z 0-9 _ - . : @, and not the source's",
            ))
        }
        // A retried fork names the same run: derived from the key in the form the reducer
        // checks (`key_…_n`), so nobody takes it first by guessing the key; a retry of a
        // fork made before that form keeps its older id.
        (None, Some(key)) => {
            let older = (0u32..)
                .map(|n| {
                    let digest = match n {
                        0 => sortie_core::json::sha256_hex(&[&caller.tenant, "fork", key]),
                        n => sortie_core::json::sha256_hex(&[
                            &caller.tenant,
                            "fork",
                            key,
                            &n.to_string(),
                        ]),
                    };
                    format!("run_{}", &digest[..26])
                })
                .find(|id| app.partition_of(id) == partition)
                .unwrap_or_default();
            match known_run(&app, &caller, &older) {
                Ok(Some(_)) => older,
                _ => (0u32..)
                    .map(|n| sortie_core::ids::keyed_fork_id(&caller.tenant, key, n))
                    .find(|id| app.partition_of(id) == partition)
                    .unwrap_or_default(),
            }
        }
        (None, None) => std::iter::repeat_with(|| format!("run_{}", Ulid::generate()))
            .find(|id| app.partition_of(id) == partition)
            .unwrap_or_default(),
    };
    // The source's whole history: the reducer re-derives the state at the version from
    // it, held to the source's chain head (what a command claims a state is never counts).
    let history = history(&app, &run_id)?;
    let input = match &body.input_patch {
        Some(patch) => merge_patch(source.input.clone(), patch),
        None => source.input.clone(),
    };
    limits::payload("input", &input)?;
    // A fork starts a run: it spends one of the tenant's start tokens.
    app.admit_start(&caller.tenant)?;
    // The new run's payloads, the source's state included, sealed with the new run's key.
    let seal = app.run_seal(&caller.tenant, &new_id, true).await?;
    let input = {
        use sortie_seal::Seal as _;
        seal.seal(&input)
    };
    let history: Vec<sortie_core::Event> = history.iter().map(|e| e.sealed(&seal)).collect();
    let fork = json!({"run_id": run_id, "version": body.at_version, "history": history});
    let command = command(
        &caller,
        &new_id,
        key,
        w::CommandBody::StartRun(w::StartRun {
            graph_id: source.graph_id.clone(),
            graph_version: Some(source.graph_version as i32),
            input: sortie_core::json::canonical(&input),
            labels: body.labels.unwrap_or_else(|| source.labels.clone()),
            fork: Some(sortie_core::json::canonical(&fork)),
            parent: None,
            // The source's limits as they stood at that version; the fork's own spend
            // starts at zero (what it carries over was charged to the source).
            budget: source.budget.as_ref().map(sortie_model::budget_text),
        }),
    );
    let answer = app.submit(&command).await?;
    let new_run = accepted(&app, &command, &answer).await?;
    let status = new_run.map_or(RunStatus::Running, |r| r.state.status);
    let mut out = written(&command, &answer, status.as_str());
    out["forked_from"] = json!({"run_id": run_id, "version": body.at_version});
    Ok((StatusCode::CREATED, Json(out)))
}

#[cfg(test)]
mod blob_tests {
    use super::*;

    /// The blob route names JSON only; whatever else a reference says (HTML, SVG, script)
    /// is served as `application/octet-stream`.
    #[test]
    fn only_a_json_media_type_is_named() {
        assert!(is_json_media_type("application/json"));
        assert!(is_json_media_type("Application/JSON; charset=utf-8"));
        for other in [
            "text/html",
            "image/svg+xml",
            "application/javascript",
            "application/json+html",
            "",
        ] {
            assert!(!is_json_media_type(other), "{other}");
        }
    }
}

#[cfg(test)]
mod resume_tests {
    use super::*;

    #[test]
    fn a_whole_changed_argument_object_without_edited_args_is_a_legacy_edit() {
        let proposed = json!({"amount": 30, "order_id": "o1"});
        let edit = json!({"amount": 20, "order_id": "o1"});
        assert_eq!(
            decision_inputs(Some(edit.clone()), None, Some(&proposed)),
            (None, Some(edit.clone()))
        );
        let note = json!({"note": "checked with the customer"});
        assert_eq!(
            decision_inputs(Some(note.clone()), None, Some(&proposed)),
            (Some(note.clone()), None),
            "human input"
        );
        assert_eq!(
            decision_inputs(Some(proposed.clone()), None, Some(&proposed)),
            (Some(proposed.clone()), None),
            "unchanged arguments edit nothing"
        );
        assert_eq!(
            decision_inputs(Some(edit.clone()), Some(edit.clone()), Some(&proposed)),
            (Some(edit.clone()), Some(edit)),
            "an explicit edited_args makes the payload input"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_statuses_are_checked() {
        assert!(valid_id("run_01J8ZQ"));
        assert!(valid_id("orders:42@acme"));
        assert!(!valid_id(""));
        assert!(!valid_id("a b"));
        assert!(!valid_id(&"x".repeat(129)));
        assert_eq!(
            parse_status("waiting_approval"),
            Some(RunStatus::WaitingApproval)
        );
        assert_eq!(parse_status("RUNNING"), Some(RunStatus::Running));
        assert_eq!(parse_status("nope"), None);
    }
}
