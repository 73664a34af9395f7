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

/// The run partitions of [`Stack::start`] (see [`Stack::start_with_partitions`]).
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
    /// Broker, registry, topology (3 run partitions) and the given graphs.
    pub async fn start(name: &str, graphs: &[&str]) -> Stack {
        Stack::start_on(crate::bootstrap().await, name, graphs).await
    }

    /// [`Stack::start`] on another broker (e.g. a [`PrivateBroker`] a test restarts).
    pub async fn start_on(bootstrap: String, name: &str, graphs: &[&str]) -> Stack {
        Stack::start_on_with_partitions(bootstrap, name, graphs, PARTITIONS).await
    }

    /// [`Stack::start`] with `partitions` run partitions (e.g. 12, enough for several
    /// reducers to share them and to move between them on every rebalance).
    pub async fn start_with_partitions(name: &str, graphs: &[&str], partitions: u32) -> Stack {
        Stack::start_on_with_partitions(crate::bootstrap().await, name, graphs, partitions).await
    }

    /// [`Stack::start_on`] with `partitions` run partitions.
    pub async fn start_on_with_partitions(
        bootstrap: String,
        name: &str,
        graphs: &[&str],
        partitions: u32,
    ) -> Stack {
        Stack::start_on_replicated(bootstrap, name, graphs, partitions, None).await
    }

    /// [`Stack::start_on_with_partitions`] with every topic replicated
    /// `replication.0` times and `min.insync.replicas` = `replication.1` (e.g. (3, 2) on
    /// a [`PrivateCluster`]); `None`: the topology's own (1).
    pub async fn start_on_replicated(
        bootstrap: String,
        name: &str,
        graphs: &[&str],
        partitions: u32,
        replication: Option<(u16, u16)>,
    ) -> Stack {
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
        for text in graphs {
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

/// A `sortie` child process whose output goes to a log file under target/test-runs.
#[derive(Debug)]
pub struct Process {
    child: Child,
    pub log: PathBuf,
    /// Where this spawn's output starts in the (appended) log.
    log_start: u64,
    /// What it was started with (a supervisor starts it again with the same).
    args: Vec<String>,
}

/// Starts `sortie` with `args`, its output appended to `log`.
fn spawn_logged(log: PathBuf, args: Vec<String>) -> Process {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .expect("log file");
    let log_start = file.metadata().map(|m| m.len()).unwrap_or(0);
    let child = Command::new(sortie_bin())
        .args(&args)
        .env("RUST_LOG", "info,sortie_reducer=debug")
        .stdout(Stdio::from(file.try_clone().expect("log handle")))
        .stderr(Stdio::from(file))
        .spawn()
        .expect("spawn sortie");
    Process {
        child,
        log,
        log_start,
        args,
    }
}

/// A process started again whenever it ends itself as wedged (status 75,
/// `sortie_kafka::watchdog::WEDGED_EXIT_CODE`), as `sortie dev` and the kubelet do. Any
/// other exit ends the supervision (the test sees the process gone).
#[derive(Debug)]
pub struct Supervised {
    process: Arc<Mutex<Process>>,
    restarts: Arc<std::sync::atomic::AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Process {
    /// Hands the process to a supervisor (see [`Supervised`]).
    pub fn supervised(self) -> Supervised {
        let process = Arc::new(Mutex::new(self));
        let restarts = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::spawn({
            let (process, restarts, stop) = (process.clone(), restarts.clone(), stop.clone());
            move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(100));
                    let mut current = process.lock().unwrap_or_else(|e| e.into_inner());
                    match current.try_exit() {
                        None => {}
                        Some(status)
                            if status.code() == Some(sortie_kafka::watchdog::WEDGED_EXIT_CODE) =>
                        {
                            eprintln!(
                                "supervisor: {} ended itself as wedged; starting it again",
                                current.log.display()
                            );
                            let again = spawn_logged(current.log.clone(), current.args.clone());
                            *current = again;
                            restarts.fetch_add(1, Ordering::Relaxed);
                        }
                        Some(_) => return,
                    }
                }
            }
        });
        Supervised {
            process,
            restarts,
            stop,
            thread: Some(thread),
        }
    }
}

impl Supervised {
    /// How many times it was started again.
    pub fn restarts(&self) -> usize {
        self.restarts.load(Ordering::Relaxed)
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.process
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .kill();
    }
}

