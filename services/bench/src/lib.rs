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
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sortie_kafka::KafkaConfig;
use sortie_wire::{Codec, Topics};
use tokio::runtime::Handle;

mod ceiling;
mod hops;
mod load;
mod pipeline;
mod procfs;
mod roll;
mod scale;
mod shape;
/// The stack a bench runs on (broker, registry, topology, services as processes), shared
/// with `sortie fuzz`.
pub mod stack;
mod stats;

use load::Driver;
use stack::Service;
use stats::{ratio, round, summary};

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

/// What the blocking phases share.
#[derive(Debug, Clone)]
pub(crate) struct Bench {
    pub options: Options,
    pub prefix: String,
    pub kafka: KafkaConfig,
    pub registry_url: String,
    pub codec: Arc<Codec>,
    pub runtime: Handle,
    /// Logs and caches of this run.
    pub dir: PathBuf,
    /// `--seal-keyring … --seal-key-store …` for the reducers and executors, with `seal`.
    pub seal_args: Vec<String>,
}

impl Bench {
    fn common_args(&self, prefix: &str) -> Vec<String> {
        let mut args = vec![
            "--bootstrap-servers".into(),
            self.kafka.bootstrap_servers.clone(),
            "--registry-url".into(),
            self.registry_url.clone(),
            "--prefix".into(),
            prefix.to_owned(),
        ];
        if let Some(path) = &self.options.kafka_properties {
            args.extend(["--kafka-properties".into(), path.display().to_string()]);
        }
        args
    }

    /// Drives one run of `graph_id` (`run_id`) through `services` and teaches `driver`
    /// its events' pattern, which the driver then times every run by.
    fn calibrate(
        &self,
        driver: &mut Driver,
        topics: &Topics,
        graph_id: &str,
        run_id: &str,
        services: &mut [&mut Service],
    ) -> anyhow::Result<load::Pattern> {
        let calibration = self.encode_commands(topics, graph_id, &[run_id.to_owned()])?;
        driver.calibrate(
            &calibration[0].0,
            &calibration[0].1,
            Duration::from_secs(180),
            services,
        )
    }

    /// Creates the bench topics and publishes the echo graphs (the load's, and the
    /// one-step graph of `light_one_step`); returns the topic names.
    fn prepare(&self) -> anyhow::Result<Topics> {
        let options = &self.options;
        let topics = Topics::new(self.prefix.clone());
        let queues = stack::queues(options.queues);
        let graph = stack::graph(stack::GRAPH, options.steps, &queues)?;
        let one_step = stack::graph(stack::ONE_STEP_GRAPH, 1, &queues)?;
        self.runtime.block_on(async {
            stack::apply_topology(
                &self.kafka,
                &self.prefix,
                options.partitions,
                options.intent_partitions,
                &queues,
            )
            .await?;
            stack::publish_graph(&self.kafka, &self.codec, &topics, &graph).await?;
            stack::publish_graph(&self.kafka, &self.codec, &topics, &one_step).await
        })?;
        Ok(topics)
    }

    /// A load driver over `topics`, reporting progress as the options say.
    fn driver(&self, topics: &Topics) -> anyhow::Result<Driver> {
        let mut driver = Driver::new(
            &self.kafka,
            topics,
            self.options.partitions,
            self.codec.clone(),
            self.runtime.clone(),
        )?;
        driver.progress = self.options.progress;
        Ok(driver)
    }

    /// A `sortie reducer` process (debug logs of the reducer: commits and restores).
    pub fn reducer(
        &self,
        dir: &Path,
        name: &str,
        prefix: &str,
        data: &Path,
    ) -> anyhow::Result<Service> {
        self.reducer_with(dir, name, prefix, data, "0", &[])
    }

