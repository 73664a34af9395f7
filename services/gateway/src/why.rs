//! `GET /v1/runs/{run_id}/operations/{operation_id}/why`: the authorization chain of one
//! side effect (`sortie_why`), each link verified — from the view's history of the run
//! (its hashes checked again over the sealed form), the graph table (read with the
//! keyring: the publisher's signature), and the commands that carried the approvals,
//! looked up on `sortie.commands` and checked against the keyring (`--keyring`). For an
//! operation of a child run, the parent's history in the view completes the `parent`
//! link (the parent dispatched the operation that started the child).

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde_json::Value;

use crate::api::{history, visible_run};
use crate::app::AppState;
use crate::error::ApiError;
use crate::extract::Caller;
use crate::extract::Params;

pub(crate) async fn why(
    State(app): State<AppState>,
    caller: Caller,
    Params((run_id, operation_id)): Params<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let run = visible_run(&app, &caller, &run_id)?;
    if run.state.forgotten.is_some() {
        // Its arguments and proposals are gone: nothing left to prove them with.
        return Err(ApiError::run_forgotten(&run_id));
    }
    let history = history(&app, &run_id)?;
    let seal = app.run_seal(&caller.tenant, &run_id, false).await?;
    let (graph, publication) = app
        .inner
        .graphs
        .version(&run.state.graph_id, run.state.graph_version);
    let keyring = app
        .config()
        .keyring
        .as_deref()
        .map(sortie_wire::signing::Keyring::load)
        .transpose()
        .map_err(|e| ApiError::internal(format!("the keyring: {e}")))?;
    let kafka = app.config().kafka.clone();
    let topic = sortie_wire::Topics::new(app.config().prefix.clone()).commands();
    let (codec, partitions) = app.codec();
    let runtime = tokio::runtime::Handle::current();
    let mut chain = tokio::task::spawn_blocking(move || {
        let mut commands =
            sortie_why::KafkaCommands::open(&kafka, topic, partitions, codec, runtime)?;
        Ok::<_, String>(sortie_why::why(sortie_why::Inputs {
            operation_id: &operation_id,
            history: &history,
            seal: &seal,
            readable: true,
            graph: graph.as_ref(),
            publication: publication.as_ref(),
            keyring: keyring.as_ref(),
            commands: &mut commands,
        }))
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))?
    .map_err(|e| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "kafka_unavailable",
            format!("sortie.commands could not be read: {e}"),
        )
    })?;
    if chain.links.first().is_some_and(|l| l.link == "history")
        && !chain
            .links
            .iter()
            .any(|l| l.link == "effect" && l.facts["step_id"].is_string())
    {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_operation",
            format!(
                "run {run_id} dispatched no operation {}",
                crate::why::shown(&chain.operation_id)
            ),
        ));
    }
    if let Some(parent) = chain.parent().map(|p| p.run_id.clone()) {
        if let Some(history) = parent_history(&app, &caller, &parent) {
            chain.check_parent(&history);
        }
    }
    serde_json::to_value(&chain)
        .map(Json)
        .map_err(|e| ApiError::internal(e.to_string()))
}

/// The history of a child's parent run as the view holds it: empty when the view holds
/// no such run of the caller's tenant (the `parent` link is then broken: no run of the
/// tenant started the child), `None` when it cannot be read now (the link stays
/// unchecked).
fn parent_history(
    app: &AppState,
    caller: &Caller,
    run_id: &str,
) -> Option<Vec<sortie_core::Event>> {
    match app.view().store.run(run_id) {
        Ok(Some(run)) if run.state.tenant == caller.tenant => history(app, run_id).ok(),
        Ok(_) => Some(Vec::new()),
        Err(_) => None,
    }
}

/// A client's id as an error shows it: at most 64 characters.
fn shown(id: &str) -> String {
    id.chars().take(64).collect()
}
