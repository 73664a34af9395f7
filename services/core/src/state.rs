//! A run's state: everything the fold knows about one run, built only from its events.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{effect::TimerKey, event::StepRole, graph::SideEffect, status::RunStatus};

mod written;
pub(crate) use written::eliding_steps;
pub use written::WrittenSteps;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    pub tenant: String,
    pub run_id: String,
    pub graph_id: String,
    pub graph_version: u32,
    pub status: RunStatus,
    /// Incremented once per applied input that changed the run.
    pub version: i64,
    pub last_event_seq: i64,
    pub last_hash: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
    pub started_by: String,
    pub labels: BTreeMap<String, String>,
    pub input: Value,
    pub deadline_at: Option<i64>,
    /// Each step behind an [`Arc`]: the fold copies the state it folds, and a step it does
    /// not touch is shared between the copies instead of copied (its payloads too);
    /// `Arc::make_mut` copies the one it changes. Written as derived, or by
    /// [`RunState::to_json_reusing`] with the JSON of unchanged steps copied.
    #[serde(serialize_with = "written::serialize")]
    pub steps: BTreeMap<String, Arc<Step>>,
    /// Step ids of succeeded steps in the order they succeeded (compensations run in reverse).
    pub completed: Vec<String>,
    pub interrupts: BTreeMap<String, Interrupt>,
    /// Armed timers: encoded [`TimerKey`] → due time.
    pub timers: BTreeMap<String, i64>,
    /// Every command applied to this run and its answer, so a duplicate gets the same answer.
    pub commands: BTreeMap<String, Answer>,
    /// Set when the run began winding down (cancel or terminal failure).
    pub ending: Option<Ending>,
    pub output: Option<Value>,
    /// Decisions that arrived before their interrupt was registered, oldest first.
    #[serde(default)]
    pub buffered: Vec<BufferedDecision>,
    /// Ids of the rejected commands still in `commands`, oldest first: only the last
    /// [`crate::limits::MAX_REJECTED_COMMANDS`] are kept, so a client that keeps sending
    /// bad commands cannot grow the run without bound.
    #[serde(default, skip_serializing_if = "VecDeque::is_empty")]
    pub rejected: VecDeque<String>,
    /// The run's spend limits and prices, raised by budget approvals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<crate::budget::Budget>,
    /// What the run has spent: model usage charged from recorded outputs, tool calls.
    #[serde(default, skip_serializing_if = "crate::budget::Spend::is_zero")]
    pub spend: crate::budget::Spend,
    /// The rules its derived state is folded with (`RunStarted.rules`; 0 in runs started
    /// before it existed).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rules: u32,
    /// Lineage of a forked run: `{run_id, version}` of the checkpoint it started from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<Value>,
    /// Set once the run's retention passed (`RunForgotten`): its payloads are gone and
    /// this state is its audit summary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forgotten: Option<Forgotten>,
    /// Waits for outside signals, by the step id of their node (absent in runs that
    /// never waited).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub waits: BTreeMap<String, Wait>,
    /// Signals that arrived before their wait opened, oldest first (bounded:
    /// [`crate::signal::MAX_EARLY_SIGNALS`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub early_signals: Vec<EarlySignal>,
    /// The budget set aside for child runs in flight, by the step that started each
    /// (`BudgetReserved`, released by `BudgetSettled`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub reserved: BTreeMap<String, crate::budget::Limits>,
    /// A child run's parent: its end is reported to the parent's step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<crate::child::ParentLink>,
}

/// A node's wait for an outside signal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Wait {
    pub step_id: String,
    pub node: String,
    pub signal: String,
    pub many: bool,
    /// How many signals end it.
    pub wanted: u32,
    pub expires_at: Option<i64>,
    pub status: WaitStatus,
    /// The signals taken, in the order they were taken.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub received: Vec<crate::signal::Received>,
    /// Ended by its deadline (`on_timeout: continue`, or the wait expired).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub timed_out: bool,
}

