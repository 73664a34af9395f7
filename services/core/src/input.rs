//! What the fold consumes: commands, executor reports, and due timers.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::effect::TimerKey;

/// One input for one run. `at` is the input record's timestamp: the fold's only clock.
// A command (with a start's budget and fork source) is about twice a step report; an
// input lives for one fold and is moved, not copied, so boxing would only add an
// allocation per command.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Input {
    Command(Command),
    StepReport(StepReport),
    TimerFired {
        run_id: String,
        timer: TimerKey,
        at: i64,
    },
}

impl Input {
    pub fn run_id(&self) -> &str {
        match self {
            Input::Command(c) => &c.run_id,
            Input::StepReport(r) => &r.run_id,
            Input::TimerFired { run_id, .. } => run_id,
        }
    }

    pub fn at(&self) -> i64 {
        match self {
            Input::Command(c) => c.at,
            Input::StepReport(r) => r.at,
            Input::TimerFired { at, .. } => *at,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Command {
    pub command_id: String,
    pub tenant: String,
    pub run_id: String,
    pub principal: String,
    pub roles: Vec<String>,
    /// Approver groups the principal belongs to (from the issuer's token claims).
    #[serde(default)]
    pub groups: Vec<String>,
    pub at: i64,
    pub body: CommandBody,
}

// A start (with its budget, fork source and parent link) is the largest command by far;
// a command lives for one fold and is moved, not copied, so boxing its fields would only
// add allocations and churn every place that builds one.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CommandBody {
    StartRun {
        graph_id: String,
        graph_version: Option<u32>,
        input: Value,
        labels: BTreeMap<String, String>,
        /// The run's own spend limits, over its tenant's default, with the price table
        /// (resolved where the run is started).
        #[serde(default)]
        budget: Option<crate::budget::Budget>,
        /// Start from another run's checkpoint instead of from scratch (time travel).
        #[serde(default)]
        fork: Option<ForkSource>,
        /// A child run's parent: the run, step, operation and attempt that start it
        /// ([`crate::child`]); its run id must be the one the link derives.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parent: Option<crate::child::ParentLink>,
    },
    ResumeRun {
        interrupt_id: String,
        proposal_hash: String,
        approve: bool,
        /// The human's input, delivered to the node (`$interrupt.payload`).
        payload: Option<Value>,
        comment: Option<String>,
        /// Arguments to run instead of the proposal's.
        #[serde(default)]
        edited_args: Option<Value>,
    },
    CancelRun {
        reason: Option<String>,
    },
    ReconcileOperation {
        operation_id: String,
        succeeded: bool,
        output: Option<Value>,
        error: Option<String>,
    },
    /// Forget a finished run now (`DELETE /v1/runs/{id}`): its payloads are dropped from
    /// its state, its step results tombstoned, as when its retention passes. Sent after
    /// its data key was destroyed (crypto-shredding); needs the operator role.
    ForgetRun {
        reason: Option<String>,
    },
    /// An outside event a node of the run waits for (`wait: {signal: <name>}`).
    SignalRun {
        /// The signal's name.
        name: String,
        /// The sender's id of this event: a signal id is taken once (a command without
        /// one uses its command id).
        signal_id: String,
        payload: Value,
    },
}

/// Where a forked run starts: the source run at one of its versions. The fold sees one
/// run per input, so the command carries what the new run needs: the source's history,
/// which the reducer holds to the source's chain head and folds up to `version`
/// ([`crate::decide::fork::verified_source`]) — what a sender claims the state is never
/// counts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkSource {
    pub run_id: String,
    pub version: i64,
    /// The source's `RunState` at `version`, as JSON: set by the reducer from what it
    /// verified before the fold reads it. A sender's own value is not read by the reducer.
    #[serde(default)]
    pub state: Value,
    /// The source's whole history as written (every event, seq 1 to its last), needed to
    /// fork at any version but the source's latest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history: Option<Vec<crate::event::Event>>,
}

impl CommandBody {
    pub fn kind(&self) -> &'static str {
        match self {
            CommandBody::StartRun { .. } => "StartRun",
            CommandBody::ResumeRun { .. } => "ResumeRun",
            CommandBody::CancelRun { .. } => "CancelRun",
            CommandBody::ReconcileOperation { .. } => "ReconcileOperation",
            CommandBody::ForgetRun { .. } => "ForgetRun",
            CommandBody::SignalRun { .. } => "SignalRun",
        }
    }
}

/// An executor's report on one attempt of an operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepReport {
    /// For a child run's report to its parent's step: what the child spent, settled
    /// against the parent's budget ([`crate::child`]). `None` from executors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spent: Option<crate::budget::Spend>,
    pub operation_id: String,
    pub attempt: u32,
    pub tenant: String,
    pub run_id: String,
    pub step_id: String,
    pub outcome: StepOutcome,
    pub at: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum StepOutcome {
    /// Recorded before calling an unsafe or reconcilable receiver.
    Started,
    Succeeded {
        output: Value,
    },
    Failed {
        retryable: bool,
        code: String,
        message: String,
        retry_after_ms: Option<i64>,
    },
    /// The call may or may not have taken effect.
    Unknown {
        code: String,
        message: String,
    },
}
