//! The edge between the typed core and the wire: Avro records ↔ `sortie-core` types,
//! once, here. JSON payloads travel as canonical JSON strings.
//!
//! Commands and step results come in through `inbound` (and go out to other runs through
//! `outbound`), events map both ways in `event`; [`Invalid`], the checks they share
//! (payloads, ids, texts, budgets), statuses, intents and states are here.

use serde_json::Value;
use sortie_core::{graph::SideEffect, input::Command, Intent, RunState, RunStatus};
use sortie_wire::records as w;

mod event;
mod inbound;
mod outbound;
pub use event::{event_from_wire, event_to_wire};
pub use inbound::{command_from_wire, report_from_wire};
pub use outbound::{command_to_wire, report_to_wire};

/// A record that decoded but cannot be applied (a payload that is not JSON, a negative
/// attempt, ...): dead-lettered with reason code `invalid`. When only a payload of a
/// command broke the shape rule (`sortie_core::limits::check_shape`) and everything else
/// about it holds, [`Invalid::answerable`] is that command with its payloads left out:
/// the reducer answers it (`limit_exceeded`) instead of dead-lettering it, as the gateway
/// answers a request.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String, pub Option<Box<Command>>);

impl Invalid {
    pub fn new(reason: impl Into<String>) -> Invalid {
        Invalid(reason.into(), None)
    }

    /// The command to answer instead of dead-lettering, if it may be answered.
    pub fn answerable(&self) -> Option<&Command> {
        self.1.as_deref()
    }
}

fn json(field: &str, text: &str) -> Result<Value, Invalid> {
    serde_json::from_str(text).map_err(|e| Invalid::new(format!("{field} is not JSON: {e}")))
}

/// A payload: JSON of the shape every payload has ([`sortie_core::limits::check_shape`]).
fn payload(field: &str, text: &str) -> Result<Value, Invalid> {
    let mut breach = None;
    let value = payload_or_null(field, text, &mut breach)?;
    match breach {
        Some(reason) => Err(Invalid::new(reason)),
        None => Ok(value),
    }
}

fn payload_opt(field: &str, text: &Option<String>) -> Result<Option<Value>, Invalid> {
    text.as_deref().map(|t| payload(field, t)).transpose()
}

/// A command's payload: JSON (or the command is invalid), and of the payload shape — if
/// not, `Null` in its place and the first breach noted in `breach` (the command is then
/// answered, not applied: see [`Invalid::answerable`]).
fn payload_or_null(field: &str, text: &str, breach: &mut Option<String>) -> Result<Value, Invalid> {
    let value = json(field, text)?;
    match sortie_core::limits::check_shape(field, &value) {
        Ok(()) => Ok(value),
        Err(e) => {
            breach.get_or_insert_with(|| format!("{e} (limit {})", e.limit.name()));
            Ok(Value::Null)
        }
    }
}

fn payload_or_null_opt(
    field: &str,
    text: &Option<String>,
    breach: &mut Option<String>,
) -> Result<Option<Value>, Invalid> {
    text.as_deref()
        .map(|t| payload_or_null(field, t, breach))
        .transpose()
}

fn json_opt(field: &str, text: &Option<String>) -> Result<Option<Value>, Invalid> {
    text.as_deref().map(|t| json(field, t)).transpose()
}

/// Free text a client wrote, at most [`sortie_core::limits::MAX_TEXT_BYTES`].
fn client_text(field: &str, text: &Option<String>) -> Result<(), Invalid> {
    match text {
        Some(text) => {
            sortie_core::limits::check_text(field, text, sortie_core::limits::MAX_TEXT_BYTES)
                .map_err(Invalid::new)
        }
        None => Ok(()),
    }
}

/// An executor's wording, cut to [`sortie_core::limits::MAX_TEXT_BYTES`] (deterministic:
/// a replay cuts the same bytes the same way).
fn clipped(text: String, max: usize) -> String {
    match text.len() <= max {
        true => text,
        false => sortie_core::limits::clip(&text, max).to_owned(),
    }
}

fn text(value: &Value) -> String {
    sortie_core::json::canonical(value)
}

/// Ids must fit everywhere they go (Kafka keys, sled keys, URLs): see
/// [`sortie_core::limits::check_id`].
fn id(field: &str, value: &str) -> Result<(), Invalid> {
    sortie_core::limits::check_id(field, value).map_err(Invalid::new)
}

