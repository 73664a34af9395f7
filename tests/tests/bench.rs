//! `sortie bench --quick` runs end to end against the test broker and prints one JSON
//! document with every figure. A smoke test only: benchmarks are programs, so nothing here
//! asserts on a duration or a rate.

use std::process::Command;

use serde_json::Value;
use sortie_tests::stack::sortie_bin;

/// The figures the README's Performance section and SPEC §11 rely on.
const NUMBERS: &[&str] = &[
    "/sortie/steps_per_s",
    "/sortie/runs_per_s",
    "/sortie/step_round_trip_ms/p50",
    "/sortie/step_round_trip_ms/p90",
    "/sortie/step_round_trip_ms/p99",
    "/sortie/commit_ms/p50",
    "/sortie/commit_ms/p99",
    "/sortie/records_per_txn/mean",
    "/sortie_light_load/step_round_trip_ms/p50",
    "/sortie_light_load/steps_per_s",
    "/sortie_light_one_step/run_duration_ms/p50",
    "/sortie_light_one_step/step_round_trip_ms/p50",
    "/sortie/processes/reducer/cpu_cores",
    "/sortie/processes/reducer/rss_mib",
    "/ceiling/records_per_s",
    "/ceiling/commit_ms/p50",
    "/ratios/steps_per_s_to_ceiling_records_per_s",
    "/pipeline/light/step_round_trip_ms/p50",
    "/pipeline/light/run_duration_ms/p50",
    "/pipeline/full/steps_per_s",
    "/ratios/sortie_to_pipeline/steps_per_s",
    "/ratios/sortie_to_pipeline/light_step_p50",
    "/ratios/sortie_to_pipeline/light_run_p50",
    "/cpu_us/sortie_per_step/reducer",
    "/cpu_us/sortie_per_step/all",
    "/cpu_us/ceiling_per_input/ceiling_loop",
    "/cpu_us/allowed_per_step_at_ratio_0_5",
    "/warm_restart/start_to_first_commit_ms",
    "/cold_restore/start_to_first_commit_ms",
    "/cold_restore/restore/states_per_s",
    "/targets/steps_per_s_vs_ceiling/value",
    "/targets/round_trip_p50_vs_commit_interval/value",
    "/targets/warm_restart_ms/value",
    "/targets/cold_restore_states_per_s/value",
];

#[test]
fn bench_quick_runs_and_prints_its_figures_as_json() {
    let bootstrap = sortie_tests::bootstrap_blocking();
    let prefix = sortie_tests::unique_prefix("bench");
    let dir = sortie_tests::workspace_root()
        .join("target")
        .join("test-runs")
        .join(prefix.trim_end_matches('.'));
    let output = Command::new(sortie_bin())
        .args([
            "bench",
            "--quick",
            "--bootstrap",
            &bootstrap,
            "--prefix",
            &prefix,
        ])
        .arg("--data-dir")
        .arg(&dir)
        .env("RUST_LOG", "warn")
        .output()
        .expect("sortie bench runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "sortie bench --quick failed ({}):\n{stderr}",
        output.status
    );
    let report: Value = serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not one JSON document ({e}):\n{}\nstderr:\n{stderr}",
            String::from_utf8_lossy(&output.stdout)
        )
    });
    for pointer in NUMBERS {
        assert!(
            report.pointer(pointer).is_some_and(Value::is_number),
            "{pointer} is not a number in:\n{report:#}"
        );
    }
    for target in [
        "steps_per_s_vs_ceiling",
        "steps_per_s_vs_pipeline",
        "light_step_p50_vs_pipeline",
        "warm_restart_ms",
    ] {
        assert!(
            report["targets"][target]["met"].is_boolean(),
            "targets.{target}.met is not a boolean"
        );
    }
    let accounted = ["runs_succeeded", "runs_failed", "runs_unfinished"]
        .iter()
        .map(|key| report["sortie"][key].as_u64().unwrap_or(0))
        .sum::<u64>();
    assert_eq!(accounted, 20, "every run of --quick is accounted for");
    // The one-step runs are timed against their own pattern: with the load's (seen
    // red), every one is left unfinished.
    let one_step = &report["sortie_light_one_step"];
    assert_eq!(
        (
            one_step["runs_succeeded"].as_u64(),
            one_step["steps"].as_u64()
        ),
        (Some(5), Some(5)),
        "five one-step runs of --quick, each timed: {one_step:#}"
    );
    assert_eq!(one_step["runs_deviant"].as_u64(), Some(0), "{one_step:#}");
}

/// `sortie bench --quick --roll`: two reducers and two executors restarted in turn under
/// the light load; the report has both p99s, every restart, and no failed run (a run lost
/// in the roll shows up as failed, deviant or unfinished and turns this red).
#[test]
fn bench_roll_restarts_every_instance_and_fails_no_run() {
    let bootstrap = sortie_tests::bootstrap_blocking();
    let prefix = sortie_tests::unique_prefix("bench-roll");
    let dir = sortie_tests::workspace_root()
        .join("target")
        .join("test-runs")
        .join(prefix.trim_end_matches('.'));
    let output = Command::new(sortie_bin())
        .args([
            "bench",
            "--quick",
            "--roll",
            "--bootstrap",
            &bootstrap,
            "--prefix",
            &prefix,
        ])
        .arg("--data-dir")
        .arg(&dir)
        .env("RUST_LOG", "warn")
        .output()
        .expect("sortie bench runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "sortie bench --quick --roll failed ({}):\n{stderr}",
        output.status
    );
    let report: Value = serde_json::from_slice(&output.stdout).expect("one JSON document");
    let roll = &report["roll"];
    for pointer in [
        "/step_round_trip_p99_ms/steady",
        "/step_round_trip_p99_ms/whole_roll_load",
        "/rolling_window_s",
    ] {
        assert!(
            roll.pointer(pointer).is_some_and(Value::is_number),
            "roll{pointer} is not a number in:\n{roll:#}"
        );
    }
    let restarts = roll["restarts"].as_array().expect("restarts");
    assert_eq!(restarts.len(), 4, "every instance restarts once: {roll:#}");
    assert_eq!(roll["runs_failed_during_roll"], 0, "{roll:#}");
}
