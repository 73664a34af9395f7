//! Signals end to end on the real broker (issue 53 item 1): a run waits for an outside
//! event (`wait: {signal: laptop_delivered}`), published over HTTP or as an Avro command
//! on `sortie.commands`, and goes on with its payload. The welcome call after the wait is
//! `keyed` to the ledger, so "taken once" is checked on what the receiver got, not on
//! what the run says about itself.
//!
//! - `a_wait_survives_a_deploy_and_takes_each_signal_once`: the reducer and the executor
//!   are killed while a run waits; another run's signal arrives over Kafka while they
//!   are down, before its run even reached the wait, and is kept; after the restart both
//!   runs take their signal once, the same request (or the same signal id under a new
//!   key, also after the run ended) is answered `duplicate` and changes nothing, a payload
//!   the schema refuses is 422, a sender without the wait's role 403, and a new signal
//!   for a finished run 409 `bad_state`.
//! - `a_signal_resent_after_the_reducer_died_mid_commit_is_taken_once` (crash matrix:
//!   "signal taken and the reducer dies before its commit"): the reducer dies at
//!   `reducer.before_commit` in the batch that takes a signal; the sender, unanswered,
//!   sends it again under a new command id; a list wait (two signals wanted) takes it
//!   once and still waits for a second one. Seen red: with the signal-id check in
//!   `decide/signal.rs` skipped, the resent signal filled the wait (two copies of one
//!   delivery) and the run had succeeded where it must still wait.
//! - `a_run_is_addressed_by_its_correlation_label`: a graph declares `correlation:
//!   hire_id`; HR starts the onboarding of hire h-7 without a run id and gets the id
//!   derived from the label; the logistics service signals "the run of hire h-7"
//!   without knowing any run id; a signal for a hire whose run has not started is 404
//!   `unknown_run`, and another tenant naming the same hire reaches nothing of ours.
//! - `only_signed_signals_are_taken_where_signatures_are_required`: under
//!   `--require-signatures` a signal signed by the logistics service's key is taken; the
//!   same signal unsigned, or signed by a key that does not vouch for the role it claims,
//!   is refused `unauthenticated` outside the run's history.

use std::time::Duration;

use serde_json::{json, Value};
use sortie_core::state::WaitStatus;
use sortie_core::{EventBody, RunState, RunStatus};
use sortie_tests::http::{code, Api};
use sortie_tests::stack::{check_history, command, start_run, Stack};
use sortie_wire::records as w;
use sortie_wire::signing::Signer;

const LONG: Duration = Duration::from_secs(90);
const TOKENS: &[&str] = &[
    "acme:svc:logistics:logistics:tok-logistics",
    "acme:user:ann:viewer:tok-ann",
    "globex:svc:logistics:logistics:tok-globex",
];

/// provision (echo) → delivered (waits for `laptop_delivered`: a tracking number, from
/// the logistics role) → welcome (keyed call to the ledger with the tracking number).
fn onboarding(ledger: &str, many: bool) -> String {
    onboarding_with(ledger, many, "")
}

/// [`onboarding`] with extra graph fields (`header`, e.g. `correlation: hire_id`).
fn onboarding_with(ledger: &str, many: bool, header: &str) -> String {
    let wait = if many {
        "{signal: laptop_delivered, many: true, count: 2, roles: [logistics], timeout: 72h, schema: {type: object, required: [tracking], properties: {tracking: {type: string}}}}"
    } else {
        "{signal: laptop_delivered, roles: [logistics], timeout: 72h, schema: {type: object, required: [tracking], properties: {tracking: {type: string}}}}"
    };
    let tracking = if many {
        "$steps.delivered.output.signals"
    } else {
        "$steps.delivered.output.payload.tracking"
    };
    format!(
        r#"
id: hire
version: 1
{header}
nodes:
  - {{id: provision, tool: echo, side_effect: pure, args: {{hire: $input.hire}}}}
  - id: delivered
    wait: {wait}
  - id: welcome
    tool: http
    side_effect: keyed
    args: {{hire: $input.hire, tracking: {tracking}}}
    config: {{url: "{ledger}/effects/welcome"}}
    timeout: 60s
edges:
  - {{from: provision, to: delivered}}
  - {{from: delivered, to: welcome}}
"#
    )
}

/// A `SignalRun` command as the logistics service publishes it.
fn signal(run_id: &str, command_id: &str, signal_id: &str, tracking: &str) -> w::RunCommand {
    let mut command = command(
        run_id,
        command_id,
        w::CommandBody::SignalRun(w::SignalRun {
            name: "laptop_delivered".into(),
            signal_id: Some(signal_id.into()),
            payload: Some(json!({ "tracking": tracking }).to_string()),
        }),
    );
    command.issuer = w::Issuer {
        principal: "svc:logistics".into(),
        roles: vec!["logistics".into()],
        groups: vec![],
    };
    command
}

