//! Child runs (sub-agents) on the real broker (issue 53 item 3, ADR 0028): a node with
//! `run: {graph}` starts a run of another graph on its own partition and waits for it;
//! the child's end comes back as the parent's step result, once.
//!
//! - `a_planner_runs_three_children_in_parallel_under_required_signatures`: three
//!   researchers started in parallel by a planner under `--require-signatures` (the
//!   reducer signs its own commands with `--signing-key`), each on its own partition; each
//!   calls the ledger once; the planner's summary reads their outputs. Seen red: with the
//!   reducer started without `--signing-key`, the children's starts were refused
//!   `unauthenticated` and the planner never finished.
//! - `cancelling_a_parent_cancels_its_waiting_child_and_one_whose_start_is_in_flight`:
//!   children that wait for a signal nobody sends; the parent is cancelled (once while
//!   its children wait, once right after its start, while the child's start may still
//!   be on its way): every child ends cancelled and the parent too.
//! - `a_child_that_ends_while_its_parents_reducer_dies_reports_once` (crash matrix: a
//!   child finishes while its parent's partition moves): two reducers; the one owning
//!   the parent's partition is SIGKILLed and the child's signal sent at once, so the
//!   child's end reaches a partition that is changing hands; the parent takes it once
//!   and calls the ledger once after it.
//! - `audit_why_follows_a_child_to_the_parent_step_that_started_it_and_back`: `sortie
//!   audit why` on an operation of a child run verifies its `parent` link (the id the
//!   link derives, the start issued as the parent and signed by the reducer's key, the
//!   parent's dispatch of that operation read from the parent's history) and prints the
//!   command that follows it upward; on the parent's operation, its `child` link names
//!   the child; the gateway answers the same over HTTP from its view.

use std::time::Duration;

use serde_json::{json, Value};
use sortie_core::{EventBody, RunState, RunStatus};
use sortie_tests::stack::{check_history, command, start_run, Stack};
use sortie_wire::records as w;
use sortie_wire::signing::Signer;

const LONG: Duration = Duration::from_secs(120);

/// A researcher: a keyed call to the ledger with its topic.
fn researcher(ledger: &str) -> String {
    format!(
        r#"
id: researcher
version: 1
nodes:
  - id: search
    tool: http
    side_effect: keyed
    args: {{topic: $input.topic}}
    config: {{url: "{ledger}/effects/search"}}
    timeout: 60s
"#
    )
}

/// A planner: three researchers in parallel, then a summary of their outputs.
const PLANNER: &str = r#"
id: planner
version: 1
nodes:
  - {id: plan, tool: echo, side_effect: pure, args: {about: $input.about}}
  - {id: tides, run: {graph: researcher}, args: {topic: tides}}
  - {id: winds, run: {graph: researcher}, args: {topic: winds}}
  - {id: reefs, run: {graph: researcher}, args: {topic: reefs}}
  - id: summary
    tool: echo
    side_effect: pure
    args: {tides: $steps.tides.output.search, winds: $steps.winds.output.search, reefs: $steps.reefs.output.search}
edges:
  - {from: plan, to: tides}
  - {from: plan, to: winds}
  - {from: plan, to: reefs}
  - {from: tides, to: summary}
  - {from: winds, to: summary}
  - {from: reefs, to: summary}
"#;

/// A child that waits for a signal, and a parent that starts it, then calls the ledger.
fn waiting_pair(ledger: &str) -> (String, String) {
    let child = r#"
id: waiter
version: 1
nodes:
  - id: go
    wait: {signal: go, timeout: 1h}
"#
    .to_owned();
    let parent = format!(
        r#"
id: boss
version: 1
nodes:
  - {{id: delegate, run: {{graph: waiter}}, args: {{}}}}
  - id: after
    tool: http
    side_effect: keyed
    args: {{child: $steps.delegate.output}}
    config: {{url: "{ledger}/effects/after"}}
    timeout: 60s
edges:
  - {{from: delegate, to: after}}
"#
    );
    (child, parent)
}

