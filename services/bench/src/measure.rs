//! The throughput measurement, blocking: calibration, the light and full loads, the
//! ceilings, the transaction shape, the pipeline, the restarts and the memory scale check,
//! and the report with each SPEC §11 target's verdict.

use serde_json::{json, Value};

use crate::phase::{phase, restart};
use crate::stack::{self, Service};
use crate::stats::{ratio, round};
use crate::{ceiling, hops, pipeline, procfs, scale, shape, Bench};

/// The measuring part, blocking.
pub(crate) fn measure(bench: &Bench, broker_pid: Option<u32>) -> anyhow::Result<Value> {
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

fn verdict(value: f64, target: &str, met: bool) -> Value {
    json!({ "value": value, "target": target, "met": met })
}
