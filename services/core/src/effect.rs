//! What the fold asks its driver to do, as data.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{event::Event, graph::SideEffect};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Effect {
    /// Append to the run's history (`sortie.run-events`).
    Emit(Event),
    /// Publish an intent to `sortie.intents.<queue>`.
    Dispatch(Intent),
    /// A command for another run (a child's start or cancel), produced in this input's
    /// transaction to that run's partition of the commands topic ([`crate::child`]).
    Command(crate::input::Command),
    /// A report to a parent run's step: this child run ended ([`crate::child`]), produced
    /// to the parent's partition of the step results, as an executor would.
    Report(crate::input::StepReport),
    /// Index a timer by due time (the timer itself lives in the run state).
    ArmTimer {
        run_id: String,
        timer: TimerKey,
        due_at: i64,
    },
    /// Forget a timer.
    DisarmTimer { run_id: String, timer: TimerKey },
    /// Write the run's new state, [`crate::Applied::state`] (`sortie.run-state`). The
    /// effect carries no copy: the reducer writes the one it already holds.
    WriteState,
    /// The run was forgotten (its retention passed): remove what else holds its
    /// payloads — a tombstone for each operation's record in `sortie.step-results`.
    Forget {
        run_id: String,
        operations: Vec<String>,
    },
}

/// "Perform operation X, attempt N."
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Intent {
    pub operation_id: String,
    pub attempt: u32,
    pub tenant: String,
    pub run_id: String,
    pub step_id: String,
    pub node: String,
    pub graph_id: String,
    pub graph_version: u32,
    pub tool: String,
    pub queue: String,
    pub side_effect: SideEffect,
    pub args: Value,
    pub config: Value,
    pub timeout_ms: Option<i64>,
    pub issued_at: i64,
    /// Ask the receiver what became of the operation; never call it (see
    /// [`crate::EventBody::StepDispatched`]'s `lookup_only`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lookup_only: bool,
}

/// A timer's identity inside its run.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum TimerKey {
    /// The attempt of the step has not reported in time.
    StepTimeout { step_id: String, attempt: u32 },
    /// The next attempt of the step is due.
    Retry { step_id: String, attempt: u32 },
    /// The interrupt's decision window closes.
    ApprovalExpiry { interrupt_id: String, round: u32 },
    /// The run's wall-clock cap.
    RunDeadline,
    /// A finished run's retention ends: its payloads are forgotten.
    Retention,
    /// A signal wait's deadline (`wait.timeout`).
    SignalWait { step_id: String },
}

impl TimerKey {
    /// A stable string form, used as a sled key suffix.
    pub fn encode(&self) -> String {
        match self {
            TimerKey::StepTimeout { step_id, attempt } => format!("timeout/{step_id}/{attempt}"),
            TimerKey::Retry { step_id, attempt } => format!("retry/{step_id}/{attempt}"),
            TimerKey::ApprovalExpiry {
                interrupt_id,
                round,
            } => format!("expiry/{interrupt_id}/{round}"),
            TimerKey::RunDeadline => "deadline".to_owned(),
            TimerKey::Retention => "retention".to_owned(),
            TimerKey::SignalWait { step_id } => format!("wait/{step_id}/0"),
        }
    }

    pub fn decode(text: &str) -> Option<TimerKey> {
        let mut parts = text.splitn(3, '/');
        let kind = parts.next()?;
        match kind {
            "deadline" => return Some(TimerKey::RunDeadline),
            "retention" => return Some(TimerKey::Retention),
            _ => {}
        }
        let id = parts.next()?.to_owned();
        let n: u32 = parts.next()?.parse().ok()?;
        Some(match kind {
            "timeout" => TimerKey::StepTimeout {
                step_id: id,
                attempt: n,
            },
            "retry" => TimerKey::Retry {
                step_id: id,
                attempt: n,
            },
            "expiry" => TimerKey::ApprovalExpiry {
                interrupt_id: id,
                round: n,
            },
            "wait" if n == 0 => TimerKey::SignalWait { step_id: id },
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::TimerKey;

    #[test]
    fn timer_keys_round_trip() {
        for key in [
            TimerKey::StepTimeout {
                step_id: "a#1".into(),
                attempt: 2,
            },
            TimerKey::Retry {
                step_id: "b#3".into(),
                attempt: 1,
            },
            TimerKey::ApprovalExpiry {
                interrupt_id: "int_x".into(),
                round: 0,
            },
            TimerKey::RunDeadline,
            TimerKey::Retention,
            TimerKey::SignalWait {
                step_id: "laptop#1".into(),
            },
        ] {
            assert_eq!(TimerKey::decode(&key.encode()), Some(key));
        }
    }
}
