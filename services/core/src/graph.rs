//! Mission graphs: versioned, immutable definitions of nodes, edges and policies.
//!
//! A graph is a DAG of nodes. Edges are sequential, conditional on a field of the source
//! node's output, or parallel (several edges leaving one node); a node with several
//! incoming edges joins them: it runs once every incoming edge is decided and at least one
//! was taken (dead-path elimination skips nodes whose every incoming edge was not taken).
//! Loops are not edges: an agent node asks for further steps in its output
//! (`next_steps`), bounded by the graph's `max_steps`. Detached nodes (no edges) serve as
//! compensations or as steps an agent may request.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{
    duration::Millis,
    json, mcp,
    signal::{self, OnWaitTimeout, SignalWait},
};

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
pub struct Graph {
    pub id: String,
    pub version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Most steps one run may take, agent-requested ones included.
    #[serde(default = "default_max_steps")]
    pub max_steps: u32,
    /// Wall-clock cap for a run, from its start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_duration: Option<Millis>,
    /// What a run does when its next dispatch would exceed its spend budget.
    #[serde(default, skip_serializing_if = "OnBudgetExceeded::is_default")]
    pub on_budget_exceeded: OnBudgetExceeded,
    /// Who may start and cancel this graph's runs (absent: any principal of the tenant).
    #[serde(default, skip_serializing_if = "Access::is_open")]
    pub access: Access,
    /// How long a finished run keeps its payloads; then its state becomes its audit
    /// summary (`RunForgotten`). Absent: kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention: Option<Millis>,
    /// A start label that names at most one run of this graph per tenant, so outside
    /// services address the run by it (a signal for "the onboarding of hire h-42"): a
    /// run's id is derived from its tenant, this graph and the label's value
    /// ([`crate::ids::correlated_run_id`]), and a start must carry the label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation: Option<String>,
    /// MCP servers whose tools nodes call or offer their models (see [`crate::mcp`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mcp_servers: Vec<mcp::McpServer>,
    pub nodes: Vec<Node>,
    #[serde(default)]
    pub edges: Vec<Edge>,
    /// The nodes of the offered MCP tools, derived from `mcp_servers`' pinned lists when the
    /// definition is parsed; never written in it (see [`crate::mcp`]).
    #[serde(skip)]
    mcp_nodes: Vec<Node>,
    /// The tenant the graph belongs to (the publication's `tenant`), `None` for a graph of
    /// every tenant. Never in the definition: the table sets it from the signed record.
    #[serde(skip)]
    pub owner: Option<String>,
}

/// `access: {start: [roles], cancel: [roles], budget: role}`: a command needs one of the
/// listed roles (an empty list: none needed). Checked by the fold (`forbidden`) and by
/// the gateway before it publishes (403). Approvals have their node's `required_role`; a
/// budget pause's decision needs `budget` (default `operator`, runs of rules 3 on);
/// reconciling needs `operator` whatever the graph says.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Access {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub start: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cancel: Vec<String>,
    /// The role that decides a budget pause (raise, or reject and fail the run); absent:
    /// [`crate::budget::BUDGET_ROLE`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<String>,
}

impl Access {
    fn is_open(&self) -> bool {
        self.start.is_empty() && self.cancel.is_empty() && self.budget.is_none()
    }

    /// The role a budget pause's decision needs.
    pub fn budget_role(&self) -> &str {
        self.budget.as_deref().unwrap_or(crate::budget::BUDGET_ROLE)
    }

    /// Why `roles` may not start a run of graph `graph_id`, if they may not.
    pub fn start_refusal(&self, graph_id: &str, roles: &[String]) -> Option<String> {
        let what = || format!("starting a run of graph {graph_id}");
        Self::refusal(what, &self.start, roles)
    }

    /// Why `roles` may not cancel a run of graph `graph_id`, if they may not.
    pub fn cancel_refusal(&self, graph_id: &str, roles: &[String]) -> Option<String> {
        let what = || format!("cancelling a run of graph {graph_id}");
        Self::refusal(what, &self.cancel, roles)
    }

    fn refusal(
        what: impl FnOnce() -> String,
        required: &[String],
        roles: &[String],
    ) -> Option<String> {
        if required.is_empty() || required.iter().any(|r| roles.contains(r)) {
            return None;
        }
        Some(format!(
            "{} needs one of the roles {}",
            what(),
            required.join(", ")
        ))
    }
}

