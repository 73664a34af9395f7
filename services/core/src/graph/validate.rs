//! Graph validation, one check per concern. [`validate`] runs them in a fixed order and
//! returns every problem found, each with the node it is about.

use std::collections::{BTreeMap, BTreeSet};

use super::{
    json, mcp, Graph, GraphError, InvalidGraph, Node, OnReject, OnTimeout, MAX_EDGES, MAX_NODES,
};
use crate::signal::{self, OnWaitTimeout, MAX_WAIT_SIGNALS, WAIT_TOOL};

pub(super) fn validate(graph: &Graph) -> Result<(), InvalidGraph> {
    let mut problems = Vec::new();
    let mut problem = |node: Option<&str>, text: String| {
        problems.push(GraphError {
            node: node.map(str::to_owned),
            problem: text,
        })
    };
    graph.check_header(&mut problem);
    graph.check_limits(&mut problem);
    graph.check_node_ids(&mut problem);
    graph.check_mcp_tools(&mut problem);
    graph.check_tool_config(&mut problem);
    graph.check_edges(&mut problem);
    let ancestors = graph.ancestors();
    let detached = graph.detached();
    for node in &graph.nodes {
        graph.check_node(node, &mut problem);
        graph.check_approval(node, &mut problem);
        graph.check_wait(node, &detached, &mut problem);
        graph.check_child(node, &mut problem);
        graph.check_conversation(node, &detached, &mut problem);
        graph.check_references(node, &detached, &ancestors, &mut problem);
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(InvalidGraph(problems))
    }
}

/// Graph, node and derived ids: 1-64 of `[A-Za-z0-9_-]`.
fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

impl Graph {
    /// Whether `id` is a node the graph declares (offered MCP tools' nodes not included).
    fn declares(&self, id: &str) -> bool {
        self.nodes.iter().any(|n| n.id == id)
    }

    /// The graph's own fields: id, version, at least one node, a step budget.
    fn check_header(&self, problem: &mut impl FnMut(Option<&str>, String)) {
        if !valid_id(&self.id) {
            problem(
                None,
                format!("graph id {:?} must be 1-64 of [A-Za-z0-9_-]", self.id),
            );
        }
        if self.version == 0 {
            problem(None, "version must be at least 1".into());
        }
        if self.nodes.is_empty() {
            problem(None, "a graph needs at least one node".into());
        }
        if self.max_steps == 0 {
            problem(None, "max_steps must be at least 1".into());
        }
        if let Some(label) = &self.correlation {
            if !valid_id(label) {
                problem(
                    None,
                    format!("correlation {label:?} must be a label name: 1-64 of [A-Za-z0-9_-]"),
                );
            }
        }
    }

    /// The limits every definition is held to, whoever publishes it: the payload shape
    /// for each node's `args` and `config` (`crate::limits::check_shape`), bounded
    /// counts of nodes and edges, and texts a person reads kept short.
    fn check_limits(&self, problem: &mut impl FnMut(Option<&str>, String)) {
        use crate::limits;
        if self.nodes.len() > MAX_NODES {
            problem(
                None,
                format!(
                    "{} nodes; at most {MAX_NODES} are allowed",
                    self.nodes.len()
                ),
            );
        }
        if self.edges.len() > MAX_EDGES {
            problem(
                None,
                format!(
                    "{} edges; at most {MAX_EDGES} are allowed",
                    self.edges.len()
                ),
            );
        }
        if let Some(description) = &self.description {
            if let Err(e) = limits::check_text("description", description, limits::MAX_TEXT_BYTES) {
                problem(None, e);
            }
        }
        for node in &self.nodes {
            for (field, value) in [("args", &node.args), ("config", &node.config)] {
                if let Err(e) = limits::check_shape(field, value) {
                    problem(Some(&node.id), format!("{e} (limit {})", e.limit.name()));
                }
            }
            if let Some(approval) = &node.interrupt_before {
                if let Err(e) = limits::check_text(
                    "interrupt_before.reason",
                    &approval.reason,
                    limits::MAX_TEXT_BYTES,
                ) {
                    problem(Some(&node.id), e);
                }
            }
        }
    }

