//! Fork from a checkpoint (time travel) through the gateway against the real broker
//! (issue #15 item 5): a finished run is forked at the version where its keyed refund had
//! succeeded, with a patched input; the fork keeps the refund's recorded output and
//! operation id (no second refund intent anywhere), runs the later steps anew, and records
//! its lineage. The CLI's `sortie run fork` does the same. Then `sortie replay shadow`
//! re-decides the three runs the same, and names the first differing decision against a
//! changed graph version.

use std::time::Duration;

use serde_json::{json, Value};
use sortie_core::EventBody;
use sortie_tests::stack::{fork_id, sortie_bin, succeed, Stack};

const REFUND: &str = r#"
id: refund-fork
version: 1
nodes:
  - {id: read, tool: echo, side_effect: pure, args: {order: $input.order}}
  - {id: refund, tool: echo, side_effect: keyed, args: {order: $steps.read.output.echo.order}}
  - {id: notify, tool: echo, side_effect: idempotent, args: {order: $input.order, channel: $input.channel}}
edges:
  - {from: read, to: refund}
  - {from: refund, to: notify}
"#;

const ALICE: &str = "acme:user:alice:approver:tok-alice";
const LONG: Duration = Duration::from_secs(90);

async fn call(method: reqwest::Method, url: &str, body: Option<Value>) -> (u16, Value) {
    let mut request = reqwest::Client::new()
        .request(method, url)
        .bearer_auth("tok-alice");
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("the gateway answers");
    let status = response.status().as_u16();
    let body = response.json().await.unwrap_or(Value::Null);
    (status, body)
}

