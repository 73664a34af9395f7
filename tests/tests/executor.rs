//! The executor as its own process against the real broker, with the reducer and the
//! ledger as their own processes too. Every assertion about side effects is made on the
//! ledger, not on what the run says about itself.
//!
//! The crash matrix (SPEC §10): the executor dies (abort, like SIGKILL) at a fault point,
//! is restarted without it, and the outcome per side-effect class is checked:
//! exactly one effect for `keyed` / `idempotent` / `reconcilable`; at most one for
//! `unsafe`, with the run in `needs_reconciliation` until an operator's
//! `ReconcileOperation` moves it on.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use sortie_core::{EventBody, RunState, RunStatus};
use sortie_tests::stack::{command, start_run, LedgerProcess, Process, Stack};
use sortie_wire::records as w;

const LONG: Duration = Duration::from_secs(60);

/// One `http` node of the given class calling the ledger, then an `echo` that reads its
/// output. Crash tests use a 2 s timeout so the reducer notices a lost attempt quickly.
fn pay_graph_with_timeout(id: &str, class: &str, ledger: &str, timeout: &str) -> String {
    pay_graph_configured(id, class, ledger, timeout, "")
}

/// `extra` is appended inside the `pay` node's config map (e.g. `, lookup_authoritative: true`).
fn pay_graph_configured(id: &str, class: &str, ledger: &str, timeout: &str, extra: &str) -> String {
    format!(
        r#"
id: {id}
version: 1
nodes:
  - id: pay
    tool: http
    side_effect: {class}
    args: {{amount: $input.amount}}
    config: {{url: "{ledger}/effects/pay", status_url: "{ledger}/status"{extra}}}
    timeout: {timeout}
    retry: {{max_attempts: 4, initial_backoff: 200ms, max_backoff: 1s, multiplier: 2.0, jitter: 0.1}}
  - {{id: receipt, tool: echo, side_effect: pure, args: {{seq: $steps.pay.output.ledger_seq}}}}
edges:
  - {{from: pay, to: receipt}}
"#
    )
}

fn status_is(status: RunStatus) -> impl Fn(&RunState) -> bool {
    move |s| s.status == status
}

/// Ledger, graph, reducer and an executor dying at `fault`; one run started.
struct Crash {
    stack: Stack,
    ledger: LedgerProcess,
    _reducer: Process,
    executor: Process,
    run: String,
}

impl Crash {
    async fn start(name: &str, class: &str, mode: &str, fault: &str) -> Crash {
        Crash::start_configured(name, class, mode, fault, "").await
    }

