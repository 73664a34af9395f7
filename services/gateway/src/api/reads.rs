//! Reads of runs from the view: one run, the tenant's list, a run's agent conversations,
//! and a run's state at a checkpoint.

use sortie_core::RunStatus;

use super::history::state_at;
use super::*;
use crate::extract::QueryParams;
use crate::render;

pub(super) async fn get_run(
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
pub(super) struct ListQuery {
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

pub(super) async fn list_runs(
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
#[serde(deny_unknown_fields)]
pub(super) struct ConversationQuery {
    #[serde(default)]
    min_position: Option<String>,
}

/// The run's agent conversations (`sortie_core::conversation`), from its events.
pub(super) async fn conversation(
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

pub(super) async fn checkpoint(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_checked() {
        assert_eq!(
            parse_status("waiting_approval"),
            Some(RunStatus::WaitingApproval)
        );
        assert_eq!(parse_status("RUNNING"), Some(RunStatus::Running));
        assert_eq!(parse_status("nope"), None);
    }
}
