//! Brokers of a test's own: one it can stop, restart and kill, and a three-node cluster.

#[allow(unused_imports)]
use super::*;

/// A broker of a test's own (data dir under `target/test-runs`, free ports, the shared test
/// broker's jars), for tests that stop and start it: the shared broker must stay up for the
/// suites running beside them. Stopped (SIGTERM, then SIGKILL) and deleted when dropped.
#[derive(Debug)]
pub struct PrivateBroker {
    pub broker: sortie_devkit::local::LocalBroker,
}

impl PrivateBroker {
    /// Formats and starts it; returns once it answers metadata requests.
    pub async fn start(name: &str) -> PrivateBroker {
        let data = crate::workspace_root()
            .join("target")
            .join("test-runs")
            .join(crate::unique_prefix(&format!("broker-{name}")).trim_end_matches('.'));
        std::fs::create_dir_all(&data).expect("broker data dir");
        // Both bound before either is released, so they differ.
        let bind = || std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
        let (a, b) = (bind(), bind());
        let port = |l: &std::net::TcpListener| l.local_addr().expect("local addr").port();
        let mut config = sortie_devkit::local::BrokerConfig::new(
            &data,
            port(&a),
            crate::workspace_root().join("dev/kafka/pom.xml"),
        );
        config.controller_port = port(&b);
        config.libs_dir = Some(crate::test_broker().libs_dir());
        drop((a, b));
        let private = PrivateBroker {
            broker: sortie_devkit::local::LocalBroker::new(config),
        };
        private.ensure_running().await;
        private
    }

    pub fn bootstrap(&self) -> String {
        self.broker.bootstrap()
    }

    /// Starts it on its existing data (or finds it running).
    pub async fn ensure_running(&self) {
        let broker = self.broker.clone();
        tokio::task::spawn_blocking(move || broker.ensure_running())
            .await
            .expect("the start task panicked")
            .unwrap_or_else(|e| panic!("starting the private broker: {e}"));
    }

    /// A clean stop (SIGTERM; SIGKILL after the stop timeout), keeping its data.
    pub async fn stop(&self) {
        let broker = self.broker.clone();
        tokio::task::spawn_blocking(move || broker.stop())
            .await
            .expect("the stop task panicked")
            .unwrap_or_else(|e| panic!("stopping the private broker: {e}"));
    }
}

impl Drop for PrivateBroker {
    fn drop(&mut self) {
        match self.broker.stop() {
            Ok(_) => {
                let _ = std::fs::remove_dir_all(self.broker.data_dir());
            }
            Err(e) => eprintln!("stopping the private broker: {e}"),
        }
    }
}

/// A KRaft cluster of the test's own on free ports: node `i` is broker and controller.
/// Stopped, and its data removed, when dropped.
#[derive(Debug)]
pub struct PrivateCluster {
    pub cluster: sortie_devkit::local::LocalCluster,
}

impl PrivateCluster {
    /// Formats and starts `nodes` nodes; returns once every node answers.
    pub async fn start(name: &str, nodes: usize) -> PrivateCluster {
        let data = crate::workspace_root()
            .join("target")
            .join("test-runs")
            .join(crate::unique_prefix(&format!("cluster-{name}")).trim_end_matches('.'));
        // Every port bound before any is released, so they all differ.
        let listeners: Vec<std::net::TcpListener> = (0..2 * nodes)
            .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port"))
            .collect();
        let port = |l: &std::net::TcpListener| l.local_addr().expect("local addr").port();
        let ports: Vec<(u16, u16)> = listeners
            .chunks(2)
            .map(|pair| (port(&pair[0]), port(&pair[1])))
            .collect();
        drop(listeners);
        let cluster = sortie_devkit::local::LocalCluster::new(
            &data,
            &ports,
            crate::workspace_root().join("dev/kafka/pom.xml"),
            Some(crate::test_broker().libs_dir()),
        )
        .expect("cluster config");
        let private = PrivateCluster { cluster };
        private.ensure_running().await;
        private
    }

    pub fn bootstrap(&self) -> String {
        self.cluster.bootstrap()
    }

    /// Starts every node that is not running (e.g. one the test killed), on its data.
    pub async fn ensure_running(&self) {
        let cluster = self.cluster.clone();
        tokio::task::spawn_blocking(move || cluster.ensure_running())
            .await
            .expect("the start task panicked")
            .unwrap_or_else(|e| panic!("starting the private cluster: {e}"));
    }

    /// SIGKILLs node `id`; returns its pid.
    pub async fn kill(&self, id: i32) -> u32 {
        let node = self.cluster.node(id).expect("no such node").clone();
        tokio::task::spawn_blocking(move || node.kill())
            .await
            .expect("the kill task panicked")
            .unwrap_or_else(|e| panic!("killing node {id}: {e}"))
            .expect("the node was running")
    }

    /// Per partition of `topic`: (leader, replicas, in-sync replicas), as the cluster
    /// reports them now.
    pub async fn partitions(&self, topic: &str) -> BTreeMap<i32, (i32, Vec<i32>, Vec<i32>)> {
        let (bootstrap, topic) = (self.bootstrap(), topic.to_owned());
        tokio::task::spawn_blocking(move || {
            let consumer: BaseConsumer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &bootstrap)
                .create()
                .expect("metadata client");
            let metadata = consumer
                .fetch_metadata(Some(&topic), Duration::from_secs(10))
                .expect("metadata");
            metadata
                .topics()
                .iter()
                .flat_map(|t| t.partitions())
                .map(|p| {
                    (
                        p.id(),
                        (p.leader(), p.replicas().to_vec(), p.isr().to_vec()),
                    )
                })
                .collect()
        })
        .await
        .expect("the metadata task panicked")
    }

    /// Waits until every partition of every topic named has all its replicas in sync.
    pub async fn wait_in_sync(&self, topics: &[String], deadline: Duration) {
        crate::wait_until("every replica back in sync", deadline, || async {
            for topic in topics {
                for (_, replicas, isr) in self.partitions(topic).await.values() {
                    if isr.len() < replicas.len() {
                        return false;
                    }
                }
            }
            true
        })
        .await;
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        match self.cluster.stop() {
            Ok(_) => {
                let _ = std::fs::remove_dir_all(self.cluster.data_dir());
            }
            Err(e) => eprintln!("stopping the private cluster: {e}"),
        }
    }
}

/// The effects `ledger` recorded for operations no run knows of (each a problem line).
pub fn unknown_effects(
    ledger: &str,
    snapshot: &sortie_devkit::ledger::Snapshot,
    known: &BTreeSet<String>,
) -> Vec<String> {
    snapshot
        .calls
        .iter()
        .filter(|c| c.effect)
        .map(|c| c.operation_id.clone().unwrap_or_default())
        .filter(|op| !known.contains(op))
        .map(|op| format!("ledger {ledger}: an effect of unknown operation {op}"))
        .collect()
}

impl Stack {
    /// Waits until every run in `runs` has a committed `RunStatusChanged` to `Succeeded`,
    /// reading events (for tests whose state table holds records `states` cannot read).
    pub async fn wait_succeeded_by_events(&self, what: &str, runs: &[String], deadline: Duration) {
        crate::wait_until(what, deadline, || async {
            let events = self.events().await;
            runs.iter().all(|run| {
                events.get(run).is_some_and(|history| {
                    history.iter().any(|e| {
                        matches!(
                            e.body,
                            sortie_core::EventBody::RunStatusChanged {
                                status: sortie_core::RunStatus::Succeeded,
                                ..
                            }
                        )
                    })
                })
            })
        })
        .await;
    }
}
