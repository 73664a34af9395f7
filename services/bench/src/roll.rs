//! `sortie bench --roll`: the step round trip while every service instance is restarted
//! one at a time — SIGTERM, start again on its data, wait until it is ready, next — as a
//! Kubernetes rolling update does, next to the same light load without a roll.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::load::Outcome;
use crate::stack::Service;
use crate::stats::{round, summary};
use crate::Bench;

/// Instances of each kind in the roll.
const REDUCERS: usize = 2;
const EXECUTORS: usize = 2;
/// How long a restarted instance may take to be ready.
const READY_WITHIN: Duration = Duration::from_secs(120);

/// What a restarted instance logs once it is ready.
fn ready_line(kind: &str) -> &'static str {
    match kind {
        "reducer" => "Assignment restored",
        _ => "Partitions assigned.",
    }
}

struct Instance {
    kind: &'static str,
    index: usize,
    service: Service,
}

pub(crate) fn measure(bench: &Bench) -> anyhow::Result<Value> {
    let options = &bench.options;
    let topics = bench.prepare()?;
    let spawn = |kind: &'static str, index: usize, generation: usize| -> anyhow::Result<Service> {
        let name = format!("{kind}-{index}-g{generation}");
        match kind {
            "reducer" => bench.reducer_with(
                &bench.dir,
                &name,
                &bench.prefix,
                &bench.dir.join(format!("reducer-{index}")),
                &index.to_string(),
                &[],
            ),
            _ => bench.executor(&bench.dir, &name, &bench.prefix, index),
        }
    };
    let mut instances = Vec::new();
    for index in 0..REDUCERS {
        instances.push(Instance {
            kind: "reducer",
            index,
            service: spawn("reducer", index, 0)?,
        });
    }
    for index in 0..EXECUTORS {
        instances.push(Instance {
            kind: "executor",
            index,
            service: spawn("executor", index, 0)?,
        });
    }
    let mut driver = bench.driver(&topics)?;
    eprintln!("sortie bench: roll: calibration run");
    {
        let mut all: Vec<&mut Service> = instances.iter_mut().map(|i| &mut i.service).collect();
        bench.calibrate(
            &mut driver,
            &topics,
            crate::stack::GRAPH,
            "calibration",
            &mut all,
        )?;
    }

    // A warm-up load (discarded): the group settles — the second member's join, the
    // first cooperative moves — before anything is measured. Then steady: the same load
    // with every instance up.
    let mut light = |name: &str| -> anyhow::Result<Outcome> {
        let ids: Vec<String> = (0..options.light_runs)
            .map(|i| format!("{name}-{i:07}"))
            .collect();
        let commands = bench.encode_commands(&topics, crate::stack::GRAPH, &ids)?;
        eprintln!("sortie bench: roll: {name} light load");
        let mut all: Vec<&mut Service> = instances.iter_mut().map(|i| &mut i.service).collect();
        driver.run(
            &commands,
            options.light_concurrency,
            options.timeout,
            &mut all,
        )
    };
    light("warmup")?;
    let steady = light("steady")?;

    // The same load, long enough to span the roll, while another thread rolls.
    let roll_ids: Vec<String> = (0..options.light_runs * 6)
        .map(|i| format!("roll-{i:07}"))
        .collect();
    let roll_commands = bench.encode_commands(&topics, crate::stack::GRAPH, &roll_ids)?;
    eprintln!("sortie bench: roll: light load while every instance restarts in turn");
    let load_started = Instant::now();
    let (during, restarts, load_ended) = std::thread::scope(|scope| {
        let roller = scope.spawn(|| -> anyhow::Result<Vec<Value>> {
            std::thread::sleep(Duration::from_secs(2)); // runs in flight first
            let mut restarts = Vec::new();
            let window_start = sortie_kafka::clock::now_ms();
            for instance in instances.iter_mut() {
                let began = Instant::now();
                instance.service.stop();
                let stopped_ms = began.elapsed().as_secs_f64() * 1000.0;
                instance.service = spawn(instance.kind, instance.index, 1)?;
                let deadline = Instant::now() + READY_WITHIN;
                while !instance
                    .service
                    .log_lines()
                    .iter()
                    .any(|l| l.contains(ready_line(instance.kind)))
                {
                    instance.service.check_alive()?;
                    anyhow::ensure!(
                        Instant::now() < deadline,
                        "{} {} was not ready within {READY_WITHIN:?}",
                        instance.kind,
                        instance.index
                    );
                    std::thread::sleep(Duration::from_millis(50));
                }
                let ready_ms = began.elapsed().as_secs_f64() * 1000.0;
                eprintln!(
                    "sortie bench: roll: {} {} back in {:.0} ms",
                    instance.kind, instance.index, ready_ms
                );
                restarts.push(json!({
                    "ready_at_ms": sortie_kafka::clock::now_ms(),
                    "window_start_ms": window_start,
                    "instance": format!("{}-{}", instance.kind, instance.index),
                    "stop_ms": round(stopped_ms),
                    "stop_to_ready_ms": round(ready_ms),
                    "at_s": round(load_started.elapsed().as_secs_f64()),
                }));
            }
            Ok(restarts)
        });
        let during = driver.run(
            &roll_commands,
            options.light_concurrency,
            options.timeout,
            &mut [],
        );
        let load_ended = load_started.elapsed();
        let restarts = roller
            .join()
            .map_err(|_| anyhow::anyhow!("the roll thread panicked"))
            .and_then(|r| r);
        (during, restarts, load_ended)
    });
    let (during, restarts) = (during?, restarts?);
    let roll_end_s = restarts
        .last()
        .and_then(|r| r["at_s"].as_f64())
        .unwrap_or(0.0);
    let p99 = |o: &Outcome| summary(&o.round_trips)["p99"].clone();
    // The round trips that ended while an instance was down or starting: from the first
    // stop to the last instance ready.
    let window = (
        restarts
            .first()
            .and_then(|r| r["window_start_ms"].as_i64())
            .unwrap_or(0),
        restarts
            .last()
            .and_then(|r| r["ready_at_ms"].as_i64())
            .unwrap_or(0),
    );
    let in_window: Vec<f64> = during
        .round_trips
        .iter()
        .zip(&during.round_trip_ends)
        .filter(|(_, end)| (window.0..=window.1).contains(*end))
        .map(|(ms, _)| *ms)
        .collect();
    Ok(json!({
        "roll": {
            "instances": {"reducers": REDUCERS, "executors": EXECUTORS},
            "steady": phase_json(&steady, options.light_concurrency),
            "during_roll": phase_json(&during, options.light_concurrency),
            "restarts": restarts,
            "load_outlasted_roll": load_ended.as_secs_f64() >= roll_end_s,
            "step_round_trip_p99_ms": {
                "steady": p99(&steady),
                "while_rolling": summary(&in_window)["p99"].clone(),
                "whole_roll_load": p99(&during),
            },
            "step_round_trip_while_rolling_ms": summary(&in_window),
            "rolling_window_s": round((window.1 - window.0) as f64 / 1000.0),
            "runs_failed_during_roll": during.runs_failed + during.runs_deviant + during.runs_unfinished,
        }
    }))
}

fn phase_json(outcome: &Outcome, concurrency: usize) -> Value {
    json!({
        "concurrency": concurrency,
        "runs_succeeded": outcome.runs_succeeded,
        "runs_failed": outcome.runs_failed,
        "runs_deviant": outcome.runs_deviant,
        "runs_unfinished": outcome.runs_unfinished,
        "elapsed_s": round(outcome.elapsed.as_secs_f64()),
        "step_round_trip_ms": summary(&outcome.round_trips),
        "run_duration_ms": summary(&outcome.run_durations),
    })
}