impl Wait {
    /// What the wait gives the nodes after it (see [`crate::signal::output`]).
    pub fn output(&self) -> Value {
        crate::signal::output(&self.signal, self.many, &self.received, self.timed_out)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WaitStatus {
    Open,
    /// Its signals arrived (or its deadline passed with `on_timeout: continue`).
    Done,
    /// Its deadline passed (`on_timeout: fail` or `goto`).
    Expired,
    /// Closed unanswered because the run began to wind down.
    Closed,
}

/// A signal kept for a wait that is not open yet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EarlySignal {
    pub command_id: String,
    pub signal: String,
    pub signal_id: String,
    pub payload: Value,
    pub sent_by: String,
    pub at: i64,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// When and why a run's payloads were forgotten.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Forgotten {
    pub at: i64,
    pub reason: String,
}

/// A decision waiting for its interrupt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BufferedDecision {
    pub command_id: String,
    pub interrupt_id: String,
    pub proposal_hash: String,
    pub approve: bool,
    pub principal: String,
    pub roles: Vec<String>,
    pub payload: Option<Value>,
    pub comment: Option<String>,
    pub at: i64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edited_args: Option<Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Step {
    pub step_id: String,
    pub node: String,
    pub operation_id: String,
    pub attempt: u32,
    pub tool: String,
    pub queue: String,
    pub side_effect: SideEffect,
    pub args: Value,
    pub role: StepRole,
    pub status: StepStatus,
    pub output: Option<Value>,
    pub error: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepStatus {
    /// An intent for the current attempt is out.
    InFlight,
    /// The executor recorded that it is calling the receiver (unsafe / reconcilable).
    Started,
    /// The last attempt failed transiently; the next one waits for its backoff timer.
    WaitingRetry,
    Succeeded,
    Failed,
    /// The outcome is unknown and an operator must record it.
    NeedsOperator,
    /// Never dispatched again because the run ended while it waited for a retry.
    Abandoned,
}

impl StepStatus {
    pub fn is_settled(self) -> bool {
        matches!(
            self,
            StepStatus::Succeeded | StepStatus::Failed | StepStatus::Abandoned
        )
    }

    /// An attempt is out and its result may still arrive.
    pub fn is_in_flight(self) -> bool {
        matches!(self, StepStatus::InFlight | StepStatus::Started)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Interrupt {
    pub interrupt_id: String,
    pub step_id: String,
    pub node: String,
    pub role: StepRole,
    pub proposal: Value,
    pub proposal_hash: String,
    pub reason: String,
    pub required_role: Option<String>,
    pub approver_group: Option<String>,
    pub quorum: u32,
    pub expires_at: Option<i64>,
    /// Escalation round: 0, then 1 after the first escalation, ...
    pub round: u32,
    /// Principals that approved so far.
    pub approvals: Vec<String>,
    pub status: InterruptStatus,
    /// See [`crate::EventBody::Interrupted`]: rationale, affects, on_reject.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<Value>,
    /// Only members of `approver_group` may decide.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub members_only: bool,
    /// The human input of the final decision (`$interrupt.payload`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<Value>,
    /// The arguments the final approval replaced the proposal's with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edited_args: Option<Value>,
}

/// Why a principal may not decide an open interrupt: the reducer's rejection code and reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: &'static str,
    pub reason: String,
}

impl Interrupt {
    /// The rule the reducer applies to a decision on this open interrupt once the proposal
    /// hash matched: not expired at `at`, the node's role held, a member of the approver
    /// group (the escalated one after an escalation) when the gate is members-only, one
    /// approval per principal. The gateway's inbox and resume route ask the same question,
    /// so they can say why someone may not decide.
    pub fn refusal(
        &self,
        principal: &str,
        roles: &[String],
        groups: &[String],
        approve: bool,
        at: i64,
    ) -> Option<Refusal> {
        if self.expires_at.is_some_and(|due| at >= due) {
            return Some(Refusal {
                code: "expired",
                reason: format!("interrupt {} expired", self.interrupt_id),
            });
        }
        if let Some(role) = &self.required_role {
            if !roles.iter().any(|r| r == role) {
                return Some(Refusal {
                    code: "forbidden",
                    reason: format!("deciding needs role {role:?}"),
                });
            }
        }
        if let (true, Some(group)) = (self.members_only, &self.approver_group) {
            if !groups.iter().any(|g| g == group) {
                return Some(Refusal {
                    code: "not_in_group",
                    reason: format!("deciding needs membership of group {group:?}"),
                });
            }
        }
        if approve && self.approvals.iter().any(|p| p == principal) {
            return Some(Refusal {
                code: "duplicate_approver",
                reason: format!("{principal} already approved"),
            });
        }
        None
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InterruptStatus {
    Open,
    Approved,
    Rejected,
    Expired,
    /// Superseded by a new proposal (an approver edited the arguments).
    Superseded,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Answer {
    Accepted,
    Rejected { code: String, reason: String },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ending {
    pub cancelled: bool,
    pub reason: String,
}

impl RunState {
    /// Drops every payload the run carried — its input and output, each step's
    /// arguments, output and error, each interrupt's proposal, context and decision
    /// payload, buffered decisions — and keeps its shape: ids, graph, who started it,
    /// labels, statuses, operation ids, timestamps, spend, command answers and the hash
    /// chain's head. What is left is the run's audit summary.
    pub fn forget(&mut self, at: i64, reason: &str) {
        self.input = Value::Null;
        self.output = None;
        for step in self.steps.values_mut() {
            let step = Arc::make_mut(step);
            step.args = Value::Null;
            step.output = None;
            step.error = None;
        }
        for interrupt in self.interrupts.values_mut() {
            interrupt.proposal = Value::Null;
            interrupt.context = None;
            interrupt.payload = None;
            interrupt.edited_args = None;
        }
        self.buffered.clear();
        for wait in self.waits.values_mut() {
            for signal in &mut wait.received {
                signal.payload = Value::Null;
            }
        }
        self.early_signals.clear();
        self.timers.clear();
        self.forgotten = Some(Forgotten {
            at,
            reason: reason.to_owned(),
        });
    }

    pub fn step_by_operation(&self, operation_id: &str) -> Option<&Step> {
        self.steps
            .values()
            .find(|s| s.operation_id == operation_id)
            .map(|s| &**s)
    }

    pub fn timer_due(&self, key: &TimerKey) -> Option<i64> {
        self.timers.get(&key.encode()).copied()
    }

    /// Whether a signal with this id was taken by a wait or is kept for one.
    pub fn has_signal(&self, signal_id: &str) -> bool {
        self.waits
            .values()
            .flat_map(|w| &w.received)
            .any(|r| r.signal_id == signal_id)
            || self.early_signals.iter().any(|e| e.signal_id == signal_id)
    }

    /// Whether `wait` is a conversation's wait for the next message (keyed by the step
    /// whose answer it follows) rather than a waiting node's (which has no step).
    pub fn is_turn_wait(&self, wait: &Wait) -> bool {
        self.steps.contains_key(&wait.step_id)
    }

    pub fn open_waits(&self) -> impl Iterator<Item = &Wait> {
        self.waits.values().filter(|w| w.status == WaitStatus::Open)
    }

    /// The next free step id for `node`: `<node>#<n>`.
    pub fn next_step_id(&self, node: &str) -> String {
        let taken = self
            .steps
            .keys()
            .chain(self.interrupts.values().map(|i| &i.step_id))
            .chain(self.waits.keys())
            .filter_map(|id| id.rsplit_once('#'))
            .filter(|(n, _)| *n == node)
            .filter_map(|(_, k)| k.parse::<u32>().ok())
            .max()
            .unwrap_or(0);
        format!("{node}#{}", taken + 1)
    }

    /// Steps started so far, compensations excluded (the graph's `max_steps` budget).
    pub fn steps_taken(&self) -> usize {
        self.steps
            .values()
            .filter(|s| !matches!(s.role, StepRole::Compensation { .. }))
            .count()
    }

    pub fn open_interrupts(&self) -> impl Iterator<Item = &Interrupt> {
        self.interrupts
            .values()
            .filter(|i| i.status == InterruptStatus::Open)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate() -> Interrupt {
        Interrupt {
            interrupt_id: "int_1".into(),
            step_id: "refund#1".into(),
            node: "refund".into(),
            role: StepRole::Node,
            proposal: serde_json::json!({"args": {"amount": 5}}),
            proposal_hash: "h".into(),
            reason: "money moves".into(),
            required_role: Some("approver".into()),
            approver_group: None,
            quorum: 2,
            expires_at: Some(1_000),
            round: 0,
            approvals: vec!["user:alice".into()],
            status: InterruptStatus::Open,
            context: None,
            members_only: false,
            payload: None,
            edited_args: None,
        }
    }

    #[test]
    fn refusals_name_expiry_then_role_then_a_second_approval() {
        let gate = gate();
        let approver = ["approver".to_owned()];
        let code = |principal: &str, roles: &[String], approve: bool, at: i64| {
            gate.refusal(principal, roles, &[], approve, at)
                .map(|r| r.code)
        };
        assert_eq!(code("user:bob", &approver, true, 999), None);
        assert_eq!(code("user:bob", &approver, true, 1_000), Some("expired"));
        assert_eq!(code("user:bob", &[], true, 1_000), Some("expired"));
        assert_eq!(code("user:bob", &[], true, 10), Some("forbidden"));
        assert_eq!(
            gate.refusal("user:bob", &[], &[], true, 10)
                .map(|r| r.reason),
            Some("deciding needs role \"approver\"".to_owned())
        );
        assert_eq!(
            code("user:alice", &approver, true, 10),
            Some("duplicate_approver")
        );
        assert_eq!(
            code("user:alice", &approver, false, 10),
            None,
            "she may still reject"
        );
        let open = Interrupt {
            required_role: None,
            expires_at: None,
            ..gate.clone()
        };
        assert!(open.refusal("anyone", &[], &[], true, i64::MAX).is_none());
    }

    #[test]
    fn a_members_only_gate_refuses_outsiders_and_follows_escalation() {
        let finance = Interrupt {
            required_role: None,
            approver_group: Some("finance".into()),
            members_only: true,
            ..gate()
        };
        let code = |groups: &[&str]| {
            let groups: Vec<String> = groups.iter().map(|g| (*g).to_owned()).collect();
            finance
                .refusal("user:bob", &[], &groups, true, 10)
                .map(|r| r.code)
        };
        assert_eq!(code(&[]), Some("not_in_group"));
        assert_eq!(code(&["sales"]), Some("not_in_group"));
        assert_eq!(code(&["sales", "finance"]), None);
        let escalated = Interrupt {
            approver_group: Some("cfo".into()),
            ..finance.clone()
        };
        let finance_only = ["finance".to_owned()];
        assert_eq!(
            escalated
                .refusal("user:bob", &[], &finance_only, true, 10)
                .map(|r| r.code),
            Some("not_in_group"),
            "after escalation the escalated group decides"
        );
        let label_only = Interrupt {
            members_only: false,
            ..finance
        };
        assert!(label_only.refusal("user:bob", &[], &[], true, 10).is_none());
    }
}