async fn wait_succeeded(url: &str, run_id: &str) -> Value {
    sortie_tests::wait_for(&format!("{run_id} to succeed"), LONG, || async {
        let (status, run) = call(
            reqwest::Method::GET,
            &format!("{url}/v1/runs/{run_id}"),
            None,
        )
        .await;
        (status == 200 && run["status"] == "succeeded").then_some(run)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_keeps_completed_side_effects_and_records_its_lineage() {
    let stack = Stack::start("fork", &[REFUND]).await;
    let _reducer = stack.reducer("0");
    let executor = stack.executor("default", succeed);
    let (_gateway, url) = stack
        .gateway_process(&stack.dir.join("gateway"), &[ALICE])
        .await;

    let (status, body) = call(
        reqwest::Method::POST,
        &format!("{url}/v1/runs"),
        Some(json!({"graph_id": "refund-fork", "run_id": "src-1", "input": {"order": "o-1", "channel": "mail"}})),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    wait_succeeded(&url, "src-1").await;

    // The version at which the refund had succeeded (notify not yet dispatched).
    let (_, page) = call(
        reqwest::Method::GET,
        &format!("{url}/v1/runs/src-1/events?limit=100"),
        None,
    )
    .await;
    let events = page["events"].as_array().cloned().unwrap_or_default();
    let at_version = events
        .iter()
        .find(|e| e["type"] == "step_succeeded" && e["node"] == "refund")
        .and_then(|e| e["state_version"].as_i64())
        .unwrap_or_else(|| panic!("refund's success in {page}"));
    let states = stack.states().await;
    let source_refund = states["src-1"].steps["refund#1"].clone();

    // Fork it over HTTP with a patched input. A fork's run id is on its source's
    // partition (the reducer holds the source's chain head there).
    let fork_1 = fork_id("fork-1", "src-1", stack.partitions);
    let fork_2 = fork_id("fork-2", "src-1", stack.partitions);
    let (status, body) = call(
        reqwest::Method::POST,
        &format!("{url}/v1/runs/src-1/fork"),
        Some(
            json!({"at_version": at_version, "input_patch": {"channel": "sms"}, "run_id": fork_1}),
        ),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["run_id"], fork_1.as_str());
    assert_eq!(
        body["forked_from"],
        json!({"run_id": "src-1", "version": at_version})
    );
    let forked = wait_succeeded(&url, &fork_1).await;
    assert_eq!(
        forked["forked_from"],
        json!({"run_id": "src-1", "version": at_version})
    );
    assert_eq!(forked["input"], json!({"order": "o-1", "channel": "sms"}));

    let states = stack.states().await;
    let fork = &states[&fork_1];
    assert_eq!(
        fork.steps["refund#1"].operation_id,
        source_refund.operation_id
    );
    assert_eq!(fork.steps["refund#1"].output, source_refund.output);
    assert_eq!(fork.steps["notify#1"].args["channel"], "sms");
    assert_ne!(
        fork.steps["notify#1"].operation_id,
        states["src-1"].steps["notify#1"].operation_id
    );

    // The executor saw exactly one refund intent (the source's) and two notifications.
    let seen = executor.seen.lock().expect("seen").clone();
    let refunds: Vec<_> = seen.iter().filter(|i| i.node == "refund").collect();
    assert_eq!(refunds.len(), 1, "{refunds:?}");
    assert_eq!(seen.iter().filter(|i| i.node == "notify").count(), 2);
    // The fork's history starts with its lineage.
    let history = stack.events().await;
    let first = &history[&fork_1][0];
    assert!(
        matches!(&first.body, EventBody::RunStarted { forked_from: Some(f), .. } if f["run_id"] == "src-1"),
        "{first:?}"
    );

    // The CLI does the same.
    let output = std::process::Command::new(sortie_bin())
        .args([
            "run",
            "--gateway",
            &url,
            "--token",
            "tok-alice",
            "fork",
            "src-1",
            "--at-version",
            &at_version.to_string(),
            "--new-run-id",
            &fork_2,
        ])
        .output()
        .expect("sortie runs");
    assert!(output.status.success(), "{output:?}");
    let answer: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(answer["run_id"], fork_2.as_str());
    wait_succeeded(&url, &fork_2).await;
    let seen = executor.seen.lock().expect("seen").clone();
    assert_eq!(seen.iter().filter(|i| i.node == "refund").count(), 1);

    // The source shows its forks (the gateway's view indexes them from the forks' events).
    let (_, source) = call(reqwest::Method::GET, &format!("{url}/v1/runs/src-1"), None).await;
    let forks: Vec<&str> = source["forks"]
        .as_array()
        .map(|f| f.iter().filter_map(|x| x["run_id"].as_str()).collect())
        .unwrap_or_default();
    let mut expected = [fork_1.as_str(), fork_2.as_str()];
    expected.sort();
    assert_eq!(forks, expected, "{source}");

    // Shadow replay, the deploy gate: this build re-decides every recorded run the same...
    let (ok, report) = shadow(&stack, &[]).await;
    assert!(ok, "{report}");
    assert_eq!(report["diverged"], 0, "{report}");
    assert_eq!(report["runs"], 3, "{report}");
    // ...but a version that makes notify `keyed` would decide src-1 differently, first
    // where notify was dispatched: the version at which the refund succeeded.
    let v2 = stack.dir.join("refund-fork-v2.yaml");
    std::fs::write(
        &v2,
        REFUND.replace("version: 1", "version: 2").replace(
            "{id: notify, tool: echo, side_effect: idempotent",
            "{id: notify, tool: echo, side_effect: keyed",
        ),
    )
    .expect("write v2");
    let (ok, report) = shadow(
        &stack,
        &["--graph-file", &v2.display().to_string(), "--run", "src-1"],
    )
    .await;
    assert!(!ok, "a divergence exits non-zero: {report}");
    assert_eq!(report["diverged"], 1, "{report}");
    let first = &report["results"][0]["first_divergence"];
    assert_eq!(first["version"], at_version, "{report}");
}

const PAY: &str = r#"
id: pay-fork
version: 1
nodes:
  - {id: quote, tool: echo, side_effect: pure, args: {amount: $input.amount}}
  - id: transfer
    tool: echo
    side_effect: idempotent
    args: {amount: $input.amount, note: $interrupt.payload.note}
    interrupt_before: {reason: money moves, required_role: approver, timeout: 1h}
edges:
  - {from: quote, to: transfer}
"#;

/// Issue #36 item 1, over HTTP: anyone who may start runs forks a finished payment at the
/// version where its approved transfer (idempotent) was in flight, with a patched amount.
/// Seen red: the fork dispatched the transfer again at once, its arguments rendered from
/// the patched input (amount 999, the approver's note dropped) — a call no approver saw.
/// Now the fork proposes it again: a fresh interrupt of the fork, no decision of the
/// source counted, and the executor saw one transfer only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_never_runs_an_approved_call_without_a_fresh_approval() {
    let stack = Stack::start("fork-gate", &[PAY]).await;
    let _reducer = stack.reducer("0");
    let executor = stack.executor("default", succeed);
    let (_gateway, url) = stack
        .gateway_process(&stack.dir.join("gateway"), &[ALICE])
        .await;
    let (status, body) = call(
        reqwest::Method::POST,
        &format!("{url}/v1/runs"),
        Some(json!({"graph_id": "pay-fork", "run_id": "pay-1", "input": {"amount": 30}})),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let waiting = sortie_tests::wait_for("the transfer's approval", LONG, || async {
        let (_, run) = call(reqwest::Method::GET, &format!("{url}/v1/runs/pay-1"), None).await;
        (run["status"] == "waiting_approval").then_some(run)
    })
    .await;
    let interrupt = &waiting["interrupt"];
    let (status, body) = call(
        reqwest::Method::POST,
        &format!("{url}/v1/runs/pay-1/resume"),
        Some(json!({
            "decision": "approve",
            "interrupt_id": interrupt["interrupt_id"],
            "proposal_hash": interrupt["proposal_hash"],
            "payload": {"note": "checked with the customer"},
        })),
    )
    .await;
    assert!(status < 300, "{status}: {body}");
    wait_succeeded(&url, "pay-1").await;

    let history = stack.events().await;
    let at_version = history["pay-1"]
        .iter()
        .find(|e| matches!(&e.body, EventBody::StepDispatched { node, .. } if node == "transfer"))
        .map(|e| e.state_version)
        .expect("the transfer's dispatch");
    let (status, body) = call(
        reqwest::Method::POST,
        &format!("{url}/v1/runs/pay-1/fork"),
        Some(json!({"at_version": at_version, "input_patch": {"amount": 999}})),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let fork = body["run_id"].as_str().expect("a run id").to_owned();
    let forked = sortie_tests::wait_for("the fork to wait for a fresh approval", LONG, || async {
        let (_, run) = call(reqwest::Method::GET, &format!("{url}/v1/runs/{fork}"), None).await;
        (run["status"] != "running" && !run["status"].is_null()).then_some(run)
    })
    .await;
    assert_eq!(forked["status"], "waiting_approval", "{forked}");
    assert_ne!(
        forked["interrupt"]["interrupt_id"],
        interrupt["interrupt_id"]
    );
    assert_eq!(
        forked["interrupt"]["proposal"]["args"]["amount"], 999,
        "the approver of the fork sees what the fork would send: {forked}"
    );
    let transfers = executor
        .seen
        .lock()
        .expect("seen")
        .iter()
        .filter(|i| i.node == "transfer")
        .count();
    assert_eq!(transfers, 1, "only the source's approved transfer ran");
    // A run id of the caller's choosing on another partition is refused before anything
    // is published.
    let away = (0..)
        .map(|n| format!("fork-away-{n}"))
        .find(|id| {
            sortie_wire::partition_for(id.as_bytes(), stack.partitions)
                != sortie_wire::partition_for(b"pay-1", stack.partitions)
        })
        .expect("an id on another partition");
    let (status, body) = call(
        reqwest::Method::POST,
        &format!("{url}/v1/runs/pay-1/fork"),
        Some(json!({"at_version": at_version, "run_id": away})),
    )
    .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["error"]["code"], "fork_partition", "{body}");
}

/// `sortie replay shadow` on the stack's topics: whether it exited 0, and its report.
async fn shadow(stack: &Stack, extra: &[&str]) -> (bool, Value) {
    let output = tokio::process::Command::new(sortie_bin())
        .args([
            "replay",
            "shadow",
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
        .expect("run sortie replay shadow");
    let report = serde_json::from_slice(&output.stdout).unwrap_or(Value::Null);
    (output.status.success(), report)
}
