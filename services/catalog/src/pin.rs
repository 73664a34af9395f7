//! Pinning: the tool lists of the MCP servers a graph offers, read when it is published
//! and written into its definition.

use std::time::Duration;

use sortie_core::graph::InvalidGraph;
use sortie_core::Graph;

use crate::Error;

/// How long listing one MCP server's tools may take when pinning.
const MCP_LIST_TIMEOUT: Duration = Duration::from_secs(30);

/// `graph` with the tool list of every MCP server it offers pinned (see
/// `sortie_core::mcp`): `tools/list` is read now, bounded, and the offered tools'
/// names, descriptions and input schemas are written into the definition with their hash.
/// A graph with nothing to pin comes back as it is. The auth header's value is read from
/// the publisher's environment, as the executor reads it from its own.
pub async fn pin(graph: &Graph) -> Result<Graph, Error> {
    let key = graph.key();
    let mut pinned = graph.clone();
    for (server_name, wanted) in graph.mcp_tools_to_pin() {
        let Some(server) = graph
            .mcp_servers
            .iter()
            .find(|s| s.name == server_name && s.pinned.is_none())
        else {
            continue;
        };
        let mut headers = Vec::new();
        if let Some(auth) = &server.auth {
            // Only a secret variable is ever sent (`sortie_core::secret`): a graph file must
            // not make its publisher send `HOME` or a cloud key to the graph's own URL.
            if !auth.env.starts_with(sortie_core::secret::PREFIX) {
                return Err(Error::McpSecretName {
                    key: key.clone(),
                    server: server.name.clone(),
                    env: auth.env.clone(),
                });
            }
            let secret = std::env::var(&auth.env).map_err(|_| Error::McpSecret {
                key: key.clone(),
                server: server.name.clone(),
                env: auth.env.clone(),
            })?;
            let value = match &auth.scheme {
                Some(scheme) => format!("{scheme} {secret}"),
                None => secret,
            };
            headers.push((auth.header.clone(), value));
        }
        let endpoint = sortie_mcp::Endpoint {
            url: server.url.clone(),
            headers,
        };
        let listed = sortie_mcp::list_tools(
            &endpoint,
            sortie_core::mcp::MAX_PINNED_TOOLS,
            MCP_LIST_TIMEOUT,
        )
        .await
        .map_err(|source| Error::McpList {
            key: key.clone(),
            server: server.name.clone(),
            source,
        })?;
        // Only the offered tools are pinned, in the server's order.
        let tools: Vec<_> = listed
            .into_iter()
            .filter(|t| wanted.as_ref().is_none_or(|w| w.contains(&t.name)))
            .collect();
        if let Some(wanted) = &wanted {
            if let Some(missing) = wanted.iter().find(|w| !tools.iter().any(|t| &t.name == *w)) {
                return Err(Error::McpPinned {
                    key,
                    source: InvalidGraph(vec![sortie_core::GraphError {
                        node: None,
                        problem: format!(
                            "mcp server {:?} does not list the offered tool {missing:?}",
                            server.name
                        ),
                    }]),
                });
            }
        }
        tracing::info!(
            graph = %key,
            server = %server.name,
            tools = tools.len(),
            "Pinned an MCP server's tools into the graph version."
        );
        pinned = pinned
            .with_pinned(&server.name, sortie_core::mcp::Pinned::new(tools))
            .map_err(|source| Error::McpPinned {
                key: key.clone(),
                source,
            })?;
    }
    Ok(pinned)
}
