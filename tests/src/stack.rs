//! A Sortie stack for integration tests: the real broker, a schema registry, the topology
//! under a unique prefix, published graphs, reducer processes, and a test executor that
//! answers intents. Each test gets its own stack, so tests run in parallel.

use std::collections::{BTreeMap, HashMap};
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

pub const PARTITIONS: u32 = 3;

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

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

#[derive(Debug)]
pub struct Stack {
    pub bootstrap: String,
    pub prefix: String,
    pub topics: Topics,
    pub kafka: KafkaConfig,
    pub registry: ServedRegistry,
    pub codec: Arc<Codec>,
    pub dir: PathBuf,
}

impl Stack {
    /// Broker, registry, topology (3 run partitions) and the given graphs.
    pub async fn start(name: &str, graphs: &[&str]) -> Stack {
        let bootstrap = crate::bootstrap().await;
        let prefix = crate::unique_prefix(name);
        let kafka = KafkaConfig::new(bootstrap.clone());
        let registry = ServedRegistry::start(&kafka, &format!("{prefix}_schemas"))
            .await
            .expect("registry");
        let topology = Topology::load(crate::workspace_root().join("topology/topics.yaml"))
            .and_then(|t| {
                t.with_overrides(&Overrides {
                    prefix: Some(prefix.clone()),
                    run_partitions: Some(PARTITIONS),
                    ..Overrides::default()
                })
            })
            .expect("topology");
        let report = topology.apply(&kafka).await.expect("topology apply");
        assert!(report.is_complete(), "topology apply left work: {report:?}");
        let codec = Arc::new(Codec::new(&CodecConfig {
            registry_url: registry.url.clone(),
            auto_register: true,
        }));
        let topics = Topics::new(prefix.clone());
        for text in graphs {
            let graph = Graph::parse(text).expect("test graph is valid");
            sortie_reducer::graphs::publish(&kafka, &codec, &topics, &graph, "test", now_ms())
                .await
                .expect("publish graph");
        }
        let dir = crate::workspace_root()
            .join("target")
            .join("test-runs")
            .join(prefix.trim_end_matches('.'));
        std::fs::create_dir_all(&dir).expect("test dir");
        Stack {
            bootstrap,
            prefix,
            topics,
            kafka,
            registry,
            codec,
            dir,
        }
    }

    pub fn reducer(&self, instance: &str) -> Process {
        let data = self.dir.join(format!("reducer-{instance}"));
        self.spawn(
            &format!("reducer-{instance}"),
            &[
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
            ],
        )
    }

    pub fn reducer_data(&self, instance: &str) -> PathBuf {
        self.dir.join(format!("reducer-{instance}"))
    }

    pub fn spawn(&self, name: &str, args: &[&str]) -> Process {
        let log = self.dir.join(format!("{name}.log"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("log file");
        let child = Command::new(sortie_bin())
            .args(args)
            .env("RUST_LOG", "info,sortie_reducer=debug")
            .stdout(Stdio::from(file.try_clone().expect("log handle")))
            .stderr(Stdio::from(file))
            .spawn()
            .expect("spawn sortie");
        Process { child, log }
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
            let record: w::RunState = self
                .codec
                .decode(message.payload())
                .await
                .expect("decode run-state");
            let state = sortie_reducer::convert::state_from_wire(&record).expect("state json");
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
            let event = sortie_reducer::convert::event_from_wire(record).expect("event");
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
                let partition = partition_for(result.run_id.as_bytes(), PARTITIONS);
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

/// A `sortie` child process whose output goes to a log file under target/test-runs.
#[derive(Debug)]
pub struct Process {
    child: Child,
    pub log: PathBuf,
}

impl Process {
    /// SIGKILL: no chance to finish anything.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait for a clean exit.
    pub fn stop(&mut self) {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32);
        if let Some(pid) = pid {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let _ = self.child.wait();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
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

/// A successful result for an intent, echoing its args as output.
pub fn succeed(intent: &w::StepIntent) -> Option<w::StepResult> {
    Some(w::StepResult {
        operation_id: intent.operation_id.clone(),
        attempt: intent.attempt,
        tenant: intent.tenant.clone(),
        run_id: intent.run_id.clone(),
        step_id: intent.step_id.clone(),
        status: w::StepStatus::Succeeded,
        retryable: false,
        output: Some(format!(
            r#"{{"echo":{},"step":"{}"}}"#,
            intent.args, intent.step_id
        )),
        error: None,
        executor: "test".into(),
        started_at: now_ms(),
        finished_at: Some(now_ms()),
    })
}

pub fn start_run(run_id: &str, graph: &str, input: &str) -> w::RunCommand {
    command(
        run_id,
        &format!("start-{run_id}"),
        w::CommandBody::StartRun(w::StartRun {
            graph_id: graph.into(),
            graph_version: None,
            input: input.into(),
            labels: BTreeMap::new(),
        }),
    )
}

pub fn command(run_id: &str, command_id: &str, body: w::CommandBody) -> w::RunCommand {
    w::RunCommand {
        command_id: command_id.into(),
        tenant: "acme".into(),
        run_id: run_id.into(),
        issuer: w::Issuer {
            principal: "svc:test".into(),
            roles: vec!["approver".into()],
        },
        issued_at: now_ms(),
        body,
    }
}
