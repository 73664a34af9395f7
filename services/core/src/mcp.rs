//! MCP servers in the graph model: where a graph's servers are (`mcp_servers:`), which of
//! their tools a node offers its model (`mcp:` on the node), how each tool's calls are
//! treated (side-effect class, approval, retries, per tool), and the tool list pinned into
//! the version when it was published.
//!
//! A server's tools are read with `tools/list` by the publisher (`sortie-catalog`), never
//! by the fold: the names, descriptions and input schemas of the tools a graph offers are
//! written into the definition under `pinned`, with a hash of them, so every replay, shadow
//! replay and fork of a run offers the model exactly what the version was published with.
//! A server that changes its tools changes nothing for published versions; publishing the
//! graph again reads the new list, which is a new definition and so needs a new version.
//!
//! Each offered tool becomes a node of the graph as the fold sees it (`Graph::node` finds
//! it): tool `mcp`, its config naming the server and the tool, the declared policy (an
//! undeclared tool is `unsafe`: its call is never repeated blindly) and the pinned schema.
//! Those nodes are derived from the definition when it is parsed, never written in it.
//!
//! No secret is ever in a graph: a server's `auth` names the environment variable that
//! holds the header's value, read by the executor (and by the publisher, to list tools).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::duration::Millis;
use crate::graph::{Approval, Node, OnReject, RetryPolicy, SideEffect};
use crate::{json, limits};

/// The tool name of a node that calls an MCP server's tool.
pub const MCP_TOOL: &str = "mcp";
/// Most tools one server's pinned list may hold.
pub const MAX_PINNED_TOOLS: usize = 128;
/// Longest tool name, in bytes (MCP's own recommendation).
pub const MAX_TOOL_NAME_BYTES: usize = 128;
/// Longest tool description, in bytes.
pub const MAX_TOOL_DESCRIPTION_BYTES: usize = 8 * 1024;
/// Largest input schema of one tool (its JSON), in bytes.
pub const MAX_TOOL_SCHEMA_BYTES: usize = 64 * 1024;
/// Largest pinned list of a whole graph (every server's tools, their JSON), in bytes: a
/// definition travels in one Kafka record with the rest of the graph.
pub const MAX_PINNED_BYTES: usize = 256 * 1024;

/// `mcp_servers: [{name, url, auth, prefix, tools, pinned}]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpServer {
    /// How nodes name the server (`mcp: [shop]`, `config: {server: shop}`).
    pub name: String,
    /// The Streamable HTTP endpoint, e.g. `https://tools.example.com/mcp`.
    pub url: String,
    /// A header every request carries, its value read from the environment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<McpAuth>,
    /// Put before each of this server's tool names as the model sees them (and as the
    /// nodes are named), for two servers with a tool of the same name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    /// Per tool, by the server's tool name: how its calls are treated.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tools: BTreeMap<String, McpToolPolicy>,
    /// Written when the graph is published: the offered tools as `tools/list` gave them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned: Option<Pinned>,
}

/// `auth: {header: Authorization, env: SORTIE_SECRET_acme__SHOP_MCP_TOKEN, scheme: Bearer}`: the header's
/// value is `<scheme> <value of $env>` (or the value alone without a scheme).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpAuth {
    #[serde(default = "authorization")]
    pub header: String,
    pub env: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheme: Option<String>,
}

fn authorization() -> String {
    "Authorization".to_owned()
}

/// How one tool's calls are treated; every field optional.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpToolPolicy {
    /// Absent: `unsafe` (a call whose outcome is unknown waits for an operator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub side_effect: Option<SideEffect>,
    #[serde(default, alias = "approval", skip_serializing_if = "Option::is_none")]
    pub interrupt_before: Option<Approval>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetryPolicy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<Millis>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
}

/// The tools pinned for a server, and the hash of their canonical JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pinned {
    pub hash: String,
    pub tools: Vec<PinnedTool>,
}

impl Pinned {
    pub fn new(tools: Vec<PinnedTool>) -> Pinned {
        Pinned {
            hash: pinned_hash(&tools),
            tools,
        }
    }
}

/// One tool as `tools/list` described it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PinnedTool {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    pub input_schema: Value,
}

/// The hash of a pinned list: SHA-256 of its canonical JSON.
pub fn pinned_hash(tools: &[PinnedTool]) -> String {
    let value = serde_json::to_value(tools).unwrap_or(Value::Null);
    json::sha256_hex(&["mcp-tools", &json::canonical(&value)])
}

