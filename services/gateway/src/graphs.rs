//! Which graphs are published, so a start naming an unknown graph is answered 422 without
//! publishing anything. The reducer's [`GraphTable`] is blocking: it runs on its own thread
//! and shares a snapshot of the graphs. A start's graph is resolved in its tenant's
//! namespace, then the global one (`Graphs::resolve`); a run's by the id it pinned. With a keyring it takes only graphs a
//! publisher key signed (and, with `--require-signatures`, no unsigned one), as the
//! reducers do (`sortie_catalog::Trust`); the keyring file is read again when it changes.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use sortie_catalog::{GraphTable, Publication, Trust};
use sortie_core::graph::{Access, OnReject};
use sortie_core::{Graph, Graphs};
use sortie_kafka::KafkaConfig;
use sortie_wire::signing::KeyringFile;
use sortie_wire::{Codec, Topics};
use tokio::runtime::Handle;
use tokio::sync::oneshot;

const POLL: Duration = Duration::from_millis(500);
/// How often the keyring file is looked at for a change.
const KEYRING_RECHECK: Duration = Duration::from_secs(2);

/// The published graphs as far as this gateway knows.
#[derive(Debug)]
pub struct Catalog {
    /// The published definitions (the inbox tells what rejecting a proposal does).
    graphs: RwLock<Graphs>,
    /// Who published each version, and the key whose signature the table verified.
    publications: RwLock<BTreeMap<String, Publication>>,
    /// The table caught up at least once; before that nothing is refused for its graph.
    loaded: AtomicBool,
    refresh: mpsc::Sender<oneshot::Sender<()>>,
}

impl Catalog {
    /// Starts the table's thread; it ends when `stop` is set.
    pub fn start(
        kafka: KafkaConfig,
        topics: Topics,
        codec: Arc<Codec>,
        runtime: Handle,
        stop: Arc<AtomicBool>,
        keyring: Option<(KeyringFile, bool)>,
    ) -> Arc<Catalog> {
        let (refresh, requests) = mpsc::channel();
        let catalog = Arc::new(Catalog {
            graphs: RwLock::new(Graphs::new()),
            publications: RwLock::new(BTreeMap::new()),
            loaded: AtomicBool::new(false),
            refresh,
        });
        let shared = catalog.clone();
        std::thread::Builder::new()
            .name("gateway-graphs".into())
            .spawn(move || {
                follow(
                    &shared, &kafka, &topics, codec, runtime, &stop, &requests, keyring,
                )
            })
            .map_err(|error| tracing::error!(%error, "Cannot start the graph table thread."))
            .ok();
        catalog
    }

    /// `Some(true)`: `tenant` can start the graph (its own or a global one); `Some(false)`:
    /// not as far as the table knows; `None`: the table has not loaded (no answer).
    pub fn knows(&self, tenant: &str, graph_id: &str, version: Option<u32>) -> Option<bool> {
        if !self.loaded.load(Ordering::Acquire) {
            return None;
        }
        let graphs = self.graphs.read().unwrap_or_else(|e| e.into_inner());
        Some(graphs.resolve(tenant, graph_id, version).is_some())
    }

    /// Reads the graphs topic up to its end now (a graph published a moment ago), at most
    /// `timeout`.
    pub async fn refresh(&self, timeout: Duration) {
        let (tx, rx) = oneshot::channel();
        if self.refresh.send(tx).is_ok() {
            let _ = tokio::time::timeout(timeout, rx).await;
        }
    }

    /// What rejecting an approval of `node` does, when the graph version is known here.
    pub fn on_reject(&self, graph_id: &str, version: u32, node: &str) -> Option<OnReject> {
        let graphs = self.graphs.read().unwrap_or_else(|e| e.into_inner());
        graphs
            .get(graph_id, Some(version))
            .and_then(|g| g.node(node))
            .map(|n| n.on_reject.clone())
    }

    /// Whether `node` of the graph version is a tool loop (it offers its model tools), when
    /// the graph version is known here.
    pub fn is_tool_loop(&self, graph_id: &str, version: u32, node: &str) -> Option<bool> {
        let graphs = self.graphs.read().unwrap_or_else(|e| e.into_inner());
        let graph = graphs.get(graph_id, Some(version))?;
        graph.node(node).map(|n| graph.is_tool_loop(n))
    }

    /// The node of the graph version that takes signal `name` (a waiting node, or a
    /// conversation): `Some(None)` when the version is known here and takes no such
    /// signal, `None` when the version is not known.
    pub fn signal_taker(
        &self,
        graph_id: &str,
        version: u32,
        name: &str,
    ) -> Option<Option<sortie_core::Node>> {
        let graphs = self.graphs.read().unwrap_or_else(|e| e.into_inner());
        let graph = graphs.get(graph_id, Some(version))?;
        Some(graph.waiting_for(name).cloned())
    }