/// `on_budget_exceeded: pause | fail | cancel`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnBudgetExceeded {
    /// An interrupt asks an approver to raise the budget (`{"raise": {...}}`).
    Pause,
    /// The run fails (compensations run).
    #[default]
    Fail,
    /// The run is cancelled (compensations run).
    Cancel,
}

impl OnBudgetExceeded {
    fn is_default(&self) -> bool {
        *self == OnBudgetExceeded::default()
    }
}

fn default_max_steps() -> u32 {
    100
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
    /// [`Graph::tool_specs`]) and the model's `tool_calls` become their steps.
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
    /// absent: derived from the declared `args` (see [`Graph::tool_specs`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_schema: Option<Value>,
    /// A wait for an outside signal instead of a call ([`crate::signal`]): such a node's
    /// `tool` is [`signal::WAIT_TOOL`] and its side effect `pure`, filled in when the
    /// definition is parsed.
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

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Edge {
    pub from: String,
    pub to: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub when: Option<Condition>,
}

/// A test on a field of the source node's output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Condition {
    /// Dotted path into the output; empty for the whole output.
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub equals: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_equals: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exists: Option<bool>,
}

impl Condition {
    pub fn holds(&self, output: &Value) -> bool {
        let found = json::at_path(output, &self.path);
        if let Some(expected) = &self.equals {
            return found == Some(expected);
        }
        if let Some(unexpected) = &self.not_equals {
            return found != Some(unexpected);
        }
        let present = found.is_some_and(|v| !v.is_null());
        present == self.exists.unwrap_or(true)
    }
}

/// One problem in a graph, naming the node (when there is one) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{problem}", node.as_ref().map(|n| format!("node {n:?}: ")).unwrap_or_default())]
pub struct GraphError {
    pub node: Option<String>,
    pub problem: String,
}

/// A graph was refused; every problem found is listed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid graph: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
pub struct InvalidGraph(pub Vec<GraphError>);

/// Most nodes in one graph.
pub const MAX_NODES: usize = 1_000;
/// Most edges in one graph.
pub const MAX_EDGES: usize = 10_000;

mod validate;

impl Graph {
    /// Parses a graph from YAML or JSON (JSON is YAML) and validates it.
    pub fn parse(text: &str) -> Result<Graph, InvalidGraph> {
        let invalid = |e: serde_yaml::Error| {
            InvalidGraph(vec![GraphError {
                node: None,
                problem: e.to_string(),
            }])
        };
        let mut document: serde_yaml::Value = serde_yaml::from_str(text).map_err(invalid)?;
        let waits = fill_waiting_nodes(&mut document);
        let mut graph: Graph = if waits {
            serde_yaml::from_value(document).map_err(invalid)?
        } else {
            // Parsed from the text again, so errors keep their line and column.
            serde_yaml::from_str(text).map_err(invalid)?
        };
        graph.validate()?;
        graph.mcp_nodes = graph.derive_mcp_nodes();
        Ok(graph)
    }

    /// A node of the graph, an offered MCP tool's node included.
    pub fn node(&self, id: &str) -> Option<&Node> {
        self.nodes
            .iter()
            .chain(self.mcp_nodes.iter())
            .find(|n| n.id == id)
    }

    /// Every node, the offered MCP tools' nodes after the declared ones.
    pub fn all_nodes(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().chain(self.mcp_nodes.iter())
    }

    /// One node per pinned tool some node offers (each once, whoever offers it).
    fn derive_mcp_nodes(&self) -> Vec<Node> {
        let wanted = mcp::wanted(&self.mcp_servers, &self.nodes);
        let mut out = Vec::new();
        for server in &self.mcp_servers {
            let (Some(want), Some(pinned)) = (wanted.get(&server.name), &server.pinned) else {
                continue;
            };
            for tool in &pinned.tools {
                if want.as_ref().is_none_or(|set| set.contains(&tool.name)) {
                    out.push(mcp::tool_node(server, tool));
                }
            }
        }
        out
    }

    /// The tools `node` offers its model, in order: its `tools`, then each offered MCP
    /// server's (listed or pinned order). Empty: the node is not a tool loop.
    pub fn offers(&self, node: &Node) -> Vec<String> {
        let mut out = node.tools.clone();
        for offer in &node.mcp {
            let Some(server) = self.mcp_servers.iter().find(|s| s.name == offer.server) else {
                continue;
            };
            for tool in mcp::offered(server, offer) {
                let id = mcp::node_id(server, tool);
                if !out.contains(&id) {
                    out.push(id);
                }
            }
        }
        out
    }

