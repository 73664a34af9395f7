//! Several local brokers on one machine forming one KRaft cluster (every node a broker
//! and a voter), for replication and leader-failure tests.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::process::{signal, FileLock};
use super::setup::{configured_port, random_cluster_id};
use super::{io_err, resolve, BrokerConfig, LocalBroker, Result, Running};
use rustix::process::Signal;

/// Several local brokers forming one KRaft cluster: node `i` (1-based) lives in
/// `<data_dir>/node-<i>`, every node is broker and controller (a voter), and the cluster
/// id is kept in `<data_dir>/cluster.id` so restarts rejoin the same cluster.
#[derive(Debug, Clone)]
pub struct LocalCluster {
    data_dir: PathBuf,
    nodes: Vec<LocalBroker>,
}

impl LocalCluster {
    /// A cluster of `ports.len()` nodes; node `i` listens on `ports[i - 1]` (PLAINTEXT,
    /// controller). Internal topics get replication factor min(nodes, 3). Creates the
    /// data dir and the cluster id if missing.
    pub fn new(
        data_dir: impl Into<PathBuf>,
        ports: &[(u16, u16)],
        pom: impl Into<PathBuf>,
        libs_dir: Option<PathBuf>,
    ) -> Result<Self> {
        let data_dir = resolve(&data_dir.into());
        fs::create_dir_all(&data_dir).map_err(io_err("creating", &data_dir))?;
        let id_file = data_dir.join("cluster.id");
        let cluster_id = match fs::read_to_string(&id_file) {
            Ok(id) if !id.trim().is_empty() => id.trim().to_owned(),
            _ => {
                let id = random_cluster_id()?;
                fs::write(&id_file, format!("{id}\n")).map_err(io_err("writing", &id_file))?;
                id
            }
        };
        let pom = pom.into();
        let voters: Vec<(i32, u16)> = ports
            .iter()
            .enumerate()
            .map(|(i, &(_, controller))| (i as i32 + 1, controller))
            .collect();
        let replication = ports.len().min(3) as u16;
        let nodes = ports
            .iter()
            .enumerate()
            .map(|(i, &(port, controller_port))| {
                let mut config =
                    BrokerConfig::new(data_dir.join(format!("node-{}", i + 1)), port, pom.clone());
                config.controller_port = controller_port;
                config.node_id = i as i32 + 1;
                config.voters = voters.clone();
                config.cluster_id = Some(cluster_id.clone());
                config.replication = replication;
                config.heap = "512m".to_owned();
                config.libs_dir = Some(libs_dir.clone().unwrap_or_else(|| data_dir.join("libs")));
                config.start_timeout = Duration::from_secs(90);
                LocalBroker::new(config)
            })
            .collect();
        Ok(Self { data_dir, nodes })
    }

    /// The node ports a cluster in `data_dir` was configured with, in node order; empty
    /// when no cluster was ever configured there.
    pub fn configured_ports(data_dir: &Path) -> Vec<(u16, u16)> {
        (1..)
            .map(|i| data_dir.join(format!("node-{i}")))
            .take_while(|dir| dir.join("server.properties").exists())
            .filter_map(|dir| {
                let port = configured_port(&dir)?;
                let text = fs::read_to_string(dir.join("server.properties")).ok()?;
                let controller = text
                    .lines()
                    .find_map(|l| l.strip_prefix("listeners="))?
                    .split(',')
                    .find_map(|l| l.strip_prefix("CONTROLLER://"))?
                    .rsplit_once(':')?
                    .1
                    .trim()
                    .parse()
                    .ok()?;
                Some((port, controller))
            })
            .collect()
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    pub fn nodes(&self) -> &[LocalBroker] {
        &self.nodes
    }

    /// Node `id` (1-based).
    pub fn node(&self, id: i32) -> Option<&LocalBroker> {
        self.nodes.iter().find(|n| n.config.node_id == id)
    }

    /// Every node's address, comma-separated: the value for `bootstrap.servers`.
    pub fn bootstrap(&self) -> String {
        self.nodes
            .iter()
            .map(LocalBroker::bootstrap)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Every node's data-dir lock, in node order (so two callers never deadlock).
    fn lock_all(&self) -> Result<Vec<FileLock>> {
        self.nodes.iter().map(LocalBroker::lock).collect()
    }

    /// Starts every node that does not run (no node can be ready before a quorum of
    /// controllers is up, so all are spawned first, then awaited) and reuses the ones
    /// that do. Serialised per node by each data dir's lock.
    pub fn ensure_running(&self) -> Result<Vec<Running>> {
        let locks = self.lock_all()?;
        let mut spawned = Vec::new();
        for node in &self.nodes {
            match node.read_pid() {
                Some(pid) if node.is_alive(pid) => spawned.push((pid, true)),
                stale => {
                    if stale.is_some() {
                        let pid_file = node.path("broker.pid");
                        fs::remove_file(&pid_file).map_err(io_err("removing", &pid_file))?;
                    }
                    match node.spawn_locked() {
                        Ok(pid) => spawned.push((pid, false)),
                        Err(error) => {
                            for (node, (pid, reused)) in self.nodes.iter().zip(&spawned) {
                                if !reused {
                                    let _ = node.kill_pid(*pid);
                                }
                            }
                            return Err(error);
                        }
                    }
                }
            }
        }
        let mut running = Vec::new();
        for (node, &(pid, reused)) in self.nodes.iter().zip(&spawned) {
            if reused {
                node.wait_ready(pid, node.config.start_timeout)?;
            } else {
                node.await_started(pid)?;
            }
            running.push(Running {
                pid,
                bootstrap: node.bootstrap(),
                reused,
            });
        }
        drop(locks);
        Ok(running)
    }

    /// Stops every node (SIGTERM, then SIGKILL after the stop timeout); data is kept.
    /// Returns the pids that were running. All nodes are told at once: the last one of a
    /// KRaft quorum cannot finish a controlled shutdown alone, so stopping them one after
    /// another would leave it waiting for the SIGKILL.
    pub fn stop(&self) -> Result<Vec<u32>> {
        let locks = self.lock_all()?;
        let mut live = Vec::new();
        for node in &self.nodes {
            if let Some(pid) = node.read_pid().filter(|&pid| node.is_alive(pid)) {
                tracing::info!(
                    pid,
                    node = node.config.node_id,
                    "Stopping a node of the local Kafka cluster."
                );
                signal(pid, Signal::TERM);
                live.push((node, pid));
            }
        }
        for (node, pid) in &live {
            if !node.wait_gone(*pid, node.config.stop_timeout) {
                tracing::warn!(pid, "A node ignored SIGTERM; sending SIGKILL.");
                node.kill_pid(*pid)?;
            }
        }
        for node in &self.nodes {
            let pid_file = node.path("broker.pid");
            if pid_file.exists() {
                fs::remove_file(&pid_file).map_err(io_err("removing", &pid_file))?;
            }
        }
        drop(locks);
        Ok(live.into_iter().map(|(_, pid)| pid).collect())
    }
}