impl Process {
    /// Every thread's backtrace of the running process (`gdb -batch`), for a test that
    /// found it stalled; a note when gdb is missing or fails.
    pub fn backtraces(&self) -> String {
        match Command::new("gdb")
            .args([
                "-p",
                &self.pid().to_string(),
                "-batch",
                "-ex",
                "thread apply all bt",
            ])
            .output()
        {
            Ok(out) => String::from_utf8_lossy(&out.stdout).into_owned(),
            Err(e) => format!("(no backtraces: gdb: {e})"),
        }
    }
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

/// The key the harness signs every graph it publishes with (principal `test`, a
/// publisher for every tenant). A keyring of a test that should take the harness's graphs
/// lists [`publisher_entry`].
pub fn test_publisher() -> sortie_wire::signing::Signer {
    sortie_wire::signing::Signer::from_seed("test-publisher", [7u8; 32])
}

/// [`test_publisher`]'s keyring entry.
pub fn publisher_entry() -> sortie_wire::signing::KeyEntry {
    let mut entry = test_publisher().entry("test", &["*".to_owned()], &[], false);
    entry.publisher = true;
    entry
}

/// Publishes `graph` as the harness does: signed by [`test_publisher`], as `test`.
async fn publish_signed(kafka: &KafkaConfig, codec: &Codec, topics: &Topics, graph: &Graph) {
    let signer = test_publisher();
    sortie_catalog::publish_signed(
        kafka,
        codec,
        topics,
        graph,
        "test",
        now_ms(),
        Some(&signer),
        None,
    )
    .await
    .expect("publish graph");
}

/// `base`, or `base-<n>` for the first n that puts it on `source`'s partition among
/// `partitions`: a fork's run id must share its source's partition.
pub fn fork_id(base: &str, source: &str, partitions: u32) -> String {
    let partition = partition_for(source.as_bytes(), partitions);
    std::iter::once(base.to_owned())
        .chain((1..).map(|n| format!("{base}-{n}")))
        .find(|id| partition_for(id.as_bytes(), partitions) == partition)
        .unwrap_or_default()
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
            budget: None,
            fork: None,
        }),
    )
}