/// A budget's JSON text on the wire.
pub fn budget_text(budget: &sortie_core::budget::Budget) -> String {
    serde_json::to_string(budget).unwrap_or_default()
}

/// A `StartRun`'s budget, held to [`sortie_core::budget::Budget::check`]: limits and
/// prices finite, not negative and under their maximum. The gateway asks the same.
pub fn budget_of(text: &Option<String>) -> Result<Option<sortie_core::budget::Budget>, Invalid> {
    let budget = recorded_budget_of(text)?;
    if let Some(problem) = budget.as_ref().and_then(|b| b.check().err()) {
        return Err(Invalid::new(format!("budget: {problem}")));
    }
    Ok(budget)
}

/// The budget a `RunStarted` recorded, as it was recorded: a history is read back whatever
/// rule held when it was written (a run started before [`budget_of`] checked limits still
/// folds to its state).
fn recorded_budget_of(
    text: &Option<String>,
) -> Result<Option<sortie_core::budget::Budget>, Invalid> {
    text.as_deref()
        .map(|t| {
            serde_json::from_str(t)
                .map_err(|e| Invalid::new(format!("budget is not a budget: {e}")))
        })
        .transpose()
}
/// An approval (`true`) or a rejection on the wire.
pub(crate) fn decision_to_wire(approve: bool) -> w::Decision {
    if approve {
        w::Decision::Approve
    } else {
        w::Decision::Reject
    }
}

pub fn side_effect_to_wire(side_effect: SideEffect) -> w::SideEffectClass {
    match side_effect {
        SideEffect::Pure => w::SideEffectClass::Pure,
        SideEffect::Idempotent => w::SideEffectClass::Idempotent,
        SideEffect::Keyed => w::SideEffectClass::Keyed,
        SideEffect::Reconcilable => w::SideEffectClass::Reconcilable,
        SideEffect::Unsafe => w::SideEffectClass::Unsafe,
    }
}

pub fn side_effect_from_wire(side_effect: w::SideEffectClass) -> SideEffect {
    match side_effect {
        w::SideEffectClass::Pure => SideEffect::Pure,
        w::SideEffectClass::Idempotent => SideEffect::Idempotent,
        w::SideEffectClass::Keyed => SideEffect::Keyed,
        w::SideEffectClass::Reconcilable => SideEffect::Reconcilable,
        w::SideEffectClass::Unsafe => SideEffect::Unsafe,
    }
}

pub fn status_to_wire(status: RunStatus) -> w::RunStatus {
    match status {
        RunStatus::Running => w::RunStatus::Running,
        RunStatus::WaitingApproval => w::RunStatus::WaitingApproval,
        RunStatus::NeedsReconciliation => w::RunStatus::NeedsReconciliation,
        RunStatus::Cancelling => w::RunStatus::Cancelling,
        RunStatus::Compensating => w::RunStatus::Compensating,
        RunStatus::Succeeded => w::RunStatus::Succeeded,
        RunStatus::Failed => w::RunStatus::Failed,
        RunStatus::Cancelled => w::RunStatus::Cancelled,
        RunStatus::WaitingSignal => w::RunStatus::WaitingSignal,
    }
}

pub fn status_from_wire(status: w::RunStatus) -> RunStatus {
    match status {
        w::RunStatus::Running => RunStatus::Running,
        w::RunStatus::WaitingApproval => RunStatus::WaitingApproval,
        w::RunStatus::NeedsReconciliation => RunStatus::NeedsReconciliation,
        w::RunStatus::Cancelling => RunStatus::Cancelling,
        w::RunStatus::Compensating => RunStatus::Compensating,
        w::RunStatus::Succeeded => RunStatus::Succeeded,
        w::RunStatus::Failed => RunStatus::Failed,
        w::RunStatus::Cancelled => RunStatus::Cancelled,
        w::RunStatus::WaitingSignal => RunStatus::WaitingSignal,
    }
}
pub fn intent_to_wire(intent: &Intent) -> w::StepIntent {
    w::StepIntent {
        operation_id: intent.operation_id.clone(),
        attempt: intent.attempt as i32,
        tenant: intent.tenant.clone(),
        run_id: intent.run_id.clone(),
        step_id: intent.step_id.clone(),
        node: intent.node.clone(),
        graph_id: intent.graph_id.clone(),
        graph_version: intent.graph_version as i32,
        tool: intent.tool.clone(),
        queue: intent.queue.clone(),
        side_effect: side_effect_to_wire(intent.side_effect),
        args: text(&intent.args),
        config: text(&intent.config),
        timeout_ms: intent.timeout_ms,
        issued_at: intent.issued_at,
        lookup_only: intent.lookup_only,
    }
}

