//! The published graphs: each version under its pinned id, and which graph a tenant's
//! start resolves to.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{Graph, GraphError};

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
