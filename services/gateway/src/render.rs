//! The JSON the API shows for runs, checkpoints and events.

use serde_json::{json, Value};
use sortie_core::state::Interrupt;
use sortie_core::{ids, Event, EventBody, RunState};

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
        "members_only": i.members_only,
        "context": i.context,
        "quorum": i.quorum,
        "approvals": i.approvals,
        "expires_at": i.expires_at,
        "status": i.status,
    })
}

/// A wait for a signal, as a reader sees it: its node, signal, status, deadline and
/// what it took so far.
fn wait(state: &RunState, w: &sortie_core::state::Wait) -> Value {
    json!({
        // A conversation's wait for the next message: the answer it follows is a step.
        "conversation": state.is_turn_wait(w),
        "step_id": w.step_id,
        "node": w.node,
        "signal": w.signal,
        "many": w.many,
        "wanted": w.wanted,
        "expires_at": w.expires_at,
        "status": w.status,
        "timed_out": w.timed_out,
        "received": w.received,
    })
}

/// The child runs a run started (its `run:` steps): step, node, the child's run id (the
/// current attempt's) and the step's status.
fn children(state: &RunState) -> Vec<Value> {
    state
        .steps
        .values()
        .filter(|s| s.tool == sortie_core::child::CHILD_TOOL)
        .map(|s| {
            json!({
                "step_id": s.step_id,
                "node": s.node,
                "run_id": sortie_core::child::child_run_id(&state.tenant, &state.run_id, &s.operation_id, s.attempt),
                "attempt": s.attempt,
                "status": s.status,
            })
        })
        .collect()
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
        "waits": state.waits.values().map(|w| wait(state, w)).collect::<Vec<_>>(),
        "parent": state.parent,
        "children": children(state),
        "open_waits": state.open_waits().map(|w| w.signal.as_str()).collect::<Vec<_>>(),
        "created_at": state.created_at,
        "updated_at": state.updated_at,
        "started_by": state.started_by,
        "labels": state.labels,
        "input": state.input,
        "output": state.output,
        "ending": state.ending,
        "budget": state.budget,
        "spend": state.spend,
        "forked_from": state.forked_from,
        "forgotten": state.forgotten,
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
        "forgotten": state.forgotten.is_some(),
    })
}

/// `GET /v1/runs/{run_id}/checkpoints/{id}`: the state at that version, with
/// `nodes_completed` at that version and `created_at`, when the checkpoint was made (the
/// time of its version's last event, RFC 3339). The run's own creation time (epoch ms,
/// `created_at` elsewhere) is `run_created_at` here.
pub fn checkpoint(state: &RunState, version: i64) -> Value {
    let mut map = common(state);
    map.insert(
        "checkpoint_id".into(),
        ids::checkpoint_id(&state.run_id, version).into(),
    );
    map.insert("run_created_at".into(), state.created_at.into());
    map.insert("created_at".into(), rfc3339(state.updated_at).into());
    map.insert(
        "state".into(),
        serde_json::to_value(state).unwrap_or(Value::Null),
    );
    Value::Object(map)
}

/// An event as recorded, plus the seed API's `ts` (RFC 3339 of `at`), `node` (the step's
/// node when the event concerns a step, else null) and `type` (the kind in snake_case).
/// Additive: every recorded field is still there.
pub fn event(event: &Event) -> Value {
    let mut value = serde_json::to_value(event).unwrap_or(Value::Null);
    if let Value::Object(map) = &mut value {
        map.insert("ts".into(), rfc3339(event.at).into());
        map.insert("node".into(), event_node(&event.body).into());
        map.insert("type".into(), snake_case(event.body.name()).into());
    }
    value
}

/// The node of the step an event concerns. Step ids are `<node>#<n>` (node ids never
/// hold a `#`).
fn event_node(body: &EventBody) -> Option<String> {
    match body {
        EventBody::StepDispatched { node, .. } | EventBody::Interrupted { node, .. } => {
            Some(node.clone())
        }
        EventBody::StepStarted { step_id, .. }
        | EventBody::StepSucceeded { step_id, .. }
        | EventBody::StepFailed { step_id, .. }
        | EventBody::StepOutcomeUnknown { step_id, .. }
        | EventBody::OperationReconciled { step_id, .. } => step_id
            .rsplit_once('#')
            .map_or(step_id.as_str(), |(node, _)| node)
            .to_owned()
            .into(),
        _ => None,
    }
}

/// `StepOutcomeUnknown` → `step_outcome_unknown`.
fn snake_case(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 4);
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// Epoch milliseconds as RFC 3339 in UTC, e.g. `2026-11-30T17:22:09.123Z`.
pub fn rfc3339(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let millis = ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_796_059_329_123), "2026-11-30T17:22:09.123Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(-1), "1969-12-31T23:59:59.999Z");
    }

    #[test]
    fn kinds_are_snake_case_and_steps_name_their_node() {
        assert_eq!(snake_case("StepOutcomeUnknown"), "step_outcome_unknown");
        assert_eq!(snake_case("RunStarted"), "run_started");
        let started = EventBody::StepStarted {
            step_id: "pay-now#12".into(),
            attempt: 1,
        };
        assert_eq!(event_node(&started).as_deref(), Some("pay-now"));
        let cancel = EventBody::CancelRequested {
            requested_by: "a".into(),
            reason: None,
        };
        assert_eq!(event_node(&cancel), None);
    }
}