/// An approval of `interrupt` of `run_id` as proposed (no payload, no edits).
pub fn approve(
    run_id: &str,
    command_id: &str,
    interrupt: &sortie_core::state::Interrupt,
) -> w::RunCommand {
    command(
        run_id,
        command_id,
        w::CommandBody::ResumeRun(w::ResumeRun {
            interrupt_id: interrupt.interrupt_id.clone(),
            proposal_hash: interrupt.proposal_hash.clone(),
            decision: w::Decision::Approve,
            payload: None,
            comment: Some("ok".into()),
            edited_args: None,
            payload_is_input: false,
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
            roles: vec!["approver".into(), "operator".into()],
            groups: vec![],
        },
        issued_at: now_ms(),
        body,
    }
}

// ---------------------------------------------------------------- gateway

impl Stack {
    /// A `sortie gateway` process on a free port, with its view under `data` and the given
    /// dev tokens (`TENANT:PRINCIPAL:ROLE1,ROLE2:TOKEN`). Returns once `/readyz` answers 200,
    /// with the process and its base URL (`http://127.0.0.1:<port>`).
    pub async fn gateway_process(
        &self,
        data: &std::path::Path,
        tokens: &[&str],
    ) -> (Process, String) {
        self.gateway_process_with(data, tokens, &[]).await
    }

    /// [`Stack::gateway_process`] with extra arguments appended (e.g. `["--fault",
    /// "gateway.after_publish"]`).
    pub async fn gateway_process_with(
        &self,
        data: &std::path::Path,
        tokens: &[&str],
        extra: &[&str],
    ) -> (Process, String) {
        static SPAWNED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SPAWNED.fetch_add(1, Ordering::Relaxed);
        let data = data.to_str().unwrap_or_default().to_owned();
        let mut args = vec![
            "gateway",
            "--bootstrap-servers",
            &self.bootstrap,
            "--registry-url",
            &self.registry.url,
            "--prefix",
            &self.prefix,
            "--addr",
            "127.0.0.1:0",
            "--data-dir",
            &data,
            "--answer-timeout-ms",
            "30000",
        ];
        for token in tokens {
            args.extend(["--token", token]);
        }
        args.extend_from_slice(extra);
        // A log of its own per spawn: the first line is this process's address.
        let process = self.spawn(&format!("gateway-{n}"), &args);
        let addr: std::net::SocketAddr = crate::wait_for(
            "the gateway to print its address",
            Duration::from_secs(60),
            || {
                let text = process.log_text();
                async move { text.lines().find_map(|l| l.trim().parse().ok()) }
            },
        )
        .await;
        let url = format!("http://{addr}");
        let client = reqwest::Client::new();
        crate::wait_until("the gateway to be ready", Duration::from_secs(90), || {
            let request = client.get(format!("{url}/readyz")).send();
            async move { request.await.is_ok_and(|r| r.status().as_u16() == 200) }
        })
        .await;
        (process, url)
    }
}

// ---------------------------------------------------------------- executors and the ledger

/// A `sortie ledger` child process and where it listens.
#[derive(Debug)]
pub struct LedgerProcess {
    pub process: Process,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    pub file: PathBuf,
}

impl LedgerProcess {
    /// Everything the ledger has recorded.
    pub async fn snapshot(&self) -> sortie_devkit::ledger::Snapshot {
        reqwest::get(format!("{}/ledger", self.url))
            .await
            .and_then(|r| r.error_for_status())
            .expect("GET /ledger")
            .json()
            .await
            .expect("ledger snapshot")
    }

    /// Arms a fault for the next calls (`{"status": 429, "times": 2}`, `{"delay_ms": ..}`,
    /// `{"drop_after_commit": true}`).
    pub async fn fault(&self, spec: serde_json::Value) {
        reqwest::Client::new()
            .post(format!("{}/faults", self.url))
            .json(&spec)
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .expect("POST /faults");
    }
}

impl Stack {
    /// Publishes one more graph (e.g. one whose config names a ledger started after the
    /// stack).
    pub async fn publish(&self, yaml: &str) {
        let graph = Graph::parse(yaml).expect("test graph is valid");
        publish_signed(&self.kafka, &self.codec, &self.topics, &graph).await;
    }

    /// Starts `sortie ledger --mode <mode>` on a free port, its file under the test's dir,
    /// and waits until it listens. A second call with the same name reopens the same file.
    pub async fn ledger_process(&self, name: &str, mode: &str) -> LedgerProcess {
        let file = self.dir.join(format!("{name}.jsonl"));
        // Measured before the spawn: a fast ledger may print its address before this
        // function could read the log's length afterwards.
        let before = std::fs::read_to_string(self.dir.join(format!("{name}.log")))
            .map(|t| t.len())
            .unwrap_or(0);
        let process = self.spawn(
            name,
            &[
                "ledger",
                "--addr",
                "127.0.0.1:0",
                "--file",
                file.to_str().unwrap_or_default(),
                "--mode",
                mode,
            ],
        );
        let log = process.log.clone();
        let url = crate::wait_for(
            &format!("ledger {name} to listen"),
            Duration::from_secs(30),
            || {
                let log = log.clone();
                async move {
                    let text = std::fs::read_to_string(&log).ok()?;
                    let line = text
                        .get(before..)?
                        .lines()
                        .find_map(|l| l.strip_prefix("ledger listening on ").map(str::to_owned))?;
                    Some(line.trim().to_owned())
                }
            },
        )
        .await;
        LedgerProcess { process, url, file }
    }

    /// Starts `sortie executor` for `queues` named `name`, with fast commits and a short
    /// drain; `extra` args are appended (e.g. `["--static-membership"]` so a restart under
    /// the same name takes its partitions back at once, `["--fault",
    /// "executor.after_call"]`).
    pub fn executor_process(&self, name: &str, queues: &[&str], extra: &[&str]) -> Process {
        let queues = queues.join(",");
        let mut args = vec![
            "executor",
            "--bootstrap-servers",
            &self.bootstrap,
            "--registry-url",
            &self.registry.url,
            "--prefix",
            &self.prefix,
            "--queue",
            &queues,
            "--executor-id",
            name,
            "--commit-interval-ms",
            "50",
            "--session-timeout-ms",
            "6000",
            "--drain-timeout-ms",
            "3000",
            "--metrics-addr",
            "127.0.0.1:0",
        ];
        args.extend_from_slice(extra);
        self.spawn(name, &args)
    }
}

impl Process {
    /// The exit status, if the process has ended (never blocks).
    pub fn try_exit(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

// ---------------------------------------------------------------- crash tests

impl Process {
    /// Waits (polling, never blocking the runtime) until the process has exited, at most
    /// `deadline`; returns its status, or `None` if it is still running.
    pub async fn wait_exit(&mut self, deadline: Duration) -> Option<std::process::ExitStatus> {
        let started = std::time::Instant::now();
        loop {
            if let Some(status) = self.try_exit() {
                return Some(status);
            }
            if started.elapsed() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// This spawn's part of its log (a restart under the same name appends to the file).
    pub fn own_log_text(&self) -> String {
        let text = self.log_text();
        text.get(self.log_start as usize..)
            .map(str::to_owned)
            .unwrap_or(text)
    }

    /// The value of `field` in each of this spawn's (a reducer's) "Partition restored
    /// from the changelog" lines, unquoted.
    pub fn restored_partitions(&self, field: &str) -> Vec<String> {
        let name = format!("{field}=");
        self.own_log_text()
            .lines()
            .filter(|l| l.contains("Partition restored from the changelog"))
            .filter_map(|l| {
                let value = &l[l.find(&name)? + name.len()..];
                Some(match value.strip_prefix('"') {
                    Some(quoted) => quoted.split('"').next()?.to_owned(),
                    None => value.split_whitespace().next()?.to_owned(),
                })
            })
            .collect()
    }

    /// How this spawn (a reducer) counted each restored partition's runs for its gauges:
    /// `snapshot` (the tally stored with the cache's marker), `restore` (a cold
    /// partition, counted as it was read) or `scan` (every cached run read back).
    pub fn gauges_counted_by(&self) -> Vec<String> {
        self.restored_partitions("gauges")
    }

    /// Waits until this spawn's `sortie_runs` gauge shows `expected` (status → runs) for
    /// every status named there.
    pub async fn wait_for_run_gauges(&self, expected: &[(&str, f64)], within: Duration) {
        let url = self.metrics_url().await;
        let what = format!("the run gauges to show {expected:?}");
        crate::wait_until(&what, within, || async {
            let metrics = scrape(&url).await;
            expected
                .iter()
                .all(|(status, n)| metric_sum(&metrics, "sortie_runs", &[("status", status)]) == *n)
        })
        .await;
    }

    /// Whether this spawn died at a fault point (its log says so).
    pub fn died_at_fault(&self) -> bool {
        // The line logged at the point itself, not the start-up warning that a fault is
        // configured.
        self.own_log_text().contains("dies here on purpose")
    }
}

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

/// Audit-style checks on one run's committed history: gap-free seq (so no record of an
/// aborted transaction and no repeat), an intact hash chain, no step attempt dispatched
/// twice, and folding it gives `state` (the changelog's). Panics on the first problem.
pub fn check_history(run_id: &str, events: &[sortie_core::Event], state: &RunState) {
    if let Some(problem) = history_problems(run_id, events, state).into_iter().next() {
        panic!("{problem}");
    }
}

/// What [`check_history`] checks, as a list of problems (empty: the history is sound), so
/// a test can report every broken run at once. A repeated or missing seq is reported once
/// per run with the seqs as committed.
pub fn history_problems(
    run_id: &str,
    events: &[sortie_core::Event],
    state: &RunState,
) -> Vec<String> {
    let mut problems = Vec::new();
    let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
    if seqs.iter().enumerate().any(|(i, seq)| *seq != i as i64 + 1) {
        let shown: Vec<i64> = seqs.iter().copied().take(40).collect();
        problems.push(format!(
            "{run_id}: seq gap or repeat: committed seqs {shown:?}{}",
            if seqs.len() > 40 { " ..." } else { "" }
        ));
        // The chain and the fold break too; the seqs say it all.
        return problems;
    }
    let mut folded = None;
    let mut prev = None;
    let mut dispatched = std::collections::BTreeSet::new();
    for event in events {
        if event.prev_hash != prev {
            problems.push(format!("{run_id}: hash chain broken at seq {}", event.seq));
        }
        if event.hash.as_deref() != Some(event.compute_hash().as_str()) {
            problems.push(format!("{run_id}: hash of seq {}", event.seq));
        }
        prev = event.hash.clone();
        if let sortie_core::EventBody::StepDispatched {
            step_id, attempt, ..
        } = &event.body
        {
            if !dispatched.insert((step_id.clone(), *attempt)) {
                problems.push(format!(
                    "{run_id}: {step_id} attempt {attempt} dispatched twice"
                ));
            }
        }
        folded = sortie_core::evolve(folded, event);
    }
    if folded.as_ref() != Some(state) {
        problems.push(format!(
            "{run_id}: folding the history does not give the changelog state"
        ));
    }
    problems
}

impl Stack {
    /// `sortie audit replay --verify` on this stack's topics: whether it exited 0, and its
    /// JSON report (`Value::Null` if it printed none).
    pub async fn audit_verify(&self) -> (bool, serde_json::Value) {
        self.audit_verify_with(&[]).await
    }

    /// [`Stack::audit_verify`] with extra arguments (e.g. the run keys).
    pub async fn audit_verify_with(&self, extra: &[&str]) -> (bool, serde_json::Value) {
        let mut args = vec![
            "audit",
            "replay",
            "--verify",
            "--bootstrap-servers",
            &self.bootstrap,
            "--registry-url",
            &self.registry.url,
            "--prefix",
            &self.prefix,
        ];
        args.extend_from_slice(extra);
        let output = tokio::process::Command::new(sortie_bin())
            .args(args)
            .env("RUST_LOG", "warn")
            .output()
            .await
            .expect("run sortie audit");
        let report = serde_json::from_slice(&output.stdout).unwrap_or(serde_json::Value::Null);
        if !output.status.success() {
            eprintln!(
                "sortie audit replay --verify failed ({}):\n{}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        (output.status.success(), report)
    }

    /// Every run event record as `(run_id, seq)` read with `isolation`: under
    /// `ReadUncommitted` it includes the records of aborted transactions.
    pub async fn event_keys(&self, isolation: Isolation) -> Vec<(String, i64)> {
        let mut out = Vec::new();
        for message in crate::read_all(&self.bootstrap, &self.topics.run_events(), isolation).await
        {
            let record: w::RunEvent = self
                .codec
                .decode(message.payload())
                .await
                .expect("decode run-event");
            out.push((record.run_id.clone(), record.seq));
        }
        out
    }
}

// ---------------------------------------------------------------- metrics and health

impl Process {
    /// The base URL of this spawn's metrics and health server (`http://127.0.0.1:<port>`),
    /// from the `metrics listening on <url>` line it prints (reducer and executor spawned
    /// with `--metrics-addr 127.0.0.1:0`, as [`Stack::reducer`] and
    /// [`Stack::executor_process`] do).
    pub async fn metrics_url(&self) -> String {
        let (log, start) = (self.log.clone(), self.log_start as usize);
        crate::wait_for(
            "the process to print its metrics address",
            Duration::from_secs(60),
            || {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                async move {
                    text.get(start..)?.lines().find_map(|l| {
                        l.trim()
                            .strip_prefix("metrics listening on ")
                            .map(str::to_owned)
                    })
                }
            },
        )
        .await
    }
}

/// One scrape of a Prometheus text endpoint: `series{labels}` (as rendered, labels
/// sorted as the exporter writes them) → value. Comment lines are skipped.
pub async fn scrape(url: &str) -> BTreeMap<String, f64> {
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .and_then(|r| r.error_for_status())
        .expect("GET /metrics")
        .text()
        .await
        .expect("metrics body");
    parse_metrics(&text)
}

/// Parses the Prometheus text format into `series → value`.
pub fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// The sum of every series of metric `name` whose labels include all of `labels`
/// (`[("tool", "echo")]`); 0 when none.
pub fn metric_sum(metrics: &BTreeMap<String, f64>, name: &str, labels: &[(&str, &str)]) -> f64 {
    metrics
        .iter()
        .filter(|(series, _)| {
            let (metric, rest) = series.split_once('{').unwrap_or((series.as_str(), ""));
            metric == name
                && labels
                    .iter()
                    .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
        })
        .map(|(_, value)| value)
        .sum()
}

// ---------------------------------------------------------------- chaos

/// SplitMix64: small, seedable, good enough to draw a workload and a fault schedule.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    /// Uniform in `low..high` (milliseconds resolution).
    pub fn between(&mut self, low: Duration, high: Duration) -> Duration {
        let span = high.saturating_sub(low).as_millis() as u64;
        low + Duration::from_millis(self.below(span.max(1)))
    }
}

/// The seed in the environment variable `var`, else one from the clock. Tests print it
/// first so that `var=<seed>` replays the same workload and schedule.
pub fn seed_from_env(var: &str) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(7)
        })
}

/// A number from the environment variable `var`, else `default`.
pub fn env_number(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(default)
}

impl Stack {
    /// Produces many commands at once (one producer, every delivery awaited), each keyed
    /// by its run id with the Java-compatible partitioner like [`Stack::send`].
    pub async fn send_many(&self, commands: &[w::RunCommand]) {
        let mut records = Vec::with_capacity(commands.len());
        for command in commands {
            let bytes = self
                .codec
                .encode(&self.topics.commands(), command)
                .await
                .expect("encode command");
            records.push((command.run_id.clone(), bytes));
        }
        crate::produce(&self.bootstrap, &self.topics.commands(), &records).await;
    }

    /// Produces `commands` one by one, evenly spread over `over` (one producer; every
    /// delivery awaited), so commands keep arriving while a test changes things around.
    pub async fn send_spread(&self, commands: &[w::RunCommand], over: Duration) {
        let gap = over / (commands.len().max(1) as u32);
        let groups: Vec<(Duration, &[w::RunCommand])> = commands
            .chunks(1)
            .enumerate()
            .map(|(i, one)| (gap * i as u32, one))
            .collect();
        self.send_timed(&groups).await;
    }

    /// Produces each group of commands at its offset from now (in order; a late group goes
    /// at once), with one producer, and awaits every delivery: bursts timed to land when
    /// a test changes something.
    pub async fn send_timed(&self, groups: &[(Duration, &[w::RunCommand])]) {
        let producer: FutureProducer = self.kafka.producer().create().expect("producer");
        let topic = self.topics.commands();
        let start = std::time::Instant::now();
        let mut deliveries = Vec::new();
        for (due, commands) in groups {
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                tokio::time::sleep(wait).await;
            }
            for command in *commands {
                let bytes = self
                    .codec
                    .encode(&topic, command)
                    .await
                    .expect("encode command");
                let record = FutureRecord::to(&topic)
                    .key(command.run_id.as_bytes())
                    .payload(&bytes);
                match producer.send_result(record) {
                    Ok(delivery) => deliveries.push(delivery),
                    Err((error, _)) => panic!("producing to {topic}: {error}"),
                }
            }
        }
        for delivery in deliveries {
            match delivery.await {
                Ok(Ok(_)) => {}
                Ok(Err((error, _))) => panic!("producing to {topic}: {error}"),
                Err(_) => panic!("producing to {topic}: the delivery was cancelled"),
            }
        }
    }

    /// Every `(queue, operation_id, attempt)` committed more than once on any intents
    /// topic, with how many times (read_committed). Empty: no executor can see an intent
    /// twice.
    pub async fn repeated_intents(&self) -> Vec<String> {
        let mut problems = Vec::new();
        for queue in &self.queues {
            let mut seen: BTreeMap<(String, i32), usize> = BTreeMap::new();
            for intent in self.intents(queue).await {
                *seen
                    .entry((intent.operation_id, intent.attempt))
                    .or_default() += 1;
            }
            for ((op, attempt), n) in seen {
                if n > 1 {
                    problems.push(format!(
                        "intents.{queue}: {op} attempt {attempt} committed {n} times"
                    ));
                }
            }
        }
        problems
    }
}

impl Process {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it still runs (never blocks).
    pub fn is_running(&mut self) -> bool {
        self.try_exit().is_none()
    }
}

impl PrivateBroker {
    /// SIGKILL to the broker's JVM (its pid from `broker.pid` in the data dir, which
    /// `sortie_devkit::local` writes on start), no clean shutdown: what a machine crash
    /// looks like to the clients. Returns the pid it killed. The data stays;
    /// [`PrivateBroker::ensure_running`] restarts it on the same data (log recovery).
    pub async fn kill(&self) -> u32 {
        let broker = self.broker.clone();
        tokio::task::spawn_blocking(move || broker.kill())
            .await
            .expect("the kill task panicked")
            .unwrap_or_else(|e| panic!("killing the private broker: {e}"))
            .expect("the private broker was running")
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