    /// Whether `node` is a tool loop: it offers its model tools (nodes or MCP tools), or is
    /// a conversation.
    pub fn is_tool_loop(&self, node: &Node) -> bool {
        !node.tools.is_empty() || !node.mcp.is_empty() || node.conversation.is_some()
    }

    /// Whether `node` may ask for a step of `target`: one of its `may_request`, or an MCP
    /// tool it offers.
    pub fn may_request(&self, node: &Node, target: &str) -> bool {
        node.may_request.iter().any(|m| m == target)
            || (!node.mcp.is_empty() && self.offers(node).iter().any(|o| o == target))
    }

    /// Whether `node` may ask for any step at all.
    pub fn requests_steps(&self, node: &Node) -> bool {
        !node.may_request.is_empty() || !node.mcp.is_empty()
    }

    /// The config an intent of `node` carries: the node's, and for an `mcp` node the
    /// server's url and auth reference from `mcp_servers`.
    pub fn step_config(&self, node: &Node) -> Value {
        if node.tool == mcp::MCP_TOOL {
            mcp::step_config(&self.mcp_servers, &node.config)
        } else {
            node.config.clone()
        }
    }

    /// MCP servers some node offers whose tool lists are not pinned yet (publishing pins
    /// them; a graph on the graphs topic must have none).
    pub fn unpinned_mcp_servers(&self) -> Vec<&str> {
        mcp::unpinned(&self.mcp_servers, &self.nodes)
    }

    /// Which tools of which server publishing must pin: every tool (`None`) or the listed
    /// ones, by server name.
    pub fn mcp_tools_to_pin(&self) -> BTreeMap<String, Option<BTreeSet<String>>> {
        mcp::wanted(&self.mcp_servers, &self.nodes)
    }

    /// This graph with `server`'s pinned list set (and its tools' nodes derived), checked
    /// as any definition.
    pub fn with_pinned(&self, server: &str, pinned: mcp::Pinned) -> Result<Graph, InvalidGraph> {
        let mut graph = self.clone();
        if let Some(s) = graph.mcp_servers.iter_mut().find(|s| s.name == server) {
            s.pinned = Some(pinned);
        }
        graph.validate()?;
        graph.mcp_nodes = graph.derive_mcp_nodes();
        Ok(graph)
    }

    /// The `tools` a tool-loop node offers its model, in its API's shape (OpenAI
    /// functions, or Anthropic `{name, description, input_schema}`): one per name in
    /// [`Graph::offers`], named after the tool's node. The parameters are the node's
    /// `input_schema` (an MCP tool's pinned schema), else derived from its declared `args`:
    /// an object value is the property's schema as written, a string its description (a
    /// string property), any other literal gives its type. Every declared argument is
    /// required.
    pub fn tool_specs(&self, node: &Node) -> Value {
        let api = node.model_api();
        let specs = self
            .offers(node)
            .iter()
            .filter_map(|name| self.node(name))
            .map(|tool| {
                let parameters = tool.input_schema.clone().unwrap_or_else(|| {
                    let mut properties = serde_json::Map::new();
                    let mut required = Vec::new();
                    if let Value::Object(args) = &tool.args {
                        for (name, declared) in args {
                            let schema = match declared {
                                Value::Object(_) => declared.clone(),
                                Value::String(text) => {
                                    serde_json::json!({"type": "string", "description": text})
                                }
                                Value::Bool(_) => serde_json::json!({"type": "boolean"}),
                                Value::Number(_) => serde_json::json!({"type": "number"}),
                                Value::Array(_) => serde_json::json!({"type": "array"}),
                                Value::Null => serde_json::json!({}),
                            };
                            properties.insert(name.clone(), schema);
                            required.push(Value::String(name.clone()));
                        }
                    }
                    serde_json::json!({
                        "type": "object",
                        "properties": properties,
                        "required": required,
                    })
                });
                let description = tool
                    .description
                    .clone()
                    .unwrap_or_else(|| format!("Runs step {}.", tool.id));
                match api {
                    ModelApi::OpenAi => serde_json::json!({
                        "type": "function",
                        "function": {
                            "name": tool.id,
                            "description": description,
                            "parameters": parameters,
                        },
                    }),
                    ModelApi::Anthropic => serde_json::json!({
                        "name": tool.id,
                        "description": description,
                        "input_schema": parameters,
                    }),
                }
            })
            .collect();
        Value::Array(specs)
    }

