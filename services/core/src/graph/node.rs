//! A graph's nodes: what a node calls and on what terms (side effect, retries, approval
//! gate, `on_reject`), and the model API an `llm` node speaks.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{duration::Millis, json, mcp, signal::SignalWait};

/// What retrying a node's call may mean for its receiver (SPEC §4.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SideEffect {
    /// No external effect: retry freely.
    Pure,
    /// Repeating is harmless: retry with the same operation id.
    Idempotent,
    /// The receiver dedupes on the operation id: retry with the same operation id.
    Keyed,
    /// The receiver answers "what happened to operation X": ask before retrying.
    Reconcilable,
    /// Neither: never retry on an unknown outcome; an operator records it.
    Unsafe,
}

impl SideEffect {
    /// Whether an attempt whose outcome is unknown may simply be tried again.
    pub fn retries_unknown(self) -> bool {
        matches!(
            self,
            SideEffect::Pure
                | SideEffect::Idempotent
                | SideEffect::Keyed
                | SideEffect::Reconcilable
        )
    }
}
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Node {
    pub id: String,
    /// Handler the executor runs: `http`, `llm`, `echo`, `sleep` or a user's own.
    pub tool: String,
    /// Executor queue (topic `sortie.intents.<queue>`).
    #[serde(default = "default_queue")]
    pub queue: String,
    pub side_effect: SideEffect,
    /// Argument template: strings `$input.x`, `$steps.<node>.output.x` are replaced.
    #[serde(default = "empty_object")]
    pub args: Value,
    /// Handler configuration (endpoint, model, ...), passed through to the executor.
    #[serde(default = "empty_object")]
    pub config: Value,
    #[serde(default)]
    pub retry: RetryPolicy,
    /// Per-attempt timeout; when it passes without a result the outcome is unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<Millis>,
    /// The approval gate (`approval:` is accepted as another name for it).
    #[serde(default, alias = "approval", skip_serializing_if = "Option::is_none")]
    pub interrupt_before: Option<Approval>,
    #[serde(default)]
    pub on_reject: OnReject,
    /// A detached node run after the approval and before the approved call, to check the
    /// business state again ("is the order still refundable?"). The call runs only when the
    /// check succeeds with `ok: true` in its output; otherwise the run follows `on_reject`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precheck: Option<String>,
    /// A detached node that undoes this one on cancellation or terminal failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensate_with: Option<String>,
    /// Detached nodes this node may ask for in its output's `next_steps`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub may_request: Vec<String>,
    /// A tool loop: these `may_request` nodes are offered to the model as tools (see
    /// [`Graph::tool_specs`](super::Graph::tool_specs)) and the model's `tool_calls` become
    /// their steps.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<String>,
    /// MCP servers whose tools are offered to the model too (all of a server's, or the
    /// listed ones): a tool loop, as `tools`, over the tools pinned at publication.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mcp: Vec<mcp::McpOffer>,
    /// What the node does, in a sentence; a tool's description for the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The JSON schema of the arguments a model passes when it calls this node as a tool;
    /// absent: derived from the declared `args` (see
    /// [`Graph::tool_specs`](super::Graph::tool_specs)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_schema: Option<Value>,
    /// A wait for an outside signal instead of a call ([`crate::signal`]): such a node's
    /// `tool` is [`signal::WAIT_TOOL`](crate::signal::WAIT_TOOL) and its side effect `pure`,
    /// filled in when the definition is parsed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait: Option<SignalWait>,
    /// Starts a run of another graph and waits for it ([`crate::child`]): `args` are its
    /// input. Such a node's `tool` is [`crate::child::CHILD_TOOL`] and its side effect
    /// `idempotent`, filled in when the definition is parsed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<crate::child::ChildRun>,
    /// A conversation ([`crate::converse`]): after an answer without tool calls the run
    /// waits for the person's next message and calls the model again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation: Option<crate::converse::Conversation>,
}

/// The model API an `llm` node speaks (`config.api`), which decides the shape of its
/// messages, tool specs and tool results.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelApi {
    /// OpenAI chat completions (the default).
    OpenAi,
    /// Anthropic Messages: `tool_use` / `tool_result` content blocks.
    Anthropic,
}

impl Node {
    /// `config.api`: `anthropic`, else OpenAI chat completions.
    pub fn model_api(&self) -> ModelApi {
        match self.config.get("api").and_then(Value::as_str) {
            Some("anthropic") => ModelApi::Anthropic,
            _ => ModelApi::OpenAi,
        }
    }
}