    /// [`Bench::reducer`] with its own instance id (and so transactional ids: one of
    /// several reducers sharing the partitions) and more arguments for `sortie reducer`.
    pub fn reducer_with(
        &self,
        dir: &Path,
        name: &str,
        prefix: &str,
        data: &Path,
        instance: &str,
        extra: &[&str],
    ) -> anyhow::Result<Service> {
        let mut args = vec!["reducer".to_owned()];
        args.extend(extra.iter().map(|arg| (*arg).to_owned()));
        args.extend(self.common_args(prefix));
        args.extend(self.seal_args.iter().cloned());
        args.extend([
            "--data-dir".to_owned(),
            data.display().to_string(),
            "--instance-id".to_owned(),
            instance.to_owned(),
            "--commit-interval-ms".to_owned(),
            self.options.commit_interval.as_millis().to_string(),
            "--max-batch".to_owned(),
            self.options.max_batch.to_string(),
        ]);
        let service = Service::spawn(
            &self.options.exe,
            dir,
            name,
            &args,
            "warn,sortie_reducer=debug",
        )?;
        eprintln!(
            "sortie bench: {name} pid {} (log {})",
            service.pid(),
            service.log.display()
        );
        Ok(service)
    }

    /// A `sortie executor` process serving every bench queue.
    pub fn executor(
        &self,
        dir: &Path,
        name: &str,
        prefix: &str,
        index: usize,
    ) -> anyhow::Result<Service> {
        let mut args = vec!["executor".to_owned()];
        args.extend(self.common_args(prefix));
        args.extend(self.seal_args.iter().cloned());
        args.extend([
            "--queue".to_owned(),
            stack::queues(self.options.queues).join(","),
            "--executor-id".to_owned(),
            format!("bench-executor-{index}"),
            "--max-in-flight".to_owned(),
            self.options.executor_max_in_flight.to_string(),
        ]);
        // Info from the consumer threads: "Partitions assigned." is how the roll knows a
        // restarted executor is ready.
        Service::spawn(
            &self.options.exe,
            dir,
            name,
            &args,
            "warn,sortie_executor::runtime=info",
        )
    }

