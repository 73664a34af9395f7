//! `sortie dev` on its own data dir and ports: it brings the whole stack up from nothing,
//! stops at the demo's approval, the printed CLI approval finishes the run, every graph in
//! `topology/graphs/` runs to `succeeded` against the dev receiver (so an example can never
//! rot), and Ctrl-C stops every process cleanly.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sortie_devkit::ledger::{Entry, Snapshot};
use sortie_devkit::receiver;

fn free_port() -> u16 {
    // Broker and controller need two consecutive free ports. The tests of this file run
    // at once and bind their broker's ports only later: each call starts past the
    // candidates the earlier calls were given.
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
    let first = NEXT.fetch_add(10, std::sync::atomic::Ordering::SeqCst);
    (first..first + 200)
        .map(|i| 23_000 + i * 7)
        .find(|p| {
            std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok()
                && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok()
        })
        .expect("a free port pair")
}

fn free_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").to_string()
}

/// `sortie dev` on a data dir of its own (`target/test-runs/<unique name>`, returned so a
/// test can prepare it) with this gateway, ledger and Kafka port, a free registry address
/// and the token `test-token`, run from the workspace root.
fn sortie_dev(name: &str, gateway: &str, ledger: &str, kafka_port: u16) -> (Command, PathBuf) {
    let data = sortie_tests::workspace_root()
        .join("target/test-runs")
        .join(sortie_tests::unique_prefix(name).trim_end_matches('.'));
    let mut command = Command::new(sortie_tests::stack::sortie_bin());
    command
        .args([
            "dev",
            "--data-dir",
            data.to_str().expect("utf-8"),
            "--gateway-addr",
            gateway,
            "--kafka-port",
            &kafka_port.to_string(),
            "--registry-addr",
            &free_addr(),
            "--ledger-addr",
            ledger,
            "--token",
            "test-token",
        ])
        .current_dir(sortie_tests::workspace_root());
    (command, data)
}

#[test]
fn sortie_dev_runs_the_demo_to_its_approval_and_stops_cleanly() {
    let bin = sortie_tests::stack::sortie_bin();
    let gateway = free_addr();
    let ledger = free_addr();
    let (mut command, _) = sortie_dev("dev", &gateway, &ledger, free_port());
    let child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("sortie dev starts");
    let mut child = sortie_tests::stack::DevStack(child);
    let stdout = child.0.stdout.take().expect("stdout");
    let (lines, received) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let mut approve = None;
    let mut seen = Vec::new();
    while approve.is_none() {
        let line = received
            .recv_timeout(Duration::from_secs(180))
            .unwrap_or_else(|_| {
                panic!(
                    "sortie dev printed no approval command; output so far:\n{}",
                    seen.join("\n")
                )
            });
        if line.contains(" approve run_") {
            approve = Some(line.trim().to_owned());
        }
        seen.push(line);
    }
    // The printed command is `cargo run -q -p sortie -- run --gateway G --token T approve
    // RUN`: run the same subcommand with the built binary, as printed — it names the
    // gateway in force (this one is not on the default port).
    let printed = approve.expect("line");
    let tail = printed.split(" -- ").nth(1).expect("a sortie command");
    let args: Vec<&str> = tail.split_whitespace().collect();
    let gateway_url = format!("http://{gateway}");
    assert!(
        printed.contains(&format!("--gateway {gateway_url} ")),
        "the printed command does not name the gateway in force: {printed}"
    );
    let approved = Command::new(&bin)
        .args(&args)
        .output()
        .expect("approve runs");
    assert!(
        approved.status.success(),
        "approve failed: {}",
        String::from_utf8_lossy(&approved.stderr)
    );
    let run_id = args.last().expect("run id").to_string();
    let watched = Command::new(&bin)
        .args([
            "run",
            "--gateway",
            &gateway_url,
            "--token",
            "test-token",
            "watch",
            &run_id,
            // The old output, one JSON event per line: scripts keep working.
            "--json",
        ])
        .output()
        .expect("watch runs");
    let history = String::from_utf8_lossy(&watched.stdout);
    assert!(
        history.contains("\"SUCCEEDED\""),
        "the demo did not finish: {history}"
    );

    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(every_example_graph_succeeds(
        &gateway_url,
        &format!("http://{ledger}"),
        "test-token",
    ));

    let pid = rustix::process::Pid::from_raw(child.0.id() as i32).expect("pid");
    rustix::process::kill_process(pid, rustix::process::Signal::INT).expect("SIGINT");
    let status = child.0.wait().expect("sortie dev exits");
    assert!(
        status.success(),
        "sortie dev did not stop cleanly: {status}"
    );
    let rest: Vec<String> = received.try_iter().collect();
    assert!(
        rest.iter().any(|l| l.contains("kafka     stopped")),
        "{rest:?}"
    );
    assert!(
        rest.iter().any(|l| l.contains(" start refund --input ")),
        "sortie dev did not print the refund story: {rest:?}"
    );
}

