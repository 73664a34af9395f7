//! A Sortie stack for integration tests: the real broker, a schema registry, the topology
//! under a unique prefix, published graphs, reducer processes, and a test executor that
//! answers intents. Each test gets its own stack, so tests run in parallel.

pub use sortie_kafka::clock::now_ms;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::Message;
use sortie_core::{Graph, RunState};
use sortie_kafka::topology::{Overrides, Topology};
use sortie_kafka::KafkaConfig;
use sortie_wire::records as w;
use sortie_wire::{partition_for, Codec, CodecConfig, Topics};

use crate::{Isolation, ServedRegistry};

mod audit;
mod brokers;
mod chaos;
mod commands;
mod gateway;
mod metrics;
mod process;
mod services;

pub use audit::*;
pub use brokers::*;
pub use chaos::*;
pub use commands::*;
pub use metrics::*;
pub use process::*;
pub use services::*;

/// The run partitions of [`Stack::start`] (see [`StackBuilder::partitions`]).
pub const PARTITIONS: u32 = 3;

/// The `sortie` binary, built once per test process.
pub fn sortie_bin() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let root = crate::workspace_root();
            let status = Command::new(env!("CARGO"))
                .args(["build", "-q", "-p", "sortie"])
                .current_dir(&root)
                .status()
                .expect("cargo build runs");
            assert!(status.success(), "building the sortie binary failed");
            root.join("target").join("debug").join("sortie")
        })
        .clone()
}

/// The executor of your own that `examples/rust-executor` builds (a project outside the
/// workspace, on the workspace's target directory so it reuses what is built), built once
/// per test process.
pub fn own_executor_bin() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let root = crate::workspace_root();
            let status = Command::new(env!("CARGO"))
                .args(["build", "-q", "--locked", "--manifest-path"])
                .arg(root.join("examples/rust-executor/Cargo.toml"))
                .env("CARGO_TARGET_DIR", root.join("target"))
                .current_dir(&root)
                .status()
                .expect("cargo build runs");
            assert!(
                status.success(),
                "building examples/rust-executor failed; after a dependency change of \
                 sortie-executor, refresh its lock file: cp Cargo.lock examples/rust-executor/ \
                 && cargo metadata --manifest-path examples/rust-executor/Cargo.toml >/dev/null"
            );
            root.join("target").join("debug").join("my-executor")
        })
        .clone()
}

#[derive(Debug)]
pub struct Stack {
    pub bootstrap: String,
    pub prefix: String,
    /// The run partitions (commands, step-results, run-state, run-events).
    pub partitions: u32,
    /// The executor queues the topology declares (one intents topic each).
    pub queues: Vec<String>,
    pub topics: Topics,
    pub kafka: KafkaConfig,
    pub registry: ServedRegistry,
    pub codec: Arc<Codec>,
    pub dir: PathBuf,
}

impl Stack {
    /// Broker, registry, topology (3 run partitions) and the given graphs: the stack most
    /// tests want. Any other shape: [`Stack::builder`].
    pub async fn start(name: &str, graphs: &[&str]) -> Stack {
        Stack::builder(name).graphs(graphs).start().await
    }

    /// A stack of another shape: on a broker of the test's own, with more run partitions,
    /// or with every topic replicated.
    pub fn builder(name: &str) -> StackBuilder<'_> {
        StackBuilder {
            name,
            graphs: Vec::new(),
            bootstrap: None,
            partitions: PARTITIONS,
            replication: None,
        }
    }
}

/// How a [`Stack`] is made (see [`Stack::builder`]).
#[must_use]
#[derive(Debug)]
pub struct StackBuilder<'a> {
    name: &'a str,
    graphs: Vec<&'a str>,
    bootstrap: Option<String>,
    partitions: u32,
    replication: Option<(u16, u16)>,
}

