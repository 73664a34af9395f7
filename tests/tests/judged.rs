//! Approvals people can judge, over the gateway against the real broker (issue #15 items
//! 3 and 8): the inbox says why, what the step affects and what a rejection does; a
//! resume's payload is human input that reaches the call; `interrupt_id` may be omitted
//! when one interrupt is open (and several are listed in a 409); a precheck re-reads the
//! business state after approval; a members-only quorum refuses outsiders — with a 403 at
//! the gateway and a `CommandRejected` for a raw Kafka command — and counts a principal once.

use std::time::Duration;

use serde_json::{json, Value};
use sortie_core::{EventBody, RunStatus};
use sortie_tests::stack::{command, succeed, Stack};
use sortie_wire::records as w;

const PAYOUT: &str = r#"
id: payout
version: 1
nodes:
  - {id: prepare, tool: echo, side_effect: pure}
  - id: pay
    tool: echo
    side_effect: keyed
    args: {amount: $input.amount, note: $interrupt.payload.note}
    approval: {reason: large payouts need two people from finance, quorum: 2, group: finance, timeout: 24h}
    precheck: still_payable
    on_reject: fail
  - {id: still_payable, tool: echo, side_effect: pure, args: {ok: $input.still_payable}}
edges:
  - {from: prepare, to: pay}
"#;

/// Two gates open at once.
const TWO_GATES: &str = r#"
id: two-gates
version: 1
nodes:
  - {id: a, tool: echo, side_effect: pure, interrupt_before: {reason: first}}
  - {id: b, tool: echo, side_effect: pure, interrupt_before: {reason: second}}
"#;

const ALICE: &str = "acme:user:alice:approver,@finance:tok-alice";
const BOB: &str = "acme:user:bob:approver,@finance:tok-bob";
const MALLORY: &str = "acme:user:mallory:approver,@sales:tok-mallory";

const LONG: Duration = Duration::from_secs(90);

/// The precheck answers with its arguments (so `ok` is what the run input says); every
/// other step as the test executor always does.
fn answer(intent: &w::StepIntent) -> Option<w::StepResult> {
    let mut result = succeed(intent)?;
    if intent.node == "still_payable" {
        result.output = Some(intent.args.clone());
    }
    Some(result)
}

/// The shared client, with this suite's helpers.
struct Api(sortie_tests::http::Api);

