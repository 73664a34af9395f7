//! The harness of Sortie's integration suites: one real Apache Kafka broker for the whole
//! test run, unique topic prefixes so tests run in parallel, topic creation that waits
//! for metadata, and polling helpers (a test never sleeps to wait for something).
//!
//! The broker: `SORTIE_TEST_BOOTSTRAP` if set; otherwise a local single-node broker on
//! 127.0.0.1:19092 with its data in `<workspace>/target/kafka-test`, started by the first
//! test that asks and reused by every later test, test binary and process while it lives
//! (pid file + `flock`, see `sortie_devkit::local`). It is left running at the end; stop it
//! with `cargo run -q -p sortie -- broker stop --data-dir target/kafka-test`.
//!
//! This crate holds helpers only, no tests; it must never stand a mock in for Kafka.

use std::collections::BTreeSet;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::OwnedMessage;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use sortie_devkit::local::{BrokerConfig, LocalBroker};
use sortie_kafka::KafkaConfig;
use sortie_registry::Registry;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub mod browser;
pub mod http;
pub mod stack;

/// The environment variable that points the tests at an existing broker.
pub const BOOTSTRAP_ENV: &str = "SORTIE_TEST_BOOTSTRAP";
/// A two-node graph whose refund waits for an `approver` (24 h): the approval suites'
/// common mission.
pub const GATED: &str = r#"
id: gated
version: 1
nodes:
  - {id: prepare, tool: echo, side_effect: pure}
  - id: refund
    tool: echo
    side_effect: keyed
    args: {amount: $input.amount}
    interrupt_before: {reason: refunds need a human, required_role: approver, timeout: 24h}
edges:
  - {from: prepare, to: refund}
"#;

/// Three echo steps in a chain, one of each repeatable class (pure, idempotent, keyed):
/// the suites' plain mission.
pub const THREE_STEPS: &str = r#"
id: three
version: 1
nodes:
  - {id: fetch, tool: echo, side_effect: pure, args: {order: $input.order}}
  - {id: price, tool: echo, side_effect: idempotent, args: {from: $steps.fetch.output.step}}
  - {id: notify, tool: echo, side_effect: keyed, args: {from: $steps.price.output.step}}
edges:
  - {from: fetch, to: price}
  - {from: price, to: notify}
"#;

/// The test broker's PLAINTEXT port (its controller listens on the next one).
pub const TEST_BROKER_PORT: u16 = 19092;

/// The workspace root (the parent of this crate's folder).
pub fn workspace_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().unwrap_or(here).to_path_buf()
}

/// The local test broker (`<workspace>/target/kafka-test`). Tests that restart the
/// broker (crash tests) use it directly; others only need [`bootstrap`].
///
/// Its port is the one its data dir was configured with; a fresh data dir takes the first
/// of 19092, 19192, ... whose broker and controller ports are free, so two checkouts on
/// one machine (a developer's tree and a CI clone) do not collide.
pub fn test_broker() -> LocalBroker {
    let root = workspace_root();
    let data_dir = root.join("target").join("kafka-test");
    let port = sortie_devkit::local::configured_port(&data_dir).unwrap_or_else(free_test_port);
    LocalBroker::new(BrokerConfig::new(
        data_dir,
        port,
        root.join("dev").join("kafka").join("pom.xml"),
    ))
}

fn free_test_port() -> u16 {
    let free = |port: u16| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok();
    (0..20)
        .map(|i| TEST_BROKER_PORT + 100 * i)
        .find(|port| free(*port) && free(port + 1))
        .unwrap_or(TEST_BROKER_PORT)
}

