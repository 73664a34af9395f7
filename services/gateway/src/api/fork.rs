//! `POST /v1/runs/{run_id}/fork`: a new run from one of a run's checkpoints, with the
//! source's history for the reducer to re-derive it from.

use sortie_core::RunStatus;

use super::history::state_at;
use super::*;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ForkRequest {
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
pub(super) async fn fork_run(
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
