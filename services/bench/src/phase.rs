//! One measured load phase (throughput, round trips, the reducer's transactions, CPU and
//! memory) and one measured restart of the reducer, warm or cold.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use sortie_wire::Topics;

use crate::load::Driver;
use crate::stack::{self, Service};
use crate::stats::{round, summary};
use crate::{procfs, Bench};

/// What one load phase measured.
pub(crate) struct Phase {
    pub(crate) json: Value,
    /// The primary reducer's transactions of the phase: (began, committed), µs since the
    /// epoch.
    pub(crate) spans: Vec<(i64, i64)>,
    /// CPU the broker's JIT compiler threads used during the phase, in cores (`None`:
    /// not our broker, or not a JVM we can see).
    pub(crate) broker_jit_cores: Option<f64>,
}

/// Drives `runs` runs (`<name>-<i>`) with `concurrency` in flight and reports the figures:
/// throughput, round trips, the reducer's transactions during the phase, CPU and memory.
#[allow(clippy::too_many_arguments)]
pub(crate) fn phase(
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

/// Stops the reducer, (cold: deletes its cache,) produces a probe run and starts it again:
/// the time from spawn to the probe's first committed event, and what the restore read.
pub(crate) fn restart(
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
