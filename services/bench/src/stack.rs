//! The stack a benchmark runs on: the broker (its own, or an existing one), the schema
//! registry in this process, the topology under the bench's prefix with its queues, the
//! bench graph, and the services as their own processes with their logs.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use sortie_core::Graph;
use sortie_devkit::local::{BrokerConfig, LocalBroker};
use sortie_kafka::topology::{Overrides, Topology};
use sortie_kafka::KafkaConfig;
use sortie_registry::Registry;
use sortie_wire::{Codec, CodecConfig, Topics};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::Options;

/// Finds a file of the repository from the current directory upwards, then from where
/// this crate was built.
pub fn repo_file(relative: &str) -> anyhow::Result<PathBuf> {
    let mut dir = std::env::current_dir()?;
    loop {
        let candidate = dir.join(relative);
        if candidate.exists() {
            return Ok(candidate);
        }
        if !dir.pop() {
            break;
        }
    }
    let built = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(relative);
    if built.exists() {
        return Ok(built);
    }
    bail!("{relative} not found: run `sortie bench` from a Sortie checkout")
}

/// The bench's own broker: its own data dir and port, and JIT flags for a long run. The
/// dev default `-XX:TieredStopAtLevel=1` stops at C1 and caps the broker's throughput;
/// tiered compilation, the JVM's default, kept the 2-core box's broker compiling at ~0.5
/// core through the light load after a 10k-run warm-up (it compiles ~13k methods, and
/// each new kind of load brings more), so the bench runs the broker C2-only
/// (`-XX:-TieredCompilation`: only hot methods are compiled). A/B in the README
/// ("The light load"); `--broker-jvm-flag=-XX:+TieredCompilation` turns it back.
pub fn own_broker(options: &Options) -> anyhow::Result<LocalBroker> {
    let mut config = BrokerConfig::new(
        options.data_dir.join("kafka"),
        options.kafka_port,
        repo_file("dev/kafka/pom.xml")?,
    );
    config.heap = "1g".to_owned();
    config
        .jvm_flags
        .retain(|flag| !flag.starts_with("-XX:TieredStopAtLevel"));
    config.jvm_flags.push("-XX:-TieredCompilation".to_owned());
    config
        .jvm_flags
        .extend(options.broker_jvm_flags.iter().cloned());
    config.properties = options.broker_properties.clone();
    // Reuse jars another local broker of this checkout already fetched.
    if let Ok(target) = repo_file("target") {
        config.libs_dir = ["kafka-test/libs", "dev/kafka/libs"]
            .iter()
            .map(|dir| target.join(dir))
            .find(|dir| has_jars(dir));
    }
    Ok(LocalBroker::new(config))
}

fn has_jars(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("kafka_2.13-"))
        })
        .unwrap_or(false)
}

/// A schema registry serving from this process on an ephemeral port.
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

    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(10), &mut self.task).await;
    }
}

/// librdkafka properties from a Java-style file: `key=value` lines, `#` or `!` comments.
pub fn properties(text: &str) -> anyhow::Result<std::collections::BTreeMap<String, String>> {
    let mut properties = std::collections::BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with('!') {
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            bail!("Kafka properties, line {}: expected key=value", n + 1);
        };
        properties.insert(key.trim().to_owned(), value.trim().to_owned());
    }
    Ok(properties)
}

/// The bench queues: `bench0`, `bench1`, ...
pub fn queues(count: usize) -> Vec<String> {
    (0..count.max(1)).map(|i| format!("bench{i}")).collect()
}

/// Applies `topology/topics.yaml` under `prefix` with `partitions` run partitions (and
/// `intent_partitions` for every intents topic, when given) and the bench queues instead
/// of the declared ones.
pub async fn apply_topology(
    kafka: &KafkaConfig,
    prefix: &str,
    partitions: u32,
    intent_partitions: Option<u32>,
    queues: &[String],
) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(repo_file("topology/topics.yaml")?)?;
    let mut yaml: serde_yaml::Value = serde_yaml::from_str(&text)?;
    let Some(map) = yaml.as_mapping_mut() else {
        bail!("topology/topics.yaml is not a mapping");
    };
    map.insert(
        "queues".into(),
        serde_yaml::Value::Sequence(queues.iter().map(|q| q.as_str().into()).collect()),
    );
    let topology =
        Topology::from_yaml(&serde_yaml::to_string(&yaml)?)?.with_overrides(&Overrides {
            prefix: Some(prefix.to_owned()),
            run_partitions: Some(partitions),
            intent_partitions,
            ..Overrides::default()
        })?;
    let report = topology.apply(kafka).await?;
    if !report.is_complete() {
        bail!("topology apply left work: {report:?}");
    }
    let names: Vec<String> = topology
        .topics()
        .iter()
        .map(|t| t.full_name.clone())
        .collect();
    wait_for_leaders(kafka, names).await
}