impl std::ops::Deref for Api {
    type Target = sortie_tests::http::Api;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl Api {
    async fn wait_run(&self, what: &str, run_id: &str, done: impl Fn(&Value) -> bool) -> Value {
        self.0.wait_run(what, run_id, "tok-alice", LONG, done).await
    }

    async fn start(&self, run_id: &str, graph: &str, input: Value) {
        self.0
            .start(
                "tok-alice",
                json!({"graph_id": graph, "run_id": run_id, "input": input}),
            )
            .await;
    }
}

use sortie_tests::http::code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finance_quorum_with_human_input_and_a_precheck() {
    let stack = Stack::start("judged", &[PAYOUT, TWO_GATES]).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor("default", answer);
    let (_gateway, url) = stack
        .gateway_process(&stack.dir.join("gateway"), &[ALICE, BOB, MALLORY])
        .await;
    let api = Api(sortie_tests::http::Api::new(&url));

    api.start(
        "pay-1",
        "payout",
        json!({"amount": 5000, "still_payable": true}),
    )
    .await;
    api.wait_run("pay-1 to wait for approval", "pay-1", |r| {
        r["status"] == "waiting_approval"
    })
    .await;

    // The inbox explains: what the step affects, what a rejection does, who may decide.
    let (_, inbox) = api.get("/v1/inbox", "tok-mallory").await;
    let item = inbox["items"]
        .as_array()
        .and_then(|items| items.iter().find(|i| i["run_id"] == "pay-1"))
        .cloned()
        .unwrap_or_else(|| panic!("pay-1 in the inbox: {inbox}"));
    assert_eq!(
        item["affects"],
        json!({"node": "pay", "tool": "echo", "side_effect": "keyed",
               "args": {"amount": 5000, "note": "$interrupt.payload.note"}})
    );
    let on_reject = item["on_reject"].as_str().unwrap_or_default();
    assert!(
        on_reject.starts_with("The run fails") && on_reject.contains("still_payable"),
        "{on_reject}"
    );
    assert_eq!(item["approver_group"], "finance");
    assert_eq!(item["may_decide"], false);
    let why_not = item["why_not"].as_str().unwrap_or_default();
    assert!(
        why_not.contains("finance") && why_not.contains("sales"),
        "{why_not}"
    );

    // Outside the group: 403, no interrupt_id needed (one is open).
    let (status, body) = api
        .post(
            "/v1/runs/pay-1/resume",
            "tok-mallory",
            json!({"decision": "approve"}),
        )
        .await;
    assert_eq!((status, code(&body)), (403, "not_in_group"), "{body}");

    // Alice approves (1 of 2); approving again counts once.
    let (status, body) = api
        .post(
            "/v1/runs/pay-1/resume",
            "tok-alice",
            json!({"decision": "approve", "payload": {"note": "first look"}}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = api
        .post(
            "/v1/runs/pay-1/resume",
            "tok-alice",
            json!({"decision": "approve"}),
        )
        .await;
    assert_eq!((status, code(&body)), (409, "duplicate_approver"), "{body}");

    // A raw Kafka decision from a principal in no group is refused by the reducer.
    let run = api
        .wait_run("pay-1's view", "pay-1", |r| {
            r["status"] == "waiting_approval"
        })
        .await;
    let interrupt = &run["interrupt"];
    let raw = command(
        "pay-1",
        "raw-outsider",
        w::CommandBody::ResumeRun(w::ResumeRun {
            interrupt_id: interrupt["interrupt_id"]
                .as_str()
                .unwrap_or_default()
                .into(),
            proposal_hash: interrupt["proposal_hash"]
                .as_str()
                .unwrap_or_default()
                .into(),
            decision: w::Decision::Approve,
            payload: None,
            comment: None,
            edited_args: None,
            payload_is_input: true,
        }),
    );
    stack.send(&raw).await;
    let refused = sortie_tests::wait_for("the raw decision's answer", LONG, || async {
        let events = stack.events().await;
        events.get("pay-1").and_then(|history| {
            history.iter().find_map(|e| match &e.body {
                EventBody::CommandRejected {
                    command_id, code, ..
                } if command_id == "raw-outsider" => Some(code.clone()),
                _ => None,
            })
        })
    })
    .await;
    assert_eq!(refused, "not_in_group");

    // Bob completes the quorum; the precheck passes; the call carries his input.
    let (status, body) = api
        .post(
            "/v1/runs/pay-1/resume",
            "tok-bob",
            json!({"decision": "approve", "payload": {"note": "second pair of eyes"}}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    // The seed's answer: running (or already past it, the executor being quick).
    assert!(
        body["status"] == "running" || body["status"] == "succeeded",
        "{body}"
    );
    api.wait_run("pay-1 to succeed", "pay-1", |r| r["status"] == "succeeded")
        .await;
    let states = stack.states().await;
    let state = &states["pay-1"];
    assert_eq!(
        state.steps["pay#1"].args,
        json!({"amount": 5000, "note": "second pair of eyes"})
    );
    assert!(state.steps.contains_key("still_payable#1"));

    // The same approvals, but the precheck says no: the payout never runs.
    api.start(
        "pay-2",
        "payout",
        json!({"amount": 5000, "still_payable": false}),
    )
    .await;
    api.wait_run("pay-2 to wait", "pay-2", |r| {
        r["status"] == "waiting_approval"
    })
    .await;
    for token in ["tok-alice", "tok-bob"] {
        let (status, body) = api
            .post(
                "/v1/runs/pay-2/resume",
                token,
                json!({"decision": "approve"}),
            )
            .await;
        assert_eq!(status, 200, "{body}");
    }
    let run = api
        .wait_run("pay-2 to fail", "pay-2", |r| r["status"] == "failed")
        .await;
    let states = stack.states().await;
    let state = &states["pay-2"];
    assert_eq!(state.status, RunStatus::Failed);
    assert!(!state.steps.contains_key("pay#1"), "{run}");
    let events = stack.events().await;
    let reason = events["pay-2"]
        .iter()
        .find_map(|e| match &e.body {
            EventBody::RunStatusChanged {
                status: RunStatus::Failed,
                reason,
                ..
            } => reason.clone(),
            _ => None,
        })
        .unwrap_or_default();
    assert!(
        reason.contains("precheck still_payable#1 refused step pay#1"),
        "{reason}"
    );

    // Two open interrupts: a decision must name one; the 409 lists them.
    api.start("gates-1", "two-gates", json!({})).await;
    api.wait_run("two gates open", "gates-1", |r| {
        r["interrupts"].as_array().is_some_and(|i| i.len() == 2)
    })
    .await;
    let (status, body) = api
        .post(
            "/v1/runs/gates-1/resume",
            "tok-alice",
            json!({"decision": "approve"}),
        )
        .await;
    assert_eq!(
        (status, code(&body)),
        (409, "ambiguous_interrupt"),
        "{body}"
    );
    let listed = body["error"]["open_interrupts"]
        .as_array()
        .map(|a| a.len())
        .unwrap_or(0);
    assert_eq!(listed, 2, "{body}");
}
