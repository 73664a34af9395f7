//! `sortie bench`: drives a configurable load through the real services (reducer and
//! executors as their own processes) on a real broker, measures the ceiling — a bare
//! transactional read-process-write loop with the same broker, partitions, batch and
//! commit settings — in the same run, and reports one JSON document: throughput, step
//! round trip, transaction commit latency and size, the services' CPU and memory, warm
//! restart and cold restore, and (with `--rss-scale`) the reducer's memory as the number
//! of runs grows. Each SPEC §11 target is reported with its verdict.
//!
//! A benchmark is a program, never a timed assertion in a test. This crate holds the
//! harness only: it must not hold run semantics (those are `sortie-core`'s) nor stand in
//! for a service (the services under test are the real `sortie` binary). Being a program
//! that reports rather than handles failures, it uses `anyhow`.

pub(crate) use sortie_kafka::clock::now_ms;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sortie_kafka::KafkaConfig;
use tokio::runtime::Handle;

mod bench;
mod ceiling;
mod hops;
mod load;
mod measure;
mod phase;
mod pipeline;
mod procfs;
mod roll;
mod scale;
mod shape;
/// The stack a bench runs on (broker, registry, topology, services as processes), shared
/// with `sortie fuzz`.
pub mod stack;
mod stats;

pub(crate) use bench::Bench;
use measure::measure;
use stats::round;

/// What to measure and how hard to push.
#[derive(Debug, Clone)]
pub struct Options {
    /// The `sortie` binary that runs the services.
    pub exe: PathBuf,
    /// Use this broker instead of starting the bench's own.
    pub bootstrap: Option<String>,
    /// Topic, group and transactional-id prefix (default: a fresh `bench.<millis>.`).
    pub prefix: Option<String>,
    /// The bench's own broker, logs and caches live here.
    pub data_dir: PathBuf,
    /// The bench broker's port (its controller takes the next one).
    pub kafka_port: u16,
    /// Leave a broker this run started running.
    pub keep_broker: bool,
    /// Leave the bench's topics on the broker.
    pub keep_topics: bool,
    /// Extra librdkafka settings (`key=value` lines) for every client: the services get
    /// the file, the ceiling loop and the driver the same properties.
    pub kafka_properties: Option<PathBuf>,
    /// Extra JVM flags of the bench's own broker, after its defaults.
    pub broker_jvm_flags: Vec<String>,
    /// Extra `server.properties` lines (`key=value`) of the bench's own broker, after its
    /// defaults.
    pub broker_properties: Vec<String>,
    pub runs: usize,
    pub steps: usize,
    /// Runs in flight at once (a closed loop).
    pub concurrency: usize,
    /// Bytes of payload in each run's input, carried by every step's args and output.
    pub payload_bytes: usize,
    pub queues: usize,
    pub partitions: u32,
    /// Partitions of every intents topic (default: `topology/topics.yaml`'s).
    pub intent_partitions: Option<u32>,
    pub commit_interval: Duration,
    pub max_batch: usize,
    pub executors: usize,
    /// Reducers sharing the partitions during the light and full loads (the restarts and
    /// the scale check use the first alone).
    pub reducers: usize,
    pub executor_max_in_flight: usize,
    /// Run counts of the memory scale check; empty: skip it.
    pub rss_scale: Vec<usize>,
    /// The light load (round trip without queueing): runs and runs in flight.
    pub light_runs: usize,
    /// Runs driven at full concurrency before anything is measured, unreported but for
    /// their throughput: the broker's JIT compiler takes most of a core for a minute
    /// after it starts, and would be measured instead.
    pub warmup_runs: usize,
    pub light_concurrency: usize,
    pub scale_steps: usize,
    pub scale_payload_bytes: usize,
    pub scale_load_runs: usize,
    /// Longest a load may take before it is cut short (and reported as unfinished).
    pub timeout: Duration,
    /// Measure a rolling restart (`roll`) instead of throughput and restarts.
    pub roll: bool,
    /// Run the services with sealed payloads (a KEK and a key store of the bench's own):
    /// what encryption costs.
    pub seal: bool,
    /// With `seal`: the key store (default: a directory in the bench's run directory).
    pub seal_key_store: Option<String>,
    /// Called about once a second during a load with a line saying how it goes, and with
    /// `""` when the load ends (the CLI rewrites one line on a terminal with it).
    pub progress: Option<fn(&str)>,
}

impl Options {
    /// The full default load.
    pub fn full(exe: PathBuf) -> Options {
        Options {
            exe,
            bootstrap: None,
            prefix: None,
            data_dir: PathBuf::from("target/bench"),
            kafka_port: 19392,
            keep_broker: false,
            keep_topics: false,
            kafka_properties: None,
            broker_jvm_flags: Vec::new(),
            broker_properties: Vec::new(),
            runs: 10_000,
            steps: 5,
            concurrency: 2000,
            payload_bytes: 256,
            queues: 2,
            partitions: 12,
            intent_partitions: None,
            commit_interval: Duration::from_millis(100),
            max_batch: 500,
            executors: 1,
            reducers: 1,
            executor_max_in_flight: 256,
            rss_scale: Vec::new(),
            light_runs: 200,
            light_concurrency: 20,
            warmup_runs: 10_000,
            scale_steps: 1,
            scale_payload_bytes: 64,
            scale_load_runs: 500,
            timeout: Duration::from_secs(600),
            roll: false,
            seal: false,
            seal_key_store: None,
            progress: None,
        }
    }

