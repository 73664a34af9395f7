//! The writes that need the operator role: deleting (forgetting) a finished run, and
//! reconciling an operation whose outcome is unknown.

use super::*;
use crate::extract::QueryParams;

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
pub(super) struct DeleteQuery {
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
pub(super) async fn delete_run(
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
pub(super) struct ReconcileRequest {
    outcome: OutcomeIn,
    /// The operation's output (what the receiver did), as JSON.
    #[serde(default)]
    result: Option<Value>,
    #[serde(default)]
    error: Option<String>,
}

pub(super) async fn reconcile(
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
