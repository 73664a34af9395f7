//! `--rss-scale`: the reducer's memory and restore rate as the number of runs grows.
//!
//! For each size N, synthetic run states (a finished run of the bench graph, folded by
//! `sortie-core` in this process, given N distinct run ids, payloads and operation ids)
//! are written straight to a fresh `run-state` changelog; then a reducer with an empty
//! cache restores them (cold), runs a small live load, and restarts warm. Its RSS is
//! sampled after each step.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use rdkafka::error::KafkaError;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use serde_json::{json, Value};
use sortie_core::{
    apply, Command, CommandBody, Effect, Graph, Graphs, Input, RunState, StepOutcome, StepReport,
};
use sortie_wire::{partition_for, RecordKind, Topics};

use crate::load::Driver;
use crate::procfs::rss_mib;
use crate::stack::{self, Service};
use crate::stats::round;
use crate::Bench;

/// A finished run of `graph`, folded in-process: the state every synthetic run gets.
pub fn finished_run(graph: &Graph, payload_bytes: usize) -> anyhow::Result<RunState> {
    let mut graphs = Graphs::new();
    graphs
        .insert(graph.clone())
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let now = crate::now_ms();
    let start = Input::Command(Command {
        command_id: "start-template".into(),
        tenant: "bench".into(),
        run_id: "template".into(),
        principal: "svc:bench".into(),
        roles: vec![],
        groups: vec![],
        at: now,
        body: CommandBody::StartRun {
            graph_id: graph.id.clone(),
            graph_version: Some(graph.version),
            input: json!({ "payload": crate::payload_text(payload_bytes, "template") }),
            labels: BTreeMap::new(),
            budget: None,
            fork: None,
            parent: None,
        },
    });
    let mut applied = apply(None, &start, &graphs);
    for at in 1..=graph.nodes.len() as i64 + 1 {
        let Some(state) = applied.state.clone() else {
            bail!("the template run did not start: {:?}", applied.ignored);
        };
        let Some(intent) = applied.effects.iter().find_map(|e| match e {
            Effect::Dispatch(intent) => Some(intent.clone()),
            _ => None,
        }) else {
            return Ok(state);
        };
        let report = Input::StepReport(StepReport {
            spent: None,
            operation_id: intent.operation_id.clone(),
            attempt: intent.attempt,
            tenant: intent.tenant.clone(),
            run_id: intent.run_id.clone(),
            step_id: intent.step_id.clone(),
            outcome: StepOutcome::Succeeded {
                output: intent.args.clone(),
            },
            at: now + at,
        });
        applied = apply(Some(&state), &report, &graphs);
    }
    applied.state.context("the template run has no state")
}

/// `template` as run `run_id`'s own: its payload (letters and digits seeded by the run id)
/// and its operation ids (derived from the run id) are the run's, as they would be for a
/// run folded from its own inputs. Copies that differed in their run id only compressed
/// across records as no real changelog does: the broker's batches held 1M states (1.08 GB)
/// in 14 MB, which flattered the cold restore's fetches.
struct Distinct {
    payload: String,
    operation_ids: Vec<String>,
    payload_bytes: usize,
}

impl Distinct {
    fn of(template: &RunState, payload_bytes: usize) -> Distinct {
        Distinct {
            payload: crate::payload_text(payload_bytes, "template"),
            operation_ids: template
                .steps
                .values()
                .map(|step| step.operation_id.clone())
                .filter(|id| !id.is_empty())
                .collect(),
            payload_bytes,
        }
    }

    /// The state's JSON for `run_id` (the template's serialised with that run id).
    fn apply(&self, run_id: &str, json: String) -> String {
        let mut json = json.replace(
            &self.payload,
            &crate::payload_text(self.payload_bytes, run_id),
        );
        for (i, id) in self.operation_ids.iter().enumerate() {
            let own = crate::payload_text(id.len(), &format!("{run_id}/{i}"));
            json = json.replace(id.as_str(), &own);
        }
        json
    }
}