impl<'a> StackBuilder<'a> {
    /// Graphs (YAML) published, signed by the harness's publisher key, before the start.
    pub fn graphs(mut self, graphs: &[&'a str]) -> Self {
        self.graphs.extend_from_slice(graphs);
        self
    }

    /// On another broker (e.g. a [`PrivateBroker`] a test restarts); default: the suite's.
    pub fn on(mut self, bootstrap: String) -> Self {
        self.bootstrap = Some(bootstrap);
        self
    }

    /// `partitions` run partitions (e.g. 12, enough for several reducers to share them and
    /// to move between them on every rebalance); default [`PARTITIONS`].
    pub fn partitions(mut self, partitions: u32) -> Self {
        self.partitions = partitions;
        self
    }

    /// Every topic replicated `factor` times with `min.insync.replicas` = `min_insync`
    /// (e.g. 3 and 2 on a [`PrivateCluster`]); default: the topology's own (1).
    pub fn replicated(mut self, factor: u16, min_insync: u16) -> Self {
        self.replication = Some((factor, min_insync));
        self
    }

    /// Applies the topology under a unique prefix, starts a registry, publishes the graphs.
    pub async fn start(self) -> Stack {
        let StackBuilder {
            name,
            graphs,
            bootstrap,
            partitions,
            replication,
        } = self;
        let bootstrap = match bootstrap {
            Some(bootstrap) => bootstrap,
            None => crate::bootstrap().await,
        };
        let prefix = crate::unique_prefix(name);
        let kafka = KafkaConfig::new(bootstrap.clone());
        let registry = ServedRegistry::start(&kafka, &format!("{prefix}_schemas"))
            .await
            .expect("registry");
        let topology = Topology::load(crate::workspace_root().join("topology/topics.yaml"))
            .and_then(|t| {
                t.with_overrides(&Overrides {
                    prefix: Some(prefix.clone()),
                    run_partitions: Some(partitions),
                    intent_partitions: None,
                    replication_factor: replication.map(|r| r.0),
                    min_insync_replicas: replication.map(|r| r.1),
                })
            })
            .expect("topology");
        let report = topology.apply(&kafka).await.expect("topology apply");
        assert!(report.is_complete(), "topology apply left work: {report:?}");
        let queues = topology.queues().to_vec();
        let codec = Arc::new(Codec::new(&CodecConfig {
            registry_url: registry.url.clone(),
            auto_register: true,
        }));
        let topics = Topics::new(prefix.clone());
        for text in &graphs {
            let graph = Graph::parse(text).expect("test graph is valid");
            publish_signed(&kafka, &codec, &topics, &graph).await;
        }
        let dir = crate::workspace_root()
            .join("target")
            .join("test-runs")
            .join(prefix.trim_end_matches('.'));
        std::fs::create_dir_all(&dir).expect("test dir");
        Stack {
            bootstrap,
            prefix,
            partitions,
            queues,
            topics,
            kafka,
            registry,
            codec,
            dir,
        }
    }
}

impl Stack {
    pub fn reducer(&self, instance: &str) -> Process {
        self.reducer_with(instance, &[])
    }

    /// [`Stack::reducer`] with extra arguments appended (e.g. `["--fault",
    /// "reducer.after_commit", "--fault-after", "3"]`). An extra `--commit-interval-ms` or
    /// `--session-timeout-ms` replaces the harness's (50 ms, 6 s).
    pub fn reducer_with(&self, instance: &str, extra: &[&str]) -> Process {
        let data = self.dir.join(format!("reducer-{instance}"));
        let mut args: Vec<&str> = vec![
            "reducer",
            "--bootstrap-servers",
            &self.bootstrap,
            "--registry-url",
            &self.registry.url,
            "--prefix",
            &self.prefix,
            "--data-dir",
            data.to_str().unwrap_or_default(),
            "--instance-id",
            instance,
            "--commit-interval-ms",
            "50",
            "--session-timeout-ms",
            "6000",
            "--metrics-addr",
            "127.0.0.1:0",
        ];
        for flag in ["--commit-interval-ms", "--session-timeout-ms"] {
            if extra.contains(&flag) {
                if let Some(at) = args.iter().position(|a| *a == flag) {
                    args.drain(at..at + 2);
                }
            }
        }
        args.extend_from_slice(extra);
        self.spawn(&format!("reducer-{instance}"), &args)
    }

    pub fn reducer_data(&self, instance: &str) -> PathBuf {
        self.dir.join(format!("reducer-{instance}"))
    }

    pub fn spawn(&self, name: &str, args: &[&str]) -> Process {
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        spawn_logged(self.dir.join(format!("{name}.log")), args)
    }

