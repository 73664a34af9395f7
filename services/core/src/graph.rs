//! Mission graphs: versioned, immutable definitions of nodes, edges and policies.
//!
//! A graph is a DAG of nodes. Edges are sequential, conditional on a field of the source
//! node's output, or parallel (several edges leaving one node); a node with several
//! incoming edges joins them: it runs once every incoming edge is decided and at least one
//! was taken (dead-path elimination skips nodes whose every incoming edge was not taken).
//! Loops are not edges: an agent node asks for further steps in its output
//! (`next_steps`), bounded by the graph's `max_steps`. Detached nodes (no edges) serve as
//! compensations or as steps an agent may request.
//!
//! Here: the graph and its edges. Beside it: `node` (nodes and their policies), `tools`
//! (what a tool loop offers its model), `published` (the published graphs), `validate`.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{
    duration::Millis,
    json, mcp,
    signal::{self, OnWaitTimeout},
};

mod node;
mod published;
mod tools;
mod validate;

pub use node::{Approval, ModelApi, Node, OnReject, OnTimeout, RetryPolicy, SideEffect};
pub use published::{qualified_id, GraphRef, Graphs};

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
}