/// Writes `count` runs of `template` (as `syn-<i>`, each with its own payload and
/// operation ids: [`Distinct`]) to the run-state changelog. Returns the bytes of one
/// record. Blocking.
fn write_states(
    bench: &Bench,
    topics: &Topics,
    template: &RunState,
    count: usize,
) -> anyhow::Result<usize> {
    let schema_id = bench.runtime.block_on(bench.codec.prepare(
        &topics.run_state(),
        RecordKind::RunState,
        Duration::from_secs(30),
    ))?;
    let mut config = bench.kafka.producer();
    config
        .set("enable.idempotence", "true")
        .set("linger.ms", "50")
        .set("batch.size", "1000000")
        .set("compression.type", sortie_kafka::COMPRESSION[0].1)
        .set("queue.buffering.max.messages", "200000");
    let producer: BaseProducer = config.create()?;
    let topic = topics.run_state();
    let partitions = bench.options.partitions;
    let mut state = template.clone();
    let distinct = Distinct::of(template, bench.options.scale_payload_bytes);
    let mut record_bytes = 0;
    for i in 0..count {
        let run_id = format!("syn-{i:08}");
        state.run_id.clone_from(&run_id);
        let mut wire = sortie_model::state_to_wire(&state);
        wire.state = distinct.apply(&run_id, wire.state);
        let datum = sortie_wire::to_datum(&wire)?;
        let mut value = Vec::with_capacity(5 + datum.len());
        value.push(0);
        value.extend_from_slice(&schema_id.to_be_bytes());
        value.extend_from_slice(&datum);
        record_bytes = value.len();
        let partition = partition_for(run_id.as_bytes(), partitions);
        loop {
            let record = BaseRecord::to(&topic)
                .key(&run_id)
                .payload(&value)
                .partition(partition);
            match producer.send(record) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    producer.poll(Duration::from_millis(5));
                }
                Err((e, _)) => bail!("writing synthetic states: {e}"),
            }
        }
    }
    producer.flush(Duration::from_secs(300))?;
    Ok(record_bytes)
}

/// A reducer as a static group member (`group.instance.id`), as the Helm chart runs it: a
/// restart within the session timeout keeps its partitions.
const STATIC: &[&str] = &["--static-membership"];

/// How long after the cold restore's first commit its memory is measured again.
const SETTLE: Duration = Duration::from_secs(2);

fn rss(service: &Service) -> Value {
    match rss_mib(service.pid()) {
        Some((rss, peak)) => json!({ "rss_mib": round(rss), "rss_peak_mib": round(peak) }),
        None => json!({ "rss_mib": null, "rss_peak_mib": null }),
    }
}

fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|entry| match entry.metadata() {
            Ok(meta) if meta.is_dir() => dir_bytes(&entry.path()),
            Ok(meta) => meta.len(),
            Err(_) => 0,
        })
        .sum()
}