/// `mcp: [shop]` or `mcp: [{server: shop, tools: [lookup_order]}]` on a node: the server's
/// tools (all pinned ones, or the listed ones) are offered to the node's model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "OfferRepr", into = "OfferRepr")]
pub struct McpOffer {
    pub server: String,
    /// `None`: every tool the server lists.
    pub tools: Option<Vec<String>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
enum OfferRepr {
    Server(String),
    Listed {
        server: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tools: Option<Vec<String>>,
    },
}

impl TryFrom<OfferRepr> for McpOffer {
    type Error = String;

    fn try_from(repr: OfferRepr) -> Result<Self, String> {
        Ok(match repr {
            OfferRepr::Server(server) => McpOffer {
                server,
                tools: None,
            },
            OfferRepr::Listed { server, tools } => McpOffer { server, tools },
        })
    }
}

impl From<McpOffer> for OfferRepr {
    fn from(offer: McpOffer) -> Self {
        match offer.tools {
            None => OfferRepr::Server(offer.server),
            tools => OfferRepr::Listed {
                server: offer.server,
                tools,
            },
        }
    }
}

/// The node id (and the name the model calls) of a server's tool: the prefix, then the
/// tool's name with every character outside `[A-Za-z0-9_-]` as `_`, at most 64 bytes.
pub fn node_id(server: &McpServer, tool: &str) -> String {
    let mut id: String = server.prefix.clone().unwrap_or_default();
    id.extend(tool.chars().map(|c| {
        if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
            c
        } else {
            '_'
        }
    }));
    id.truncate(64);
    id
}

/// The tools of `server` an offer names, in order: the listed ones, or every pinned one.
pub fn offered<'s>(server: &'s McpServer, offer: &'s McpOffer) -> Vec<&'s str> {
    match &offer.tools {
        Some(listed) => listed.iter().map(String::as_str).collect(),
        None => server
            .pinned
            .iter()
            .flat_map(|p| p.tools.iter().map(|t| t.name.as_str()))
            .collect(),
    }
}

/// The tools to pin for each server: every tool of a server some node offers whole
/// (`None`), else the union of the listed ones, by server name. Servers nobody offers
/// are absent (nothing to pin).
pub fn wanted(servers: &[McpServer], nodes: &[Node]) -> BTreeMap<String, Option<BTreeSet<String>>> {
    let mut out: BTreeMap<String, Option<BTreeSet<String>>> = BTreeMap::new();
    for offer in nodes.iter().flat_map(|n| n.mcp.iter()) {
        if !servers.iter().any(|s| s.name == offer.server) {
            continue;
        }
        match &offer.tools {
            None => {
                out.insert(offer.server.clone(), None);
            }
            Some(listed) => {
                let entry = out
                    .entry(offer.server.clone())
                    .or_insert_with(|| Some(BTreeSet::new()));
                if let Some(set) = entry {
                    set.extend(listed.iter().cloned());
                }
            }
        }
    }
    out
}

/// The node the fold runs for a call of `tool` of `server`.
pub fn tool_node(server: &McpServer, tool: &PinnedTool) -> Node {
    let policy = server.tools.get(&tool.name).cloned().unwrap_or_default();
    Node {
        id: node_id(server, &tool.name),
        tool: MCP_TOOL.to_owned(),
        queue: policy.queue.unwrap_or_else(|| "default".to_owned()),
        side_effect: policy.side_effect.unwrap_or(SideEffect::Unsafe),
        args: Value::Object(serde_json::Map::new()),
        config: serde_json::json!({"server": server.name, "tool": tool.name}),
        retry: policy.retry.unwrap_or_default(),
        timeout: policy.timeout,
        interrupt_before: policy.interrupt_before,
        on_reject: OnReject::Fail,
        precheck: None,
        compensate_with: None,
        may_request: Vec::new(),
        tools: Vec::new(),
        mcp: Vec::new(),
        description: tool.description.clone(),
        input_schema: Some(tool.input_schema.clone()),
        wait: None,
        run: None,
        conversation: None,
    }
}