/// The bootstrap servers for tests. Blocking: starts (or reuses) the local broker on the
/// first call in this process, then answers from a cache. Panics if no broker can be had.
pub fn bootstrap_blocking() -> String {
    static BOOTSTRAP: OnceLock<String> = OnceLock::new();
    BOOTSTRAP
        .get_or_init(|| {
            if let Ok(bootstrap) = std::env::var(BOOTSTRAP_ENV) {
                if !bootstrap.trim().is_empty() {
                    return bootstrap;
                }
            }
            let broker = test_broker();
            let started = Instant::now();
            match broker.ensure_running() {
                Ok(running) => {
                    eprintln!(
                        "sortie-tests: broker {} (pid {}, {}) ready in {} ms",
                        running.bootstrap,
                        running.pid,
                        if running.reused { "reused" } else { "started" },
                        started.elapsed().as_millis()
                    );
                    running.bootstrap
                }
                Err(error) => panic!("the local test broker could not be started: {error}"),
            }
        })
        .clone()
}

/// [`bootstrap_blocking`] for async tests (runs it on the blocking pool).
pub async fn bootstrap() -> String {
    tokio::task::spawn_blocking(bootstrap_blocking)
        .await
        .expect("the bootstrap task panicked")
}

/// A topic/group/transactional-id prefix no other test (or earlier run) uses:
/// `t.<test>.<pid>.<counter>.<millis>.` with only Kafka-legal characters.
pub fn unique_prefix(test: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let test: String = test
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .take(80)
        .collect();
    let millis = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    format!(
        "t.{test}.{}.{}.{millis}.",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Creates a topic (replication 1) with the given configs and waits until metadata shows
/// it with a leader for every partition. Panics on failure.
pub async fn create_topic(bootstrap: &str, name: &str, partitions: i32, config: &[(&str, &str)]) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("admin client");
    let mut topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
    for (key, value) in config {
        topic = topic.set(key, value);
    }
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let results = admin
        .create_topics([&topic], &options)
        .await
        .unwrap_or_else(|e| panic!("creating topic {name}: {e}"));
    for result in results {
        if let Err((topic, code)) = result {
            panic!("creating topic {topic}: {code}");
        }
    }
    let bootstrap = bootstrap.to_owned();
    let name = name.to_owned();
    wait_until(
        &format!("topic {name} to appear in metadata with leaders"),
        Duration::from_secs(30),
        || {
            let bootstrap = bootstrap.clone();
            let name = name.clone();
            async move {
                tokio::task::spawn_blocking(move || topic_ready(&bootstrap, &name, partitions))
                    .await
                    .unwrap_or(false)
            }
        },
    )
    .await;
}

fn topic_ready(bootstrap: &str, name: &str, partitions: i32) -> bool {
    let Ok(consumer) = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create::<BaseConsumer>()
    else {
        return false;
    };
    let Ok(metadata) = consumer.fetch_metadata(Some(name), Duration::from_secs(5)) else {
        return false;
    };
    metadata.topics().iter().any(|t| {
        t.name() == name
            && t.error().is_none()
            && t.partitions().len() == partitions as usize
            && t.partitions()
                .iter()
                .all(|p| p.error().is_none() && p.leader() >= 0)
    })
}

/// Polls `f` until it returns true; panics with `what` when `deadline` has passed.
pub async fn wait_until<F, Fut>(what: &str, deadline: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    wait_for(what, deadline, || {
        let fut = f();
        async move { fut.await.then_some(()) }
    })
    .await
}

/// Polls `f` until it returns `Some(value)` and returns the value; panics with `what` when
/// `deadline` has passed.
pub async fn wait_for<T, F, Fut>(what: &str, deadline: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    let mut pause = Duration::from_millis(20);
    loop {
        if let Some(value) = f().await {
            return value;
        }
        if start.elapsed() >= deadline {
            panic!("timed out after {deadline:?} waiting for {what}");
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(250));
    }
}

/// Produces records (non-transactionally, murmur2 partitioner like every Sortie producer)
/// and waits for every delivery. Panics on failure.
pub async fn produce<K, V>(bootstrap: &str, topic: &str, records: &[(K, V)])
where
    K: AsRef<[u8]>,
    V: AsRef<[u8]>,
{
    let producer: FutureProducer = KafkaConfig::new(bootstrap)
        .producer()
        .set("linger.ms", "0")
        .create()
        .expect("producer");
    let mut deliveries = Vec::with_capacity(records.len());
    for (key, value) in records {
        let record = FutureRecord::to(topic)
            .key(key.as_ref())
            .payload(value.as_ref());
        match producer.send_result(record) {
            Ok(delivery) => deliveries.push(delivery),
            Err((error, _)) => panic!("producing to {topic}: {error}"),
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

/// How [`read_all`] reads transactional records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolation {
    ReadCommitted,
    ReadUncommitted,
}

/// Every record of `topic` from the beginning to the current end (the last stable offset
/// under `ReadCommitted`) of every partition, in partition then offset order. Reads
/// without a consumer group. Panics on failure or after 30 s.
pub async fn read_all(bootstrap: &str, topic: &str, isolation: Isolation) -> Vec<OwnedMessage> {
    let bootstrap = bootstrap.to_owned();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || read_all_blocking(&bootstrap, &topic, isolation))
        .await
        .expect("read_all panicked")
}

/// The blocking form of [`read_all`].
pub fn read_all_blocking(bootstrap: &str, topic: &str, isolation: Isolation) -> Vec<OwnedMessage> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        // librdkafka wants a group for assign(); nothing is joined or committed.
        .set("group.id", "sortie-tests-read-all")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .set(
            "isolation.level",
            match isolation {
                Isolation::ReadCommitted => "read_committed",
                Isolation::ReadUncommitted => "read_uncommitted",
            },
        )
        .create()
        .expect("consumer");
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("metadata for {topic}: {e}"));
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .map(|t| t.partitions().iter().map(|p| p.id()).collect())
        .unwrap_or_default();
    assert!(!partitions.is_empty(), "topic {topic} has no partitions");
    let mut assignment = TopicPartitionList::new();
    for &partition in &partitions {
        assignment
            .add_partition_offset(topic, partition, Offset::Beginning)
            .expect("assignment");
    }
    consumer.assign(&assignment).expect("assign");

    let deadline = Instant::now() + Duration::from_secs(30);
    let mut at_end = BTreeSet::new();
    let mut messages = Vec::new();
    while at_end.len() < partitions.len() {
        assert!(
            Instant::now() < deadline,
            "timed out reading {topic} to its end ({} records so far)",
            messages.len()
        );
        match consumer.poll(Duration::from_millis(200)) {
            None => {}
            Some(Ok(message)) => {
                at_end.remove(&message.partition());
                messages.push(message.detach());
            }
            Some(Err(KafkaError::PartitionEOF(partition))) => {
                at_end.insert(partition);
            }
            // A broker of a cluster that is down (a test killed it) shows up as transport
            // errors while the client moves to the new leaders: the deadline bounds it.
            Some(Err(error)) if sortie_kafka::is_transient(&error) => {}
            Some(Err(KafkaError::MessageConsumption(
                rdkafka::types::RDKafkaErrorCode::BrokerTransportFailure
                | rdkafka::types::RDKafkaErrorCode::AllBrokersDown,
            ))) => {}
            Some(Err(error)) => panic!("reading {topic}: {error}"),
        }
    }
    messages.sort_by_key(|m| (m.partition(), m.offset()));
    messages
}

