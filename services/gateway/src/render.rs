//! The JSON the API shows for runs, checkpoints and events.

use serde_json::{json, Value};
use sortie_core::state::Interrupt;
use sortie_core::{ids, Event, RunState};

fn interrupt(i: &Interrupt) -> Value {
    json!({
        "interrupt_id": i.interrupt_id,
        "step_id": i.step_id,
        "node": i.node,
        "proposal": i.proposal,
        "proposal_hash": i.proposal_hash,
        "reason": i.reason,
        "required_role": i.required_role,
        "approver_group": i.approver_group,
        "quorum": i.quorum,
        "approvals": i.approvals,
        "expires_at": i.expires_at,
        "status": i.status,
    })
}

/// The nodes of the steps that succeeded, in the order they did.
fn nodes_completed(state: &RunState) -> Vec<&str> {
    state
        .completed
        .iter()
        .filter_map(|id| state.steps.get(id).map(|s| s.node.as_str()))
        .collect()
}

fn common(state: &RunState) -> serde_json::Map<String, Value> {
    let open: Vec<Value> = state.open_interrupts().map(interrupt).collect();
    let body = json!({
        "run_id": state.run_id,
        "checkpoint_ns": state.tenant,
        "graph_id": state.graph_id,
        "graph_version": state.graph_version,
        "status": state.status.as_str(),
        "version": state.version,
        "last_event_seq": state.last_event_seq,
        "steps_done": state.completed.len(),
        "nodes_completed": nodes_completed(state),
        "steps": state.steps.values().collect::<Vec<_>>(),
        "interrupt": open.first(),
        "interrupts": open,
        "created_at": state.created_at,
        "updated_at": state.updated_at,
        "started_by": state.started_by,
        "labels": state.labels,
        "input": state.input,
        "output": state.output,
        "ending": state.ending,
    });
    match body {
        Value::Object(map) => map,
        _ => serde_json::Map::new(),
    }
}

/// `GET /v1/runs/{run_id}`: status, the open interrupts, the last checkpoint, steps.
pub fn run(state: &RunState) -> Value {
    let mut map = common(state);
    map.insert(
        "last_checkpoint_id".into(),
        ids::checkpoint_id(&state.run_id, state.version).into(),
    );
    Value::Object(map)
}

/// A row of `GET /v1/runs`.
pub fn summary(state: &RunState) -> Value {
    json!({
        "run_id": state.run_id,
        "checkpoint_ns": state.tenant,
        "graph_id": state.graph_id,
        "graph_version": state.graph_version,
        "status": state.status.as_str(),
        "version": state.version,
        "steps_done": state.completed.len(),
        "open_interrupts": state.open_interrupts().count(),
        "last_checkpoint_id": ids::checkpoint_id(&state.run_id, state.version),
        "created_at": state.created_at,
        "updated_at": state.updated_at,
        "labels": state.labels,
    })
}

/// `GET /v1/runs/{run_id}/checkpoints/{id}`: the state at that version.
pub fn checkpoint(state: &RunState, version: i64) -> Value {
    let mut map = common(state);
    map.insert(
        "checkpoint_id".into(),
        ids::checkpoint_id(&state.run_id, version).into(),
    );
    map.insert(
        "state".into(),
        serde_json::to_value(state).unwrap_or(Value::Null),
    );
    Value::Object(map)
}

pub fn event(event: &Event) -> Value {
    serde_json::to_value(event).unwrap_or(Value::Null)
}