/// The changelog record: structured header fields for dashboards, the full fold state as JSON.
pub fn state_to_wire(state: &RunState) -> w::RunState {
    state_to_wire_json(state, serde_json::to_string(state).unwrap_or_default())
}

/// [`state_to_wire`] with the state's JSON already made (the reducer serialises each state
/// once per commit and stores the same bytes in its cache).
pub fn state_to_wire_json(state: &RunState, json: String) -> w::RunState {
    w::RunState {
        tenant: state.tenant.clone(),
        run_id: state.run_id.clone(),
        graph_id: state.graph_id.clone(),
        graph_version: state.graph_version as i32,
        status: status_to_wire(state.status),
        version: state.version,
        last_event_seq: state.last_event_seq,
        created_at: state.created_at,
        updated_at: state.updated_at,
        labels: state.labels.clone(),
        state: json,
    }
}

pub fn state_from_wire(record: &w::RunState) -> Result<RunState, Invalid> {
    serde_json::from_str(&record.state).map_err(|e| {
        Invalid::new(format!(
            "run-state of {} does not decode: {e}",
            record.run_id
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    fn start_with_budget(budget: &str) -> w::RunCommand {
        w::RunCommand {
            command_id: "c1".into(),
            tenant: "t".into(),
            run_id: "r".into(),
            issuer: w::Issuer {
                principal: "svc".into(),
                roles: vec![],
                groups: vec![],
            },
            issued_at: 0,
            body: w::CommandBody::StartRun(w::StartRun {
                graph_id: "g".into(),
                graph_version: None,
                input: "{}".into(),
                labels: Default::default(),
                budget: Some(budget.into()),
                fork: None,
                parent: None,
            }),
        }
    }

    /// A StartRun's budget is held to `Budget::check` where it enters; a recorded
    /// `RunStarted` with the same budget still reads back (history is read as written).
    /// Seen red: with `budget_of` not calling `check`, every bad budget below decoded.
    #[test]
    fn a_start_with_an_unbounded_budget_is_refused_but_history_reads_back() {
        for bad in [
            r#"{"limits": {"cost_usd": -1.0}}"#,
            r#"{"limits": {"tokens": 1000000000000000}}"#,
            r#"{"limits": {"wall_time": 1000000000000000}}"#,
            r#"{"limits": {"tool_calls": 18446744073709551615}}"#,
            r#"{"prices": {"m": {"input_per_1k": -2.0, "output_per_1k": 1.0}}}"#,
            r#"{"limits": {"cost_usd": 1e300}}"#,
        ] {
            let refused = command_from_wire(start_with_budget(bad));
            assert!(
                refused.as_ref().is_err_and(|e| e.0.starts_with("budget:")),
                "{bad}: {refused:?}"
            );
            let recorded = w::RunEvent {
                tenant: "t".into(),
                run_id: "r".into(),
                seq: 1,
                state_version: 1,
                at: 0,
                command_id: None,
                operation_id: None,
                prev_hash: None,
                hash: None,
                body: w::EventBody::RunStarted(w::RunStarted {
                    graph_id: "g".into(),
                    graph_version: 1,
                    input: "{}".into(),
                    started_by: "svc".into(),
                    labels: Default::default(),
                    deadline_at: None,
                    budget: Some(bad.into()),
                    forked_from: None,
                    rules: 0,
                    parent: None,
                }),
            };
            assert!(event_from_wire(recorded).is_ok(), "{bad}");
        }
        let good = r#"{"limits": {"cost_usd": 5.0, "tokens": 100000}, "prices": {"m": {"input_per_1k": 0.5, "output_per_1k": 1.5}}}"#;
        assert!(command_from_wire(start_with_budget(good)).is_ok());
    }
}