/// A port already taken is named with the flag that moves it, before anything starts: no
/// broker is left behind.
#[test]
fn a_taken_address_is_named_with_its_flag_and_nothing_is_started() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let taken_addr = taken.local_addr().expect("addr").to_string();
    let kafka_port = free_port();
    let output = sortie_dev("dev-taken", &taken_addr, &free_addr(), kafka_port)
        .0
        .output()
        .expect("sortie dev runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains(&taken_addr) && stderr.contains("--gateway-addr"),
        "the error does not name the address and its flag: {stderr}"
    );
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", kafka_port)).is_err(),
        "a broker was started"
    );
}

/// A stack that fails after its broker started (here the gateway cannot open its data
/// dir) stops every process it started, the broker included: the next `sortie dev` does
/// not find a stray broker "already running".
///
/// Checked red: without the stop on failure, the broker's port still answered.
#[test]
fn a_failed_start_stops_the_broker_it_started() {
    let kafka_port = free_port();
    let (mut command, data) = sortie_dev("dev-failed", &free_addr(), &free_addr(), kafka_port);
    std::fs::create_dir_all(&data).expect("data dir");
    // The gateway's data dir is a file: the gateway exits at once.
    std::fs::write(data.join("gateway"), "not a directory").expect("blocker");
    let output = command.arg("--no-demo").output().expect("sortie dev runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains(&format!("127.0.0.1:{kafka_port} (started)")),
        "the broker was not started by this run: {stdout}"
    );
    assert!(
        stderr.contains("gateway exited"),
        "the failure is not the gateway's: {stderr}"
    );
    assert!(
        stdout.contains("kafka     stopped"),
        "the broker was left running: {stdout}"
    );
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", kafka_port)).is_err(),
        "the broker's port still answers"
    );
}

/// The MCP example ran the fake model's script on the Anthropic API: three model calls,
/// two tool calls, charged as the chat-completions example is.
fn mcp_agent_spent(run: &Value) {
    let spend = &run["spend"];
    assert_eq!(spend["llm_calls"], 3, "{run}");
    assert_eq!(spend["tool_calls"], 2, "{run}");
    assert!(spend["cost_usd"].as_f64().unwrap_or(0.0) > 0.0, "{run}");
    assert_eq!(
        run["output"]["summarize"]["answer"],
        sortie_devkit::model::FINAL_ANSWER,
        "{run}"
    );
}

/// The agent example ran the fake model's script (two tool calls, then an answer) under
/// the dev budgets file: its budget and spend are in the run's state.
fn agent_spent(run: &Value) {
    let spend = &run["spend"];
    assert_eq!(spend["llm_calls"], 3, "{run}");
    assert_eq!(spend["tool_calls"], 2, "{run}");
    assert!(spend["cost_usd"].as_f64().unwrap_or(0.0) > 0.0, "{run}");
    assert_eq!(run["budget"]["limits"]["tokens"], 200_000, "{run}");
    assert!(run["budget"]["prices"]["fake-agent"].is_object(), "{run}");
}

/// A payload a wait's schema takes: each declared string property `"example-<name>"`.
fn example_payload(schema: Option<&Value>) -> Value {
    let mut payload = serde_json::Map::new();
    let properties = schema.and_then(|s| s["properties"].as_object());
    for (name, property) in properties.into_iter().flatten() {
        if property["type"] == "string" {
            payload.insert(name.clone(), Value::String(format!("example-{name}")));
        }
    }
    Value::Object(payload)
}