/// What the executor is handed for a step of an `mcp` node: the node's config (server and
/// tool) with the server's `url` and `auth` (a secret's *name*) from the graph.
pub fn step_config(servers: &[McpServer], config: &Value) -> Value {
    let mut out = config.clone();
    let Some(server) = config
        .get("server")
        .and_then(Value::as_str)
        .and_then(|name| servers.iter().find(|s| s.name == name))
    else {
        return out;
    };
    if let Value::Object(map) = &mut out {
        map.insert("url".into(), Value::String(server.url.clone()));
        if let Some(auth) = &server.auth {
            map.insert(
                "auth".into(),
                serde_json::to_value(auth).unwrap_or(Value::Null),
            );
        }
    }
    out
}

/// Problems with a graph's servers, its nodes' offers and `mcp` nodes, and the pinned
/// lists (hash, bounds, offered names), each with the node it concerns.
pub(crate) fn check(
    servers: &[McpServer],
    nodes: &[Node],
    problem: &mut impl FnMut(Option<&str>, String),
) {
    let valid_name = |s: &str, max: usize| {
        !s.is_empty()
            && s.len() <= max
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    };
    let mut names = BTreeSet::new();
    let mut pinned_bytes = 0;
    for server in servers {
        let what = format!("mcp server {:?}", server.name);
        if !valid_name(&server.name, 64) {
            problem(None, format!("{what}: name must be 1-64 of [A-Za-z0-9_-]"));
        }
        if !names.insert(server.name.as_str()) {
            problem(None, format!("{what} is declared twice"));
        }
        if !(server.url.starts_with("http://") || server.url.starts_with("https://"))
            || server.url.len() > 2048
        {
            problem(
                None,
                format!("{what}: url must be an http:// or https:// URL"),
            );
        }
        if let Some(prefix) = &server.prefix {
            if !valid_name(prefix, 32) {
                problem(
                    None,
                    format!("{what}: prefix must be 1-32 of [A-Za-z0-9_-]"),
                );
            }
        }
        if let Some(auth) = &server.auth {
            if !valid_name(&auth.header, 128) {
                problem(None, format!("{what}: auth.header is not a header name"));
            }
            if auth.env.is_empty()
                || auth.env.len() > 128
                || !auth
                    .env
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_')
            {
                problem(
                    None,
                    format!("{what}: auth.env must name an environment variable (the secret is never in the graph)"),
                );
            } else if let Some(why) = crate::secret::prefix_refusal("auth.env", &auth.env) {
                problem(None, format!("{what}: {why}"));
            }
            if auth.scheme.as_ref().is_some_and(|s| !valid_name(s, 32)) {
                problem(
                    None,
                    format!("{what}: auth.scheme must be a word such as Bearer"),
                );
            }
        }
        for (tool, policy) in &server.tools {
            if let Some(queue) = &policy.queue {
                if !valid_name(queue, 249) {
                    problem(
                        None,
                        format!("{what}: tool {tool:?}: queue must be of [A-Za-z0-9_-]"),
                    );
                }
            }
            if policy.retry.as_ref().is_some_and(|r| r.max_attempts == 0) {
                problem(
                    None,
                    format!("{what}: tool {tool:?}: retry.max_attempts must be at least 1"),
                );
            }
        }
        let Some(pinned) = &server.pinned else {
            continue;
        };
        if pinned.hash != pinned_hash(&pinned.tools) {
            problem(
                None,
                format!("{what}: pinned.hash is not the hash of its pinned tools"),
            );
        }
        if pinned.tools.len() > MAX_PINNED_TOOLS {
            problem(
                None,
                format!(
                    "{what}: {} tools pinned; at most {MAX_PINNED_TOOLS} are allowed",
                    pinned.tools.len()
                ),
            );
        }
        let mut seen = BTreeSet::new();
        for tool in &pinned.tools {
            let label = format!("{what}: tool {:?}", limits::clip(&tool.name, 64));
            if tool.name.is_empty() || tool.name.len() > MAX_TOOL_NAME_BYTES {
                problem(
                    None,
                    format!("{label}: a name has 1 to {MAX_TOOL_NAME_BYTES} bytes"),
                );
            }
            if !seen.insert(tool.name.as_str()) {
                problem(None, format!("{label} is listed twice"));
            }
            if let Some(description) = &tool.description {
                if let Err(e) =
                    limits::check_text("its description", description, MAX_TOOL_DESCRIPTION_BYTES)
                {
                    problem(None, format!("{label}: {e}"));
                }
            }
            if !tool.input_schema.is_object() {
                problem(None, format!("{label}: its input schema is not an object"));
            }
            if let Err(e) = limits::check_shape("input_schema", &tool.input_schema) {
                problem(None, format!("{label}: {e} (limit {})", e.limit.name()));
            }
            let bytes = tool.input_schema.to_string().len();
            if bytes > MAX_TOOL_SCHEMA_BYTES {
                problem(
                    None,
                    format!("{label}: its input schema has {bytes} bytes; at most {MAX_TOOL_SCHEMA_BYTES} are allowed"),
                );
            }
            pinned_bytes +=
                bytes + tool.name.len() + tool.description.as_ref().map_or(0, String::len);
        }
        for tool in server.tools.keys() {
            if !seen.contains(tool.as_str()) {
                problem(
                    None,
                    format!("{what}: tools declares {tool:?}, which the server did not list (or no node offers)"),
                );
            }
        }
    }
    if pinned_bytes > MAX_PINNED_BYTES {
        problem(
            None,
            format!("the pinned MCP tools take {pinned_bytes} bytes; at most {MAX_PINNED_BYTES} are allowed"),
        );
    }
    for node in nodes {
        let id = Some(node.id.as_str());
        for offer in &node.mcp {
            let Some(server) = servers.iter().find(|s| s.name == offer.server) else {
                problem(
                    id,
                    format!(
                        "mcp offers server {:?}, which mcp_servers does not declare",
                        offer.server
                    ),
                );
                continue;
            };
            if let (Some(listed), Some(pinned)) = (&offer.tools, &server.pinned) {
                for name in listed {
                    if !pinned.tools.iter().any(|t| &t.name == name) {
                        problem(
                            id,
                            format!(
                                "mcp server {:?} has no tool {name:?} in its pinned list",
                                server.name
                            ),
                        );
                    }
                }
            }
            if offer.tools.as_ref().is_some_and(Vec::is_empty) {
                problem(
                    id,
                    format!(
                        "mcp offers no tool of server {:?} (an empty list)",
                        server.name
                    ),
                );
            }
        }
        if node.tool == MCP_TOOL {
            let server = node.config.get("server").and_then(Value::as_str);
            match server {
                Some(name) if servers.iter().any(|s| s.name == name) => {}
                Some(name) => problem(id, format!("config.server {name:?} is not in mcp_servers")),
                None => problem(
                    id,
                    "an mcp node needs config.server (a name in mcp_servers)".into(),
                ),
            }
            if !node
                .config
                .get("tool")
                .and_then(Value::as_str)
                .is_some_and(|t| !t.is_empty() && t.len() <= MAX_TOOL_NAME_BYTES)
            {
                problem(
                    id,
                    "an mcp node needs config.tool (the server's tool name)".into(),
                );
            }
            if let Value::Object(map) = &node.config {
                for key in map.keys() {
                    if key != "server" && key != "tool" {
                        problem(
                            id,
                            format!("config.{key}: an mcp node's config has only server and tool (the server's url and auth are in mcp_servers)"),
                        );
                    }
                }
            }
        }
    }
}