    /// The node that waits for signal `name`, if any: a waiting node, or a conversation
    /// whose messages it carries (names are unique among both).
    pub fn waiting_for(&self, name: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| {
            n.wait.as_ref().is_some_and(|w| w.signal == name)
                || n.conversation.as_ref().is_some_and(|c| c.signal == name)
        })
    }

    /// `graph_id@version`, with the owner first for a tenant's graph
    /// (`tenant/graph_id@version`): the record's key on `sortie.graphs`.
    pub fn key(&self) -> String {
        format!("{}@{}", self.pinned_id(), self.version)
    }

    /// The id a run of this graph pins (`RunStarted.graph_id`): the graph's id, prefixed
    /// with its owner for a tenant's graph (see [`Graphs`]).
    pub fn pinned_id(&self) -> String {
        qualified_id(self.owner.as_deref(), &self.id)
    }

    /// Canonical JSON of the definition (what is published and hashed).
    pub fn canonical_json(&self) -> String {
        json::canonical(&serde_json::to_value(self).unwrap_or(Value::Null))
    }

    pub fn incoming<'a>(&'a self, node: &'a str) -> impl Iterator<Item = &'a Edge> + 'a {
        self.edges.iter().filter(move |e| e.to == node)
    }

    pub fn outgoing<'a>(&'a self, node: &'a str) -> impl Iterator<Item = &'a Edge> + 'a {
        self.edges.iter().filter(move |e| e.from == node)
    }

    /// Nodes reached only as compensations or agent requests, never by edges.
    pub fn detached(&self) -> BTreeSet<&str> {
        self.nodes
            .iter()
            .flat_map(|n| {
                n.compensate_with
                    .iter()
                    .chain(n.may_request.iter())
                    .chain(n.precheck.iter())
            })
            .chain(self.nodes.iter().filter_map(|n| match &n.on_reject {
                OnReject::Goto(target) => Some(target),
                OnReject::Fail => None,
            }))
            .chain(
                self.nodes
                    .iter()
                    .filter_map(|n| match n.wait.as_ref().map(|w| &w.on_timeout) {
                        Some(OnWaitTimeout::Goto(target)) => Some(target),
                        _ => None,
                    }),
            )
            .map(String::as_str)
            .chain(self.nodes.iter().filter_map(|n| {
                n.conversation
                    .as_ref()
                    .and_then(|c| c.context.summary_node())
            }))
            .collect()
    }

    /// The nodes reached by edges (not [`Graph::detached`]).
    fn attached(&self) -> usize {
        let detached = self.detached();
        self.nodes
            .iter()
            .filter(|n| !detached.contains(n.id.as_str()))
            .count()
    }

    /// Graph nodes in topological order (detached nodes excluded).
    pub fn topological(&self) -> Vec<&Node> {
        let detached = self.detached();
        let attached = self.attached();
        let mut order = Vec::new();
        let mut placed = BTreeSet::new();
        // `detached` may name nodes that do not exist (validate() refuses those): count
        // the nodes that are there.
        while order.len() < attached {
            let before = order.len();
            for node in &self.nodes {
                if detached.contains(node.id.as_str()) || placed.contains(node.id.as_str()) {
                    continue;
                }
                if self
                    .incoming(&node.id)
                    .all(|e| placed.contains(e.from.as_str()))
                {
                    placed.insert(node.id.as_str());
                    order.push(node);
                }
            }
            if order.len() == before {
                break; // a cycle; validate() refuses such graphs
            }
        }
        order
    }

    /// Every problem of the definition, or `Ok` (see `validate.rs`: one check per concern).
    pub fn validate(&self) -> Result<(), InvalidGraph> {
        validate::validate(self)
    }

    /// For each node, the nodes on every path before it (all predecessors, transitively).
    fn ancestors(&self) -> BTreeMap<&str, BTreeSet<&str>> {
        let mut out: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
        for node in self.topological() {
            let mut set = BTreeSet::new();
            for edge in self.incoming(&node.id) {
                set.insert(edge.from.as_str());
                if let Some(more) = out.get(edge.from.as_str()) {
                    set.extend(more.iter().copied());
                }
            }
            out.insert(node.id.as_str(), set);
        }
        out
    }
}

