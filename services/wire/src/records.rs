//! Rust mirrors of the Avro records in `schemas/`. Field order and names follow the
//! schemas exactly; union branches follow the schema's branch order (the encoder picks
//! a branch by variant index). JSON payloads stay strings here: parsing them is the
//! business of whoever owns their meaning.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::RecordKind;

/// A Rust type that is the value of one of Sortie's topics.
pub trait Record: Serialize + serde::de::DeserializeOwned {
    const KIND: RecordKind;
}

/// Milliseconds since the Unix epoch (Avro `timestamp-millis`).
pub type Millis = i64;

// ---------------------------------------------------------------- sortie.commands

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunCommand {
    pub command_id: String,
    pub tenant: String,
    pub run_id: String,
    pub issuer: Issuer,
    pub issued_at: Millis,
    pub body: CommandBody,
}

impl Record for RunCommand {
    const KIND: RecordKind = RecordKind::RunCommand;
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Issuer {
    pub principal: String,
    pub roles: Vec<String>,
    /// Approver groups the principal belongs to (added in 0.2; default empty).
    #[serde(default)]
    pub groups: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CommandBody {
    StartRun(StartRun),
    ResumeRun(ResumeRun),
    CancelRun(CancelRun),
    ReconcileOperation(ReconcileOperation),
    /// Added in 0.3: forget a finished run now (crypto-shredding).
    ForgetRun(ForgetRun),
    /// Added in 0.4: an outside event a node of the run waits for.
    SignalRun(SignalRun),
}

impl CommandBody {
    /// The command kind as named in events (`CommandAccepted.command`).
    pub fn kind(&self) -> &'static str {
        match self {
            CommandBody::StartRun(_) => "StartRun",
            CommandBody::ResumeRun(_) => "ResumeRun",
            CommandBody::CancelRun(_) => "CancelRun",
            CommandBody::ReconcileOperation(_) => "ReconcileOperation",
            CommandBody::ForgetRun(_) => "ForgetRun",
            CommandBody::SignalRun(_) => "SignalRun",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartRun {
    pub graph_id: String,
    pub graph_version: Option<i32>,
    pub input: String,
    pub labels: BTreeMap<String, String>,
    /// The run's spend limits and price table (JSON), if any.
    #[serde(default)]
    pub budget: Option<String>,
    /// Start from another run's checkpoint: `{run_id, version, state}` as JSON (added in 0.2).
    #[serde(default)]
    pub fork: Option<String>,
    /// A child run's parent `{run_id, step_id, operation_id, attempt}` as JSON (added in 0.4).
    #[serde(default)]
    pub parent: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResumeRun {
    pub interrupt_id: String,
    pub proposal_hash: String,
    pub decision: Decision,
    pub payload: Option<String>,
    pub comment: Option<String>,
    /// Arguments the approver edited (added in 0.2).
    #[serde(default)]
    pub edited_args: Option<String>,
    /// `payload` is the human's input (true), not edited arguments (false: the 0.1
    /// meaning, kept for producers written against 0.1).
    #[serde(default)]
    pub payload_is_input: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Decision {
    Approve,
    Reject,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelRun {
    pub reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForgetRun {
    pub reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignalRun {
    pub name: String,
    /// The sender's id of the event (`None`: the command id).
    #[serde(default)]
    pub signal_id: Option<String>,
    /// JSON; `None` is JSON null.
    #[serde(default)]
    pub payload: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReconcileOperation {
    pub operation_id: String,
    pub outcome: ReconcileOutcome,
    pub output: Option<String>,
    pub error: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ReconcileOutcome {
    Succeeded,
    Failed,
}

// ---------------------------------------------------------------- sortie.intents.<queue>

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepIntent {
    pub operation_id: String,
    pub attempt: i32,
    pub tenant: String,
    pub run_id: String,
    pub step_id: String,
    pub node: String,
    pub graph_id: String,
    pub graph_version: i32,
    pub tool: String,
    pub queue: String,
    pub side_effect: SideEffectClass,
    pub args: String,
    pub config: String,
    pub timeout_ms: Option<i64>,
    pub issued_at: Millis,
    /// Ask the receiver only; never call it (added in 0.2).
    #[serde(default)]
    pub lookup_only: bool,
}

impl Record for StepIntent {
    const KIND: RecordKind = RecordKind::StepIntent;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum SideEffectClass {
    Pure,
    Idempotent,
    Keyed,
    Reconcilable,
    Unsafe,
}

// ---------------------------------------------------------------- sortie.step-deltas

/// What a running step has produced so far (`schemas/step-delta.avsc`): outside the run's
/// history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepDelta {
    pub tenant: String,
    pub run_id: String,
    pub step_id: String,
    pub node: String,
    pub operation_id: String,
    pub attempt: i32,
    pub execution_id: String,
    pub seq: i64,
    pub kind: DeltaKind,
    pub text: String,
    pub at: Millis,
}

impl Record for StepDelta {
    const KIND: RecordKind = RecordKind::StepDelta;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum DeltaKind {
    Text,
    Status,
}

// ---------------------------------------------------------------- sortie.step-results

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepResult {
    pub operation_id: String,
    pub attempt: i32,
    pub tenant: String,
    pub run_id: String,
    pub step_id: String,
    pub status: StepStatus,
    pub retryable: bool,
    pub output: Option<String>,
    pub error: Option<StepError>,
    pub executor: String,
    pub started_at: Millis,
    pub finished_at: Option<Millis>,
    /// A child run's spend, in its report to its parent (JSON); `None` from executors.
    #[serde(default)]
    pub spend: Option<String>,
}

impl Record for StepResult {
    const KIND: RecordKind = RecordKind::StepResult;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum StepStatus {
    Started,
    Succeeded,
    Failed,
    Unknown,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepError {
    pub code: String,
    pub message: String,
    pub retry_after_ms: Option<i64>,
}

// ---------------------------------------------------------------- sortie.run-events

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunEvent {
    pub tenant: String,
    pub run_id: String,
    pub seq: i64,
    pub state_version: i64,
    pub at: Millis,
    pub command_id: Option<String>,
    pub operation_id: Option<String>,
    pub prev_hash: Option<String>,
    pub hash: Option<String>,
    pub body: EventBody,
}

impl Record for RunEvent {
    const KIND: RecordKind = RecordKind::RunEvent;
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventBody {
    CommandAccepted(CommandAccepted),
    CommandRejected(CommandRejected),
    RunStarted(RunStarted),
    StepDispatched(StepDispatched),
    StepStarted(StepStarted),
    StepSucceeded(StepSucceeded),
    StepFailed(StepFailed),
    StepOutcomeUnknown(StepOutcomeUnknown),
    OperationReconciled(OperationReconciled),
    Interrupted(Interrupted),
    InterruptDecided(InterruptDecided),
    InterruptEscalated(InterruptEscalated),
    InterruptExpired(InterruptExpired),
    CancelRequested(CancelRequested),
    RunStatusChanged(RunStatusChanged),
    DecisionBuffered(DecisionBuffered),
    RunForgotten(RunForgotten),
    SignalWaitOpened(SignalWaitOpened),
    SignalReceived(SignalReceived),
    SignalBuffered(SignalBuffered),
    SignalWaitExpired(SignalWaitExpired),
    BudgetReserved(BudgetReserved),
    BudgetSettled(BudgetSettled),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetReserved {
    pub step_id: String,
    pub child_run_id: String,
    /// JSON.
    pub limits: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetSettled {
    pub step_id: String,
    /// JSON.
    pub spent: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignalWaitOpened {
    pub step_id: String,
    pub node: String,
    pub signal: String,
    #[serde(default)]
    pub many: bool,
    #[serde(default = "one")]
    pub wanted: i32,
    #[serde(default)]
    pub expires_at: Option<Millis>,
}

fn one() -> i32 {
    1
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignalReceived {
    pub step_id: String,
    pub signal: String,
    pub signal_id: String,
    pub payload: String,
    pub sent_by: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignalBuffered {
    pub signal: String,
    pub signal_id: String,
    pub payload: String,
    pub sent_by: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignalWaitExpired {
    pub step_id: String,
    pub on_timeout: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunForgotten {
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecisionBuffered {
    pub interrupt_id: String,
    pub proposal_hash: String,
    pub decision: Decision,
    pub decided_by: String,
    pub roles: Vec<String>,
    pub payload: Option<String>,
    pub comment: Option<String>,
    #[serde(default)]
    pub groups: Vec<String>,
    #[serde(default)]
    pub edited_args: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandAccepted {
    pub command_id: String,
    pub command: String,
    pub duplicate: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandRejected {
    pub command_id: String,
    pub command: String,
    pub code: String,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunStarted {
    pub graph_id: String,
    pub graph_version: i32,
    pub input: String,
    pub started_by: String,
    pub labels: BTreeMap<String, String>,
    pub deadline_at: Option<Millis>,
    /// The run's spend limits and price table (JSON), if any.
    #[serde(default)]
    pub budget: Option<String>,
    /// For a fork: the source and what was carried over, as JSON (added in 0.2).
    #[serde(default)]
    pub forked_from: Option<String>,
    /// The rules the run's derived state is folded with (added in 0.2; 0 before).
    #[serde(default)]
    pub rules: i32,
    /// A child run's parent, as JSON (added in 0.4).
    #[serde(default)]
    pub parent: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepDispatched {
    pub step_id: String,
    pub node: String,
    pub attempt: i32,
    pub tool: String,
    pub queue: String,
    pub args: String,
    pub compensates: Option<String>,
    pub side_effect: Option<SideEffectClass>,
    pub timeout_at: Option<Millis>,
    pub requested_by: Option<String>,
    pub substitute_for: Option<String>,
    /// The approved step this step prechecks (added in 0.2).
    #[serde(default)]
    pub precheck_for: Option<String>,
    /// The attempt only asks a reconcilable receiver (added in 0.2).
    #[serde(default)]
    pub lookup_only: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepStarted {
    pub step_id: String,
    pub attempt: i32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepSucceeded {
    pub step_id: String,
    pub attempt: i32,
    pub output: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepFailed {
    pub step_id: String,
    pub attempt: i32,
    pub code: String,
    pub message: String,
    pub retryable: bool,
    pub retry_at: Option<Millis>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepOutcomeUnknown {
    pub step_id: String,
    pub attempt: i32,
    pub message: String,
    pub needs_operator: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperationReconciled {
    pub step_id: String,
    pub outcome: ReconcileOutcome,
    pub by: String,
    pub output: Option<String>,
    pub error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Interrupted {
    pub interrupt_id: String,
    pub step_id: String,
    pub node: String,
    pub proposal: String,
    pub proposal_hash: String,
    pub reason: String,
    pub required_role: Option<String>,
    pub approver_group: Option<String>,
    pub quorum: i32,
    pub expires_at: Option<Millis>,
    pub requested_by: Option<String>,
    pub substitute_for: Option<String>,
    /// JSON: rationale, affects, on_reject (added in 0.2).
    #[serde(default)]
    pub context: Option<String>,
    /// Only members of approver_group may decide (added in 0.2).
    #[serde(default)]
    pub members_only: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InterruptDecided {
    pub interrupt_id: String,
    pub proposal_hash: String,
    pub decision: Decision,
    pub decided_by: String,
    pub payload: Option<String>,
    pub comment: Option<String>,
    #[serde(rename = "final")]
    pub is_final: bool,
    #[serde(default)]
    pub edited_args: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InterruptEscalated {
    pub interrupt_id: String,
    pub approver_group: String,
    pub expires_at: Millis,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InterruptExpired {
    pub interrupt_id: String,
    pub on_timeout: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelRequested {
    pub requested_by: String,
    pub reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunStatusChanged {
    pub status: RunStatus,
    pub reason: Option<String>,
    pub output: Option<String>,
    #[serde(default)]
    pub forget_at: Option<i64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum RunStatus {
    Running,
    WaitingApproval,
    NeedsReconciliation,
    Cancelling,
    Compensating,
    Succeeded,
    Failed,
    Cancelled,
    /// Added in 0.4.
    WaitingSignal,
}

// ---------------------------------------------------------------- sortie.run-state

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunState {
    pub tenant: String,
    pub run_id: String,
    pub graph_id: String,
    pub graph_version: i32,
    pub status: RunStatus,
    pub version: i64,
    pub last_event_seq: i64,
    pub created_at: Millis,
    pub updated_at: Millis,
    pub labels: BTreeMap<String, String>,
    pub state: String,
}

impl Record for RunState {
    const KIND: RecordKind = RecordKind::RunState;
}

// ---------------------------------------------------------------- sortie.graphs

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GraphDefinition {
    pub graph_id: String,
    pub version: i32,
    pub tenant: Option<String>,
    pub definition: String,
    pub definition_hash: String,
    pub published_by: String,
    pub published_at: Millis,
}

impl Record for GraphDefinition {
    const KIND: RecordKind = RecordKind::GraphDefinition;
}

// ---------------------------------------------------------------- sortie.dead-letters

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetter {
    pub reason_code: String,
    pub reason: String,
    pub service: String,
    pub original_topic: String,
    pub original_partition: i32,
    pub original_offset: i64,
    pub original_timestamp: Option<Millis>,
    #[serde(with = "apache_avro::serde::bytes_opt")]
    pub original_key: Option<Vec<u8>>,
    #[serde(with = "apache_avro::serde::bytes_opt")]
    pub original_value: Option<Vec<u8>>,
    pub original_headers: Vec<Header>,
    pub failed_at: Millis,
}

impl Record for DeadLetter {
    const KIND: RecordKind = RecordKind::DeadLetter;
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub key: String,
    #[serde(with = "apache_avro::serde::bytes_opt")]
    pub value: Option<Vec<u8>>,
}