    /// The correlation label of the graph `tenant` starts (its latest version for `None`):
    /// `Some(None)` when the graph is known here and declares none.
    pub fn correlation(
        &self,
        tenant: &str,
        graph_id: &str,
        version: Option<u32>,
    ) -> Option<Option<String>> {
        let graphs = self.graphs.read().unwrap_or_else(|e| e.into_inner());
        graphs
            .resolve(tenant, graph_id, version)
            .map(|g| g.correlation.clone())
    }

    /// Who may start and cancel runs of the graph `tenant` starts (its latest version for
    /// `None`), when the graph is known here.
    pub fn access(&self, tenant: &str, graph_id: &str, version: Option<u32>) -> Option<Access> {
        let graphs = self.graphs.read().unwrap_or_else(|e| e.into_inner());
        graphs
            .resolve(tenant, graph_id, version)
            .map(|g| g.access.clone())
    }

    /// Who may cancel a run of the graph version it pinned, when it is known here.
    pub fn pinned_access(&self, pinned_id: &str, version: u32) -> Option<Access> {
        let graphs = self.graphs.read().unwrap_or_else(|e| e.into_inner());
        graphs
            .get(pinned_id, Some(version))
            .map(|g| g.access.clone())
    }

    /// A graph version as published, and its publication (`audit why`'s graph link).
    pub fn version(&self, graph_id: &str, version: u32) -> (Option<Graph>, Option<Publication>) {
        let graphs = self.graphs.read().unwrap_or_else(|e| e.into_inner());
        let publications = self.publications.read().unwrap_or_else(|e| e.into_inner());
        (
            graphs.get(graph_id, Some(version)).cloned(),
            publications.get(&format!("{graph_id}@{version}")).cloned(),
        )
    }

    fn update(&self, table: &GraphTable) {
        *self.graphs.write().unwrap_or_else(|e| e.into_inner()) = table.graphs().clone();
        let publications = table
            .graphs()
            .all()
            .filter_map(|g| table.publication(&g.key()).map(|p| (g.key(), p.clone())))
            .collect();
        *self.publications.write().unwrap_or_else(|e| e.into_inner()) = publications;
    }
}

#[allow(clippy::too_many_arguments)]
fn follow(
    catalog: &Catalog,
    kafka: &KafkaConfig,
    topics: &Topics,
    codec: Arc<Codec>,
    runtime: Handle,
    stop: &AtomicBool,
    requests: &mpsc::Receiver<oneshot::Sender<()>>,
    mut keyring: Option<(KeyringFile, bool)>,
) {
    let trust = |keyring: &Option<(KeyringFile, bool)>| {
        keyring.as_ref().map(|(file, require)| Trust {
            keyring: file.ring().clone(),
            require: *require,
        })
    };
    let mut table = loop {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        match GraphTable::open(kafka, topics, codec.clone(), runtime.clone()) {
            Ok(mut table) => {
                table.set_trust(trust(&keyring));
                break table;
            }
            Err(error) => {
                tracing::warn!(%error, "The graph table does not open yet; retrying.");
                std::thread::sleep(Duration::from_secs(1));
            }
        }
    };
    while !stop.load(Ordering::Relaxed) && !catalog.loaded.load(Ordering::Relaxed) {
        match table.catch_up(Duration::from_secs(30)) {
            Ok(_) => {
                catalog.update(&table);
                catalog.loaded.store(true, Ordering::Release);
                tracing::info!(
                    graphs = table.graphs().all().count(),
                    "The graph table caught up."
                );
            }
            Err(error) => tracing::warn!(%error, "The graph table did not catch up; retrying."),
        }
    }
    while !stop.load(Ordering::Relaxed) {
        if let Some((file, _)) = &mut keyring {
            match file.refresh(KEYRING_RECHECK) {
                Ok(true) => {
                    tracing::info!(path = %file.path().display(), "Graph keyring changed; reloaded.");
                    table.set_trust(trust(&keyring));
                }
                Ok(false) => {}
                Err(error) => {
                    tracing::warn!(%error, "The graph keyring changed but does not load; keeping the last good one.");
                }
            }
        }
        crate::metrics::graphs_untrusted(table.untrusted());
        match requests.recv_timeout(POLL) {
            Ok(reply) => {
                if let Err(error) = table.catch_up(Duration::from_secs(3)) {
                    tracing::warn!(%error, "Refreshing the graph table failed.");
                }
                catalog.update(&table);
                let _ = reply.send(());
            }
            Err(RecvTimeoutError::Timeout) => {
                if table.poll() > 0 {
                    catalog.update(&table);
                }
            }
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}