    /// [`Crash::start`] with `extra` in the `pay` node's config ([`pay_graph_configured`]).
    async fn start_configured(
        name: &str,
        class: &str,
        mode: &str,
        fault: &str,
        extra: &str,
    ) -> Crash {
        let stack = Stack::start(name, &[]).await;
        let ledger = stack.ledger_process("ledger", mode).await;
        stack
            .publish(&pay_graph_configured(
                "pay",
                class,
                &ledger.url,
                "2s",
                extra,
            ))
            .await;
        let reducer = stack.reducer("0");
        let executor = stack.executor_process(
            "executor",
            &["default"],
            &["--static-membership", "--fault", fault],
        );
        // The run starts once the executor serves the queue: an intent that reached it
        // only after the step's 2 s timeout would not be called (it is late), and the
        // fault point would never be reached.
        sortie_tests::wait_until("the executor to be assigned the queue", LONG, || {
            let assigned = executor.log_text().contains("Partitions assigned");
            async move { assigned }
        })
        .await;
        let run = format!("run-{class}");
        stack
            .send(&start_run(&run, "pay", r#"{"amount": 42}"#))
            .await;
        Crash {
            stack,
            ledger,
            _reducer: reducer,
            executor,
            run,
        }
    }

    /// Waits for the executor to die at its fault point; returns the ledger's calls of
    /// the run's `pay` operation at that moment.
    async fn wait_for_the_crash(&mut self) -> usize {
        let executor = &mut self.executor;
        sortie_tests::wait_until("the executor to die at its fault point", LONG, || {
            let exited = executor.try_exit().is_some();
            async move { exited }
        })
        .await;
        assert!(
            self.executor.log_text().contains("Fault injection"),
            "the executor died at its fault point:\n{}",
            self.executor.log_text()
        );
        let op = self.operation_id().await;
        self.ledger.snapshot().await.calls(&op)
    }

    fn restart_executor(&mut self) {
        self.executor =
            self.stack
                .executor_process("executor", &["default"], &["--static-membership"]);
    }

    async fn operation_id(&self) -> String {
        let run = self.run.clone();
        sortie_tests::wait_for("the pay step to be dispatched", LONG, || async {
            let states = self.stack.states().await;
            states
                .get(&run)
                .and_then(|s| s.steps.get("pay#1"))
                .map(|s| s.operation_id.clone())
        })
        .await
    }

    async fn wait_for(&self, what: &str, done: impl Fn(&RunState) -> bool) -> RunState {
        let mut states = self
            .stack
            .wait_for_states(what, std::slice::from_ref(&self.run), LONG, done)
            .await;
        states.remove(&self.run).expect("the run's state")
    }
}

/// keyed / idempotent: the intent was not committed, so the restarted executor gets it
/// again (or the reducer's timeout dispatches attempt 2) and calls with the same key; the
/// receiver absorbs the repeat.
async fn redelivered_once(name: &str, class: &str, mode: &str) {
    let mut crash = Crash::start(name, class, mode, "executor.after_call").await;
    assert_eq!(
        crash.wait_for_the_crash().await,
        1,
        "the receiver committed"
    );
    crash.restart_executor();
    let state = crash
        .wait_for("the run to succeed", status_is(RunStatus::Succeeded))
        .await;
    let op = state.steps["pay#1"].operation_id.clone();
    let ledger = crash.ledger.snapshot().await;
    assert_eq!(ledger.effects(&op), 1, "exactly one effect: {ledger:#?}");
    assert!(
        ledger.calls(&op) >= 2,
        "the repeat reached the receiver with the same key: {ledger:#?}"
    );
    assert!(
        ledger
            .calls
            .iter()
            .all(|c| c.operation_id.as_deref() == Some(op.as_str())),
        "every call carried the operation id as its key"
    );
    assert_eq!(
        state.steps["receipt#1"].args["seq"], ledger.calls[0].answer["ledger_seq"],
        "the run recorded the receiver's first answer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_killed_after_the_receiver_committed_has_one_effect() {
    redelivered_once("exec-crash-keyed", "keyed", "keyed").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_killed_after_the_receiver_committed_has_one_effect() {
    redelivered_once("exec-crash-idem", "idempotent", "idempotent").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_killed_before_the_call_is_redelivered_and_has_one_effect() {
    let mut crash = Crash::start(
        "exec-crash-before",
        "keyed",
        "keyed",
        "executor.before_call",
    )
    .await;
    assert_eq!(crash.wait_for_the_crash().await, 0, "nothing was called");
    crash.restart_executor();
    let state = crash
        .wait_for("the run to succeed", status_is(RunStatus::Succeeded))
        .await;
    let op = &state.steps["pay#1"].operation_id;
    let ledger = crash.ledger.snapshot().await;
    assert_eq!(ledger.effects(op), 1, "{ledger:#?}");
    assert!(
        ledger
            .calls
            .iter()
            .all(|c| c.operation_id.as_deref() == Some(op.as_str())),
        "the redelivered intent (and any re-dispatched attempt) used the same key"
    );
}

/// reconcilable: STARTED and the offset commit came before the call, so the intent is
/// not redelivered; the reducer's timeout dispatches attempt 2, whose executor asks the
/// receiver first and records the real outcome without calling again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcilable_killed_after_the_receiver_committed_is_looked_up_not_called_again() {
    let mut crash = Crash::start(
        "exec-crash-recon",
        "reconcilable",
        "reconcilable",
        "executor.after_call",
    )
    .await;
    assert_eq!(crash.wait_for_the_crash().await, 1);
    crash.restart_executor();
    let state = crash
        .wait_for("the run to succeed", status_is(RunStatus::Succeeded))
        .await;
    let pay = &state.steps["pay#1"];
    let ledger = crash.ledger.snapshot().await;
    assert_eq!(
        (
            ledger.effects(&pay.operation_id),
            ledger.calls(&pay.operation_id)
        ),
        (1, 1),
        "one effect and no second call: {ledger:#?}"
    );
    // The lost attempt is re-dispatched (attempt 2). If the restarted executor takes
    // longer than the 2 s step timeout to join, attempt 2 times out too and attempt 3
    // follows: how many depends on the machine, not the contract. What the contract
    // says is above and below: one call, one effect, the real outcome looked up.
    assert!(
        pay.attempt >= 2,
        "the lost attempt was re-dispatched and answered by a lookup (attempt {})",
        pay.attempt
    );
    assert_eq!(pay.output.as_ref(), Some(&ledger.calls[0].answer));
    let events = crash.stack.events().await;
    assert!(
        events[&crash.run]
            .iter()
            .any(|e| matches!(&e.body, EventBody::StepStarted { attempt: 1, .. })),
        "STARTED was recorded before the call"
    );
}

/// reconcilable, outcome lost, and the receiver's lookup answers 404 for a call it did
/// take (it lost its record, or its lookup lags): "not found" is not "never happened"
/// (seed 001). Without `lookup_authoritative` the run waits for an operator, like an
/// unsafe step whose outcome is unknown, and the receiver was called exactly once.
///
/// Red/green: with the check reverted (`settle` taking not found as "call", as before),
/// this test failed: the later attempt called the receiver again and the run never
/// reached `needs_reconciliation` (the wait timed out). Restored, it passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcilable_lookup_not_found_is_not_never_happened() {
    let mut crash = Crash::start(
        "exec-recon-forgot",
        "reconcilable",
        "reconcilable",
        "executor.after_call",
    )
    .await;
    assert_eq!(crash.wait_for_the_crash().await, 1);
    // Every lookup from now on denies the call the ledger recorded.
    crash
        .ledger
        .fault(json!({"forget": true, "times": 1000}))
        .await;
    crash.restart_executor();
    let state = crash
        .wait_for(
            "the run to need reconciliation",
            status_is(RunStatus::NeedsReconciliation),
        )
        .await;
    let pay = &state.steps["pay#1"];
    assert!(
        pay.attempt >= 2,
        "a later attempt asked (attempt {})",
        pay.attempt
    );
    let ledger = crash.ledger.snapshot().await;
    assert_eq!(
        (
            ledger.effects(&pay.operation_id),
            ledger.calls(&pay.operation_id)
        ),
        (1, 1),
        "called exactly once: {ledger:#?}"
    );
    let events = crash.stack.events().await;
    assert!(
        events[&crash.run].iter().any(|e| matches!(
            &e.body,
            EventBody::StepOutcomeUnknown { message, needs_operator: true, .. }
                if message.contains("lookup_authoritative")
        )),
        "the lookup's 404 left the outcome unknown for an operator"
    );
}

/// The same lost outcome and 404, but the node declares its lookup authoritative: not
/// found means never happened, so the later attempt calls again and the run succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcilable_authoritative_lookup_not_found_calls_again() {
    let mut crash = Crash::start_configured(
        "exec-recon-authoritative",
        "reconcilable",
        "reconcilable",
        "executor.after_call",
        ", lookup_authoritative: true",
    )
    .await;
    assert_eq!(crash.wait_for_the_crash().await, 1);
    crash
        .ledger
        // Only the first lookup denies the call: if the restart is slow and attempts time
        // out, later ones find the second call's record instead of calling a third time.
        .fault(json!({"forget": true, "times": 1}))
        .await;
    crash.restart_executor();
    let state = crash
        .wait_for("the run to succeed", status_is(RunStatus::Succeeded))
        .await;
    let pay = &state.steps["pay#1"];
    assert!(pay.attempt >= 2, "attempt {}", pay.attempt);
    let ledger = crash.ledger.snapshot().await;
    assert_eq!(
        ledger.calls(&pay.operation_id),
        2,
        "the authoritative 404 let the later attempt call again: {ledger:#?}"
    );
    assert!(
        ledger
            .calls
            .iter()
            .any(|c| Some(&c.answer) == pay.output.as_ref()),
        "the recorded output is the receiver's answer: {ledger:#?}"
    );
}

/// unsafe: never retried; the run waits for an operator, the ledger has at most one
/// effect, and ReconcileOperation moves the run on without a second call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsafe_killed_after_the_call_waits_for_an_operator() {
    let mut crash = Crash::start(
        "exec-crash-unsafe",
        "unsafe",
        "plain",
        "executor.after_call",
    )
    .await;
    assert_eq!(crash.wait_for_the_crash().await, 1);
    crash.restart_executor();
    let state = crash
        .wait_for(
            "the run to need reconciliation",
            status_is(RunStatus::NeedsReconciliation),
        )
        .await;
    let op = state.steps["pay#1"].operation_id.clone();
    assert_eq!(
        state.steps["pay#1"].attempt, 1,
        "unsafe is never re-dispatched"
    );
    let ledger = crash.ledger.snapshot().await;
    assert!(ledger.effects(&op) <= 1, "{ledger:#?}");

    // The operator looks at the receiver and records what happened.
    let answer = ledger.calls[0].answer.clone();
    crash
        .stack
        .send(&command(
            &crash.run,
            "reconcile-1",
            w::CommandBody::ReconcileOperation(w::ReconcileOperation {
                operation_id: op.clone(),
                outcome: w::ReconcileOutcome::Succeeded,
                output: Some(answer.to_string()),
                error: None,
            }),
        ))
        .await;
    let state = crash
        .wait_for("the run to succeed", status_is(RunStatus::Succeeded))
        .await;
    assert_eq!(state.steps["receipt#1"].args["seq"], answer["ledger_seq"]);
    let ledger = crash.ledger.snapshot().await;
    assert_eq!(
        (ledger.effects(&op), ledger.calls(&op)),
        (1, 1),
        "{ledger:#?}"
    );
}

/// unsafe, killed after STARTED and the commit but before the call: no effect; the
/// operator says it failed, so the retry policy dispatches attempt 2, which calls once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsafe_killed_before_the_call_is_retried_after_the_operator_says_it_failed() {
    let mut crash = Crash::start(
        "exec-crash-unsafe-before",
        "unsafe",
        "plain",
        "executor.before_call",
    )
    .await;
    assert_eq!(crash.wait_for_the_crash().await, 0);
    crash.restart_executor();
    let state = crash
        .wait_for(
            "the run to need reconciliation",
            status_is(RunStatus::NeedsReconciliation),
        )
        .await;
    let op = state.steps["pay#1"].operation_id.clone();
    assert_eq!(
        crash.ledger.snapshot().await.calls(&op),
        0,
        "not redelivered"
    );
    crash
        .stack
        .send(&command(
            &crash.run,
            "reconcile-1",
            w::CommandBody::ReconcileOperation(w::ReconcileOperation {
                operation_id: op.clone(),
                outcome: w::ReconcileOutcome::Failed,
                output: None,
                error: Some("the receiver never saw it".into()),
            }),
        ))
        .await;
    let state = crash
        .wait_for("the run to succeed", status_is(RunStatus::Succeeded))
        .await;
    assert_eq!(state.steps["pay#1"].attempt, 2);
    let ledger = crash.ledger.snapshot().await;
    assert_eq!(
        (ledger.effects(&op), ledger.calls(&op)),
        (1, 1),
        "{ledger:#?}"
    );
}

