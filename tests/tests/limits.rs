//! Nothing is stored that cannot be read back: a value at each of the payload limits
//! (`sortie_core::limits`) goes through every store Sortie keeps — the run-state
//! changelog, the run events, a cold restore of the reducer's cache from the changelog,
//! the warm cache itself, the gateway's view and a restart of it — and comes out as it
//! went in, with histories that fold and an audit that verifies.

use std::time::Duration;

use serde_json::{json, Value};
use sortie_core::limits::{MAX_DEPTH, MAX_KEY_BYTES, MAX_LABELS, MAX_MEMBERS, MAX_TEXT_BYTES};
use sortie_core::{EventBody, RunStatus};
use sortie_tests::stack::{check_history, command, Stack};
use sortie_wire::records as w;

const LONG: Duration = Duration::from_secs(120);

/// A gate whose arguments do not copy the input, so a run's state holds its input once.
const HELD: &str = r#"
id: held
version: 1
nodes:
  - id: wait
    tool: echo
    side_effect: pure
    args: {fixed: 1}
    interrupt_before: {reason: hold, required_role: approver, timeout: 24h}
edges: []
"#;

fn nested(depth: usize) -> Value {
    (0..depth).fold(json!(1), |v, _| json!({ "a": v }))
}

/// One run per limit, each at its limit: (run id, input, labels).
fn at_the_limits() -> Vec<(String, Value, std::collections::BTreeMap<String, String>)> {
    let none = std::collections::BTreeMap::new;
    let labels = (0..MAX_LABELS)
        .map(|i| (format!("label-{i}"), "v".repeat(1024)))
        .collect();
    vec![
        ("depth".into(), nested(MAX_DEPTH), none()),
        (
            "members".into(),
            json!({ "list": (0..MAX_MEMBERS).collect::<Vec<_>>() }),
            none(),
        ),
        (
            "key".into(),
            json!({ "k".repeat(MAX_KEY_BYTES): true }),
            none(),
        ),
        // A string is bounded by the record limit a run's events must fit in.
        (
            "string".into(),
            json!({ "s": "s".repeat(300 * 1024) }),
            none(),
        ),
        ("labels".into(), json!({}), labels),
    ]
}

fn start(
    run: &str,
    input: &Value,
    labels: &std::collections::BTreeMap<String, String>,
) -> w::RunCommand {
    command(
        run,
        &format!("start-{run}"),
        w::CommandBody::StartRun(w::StartRun {
            graph_id: "held".into(),
            graph_version: Some(1),
            input: input.to_string(),
            labels: labels.clone(),
            budget: None,
            fork: None,
            parent: None,
        }),
    )
}

/// Checked red: with the depth limit raised to 126 (and the fold's stored-depth check to
/// 200), the 126-deep input went through the reducer and the gateway's view could not
/// read its run back (500 `run_unreadable`). The limits are what every store can hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_at_every_limit_round_trip_through_every_store() {
    let stack = Stack::start("limits-roundtrip", &[HELD]).await;
    let _executor = stack.executor_process("executor", &["default"], &[]);
    let runs = at_the_limits();
    let ids: Vec<String> = runs.iter().map(|(id, _, _)| id.clone()).collect();
    {
        let mut first = stack.reducer("0");
        for (run, input, labels) in &runs {
            stack.send(&start(run, input, labels)).await;
        }
        stack
            .wait_for_states("every run to wait", &ids, LONG, |s| {
                s.status == RunStatus::WaitingApproval
            })
            .await;
        first.stop();
    }
    // A new instance restores its cache cold, from the changelog.
    let states = {
        let mut restored = stack.reducer("1");
        let waiting = stack.states().await;
        for run in &ids {
            let interrupt = waiting[run].open_interrupts().next().expect("open").clone();
            let mut approve =
                sortie_tests::stack::approve(run, &format!("approve-{run}"), &interrupt);
            if let w::CommandBody::ResumeRun(resume) = &mut approve.body {
                resume.comment = Some("c".repeat(MAX_TEXT_BYTES));
            }
            stack.send(&approve).await;
        }
        let states = stack
            .wait_for_states("every approved run to succeed", &ids, LONG, |s| {
                s.status == RunStatus::Succeeded
            })
            .await;
        restored.stop();
        states
    };
    // The same instance again: its cache is warm, and a command reads each run from it.
    let warm = stack.reducer("1");
    for run in &ids {
        stack
            .send(&command(
                run,
                &format!("cancel-{run}"),
                w::CommandBody::CancelRun(w::CancelRun { reason: None }),
            ))
            .await;
    }
    sortie_tests::wait_until("every run's cancel to be answered", LONG, || async {
        let events = stack.events().await;
        ids.iter().all(|run| {
            events.get(run).is_some_and(|history| {
                history.iter().any(|e| {
                    matches!(&e.body, EventBody::CommandRejected { command_id, .. }
                        if command_id == &format!("cancel-{run}"))
                })
            })
        })
    })
    .await;
    assert!(
        !warm.log_text().contains("cannot be read"),
        "the warm cache read every run back"
    );
    // The changelog as it is now (the cancels' answers are in the histories too).
    let states = {
        let before = states;
        let now = stack.states().await;
        for run in &ids {
            assert_eq!(before[run].status, RunStatus::Succeeded, "{run}");
        }
        now
    };
    let events = stack.events().await;
    for (run, input, labels) in &runs {
        let state = &states[run];
        assert_eq!(&state.input, input, "{run}: the changelog's state");
        assert_eq!(&state.labels, labels, "{run}");
        check_history(run, &events[run], state);
    }

    // The gateway's view, and the same view after a restart.
    let data = stack.dir.join("gateway");
    let tokens = &["acme:svc-test:approver,operator:tok-svc"];
    for round in 0..2 {
        let (mut gateway, url) = stack.gateway_process(&data, tokens).await;
        let client = reqwest::Client::new();
        for (run, input, _) in &runs {
            let answer = client
                .get(format!("{url}/v1/runs/{run}"))
                .bearer_auth("tok-svc")
                .send()
                .await
                .expect("GET the run");
            assert_eq!(answer.status().as_u16(), 200, "{run}, round {round}");
            let body: Value = answer.json().await.expect("JSON");
            assert_eq!(&body["input"], input, "{run}, round {round}: the view");
        }
        gateway.stop();
    }
    let (clean, audit) = stack.audit_verify().await;
    assert!(clean, "{audit}");
}
