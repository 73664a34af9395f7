//! A run's history. Every state change is an event; [`crate::evolve`] folds them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{graph::SideEffect, json, status::RunStatus};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub tenant: String,
    pub run_id: String,
    /// 1-based, gap-free per run. 0 for the answer to a command about a run that does not exist.
    pub seq: i64,
    /// The state version this event belongs to (one version per applied input).
    pub state_version: i64,
    pub at: i64,
    pub command_id: Option<String>,
    pub operation_id: Option<String>,
    pub prev_hash: Option<String>,
    pub hash: Option<String>,
    pub body: EventBody,
}

impl Event {
    /// This event as a view shows it once its run was forgotten: every payload and free
    /// text (comment, error message, reason) it carried dropped, as [`crate::RunState::forget`] drops them from the state. The
    /// hashes stay those of the event as written (the history in Kafka is unchanged, and
    /// `audit replay --verify` checks that history, not a view).
    pub fn forget(&mut self) {
        match &mut self.body {
            EventBody::RunStarted { input, .. } => *input = Value::Null,
            EventBody::StepDispatched { args, .. } => *args = Value::Null,
            EventBody::StepSucceeded { output, .. } => *output = Value::Null,
            EventBody::StepFailed { message, .. } => message.clear(),
            EventBody::StepOutcomeUnknown { message, .. } => message.clear(),
            EventBody::OperationReconciled { output, error, .. } => {
                *output = None;
                *error = None;
            }
            EventBody::Interrupted {
                proposal, context, ..
            } => {
                *proposal = Value::Null;
                *context = None;
            }
            EventBody::InterruptDecided {
                payload,
                edited_args,
                comment,
                ..
            }
            | EventBody::DecisionBuffered {
                payload,
                edited_args,
                comment,
                ..
            } => {
                *payload = None;
                *edited_args = None;
                *comment = None;
            }
            EventBody::RunStatusChanged { output, reason, .. } => {
                *output = None;
                *reason = None;
            }
            EventBody::CancelRequested { reason, .. } => *reason = None,
            EventBody::SignalReceived { payload, .. }
            | EventBody::SignalBuffered { payload, .. } => *payload = Value::Null,
            EventBody::SignalWaitOpened { .. }
            | EventBody::SignalWaitExpired { .. }
            | EventBody::BudgetReserved { .. }
            | EventBody::BudgetSettled { .. } => {}
            EventBody::CommandAccepted { .. }
            | EventBody::CommandRejected { .. }
            | EventBody::StepStarted { .. }
            | EventBody::InterruptEscalated { .. }
            | EventBody::InterruptExpired { .. }
            | EventBody::RunForgotten { .. } => {}
        }
    }