/// Every class on the happy path, with receiver faults the executor must tell apart: a
/// 429 and a 500 are retryable failures (the reducer retries after its backoff), a
/// connection dropped after the receiver committed is an unknown outcome (keyed: retried
/// with the same key, absorbed by the receiver). Guarded classes record STARTED and call
/// exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_class_completes_and_receiver_faults_are_classified() {
    let stack = Stack::start("exec-classes", &[]).await;
    let keyed = stack.ledger_process("keyed", "keyed").await;
    let recon = stack.ledger_process("recon", "reconcilable").await;
    let graph = format!(
        r#"
id: classes
version: 1
nodes:
  - {{id: think, tool: echo, side_effect: pure, args: {{q: $input.q}}}}
  - id: reserve
    tool: http
    side_effect: keyed
    args: {{q: $steps.think.output.q}}
    config: {{url: "{k}/effects/reserve"}}
    timeout: 5s
    retry: {{max_attempts: 5, initial_backoff: 100ms, max_backoff: 500ms, multiplier: 2.0, jitter: 0.1}}
  - id: book
    tool: http
    side_effect: reconcilable
    args: {{q: $input.q}}
    config: {{url: "{r}/effects/book", status_url: "{r}/status"}}
    timeout: 5s
  - id: notify
    tool: http
    side_effect: unsafe
    args: {{q: $input.q}}
    config: {{url: "{r}/effects/notify"}}
    timeout: 5s
  - {{id: nap, tool: sleep, side_effect: pure, args: {{ms: 10}}}}
edges:
  - {{from: think, to: reserve}}
  - {{from: reserve, to: book}}
  - {{from: book, to: notify}}
  - {{from: notify, to: nap}}
"#,
        k = keyed.url,
        r = recon.url
    );
    stack.publish(&graph).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor_process("executor", &["default"], &[]);

    // run-0's `reserve` meets a 429, then a 500, then a drop after the commit.
    keyed.fault(json!({"status": 429})).await;
    keyed.fault(json!({"status": 500})).await;
    keyed.fault(json!({"drop_after_commit": true})).await;
    stack
        .send(&start_run("run-0", "classes", r#"{"q": 0}"#))
        .await;
    let runs = ["run-0".to_owned()];
    let state = stack
        .wait_for_states(
            "run-0 to succeed",
            &runs,
            LONG,
            status_is(RunStatus::Succeeded),
        )
        .await;
    let run0 = &state["run-0"];
    let reserve = &run0.steps["reserve#1"];
    assert_eq!(
        reserve.attempt, 4,
        "429, 500, dropped, then the receiver's stored answer"
    );
    assert_eq!(run0.steps["nap#1"].output, Some(json!({"slept_ms": 10})));
    let ledger = keyed.snapshot().await;
    assert_eq!(
        (
            ledger.effects(&reserve.operation_id),
            ledger.calls(&reserve.operation_id)
        ),
        (1, 2),
        "the dropped call took effect; its retry was absorbed: {ledger:#?}"
    );
    assert_eq!(reserve.output.as_ref(), Some(&ledger.calls[0].answer));
    let events = stack.events().await;
    let reserve_events: Vec<String> = events["run-0"]
        .iter()
        .filter_map(|e| match &e.body {
            EventBody::StepFailed {
                step_id,
                code,
                retryable: true,
                ..
            } if step_id == "reserve#1" => Some(code.clone()),
            EventBody::StepOutcomeUnknown {
                step_id,
                needs_operator: false,
                ..
            } if step_id == "reserve#1" => Some("unknown".to_owned()),
            _ => None,
        })
        .collect();
    assert_eq!(reserve_events, ["rate_limited", "server_error", "unknown"]);

    // More runs at once, no faults: each guarded step is STARTED, then called once.
    let runs: Vec<String> = (1..=4).map(|i| format!("run-{i}")).collect();
    for (i, run) in runs.iter().enumerate() {
        stack
            .send(&start_run(
                run,
                "classes",
                &format!(r#"{{"q": {}}}"#, i + 1),
            ))
            .await;
    }
    let states = stack
        .wait_for_states(
            "every run to succeed",
            &runs,
            LONG,
            status_is(RunStatus::Succeeded),
        )
        .await;
    let events = stack.events().await;
    let recon_ledger = recon.snapshot().await;
    let keyed_ledger = keyed.snapshot().await;
    for run in &runs {
        let steps = &states[run].steps;
        let op = &steps["reserve#1"].operation_id;
        assert_eq!(keyed_ledger.effects(op), 1, "{run} reserve");
        for step in ["book#1", "notify#1"] {
            let op = &steps[step].operation_id;
            assert_eq!(
                (recon_ledger.effects(op), recon_ledger.calls(op)),
                (1, 1),
                "{run} {step}"
            );
            assert!(
                events[run].iter().any(|e| matches!(
                    &e.body,
                    EventBody::StepStarted { step_id, .. } if step_id == step
                )),
                "{run} {step}: STARTED recorded"
            );
        }
    }
}

/// Bad intents: an undecodable record is dead-lettered and the partition keeps moving;
/// an unknown tool fails the step permanently (`unknown_tool`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_intents_are_dead_lettered_and_unknown_tools_fail_the_step() {
    let graph = r#"
id: odd
version: 1
nodes:
  - {id: first, tool: echo, side_effect: pure, args: {x: 1}}
  - {id: mystery, tool: teleport, side_effect: keyed}
edges:
  - {from: first, to: mystery}
"#;
    let stack = Stack::start("exec-bad", &[graph]).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor_process("executor", &["default"], &[]);
    stack
        .send_raw(
            &stack.topics.intents("default"),
            Some(0),
            b"junk-key",
            b"not avro",
        )
        .await;
    stack.send(&start_run("run-odd", "odd", "{}")).await;
    let states = stack
        .wait_for_states(
            "the run to fail",
            &["run-odd".to_owned()],
            LONG,
            status_is(RunStatus::Failed),
        )
        .await;
    let mystery = &states["run-odd"].steps["mystery#1"];
    assert_eq!(mystery.attempt, 1, "a permanent failure is not retried");
    assert!(
        mystery
            .error
            .as_deref()
            .unwrap_or_default()
            .contains("unknown_tool"),
        "{mystery:?}"
    );
    let letters = sortie_tests::wait_for("the dead letter", LONG, || async {
        let letters = stack.dead_letters().await;
        (!letters.is_empty()).then_some(letters)
    })
    .await;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].reason_code, "undecodable");
    assert_eq!(letters[0].original_key.as_deref(), Some(&b"junk-key"[..]));
    assert!(letters[0].service.starts_with("executor/"));
}