/// Waits until every partition of `names` has a leader (a fresh broker takes a moment).
pub async fn wait_for_leaders(kafka: &KafkaConfig, names: Vec<String>) -> anyhow::Result<()> {
    let consumer: BaseConsumer = kafka.client().create()?;
    tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        for name in &names {
            loop {
                let ready = consumer
                    .fetch_metadata(Some(name), Duration::from_secs(5))
                    .map(|m| {
                        m.topics().iter().any(|t| {
                            t.error().is_none()
                                && !t.partitions().is_empty()
                                && t.partitions()
                                    .iter()
                                    .all(|p| p.error().is_none() && p.leader() >= 0)
                        })
                    })
                    .unwrap_or(false);
                if ready {
                    break;
                }
                if Instant::now() > deadline {
                    bail!("topic {name} has no leaders after 60 s");
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Ok(())
    })
    .await?
}

/// The bench graph's id.
pub const GRAPH: &str = "bench";

/// The id of the one-step graph of the `light_one_step` phase (a run's fixed cost: its
/// start, one step and its end, as Restate's harness measures with `light1`).
pub const ONE_STEP_GRAPH: &str = "bench-one-step";

/// A bench graph `id`: a chain of `steps` pure `echo` nodes spread over the queues, each
/// carrying the run's payload in its args (so its result carries it back).
pub fn graph(id: &str, steps: usize, queues: &[String]) -> anyhow::Result<Graph> {
    let mut yaml = format!(
        "id: {id}\nversion: 1\ndescription: sortie bench, {steps} echo steps\nmax_steps: {}\nnodes:\n",
        steps + 1
    );
    for i in 0..steps {
        yaml.push_str(&format!(
            "  - id: s{i}\n    tool: echo\n    queue: {}\n    side_effect: pure\n    timeout: 60s\n    args:\n      payload: $input.payload\n      step: {i}\n",
            queues[i % queues.len()]
        ));
    }
    if steps > 1 {
        yaml.push_str("edges:\n");
        for i in 1..steps {
            yaml.push_str(&format!("  - from: s{}\n    to: s{i}\n", i - 1));
        }
    }
    Graph::parse(&yaml).map_err(|e| anyhow::anyhow!("the bench graph is invalid: {e:?}"))
}

/// Publishes the bench graph under `topics`.
pub async fn publish_graph(
    kafka: &KafkaConfig,
    codec: &Codec,
    topics: &Topics,
    graph: &Graph,
) -> anyhow::Result<()> {
    // A freshly started broker can answer NotLeaderForPartition for a moment after its
    // metadata already names a leader.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let published =
            sortie_catalog::publish(kafka, codec, topics, graph, "sortie-bench", crate::now_ms())
                .await;
        match published {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() > deadline => return Err(e.into()),
            Err(e) => {
                tracing::debug!(error = %e, "Publishing the bench graph failed; retrying.");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    }
}

pub fn codec(registry_url: &str) -> Arc<Codec> {
    Arc::new(Codec::new(&CodecConfig {
        registry_url: registry_url.to_owned(),
        auto_register: true,
    }))
}

/// Deletes every topic whose name starts with `prefix`.
pub async fn delete_topics(kafka: &KafkaConfig, prefix: &str) -> anyhow::Result<usize> {
    let consumer: BaseConsumer = kafka.client().create()?;
    let metadata =
        tokio::task::spawn_blocking(move || consumer.fetch_metadata(None, Duration::from_secs(10)))
            .await??;
    let names: Vec<String> = metadata
        .topics()
        .iter()
        .map(|t| t.name().to_owned())
        .filter(|name| name.starts_with(prefix))
        .collect();
    if names.is_empty() {
        return Ok(0);
    }
    let admin: AdminClient<DefaultClientContext> = kafka.client().create()?;
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    admin.delete_topics(&refs, &options).await?;
    Ok(names.len())
}

/// A `sortie` service process with its output in a log file.
#[derive(Debug)]
pub struct Service {
    pub name: String,
    child: Child,
    pub log: PathBuf,
    pub spawned: Instant,
}

impl Service {
    pub fn spawn(
        exe: &Path,
        dir: &Path,
        name: &str,
        args: &[String],
        rust_log: &str,
    ) -> anyhow::Result<Service> {
        let log = dir.join(format!("{name}.log"));
        let file =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let spawned = Instant::now();
        let child = Command::new(exe)
            .args(args)
            // The bench reads the services' logs: pin their filter and line format.
            .env("RUST_LOG", rust_log)
            .env("SORTIE__LOG__LEVEL", rust_log)
            .env("SORTIE__LOG__FORMAT", "text")
            .stdin(Stdio::null())
            .stdout(Stdio::from(file.try_clone()?))
            .stderr(Stdio::from(file))
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        Ok(Service {
            name: name.to_owned(),
            child,
            log,
            spawned,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Fails with the log's tail if the process has exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Ok(Some(status)) = self.child.try_wait() {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(20).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            bail!(
                "{} exited ({status}); last lines of {}:\n{}",
                self.name,
                self.log.display(),
                tail.join("\n")
            );
        }
        Ok(())
    }

    /// SIGTERM, then wait (SIGKILL after 30 s).
    pub fn stop(&mut self) {
        if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) | Err(_) => return,
                Ok(None) if Instant::now() > deadline => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    /// SIGKILL, and wait: a crash.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The log's lines (the whole file).
    pub fn log_lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill();
        }
    }
}