/// One size of the scale check. Blocking.
pub fn one(bench: &Bench, runs: usize) -> anyhow::Result<Value> {
    let options = &bench.options;
    let prefix = format!("{}s{runs}.", bench.prefix);
    let topics = Topics::new(prefix.clone());
    let queues = stack::queues(options.queues);
    let graph = stack::graph(stack::GRAPH, options.scale_steps, &queues)?;
    bench.runtime.block_on(async {
        stack::apply_topology(
            &bench.kafka,
            &prefix,
            options.partitions,
            options.intent_partitions,
            &queues,
        )
        .await?;
        stack::publish_graph(&bench.kafka, &bench.codec, &topics, &graph).await
    })?;
    let template = finished_run(&graph, options.scale_payload_bytes)?;
    eprintln!("sortie bench: scale {runs}: writing {runs} run states to the changelog");
    let written = Instant::now();
    let record_bytes = write_states(bench, &topics, &template, runs)?;
    let write_s = written.elapsed().as_secs_f64();

    let dir = bench.dir.join(format!("scale-{runs}"));
    std::fs::create_dir_all(&dir)?;
    let data = dir.join("reducer");
    let mut driver = bench.driver(&topics)?;
    let probe = |name: &str| -> anyhow::Result<(String, Vec<u8>)> {
        let run_id = format!("probe-{name}");
        let bytes = bench.runtime.block_on(Driver::start_command(
            &bench.codec,
            &topics,
            &run_id,
            stack::GRAPH,
            options.payload_bytes,
        ))?;
        Ok((run_id, bytes))
    };
    // A probe run started now: the first event of it is the restarted reducer's first
    // commit.
    let send_probe = |driver: &mut Driver, name: &str| -> anyhow::Result<String> {
        let (run_id, bytes) = probe(name)?;
        driver.send(&run_id, &bytes)?;
        driver.flush()?;
        Ok(run_id)
    };

    // Cold: an empty cache restores every state.
    let probe_id = send_probe(&mut driver, "cold")?;
    eprintln!("sortie bench: scale {runs}: cold restore");
    let mut reducer = bench.reducer(&dir, "reducer-cold", &prefix, &data)?;
    let seen = driver.first_event(&probe_id, Duration::from_secs(1800), &mut reducer)?;
    let cold_ms = seen.duration_since(reducer.spawned).as_secs_f64() * 1000.0;
    let (partitions, records, millis) = wait_restored(&reducer, options.partitions)?;
    let mut after_restore = rss(&reducer);
    // What the restore freed reaches the OS a moment later: the pages sled held before
    // the store was reopened went within ~0.6 s of the first commit at 1M runs (RSS
    // sampled every 100 ms: 362 MiB at the first commit, 146 from 0.6 s on).
    std::thread::sleep(SETTLE);
    after_restore["rss_settled_mib"] = rss(&reducer)["rss_mib"].clone();

    // A small live load on top of them.
    let mut executor = bench.executor(&dir, "executor", &prefix, 0)?;
    let (warmup, bytes) = probe("calibration")?;
    driver.calibrate(
        &warmup,
        &bytes,
        Duration::from_secs(300),
        &mut [&mut reducer, &mut executor],
    )?;
    let load_runs = options.scale_load_runs;
    let mut commands = Vec::with_capacity(load_runs);
    for i in 0..load_runs {
        let run_id = format!("live-{i:06}");
        let bytes = bench.runtime.block_on(Driver::start_command(
            &bench.codec,
            &topics,
            &run_id,
            stack::GRAPH,
            options.payload_bytes,
        ))?;
        commands.push((run_id, bytes));
    }
    let outcome = driver.run(
        &commands,
        options.concurrency.min(100),
        options.timeout,
        &mut [&mut reducer, &mut executor],
    )?;
    let after_load = rss(&reducer);

    // Warm: the same cache, restarted.
    reducer.stop();
    let probe_id = send_probe(&mut driver, "warm")?;
    eprintln!("sortie bench: scale {runs}: warm restart");
    let mut reducer = bench.reducer(&dir, "reducer-warm", &prefix, &data)?;
    let seen = driver.first_event(&probe_id, Duration::from_secs(600), &mut reducer)?;
    let warm_ms = seen.duration_since(reducer.spawned).as_secs_f64() * 1000.0;
    let (_, warm_records, warm_millis) = wait_restored(&reducer, options.partitions)?;
    let after_warm = rss(&reducer);
    reducer.stop();

    // A crash: the same cache, a reducer SIGKILLed right after its first commit (no clean
    // stop stores the gauges' tallies: the restart starts from those its commits stored,
    // or counts by scan). Both are static members, as the Helm chart runs them; a dynamic
    // member's restart waits out the session timeout (10 s) for the dead member first.
    let probe_id = send_probe(&mut driver, "before-crash")?;
    let mut reducer = bench.reducer_with(&dir, "reducer-to-crash", &prefix, &data, "0", STATIC)?;
    driver.first_event(&probe_id, Duration::from_secs(600), &mut reducer)?;
    reducer.kill();
    let probe_id = send_probe(&mut driver, "crash")?;
    eprintln!("sortie bench: scale {runs}: restart after a crash");
    let mut reducer = bench.reducer_with(&dir, "reducer-crashed", &prefix, &data, "0", STATIC)?;
    let seen = driver.first_event(&probe_id, Duration::from_secs(600), &mut reducer)?;
    let crash_ms = seen.duration_since(reducer.spawned).as_secs_f64() * 1000.0;
    let (_, crash_records, crash_millis) = wait_restored(&reducer, options.partitions)?;
    let crash_gauges = gauges_started(&reducer.log_lines());
    let after_crash = rss(&reducer);
    reducer.stop();
    executor.stop();
    let sled_bytes = dir_bytes(&data);
    let _ = std::fs::remove_dir_all(&data);
    if !options.keep_topics {
        bench
            .runtime
            .block_on(stack::delete_topics(&bench.kafka, &prefix))?;
    }
    Ok(json!({
        "runs": runs,
        "state_record_bytes": record_bytes,
        "write_changelog_s": round(write_s),
        "cold_start_to_first_commit_ms": round(cold_ms),
        "cold_restore": {
            "partitions": partitions,
            "records": records,
            "millis": millis,
            "states_per_s": round(records as f64 * 1000.0 / (millis.max(1)) as f64),
        },
        "reducer_after_cold_restore": after_restore,
        "live_load": {
            "runs": outcome.runs_succeeded,
            "steps_per_s": round(
                (outcome.runs_succeeded * options.scale_steps) as f64
                    / outcome.elapsed.as_secs_f64().max(1e-9)
            ),
        },
        "reducer_after_live_load": after_load,
        "warm_start_to_first_commit_ms": round(warm_ms),
        "warm_restore": { "records": warm_records, "millis": warm_millis },
        "reducer_after_warm_restart": after_warm,
        "crash_start_to_first_commit_ms": round(crash_ms),
        "crash_restore": {
            "records": crash_records,
            "millis": crash_millis,
            "gauges": crash_gauges,
        },
        "reducer_after_crash_restart": after_crash,
        "sled_bytes_on_disk": sled_bytes,
    }))
}