/// A graph naming an address the executor refuses (the cloud metadata address, a private
/// one) fails its step for good, `egress_forbidden` naming the rule, on its first
/// attempt and before anything is sent: the harness's executor allows loopback only
/// (`--egress-allow 127.0.0.0/8`), as `sortie dev`'s does. Seen red with the executor's
/// literal check skipped: the request went out (this machine's network answered the
/// metadata address 403, so the step failed `client_error`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_step_to_a_refused_address_fails_egress_forbidden() {
    let graph = |id: &str, url: &str| {
        format!(
            r#"
id: {id}
version: 1
nodes:
  - id: fetch
    tool: http
    side_effect: keyed
    args: {{x: 1}}
    config: {{url: "{url}"}}
    timeout: 2s
    retry: {{max_attempts: 3, initial_backoff: 100ms, max_backoff: 200ms, multiplier: 2.0, jitter: 0.1}}
edges: []
"#
        )
    };
    let metadata = graph(
        "metadata",
        "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
    );
    let private = graph("private", "http://10.255.255.1:8080/admin");
    let stack = Stack::start("exec-egress", &[&metadata, &private]).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor_process("executor", &["default"], &[]);
    stack
        .send(&start_run("run-metadata", "metadata", "{}"))
        .await;
    stack.send(&start_run("run-private", "private", "{}")).await;
    let runs = ["run-metadata".to_owned(), "run-private".to_owned()];
    let states = stack
        .wait_for_states(
            "both runs to fail",
            &runs,
            LONG,
            status_is(RunStatus::Failed),
        )
        .await;
    for (run, rule) in [
        (
            "run-metadata",
            "169.254.169.254 is a link-local (cloud metadata) address",
        ),
        (
            "run-private",
            "10.255.255.1 is a private address (10.0.0.0/8)",
        ),
    ] {
        let step = &states[run].steps["fetch#1"];
        assert_eq!(step.attempt, 1, "{run}: a permanent failure is not retried");
        let error = step.error.as_deref().unwrap_or_default();
        assert!(error.contains("egress_forbidden"), "{run}: {step:?}");
        assert!(error.contains(rule), "{run}: {error}");
        assert!(error.contains("--egress-allow"), "{run}: {error}");
    }
}

