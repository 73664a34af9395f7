//! The run lifecycle and its legal transitions, in one place.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum RunStatus {
    /// Steps are being dispatched or are in flight.
    Running,
    /// At least one interrupt awaits a human decision; no process waits.
    WaitingApproval,
    /// An operation's outcome is unknown and its class forbids a blind retry: an operator
    /// must record what happened (`ReconcileOperation`). Also a run that is winding down
    /// (its `ending` is set) while it waits for such an outcome; once recorded, it goes
    /// back to `Cancelling` or `Compensating`.
    NeedsReconciliation,
    /// Cancel requested: no new dispatches; waiting for in-flight outcomes, then compensating.
    Cancelling,
    /// A terminal failure happened: waiting for in-flight outcomes and running compensations.
    Compensating,
    Succeeded,
    Failed,
    Cancelled,
    /// Nothing is in flight and the run waits for an outside signal (`wait:`).
    WaitingSignal,
}

impl RunStatus {
    /// Every status, in the order a person reads them.
    pub const ALL: [RunStatus; 9] = [
        RunStatus::Running,
        RunStatus::WaitingApproval,
        RunStatus::WaitingSignal,
        RunStatus::NeedsReconciliation,
        RunStatus::Cancelling,
        RunStatus::Compensating,
        RunStatus::Succeeded,
        RunStatus::Failed,
        RunStatus::Cancelled,
    ];

    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RunStatus::Succeeded | RunStatus::Failed | RunStatus::Cancelled
        )
    }

    /// Whether the run is winding down (no new forward progress, only compensations).
    pub fn is_ending(self) -> bool {
        matches!(self, RunStatus::Cancelling | RunStatus::Compensating)
    }

    /// The legal transitions. Anything else is a defect in the fold.
    pub fn can_become(self, next: RunStatus) -> bool {
        use RunStatus::*;
        if self == next {
            return false;
        }
        match self {
            Running | WaitingApproval | NeedsReconciliation | WaitingSignal => true,
            // Winding down, a run may wait for an operator (and come back) but never
            // runs forward again.
            Cancelling => matches!(next, Cancelled | Failed | NeedsReconciliation),
            Compensating => matches!(next, Failed | Cancelling | Cancelled | NeedsReconciliation),
            Succeeded | Failed | Cancelled => false,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Running => "running",
            RunStatus::WaitingApproval => "waiting_approval",
            RunStatus::NeedsReconciliation => "needs_reconciliation",
            RunStatus::Cancelling => "cancelling",
            RunStatus::Compensating => "compensating",
            RunStatus::Succeeded => "succeeded",
            RunStatus::Failed => "failed",
            RunStatus::Cancelled => "cancelled",
            RunStatus::WaitingSignal => "waiting_signal",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RunStatus::*;

    #[test]
    fn terminal_states_are_final() {
        for terminal in [Succeeded, Failed, Cancelled] {
            for next in [
                Running,
                WaitingApproval,
                NeedsReconciliation,
                Cancelling,
                Compensating,
                Succeeded,
                Failed,
                Cancelled,
                WaitingSignal,
            ] {
                assert!(!terminal.can_become(next), "{terminal:?} -> {next:?}");
            }
        }
        assert!(Cancelling.can_become(Cancelled));
        assert!(!Cancelling.can_become(Running));
        assert!(Cancelling.can_become(NeedsReconciliation));
        assert!(Compensating.can_become(NeedsReconciliation));
        assert!(NeedsReconciliation.can_become(Cancelling));
        assert!(Running.can_become(Succeeded));
    }
}