/// A record's key and payload as UTF-8 strings (empty when absent), for assertions.
pub fn key_value(message: &OwnedMessage) -> (String, String) {
    (
        String::from_utf8_lossy(message.key().unwrap_or_default()).into_owned(),
        String::from_utf8_lossy(message.payload().unwrap_or_default()).into_owned(),
    )
}

// ---------------------------------------------------------------- schema registry

/// A registry serving on an ephemeral port until stopped.
#[derive(Debug)]
pub struct ServedRegistry {
    pub url: String,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), sortie_registry::Error>>,
}

impl ServedRegistry {
    pub async fn start(kafka: &KafkaConfig, topic: &str) -> anyhow::Result<ServedRegistry> {
        let registry = Arc::new(Registry::open(kafka, topic).await?);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(sortie_registry::serve(listener, registry, async {
            let _ = stopped.await;
        }));
        Ok(ServedRegistry {
            url,
            stop: Some(stop),
            task,
        })
    }

    /// Shuts the server down and drops the registry (its producer and state).
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(Duration::from_secs(30), &mut self.task)
            .await
            .context("the registry did not shut down")??
            .context("the registry server failed")
    }
}

// ---------------------------------------------------------------- python

/// The Python interpreter of the tests' virtualenv (`target/py`, built once from
/// `tests/python/requirements.txt` and reused; safe across parallel tests). Blocking.
pub fn python_venv() -> anyhow::Result<String> {
    python_venv_of("py", "requirements.txt")
}

