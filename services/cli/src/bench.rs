//! `sortie bench`: the benchmark program (`sortie-bench`); prints one JSON document.

use std::path::PathBuf;
use std::time::Duration;

use sortie_bench::Options;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A tiny load (20 runs x 3 steps) that checks the harness end to end.
    #[arg(long)]
    quick: bool,
    /// Use this broker instead of starting the bench's own.
    #[arg(long)]
    bootstrap: Option<String>,
    /// Topic prefix (default: a fresh `bench.<millis>.`).
    #[arg(long)]
    prefix: Option<String>,
    /// The bench broker's data, logs and caches.
    #[arg(long, default_value = "target/bench")]
    data_dir: PathBuf,
    /// The bench broker's port (the controller takes the next one).
    #[arg(long, default_value_t = 19392)]
    kafka_port: u16,
    /// Leave the bench broker running afterwards.
    #[arg(long)]
    keep_broker: bool,
    /// Leave the bench's topics on the broker.
    #[arg(long)]
    keep_topics: bool,
    /// Extra librdkafka settings (`key=value` lines) for every client: passed to the
    /// services, applied to the ceiling loop and the driver too.
    #[arg(long, env = "SORTIE__KAFKA__PROPERTIES_FILE")]
    kafka_properties: Option<PathBuf>,
    /// Runs to drive [full: 10000, quick: 20].
    #[arg(long)]
    runs: Option<usize>,
    /// Steps per run (a chain of echo steps) [full: 5, quick: 3].
    #[arg(long)]
    steps: Option<usize>,
    /// Runs in flight at once [full: 2000, quick: 10].
    #[arg(long)]
    concurrency: Option<usize>,
    /// Runs of the light load that measures the round trip without queueing
    /// [full: 200, quick: 5].
    #[arg(long)]
    light_runs: Option<usize>,
    /// Runs in flight during the light load [full: 20, quick: 2].
    #[arg(long)]
    light_concurrency: Option<usize>,
    /// Runs driven before anything is measured, to warm the broker's JIT up [full:
    /// 10000, quick: 0].
    #[arg(long)]
    warmup_runs: Option<usize>,
    /// Payload bytes in each run's input, carried by every step [full: 256, quick: 64].
    #[arg(long)]
    payload_bytes: Option<usize>,
    /// Executor queues the steps are spread over.
    #[arg(long, default_value_t = 2)]
    queues: usize,
    /// Partitions of the co-partitioned topics.
    #[arg(long, default_value_t = 12)]
    partitions: u32,
    /// Partitions of every intents topic [default: topology/topics.yaml's].
    #[arg(long)]
    intent_partitions: Option<u32>,
    /// The reducer's (and the ceiling loop's) commit interval.
    #[arg(long, default_value_t = 100)]
    commit_interval_ms: u64,
    /// The reducer's (and the ceiling loop's) largest batch.
    #[arg(long, default_value_t = 500)]
    max_batch: usize,
    /// Executor processes.
    #[arg(long, default_value_t = 1)]
    executors: usize,
    /// Reducers sharing the partitions during the loads (restarts use the first alone).
    #[arg(long, default_value_t = 1)]
    reducers: usize,
    /// Intents an executor runs at once, per queue.
    #[arg(long, default_value_t = 256)]
    executor_max_in_flight: usize,
    /// Also measure the reducer's memory and cold restore with synthetic run states at
    /// these run counts (written straight to the changelog).
    #[arg(long)]
    rss_scale: bool,
    #[arg(long, value_delimiter = ',', default_value = "10000,1000000")]
    rss_runs: Vec<usize>,
    /// Longest a load may run before it is cut short [full: 600, quick: 120].
    #[arg(long)]
    timeout_s: Option<u64>,
    /// Instead of throughput and restarts: 2 reducers and 2 executors, the light load
    /// steady and then while each instance restarts in turn (as a rolling update);
    /// reports both step round-trip p99s.
    #[arg(long)]
    roll: bool,
    /// Run the reducer and executors with sealed payloads (per-run data keys in a key
    /// store of the bench's own): what encryption costs, against a run without.
    #[arg(long)]
    seal: bool,
    /// With --seal: where the run keys live (`file:///…`, `s3://…`); default a directory
    /// in the bench's run directory.
    #[arg(long, requires = "seal")]
    seal_key_store: Option<String>,
    /// The `sortie` executable the reducer and executors run as (default: this one). To
    /// compare two builds under the same harness, in the same quarter hour.
    #[arg(long)]
    services_exe: Option<std::path::PathBuf>,
    /// An extra JVM flag for the bench's own broker (repeatable), after its defaults
    /// (`-XX:+UseSerialGC`, `-XX:-TieredCompilation`): to compare broker tunings under
    /// the same harness, e.g. `--broker-jvm-flag=-XX:+TieredCompilation`.
    #[arg(long, allow_hyphen_values = true)]
    broker_jvm_flag: Vec<String>,
    /// An extra `server.properties` line (`key=value`, repeatable) for the bench's own
    /// broker, after its defaults: to compare broker settings under the same harness, e.g.
    /// `--broker-property num.io.threads=2`.
    #[arg(long)]
    broker_property: Vec<String>,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    if let Some(bootstrap) = &args.bootstrap {
        crate::reach::kafka_via(
            bootstrap,
            "--bootstrap",
            "Point --bootstrap at yours, or leave it out for the bench's own broker",
            crate::reach::PATIENCE,
        )
        .await?;
    }
    let exe = match &args.services_exe {
        Some(exe) => exe.canonicalize()?,
        None => std::env::current_exe()?,
    };
    let base = if args.quick {
        Options::quick(exe)
    } else {
        Options::full(exe)
    };
    let options = Options {
        bootstrap: args.bootstrap,
        prefix: args.prefix,
        data_dir: args.data_dir,
        kafka_port: args.kafka_port,
        keep_broker: args.keep_broker,
        keep_topics: args.keep_topics,
        kafka_properties: args.kafka_properties,
        broker_jvm_flags: args.broker_jvm_flag,
        broker_properties: args.broker_property,
        runs: args.runs.unwrap_or(base.runs),
        steps: args.steps.unwrap_or(base.steps).max(1),
        concurrency: args.concurrency.unwrap_or(base.concurrency).max(1),
        payload_bytes: args.payload_bytes.unwrap_or(base.payload_bytes),
        light_runs: args.light_runs.unwrap_or(base.light_runs),
        warmup_runs: args.warmup_runs.unwrap_or(base.warmup_runs),
        light_concurrency: args
            .light_concurrency
            .unwrap_or(base.light_concurrency)
            .max(1),
        queues: args.queues.max(1),
        partitions: args.partitions.max(1),
        intent_partitions: args.intent_partitions,
        commit_interval: Duration::from_millis(args.commit_interval_ms),
        max_batch: args.max_batch.max(1),
        executors: args.executors.max(1),
        reducers: args.reducers.max(1),
        executor_max_in_flight: args.executor_max_in_flight.max(1),
        rss_scale: if args.rss_scale {
            args.rss_runs
        } else {
            Vec::new()
        },
        timeout: args.timeout_s.map_or(base.timeout, Duration::from_secs),
        roll: args.roll,
        seal: args.seal,
        seal_key_store: args.seal_key_store,
        progress: Some(crate::progress::line),
        ..base
    };
    let report = sortie_bench::run(options).await;
    crate::progress::clear();
    let report = report?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
