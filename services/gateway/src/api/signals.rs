//! `POST /v1/runs/{run_id}/signals/{name}`: an outside event a node of the run waits for
//! (`wait: {signal: <name>}`), published as a `SignalRun` command like every write.

use super::*;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SignalRequest {
    /// The signal's payload (absent: null), held to the wait's schema.
    #[serde(default)]
    payload: Option<Value>,
    /// The sender's id of the event: taken once per run, whatever request carries it
    /// (absent: the command id, i.e. the `Idempotency-Key`).
    #[serde(default)]
    signal_id: Option<String>,
}

/// `POST /v1/signals/{name}`: a signal for the run of a graph with a `correlation`
/// label, addressed by the label's value (the run's id is derived from it).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CorrelatedSignalRequest {
    graph_id: String,
    /// The value of the graph's correlation label on the run (e.g. the hire's id).
    correlation: String,
    #[serde(default)]
    payload: Option<Value>,
    #[serde(default)]
    signal_id: Option<String>,
}

/// The id of the run of `graph_id` whose correlation label `label` is in `labels`
/// (422 `bad_run_id` when it is not).
pub(super) fn correlated(
    tenant: &str,
    graph_id: &str,
    label: &str,
    labels: &BTreeMap<String, String>,
) -> Result<String, ApiError> {
    let value = labels.get(label).ok_or_else(|| {
        ApiError::from_reject(
            "bad_run_id",
            &format!(
                "graph {graph_id} names its runs by their {label} label: a start must carry it"
            ),
        )
    })?;
    Ok(sortie_core::ids::correlated_run_id(
        tenant, graph_id, label, value,
    ))
}

/// Sends a signal to the run of `graph_id` named by its correlation label's value: the
/// same as [`signal_run`] on the derived run id. A graph without a correlation is 422
/// `no_correlation`; a run not started yet is 404 `unknown_run` (the sender retries: a
/// signal is never kept for a run that does not exist).
pub(super) async fn signal_correlated(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Params(name): Params<String>,
    JsonBody(body): JsonBody<CorrelatedSignalRequest>,
) -> Result<Json<Value>, ApiError> {
    sortie_core::limits::check_id("graph_id", &body.graph_id)
        .map_err(|e| ApiError::bad_request("invalid_request", e))?;
    sortie_core::limits::check_text(
        "correlation",
        &body.correlation,
        sortie_core::limits::MAX_TEXT_BYTES,
    )
    .map_err(|e| ApiError::bad_request("invalid_request", e))?;
    let graphs = &app.inner.graphs;
    let mut label = graphs.correlation(&caller.tenant, &body.graph_id, None);
    if label.is_none() {
        graphs.refresh(Duration::from_secs(3)).await;
        label = graphs.correlation(&caller.tenant, &body.graph_id, None);
    }
    let label = match label {
        None => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "unknown_graph",
                format!("graph {} is not published", body.graph_id),
            ))
        }
        Some(None) => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "no_correlation",
                format!(
                    "graph {} declares no correlation label; address its runs by run id",
                    body.graph_id
                ),
            ))
        }
        Some(Some(label)) => label,
    };
    let labels = BTreeMap::from([(label.clone(), body.correlation)]);
    let run_id = correlated(&caller.tenant, &body.graph_id, &label, &labels)?;
    send(
        &app,
        &caller,
        &headers,
        run_id,
        name,
        SignalRequest {
            payload: body.payload,
            signal_id: body.signal_id,
        },
    )
    .await
}

/// Sends a signal. What the gateway can tell from the run's pinned graph it answers
/// before publishing (no such wait 409 `unknown_signal`, the sender's roles 403, the
/// payload's schema 422 `invalid_payload`); the reducer decides the rest and its answer
/// is the response: `signal` is `taken` (an open wait took it), `kept` (the wait has not
/// opened yet; it is taken when it does) or `duplicate` (this signal id was taken or
/// kept already).
pub(super) async fn signal_run(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Params((run_id, name)): Params<(String, String)>,
    JsonBody(body): JsonBody<Option<SignalRequest>>,
) -> Result<Json<Value>, ApiError> {
    send(
        &app,
        &caller,
        &headers,
        run_id,
        name,
        body.unwrap_or_default(),
    )
    .await
}

async fn send(
    app: &AppState,
    caller: &Caller,
    headers: &HeaderMap,
    run_id: String,
    name: String,
    body: SignalRequest,
) -> Result<Json<Value>, ApiError> {
    let key = idempotency_key(headers)?;
    sortie_core::limits::check_id("signal name", &name)
        .map_err(|e| ApiError::bad_request("invalid_request", e))?;
    if let Some(id) = &body.signal_id {
        sortie_core::limits::check_id("signal_id", id)
            .map_err(|e| ApiError::bad_request("invalid_request", e))?;
    }
    let payload = body.payload.unwrap_or(Value::Null);
    // A signal's payload travels inline, never by reference: the wait's schema is held
    // against it in the fold, which never reads a blob.
    limits::payload("payload", &payload)?;
    if let Some(run) = known_run(app, caller, &run_id)? {
        let (graph, version) = (&run.state.graph_id, run.state.graph_version);
        match app.inner.graphs.signal_taker(graph, version, &name) {
            Some(None) => {
                return Err(ApiError::from_reject(
                    "unknown_signal",
                    &format!("graph {graph}@{version} waits for no signal named {name}"),
                ))
            }
            Some(Some(node)) => {
                if let Some(reason) = sortie_core::signal::refusal(&node, &caller.roles) {
                    return Err(ApiError::new(StatusCode::FORBIDDEN, "forbidden", reason));
                }
                sortie_core::signal::check_payload(&node, &payload)
                    .map_err(|why| ApiError::from_reject("invalid_payload", &why))?;
            }
            None => {} // the version is not known here yet: the reducer answers
        }
    }
    let payload = app.seal(&caller.tenant, &run_id, payload, false).await?;
    let command = command(
        caller,
        &run_id,
        key,
        w::CommandBody::SignalRun(w::SignalRun {
            name,
            signal_id: body.signal_id,
            payload: Some(sortie_core::json::canonical(&payload)),
        }),
    );
    let answer = app.submit(&command).await?;
    let run = accepted(app, &command, &answer).await?;
    let signal_id = match &command.body {
        w::CommandBody::SignalRun(s) => s.signal_id.clone(),
        _ => None,
    }
    .unwrap_or_else(|| command.command_id.clone());
    let state = run.as_ref().map(|r| &r.state);
    let taken = state.is_some_and(|s| {
        s.waits
            .values()
            .flat_map(|w| &w.received)
            .any(|r| r.signal_id == signal_id)
    });
    let signal = match (answer.duplicate, taken) {
        (true, _) => "duplicate",
        (false, true) => "taken",
        (false, false) => "kept",
    };
    let status = state.map_or("running", |s| s.status.as_str());
    let mut out = written(&command, &answer, status);
    out["signal"] = signal.into();
    out["signal_id"] = signal_id.into();
    Ok(Json(out))
}
