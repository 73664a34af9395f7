//! The writes a person makes on a running run: approving or rejecting an open interrupt
//! (`resume`), and cancelling it.

use sortie_core::RunStatus;

use super::*;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
enum DecisionIn {
    Approve,
    Reject,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ResumeRequest {
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

pub(super) async fn resume_run(
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
pub(super) struct CancelRequest {
    #[serde(default)]
    reason: Option<String>,
}

pub(super) async fn cancel_run(
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
