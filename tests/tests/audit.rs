//! Issue #14's proof, "a tampered event caught by `audit replay --verify`": whoever can
//! write to the history or the state table can forge either, and the audit finds it.
//!
//! - a forged next event with a correctly chained hash (the hash function is public, so a
//!   valid chain proves nothing by itself): the history re-folds to a state the reducer
//!   never wrote;
//! - an altered copy of an event (its content changed, its old hash kept): a duplicate
//!   seq, and a hash that does not match;
//! - a forged state record (a run shown succeeded with other output): it differs from what
//!   the history folds to.
//!
//! Checked: the audit was clean before the forgeries (asserted below), so each problem is
//! a forgery's; and with the audit's re-fold comparison skipped (`audit.rs`) the chained
//! forgery and the forged state pass unseen and this test goes red.

use std::time::Duration;

use sortie_core::{EventBody, RunStatus};
use sortie_tests::stack::{start_run, succeed, Stack};
use sortie_wire::partition_for;
use sortie_wire::records as w;

const TWO_STEPS: &str = r#"
id: two
version: 1
nodes:
  - {id: fetch, tool: echo, side_effect: pure, args: {order: $input.order}}
  - {id: notify, tool: echo, side_effect: keyed, args: {from: $steps.fetch.output.step}}
edges:
  - {from: fetch, to: notify}
"#;

const LONG: Duration = Duration::from_secs(90);

fn problems_of(report: &serde_json::Value, run: &str) -> Vec<String> {
    report["reports"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["run_id"] == run)
        .flat_map(|r| r["problems"].as_array().cloned().unwrap_or_default())
        .filter_map(|p| p.as_str().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_history_and_state_are_caught_by_audit_replay_verify() {
    let stack = Stack::start("audit-tamper", &[TWO_STEPS]).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    let runs: Vec<String> = ["run-chain", "run-copy", "run-state"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for run in &runs {
        stack
            .send(&start_run(run, "two", r#"{"order": "o-1"}"#))
            .await;
    }
    stack
        .wait_for_states("the runs to finish", &runs, LONG, |s| {
            s.status == RunStatus::Succeeded
        })
        .await;
    let (clean, report) = stack.audit_verify().await;
    assert!(clean && report["diverged"] == 0, "clean before: {report}");

    let events = stack.events().await;
    let produce_event = |event: sortie_core::Event| {
        let stack = &stack;
        async move {
            let value = stack
                .codec
                .encode(
                    &stack.topics.run_events(),
                    &sortie_model::event_to_wire(&event),
                )
                .await
                .expect("encode event");
            stack
                .send_raw(
                    &stack.topics.run_events(),
                    Some(partition_for(event.run_id.as_bytes(), stack.partitions)),
                    event.run_id.as_bytes(),
                    &value,
                )
                .await;
        }
    };

    // 1. A forged next event, chained properly: "the run was cancelled by mallory".
    let history: Vec<&sortie_core::Event> =
        events["run-chain"].iter().filter(|e| e.seq > 0).collect();
    let last = *history.last().expect("events");
    let mut forged = last.clone();
    forged.seq = last.seq + 1;
    forged.state_version = last.state_version + 1;
    forged.prev_hash = last.hash.clone();
    forged.command_id = None;
    forged.operation_id = None;
    forged.body = EventBody::CancelRequested {
        requested_by: "user:mallory".into(),
        reason: Some("forged".into()),
    };
    forged.hash = Some(forged.compute_hash());
    produce_event(forged).await;

    // 2. An altered copy of an event, its old hash kept.
    let first = events["run-copy"]
        .iter()
        .find(|e| e.seq == 1)
        .expect("seq 1")
        .clone();
    let mut altered = first;
    if let EventBody::RunStarted { started_by, .. } = &mut altered.body {
        *started_by = "user:mallory".into();
    }
    produce_event(altered).await;

    // 3. A forged state record: the run shown with another output.
    let mut state = stack.states().await["run-state"].clone();
    if let Some(step) = state.steps.values_mut().next() {
        step.output = Some(serde_json::json!({"refund": 1_000_000}));
    }
    let record: w::RunState = sortie_model::state_to_wire(&state);
    let value = stack
        .codec
        .encode(&stack.topics.run_state(), &record)
        .await
        .expect("encode state");
    stack
        .send_raw(
            &stack.topics.run_state(),
            Some(partition_for(b"run-state", stack.partitions)),
            b"run-state",
            &value,
        )
        .await;

    let (clean, report) = stack.audit_verify().await;
    assert!(!clean, "a forged history exits non-zero: {report}");
    assert_eq!(report["diverged"], 3, "{report}");
    let chain = problems_of(&report, "run-chain");
    assert!(
        chain.iter().any(|p| p.contains("re-folded state differs")),
        "{chain:?}"
    );
    let copy = problems_of(&report, "run-copy");
    assert!(
        copy.iter().any(|p| p.contains("gap or a duplicate")),
        "{copy:?}"
    );
    let forged_state = problems_of(&report, "run-state");
    assert!(
        forged_state
            .iter()
            .any(|p| p.contains("re-folded state differs") && p.contains("steps")),
        "{forged_state:?}"
    );
}