fn default_queue() -> String {
    "default".to_owned()
}

fn empty_object() -> Value {
    Value::Object(serde_json::Map::new())
}

/// A node's retry policy; each field left out takes its default (`retry: {max_attempts:
/// 5}` keeps the default backoff).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryPolicy {
    pub max_attempts: u32,
    pub initial_backoff: Millis,
    pub max_backoff: Millis,
    pub multiplier: f64,
    /// Fraction of the backoff added or removed, derived from the operation id (no RNG).
    pub jitter: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            initial_backoff: Millis(1_000),
            max_backoff: Millis(60_000),
            multiplier: 2.0,
            jitter: 0.2,
        }
    }
}

impl RetryPolicy {
    /// Delay before attempt `attempt + 1`, with deterministic jitter from `seed`.
    pub fn backoff(&self, attempt: u32, seed: &str) -> i64 {
        let exponent = attempt.saturating_sub(1).min(30) as i32;
        let base = (self.initial_backoff.0 as f64) * self.multiplier.powi(exponent);
        let base = base.min(self.max_backoff.0 as f64);
        let hash = json::sha256_hex(&[seed, &attempt.to_string()]);
        let unit =
            u64::from_str_radix(&hash[..12], 16).unwrap_or(0) as f64 / (0xffff_ffff_ffffu64 as f64);
        let factor = 1.0 + self.jitter * (2.0 * unit - 1.0);
        (base * factor).max(0.0).round() as i64
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Approval {
    #[serde(default = "default_approval_reason")]
    pub reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub required_role: Option<String>,
    /// The group notified to decide: a label (decisions are not limited to it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approver_group: Option<String>,
    /// Only members of this group (the approver token's `groups`) may decide. Escalation
    /// hands the gate to the next group of `escalation`, whose members alone decide then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// How long the approval may wait. Nothing waits forever by default: 7 days.
    #[serde(default = "default_approval_timeout")]
    pub timeout: Millis,
    #[serde(default)]
    pub on_timeout: OnTimeout,
    /// Approver groups to escalate to, in order, when `on_timeout: escalate`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub escalation: Vec<String>,
    /// Distinct approvals required.
    #[serde(default = "one")]
    pub quorum: u32,
    /// Whether an approver's edited payload may replace the arguments without a new approval.
    #[serde(default)]
    pub allow_edits: bool,
}

fn default_approval_reason() -> String {
    "a person approves this step".to_owned()
}

fn default_approval_timeout() -> Millis {
    Millis(7 * 86_400_000)
}

fn one() -> u32 {
    1
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnTimeout {
    #[default]
    Fail,
    Cancel,
    Escalate,
}

impl OnTimeout {
    pub fn as_str(self) -> &'static str {
        match self {
            OnTimeout::Fail => "fail",
            OnTimeout::Cancel => "cancel",
            OnTimeout::Escalate => "escalate",
        }
    }
}

/// `on_reject: fail` or `on_reject: {goto: <node>}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "OnRejectRepr", into = "OnRejectRepr")]
pub enum OnReject {
    /// The run fails (compensations run).
    #[default]
    Fail,
    /// Skip the node and continue at another (detached) node instead.
    Goto(String),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
enum OnRejectRepr {
    Word(String),
    Goto { goto: String },
}

impl TryFrom<OnRejectRepr> for OnReject {
    type Error = String;

    fn try_from(repr: OnRejectRepr) -> Result<Self, String> {
        match repr {
            OnRejectRepr::Word(word) if word == "fail" => Ok(OnReject::Fail),
            OnRejectRepr::Word(word) => Err(format!(
                "on_reject is `fail` or `{{goto: <node>}}`, not {word:?}"
            )),
            OnRejectRepr::Goto { goto } => Ok(OnReject::Goto(goto)),
        }
    }
}

impl From<OnReject> for OnRejectRepr {
    fn from(value: OnReject) -> Self {
        match value {
            OnReject::Fail => OnRejectRepr::Word("fail".into()),
            OnReject::Goto(goto) => OnRejectRepr::Goto { goto },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_is_capped_and_deterministic() {
        let policy = RetryPolicy::default();
        let first = policy.backoff(1, "op");
        assert_eq!(first, policy.backoff(1, "op"));
        assert!((800..=1200).contains(&first), "{first}");
        assert!((1600..=2400).contains(&policy.backoff(2, "op")));
        assert!(policy.backoff(20, "op") <= 72_000);
    }
}