    /// The hash chaining this event to the previous one: SHA-256 over the previous hash and
    /// the canonical JSON of everything else in the event.
    pub fn compute_hash(&self) -> String {
        let content = serde_json::json!({
            "tenant": self.tenant,
            "run_id": self.run_id,
            "seq": self.seq,
            "state_version": self.state_version,
            "at": self.at,
            "command_id": self.command_id,
            "operation_id": self.operation_id,
            "body": self.body,
        });
        json::sha256_hex_of(self.prev_hash.as_deref().unwrap_or(""), &content)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum EventBody {
    CommandAccepted {
        command_id: String,
        command: String,
        duplicate: bool,
    },
    CommandRejected {
        command_id: String,
        command: String,
        code: String,
        reason: String,
    },
    RunStarted {
        graph_id: String,
        graph_version: u32,
        input: Value,
        started_by: String,
        labels: BTreeMap<String, String>,
        deadline_at: Option<i64>,
        /// The run's spend limits and price table (`None`: no limits, no prices).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        budget: Option<crate::budget::Budget>,
        /// For a fork: `{run_id, version}` of the source, and what the new run carries
        /// over from it (`steps`, `completed`, `interrupts`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        forked_from: Option<Value>,
        /// The rules `evolve` folds this run's derived state with
        /// ([`crate::budget::RULES`]); 0 (absent) in histories written before it existed,
        /// which keep the rules they were written under.
        #[serde(default, skip_serializing_if = "is_zero")]
        rules: u32,
        /// A child run's parent ([`crate::child`]); its end is reported to it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parent: Option<crate::child::ParentLink>,
    },
    StepDispatched {
        step_id: String,
        node: String,
        attempt: u32,
        tool: String,
        queue: String,
        side_effect: SideEffect,
        args: Value,
        role: StepRole,
        timeout_at: Option<i64>,
        /// This attempt only asks a `reconcilable` receiver what became of the operation
        /// and never calls it: the attempt before it timed out while the run was winding
        /// down, when a call would be new work the cancel or failure forbids. Absent
        /// (false) in older histories.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        lookup_only: bool,
    },
    StepStarted {
        step_id: String,
        attempt: u32,
    },
    StepSucceeded {
        step_id: String,
        attempt: u32,
        output: Value,
    },
    StepFailed {
        step_id: String,
        attempt: u32,
        code: String,
        message: String,
        retryable: bool,
        retry_at: Option<i64>,
    },
    StepOutcomeUnknown {
        step_id: String,
        attempt: u32,
        message: String,
        needs_operator: bool,
    },
    OperationReconciled {
        step_id: String,
        succeeded: bool,
        output: Option<Value>,
        error: Option<String>,
        by: String,
    },
    Interrupted {
        interrupt_id: String,
        step_id: String,
        node: String,
        proposal: Value,
        proposal_hash: String,
        reason: String,
        required_role: Option<String>,
        approver_group: Option<String>,
        quorum: u32,
        expires_at: Option<i64>,
        role: StepRole,
        /// What an approver needs to judge the proposal: `rationale` (the model message
        /// that proposed the call, when an llm step requested it), `affects` (node, tool,
        /// side-effect class, args, and `edited_from`/`diff` when it replaces an edited
        /// proposal) and `on_reject` (what a rejection does). Absent in older histories.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        context: Option<Value>,
        /// Only members of `approver_group` may decide (false in older histories, where
        /// the group was a label).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        members_only: bool,
    },
    InterruptDecided {
        interrupt_id: String,
        proposal_hash: String,
        approve: bool,
        decided_by: String,
        /// The human's input, delivered to the node (`$interrupt.payload`). In histories
        /// written before `edited_args` existed it held the edited arguments.
        payload: Option<Value>,
        comment: Option<String>,
        is_final: bool,
        /// Arguments the approver edited, replacing the proposal's.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        edited_args: Option<Value>,
    },
    InterruptEscalated {
        interrupt_id: String,
        approver_group: String,
        expires_at: i64,
    },
    InterruptExpired {
        interrupt_id: String,
        on_timeout: String,
    },
    CancelRequested {
        requested_by: String,
        reason: Option<String>,
    },
    RunStatusChanged {
        status: RunStatus,
        reason: Option<String>,
        output: Option<Value>,
        /// On a terminal status of a graph with a `retention`: when the run's payloads
        /// are forgotten (`RunForgotten`). Absent: kept.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        forget_at: Option<i64>,
    },
    /// The run's retention passed: its payloads (input, arguments, outputs, proposals,
    /// decision payloads, errors, output) are dropped from its state, which is from now
    /// on its audit summary: who started it, what, when, the outcome, every step's
    /// status and operation id, and the hash chain's head over its whole history.
    RunForgotten {
        reason: String,
    },
    /// A decision named an interrupt that is not registered yet: it waits in the run's
    /// state and is applied (and answered) when the interrupt is registered.
    DecisionBuffered {
        interrupt_id: String,
        proposal_hash: String,
        approve: bool,
        decided_by: String,
        roles: Vec<String>,
        payload: Option<Value>,
        comment: Option<String>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        groups: Vec<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        edited_args: Option<Value>,
    },
    /// A node began to wait for an outside signal (`wait:`); its deadline is armed.
    SignalWaitOpened {
        step_id: String,
        node: String,
        signal: String,
        /// Several signals (a list) rather than one.
        many: bool,
        /// How many signals end the wait.
        wanted: u32,
        expires_at: Option<i64>,
    },
    /// A wait took a signal (the command that carried it is the event's `command_id`).
    /// The wait is done once it took `wanted` signals.
    SignalReceived {
        step_id: String,
        signal: String,
        signal_id: String,
        payload: Value,
        sent_by: String,
    },
    /// A signal arrived before its wait opened: it is kept in the run's state and taken
    /// when the wait opens (its command is answered now: accepted).
    SignalBuffered {
        signal: String,
        signal_id: String,
        payload: Value,
        sent_by: String,
    },
    /// A wait's deadline passed: `on_timeout` is `fail`, `continue` (the wait is done
    /// with what arrived) or `goto` (the node's substitute runs).
    SignalWaitExpired {
        step_id: String,
        on_timeout: String,
    },
    /// A child run's share of the run's budget was set aside as step `step_id` started
    /// it: what the run may still spend (and give its other children) excludes it until
    /// the child ends. The child was started with `limits` as its budget.
    BudgetReserved {
        step_id: String,
        child_run_id: String,
        limits: crate::budget::Limits,
    },
    /// The child run of step `step_id` ended: its reservation is released and what it
    /// spent (its children's spend included) is charged to this run.
    BudgetSettled {
        step_id: String,
        spent: crate::budget::Spend,
    },
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Why a step exists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StepRole {
    /// A node of the graph, reached by its edges.
    Node,
    /// Asked for by an agent step's `next_steps`.
    Requested { by: String },
    /// Undoes a completed step.
    Compensation { of: String },
    /// Runs in place of a node whose approval was rejected (`on_reject: goto`).
    Substitute { for_node: String },
    /// Checks the business state again after the approval of step `of`, before its call.
    Precheck { of: String },
}

impl EventBody {
    pub fn name(&self) -> &'static str {
        match self {
            EventBody::CommandAccepted { .. } => "CommandAccepted",
            EventBody::CommandRejected { .. } => "CommandRejected",
            EventBody::RunStarted { .. } => "RunStarted",
            EventBody::StepDispatched { .. } => "StepDispatched",
            EventBody::StepStarted { .. } => "StepStarted",
            EventBody::StepSucceeded { .. } => "StepSucceeded",
            EventBody::StepFailed { .. } => "StepFailed",
            EventBody::StepOutcomeUnknown { .. } => "StepOutcomeUnknown",
            EventBody::OperationReconciled { .. } => "OperationReconciled",
            EventBody::Interrupted { .. } => "Interrupted",
            EventBody::InterruptDecided { .. } => "InterruptDecided",
            EventBody::InterruptEscalated { .. } => "InterruptEscalated",
            EventBody::InterruptExpired { .. } => "InterruptExpired",
            EventBody::CancelRequested { .. } => "CancelRequested",
            EventBody::RunStatusChanged { .. } => "RunStatusChanged",
            EventBody::RunForgotten { .. } => "RunForgotten",
            EventBody::DecisionBuffered { .. } => "DecisionBuffered",
            EventBody::SignalWaitOpened { .. } => "SignalWaitOpened",
            EventBody::SignalReceived { .. } => "SignalReceived",
            EventBody::SignalBuffered { .. } => "SignalBuffered",
            EventBody::SignalWaitExpired { .. } => "SignalWaitExpired",
            EventBody::BudgetReserved { .. } => "BudgetReserved",
            EventBody::BudgetSettled { .. } => "BudgetSettled",
        }
    }
}