fn children_of<'s>(
    states: &'s std::collections::HashMap<String, RunState>,
    parent: &str,
) -> Vec<&'s RunState> {
    states
        .values()
        .filter(|s| s.parent.as_ref().is_some_and(|p| p.run_id == parent))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planner_runs_three_children_in_parallel_under_required_signatures() {
    let stack = Stack::start("children-planner", &[PLANNER]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    stack.publish(&researcher(&ledger.url)).await;
    let service = Signer::generate("svc-test").expect("key");
    let reducer_key = Signer::generate("reducer").expect("key");
    let acme = ["acme".to_owned()];
    let keyring = stack.write_keyring(&[
        service.entry(
            "svc:test",
            &acme,
            &["approver".into(), "operator".into()],
            false,
        ),
        reducer_key.entry("reducer", &acme, &[], true),
    ]);
    let key_file = stack.dir.join("reducer.key");
    std::fs::write(&key_file, reducer_key.to_file()).expect("key file");
    let _reducer = stack.reducer_with(
        "0",
        &[
            "--keyring",
            keyring.to_str().expect("path"),
            "--require-signatures",
            "--signing-key",
            key_file.to_str().expect("path"),
        ],
    );
    let _executor = stack.executor_process("executor", &["default"], &[]);
    let run = "plan-1".to_owned();
    stack
        .send_signed(
            &start_run(&run, "planner", r#"{"about": "the sea"}"#),
            &service,
        )
        .await;
    let states = stack
        .wait_for_states("the planner ends", std::slice::from_ref(&run), LONG, |s| {
            s.status.is_terminal()
        })
        .await;
    let planner = &states[&run];
    assert_eq!(planner.status, RunStatus::Succeeded, "{planner:?}");
    let children = children_of(&states, &run);
    assert_eq!(children.len(), 3);
    let partitions: std::collections::BTreeSet<i32> = children
        .iter()
        .map(|c| sortie_wire::partition_for(c.run_id.as_bytes(), stack.partitions))
        .collect();
    assert!(
        partitions.len() > 1,
        "children spread over partitions: {partitions:?}"
    );
    let events = stack.events().await;
    check_history(&run, &events[&run], planner);
    let snapshot = ledger.snapshot().await;
    for child in &children {
        assert_eq!(child.status, RunStatus::Succeeded);
        check_history(&child.run_id, &events[&child.run_id], child);
        let search = child.steps.values().next().expect("a step");
        assert_eq!(
            snapshot.effects(&search.operation_id),
            1,
            "{}",
            child.run_id
        );
        assert_eq!(snapshot.calls(&search.operation_id), 1, "{}", child.run_id);
    }
    let summary = planner
        .steps
        .values()
        .find(|s| s.node == "summary")
        .expect("summary");
    for topic in ["tides", "winds", "reefs"] {
        assert!(
            summary.args[topic]["ledger_seq"].is_number(),
            "{topic}: {}",
            summary.args
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_parent_cancels_its_waiting_child_and_one_whose_start_is_in_flight() {
    let stack = Stack::start("children-cancel", &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    let (child, parent) = waiting_pair(&ledger.url);
    stack.publish(&child).await;
    stack.publish(&parent).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor_process("executor", &["default"], &[]);

    let waiting = "boss-1".to_owned();
    stack.send(&start_run(&waiting, "boss", "{}")).await;
    sortie_tests::wait_until("its child waits for its signal", LONG, || async {
        let states = stack.states().await;
        children_of(&states, &waiting)
            .iter()
            .any(|c| c.status == RunStatus::WaitingSignal)
    })
    .await;
    let cancel = |run: &str, id: &str| {
        command(
            run,
            id,
            w::CommandBody::CancelRun(w::CancelRun {
                reason: Some("no longer needed".into()),
            }),
        )
    };
    stack.send(&cancel(&waiting, "cancel-1")).await;
    // Another parent, cancelled right after its start: the child's start is in flight.
    let hasty = "boss-2".to_owned();
    stack.send(&start_run(&hasty, "boss", "{}")).await;
    stack.send(&cancel(&hasty, "cancel-2")).await;

    let parents = [waiting.clone(), hasty.clone()];
    let states = stack
        .wait_for_states("both parents end", &parents, LONG, |s| {
            s.status.is_terminal()
        })
        .await;
    let events = stack.events().await;
    for parent in &parents {
        assert_eq!(states[parent].status, RunStatus::Cancelled, "{parent}");
        check_history(parent, &events[parent], &states[parent]);
    }
    // Every child any parent started ended cancelled, and reported once.
    let all = stack
        .wait_for_states("the children end", &parents, LONG, |_| true)
        .await;
    let children: Vec<&RunState> = parents.iter().flat_map(|p| children_of(&all, p)).collect();
    assert!(!children.is_empty(), "the waiting parent started its child");
    for child in children {
        assert_eq!(child.status, RunStatus::Cancelled, "{}", child.run_id);
        let link = child.parent.as_ref().expect("link");
        let reported = events[&link.run_id]
            .iter()
            .filter(|e| matches!(&e.body, EventBody::StepFailed { step_id, .. } if *step_id == link.step_id))
            .count();
        assert_eq!(
            reported, 1,
            "{}: its end reached the parent once",
            child.run_id
        );
    }
    assert_eq!(
        ledger.snapshot().await.total_effects(),
        0,
        "nothing ran after a cancel"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_that_ends_while_its_parents_reducer_dies_reports_once() {
    let stack = Stack::start("children-move", &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    let (child, parent) = waiting_pair(&ledger.url);
    stack.publish(&child).await;
    stack.publish(&parent).await;
    let mut first = stack.reducer("0");
    let _second = stack.reducer("1");
    let _executor = stack.executor_process("executor", &["default"], &[]);
    let runs: Vec<String> = (0..4).map(|i| format!("boss-move-{i}")).collect();
    for run in &runs {
        stack.send(&start_run(run, "boss", "{}")).await;
    }
    let states = stack
        .wait_for_states("every child waits", &runs, LONG, |s| {
            s.steps.values().any(|s| s.node == "delegate")
        })
        .await;
    let children: Vec<String> = runs
        .iter()
        .flat_map(|p| children_of(&states, p))
        .map(|c| c.run_id.clone())
        .collect();
    let children = if children.len() == runs.len() {
        children
    } else {
        let all = stack
            .wait_for_states("the children start", &runs, LONG, |_| true)
            .await;
        runs.iter()
            .flat_map(|p| children_of(&all, p))
            .map(|c| c.run_id.clone())
            .collect()
    };
    // One reducer dies; the children's signals go out at once, so their ends cross
    // partitions that are changing hands.
    first.kill();
    for (i, child) in children.iter().enumerate() {
        stack
            .send(&command(
                child,
                &format!("go-{i}"),
                w::CommandBody::SignalRun(w::SignalRun {
                    name: "go".into(),
                    signal_id: None,
                    payload: None,
                }),
            ))
            .await;
    }
    let states = stack
        .wait_for_states("every parent succeeds", &runs, LONG, |s| {
            s.status == RunStatus::Succeeded
        })
        .await;
    let events = stack.events().await;
    let snapshot = ledger.snapshot().await;
    for run in &runs {
        let state = &states[run];
        check_history(run, &events[run], state);
        let delegate = state
            .steps
            .values()
            .find(|s| s.node == "delegate")
            .expect("step");
        let settled = events[run]
            .iter()
            .filter(|e| matches!(&e.body, EventBody::StepSucceeded { step_id, .. } if *step_id == delegate.step_id))
            .count();
        assert_eq!(settled, 1, "{run}: the child's end taken once");
        let after = state
            .steps
            .values()
            .find(|s| s.node == "after")
            .expect("after");
        assert_eq!(snapshot.effects(&after.operation_id), 1, "{run}");
        assert_eq!(
            after.args["child"]["go"]["signal"],
            json!("go"),
            "{run}: {}",
            after.args
        );
    }
}

/// A parent that starts one researcher.
const SOLO: &str = r#"
id: solo
version: 1
nodes:
  - {id: delegate, run: {graph: researcher}, args: {topic: tides}}
"#;

/// `sortie audit why <operation> --json` on this stack: whether it exited 0, the chain,
/// and its stderr.
async fn audit_why(stack: &Stack, operation: &str, extra: &[&str]) -> (bool, Value, String) {
    let output = tokio::process::Command::new(sortie_tests::stack::sortie_bin())
        .args([
            "audit",
            "why",
            operation,
            "--json",
            "--bootstrap-servers",
            &stack.bootstrap,
            "--registry-url",
            &stack.registry.url,
            "--prefix",
            &stack.prefix,
        ])
        .args(extra)
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("run sortie audit why");
    (
        output.status.success(),
        serde_json::from_slice(&output.stdout).unwrap_or(Value::Null),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn why_link<'a>(chain: &'a Value, name: &str) -> &'a Value {
    chain["links"]
        .as_array()
        .and_then(|links| links.iter().find(|l| l["link"] == name))
        .unwrap_or(&Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_why_follows_a_child_to_the_parent_step_that_started_it_and_back() {
    let stack = Stack::start("children-why", &[SOLO]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    stack.publish(&researcher(&ledger.url)).await;
    let service = Signer::generate("svc-test").expect("key");
    let reducer_key = Signer::generate("reducer").expect("key");
    let acme = ["acme".to_owned()];
    let keyring = stack.write_keyring(&[
        service.entry(
            "svc:test",
            &acme,
            &["approver".into(), "operator".into()],
            false,
        ),
        reducer_key.entry("reducer", &acme, &[], true),
    ]);
    let ring = keyring.to_str().expect("path").to_owned();
    let key_file = stack.dir.join("reducer.key");
    std::fs::write(&key_file, reducer_key.to_file()).expect("key file");
    let _reducer = stack.reducer_with(
        "0",
        &[
            "--keyring",
            &ring,
            "--require-signatures",
            "--signing-key",
            key_file.to_str().expect("path"),
        ],
    );
    let _executor = stack.executor_process("executor", &["default"], &[]);
    let run = "solo-1".to_owned();
    stack
        .send_signed(&start_run(&run, "solo", "{}"), &service)
        .await;
    let states = stack
        .wait_for_states("the parent ends", std::slice::from_ref(&run), LONG, |s| {
            s.status.is_terminal()
        })
        .await;
    assert_eq!(
        states[&run].status,
        RunStatus::Succeeded,
        "{:?}",
        states[&run]
    );
    let child = children_of(&states, &run)[0].clone();
    let search = child
        .steps
        .values()
        .next()
        .expect("a step")
        .operation_id
        .clone();
    let delegate = states[&run]
        .steps
        .values()
        .next()
        .expect("a step")
        .operation_id
        .clone();

    // The child's operation: every link holds, the parent's among them.
    let (ok, chain, stderr) = audit_why(
        &stack,
        &search,
        &["--run", &child.run_id, "--keyring", &ring],
    )
    .await;
    assert!(ok, "{stderr}\n{chain:#}");
    let parent = why_link(&chain, "parent");
    assert_eq!(parent["status"], "verified", "{chain:#}");
    let facts = &parent["facts"];
    assert_eq!(facts["run_id"], json!(run));
    assert_eq!(facts["operation_id"], json!(delegate));
    assert_eq!(facts["derived_run_id"], json!(child.run_id));
    assert_eq!(facts["started_by"], "run:solo-1");
    assert_eq!(facts["start_command"]["key_id"], "reducer", "{chain:#}");
    assert!(
        facts["start_command"]["record"]["offset"].is_i64(),
        "{chain:#}"
    );
    assert_eq!(facts["dispatch"]["tool"], "$run");
    let follow = format!("sortie audit why {delegate} --run {run}");
    assert_eq!(facts["follow"], json!(follow));

    // Followed upward: the parent's operation names the child.
    let (ok, chain, stderr) =
        audit_why(&stack, &delegate, &["--run", &run, "--keyring", &ring]).await;
    assert!(ok, "{stderr}\n{chain:#}");
    let down = why_link(&chain, "child");
    assert_eq!(down["status"], "verified", "{chain:#}");
    assert_eq!(down["facts"]["runs"][0]["run_id"], json!(child.run_id));
    assert!(why_link(&chain, "parent").is_null());

    // The gateway answers the same, the parent's history read from its view.
    let (_gateway, url) = stack
        .gateway_process_with(
            &stack.dir.join("gateway"),
            &["acme:user:auditor::tok-auditor"],
            &["--keyring", &ring],
        )
        .await;
    let over_http: Value = sortie_tests::wait_for("the gateway's chain", LONG, || async {
        let answer = reqwest::Client::new()
            .get(format!(
                "{url}/v1/runs/{}/operations/{search}/why",
                child.run_id
            ))
            .bearer_auth("tok-auditor")
            .send()
            .await
            .ok()?;
        if answer.status().as_u16() != 200 {
            return None;
        }
        let chain: Value = answer.json().await.ok()?;
        (why_link(&chain, "parent")["facts"]["dispatch"] != Value::Null).then_some(chain)
    })
    .await;
    assert_eq!(over_http["verified"], true, "{over_http:#}");
    assert_eq!(why_link(&over_http, "parent")["status"], "verified");
    assert_eq!(ledger.snapshot().await.effects(&search), 1);
}