    /// A tiny load that checks the harness end to end in seconds.
    pub fn quick(exe: PathBuf) -> Options {
        Options {
            runs: 20,
            steps: 3,
            concurrency: 10,
            payload_bytes: 64,
            light_runs: 5,
            light_concurrency: 2,
            warmup_runs: 0,
            timeout: Duration::from_secs(120),
            ..Options::full(exe)
        }
    }
}

/// Runs the benchmark and returns its report.
pub async fn run(options: Options) -> anyhow::Result<Value> {
    let started = Instant::now();
    let load_before = procfs::load_average();
    let mut own_broker = None;
    let (bootstrap, broker_json) = match &options.bootstrap {
        Some(bootstrap) => (
            bootstrap.clone(),
            json!({ "bootstrap": bootstrap, "own": false }),
        ),
        None => {
            let broker = stack::own_broker(&options)?;
            let flags = broker.config().jvm_flags.clone();
            let properties = broker.config().properties.clone();
            let ensure = broker.clone();
            eprintln!(
                "sortie bench: starting the bench broker in {}",
                broker.data_dir().display()
            );
            let running = tokio::task::spawn_blocking(move || ensure.ensure_running()).await??;
            let json = json!({
                "bootstrap": running.bootstrap,
                "own": true,
                "reused": running.reused,
                "jvm_flags": if running.reused { Value::Null } else { json!(flags) },
                "properties": if running.reused { Value::Null } else { json!(properties) },
                "pid": running.pid,
            });
            let pid = running.pid;
            let bootstrap = running.bootstrap.clone();
            own_broker = Some((broker, running.reused, pid));
            (bootstrap, json)
        }
    };
    let mut kafka = KafkaConfig::new(bootstrap);
    let mut options = options;
    if let Some(path) = &options.kafka_properties {
        let path = std::fs::canonicalize(path)?;
        kafka.properties = stack::properties(&std::fs::read_to_string(&path)?)?;
        options.kafka_properties = Some(path);
    }
    let prefix = options
        .prefix
        .clone()
        .unwrap_or_else(|| format!("bench.{}.", now_ms()));
    std::fs::create_dir_all(&options.data_dir)?;
    let dir = std::fs::canonicalize(&options.data_dir)?
        .join("runs")
        .join(prefix.trim_end_matches('.'));
    std::fs::create_dir_all(&dir)?;
    let registry = stack::ServedRegistry::start(&kafka, &format!("{prefix}_schemas")).await?;
    let seal_args = match options.seal {
        true => {
            let kek = dir.join("kek.yaml");
            std::fs::write(&kek, sortie_seal::kek::Keyring::generate("*", "bench")?)?;
            vec![
                "--seal-keyring".to_owned(),
                kek.display().to_string(),
                "--seal-key-store".to_owned(),
                options
                    .seal_key_store
                    .clone()
                    .unwrap_or_else(|| format!("file://{}", dir.join("run-keys").display())),
            ]
        }
        false => Vec::new(),
    };
    let bench = Bench {
        seal_args,
        options: options.clone(),
        prefix: prefix.clone(),
        kafka: kafka.clone(),
        registry_url: registry.url.clone(),
        codec: stack::codec(&registry.url),
        runtime: Handle::current(),
        dir: dir.clone(),
    };
    let broker_pid = own_broker.as_ref().map(|(_, _, pid)| *pid);
    let result = tokio::task::spawn_blocking(move || {
        if bench.options.roll {
            roll::measure(&bench)
        } else {
            measure(&bench, broker_pid)
        }
    })
    .await;

    registry.stop().await;
    if !options.keep_topics {
        if let Err(e) = stack::delete_topics(&kafka, &prefix).await {
            eprintln!("sortie bench: deleting the bench topics failed: {e}");
        }
    }
    if let Some((broker, reused, _)) = own_broker {
        if !reused && !options.keep_broker {
            tokio::task::spawn_blocking(move || broker.stop()).await??;
        }
    }
    let mut report = result??;
    if let Some(map) = report.as_object_mut() {
        map.insert("broker".into(), broker_json);
        map.insert(
            "machine".into(),
            json!({
                "cpus": procfs::cpus(),
                "load_average_1m_before": load_before,
                "load_average_1m_after": procfs::load_average(),
            }),
        );
        map.insert("logs".into(), json!(dir.display().to_string()));
        map.insert(
            "bench_wall_s".into(),
            json!(round(started.elapsed().as_secs_f64())),
        );
    }
    Ok(report)
}
/// `bytes` of pseudo-random letters and digits, the same for the same `seed`: a payload
/// that packs about as badly as text does (the reducer's cache compresses run states; a
/// run of one letter, the bench's payload before, would flatter it).
pub(crate) fn payload_text(bytes: usize, seed: &str) -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    // FNV-1a of the seed, then xorshift64*.
    let mut x = seed.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    }) | 1;
    (0..bytes)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            let r = x.wrapping_mul(0x2545_f491_4f6c_dd1d);
            char::from(ALPHABET[(r >> 58) as usize % ALPHABET.len()])
        })
        .collect()
}