    /// Produces a command keyed by its run id with the Java-compatible partitioner.
    pub async fn send(&self, command: &w::RunCommand) {
        let bytes = self
            .codec
            .encode(&self.topics.commands(), command)
            .await
            .expect("encode command");
        crate::produce(
            &self.bootstrap,
            &self.topics.commands(),
            &[(command.run_id.clone(), bytes)],
        )
        .await;
    }

    /// Produces a command to an explicit partition (a client with another partitioner).
    pub async fn send_to(&self, command: &w::RunCommand, partition: i32) {
        let bytes = self
            .codec
            .encode(&self.topics.commands(), command)
            .await
            .expect("encode command");
        self.send_raw(
            &self.topics.commands(),
            Some(partition),
            command.run_id.as_bytes(),
            &bytes,
        )
        .await;
    }

    /// A command's value bytes, as the reducer will read them.
    pub async fn encode_command(&self, command: &w::RunCommand) -> Vec<u8> {
        self.codec
            .encode(&self.topics.commands(), command)
            .await
            .expect("encode command")
    }

    /// Produces `value` (a command's bytes) to `run_id`'s partition of the commands topic
    /// with `headers` (e.g. a signature).
    pub async fn send_command_bytes(
        &self,
        run_id: &str,
        value: &[u8],
        headers: &[(&str, Vec<u8>)],
    ) {
        use rdkafka::message::{Header, OwnedHeaders};
        let producer: FutureProducer = self.kafka.producer().create().expect("producer");
        let mut owned = OwnedHeaders::new();
        for (key, bytes) in headers {
            owned = owned.insert(Header {
                key,
                value: Some(bytes),
            });
        }
        let topic = self.topics.commands();
        let record = FutureRecord::to(&topic)
            .key(run_id.as_bytes())
            .payload(value)
            .partition(partition_for(run_id.as_bytes(), self.partitions))
            .headers(owned);
        producer
            .send(record, Duration::from_secs(10))
            .await
            .expect("delivered");
    }

    /// Produces `command` signed by `signer`.
    pub async fn send_signed(
        &self,
        command: &w::RunCommand,
        signer: &sortie_wire::signing::Signer,
    ) {
        let value = self.encode_command(command).await;
        let headers = signer.headers(&value);
        self.send_command_bytes(&command.run_id, &value, &headers)
            .await;
    }

    pub async fn send_raw(&self, topic: &str, partition: Option<i32>, key: &[u8], value: &[u8]) {
        let producer: FutureProducer = self.kafka.producer().create().expect("producer");
        let mut record = FutureRecord::to(topic).key(key).payload(value);
        if let Some(p) = partition {
            record = record.partition(p);
        }
        producer
            .send(record, Duration::from_secs(10))
            .await
            .expect("delivered");
    }

    /// The latest run-state record per run, decoded (read_committed).
    pub async fn states(&self) -> HashMap<String, RunState> {
        let mut out = HashMap::new();
        for message in crate::read_all(
            &self.bootstrap,
            &self.topics.run_state(),
            Isolation::ReadCommitted,
        )
        .await
        {
            // A record planted to be unreadable (tests of the quarantine) is no run's
            // state: the run is absent here, as it is in the reducer.
            let Ok(record) = self.codec.decode::<w::RunState>(message.payload()).await else {
                eprintln!(
                    "states: skipped an undecodable run-state record at {}",
                    message.offset()
                );
                continue;
            };
            let state = sortie_model::state_from_wire(&record).expect("state json");
            out.insert(record.run_id.clone(), state);
        }
        out
    }

    /// Every run event, decoded, grouped by run in log order (read_committed).
    pub async fn events(&self) -> BTreeMap<String, Vec<sortie_core::Event>> {
        let mut out: BTreeMap<String, Vec<sortie_core::Event>> = BTreeMap::new();
        for message in crate::read_all(
            &self.bootstrap,
            &self.topics.run_events(),
            Isolation::ReadCommitted,
        )
        .await
        {
            let record: w::RunEvent = self
                .codec
                .decode(message.payload())
                .await
                .expect("decode run-event");
            let event = sortie_model::event_from_wire(record).expect("event");
            out.entry(event.run_id.clone()).or_default().push(event);
        }
        out
    }

