//! `POST /v1/runs`: starting a run, with the run id it gets (chosen, derived from the
//! `Idempotency-Key`, or from the graph's correlation label).

use sortie_core::RunStatus;

use super::*;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct StartRequest {
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

pub(super) async fn start_run(
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