/// The Python interpreter of the MCP server's virtualenv (`target/py-mcp`, from
/// `tests/python/mcp-requirements.txt`: the official MCP Python SDK). Its own venv, so
/// the SDK's dependencies never meet the other suites' pins. Blocking.
pub fn python_mcp_venv() -> anyhow::Result<String> {
    python_venv_of("py-mcp", "mcp-requirements.txt")
}

fn python_venv_of(dir: &str, requirements: &str) -> anyhow::Result<String> {
    let root = workspace_root();
    let output = std::process::Command::new(
        std::env::var("SORTIE_PYTHON").unwrap_or_else(|_| "python3".into()),
    )
    .arg(root.join("tests/python/ensure_venv.py"))
    .arg(root.join("target").join(dir))
    .arg(root.join("tests/python").join(requirements))
    .output()
    .context("running python3 tests/python/ensure_venv.py")?;
    anyhow::ensure!(
        output.status.success(),
        "creating the Python venv failed ({}):\n{}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .last()
        .map(str::to_owned)
        .context("ensure_venv.py printed no interpreter path")
}

/// Says `line` on the test's stderr whether the test passes or not: libtest captures what
/// `println!`/`eprintln!` print from a passing test, and a seeded test's seed belongs in
/// every CI log, not only a failing one's.
pub fn say(line: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// A shop's MCP server of the official Python SDK (`tests/python/mcp_server.py`) on a
/// free loopback port, its ledger of calls in `ledger`. Killed when dropped.
#[derive(Debug)]
pub struct McpServer {
    pub url: String,
    pub base: String,
    child: std::process::Child,
}

impl McpServer {
    /// Starts the server and waits until it answers.
    pub async fn start(ledger: &Path, log: &Path) -> McpServer {
        let python = tokio::task::spawn_blocking(python_mcp_venv)
            .await
            .expect("join")
            .expect("the MCP venv");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let out = std::fs::File::create(log).expect("log file");
        let child = std::process::Command::new(python)
            .arg(workspace_root().join("tests/python/mcp_server.py"))
            .args(["--port", &port.to_string(), "--ledger"])
            .arg(ledger)
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .spawn()
            .expect("the MCP server starts");
        let base = format!("http://127.0.0.1:{port}");
        let server = McpServer {
            url: format!("{base}/mcp"),
            base,
            child,
        };
        let client = reqwest::Client::new();
        wait_until("the MCP server to answer", Duration::from_secs(60), || {
            let request = client.get(format!("{}/ledger", server.base)).send();
            async move { request.await.is_ok_and(|r| r.status().is_success()) }
        })
        .await;
        server
    }

    /// Every call the server recorded, oldest first.
    pub async fn ledger(&self) -> Vec<serde_json::Value> {
        reqwest::Client::new()
            .get(format!("{}/ledger", self.base))
            .send()
            .await
            .expect("ledger")
            .json()
            .await
            .expect("ledger json")
    }

    /// Changes the tools the server lists (see the server's doc).
    pub async fn change_tools(&self) {
        let answer = reqwest::Client::new()
            .post(format!("{}/control/change", self.base))
            .send()
            .await
            .expect("change");
        assert!(answer.status().is_success(), "{answer:?}");
    }
}

impl Drop for McpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