/// How many partitions started their gauges each way (`gauges=` of the reducer's
/// "Partition restored" lines: "snapshot", "restore", "scan", "stopped").
fn gauges_started(lines: &[String]) -> Value {
    let mut started = serde_json::Map::new();
    for line in lines {
        if line.contains("Partition restored from the changelog.") {
            let how = stack::field(line, "gauges")
                .unwrap_or("?")
                .trim_matches('"');
            let n = started.entry(how).or_insert(json!(0));
            *n = json!(n.as_u64().unwrap_or(0) + 1);
        }
    }
    Value::Object(started)
}

/// Waits until the reducer's log shows every partition restored.
fn wait_restored(reducer: &Service, partitions: u32) -> anyhow::Result<(usize, u64, u64)> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let restored = stack::restores(&reducer.log_lines());
        if restored.0 >= partitions as usize || Instant::now() > deadline {
            return Ok(restored);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each synthetic run is its own: a valid state of that run, with the template's
    /// shape, and nothing of the template's payload or operation ids left.
    #[test]
    fn synthetic_runs_have_their_own_payloads_and_operation_ids() {
        let graph = stack::graph(stack::GRAPH, 2, &stack::queues(1)).expect("graph");
        let template = finished_run(&graph, 64).expect("template");
        let distinct = Distinct::of(&template, 64);
        assert_eq!(distinct.operation_ids.len(), 2);
        let run = |run_id: &str| -> (String, RunState) {
            let mut state = template.clone();
            state.run_id = run_id.to_owned();
            let json = distinct.apply(run_id, sortie_model::state_to_wire(&state).state);
            let parsed: RunState = serde_json::from_str(&json).expect("a state");
            (json, parsed)
        };
        let (a, state_a) = run("syn-00000001");
        let (b, _) = run("syn-00000002");
        assert_eq!(state_a.run_id, "syn-00000001");
        assert_eq!(state_a.steps.len(), template.steps.len());
        assert!(a.contains(&crate::payload_text(64, "syn-00000001")));
        assert!(!a.contains(&distinct.payload) && !b.contains(&distinct.payload));
        for id in &distinct.operation_ids {
            assert!(!a.contains(id.as_str()), "{id} left in {a}");
        }
        let ops = |state: &RunState| -> Vec<String> {
            state
                .steps
                .values()
                .map(|s| s.operation_id.clone())
                .collect()
        };
        assert_ne!(ops(&state_a), ops(&run("syn-00000002").1));
        assert_eq!(a.len(), b.len());
    }
}
