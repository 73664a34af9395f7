//! What a tool-loop node offers its model: the nodes and pinned MCP tools it may call, and
//! their specs in the shape of the model's API.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::{Graph, InvalidGraph, ModelApi, Node};
use crate::mcp;

impl Graph {
    /// One node per pinned tool some node offers (each once, whoever offers it).
    pub(super) fn derive_mcp_nodes(&self) -> Vec<Node> {
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
}
