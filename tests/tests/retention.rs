//! Issue #14, item 9, on the real broker with the real services: a graph's `retention`.
//! A finished run of a graph with `retention: 2s` is forgotten two seconds after it ends:
//! its state in `sortie.run-state` becomes its audit summary (no input, arguments or
//! outputs; who, what, when, the outcome and the hash chain's head kept), its step
//! results in `sortie.step-results` are tombstoned, the gateway shows the same summary
//! and the run's events without their payloads, refuses to fork it (410), and
//! `audit replay --verify` is clean. A run of a graph without retention keeps its payloads.
//!
//! Checked red: with the reducer's `Effect::Forget` producing nothing, "every step result
//! of the forgotten run is tombstoned" fails; with the gateway's event rewrite skipped,
//! "the events show no payload" fails.

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::Message;
use serde_json::{json, Value};
use sortie_tests::stack::Stack;
use sortie_tests::Isolation;

const KEPT: &str = r#"
id: kept
version: 1
retention: 2s
nodes:
  - {id: read, tool: echo, side_effect: pure, args: {card: $input.card}}
  - {id: note, tool: echo, side_effect: pure, args: {seen: $steps.read.output}}
edges:
  - {from: read, to: note}
"#;

const FOREVER: &str = r#"
id: forever
version: 1
nodes:
  - {id: read, tool: echo, side_effect: pure, args: {card: $input.card}}
"#;

const TOKEN: &str = "acme:user:ops:operator:tok-ops";
const SECRET: &str = "4111-1111-1111-1111";
const LONG: Duration = Duration::from_secs(90);

async fn get(client: &reqwest::Client, url: &str) -> (u16, Value) {
    let response = client
        .get(url)
        .bearer_auth("tok-ops")
        .send()
        .await
        .expect("GET");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

async fn start(client: &reqwest::Client, url: &str, graph: &str, run_id: &str) {
    let response = client
        .post(format!("{url}/v1/runs"))
        .bearer_auth("tok-ops")
        .header("idempotency-key", run_id)
        .json(&json!({"graph_id": graph, "run_id": run_id, "input": {"card": SECRET}}))
        .send()
        .await
        .expect("POST /v1/runs");
    assert!(
        response.status().is_success(),
        "{:?}",
        response.text().await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_run_is_forgotten_after_its_graphs_retention() {
    let stack = Stack::start("retention", &[KEPT, FOREVER]).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor_process("executor", &["default"], &[]);
    let (_gateway, url) = stack
        .gateway_process(&stack.dir.join("gateway"), &[TOKEN])
        .await;
    let client = reqwest::Client::new();
    start(&client, &url, "kept", "run-kept").await;
    start(&client, &url, "forever", "run-forever").await;

    // Forgotten: the gateway's view says so (it reads the run-state topic).
    let run_url = format!("{url}/v1/runs/run-kept");
    sortie_tests::wait_until("the run to be forgotten", LONG, || {
        let (client, run_url) = (client.clone(), run_url.clone());
        async move { !get(&client, &run_url).await.1["forgotten"].is_null() }
    })
    .await;
    let (_, run) = get(&client, &run_url).await;
    assert_eq!(run["status"], "succeeded", "the outcome is kept: {run}");
    assert_eq!(run["forgotten"]["reason"], "retention");
    assert_eq!(run["started_by"], "user:ops", "who is kept");
    assert_eq!(run["steps"].as_array().map(Vec::len), Some(2));
    assert!(
        !run.to_string().contains(SECRET),
        "the run shows no payload: {run}"
    );

    let (_, events) = get(&client, &format!("{run_url}/events")).await;
    let names: Vec<&str> = events["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["type"].as_str())
        .collect();
    assert_eq!(names.last(), Some(&"run_forgotten"), "{names:?}");
    assert!(
        !events.to_string().contains(SECRET),
        "the events show no payload: {events}"
    );

    let fork = client
        .post(format!("{run_url}/fork"))
        .bearer_auth("tok-ops")
        .header("idempotency-key", "fork-1")
        .json(&json!({"at_version": 1}))
        .send()
        .await
        .expect("POST fork");
    assert_eq!(fork.status().as_u16(), 410);
    let body: Value = fork.json().await.expect("json error");
    assert_eq!(body["error"]["code"], "run_forgotten", "{body}");

    // Kafka: the latest state of the run is its summary, its step results are tombstones.
    let mut latest: HashMap<String, Option<Vec<u8>>> = HashMap::new();
    for message in sortie_tests::read_all(
        &stack.bootstrap,
        &stack.topics.run_state(),
        Isolation::ReadCommitted,
    )
    .await
    {
        let key = String::from_utf8_lossy(message.key().unwrap_or_default()).into_owned();
        latest.insert(key, message.payload().map(<[u8]>::to_vec));
    }
    let contains = |bytes: &Option<Vec<u8>>| {
        bytes
            .as_deref()
            .is_some_and(|b| String::from_utf8_lossy(b).contains(SECRET))
    };
    assert!(
        !contains(&latest["run-kept"]),
        "the forgotten run's latest state has no payload"
    );
    assert!(
        contains(&latest["run-forever"]),
        "a run without retention keeps its payloads"
    );
    let states = stack.states().await;
    let operations: Vec<String> = states["run-kept"]
        .steps
        .values()
        .map(|s| s.operation_id.clone())
        .collect();
    assert_eq!(operations.len(), 2);
    let mut results: HashMap<String, Option<Vec<u8>>> = HashMap::new();
    for message in sortie_tests::read_all(
        &stack.bootstrap,
        &stack.topics.step_results(),
        Isolation::ReadCommitted,
    )
    .await
    {
        let key = String::from_utf8_lossy(message.key().unwrap_or_default()).into_owned();
        results.insert(key, message.payload().map(<[u8]>::to_vec));
    }
    for operation in &operations {
        assert_eq!(
            results.get(operation),
            Some(&None),
            "every step result of the forgotten run is tombstoned ({operation})"
        );
    }
    let kept_operation = &states["run-forever"]
        .steps
        .values()
        .next()
        .expect("a step")
        .operation_id;
    assert!(
        results.get(kept_operation).is_some_and(Option::is_some),
        "the other run's result stays"
    );

    // The auditor: the history still folds to the state, and the chain holds.
    let (clean, report) = stack.audit_verify().await;
    assert!(clean && report["diverged"] == 0, "audit: {report}");
}