    /// Node ids unique and well formed; per-node fields that name other nodes or must be
    /// of one type.
    fn check_node_ids(&self, problem: &mut impl FnMut(Option<&str>, String)) {
        let mut seen = BTreeSet::new();
        for node in &self.nodes {
            if !valid_id(&node.id) {
                problem(Some(&node.id), "id must be 1-64 of [A-Za-z0-9_-]".into());
            }
            if !seen.insert(node.id.as_str()) {
                problem(Some(&node.id), "declared twice".into());
            }
            if node
                .config
                .get("lookup_authoritative")
                .is_some_and(|v| !v.is_boolean())
            {
                problem(
                    Some(&node.id),
                    "config.lookup_authoritative must be true or false".into(),
                );
            }
            if let Some(check) = &node.precheck {
                if node.interrupt_before.is_none() {
                    problem(
                        Some(&node.id),
                        "a precheck runs after an approval, so the node needs interrupt_before"
                            .into(),
                    );
                }
                if check == &node.id || !self.nodes.iter().any(|n| &n.id == check) {
                    problem(
                        Some(&node.id),
                        format!("precheck {check:?} must name another node of the graph"),
                    );
                }
            }
        }
    }

    /// The MCP servers, and the node ids their offered tools become.
    fn check_mcp_tools(&self, problem: &mut impl FnMut(Option<&str>, String)) {
        mcp::check(&self.mcp_servers, &self.nodes, problem);
        let mut derived_ids = BTreeSet::new();
        for derived in self.derive_mcp_nodes() {
            let id = derived.id.as_str();
            if !valid_id(id) {
                problem(
                    Some(id),
                    "an MCP tool's name gives no valid node id (give its server a prefix)".into(),
                );
            }
            if self.nodes.iter().any(|n| n.id == id) {
                problem(
                    Some(id),
                    "an offered MCP tool has the name of a node of the graph: give its server a prefix".into(),
                );
            }
            if !derived_ids.insert(derived.id.clone()) {
                problem(
                    Some(id),
                    "two offered MCP tools have this name: give one server a prefix".into(),
                );
            }
        }
    }

    /// A tool's own configuration: the model API of an `llm` node, input schemas.
    fn check_tool_config(&self, problem: &mut impl FnMut(Option<&str>, String)) {
        for node in &self.nodes {
            if node.tool == crate::budget::LLM_TOOL {
                if let Some(api) = node.config.get("api") {
                    if api != "openai" && api != "anthropic" {
                        problem(
                            Some(&node.id),
                            "config.api must be openai or anthropic".into(),
                        );
                    }
                }
                if let Some(name) = node.config.get("api_key_env") {
                    let name = name.as_str().unwrap_or_default();
                    if let Some(why) = crate::secret::prefix_refusal("config.api_key_env", name) {
                        problem(Some(&node.id), why);
                    }
                }
            }
            if let Some(schema) = &node.input_schema {
                if !schema.is_object() {
                    problem(Some(&node.id), "input_schema must be a JSON object".into());
                }
                if let Err(e) = crate::limits::check_shape("input_schema", schema) {
                    problem(Some(&node.id), format!("{e} (limit {})", e.limit.name()));
                }
            }
        }
    }

    /// Edges: known ends, no edges on detached nodes, no self-loops, one test per
    /// condition, no cycle.
    fn check_edges(&self, problem: &mut impl FnMut(Option<&str>, String)) {
        let detached = self.detached();
        for edge in &self.edges {
            for end in [&edge.from, &edge.to] {
                if !self.declares(end) {
                    problem(
                        Some(end),
                        format!("edge {} -> {} names an unknown node", edge.from, edge.to),
                    );
                }
                if detached.contains(end.as_str()) {
                    problem(
                        Some(end),
                        "is a compensation, on_reject target or requested node, so it may not have edges".into(),
                    );
                }
            }
            if edge.from == edge.to {
                problem(
                    Some(&edge.from),
                    "has an edge to itself; loops are agent requests (next_steps), not edges"
                        .into(),
                );
            }
            if let Some(when) = &edge.when {
                let tests = [
                    when.equals.is_some(),
                    when.not_equals.is_some(),
                    when.exists.is_some(),
                ];
                if tests.iter().filter(|t| **t).count() > 1 {
                    problem(
                        Some(&edge.from),
                        format!(
                            "edge to {}: give one of equals, not_equals, exists",
                            edge.to
                        ),
                    );
                }
            }
        }
        if self.topological().len() < self.attached() {
            problem(
                None,
                "edges form a cycle; loops are agent requests (next_steps), not edges".into(),
            );
        }
    }