/// Gives each node that waits for a signal (`wait:`) or starts a child run (`run:`) the
/// tool and side effect it has on the wire ([`signal::WAIT_TOOL`] and `pure`,
/// [`crate::child::CHILD_TOOL`] and `idempotent`) where the author left them out.
/// Whether there was any such node.
fn fill_waiting_nodes(document: &mut serde_yaml::Value) -> bool {
    let mut any = false;
    let nodes = document
        .get_mut("nodes")
        .and_then(serde_yaml::Value::as_sequence_mut);
    for node in nodes.into_iter().flatten() {
        let Some(map) = node.as_mapping_mut() else {
            continue;
        };
        let (tool, side_effect) = if map.contains_key("wait") {
            (signal::WAIT_TOOL, "pure")
        } else if map.contains_key("run") {
            (crate::child::CHILD_TOOL, "idempotent")
        } else {
            continue;
        };
        any = true;
        for (key, value) in [("tool", tool), ("side_effect", side_effect)] {
            if !map.contains_key(key) {
                map.insert(key.into(), value.into());
            }
        }
    }
    any
}

/// Identifies a published graph version.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct GraphRef {
    pub id: String,
    pub version: u32,
}

/// `tenant/id` for a tenant's graph, `id` for a graph of every tenant. Unambiguous: a
/// graph id never contains `/`, so the owner is everything before the last one.
pub fn qualified_id(owner: Option<&str>, id: &str) -> String {
    match owner {
        Some(owner) => format!("{owner}/{id}"),
        None => id.to_owned(),
    }
}

/// The published graphs, as the reducer's global table knows them.
///
/// **Namespaces.** A graph belongs to one tenant or to every tenant (its publication's
/// `tenant`; a graph of every tenant needs a publisher key for `*`). Versions are kept per
/// pinned id ([`Graph::pinned_id`]): `refund@3` of tenant `acme` (`acme/refund`) and of
/// tenant `globex` never meet, and neither meets a global `refund@3`. A start names the
/// short id and [`Graphs::resolve`] reads it in its own tenant's namespace first, then the
/// global one; a run pins the qualified id, so what it runs never changes under it when
/// its tenant publishes the same id later, and no tenant's graph is ever another's.
#[derive(Debug, Clone, Default)]
pub struct Graphs {
    by_id: BTreeMap<String, BTreeMap<u32, Graph>>,
}

impl Graphs {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a published version under its pinned id (owner included). Versions are
    /// immutable: a second, different definition of the same version is refused and the
    /// first one stays.
    pub fn insert(&mut self, graph: Graph) -> Result<(), GraphError> {
        let versions = self.by_id.entry(graph.pinned_id()).or_default();
        match versions.get(&graph.version) {
            Some(existing) if existing != &graph => Err(GraphError {
                node: None,
                problem: format!(
                    "{} is already published with another definition",
                    graph.key()
                ),
            }),
            Some(_) => Ok(()),
            None => {
                versions.insert(graph.version, graph);
                Ok(())
            }
        }
    }

    /// A version of a pinned id (`tenant/id` for a tenant's graph), or the latest when
    /// `version` is `None`. What a run pinned is looked up with this.
    pub fn get(&self, pinned_id: &str, version: Option<u32>) -> Option<&Graph> {
        let versions = self.by_id.get(pinned_id)?;
        match version {
            Some(v) => versions.get(&v),
            None => versions.values().next_back(),
        }
    }

    /// The graph a start of `tenant` naming `id` runs: the tenant's own graph of that id
    /// when it has published one (every version read there, none mixed in from elsewhere),
    /// else the graph of every tenant. A qualified id (`tenant/id`) is read only as the
    /// tenant's own: another tenant's graph is never found.
    pub fn resolve(&self, tenant: &str, id: &str, version: Option<u32>) -> Option<&Graph> {
        if let Some((owner, _)) = id.rsplit_once('/') {
            return if owner == tenant {
                self.get(id, version)
            } else {
                None
            };
        }
        let own = qualified_id(Some(tenant), id);
        if self.by_id.contains_key(&own) {
            self.get(&own, version)
        } else {
            self.get(id, version)
        }
    }

    pub fn all(&self) -> impl Iterator<Item = &Graph> {
        self.by_id.values().flat_map(|v| v.values())
    }

    /// The graphs `tenant` can start: its own and those of every tenant.
    pub fn visible_to<'a>(&'a self, tenant: &'a str) -> impl Iterator<Item = &'a Graph> + 'a {
        self.all()
            .filter(move |g| g.owner.as_deref().is_none_or(|owner| owner == tenant))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(yaml: &str) -> Vec<String> {
        match Graph::parse(yaml) {
            Ok(_) => vec![],
            Err(InvalidGraph(list)) => list.iter().map(ToString::to_string).collect(),
        }
    }