/// The value of `key=value` in a tracing log line (fmt format), if present.
pub fn field<'l>(line: &'l str, key: &str) -> Option<&'l str> {
    let needle = format!(" {key}=");
    let at = line.find(&needle)? + needle.len();
    line[at..].split_whitespace().next()
}

/// What the reducer's restore lines say: (partitions restored, records read, milliseconds
/// summed over partitions).
pub fn restores(lines: &[String]) -> (usize, u64, u64) {
    let mut partitions = 0;
    let mut records = 0;
    let mut millis = 0;
    for line in lines {
        if line.contains("Partition restored from the changelog.") {
            partitions += 1;
            records += field(line, "records")
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        } else if line.contains("Assignment restored") {
            // One restore per assignment, all its partitions at once.
            millis += field(line, "millis")
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    (partitions, records, millis)
}

/// The transaction phases of each "Batch committed." line (`phases_ms=[a, b, c, d, e]`:
/// encode states, begin + produce, send offsets, await deliveries, commit).
pub fn commit_phases(lines: &[String]) -> Vec<[f64; 5]> {
    lines
        .iter()
        .filter(|l| l.contains("Batch committed."))
        .filter_map(|line| {
            let at = line.find("phases_ms=[")? + "phases_ms=[".len();
            let end = line[at..].find(']')? + at;
            let values: Vec<f64> = line[at..end]
                .split(',')
                .filter_map(|v| v.trim().parse().ok())
                .collect();
            <[f64; 5]>::try_from(values).ok()
        })
        .collect()
}

/// One "Batch committed." line of the reducer: (inputs, outputs, commit_ms, blocked_ms).
/// `blocked_ms` is the part of the transaction the loop waited for (the rest overlapped
/// folding the next batch); a reducer before the commit pipeline blocked for all of it.
pub fn commits(lines: &[String]) -> Vec<(u64, u64, u64, u64)> {
    lines
        .iter()
        .filter(|l| l.contains("Batch committed."))
        .filter_map(|line| {
            let get = |key| field(line, key).and_then(|v| v.parse::<u64>().ok());
            let took = get("commit_ms")?;
            Some((
                get("inputs")?,
                get("outputs")?,
                took,
                get("blocked_ms").unwrap_or(took),
            ))
        })
        .collect()
}

/// When each transaction of the reducer's "Batch committed." lines began and when its
/// commit was answered, µs since the epoch, in commit order (lines from before the
/// reducer logged them are skipped).
pub fn commit_spans(lines: &[String]) -> Vec<(i64, i64)> {
    lines
        .iter()
        .filter(|l| l.contains("Batch committed."))
        .filter_map(|line| {
            let get = |key| field(line, key).and_then(|v| v.parse::<i64>().ok());
            Some((get("began_us")?, get("committed_us")?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_from_fmt_lines() {
        let line = "2026-01-01T00:00:00.000001Z DEBUG sortie_reducer::driver: Batch committed. inputs=12 outputs=40 runs=10 ignored=0 dead_letters=0 commit_ms=3";
        assert_eq!(field(line, "inputs"), Some("12"));
        assert_eq!(field(line, "commit_ms"), Some("3"));
        assert_eq!(commits(&[line.to_owned()]), vec![(12, 40, 3, 3)]);
        let pipelined = format!("{line} blocked_ms=1");
        assert_eq!(commits(&[pipelined]), vec![(12, 40, 3, 1)]);
        let restore = [
            "2026-01-01T00:00:00Z  INFO sortie_reducer::tasks: Partition restored from the changelog. partition=3 records=120 warm=false".to_owned(),
            "2026-01-01T00:00:00Z  INFO sortie_reducer::tasks: Assignment restored; consuming from the committed offsets. partitions={3} records=120 warm=false millis=40 stopped=[]".to_owned(),
        ];
        assert_eq!(restores(&restore), (1, 120, 40));
        let phased = format!("{line} phases_ms=[1, 2, 3, 4, 5]");
        assert_eq!(commit_phases(&[phased]), vec![[1.0, 2.0, 3.0, 4.0, 5.0]]);
        assert_eq!(commit_spans(&[line.to_owned()]), vec![]);
        let spanned = format!("{line} began_us=1796545338175307 committed_us=1796545338183791");
        assert_eq!(
            commit_spans(&[spanned]),
            vec![(1796545338175307, 1796545338183791)]
        );
    }

    #[test]
    fn the_bench_graph_parses() {
        let five = graph(GRAPH, 5, &queues(2)).expect("graph");
        assert_eq!(five.nodes.len(), 5);
        assert_eq!(five.nodes[3].queue, "bench1");
        assert_eq!(five.edges.len(), 4);
        let one = graph(ONE_STEP_GRAPH, 1, &queues(2)).expect("graph");
        assert_eq!((one.id.as_str(), one.nodes.len()), (ONE_STEP_GRAPH, 1));
        assert!(one.edges.is_empty());
    }
}