/// Servers some node offers whose tools are not pinned yet: publishing pins them.
pub fn unpinned<'g>(servers: &'g [McpServer], nodes: &[Node]) -> Vec<&'g str> {
    let wanted = wanted(servers, nodes);
    servers
        .iter()
        .filter(|s| wanted.contains_key(&s.name))
        .filter(|s| s.pinned.is_none())
        .map(|s| s.name.as_str())
        .collect()
}

/// What a model reads of a tool step's output (the tool message, or `tool_result`
/// block): its canonical JSON; for an `mcp` step, the text of its result's content when
/// every item is text (as MCP clients hand a tool's answer to a model), else its
/// structured content, else its content, as JSON.
pub fn model_text(tool: &str, output: &Value) -> String {
    if tool != MCP_TOOL {
        return json::canonical(output);
    }
    let content = output.get("content").and_then(Value::as_array);
    let texts: Option<Vec<&str>> = content.map(|items| {
        items
            .iter()
            .filter_map(|i| (i["type"] == "text").then(|| i["text"].as_str()).flatten())
            .collect()
    });
    match (content, texts) {
        (Some(items), Some(texts)) if !items.is_empty() && texts.len() == items.len() => {
            texts.join("\n")
        }
        _ => match output.get("structuredContent") {
            Some(structured) => json::canonical(structured),
            None => json::canonical(output.get("content").unwrap_or(output)),
        },
    }
}