    /// One node's tool, queue, retry policy, args, compensation, requests and on_reject.
    fn check_node(&self, node: &Node, problem: &mut impl FnMut(Option<&str>, String)) {
        let id = node.id.as_str();
        if node.tool.trim().is_empty() {
            problem(Some(id), "tool is empty".into());
        }
        if node.queue.is_empty()
            || !node
                .queue
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            problem(
                Some(id),
                format!("queue {:?} must be of [A-Za-z0-9_-]", node.queue),
            );
        }
        if node.retry.max_attempts == 0 {
            problem(Some(id), "retry.max_attempts must be at least 1".into());
        }
        if node.retry.multiplier < 1.0 || !(0.0..=1.0).contains(&node.retry.jitter) {
            problem(
                Some(id),
                "retry.multiplier must be >= 1 and retry.jitter within 0..1".into(),
            );
        }
        if !node.args.is_object() {
            problem(Some(id), "args must be a JSON object".into());
        }
        for target in node.compensate_with.iter() {
            if !self.declares(target) {
                problem(
                    Some(id),
                    format!("compensate_with names unknown node {target:?}"),
                );
            } else if self
                .node(target)
                .and_then(|n| n.compensate_with.as_ref())
                .is_some()
            {
                problem(
                    Some(id),
                    format!("compensation {target:?} may not have a compensation of its own"),
                );
            }
        }
        for target in &node.may_request {
            if !self.declares(target) {
                problem(
                    Some(id),
                    format!("may_request names unknown node {target:?}"),
                );
            }
        }
        for tool in &node.tools {
            if !node.may_request.contains(tool) {
                problem(
                    Some(id),
                    format!("tool {tool:?} must also be listed in may_request"),
                );
            }
        }
        if let OnReject::Goto(target) = &node.on_reject {
            if !self.declares(target) {
                problem(
                    Some(id),
                    format!("on_reject goto names unknown node {target:?}"),
                );
            }
            if node.interrupt_before.is_none() {
                problem(Some(id), "on_reject needs interrupt_before".into());
            }
        }
    }

    /// One node's approval gate.
    fn check_approval(&self, node: &Node, problem: &mut impl FnMut(Option<&str>, String)) {
        let id = node.id.as_str();
        if let Some(approval) = &node.interrupt_before {
            let groups = approval
                .group
                .iter()
                .chain(&approval.approver_group)
                .chain(&approval.escalation);
            for group in groups.filter(|g| g.starts_with('$')) {
                if !matches!(json::reference(group), Some(Ok(json::Reference::Input(_)))) {
                    problem(
                        Some(id),
                        format!("approver group {group:?}: a group template reads the run input ($input.<path>)"),
                    );
                }
            }
            if approval.quorum == 0 {
                problem(
                    Some(id),
                    "interrupt_before.quorum must be at least 1".into(),
                );
            }
            if approval.on_timeout == OnTimeout::Escalate && approval.escalation.is_empty() {
                problem(
                    Some(id),
                    "on_timeout escalate needs an escalation list of approver groups".into(),
                );
            }
            if let (Some(group), Some(label)) = (&approval.group, &approval.approver_group) {
                if group != label {
                    problem(
                        Some(id),
                        "give group (members only) or approver_group (a label), not both".into(),
                    );
                }
            }
            if approval.timeout.0 <= 0 {
                problem(Some(id), "interrupt_before.timeout must be positive".into());
            }
        }
    }

    /// A node that waits for a signal: a well-formed wait, reached by edges, calling
    /// nothing; and no other node that claims the waiting tool.
    fn check_wait(
        &self,
        node: &Node,
        detached: &BTreeSet<&str>,
        problem: &mut impl FnMut(Option<&str>, String),
    ) {
        let id = node.id.as_str();
        let Some(wait) = &node.wait else {
            if node.tool == WAIT_TOOL {
                problem(
                    Some(id),
                    format!("tool {WAIT_TOOL} is the tool of a waiting node; give it a wait"),
                );
            }
            return;
        };
        if node.tool != WAIT_TOOL {
            problem(
                Some(id),
                "a waiting node calls no tool: leave tool out".into(),
            );
        }
        if !signal::valid_name(&wait.signal) {
            problem(
                Some(id),
                format!(
                    "wait.signal {:?} must be 1-64 of [A-Za-z0-9_.-]",
                    wait.signal
                ),
            );
        }
        if self
            .nodes
            .iter()
            .filter(|n| n.wait.as_ref().is_some_and(|w| w.signal == wait.signal))
            .count()
            > 1
        {
            problem(
                Some(id),
                format!(
                    "signal {:?} is waited for by two nodes; a signal names one wait",
                    wait.signal
                ),
            );
        }
        let calls = node.interrupt_before.is_some()
            || node.side_effect != super::SideEffect::Pure
            || node.queue != "default"
            || node.retry != super::RetryPolicy::default()
            || node.config.as_object().is_some_and(|c| !c.is_empty())
            || node.precheck.is_some()
            || node.compensate_with.is_some()
            || !node.may_request.is_empty()
            || !node.tools.is_empty()
            || !node.mcp.is_empty()
            || node.timeout.is_some()
            || node.args.as_object().is_some_and(|a| !a.is_empty());
        if calls {
            problem(
                Some(id),
                "a waiting node calls nothing: no args, config, queue, retry, side_effect, timeout (use wait.timeout), approval, precheck, compensation, requests or tools".into(),
            );
        }
        if detached.contains(id) {
            problem(
                Some(id),
                "a waiting node is reached by edges, never as a compensation, request, precheck or goto target".into(),
            );
        }
        if wait.timeout.0 <= 0 {
            problem(Some(id), "wait.timeout must be positive".into());
        }
        if wait.many && wait.count.is_none() && wait.on_timeout == OnWaitTimeout::Fail {
            problem(
                Some(id),
                "a list wait without a count ends at its deadline: give it a count, or on_timeout continue or goto".into(),
            );
        }
        match wait.count {
            Some(_) if !wait.many => {
                problem(Some(id), "wait.count needs many: true".into());
            }
            Some(n) if n == 0 || n > MAX_WAIT_SIGNALS => problem(
                Some(id),
                format!("wait.count must be within 1..={MAX_WAIT_SIGNALS}"),
            ),
            _ => {}
        }
        if let Some(schema) = &wait.schema {
            if let Err(e) = crate::limits::check_shape("wait.schema", schema) {
                problem(Some(id), format!("{e} (limit {})", e.limit.name()));
            } else if let Err(e) = signal::check_schema(schema) {
                problem(Some(id), format!("wait.{e}"));
            }
        }
        for role in &wait.roles {
            if role.is_empty() {
                problem(Some(id), "wait.roles names an empty role".into());
            }
        }
        if let OnWaitTimeout::Goto(target) = &wait.on_timeout {
            match self.nodes.iter().find(|n| &n.id == target) {
                None => problem(
                    Some(id),
                    format!("wait.on_timeout goto names unknown node {target:?}"),
                ),
                Some(n) if n.wait.is_some() || n.id == node.id => problem(
                    Some(id),
                    format!("wait.on_timeout goto {target:?} must be a node that calls a tool"),
                ),
                Some(_) => {}
            }
        }
    }

    /// A conversation: an `llm` node reached by edges, without an approval of its own (gate
    /// its tools), whose signal names no other wait, whose turns fit the graph's
    /// `max_steps`, and whose summary node (if any) is a detached node of its own.
    fn check_conversation(
        &self,
        node: &Node,
        detached: &BTreeSet<&str>,
        problem: &mut impl FnMut(Option<&str>, String),
    ) {
        use crate::converse::{Context, MAX_TURNS};
        let Some(conversation) = &node.conversation else {
            return;
        };
        let id = Some(node.id.as_str());
        if node.tool != "llm" {
            problem(id, "a conversation is an llm node (tool: llm)".into());
        }
        if node.wait.is_some() || node.run.is_some() || node.interrupt_before.is_some() {
            problem(
                id,
                "a conversation neither waits, runs a child nor has an approval of its own (gate its tools)".into(),
            );
        }
        if detached.contains(node.id.as_str()) {
            problem(
                id,
                "a conversation is reached by edges, never as a compensation, request, precheck or goto target".into(),
            );
        }
        if !signal::valid_name(&conversation.signal) {
            problem(
                id,
                format!(
                    "conversation.signal {:?} must be 1-64 of [A-Za-z0-9_.-]",
                    conversation.signal
                ),
            );
        }
        let takers = self
            .nodes
            .iter()
            .filter(|n| {
                n.wait
                    .as_ref()
                    .is_some_and(|w| w.signal == conversation.signal)
                    || n.conversation
                        .as_ref()
                        .is_some_and(|c| c.signal == conversation.signal)
            })
            .count();
        if takers > 1 {
            problem(
                id,
                format!(
                    "signal {:?} is taken by two nodes; a signal names one wait or conversation",
                    conversation.signal
                ),
            );
        }
        if conversation.max_turns == 0 || conversation.max_turns > MAX_TURNS {
            problem(
                id,
                format!("conversation.max_turns must be within 1..={MAX_TURNS}"),
            );
        } else if conversation.max_turns > self.max_steps {
            problem(
                id,
                format!(
                    "conversation.max_turns ({}) is more than the graph's max_steps ({}): every turn is a step",
                    conversation.max_turns, self.max_steps
                ),
            );
        }
        if conversation.idle.0 <= 0 {
            problem(id, "conversation.idle must be positive".into());
        }
        if conversation.roles.iter().any(|r| r.trim().is_empty()) {
            problem(id, "conversation.roles names an empty role".into());
        }
        if let Some(stop) = &conversation.stop_tool {
            if !valid_id(stop) || self.offers(node).iter().any(|o| o == stop) {
                problem(
                    id,
                    format!("conversation.stop_tool {stop:?} must be a tool name of [A-Za-z0-9_-] that the node offers no other tool under"),
                );
            }
        }
        if conversation.context.last() == Some(0) {
            problem(id, "conversation.context.last must be at least 1".into());
        }
        if let Context::Summary { node: summary, .. } = &conversation.context {
            match self.node(summary) {
                None => problem(
                    id,
                    format!("conversation.context.summary names unknown node {summary:?}"),
                ),
                Some(n) if n.tool != "llm" || n.conversation.is_some() || n.interrupt_before.is_some() => problem(
                    id,
                    format!("conversation.context.summary {summary:?} must be an llm node without a conversation or approval"),
                ),
                Some(_) => {}
            }
        }
    }

    /// A node that starts a child run: a graph id, no tool of its own, nothing that would
    /// let a second child start while the first runs (a timeout), and `idempotent` (a
    /// re-fold sends the same start; the child's id makes it one run).
    fn check_child(&self, node: &Node, problem: &mut impl FnMut(Option<&str>, String)) {
        let id = node.id.as_str();
        let Some(child) = &node.run else {
            if node.tool == crate::child::CHILD_TOOL {
                problem(
                    Some(id),
                    format!(
                        "tool {} is the tool of a node that starts a child run; give it run",
                        crate::child::CHILD_TOOL
                    ),
                );
            }
            return;
        };
        if let Some(Err(why)) = child.budget.as_ref().map(|b| b.check()) {
            problem(Some(&node.id), format!("run.budget: {why}"));
        }
        if !valid_id(&child.graph) {
            problem(
                Some(id),
                format!("run.graph {:?} must be a graph id", child.graph),
            );
        }
        if node.wait.is_some() {
            problem(
                Some(id),
                "a node either waits or runs a child, not both".into(),
            );
        }
        let own = node.tool != crate::child::CHILD_TOOL
            || node.side_effect != super::SideEffect::Idempotent
            || node.timeout.is_some()
            || node.config.as_object().is_some_and(|c| !c.is_empty())
            || !node.may_request.is_empty()
            || !node.tools.is_empty()
            || !node.mcp.is_empty();
        if own {
            problem(
                Some(id),
                "a node that runs a child calls nothing itself: no tool, config, timeout (the child's graph has max_duration), side_effect other than idempotent, requests or tools".into(),
            );
        }
    }

    /// What one node's args refer to: nodes that always run before it, an approval's
    /// payload where an approval precedes it, `$compensated` in a compensation.
    fn check_references(
        &self,
        node: &Node,
        detached: &BTreeSet<&str>,
        ancestors: &BTreeMap<&str, BTreeSet<&str>>,
        problem: &mut impl FnMut(Option<&str>, String),
    ) {
        let id = node.id.as_str();
        let is_compensation = self
            .nodes
            .iter()
            .any(|n| n.compensate_with.as_deref() == Some(id));
        // `$interrupt.payload` is a decision's input: it exists for a gated node, its
        // precheck and its on_reject substitute.
        let decided = node.interrupt_before.is_some()
            || self.nodes.iter().any(|n| {
                n.precheck.as_deref() == Some(id)
                    || matches!(&n.on_reject, OnReject::Goto(t) if t == id)
            });
        for reference in json::references(&node.args) {
            match reference {
                Err(e) => problem(Some(id), format!("args: {e}")),
                Ok(json::Reference::Step { node: source, .. }) => {
                    if !self.declares(source) {
                        problem(Some(id), format!("args refer to unknown node {source:?}"));
                    } else if !detached.contains(id)
                        && !ancestors.get(id).is_some_and(|a| a.contains(source))
                    {
                        problem(
                            Some(id),
                            format!(
                                "args refer to {source:?}, which does not always run before it"
                            ),
                        );
                    }
                }
                Ok(json::Reference::Interrupt(_)) if !decided => {
                    problem(
                        Some(id),
                        "args use $interrupt.payload but no approval precedes the node (gate it, or make it a precheck or on_reject target)".into(),
                    );
                }
                Ok(json::Reference::Compensated { .. }) if !is_compensation => {
                    problem(
                        Some(id),
                        "args use $compensated but the node compensates nothing".into(),
                    );
                }
                Ok(_) => {}
            }
        }
    }
}