fn waiting(state: &RunState) -> bool {
    state.status == RunStatus::WaitingSignal
}

/// The welcome calls the ledger took for `hire`, with their bodies.
async fn welcomes(ledger: &sortie_tests::stack::LedgerProcess, hire: &str) -> Vec<Value> {
    ledger
        .snapshot()
        .await
        .calls
        .iter()
        .filter(|c| c.name == "welcome" && c.body["hire"] == hire)
        .map(|c| c.body.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_survives_a_deploy_and_takes_each_signal_once() {
    let stack = Stack::start("signals-deploy", &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    stack.publish(&onboarding(&ledger.url, false)).await;
    let mut reducer = stack.reducer("0");
    let mut executor = stack.executor_process("executor", &["default"], &[]);
    let (_gateway, url) = stack
        .gateway_process(&stack.dir.join("gateway"), TOKENS)
        .await;
    let api = Api::new(&url);

    let started = api
        .start(
            "tok-logistics",
            json!({"graph_id": "hire", "run_id": "hire-ada", "input": {"hire": "ada"}}),
        )
        .await;
    assert_eq!(started["run_id"], "hire-ada");
    let ada = "hire-ada".to_owned();
    stack
        .wait_for_states(
            "ada waits for her laptop",
            std::slice::from_ref(&ada),
            LONG,
            waiting,
        )
        .await;

    // A deploy mid-wait: both die; while they are down, Bob's run starts and his laptop's
    // signal arrives before his run has reached the wait.
    reducer.kill();
    executor.kill();
    let bob = "hire-bob".to_owned();
    stack
        .send(&start_run(&bob, "hire", r#"{"hire": "bob"}"#))
        .await;
    stack
        .send(&signal(&bob, "sig-cmd-bob", "dlv-bob", "1Z-BOB"))
        .await;
    let _reducer = stack.reducer("0");
    let kept = stack
        .wait_for_states(
            "bob's signal is kept",
            std::slice::from_ref(&bob),
            LONG,
            |s| !s.early_signals.is_empty(),
        )
        .await;
    assert!(kept[&bob].waits.is_empty(), "kept before any wait opened");
    let _executor = stack.executor_process("executor", &["default"], &[]);

    // Ada's signal over HTTP: refused by the schema first, then taken.
    let path = format!("/v1/runs/{ada}/signals/laptop_delivered");
    let (status, refused) = api
        .post(&path, "tok-logistics", json!({"payload": {"tracking": 7}}))
        .await;
    assert_eq!(
        (status, code(&refused)),
        (422, "invalid_payload"),
        "{refused}"
    );
    let (status, refused) = api
        .post(&path, "tok-ann", json!({"payload": {"tracking": "1Z-ADA"}}))
        .await;
    assert_eq!((status, code(&refused)), (403, "forbidden"), "{refused}");
    let send_ada = |key: &'static str| {
        api.request("POST", &path, Some("tok-logistics"))
            .header("Idempotency-Key", key)
            .json(&json!({"payload": {"tracking": "1Z-ADA"}, "signal_id": "dlv-ada"}))
    };
    let (status, taken) = api.send(send_ada("ada-laptop")).await;
    assert_eq!(status, 200, "{taken}");
    assert_eq!(taken["signal"], "taken", "{taken}");
    assert_eq!(taken["signal_id"], "dlv-ada", "{taken}");

    let runs = [ada.clone(), bob.clone()];
    stack
        .wait_for_states("both hires are welcomed", &runs, LONG, |s| {
            s.status == RunStatus::Succeeded
        })
        .await;

    // The same request again (its Idempotency-Key): the same answer, nothing applied.
    let (status, again) = api.send(send_ada("ada-laptop")).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(
        (&again["duplicate"], &again["signal"]),
        (&json!(true), &json!("duplicate"))
    );
    // The same delivery under a new key, after the run ended: still "taken before".
    let (status, late) = api.send(send_ada("ada-laptop-2")).await;
    assert_eq!(
        (status, &late["signal"]),
        (200, &json!("duplicate")),
        "{late}"
    );
    // Another delivery after the end: refused, nothing applied.
    let (status, other) = api
        .post(
            &path,
            "tok-logistics",
            json!({"payload": {"tracking": "2Z-ADA"}, "signal_id": "dlv-ada-2"}),
        )
        .await;
    assert_eq!((status, code(&other)), (409, "bad_state"), "{other}");

    let states = stack
        .wait_for_states("the answers are folded", &runs, LONG, |s| {
            (s.commands.contains_key("ada-laptop-2") && !s.rejected.is_empty())
                || s.run_id != "hire-ada"
        })
        .await;
    let events = stack.events().await;
    for (run, tracking) in [(&ada, "1Z-ADA"), (&bob, "1Z-BOB")] {
        let state = &states[run];
        check_history(run, &events[run], state);
        let received: Vec<_> = events[run]
            .iter()
            .filter(|e| matches!(e.body, EventBody::SignalReceived { .. }))
            .collect();
        assert_eq!(received.len(), 1, "{run}: one signal taken");
        let wait = state.waits.values().next().expect("a wait");
        assert_eq!(wait.status, WaitStatus::Done);
        assert_eq!(wait.received[0].payload["tracking"], tracking);
        let hire = state.input["hire"].as_str().expect("hire").to_owned();
        let calls = welcomes(&ledger, &hire).await;
        assert_eq!(calls.len(), 1, "{run}: one welcome call: {calls:?}");
        assert_eq!(calls[0]["tracking"], tracking, "{run}");
    }
    assert!(
        events[&bob]
            .iter()
            .any(|e| matches!(e.body, EventBody::SignalBuffered { .. })),
        "bob's signal was kept before his wait opened"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_resent_after_the_reducer_died_mid_commit_is_taken_once() {
    let stack = Stack::start("signals-crash", &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    stack.publish(&onboarding(&ledger.url, true)).await;
    let mut reducer = stack.reducer("0");
    let _executor = stack.executor_process("executor", &["default"], &[]);
    let run = "hire-cy".to_owned();
    stack
        .send(&start_run(&run, "hire", r#"{"hire": "cy"}"#))
        .await;
    stack
        .wait_for_states("cy waits", std::slice::from_ref(&run), LONG, waiting)
        .await;

    // The next commit is the signal's: the reducer dies before it.
    reducer.kill();
    let mut dying = stack.reducer_with("0", &["--fault", "reducer.before_commit"]);
    stack.send(&signal(&run, "sig-1", "dlv-1", "1Z-ONE")).await;
    let status = dying.wait_exit(LONG).await;
    assert!(
        status.is_some() && dying.died_at_fault(),
        "the reducer died at reducer.before_commit ({status:?})"
    );
    // Unanswered, the sender sends the same delivery again under a new command id.
    stack
        .send(&signal(&run, "sig-1-retry", "dlv-1", "1Z-ONE"))
        .await;
    let _reducer = stack.reducer("0");
    let answered = stack
        .wait_for_states(
            "both commands answered",
            std::slice::from_ref(&run),
            LONG,
            |s| s.commands.contains_key("sig-1") && s.commands.contains_key("sig-1-retry"),
        )
        .await;
    let state = &answered[&run];
    assert_eq!(state.status, RunStatus::WaitingSignal, "one of two taken");
    let wait = state.waits.values().next().expect("a wait");
    assert_eq!(wait.received.len(), 1, "taken once: {:?}", wait.received);

    stack.send(&signal(&run, "sig-2", "dlv-2", "1Z-TWO")).await;
    let states = stack
        .wait_for_states("cy is welcomed", std::slice::from_ref(&run), LONG, |s| {
            s.status == RunStatus::Succeeded
        })
        .await;
    let events = stack.events().await;
    check_history(&run, &events[&run], &states[&run]);
    let calls = welcomes(&ledger, "cy").await;
    assert_eq!(calls.len(), 1, "one welcome call: {calls:?}");
    let ids: Vec<&str> = calls[0]["tracking"]
        .as_array()
        .expect("the list")
        .iter()
        .filter_map(|s| s["signal_id"].as_str())
        .collect();
    assert_eq!(ids, ["dlv-1", "dlv-2"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_is_addressed_by_its_correlation_label() {
    let stack = Stack::start("signals-correlated", &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    stack
        .publish(&onboarding_with(&ledger.url, false, "correlation: hire_id"))
        .await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor_process("executor", &["default"], &[]);
    let (_gateway, url) = stack
        .gateway_process(&stack.dir.join("gateway"), TOKENS)
        .await;
    let api = Api::new(&url);
    let signal = |hire: &str| json!({"graph_id": "hire", "correlation": hire, "payload": {"tracking": format!("1Z-{hire}")}});

    // Before the run exists: answered, not kept.
    let (status, early) = api
        .post(
            "/v1/signals/laptop_delivered",
            "tok-logistics",
            signal("h-7"),
        )
        .await;
    assert_eq!((status, code(&early)), (404, "unknown_run"), "{early}");

    let started = api
        .start(
            "tok-logistics",
            json!({"graph_id": "hire", "input": {"hire": "h-7"}, "labels": {"hire_id": "h-7"}}),
        )
        .await;
    let run_id = started["run_id"].as_str().expect("run_id").to_owned();
    assert_eq!(
        run_id,
        sortie_core::ids::correlated_run_id("acme", "hire", "hire_id", "h-7")
    );
    // A second onboarding of the same hire is the same run (or a conflict): never two.
    let (status, twice) = api
        .post(
            "/v1/runs",
            "tok-logistics",
            json!({"graph_id": "hire", "input": {"hire": "someone else"}, "labels": {"hire_id": "h-7"}}),
        )
        .await;
    assert_eq!((status, code(&twice)), (409, "conflict"), "{twice}");
    stack
        .wait_for_states("h-7 waits", std::slice::from_ref(&run_id), LONG, waiting)
        .await;

    // Another tenant naming the same hire computes another run: ours is not reached.
    let (status, foreign) = api
        .post("/v1/signals/laptop_delivered", "tok-globex", signal("h-7"))
        .await;
    assert_eq!((status, code(&foreign)), (404, "unknown_run"), "{foreign}");

    let (status, taken) = api
        .post(
            "/v1/signals/laptop_delivered",
            "tok-logistics",
            signal("h-7"),
        )
        .await;
    assert_eq!(status, 200, "{taken}");
    assert_eq!(
        (&taken["signal"], &taken["run_id"]),
        (&json!("taken"), &json!(run_id))
    );
    stack
        .wait_for_states(
            "h-7 is welcomed",
            std::slice::from_ref(&run_id),
            LONG,
            |s| s.status == RunStatus::Succeeded,
        )
        .await;
    let calls = welcomes(&ledger, "h-7").await;
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["tracking"], "1Z-h-7");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_signed_signals_are_taken_where_signatures_are_required() {
    let stack = Stack::start("signals-signed", &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    stack.publish(&onboarding(&ledger.url, false)).await;
    let service = Signer::generate("svc-test").expect("key");
    let logistics = Signer::generate("svc-logistics").expect("key");
    let narrow = Signer::generate("svc-logistics-viewer").expect("key");
    let acme = ["acme".to_owned()];
    let keyring = stack.write_keyring(&[
        service.entry(
            "svc:test",
            &acme,
            &["approver".into(), "operator".into()],
            false,
        ),
        logistics.entry("svc:logistics", &acme, &["logistics".into()], false),
        narrow.entry("svc:logistics", &acme, &["viewer".into()], false),
    ]);
    let keyring = keyring.to_str().expect("path");
    let _reducer = stack.reducer_with("0", &["--keyring", keyring, "--require-signatures"]);
    let _executor = stack.executor_process("executor", &["default"], &[]);
    let run = "hire-di".to_owned();
    stack
        .send_signed(&start_run(&run, "hire", r#"{"hire": "di"}"#), &service)
        .await;
    stack
        .wait_for_states("di waits", std::slice::from_ref(&run), LONG, waiting)
        .await;

    stack.send(&signal(&run, "forged", "dlv-x", "1Z-X")).await;
    stack
        .send_signed(&signal(&run, "too-much", "dlv-y", "1Z-Y"), &narrow)
        .await;
    stack
        .send_signed(&signal(&run, "real", "dlv-di", "1Z-DI"), &logistics)
        .await;
    let states = stack
        .wait_for_states("di is welcomed", std::slice::from_ref(&run), LONG, |s| {
            s.status == RunStatus::Succeeded
        })
        .await;
    let events = stack.events().await;
    for refused in ["forged", "too-much"] {
        let answer = events[&run]
            .iter()
            .find(|e| e.command_id.as_deref() == Some(refused))
            .unwrap_or_else(|| panic!("{refused} is answered"));
        match &answer.body {
            EventBody::CommandRejected { code, .. } => {
                assert_eq!(code, "unauthenticated", "{refused}");
                assert_eq!(answer.seq, 0, "{refused} is answered outside the history");
            }
            other => panic!("{refused}: {other:?}"),
        }
    }
    let wait = states[&run].waits.values().next().expect("a wait");
    assert_eq!(wait.received.len(), 1);
    assert_eq!(wait.received[0].signal_id, "dlv-di");
    let calls = welcomes(&ledger, "di").await;
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["tracking"], "1Z-DI");
}