    fn encode_commands(
        &self,
        topics: &Topics,
        graph_id: &str,
        ids: &[String],
    ) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
        ids.iter()
            .map(|run_id| {
                let bytes = self.runtime.block_on(Driver::start_command(
                    &self.codec,
                    topics,
                    run_id,
                    graph_id,
                    self.options.payload_bytes,
                ))?;
                Ok((run_id.clone(), bytes))
            })
            .collect()
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

/// The measuring part, blocking.
fn measure(bench: &Bench, broker_pid: Option<u32>) -> anyhow::Result<Value> {
    let options = &bench.options;
    let topics = bench.prepare()?;

    // The services, and one calibration run through them (also warms them up).
    let data = bench.dir.join("reducer");
    let mut reducer = bench.reducer(&bench.dir, "reducer", &bench.prefix, &data)?;
    let mut extra_reducers = (1..options.reducers.max(1))
        .map(|k| {
            bench.reducer_with(
                &bench.dir,
                &format!("reducer-{k}"),
                &bench.prefix,
                &bench.dir.join(format!("reducer-{k}")),
                &k.to_string(),
                &[],
            )
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut executors = (0..options.executors.max(1))
        .map(|i| bench.executor(&bench.dir, &format!("executor-{i}"), &bench.prefix, i))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut driver = bench.driver(&topics)?;
    eprintln!("sortie bench: calibration runs");
    let [one_step_pattern, pattern] = {
        let mut all: Vec<&mut Service> = vec![&mut reducer];
        all.extend(executors.iter_mut());
        let mut learn = |graph_id: &str, run_id: &str| {
            bench.calibrate(&mut driver, &topics, graph_id, run_id, &mut all)
        };
        // The load's last: the driver keeps the pattern it learnt last.
        [
            learn(stack::ONE_STEP_GRAPH, "calibration-one-step")?,
            learn(stack::GRAPH, "calibration")?,
        ]
    };

    // A warm-up load, then the light load (the round trip when nothing queues), before
    // the ceilings. A broker just started spends most of a core in its JIT compiler for
    // a minute or more (C2, seen with `top -H` during the light load): without the
    // warm-up the light load measured that.
    let (warmup, light, light_one_step) = {
        let mut all: Vec<&mut Service> = vec![&mut reducer];
        all.extend(extra_reducers.iter_mut());
        all.extend(executors.iter_mut());
        let warmup = match options.warmup_runs {
            0 => None,
            runs => {
                let full = phase(
                    bench,
                    &mut driver,
                    &topics,
                    "warmup",
                    (stack::GRAPH, options.steps),
                    runs,
                    options.concurrency,
                    &mut all,
                    broker_pid,
                )?;
                // The same light load once more, unmeasured: the broker compiles again
                // for each new kind of load, and the light load is the one it meets
                // first after the full-load warm-up.
                let light = phase(
                    bench,
                    &mut driver,
                    &topics,
                    "warmup-light",
                    (stack::GRAPH, options.steps),
                    options.light_runs,
                    options.light_concurrency,
                    &mut all,
                    broker_pid,
                )?;
                Some((full, light))
            }
        };
        let mut light = phase(
            bench,
            &mut driver,
            &topics,
            "light",
            (stack::GRAPH, options.steps),
            options.light_runs,
            options.light_concurrency,
            &mut all,
            broker_pid,
        )?;
        // Where a step's time goes when nothing queues, read back from the topics and
        // placed in the reducer's transactions (with one reducer: with more, whose
        // transaction carried a record is not known from one reducer's log).
        let spans = match options.reducers {
            1 => light.spans.as_slice(),
            _ => &[],
        };
        light.json["hops_ms"] = hops::measure(
            &bench.kafka,
            &bench.codec,
            &bench.runtime,
            &topics,
            &stack::queues(options.queues),
            "light-",
            spans,
        )
        .unwrap_or_else(|e| json!({ "error": e.to_string() }));
        // The same light load with one-step runs: what a run costs besides its steps
        // (its start and its end), beside Restate's harness's `light1`.
        let load_pattern = driver.pattern.replace(one_step_pattern);
        let light_one_step = phase(
            bench,
            &mut driver,
            &topics,
            "light-one-step",
            (stack::ONE_STEP_GRAPH, 1),
            options.light_runs,
            options.light_concurrency,
            &mut all,
            broker_pid,
        );
        driver.pattern = load_pattern;
        (warmup, light, light_one_step?)
    };

    // The ceilings, each fed as many records as Sortie will consume: a StartRun and one
    // result per step for every run. Untuned and tuned copy one record per input; the
    // fair one writes as many records per input as Sortie does (from the calibration
    // run: its events, one intent per step, and a state per input at most).
    let inputs = options.runs * (options.steps + 1);
    let per_run_inputs = (options.steps + 1) as f64;
    let fan_out = ((pattern.events as f64 + options.steps as f64 + per_run_inputs) / per_run_inputs)
        .round()
        .max(1.0) as usize;
    let mut ceilings = Vec::new();
    for (name, tuned, fan_out) in [
        ("untuned", false, 1),
        ("tuned", true, 1),
        ("fan-out", true, fan_out),
    ] {
        eprintln!("sortie bench: ceiling loop ({name}) over {inputs} records");
        ceilings.push(ceiling::run(
            &bench.kafka,
            &ceiling::Setup {
                prefix: bench.prefix.clone(),
                partitions: options.partitions,
                records: inputs,
                value_bytes: options.payload_bytes + 200,
                commit_interval: options.commit_interval,
                max_batch: options.max_batch,
                fan_out,
                tuned,
                name: name.to_owned(),
                watch: broker_pid
                    .map(|pid| ("broker".to_owned(), pid))
                    .into_iter()
                    .chain([("ceiling_loop".to_owned(), std::process::id())])
                    .collect(),
            },
            &bench.runtime,
        )?);
    }
    // The fair ceiling: Sortie's client settings and Sortie's records out per input.
    let ceiling = ceilings
        .pop()
        .ok_or_else(|| anyhow::anyhow!("no ceiling"))?;

    // What one transaction costs by the partitions it writes, on the quiet broker.
    eprintln!("sortie bench: transaction shape");
    let shape = shape::run(&bench.kafka, &bench.prefix, &bench.runtime)
        .unwrap_or_else(|e| json!({ "error": e.to_string() }));

    // The pipeline: Sortie's legs per step with no Sortie logic, the same loads (the
    // light one once unmeasured first, as for Sortie).
    let pipeline = {
        let load = |name: &str, runs, concurrency| pipeline::Load {
            name: name.to_owned(),
            runs,
            concurrency,
        };
        let mut reports = pipeline::run(
            &bench.kafka,
            &pipeline::Setup {
                prefix: bench.prefix.clone(),
                partitions: options.partitions,
                steps: options.steps,
                payload_bytes: options.payload_bytes,
                fan_out,
                commit_interval: options.commit_interval,
                max_batch: options.max_batch,
                watch: broker_pid
                    .map(|pid| ("broker".to_owned(), pid))
                    .into_iter()
                    .chain([("pipeline".to_owned(), std::process::id())])
                    .collect(),
            },
            &[
                load(
                    "warmup-light",
                    options.light_runs,
                    options.light_concurrency,
                ),
                load("light", options.light_runs, options.light_concurrency),
                load("run", options.runs, options.concurrency),
            ],
            &bench.runtime,
        )?;
        let full = reports.pop().unwrap_or_default();
        let light = reports.pop().unwrap_or_default();
        json!({ "fan_out": fan_out, "light": light, "full": full })
    };

    // The full load, after the ceilings. Commit figures come from the first reducer's log.
    let mut all: Vec<&mut Service> = vec![&mut reducer];
    all.extend(extra_reducers.iter_mut());
    all.extend(executors.iter_mut());
    let load = phase(
        bench,
        &mut driver,
        &topics,
        "run",
        (stack::GRAPH, options.steps),
        options.runs,
        options.concurrency,
        &mut all,
        broker_pid,
    )?;
    drop(all);
    for extra in &mut extra_reducers {
        extra.stop();
    }
    let steps_per_s = load.json["steps_per_s"].as_f64().unwrap_or(0.0);

    // Warm restart: the same cache; then cold: no cache, everything from the changelog.
    let mut all_executors: Vec<&mut Service> = executors.iter_mut().collect();
    let warm = restart(
        bench,
        &mut driver,
        &mut reducer,
        &topics,
        &data,
        false,
        &mut all_executors,
    )?;
    let cold = restart(
        bench,
        &mut driver,
        &mut reducer,
        &topics,
        &data,
        true,
        &mut all_executors,
    )?;
    reducer.stop();
    for executor in &mut executors {
        executor.stop();
    }
    // The logs stay; the cache is only disk.
    let _ = std::fs::remove_dir_all(&data);

    let mut scale = Vec::new();
    for runs in &options.rss_scale {
        scale.push(scale::one(bench, *runs)?);
    }

    let ceiling_per_s = ceiling.records_per_s();
    let commit_interval_ms = options.commit_interval.as_millis() as f64;
    let p50 = light.json["step_round_trip_ms"]["p50"]
        .as_f64()
        .unwrap_or(0.0);
    let loaded_p50 = load.json["step_round_trip_ms"]["p50"]
        .as_f64()
        .unwrap_or(0.0);
    let warm_ms = warm["start_to_first_commit_ms"].as_f64().unwrap_or(0.0);
    let number = |value: &Value| value.as_f64().unwrap_or(0.0);
    let vs_pipeline = json!({
        "steps_per_s": ratio(steps_per_s, number(&pipeline["full"]["steps_per_s"])),
        "light_step_p50": ratio(p50, number(&pipeline["light"]["step_round_trip_ms"]["p50"])),
        "light_run_p50": ratio(
            number(&light.json["run_duration_ms"]["p50"]),
            number(&pipeline["light"]["run_duration_ms"]["p50"]),
        ),
    });
    let cold_rate = cold["restore"]["states_per_s"].as_f64().unwrap_or(0.0);
    let mut targets = serde_json::Map::new();
    targets.insert(
        "steps_per_s_vs_ceiling".into(),
        verdict(
            ratio(steps_per_s, ceiling_per_s),
            ">= 0.5",
            ratio(steps_per_s, ceiling_per_s) >= 0.5,
        ),
    );
    let steps_vs_pipeline = number(&vs_pipeline["steps_per_s"]);
    targets.insert(
        "steps_per_s_vs_pipeline".into(),
        verdict(steps_vs_pipeline, ">= 0.7", steps_vs_pipeline >= 0.7),
    );
    let light_vs_pipeline = number(&vs_pipeline["light_step_p50"]);
    targets.insert(
        "light_step_p50_vs_pipeline".into(),
        verdict(
            light_vs_pipeline,
            "<= 1.3",
            light_vs_pipeline > 0.0 && light_vs_pipeline <= 1.3,
        ),
    );
    targets.insert(
        "steps_per_s".into(),
        verdict(round(steps_per_s), ">= 5000", steps_per_s >= 5000.0),
    );
    let p99 = light.json["step_round_trip_ms"]["p99"]
        .as_f64()
        .unwrap_or(0.0);
    targets.insert(
        "light_round_trip_p50_ms".into(),
        verdict(p50, "<= 50", p50 <= 50.0),
    );
    targets.insert(
        "light_round_trip_p99_ms".into(),
        verdict(p99, "<= 150", p99 <= 150.0),
    );
    targets.insert(
        "round_trip_p50_vs_commit_interval".into(),
        verdict(
            ratio(p50, commit_interval_ms),
            "<= 2.0",
            p50 <= 2.0 * commit_interval_ms,
        ),
    );
    // The same under the full load, where runs queue behind each other (closed loop).
    targets.insert(
        "round_trip_p50_under_full_load_vs_commit_interval".into(),
        verdict(
            ratio(loaded_p50, commit_interval_ms),
            "<= 2.0 (informative: includes queueing)",
            loaded_p50 <= 2.0 * commit_interval_ms,
        ),
    );
    let scale_warm = scale
        .iter()
        .filter_map(|s| s["warm_start_to_first_commit_ms"].as_f64())
        .fold(warm_ms, f64::max);
    targets.insert(
        "warm_restart_ms".into(),
        verdict(round(warm_ms), "<= 1000", warm_ms <= 1000.0),
    );
    targets.insert(
        "warm_restart_ms_largest_cache".into(),
        verdict(round(scale_warm), "<= 2000", scale_warm <= 2000.0),
    );
    let restore_rate = scale
        .iter()
        .filter_map(|s| s["cold_restore"]["states_per_s"].as_f64())
        .next_back()
        .unwrap_or(cold_rate);
    targets.insert(
        "cold_restore_states_per_s".into(),
        verdict(restore_rate, ">= 100000", restore_rate >= 100_000.0),
    );
    if let (Some(small), Some(large)) = (scale.first(), scale.last()) {
        // Judged once what the restore freed has reached the OS (two seconds after its
        // first commit); the figure at the first commit is reported beside it.
        let rss = |s: &Value| {
            let after = &s["reducer_after_cold_restore"];
            after["rss_settled_mib"]
                .as_f64()
                .or_else(|| after["rss_mib"].as_f64())
                .unwrap_or(0.0)
        };
        let growth = ratio(rss(large), rss(small));
        targets.insert(
            "reducer_rss_growth_smallest_to_largest".into(),
            verdict(growth, "<= 1.5 (flat)", growth > 0.0 && growth <= 1.5),
        );
        targets.insert(
            "reducer_rss_mib_largest".into(),
            verdict(
                rss(large),
                "<= 256",
                rss(large) > 0.0 && rss(large) <= 256.0,
            ),
        );
    }

    Ok(json!({
        "sortie_bench": 1,
        "build": if cfg!(debug_assertions) { "debug" } else { "release" },
        "kafka_properties": bench.kafka.properties,
        "prefix": bench.prefix,
        "config": {
            "sealed": options.seal,
            "seal_key_store": options.seal_key_store,
            "runs": options.runs,
            "steps_per_run": options.steps,
            "concurrency": options.concurrency,
            "light_runs": options.light_runs,
            "light_concurrency": options.light_concurrency,
            "warmup_runs": options.warmup_runs,
            "services_exe": options.exe.display().to_string(),
            "payload_bytes": options.payload_bytes,
            "queues": options.queues,
            "partitions": options.partitions,
            "intent_partitions": options.intent_partitions,
            "commit_interval_ms": commit_interval_ms,
            "max_batch": options.max_batch,
            "executors": options.executors,
            "reducers": options.reducers.max(1),
            "executor_max_in_flight": options.executor_max_in_flight,
        },
        "events_per_run": pattern.events,
        "sortie": load.json,
        "sortie_light_load": light.json,
        "sortie_light_one_step": light_one_step.json,
        "warmup": warmup.map(|(w, light)| json!({
            "runs": w.json["runs"],
            "steps_per_s": w.json["steps_per_s"],
            "elapsed_s": w.json["elapsed_s"],
            "broker_jit_cores": w.broker_jit_cores,
            "light": {
                "runs": light.json["runs"],
                "step_round_trip_ms": light.json["step_round_trip_ms"],
                "broker_jit_cores": light.broker_jit_cores,
            },
        })),
        "ceiling": ceiling.json(),
        "ceilings_one_record_per_input": ceilings.iter().map(ceiling::Ceiling::json).collect::<Vec<_>>(),
        "pipeline": pipeline,
        "transaction_shape": shape,
        "ratios": {
            "sortie_to_pipeline": vs_pipeline,
            "steps_per_s_to_ceiling_records_per_s": ratio(steps_per_s, ceiling_per_s),
            "inputs_per_s_to_ceiling_records_per_s": ratio(
                load.json["inputs_per_s"].as_f64().unwrap_or(0.0),
                ceiling_per_s,
            ),
            "commit_ms_p50_to_ceiling": ratio(
                load.json["commit_ms"]["p50"].as_f64().unwrap_or(0.0),
                ceiling.json()["commit_ms"]["p50"].as_f64().unwrap_or(0.0),
            ),
        },
        "cpu_us": cpu_us(&load.json, steps_per_s, &ceiling),
        "warm_restart": warm,
        "cold_restore": cold,
        "rss_scale": if scale.is_empty() { Value::Null } else { json!(scale) },
        "targets": targets,
    }))
}

/// CPU microseconds per unit of work, from the processes' cores over each phase: per step
/// of the full load, per input of the fair ceiling, and what two (`procfs::cpus`) cores
/// allow per step at a ratio of 0.5 to that ceiling. The ratio's bound on this machine:
/// a step cannot take more CPU than that, summed over every process. Beside them, each
/// process's minor page faults per step of the full load: whether a change touches fewer
/// new pages, which CPU time on a noisy machine cannot say.
fn cpu_us(load: &Value, steps_per_s: f64, ceiling: &ceiling::Ceiling) -> Value {
    let per = |processes: &Value, rate: f64, figure: &str, scale: f64| -> Value {
        let mut out = serde_json::Map::new();
        let mut all = 0.0;
        if let Some(map) = processes.as_object() {
            for (name, figures) in map {
                if let Some(value) = figures.get(figure).and_then(Value::as_f64) {
                    let each = if rate > 0.0 {
                        value / rate * scale
                    } else {
                        0.0
                    };
                    all += each;
                    out.insert(name.clone(), json!(round(each)));
                }
            }
        }
        out.insert("all".into(), json!(round(all)));
        Value::Object(out)
    };
    let ceiling_per_s = ceiling.records_per_s();
    json!({
        "sortie_per_step": per(&load["processes"], steps_per_s, "cpu_cores", 1e6),
        "sortie_page_faults_per_step": per(&load["processes"], steps_per_s, "page_faults_per_s", 1.0),
        "ceiling_per_input": ceiling
            .processes
            .as_ref()
            .map(|p| per(p, ceiling_per_s, "cpu_cores", 1e6)),
        "allowed_per_step_at_ratio_0_5": if ceiling_per_s > 0.0 {
            json!(round(procfs::cpus() as f64 / (0.5 * ceiling_per_s) * 1e6))
        } else {
            Value::Null
        },
    })
}

/// What one load phase measured.
struct Phase {
    json: Value,
    /// The primary reducer's transactions of the phase: (began, committed), µs since the
    /// epoch.
    spans: Vec<(i64, i64)>,
    /// CPU the broker's JIT compiler threads used during the phase, in cores (`None`:
    /// not our broker, or not a JVM we can see).
    broker_jit_cores: Option<f64>,
}

/// Drives `runs` runs (`<name>-<i>`) with `concurrency` in flight and reports the figures:
/// throughput, round trips, the reducer's transactions during the phase, CPU and memory.
#[allow(clippy::too_many_arguments)]
fn phase(
    bench: &Bench,
    driver: &mut Driver,
    topics: &Topics,
    name: &str,
    (graph_id, steps): (&str, usize),
    runs: usize,
    concurrency: usize,
    services: &mut [&mut Service],
    broker_pid: Option<u32>,
) -> anyhow::Result<Phase> {
    let ids: Vec<String> = (0..runs).map(|i| format!("{name}-{i:07}")).collect();
    let commands = bench.encode_commands(topics, graph_id, &ids)?;
    let mut watched: Vec<(String, u32)> =
        services.iter().map(|s| (s.name.clone(), s.pid())).collect();
    if let Some(pid) = broker_pid {
        watched.push(("broker".into(), pid));
    }
    watched.push(("bench_driver".into(), std::process::id()));
    let log_before = services[0].log_lines().len();
    eprintln!("sortie bench: {name}: {runs} runs x {steps} steps, {concurrency} in flight");
    let window = procfs::CpuWindow::start(&watched);
    let jit_before = broker_pid.and_then(procfs::jit_cpu_seconds);
    let outcome = driver.run(&commands, concurrency, bench.options.timeout, services)?;
    let processes = window.finish();
    let broker_jit_cores = match (jit_before, broker_pid.and_then(procfs::jit_cpu_seconds)) {
        (Some(before), Some(after)) => Some(round(
            (after - before) / outcome.elapsed.as_secs_f64().max(1e-9),
        )),
        _ => None,
    };
    let lines = services[0].log_lines();
    let commits = stack::commits(lines.get(log_before..).unwrap_or_default());
    let elapsed = outcome.elapsed.as_secs_f64().max(1e-9);
    let steps_done = outcome.runs_succeeded * steps;
    let commit_ms: Vec<f64> = commits.iter().map(|c| c.2 as f64).collect();
    let outputs: Vec<f64> = commits.iter().map(|c| c.1 as f64).collect();
    let inputs: Vec<f64> = commits.iter().map(|c| c.0 as f64).collect();
    // Where a transaction's time goes, and how much of the phase the reducer spent in
    // transactions at all: the profile hint.
    let phases = stack::commit_phases(lines.get(log_before..).unwrap_or_default());
    let phase_of = |i: usize| summary(&phases.iter().map(|p| p[i]).collect::<Vec<_>>());
    let in_commits_s = commit_ms.iter().sum::<f64>() / 1000.0;
    let blocked_s = commits.iter().map(|c| c.3 as f64).sum::<f64>() / 1000.0;
    let profile = json!({
        "transaction_phase_ms": {
            "encode_states": phase_of(0),
            "begin_and_produce": phase_of(1),
            "send_offsets": phase_of(2),
            "await_deliveries": phase_of(3),
            "commit": phase_of(4),
        },
        "share_of_time_in_transactions": round(in_commits_s / elapsed),
        "share_of_time_blocked_by_transactions": round(blocked_s / elapsed),
        "hint": "send_offsets and await_deliveries wait for the broker (CONCURRENT_TRANSACTIONS while the previous transaction's markers are written); the reducer folds the next batch while a transaction's deliveries come in, so only the blocked share held its loop; the rest is the reducer's own CPU (fold, encode, sled) or waiting for input",
    });
    Ok(Phase {
        json: json!({
            "runs": runs,
            "concurrency": concurrency,
            "runs_succeeded": outcome.runs_succeeded,
            "runs_failed": outcome.runs_failed,
            "runs_deviant": outcome.runs_deviant,
            "runs_unfinished": outcome.runs_unfinished,
            "steps": steps_done,
            "elapsed_s": round(elapsed),
            "steps_per_s": round(steps_done as f64 / elapsed),
            "runs_per_s": round(outcome.runs_succeeded as f64 / elapsed),
            "inputs_per_s": round((outcome.runs_succeeded * (steps + 1)) as f64 / elapsed),
            "step_round_trip_ms": summary(&outcome.round_trips),
            "run_duration_ms": summary(&outcome.run_durations),
            "transactions": commits.len(),
            "commit_ms": summary(&commit_ms),
            "records_per_txn": summary(&outputs),
            "inputs_per_txn": summary(&inputs),
            "profile": profile,
            "processes": processes,
            "broker_jit_cores": broker_jit_cores,
        }),
        spans: stack::commit_spans(lines.get(log_before..).unwrap_or_default()),
        broker_jit_cores,
    })
}

fn verdict(value: f64, target: &str, met: bool) -> Value {
    json!({ "value": value, "target": target, "met": met })
}

/// Stops the reducer, (cold: deletes its cache,) produces a probe run and starts it again:
/// the time from spawn to the probe's first committed event, and what the restore read.
fn restart(
    bench: &Bench,
    driver: &mut Driver,
    reducer: &mut Service,
    topics: &Topics,
    data: &Path,
    cold: bool,
    executors: &mut [&mut Service],
) -> anyhow::Result<Value> {
    let name = if cold { "cold" } else { "warm" };
    reducer.stop();
    if cold {
        std::fs::remove_dir_all(data)?;
    }
    let probe = bench.encode_commands(topics, stack::GRAPH, &[format!("probe-{name}")])?;
    driver.send(&probe[0].0, &probe[0].1)?;
    driver.flush()?;
    eprintln!("sortie bench: {name} restart");
    *reducer = bench.reducer(&bench.dir, &format!("reducer-{name}"), &bench.prefix, data)?;
    let seen = driver.first_event(&probe[0].0, Duration::from_secs(300), reducer)?;
    let to_first_commit = seen.duration_since(reducer.spawned).as_secs_f64() * 1000.0;
    for executor in executors.iter_mut() {
        executor.check_alive()?;
    }
    let (partitions, records, millis) = stack::restores(&reducer.log_lines());
    Ok(json!({
        "start_to_first_commit_ms": round(to_first_commit),
        "restore": {
            "partitions": partitions,
            "records": records,
            "millis": millis,
            "states_per_s": round(records as f64 * 1000.0 / millis.max(1) as f64),
        },
    }))
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
