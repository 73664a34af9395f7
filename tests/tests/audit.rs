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
        std::sync::Arc::make_mut(step).output = Some(serde_json::json!({"refund": 1_000_000}));
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

// ---------------------------------------------------------------- audit why (issue #36)

/// `sortie audit why` on this stack: whether it exited 0, and the chain it printed.
async fn why(stack: &Stack, operation: &str, extra: &[&str]) -> (bool, serde_json::Value, String) {
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
    let chain = serde_json::from_slice(&output.stdout).unwrap_or(serde_json::Value::Null);
    (
        output.status.success(),
        chain,
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn link<'a>(chain: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    chain["links"]
        .as_array()
        .and_then(|links| links.iter().find(|l| l["link"] == name))
        .unwrap_or(&serde_json::Value::Null)
}

/// A keyring with the harness's service key and graph publisher, and a reducer that
/// requires signatures.
fn signed_stack(stack: &Stack) -> (sortie_wire::signing::Signer, std::path::PathBuf) {
    let service = sortie_wire::signing::Signer::generate("svc-test-1").expect("key");
    let keyring = stack.write_keyring(&[service.entry(
        "svc:test",
        &["acme".to_owned()],
        &["approver".to_owned(), "operator".to_owned()],
        false,
    )]);
    (service, keyring)
}

/// Issue #36 item 6, the refund story: `sortie audit why <refund's operation>` verifies
/// every link — the hash chain, the operation id derived from the step and its
/// arguments, the graph version signed by the publisher key, the approval carried by a
/// signed command found on `sortie.commands` (partition, offset, key), its proposal hash —
/// and the gateway answers the same chain. Then a tampered history: a copy of the run
/// forged under another id with every hash chained anew (the audit's re-fold cannot tell:
/// it is a consistent history) is named broken at its approval — no signed command
/// carries it — and an altered event of the real run breaks its history link. Seen red:
/// with `signed_command` taking a command it cannot find as verified, the forged copy's
/// chain held and `audit why` exited 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_why_proves_a_refunds_approval_and_names_a_forged_one() {
    let stack = Stack::start("audit-why", &[sortie_tests::GATED]).await;
    let (service, keyring) = signed_stack(&stack);
    let ring = keyring.to_str().expect("path").to_owned();
    let _reducer = stack.reducer_with("0", &["--keyring", &ring, "--require-signatures"]);
    let _executor = stack.executor("default", succeed);
    let run = "run-refund".to_owned();
    stack
        .send_signed(&start_run(&run, "gated", r#"{"amount": 5}"#), &service)
        .await;
    let waiting = stack
        .wait_for_states(
            "the refund's approval",
            std::slice::from_ref(&run),
            LONG,
            |s| s.status == RunStatus::WaitingApproval,
        )
        .await;
    let interrupt = waiting[&run]
        .interrupts
        .values()
        .next()
        .expect("open")
        .clone();
    stack
        .send_signed(
            &sortie_tests::stack::approve(&run, "approve-refund", &interrupt),
            &service,
        )
        .await;
    let done = stack
        .wait_for_states("the refund", std::slice::from_ref(&run), LONG, |s| {
            s.status == RunStatus::Succeeded
        })
        .await;
    let refund = done[&run].steps["refund#1"].operation_id.clone();
    let prepare = done[&run].steps["prepare#1"].operation_id.clone();

    let (ok, chain, stderr) = why(&stack, &refund, &["--keyring", &ring]).await;
    assert!(ok, "{stderr}\n{chain:#}");
    assert_eq!(chain["verified"], true, "{chain:#}");
    let names: Vec<&str> = chain["links"]
        .as_array()
        .expect("links")
        .iter()
        .filter_map(|l| l["link"].as_str())
        .collect();
    assert_eq!(
        names,
        ["history", "effect", "graph", "approval", "proposal"]
    );
    assert_eq!(link(&chain, "effect")["facts"]["class"], "keyed");
    assert_eq!(
        link(&chain, "graph")["facts"]["signed_by"],
        "test-publisher"
    );
    let approval = &link(&chain, "approval")["facts"]["approvals"][0];
    assert_eq!(approval["principal"], "svc:test", "{chain:#}");
    assert_eq!(approval["key_id"], "svc-test-1");
    assert_eq!(approval["signature"], "verified");
    assert!(approval["record"]["offset"].is_i64(), "{chain:#}");
    assert_eq!(
        approval["proposal_hash"],
        serde_json::json!(interrupt.proposal_hash)
    );
    // The ungated step: no approval needed, and that is said.
    let (ok, chain, stderr) = why(&stack, &prepare, &["--keyring", &ring]).await;
    assert!(ok, "{stderr}");
    assert_eq!(link(&chain, "approval")["facts"]["gated"], false);
    // Without the keyring nothing signed can be checked: not verified, exit non-zero.
    let (ok, chain, _) = why(&stack, &refund, &[]).await;
    assert!(!ok);
    assert_eq!(link(&chain, "approval")["status"], "unchecked");

    // The gateway answers the same chain.
    let (_gateway, url) = stack
        .gateway_process_with(
            &stack.dir.join("gateway"),
            &["acme:user:auditor::tok-auditor"],
            &["--keyring", &ring],
        )
        .await;
    let answer = reqwest::Client::new()
        .get(format!("{url}/v1/runs/{run}/operations/{refund}/why"))
        .bearer_auth("tok-auditor")
        .send()
        .await
        .expect("GET why");
    assert_eq!(answer.status().as_u16(), 200);
    let over_http: serde_json::Value = answer.json().await.expect("JSON");
    assert_eq!(over_http["verified"], true, "{over_http:#}");
    assert_eq!(
        link(&over_http, "approval")["facts"]["approvals"][0]["record"],
        approval["record"]
    );

    // A forged copy of the run, chained anew: "run-forged" refunded on svc:test's word.
    let events = stack.events().await;
    let forged_run = "run-forged";
    let mut prev: Option<String> = None;
    let mut forged_refund = String::new();
    for event in events[&run].iter().filter(|e| e.seq > 0) {
        let mut forged = event.clone();
        forged.run_id = forged_run.into();
        if let EventBody::StepDispatched {
            step_id,
            tool,
            args,
            ..
        } = &forged.body
        {
            let op = sortie_core::ids::operation_id("acme", forged_run, step_id, tool, args);
            if step_id == "refund#1" {
                forged_refund = op.clone();
            }
            forged.operation_id = Some(op);
        }
        forged.prev_hash = prev.clone();
        forged.hash = Some(forged.compute_hash());
        prev = forged.hash.clone();
        let value = stack
            .codec
            .encode(
                &stack.topics.run_events(),
                &sortie_model::event_to_wire(&forged),
            )
            .await
            .expect("encode");
        stack
            .send_raw(
                &stack.topics.run_events(),
                Some(partition_for(forged_run.as_bytes(), stack.partitions)),
                forged_run.as_bytes(),
                &value,
            )
            .await;
    }
    let (ok, chain, stderr) = why(&stack, &forged_refund, &["--keyring", &ring]).await;
    assert!(!ok, "a forged approval exits non-zero: {chain:#}");
    assert_eq!(link(&chain, "history")["status"], "verified", "{chain:#}");
    assert_eq!(link(&chain, "approval")["status"], "broken", "{chain:#}");
    let problems = link(&chain, "approval")["problems"].to_string();
    assert!(problems.contains("nobody sent"), "{problems}");
    assert!(
        stderr.contains("approval"),
        "the broken link is named: {stderr}"
    );

    // An altered event of the real run (its refund's arguments, its old hash kept).
    let mut altered = events[&run]
        .iter()
        .find(|e| matches!(&e.body, EventBody::StepDispatched { step_id, .. } if step_id == "refund#1"))
        .expect("the refund's dispatch")
        .clone();
    if let EventBody::StepDispatched { args, .. } = &mut altered.body {
        *args = serde_json::json!({"amount": 5000});
    }
    let value = stack
        .codec
        .encode(
            &stack.topics.run_events(),
            &sortie_model::event_to_wire(&altered),
        )
        .await
        .expect("encode");
    stack
        .send_raw(
            &stack.topics.run_events(),
            Some(partition_for(run.as_bytes(), stack.partitions)),
            run.as_bytes(),
            &value,
        )
        .await;
    let (ok, chain, _) = why(&stack, &refund, &["--keyring", &ring, "--run", &run]).await;
    assert!(!ok);
    assert_eq!(link(&chain, "history")["status"], "broken", "{chain:#}");
}

/// Issue #36 item 6, the agent story: a model (the scripted fake, served here) calls
/// `lookup_order`, then `refund` behind an approval. `audit why` on the refund's
/// operation verifies, besides the approval, the request link: the assistant step whose
/// recorded answer (its hash) holds the tool call that named `refund` with these
/// arguments, and the model that answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_why_follows_an_agents_refund_back_to_the_models_tool_call() {
    use sortie_devkit::model::{self, FakeModel};
    let fake = FakeModel::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let model_url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(model::serve(
        listener,
        fake.clone(),
        std::future::pending::<()>(),
    ));
    let stack = Stack::start("audit-why-agent", &[]).await;
    stack
        .publish(&format!(
            r#"
id: agent
version: 1
max_steps: 20
nodes:
  - id: assistant
    tool: llm
    side_effect: pure
    args:
      messages: [{{role: user, content: $input.request}}]
    config: {{base_url: "{model_url}/v1", model: fake-agent}}
    timeout: 10s
    may_request: [lookup_order, refund]
    tools: [lookup_order, refund]
  - id: lookup_order
    tool: echo
    side_effect: pure
    description: Reads an order.
    args: {{order_id: The order's id.}}
  - id: refund
    tool: echo
    side_effect: keyed
    args: {{order_id: The order's id., amount: {{type: number}}}}
    interrupt_before: {{reason: money moves, required_role: approver, timeout: 1h}}
edges: []
"#
        ))
        .await;
    let (service, keyring) = signed_stack(&stack);
    let ring = keyring.to_str().expect("path").to_owned();
    let _reducer = stack.reducer_with("0", &["--keyring", &ring, "--require-signatures"]);
    let _executor = stack.executor_process("executor", &["default"], &[]);
    let run = "run-agent".to_owned();
    stack
        .send_signed(
            &start_run(&run, "agent", r#"{"request": "refund ord-1"}"#),
            &service,
        )
        .await;
    let waiting = stack
        .wait_for_states(
            "the refund's approval",
            std::slice::from_ref(&run),
            LONG,
            |s| s.open_interrupts().any(|i| i.node == "refund"),
        )
        .await;
    let interrupt = waiting[&run]
        .open_interrupts()
        .find(|i| i.node == "refund")
        .expect("open")
        .clone();
    stack
        .send_signed(
            &sortie_tests::stack::approve(&run, "approve-refund", &interrupt),
            &service,
        )
        .await;
    let done = stack
        .wait_for_states(
            "the agent to finish",
            std::slice::from_ref(&run),
            LONG,
            |s| s.status.is_terminal(),
        )
        .await;
    let state = &done[&run];
    assert_eq!(state.status, RunStatus::Succeeded, "{state:#?}");
    let refund = state.steps["refund#1"].operation_id.clone();
    let (ok, chain, stderr) = why(&stack, &refund, &["--keyring", &ring]).await;
    assert!(ok, "{stderr}\n{chain:#}");
    let request = &link(&chain, "request")["facts"];
    assert_eq!(request["requested_by"], "assistant#2", "{chain:#}");
    assert_eq!(request["model"], "fake-agent", "{chain:#}");
    assert_eq!(request["tool_call"]["function"]["name"], "refund");
    let asked = &state.steps["assistant#2"];
    assert_eq!(
        request["operation_id"],
        serde_json::json!(asked.operation_id)
    );
    assert_eq!(
        request["output_sha256"],
        serde_json::json!(sortie_core::json::sha256_hex(&[
            &sortie_core::json::canonical(asked.output.as_ref().expect("the model's answer"))
        ]))
    );
    assert_eq!(link(&chain, "approval")["status"], "verified");
    // The ungated lookup goes back to the first answer.
    let lookup = state.steps["lookup_order#1"].operation_id.clone();
    let (ok, chain, stderr) = why(&stack, &lookup, &["--keyring", &ring]).await;
    assert!(ok, "{stderr}");
    assert_eq!(
        link(&chain, "request")["facts"]["requested_by"],
        "assistant#1"
    );
}