/// SIGTERM while a call is in flight: the executor finishes it and reports before it
/// exits; nothing runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_shutdown_finishes_the_call_in_flight() {
    let stack = Stack::start("exec-drain", &[]).await;
    let ledger = stack.ledger_process("ledger", "plain").await;
    // A timeout long enough that the reducer waits for the slow answer.
    stack
        .publish(&pay_graph_with_timeout("pay", "unsafe", &ledger.url, "30s"))
        .await;
    let _reducer = stack.reducer("0");
    ledger.fault(json!({"delay_ms": 1000})).await;
    let mut executor = stack.executor_process("executor", &["default"], &[]);
    stack
        .send(&start_run("run-drain", "pay", r#"{"amount": 1}"#))
        .await;
    sortie_tests::wait_until("the call to reach the ledger", LONG, || async {
        ledger.snapshot().await.total_effects() == 1
    })
    .await;
    executor.stop();
    // The executor is gone: the next step cannot run, but the call in flight was finished
    // and reported before it exited.
    let states = stack
        .wait_for_states(
            "the pay step to succeed with no executor running",
            &["run-drain".to_owned()],
            LONG,
            |s| {
                s.steps
                    .get("pay#1")
                    .is_some_and(|p| p.status == sortie_core::state::StepStatus::Succeeded)
            },
        )
        .await;
    let pay = &states["run-drain"].steps["pay#1"];
    assert_eq!(pay.attempt, 1);
    assert_eq!(ledger.snapshot().await.calls(&pay.operation_id), 1);
    assert!(
        executor.log_text().contains("Executor stopped."),
        "a clean exit:\n{}",
        executor.log_text()
    );
}

/// Executors joining and leaving while intents are in flight: cooperative rebalances
/// drain what they revoke and commit only finished work, so nothing is lost. The step has
/// no timeout, so a lost intent would leave its run stuck (no re-dispatch would hide it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebalance_loses_no_intent() {
    let stack = Stack::start("exec-rebalance", &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    let graph = format!(
        r#"
id: steady
version: 1
nodes:
  - {{id: pay, tool: http, side_effect: keyed, args: {{n: $input.n}}, config: {{url: "{}/effects/pay"}}}}
  - {{id: receipt, tool: echo, side_effect: pure, args: {{seq: $steps.pay.output.ledger_seq}}}}
edges:
  - {{from: pay, to: receipt}}
"#,
        ledger.url
    );
    stack.publish(&graph).await;
    let _reducer = stack.reducer("0");
    ledger.fault(json!({"delay_ms": 200, "times": 1000})).await;
    let slow = ["--max-in-flight", "1"];
    let mut first = stack.executor_process("executor-a", &["default"], &slow);
    let runs: Vec<String> = (0..40).map(|i| format!("run-{i}")).collect();
    for (i, run) in runs.iter().enumerate() {
        stack
            .send(&start_run(run, "steady", &format!(r#"{{"n": {i}}}"#)))
            .await;
    }
    sortie_tests::wait_until("the first effects", LONG, || async {
        ledger.snapshot().await.total_effects() >= 3
    })
    .await;
    // A second executor joins: the first gives up some partitions mid-stream.
    let second = stack.executor_process("executor-b", &["default"], &slow);
    sortie_tests::wait_until("the second executor to get partitions", LONG, || {
        let (a, b) = (first.log_text(), second.log_text());
        async move { b.contains("Partitions assigned") && a.contains("Partitions revoked") }
    })
    .await;
    let done_before_leaving = ledger.snapshot().await.total_effects();
    assert!(
        done_before_leaving < runs.len(),
        "the rebalance happened with work left ({done_before_leaving} done)"
    );
    // Then the first one leaves (SIGTERM): its partitions move to the second.
    first.stop();
    let states = stack
        .wait_for_states(
            "every run to succeed",
            &runs,
            LONG,
            status_is(RunStatus::Succeeded),
        )
        .await;
    let ledger = ledger.snapshot().await;
    for run in &runs {
        let pay = &states[run].steps["pay#1"];
        assert_eq!(pay.attempt, 1, "{run}");
        assert_eq!(ledger.effects(&pay.operation_id), 1, "{run}");
    }
    assert_eq!(ledger.total_effects(), runs.len());
}

/// A fake OpenAI-compatible model server that counts its requests: plain HTTP/1.1 on
/// tokio sockets (one request per connection), answering every `POST
/// /v1/chat/completions` with a tool call and token usage.
async fn fake_model() -> (String, Arc<AtomicUsize>, Arc<Mutex<Vec<Value>>>) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    let count = Arc::new(AtomicUsize::new(0));
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let (count2, bodies2) = (count.clone(), bodies.clone());
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let (count, bodies) = (count2.clone(), bodies2.clone());
            tokio::spawn(async move {
                let mut buffer = Vec::new();
                let mut chunk = [0u8; 4096];
                let (head, body) = loop {
                    let Ok(n) = socket.read(&mut chunk).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    buffer.extend_from_slice(&chunk[..n]);
                    let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") else {
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buffer[..end]).to_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    if buffer.len() >= end + 4 + length {
                        break (head, buffer[end + 4..end + 4 + length].to_vec());
                    }
                };
                let answer = if head.starts_with("post /v1/chat/completions ") {
                    count.fetch_add(1, Ordering::SeqCst);
                    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                    bodies.lock().expect("bodies").push(body.clone());
                    json!({
                        "id": "chatcmpl-1",
                        "object": "chat.completion",
                        "model": body["model"],
                        "choices": [{
                            "index": 0,
                            "message": {
                                "role": "assistant",
                                "content": "Refund approved.",
                                "tool_calls": [{"id": "call_1", "type": "function",
                                                "function": {"name": "refund", "arguments": "{\"amount\":30}"}}]
                            },
                            "finish_reason": "tool_calls"
                        }],
                        "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}
                    })
                    .to_string()
                } else {
                    String::new()
                };
                let status = if answer.is_empty() {
                    "404 Not Found"
                } else {
                    "200 OK"
                };
                let response = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                    answer.len()
                );
                let _ = socket.write_all(response.as_bytes()).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    (url, count, bodies)
}

/// The `llm` handler against a fake model: the response is the recorded output, and
/// replaying the run's history — folding its events, and a reducer rebuilding its state
/// from the changelog — calls the model zero further times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_llm_step_is_recorded_and_replays_never_call_the_model() {
    let (model, count, bodies) = fake_model().await;
    let stack = Stack::start("exec-llm", &[]).await;
    let graph = format!(
        r#"
id: agent
version: 1
nodes:
  - id: think
    tool: llm
    side_effect: idempotent
    args:
      messages: [{{role: system, content: "You are a refund agent."}}, {{role: user, content: $input.question}}]
      tools: [{{type: function, function: {{name: refund, parameters: {{type: object}}}}}}]
      temperature: 0
    config: {{base_url: "{model}/v1", model: tiny-test}}
    timeout: 10s
  - {{id: act, tool: echo, side_effect: pure, args: {{call: $steps.think.output.tool_calls}}}}
edges:
  - {{from: think, to: act}}
"#
    );
    stack.publish(&graph).await;
    let mut reducer = stack.reducer("0");
    let _executor = stack.executor_process("executor", &["default"], &[]);
    stack
        .send(&start_run(
            "run-llm",
            "agent",
            r#"{"question": "refund order 7?"}"#,
        ))
        .await;
    let runs = ["run-llm".to_owned()];
    let states = stack
        .wait_for_states(
            "the run to succeed",
            &runs,
            LONG,
            status_is(RunStatus::Succeeded),
        )
        .await;
    let think = &states["run-llm"].steps["think#1"];
    let output = think.output.clone().expect("output");
    assert_eq!(output["content"], "Refund approved.");
    assert_eq!(output["tool_calls"][0]["function"]["name"], "refund");
    assert_eq!(output["usage"]["total_tokens"], 17);
    assert_eq!(output["model"], "tiny-test");
    assert_eq!(output["finish_reason"], "tool_calls");
    assert_eq!(count.load(Ordering::SeqCst), 1);
    {
        let bodies = bodies.lock().expect("bodies");
        assert_eq!(bodies[0]["messages"][1]["content"], "refund order 7?");
        assert_eq!(bodies[0]["model"], "tiny-test");
        assert_eq!(bodies[0]["tools"][0]["function"]["name"], "refund");
    }

    // Replay 1: fold the recorded history.
    let events = stack.events().await;
    let folded = events["run-llm"]
        .iter()
        .fold(None, sortie_core::evolve)
        .expect("a state");
    assert_eq!(folded, states["run-llm"]);
    assert_eq!(folded.steps["think#1"].output.as_ref(), Some(&output));

    // Replay 2: a reducer with no cache rebuilds every run from the changelog.
    reducer.stop();
    std::fs::remove_dir_all(stack.reducer_data("0")).expect("delete the cache");
    let _restarted = stack.reducer("0");
    stack
        .send(&start_run(
            "run-llm-2",
            "agent",
            r#"{"question": "and order 8?"}"#,
        ))
        .await;
    let states = stack
        .wait_for_states(
            "a new run to succeed after the cold restart",
            &["run-llm".to_owned(), "run-llm-2".to_owned()],
            LONG,
            status_is(RunStatus::Succeeded),
        )
        .await;
    assert_eq!(
        states["run-llm"].steps["think#1"].output.as_ref(),
        Some(&output)
    );
    assert_eq!(
        count.load(Ordering::SeqCst),
        2,
        "only the new run called the model; the first run's answer came from its history"
    );
}

/// A node that holds its slot for two minutes.
const HOG: &str = "id: hog\nversion: 1\nnodes:\n  - {id: hang, tool: sleep, side_effect: pure, args: {ms: 120000}, timeout: 180s}\n";
/// A node that answers at once.
const QUICK: &str = "id: quick\nversion: 1\nnodes:\n  - {id: hello, tool: echo, side_effect: pure, args: {hello: world}}\n";

/// Tenants share a queue's slots. One tenant's steps hang for two minutes: six of them,
/// in one partition, take six of the executor's 8 slots; then 24 more, in another
/// partition, ahead of another tenant's one quick step. The executor reads past them,
/// holds them per tenant, and the hog stops at its cap (6 of 8), so the quick step runs at
/// once instead of two minutes later. Killed then, the executor's successor is handed
/// every held intent again: none was committed past, though the quick one above them in
/// their partition was done.
///
/// Seen red: with `--tenant-max-in-flight 8` (one tenant may take every slot) the quick
/// run does not end within the wait; with an offset tracked only once its intent runs,
/// the successor is handed none of the 24 (it holds 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_holding_every_slot_leaves_room_for_another() {
    let stack = Stack::start("exec-share", &[HOG, QUICK]).await;
    let _reducer = stack.reducer("0");
    let partitions: u32 = 12; // topology/topics.yaml, intents.{queue}
    let partition_of = |tenant: &str, run: &str, step: &str, tool: &str, args: Value| {
        let op = sortie_core::ids::operation_id(tenant, run, step, tool, &args);
        (sortie_wire::partition_for(op.as_bytes(), partitions), op)
    };
    let (target, quick_op) = partition_of(
        "quiet",
        "quick-1",
        "hello#1",
        "echo",
        json!({"hello": "world"}),
    );
    let hog_partition =
        |run: &str| partition_of("hog", run, "hang#1", "sleep", json!({"ms": 120000}));
    let hogs_in = |partition: i32, n: usize| -> Vec<String> {
        (0..)
            .map(|i| format!("hog-{i}"))
            .filter(|run| hog_partition(run).0 == partition)
            .take(n)
            .collect()
    };
    let start_hogs = |runs: Vec<String>| {
        let stack = &stack;
        async move {
            for run in &runs {
                let mut start = start_run(run, "hog", "{}");
                start.tenant = "hog".into();
                stack.send(&start).await;
            }
            let states = stack
                .wait_for_states("the hog steps to be dispatched", &runs, LONG, |s| {
                    s.steps.contains_key("hang#1")
                })
                .await;
            assert_eq!(
                states[&runs[0]].steps["hang#1"].operation_id,
                hog_partition(&runs[0]).1,
                "the test computes the intents' partition"
            );
            runs
        }
    };
    let mut hogs = start_hogs(hogs_in((target + 1) % partitions as i32, 6)).await;
    let executor = stack.executor_process("executor", &["default"], &["--max-in-flight", "8"]);
    held_and_running(&executor, 0, 6).await;
    hogs.extend(start_hogs(hogs_in(target, 24)).await);
    let mut start = start_run("quick-1", "quick", "{}");
    start.tenant = "quiet".into();
    stack.send(&start).await;
    stack
        .wait_for_states(
            "the quick run to end while the hog's steps hang",
            &["quick-1".to_owned()],
            Duration::from_secs(45),
            status_is(RunStatus::Succeeded),
        )
        .await;
    let states = stack.states().await;
    assert_eq!(states["quick-1"].steps["hello#1"].operation_id, quick_op);
    let hogging = hogs
        .iter()
        .filter(|run| states[*run].steps["hang#1"].status.is_in_flight())
        .count();
    assert_eq!(
        hogging, 30,
        "the hog's steps still hang: the quick one did not wait for them"
    );
    held_and_running(&executor, 24, 6).await;

    let mut executor = executor;
    executor.kill();
    let executor = stack.executor_process("executor-2", &["default"], &["--max-in-flight", "8"]);
    held_and_running(&executor, 24, 6).await;
}

/// Waits until `executor` holds `held` intents of the default queue and runs `running`.
async fn held_and_running(executor: &sortie_tests::stack::Process, held: usize, running: usize) {
    let url = executor.metrics_url().await;
    let what = format!("{held} intents of the default queue to be held and {running} to run");
    sortie_tests::wait_until(&what, LONG, || async {
        let metrics = sortie_tests::stack::scrape(&url).await;
        let gauge = |name| sortie_tests::stack::metric_sum(&metrics, name, &[("queue", "default")]);
        gauge("sortie_executor_held") == held as f64
            && gauge("sortie_executor_in_flight") == running as f64
    })
    .await;
}

/// An attempt the reducer gave up on while its intent waited is never called late. An
/// `unsafe` step's intent waits in the topic (no executor) past its 2 s timeout: the run
/// needs reconciliation. When an executor comes, it reports the attempt `deadline_passed`
/// without a call — a definite outcome the reducer takes even then — so the run goes on
/// with attempt 2, the only call the receiver sees, and no operator is needed. (Without
/// the check the late call happens, and an operator who had ruled "it never happened"
/// would have a second effect.)
///
/// Seen red: without the deadline check the late executor called attempt 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsafe_attempt_given_up_on_is_never_called_late() {
    let stack = Stack::start("exec-late", &[]).await;
    let ledger = stack.ledger_process("ledger", "plain").await;
    stack
        .publish(&pay_graph_with_timeout("pay", "unsafe", &ledger.url, "2s"))
        .await;
    let _reducer = stack.reducer("0");
    stack
        .send(&start_run("run-late", "pay", r#"{"amount": 5}"#))
        .await;
    let states = stack
        .wait_for_states(
            "the run to need reconciliation with no executor",
            &["run-late".to_owned()],
            LONG,
            status_is(RunStatus::NeedsReconciliation),
        )
        .await;
    let op = states["run-late"].steps["pay#1"].operation_id.clone();
    let executor = stack.executor_process("executor", &["default"], &[]);
    // Either it skips the attempt (its log says so) or it calls it: the assertion below
    // tells which.
    sortie_tests::wait_until("the executor to take the expired attempt", LONG, || {
        let skipped = executor
            .log_text()
            .contains("deadline passed before it got a slot");
        let (ledger, op) = (&ledger, op.clone());
        async move { skipped || ledger.snapshot().await.calls(&op) > 0 }
    })
    .await;
    // Skipped, not called. (The ledger cannot tell the attempts apart, and attempt 2, the
    // retry, may already have been called by now: the one call below is attempt 2's.)
    assert!(
        executor
            .log_text()
            .contains("deadline passed before it got a slot"),
        "attempt 1 was called late"
    );
    let states = stack
        .wait_for_states(
            "the run to go on by itself and succeed on attempt 2",
            &["run-late".to_owned()],
            LONG,
            status_is(RunStatus::Succeeded),
        )
        .await;
    assert_eq!(states["run-late"].steps["pay#1"].attempt, 2);
    let ledger = ledger.snapshot().await;
    assert_eq!(
        (ledger.effects(&op), ledger.calls(&op)),
        (1, 1),
        "{ledger:#?}"
    );
}