    /// Every intent of a queue (read_committed).
    pub async fn intents(&self, queue: &str) -> Vec<w::StepIntent> {
        let mut out = Vec::new();
        for message in crate::read_all(
            &self.bootstrap,
            &self.topics.intents(queue),
            Isolation::ReadCommitted,
        )
        .await
        {
            out.push(
                self.codec
                    .decode::<w::StepIntent>(message.payload())
                    .await
                    .expect("decode intent"),
            );
        }
        out
    }

    /// Every step result (read_committed).
    pub async fn results(&self) -> Vec<w::StepResult> {
        let mut out = Vec::new();
        for message in crate::read_all(
            &self.bootstrap,
            &self.topics.step_results(),
            Isolation::ReadCommitted,
        )
        .await
        {
            if let Some(payload) = message.payload() {
                out.push(
                    self.codec
                        .decode::<w::StepResult>(Some(payload))
                        .await
                        .expect("decode step result"),
                );
            }
        }
        out
    }

    pub async fn dead_letters(&self) -> Vec<w::DeadLetter> {
        let mut out = Vec::new();
        for message in crate::read_all(
            &self.bootstrap,
            &self.topics.dead_letters(),
            Isolation::ReadCommitted,
        )
        .await
        {
            out.push(
                self.codec
                    .decode::<w::DeadLetter>(message.payload())
                    .await
                    .expect("decode dead letter"),
            );
        }
        out
    }

    /// Waits until every run in `runs` has a state for which `done` holds.
    pub async fn wait_for_states(
        &self,
        what: &str,
        runs: &[String],
        deadline: Duration,
        done: impl Fn(&RunState) -> bool,
    ) -> HashMap<String, RunState> {
        crate::wait_for(what, deadline, || async {
            let states = self.states().await;
            runs.iter()
                .all(|r| states.get(r).is_some_and(&done))
                .then_some(states)
        })
        .await
    }

    /// A test executor for one queue: answers every intent with `answer(intent)` on the
    /// run's canonical partition of step-results, and records what it saw.
    pub fn executor(
        &self,
        queue: &str,
        answer: impl Fn(&w::StepIntent) -> Option<w::StepResult> + Send + 'static,
    ) -> TestExecutor {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (kafka, topics, codec, queue) = (
            self.kafka.clone(),
            self.topics.clone(),
            self.codec.clone(),
            queue.to_owned(),
        );
        let (stop2, seen2) = (stop.clone(), seen.clone());
        let partitions = self.partitions;
        let runtime = tokio::runtime::Handle::current();
        let thread = std::thread::spawn(move || {
            let mut config = kafka.client();
            config
                .set("group.id", format!("{}executor.{queue}", topics.prefix()))
                .set("isolation.level", "read_committed")
                .set("auto.offset.reset", "earliest")
                .set("enable.auto.commit", "true");
            let consumer: BaseConsumer = config.create().expect("executor consumer");
            consumer
                .subscribe(&[&topics.intents(&queue)])
                .expect("subscribe");
            let producer: FutureProducer = kafka.producer().create().expect("executor producer");
            while !stop2.load(Ordering::Relaxed) {
                let Some(Ok(message)) = consumer.poll(Duration::from_millis(100)) else {
                    continue;
                };
                let intent: w::StepIntent = match runtime.block_on(codec.decode(message.payload()))
                {
                    Ok(intent) => intent,
                    Err(_) => continue,
                };
                seen2.lock().expect("seen").push(intent.clone());
                let Some(result) = answer(&intent) else {
                    continue;
                };
                let bytes = runtime
                    .block_on(codec.encode(&topics.step_results(), &result))
                    .expect("encode result");
                let partition = partition_for(result.run_id.as_bytes(), partitions);
                let results_topic = topics.step_results();
                let record = FutureRecord::to(&results_topic)
                    .key(&result.operation_id)
                    .payload(&bytes)
                    .partition(partition);
                runtime
                    .block_on(producer.send(record, Duration::from_secs(10)))
                    .expect("result delivered");
            }
        });
        TestExecutor {
            stop,
            seen,
            thread: Some(thread),
        }
    }
}

#[derive(Debug)]
pub struct TestExecutor {
    stop: Arc<AtomicBool>,
    pub seen: Arc<Mutex<Vec<w::StepIntent>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for TestExecutor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