/// The input a graph file asks for: every `$input.<name>` it mentions, as a string.
fn example_input(text: &str) -> Value {
    let mut input = serde_json::Map::new();
    for (at, _) in text.match_indices("$input.") {
        let name: String = text[at + "$input.".len()..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        // A manager's group: the dev user is in `managers` (members-only gates).
        if name == "manager" {
            input.insert(name, Value::String("managers".into()));
        } else if !name.is_empty() {
            input.insert(name.clone(), Value::String(format!("example-{name}")));
        }
    }
    Value::Object(input)
}

/// Starts one run of every graph file in `topology/graphs/` (enumerated, so a new file is
/// covered without touching this test), approves through the HTTP API whenever a run asks,
/// and waits until every run has succeeded. Then the dev receiver's ledger must hold
/// exactly one refund per idempotency key, and a repeated refund (what a retry after a
/// lost answer sends) must get the first answer and refund nothing.
///
/// Seen red: with the receiver's refund route deduping nothing (`Mode::Plain`), the
/// repeated refund below is a second effect.
async fn every_example_graph_succeeds(gateway: &str, receiver: &str, token: &str) {
    let client = reqwest::Client::new();
    let dir = sortie_tests::workspace_root().join("topology/graphs");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("topology/graphs")
        .map(|entry| entry.expect("entry").path())
        .filter(|path| {
            path.extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"))
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no graph files in {}", dir.display());

    let mut runs = Vec::new();
    let mut signals = std::collections::BTreeMap::new();
    for file in &files {
        let graph = sortie_catalog::load_file(file).expect("the graph file loads");
        let text = std::fs::read_to_string(file).expect("read");
        // A correlated graph names its runs by a label: the run id is derived from it.
        let labels: serde_json::Map<String, Value> = graph
            .correlation
            .iter()
            .map(|label| (label.clone(), Value::String(format!("example-{label}"))))
            .collect();
        for node in &graph.nodes {
            if let Some(wait) = &node.wait {
                signals.insert(wait.signal.clone(), example_payload(wait.schema.as_ref()));
            }
            // A conversation's customer says goodbye, and ends it.
            if let Some(conversation) = &node.conversation {
                signals.insert(
                    conversation.signal.clone(),
                    json!({"text": "Thanks, goodbye!", "end": true}),
                );
            }
        }
        let started: Value = client
            .post(format!("{gateway}/v1/runs"))
            .bearer_auth(token)
            .json(&json!({"graph_id": graph.id, "input": example_input(&text), "labels": labels}))
            .send()
            .await
            .expect("start")
            .json()
            .await
            .expect("json");
        let run_id = started["run_id"]
            .as_str()
            .unwrap_or_else(|| panic!("{} did not start: {started}", file.display()))
            .to_owned();
        runs.push((file.display().to_string(), run_id));
    }

    for (file, run_id) in &runs {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let run: Value = client
                .get(format!("{gateway}/v1/runs/{run_id}"))
                .bearer_auth(token)
                .send()
                .await
                .expect("get")
                .json()
                .await
                .expect("json");
            match run["status"].as_str().unwrap_or_default() {
                "succeeded" if file.ends_with("agent.yaml") => {
                    agent_spent(&run);
                    break;
                }
                "succeeded" if file.ends_with("mcp.yaml") => {
                    mcp_agent_spent(&run);
                    break;
                }
                "succeeded" => break,
                "failed" | "cancelled" => panic!("{file}: run {run_id} ended {run}"),
                _ => {}
            }
            // A run that waits for the world gets its signal, as the outside service
            // would send it.
            for name in run["open_waits"].as_array().into_iter().flatten() {
                let name = name.as_str().expect("signal name");
                let answer = client
                    .post(format!("{gateway}/v1/runs/{run_id}/signals/{name}"))
                    .bearer_auth(token)
                    .json(&json!({"payload": signals.get(name), "signal_id": format!("example-{name}")}))
                    .send()
                    .await
                    .expect("signal");
                assert!(
                    answer.status().is_success(),
                    "{file}: signalling {name}: {}",
                    answer.text().await.unwrap_or_default()
                );
            }
            for interrupt in run["interrupts"].as_array().into_iter().flatten() {
                let id = interrupt["interrupt_id"].as_str().expect("interrupt id");
                let answer = client
                    .post(format!("{gateway}/v1/runs/{run_id}/resume"))
                    .bearer_auth(token)
                    .json(&json!({"decision": "approve", "interrupt_id": id}))
                    .send()
                    .await
                    .expect("resume");
                assert!(
                    answer.status().is_success() || answer.status().as_u16() == 409,
                    "{file}: approving {id}: {}",
                    answer.text().await.unwrap_or_default()
                );
            }
            assert!(
                Instant::now() < deadline,
                "{file}: run {run_id} did not succeed: {run}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    let ledger = |client: reqwest::Client| async move {
        client
            .get(format!("{receiver}/ledger"))
            .send()
            .await
            .expect("ledger")
            .json::<Snapshot>()
            .await
            .expect("snapshot")
    };
    let snapshot = ledger(client.clone()).await;
    let refunds: Vec<&Entry> = snapshot
        .calls
        .iter()
        .filter(|e| e.name == receiver::PAYMENTS_REFUND)
        .collect();
    assert!(
        !refunds.is_empty() || !files.iter().any(|f| f.ends_with("refund.yaml")),
        "the refund story refunded nothing: {snapshot:?}"
    );
    for refund in &refunds {
        let key = refund
            .operation_id
            .as_deref()
            .expect("a refund carries its key");
        assert_eq!(snapshot.effects(key), 1, "refund {key}: {snapshot:?}");
    }

    // The MCP example: its tools' calls reached the dev MCP server with their operation
    // ids in `_meta`, each refund once.
    if files.iter().any(|f| f.ends_with("mcp.yaml")) {
        let lookups = snapshot
            .calls
            .iter()
            .filter(|e| e.name == sortie_devkit::mcp::LOOKUP_ORDER)
            .count();
        let mcp_refunds: Vec<&Entry> = snapshot
            .calls
            .iter()
            .filter(|e| e.name == sortie_devkit::mcp::REFUND)
            .collect();
        assert!(lookups >= 1, "{snapshot:?}");
        assert_eq!(mcp_refunds.len(), 1, "{snapshot:?}");
        assert!(
            mcp_refunds[0]
                .operation_id
                .as_deref()
                .is_some_and(|op| op.starts_with("op_")),
            "the operation id came in _meta: {:?}",
            mcp_refunds[0]
        );
    }

    reversal_undoes_a_refund(&client, gateway, receiver, token).await;

    // What an executor retrying after a lost answer sends: the same key, the same body.
    if let Some(first) = refunds.first() {
        let key = first.operation_id.clone().expect("key");
        let repeat: Value = client
            .post(format!("{receiver}/{}", receiver::PAYMENTS_REFUND))
            .header("Idempotency-Key", &key)
            .json(&first.body)
            .send()
            .await
            .expect("repeat")
            .json()
            .await
            .expect("json");
        assert_eq!(repeat, first.answer, "a repeated key gets the first answer");
        let after = ledger(client.clone()).await;
        assert_eq!(
            (after.effects(&key), after.calls(&key)),
            (1, snapshot.calls(&key) + 1),
            "a repeated key refunded again"
        );
    }
}

/// The refund story's unhappy end: the customer cannot be notified (the receiver refuses
/// `cus-unreachable…` with 422, a permanent failure), so the run fails after its refund and
/// the compensation reverses that refund, once, with the refund's id.
///
/// Seen red: with the receiver notifying unreachable customers anyway, the run succeeds
/// and nothing is reversed; the stack was still stopped by the guard.
async fn reversal_undoes_a_refund(
    client: &reqwest::Client,
    gateway: &str,
    receiver: &str,
    token: &str,
) {
    let input = json!({
        "order_id": "ord-unhappy",
        "customer_id": format!("{}-1", receiver::UNREACHABLE),
        "reason": "arrived damaged",
    });
    let started: Value = client
        .post(format!("{gateway}/v1/runs"))
        .bearer_auth(token)
        .json(&json!({"graph_id": "refund", "input": input}))
        .send()
        .await
        .expect("start")
        .json()
        .await
        .expect("json");
    let run_id = started["run_id"].as_str().expect("run id").to_owned();
    let deadline = Instant::now() + Duration::from_secs(120);
    let run = loop {
        let run: Value = client
            .get(format!("{gateway}/v1/runs/{run_id}"))
            .bearer_auth(token)
            .send()
            .await
            .expect("get")
            .json()
            .await
            .expect("json");
        if matches!(
            run["status"].as_str(),
            Some("failed" | "cancelled" | "succeeded")
        ) {
            break run;
        }
        if let Some(id) = run["interrupt"]["interrupt_id"].as_str() {
            let _ = client
                .post(format!("{gateway}/v1/runs/{run_id}/resume"))
                .bearer_auth(token)
                .json(&json!({"decision": "approve", "interrupt_id": id}))
                .send()
                .await;
        }
        assert!(
            Instant::now() < deadline,
            "the unhappy refund did not end: {run}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(run["status"], "failed", "{run}");
    let snapshot: Snapshot = client
        .get(format!("{receiver}/ledger"))
        .send()
        .await
        .expect("ledger")
        .json()
        .await
        .expect("snapshot");
    let refund = snapshot
        .calls
        .iter()
        .find(|e| e.name == receiver::PAYMENTS_REFUND && e.body["order_id"] == "ord-unhappy")
        .expect("the unhappy run refunded");
    let reversals: Vec<&Entry> = snapshot
        .calls
        .iter()
        .filter(|e| {
            e.name == receiver::PAYMENTS_REVERSE
                && e.body["refund_id"] == refund.answer["refund_id"]
        })
        .collect();
    assert_eq!(
        reversals.len(),
        1,
        "one reversal of {}: {snapshot:?}",
        refund.answer
    );
    assert_eq!(reversals[0].body["amount"], refund.body["amount"]);
    assert_eq!(reversals[0].answer["status"], "reversed");
}