    #[test]
    fn a_valid_graph_parses() {
        let graph = Graph::parse(
            r#"
id: refund
version: 1
nodes:
  - {id: read, tool: echo, side_effect: pure, args: {order: $input.order}}
  - {id: refund, tool: http, side_effect: keyed, args: {amount: $steps.read.output.total}, compensate_with: reverse}
  - {id: reverse, tool: http, side_effect: keyed, args: {of: $compensated.output.id}}
edges:
  - {from: read, to: refund, when: {path: refundable, equals: true}}
"#,
        )
        .expect("valid");
        assert_eq!(graph.topological().len(), 2);
        assert_eq!(
            graph.detached().into_iter().collect::<Vec<_>>(),
            vec!["reverse"]
        );
    }

    #[test]
    fn problems_name_the_node() {
        let found = problems(
            r#"
id: g
version: 1
nodes:
  - {id: a, tool: echo, side_effect: pure}
  - {id: b, tool: echo, side_effect: pure, args: {x: $steps.c.output}}
  - {id: c, tool: "", side_effect: pure, compensate_with: zzz}
edges:
  - {from: a, to: b}
  - {from: b, to: a}
  - {from: a, to: ghost}
"#,
        );
        let text = found.join("\n");
        assert!(
            text.contains(r#"node "ghost": edge a -> ghost names an unknown node"#),
            "{text}"
        );
        assert!(text.contains("cycle"), "{text}");
        assert!(text.contains(r#"node "c": tool is empty"#), "{text}");
        assert!(
            text.contains(r#"node "c": compensate_with names unknown node "zzz""#),
            "{text}"
        );
        assert!(
            text.contains(r#"node "b": args refer to "c", which does not always run before it"#),
            "{text}"
        );
    }

    #[test]
    fn lookup_authoritative_must_be_a_boolean() {
        let graph = |value: &str| {
            format!(
                "id: g\nversion: 1\nnodes:\n  - {{id: a, tool: http, side_effect: reconcilable, config: {{status_url: x, lookup_authoritative: {value}}}}}\n"
            )
        };
        assert_eq!(problems(&graph("true")), Vec::<String>::new());
        assert_eq!(problems(&graph("false")), Vec::<String>::new());
        let found = problems(&graph("\"yes\""));
        assert!(
            found.iter().any(|p| p.contains("lookup_authoritative")),
            "{found:?}"
        );
    }

    #[test]
    fn a_retry_policy_takes_its_defaults_field_by_field() {
        let graph = Graph::parse(
            "id: g\nversion: 1\nnodes:\n  - {id: a, tool: echo, side_effect: pure, retry: {max_attempts: 5}}\n",
        )
        .expect("a partial retry policy is complete with defaults");
        let retry = &graph.nodes[0].retry;
        assert_eq!(retry.max_attempts, 5);
        assert_eq!(
            RetryPolicy {
                max_attempts: 3,
                ..retry.clone()
            },
            RetryPolicy::default()
        );
        let found = problems(
            "id: g\nversion: 1\nnodes:\n  - {id: a, tool: echo, side_effect: pure, retry: {max_atempts: 5}}\n",
        );
        assert!(found.iter().any(|p| p.contains("max_atempts")), "{found:?}");
    }

    #[test]
    fn missing_side_effect_is_refused() {
        let found = problems("id: g\nversion: 1\nnodes:\n  - {id: a, tool: echo}\n");
        assert!(found.iter().any(|p| p.contains("side_effect")), "{found:?}");
    }

    #[test]
    fn backoff_grows_is_capped_and_deterministic() {
        let policy = RetryPolicy::default();
        let first = policy.backoff(1, "op");
        assert_eq!(first, policy.backoff(1, "op"));
        assert!((800..=1200).contains(&first), "{first}");
        assert!((1600..=2400).contains(&policy.backoff(2, "op")));
        assert!(policy.backoff(20, "op") <= 72_000);
    }

    #[test]
    fn published_versions_are_immutable() {
        let mut graphs = Graphs::new();
        let g =
            Graph::parse("id: g\nversion: 1\nnodes:\n  - {id: a, tool: echo, side_effect: pure}\n")
                .expect("valid");
        graphs.insert(g.clone()).expect("first");
        graphs.insert(g.clone()).expect("same again");
        let mut changed = g;
        changed.nodes[0].tool = "http".into();
        assert!(graphs.insert(changed).is_err());
        assert_eq!(
            graphs.get("g", None).map(|g| g.nodes[0].tool.as_str()),
            Some("echo")
        );
    }
}
