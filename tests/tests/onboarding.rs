//! The shipped onboarding (issue 53 item 4) on the real broker: `topology/graphs/onboarding.yaml`
//! and its sub-agent `topology/graphs/welcome_writer.yaml`, read from disk as `sortie dev`
//! publishes them. Five provisioning calls, each with its side-effect class and its own
//! operation id (`create_account` refused once with a 429 and retried by its policy), the
//! manager's approval escalating to the manager's manager (both groups named by the run's
//! input), a `laptop_delivered` signal published over Kafka by the logistics service, and a
//! child run that writes the welcome plan.
//!
//! What the test rewrites in the shipped text, and nothing else:
//! - every `http://127.0.0.1:8090` of `onboarding.yaml` (the `url`s and `enroll_payroll`'s
//!   `status_url`) → this test's receiver: `sortie ledger --mode keyed --dev-routes`, the very
//!   process `sortie dev` serves on :8090 (its `/effects/<name>` record every call, keyed by the
//!   `Idempotency-Key`; its `/status/{operation_id}` answers the reconcilable lookups), here on a
//!   free port, as `sortie dev`'s own `rebase_urls` does when it listens elsewhere;
//! - `welcome_writer.yaml`'s model `base_url` (`http://127.0.0.1:8090/v1`) → the scripted fake
//!   model (`sortie_devkit::model`) served in this process, so the test reads what it was asked;
//! - in the deadline test only: the approval's `timeout: 72h` → 5 s and the wait's
//!   `timeout: 10d` → 3 s, so the escalation and the chase happen within the test (short
//!   deadlines on the reducer's own timers, no sleeping test). Each rewrite must match the
//!   shipped text exactly once, so a changed file fails here instead of going untested.
//!
//! - `the_shipped_onboarding_survives_a_deploy_and_takes_its_signals_once`: hire A's manager
//!   approves the laptop; while A waits for its delivery the reducer and the executor are
//!   killed; while they are down hire B starts and B's `laptop_delivered` arrives (twice: the
//!   logistics service resent it under a new command id) before B's run reached its wait, and
//!   is kept once; after the restart A's signal arrives, then again under a new command id with
//!   the same signal id; B's manager approves; both runs end with the child's welcome plan.
//!   Checked on the receiver: each of the five provisioning calls took effect once per hire
//!   (Ada's `create_account` on its second attempt); and in the histories: one `SignalReceived`
//!   per run, one `SignalBuffered` for B, each resend answered `CommandAccepted {duplicate:
//!   true}`, the plan step's output is the `sub_…` child run's, every history folds to its state.
//! - `the_shipped_onboarding_escalates_and_chases_at_its_deadlines`: nobody approves, the gate
//!   escalates to `$input.managers_manager` (`InterruptEscalated`, a whole new window), the
//!   manager's manager approves; no signal comes, the wait expires into `chase_delivery` (one
//!   call to the receiver), and the welcome plan is still written.
//!
//! Who may decide: both tests also send a decision from a principal outside the gate's group
//! (an approver of another team before the deadline; the hire's own manager after the
//! escalation) and assert, last, that it was refused `not_in_group`: the gate names the
//! manager's group with `group: $input.manager`, which makes it members-only
//! (`Interrupt::members_only`). Seen red: the graph first said `approver_group:`, which
//! `docs/guides/approvals.md` defines as a notification label that "does not limit who
//! decides" — an approver of another team decided the laptop.
//!
//! Why a duplicate is taken once: `decide/signal.rs` answers a signal whose signal id the run
//! took or kept already as `duplicate` (`RunState::has_signal`) before it looks at the wait; a
//! kept signal counts, so B's resend is not kept twice. `signals.rs` saw that check red (with it
//! skipped, a resent signal filled a list wait twice). Here the assertions were seen red by
//! resending under a new signal id instead (a temporary edit of this file): B then kept two
//! signals (`kept once`: left 2), and A's resend was refused `not_waiting` ("the wait for
//! signal laptop_delivered has ended") instead of answered `duplicate`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use sortie_core::graph::SideEffect;
use sortie_core::state::{Answer, Interrupt, WaitStatus};
use sortie_core::{EventBody, RunState, RunStatus};
use sortie_devkit::model::{self, FakeModel, FINAL_ANSWER};
use sortie_tests::stack::{check_history, command, LedgerProcess, Stack};
use sortie_wire::records as w;

const LONG: Duration = Duration::from_secs(120);
const GRAPH: &str = "onboarding";
/// The five provisioning calls, each its own node (and receiver route) and class.
const PROVISIONING: [(&str, SideEffect); 5] = [
    ("create_account", SideEffect::Keyed),
    ("provision_email", SideEffect::Idempotent),
    ("enroll_payroll", SideEffect::Reconcilable),
    ("grant_building_access", SideEffect::Keyed),
    ("order_laptop", SideEffect::Keyed),
];
/// Where the shipped graphs send their calls (`sortie dev`'s receiver).
const SHIPPED_BASE: &str = "http://127.0.0.1:8090";

/// A hire: the run's input, and who is in the groups its gate names.
struct Hire {
    id: &'static str,
    name: &'static str,
    manager: &'static str,
    managers_manager: &'static str,
}

impl Hire {
    fn run_id(&self) -> String {
        sortie_core::ids::correlated_run_id("acme", GRAPH, "hire_id", self.id)
    }

    fn input(&self) -> Value {
        json!({
            "hire_id": self.id,
            "name": self.name,
            "laptop": "X1 Carbon",
            "manager": self.manager,
            "managers_manager": self.managers_manager,
        })
    }

    /// HR's start: the `hire_id` label names the run (`correlation: hire_id`), so the command
    /// carries the id it derives, as the gateway and the Python client compute it.
    fn start(&self) -> w::RunCommand {
        command(
            &self.run_id(),
            &format!("start-{}", self.id),
            w::CommandBody::StartRun(w::StartRun {
                graph_id: GRAPH.into(),
                graph_version: None,
                input: self.input().to_string(),
                labels: [("hire_id".to_owned(), self.id.to_owned())].into(),
                budget: None,
                fork: None,
                parent: None,
            }),
        )
    }

    /// The logistics service's `laptop_delivered` for this hire.
    fn delivered(&self, command_id: &str, signal_id: &str) -> w::RunCommand {
        let mut command = command(
            &self.run_id(),
            command_id,
            w::CommandBody::SignalRun(w::SignalRun {
                name: "laptop_delivered".into(),
                signal_id: Some(signal_id.into()),
                payload: Some(json!({"tracking": format!("1Z-{}", self.id)}).to_string()),
            }),
        );
        command.issuer = w::Issuer {
            principal: "svc:logistics".into(),
            roles: vec!["logistics".into()],
            groups: vec![],
        };
        command
    }
}

/// `pattern` in `text` → `with`, where the shipped text must hold `pattern` exactly `times`.
fn rewrite(text: &str, pattern: &str, with: &str, times: usize) -> String {
    assert_eq!(
        text.matches(pattern).count(),
        times,
        "the shipped graph no longer holds {pattern:?} {times} time(s)"
    );
    text.replace(pattern, with)
}

fn shipped(file: &str) -> String {
    let path = sortie_tests::workspace_root()
        .join("topology/graphs")
        .join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Publishes the shipped pair, its receivers rewritten (and, given, its deadlines).
async fn publish_shipped(
    stack: &Stack,
    receiver: &str,
    model: &str,
    deadlines: Option<(&str, &str)>,
) {
    let mut onboarding = rewrite(&shipped("onboarding.yaml"), SHIPPED_BASE, receiver, 7);
    if let Some((approval, wait)) = deadlines {
        onboarding = rewrite(
            &onboarding,
            "timeout: 72h",
            &format!("timeout: {approval}"),
            1,
        );
        onboarding = rewrite(&onboarding, "timeout: 10d", &format!("timeout: {wait}"), 1);
    }
    let writer = rewrite(&shipped("welcome_writer.yaml"), SHIPPED_BASE, model, 1);
    stack.publish(&writer).await;
    stack.publish(&onboarding).await;
}

/// `sortie ledger --mode keyed --dev-routes` on a free port: `sortie dev`'s receiver.
async fn receiver(stack: &Stack) -> LedgerProcess {
    let file = stack.dir.join("receiver.jsonl");
    let process = stack.spawn(
        "receiver",
        &[
            "ledger",
            "--addr",
            "127.0.0.1:0",
            "--file",
            file.to_str().expect("path"),
            "--mode",
            "keyed",
            "--dev-routes",
        ],
    );
    let log = process.log.clone();
    let url = sortie_tests::wait_for("the receiver to listen", Duration::from_secs(30), || {
        let log = log.clone();
        async move {
            let text = std::fs::read_to_string(&log).ok()?;
            let line = text
                .lines()
                .find_map(|l| l.strip_prefix("ledger listening on "))?;
            Some(line.trim().to_owned())
        }
    })
    .await;
    LedgerProcess { process, url, file }
}

/// The scripted model, served in this process (as `tests/tests/agent.rs` does).
async fn serve_model() -> (Arc<FakeModel>, String) {
    let fake = FakeModel::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(model::serve(
        listener,
        fake.clone(),
        std::future::pending::<()>(),
    ));
    (fake, url)
}

/// The executor for the shipped graphs' queues: `http` (the calls) and `llm` (the model).
fn executor(stack: &Stack) -> sortie_tests::stack::Process {
    stack.executor_process("executor", &["http", "llm"], &[])
}

/// Waits until `run`'s gate on the laptop is open and `which` holds for it.
async fn gate(stack: &Stack, run: &str, which: impl Fn(&Interrupt) -> bool) -> Interrupt {
    let states = stack
        .wait_for_states(
            &format!("{run}'s laptop gate"),
            &[run.to_owned()],
            LONG,
            |s| {
                s.open_interrupts()
                    .any(|i| i.node == "order_laptop" && which(i))
            },
        )
        .await;
    let open = states[run]
        .open_interrupts()
        .find(|i| i.node == "order_laptop")
        .cloned();
    open.expect("open")
}

/// An approval of `interrupt` by `principal`, an approver in `group`.
fn approval(
    run: &str,
    command_id: &str,
    interrupt: &Interrupt,
    principal: &str,
    group: &str,
) -> w::RunCommand {
    let mut command = command(
        run,
        command_id,
        w::CommandBody::ResumeRun(w::ResumeRun {
            interrupt_id: interrupt.interrupt_id.clone(),
            proposal_hash: interrupt.proposal_hash.clone(),
            decision: w::Decision::Approve,
            payload: None,
            comment: Some("approved".into()),
            edited_args: None,
            payload_is_input: false,
        }),
    );
    command.issuer = w::Issuer {
        principal: principal.into(),
        roles: vec!["approver".into()],
        groups: vec![group.into()],
    };
    command
}

fn count(events: &[sortie_core::Event], what: impl Fn(&EventBody) -> bool) -> usize {
    events.iter().filter(|e| what(&e.body)).count()
}

fn answered_duplicate(events: &[sortie_core::Event], command: &str) -> bool {
    events.iter().any(|e| {
        matches!(&e.body, EventBody::CommandAccepted { command_id, duplicate: true, .. } if command_id == command)
    })
}

/// The checks every finished onboarding passes: the five provisioning calls took effect once
/// each on the receiver, under the operation ids of the run's steps; the welcome plan is the
/// output of the one `sub_…` child run the plan step started; every history folds to its state.
fn check_finished(
    run: &str,
    states: &HashMap<String, RunState>,
    events: &std::collections::BTreeMap<String, Vec<sortie_core::Event>>,
    receiver: &sortie_devkit::ledger::Snapshot,
) {
    let state = &states[run];
    assert_eq!(state.status, RunStatus::Succeeded, "{run}: {state:#?}");
    check_history(run, &events[run], state);
    let mut operations = std::collections::BTreeSet::new();
    for (node, class) in PROVISIONING {
        let steps: Vec<_> = state.steps.values().filter(|s| s.node == node).collect();
        assert_eq!(steps.len(), 1, "{run}: one {node} step");
        assert_eq!(steps[0].side_effect, class, "{run}: {node}");
        assert!(
            operations.insert(steps[0].operation_id.clone()),
            "{run}: {node}'s own operation id"
        );
        let op = &steps[0].operation_id;
        assert_eq!(receiver.effects(op), 1, "{run}: {node} took effect once");
        let entry = receiver
            .calls
            .iter()
            .find(|c| c.operation_id.as_deref() == Some(op.as_str()))
            .expect("recorded");
        assert_eq!(entry.name, node, "{run}: {node} reached its own route");
    }
    let plan = state
        .steps
        .values()
        .find(|s| s.node == "welcome_plan")
        .expect("the plan step");
    let children: Vec<&RunState> = states
        .values()
        .filter(|s| s.parent.as_ref().is_some_and(|p| p.run_id == run))
        .collect();
    assert_eq!(children.len(), 1, "{run}: one child run");
    let child = children[0];
    assert!(child.run_id.starts_with("sub_"), "{}", child.run_id);
    assert_eq!(child.graph_id, "welcome_writer");
    assert_eq!(child.status, RunStatus::Succeeded, "{child:#?}");
    assert_eq!(
        child.parent.as_ref().map(|p| &p.step_id),
        Some(&plan.step_id)
    );
    assert_eq!(child.input["name"], state.input["name"], "{run}");
    check_history(&child.run_id, &events[&child.run_id], child);
    assert_eq!(
        plan.output.as_ref(),
        child.output.as_ref(),
        "{run}: the plan step's output is its child's"
    );
    assert_eq!(
        child.output.as_ref().map(|o| &o["plan"]["content"]),
        Some(&json!(FINAL_ANSWER)),
        "{run}: the model's plan: {:?}",
        child.output
    );
    assert_eq!(
        state.output.as_ref().map(|o| &o["welcome_plan"]),
        plan.output.as_ref()
    );
}

/// The gate's decisions, checked last: `refused` was answered `not_in_group`, and the one
/// approval that counted was `by`'s (red with the gate's `group:` written
/// `approver_group:`, a label).
fn check_members_only(
    run: &str,
    state: &RunState,
    events: &[sortie_core::Event],
    refused: &str,
    by: &str,
) {
    let decided_by: Vec<&str> = events
        .iter()
        .filter_map(|e| match &e.body {
            EventBody::InterruptDecided { decided_by, .. } => Some(decided_by.as_str()),
            _ => None,
        })
        .collect();
    let answer = state.commands.get(refused);
    let kept_out = matches!(answer, Some(Answer::Rejected { code, .. }) if code == "not_in_group");
    assert!(
        kept_out && decided_by == [by],
        "{run}: only the group the gate names may decide, but {refused} was answered \
         {answer:?} and the gate was decided by {decided_by:?}: the laptop gate of \
         topology/graphs/onboarding.yaml must say `group: $input.manager` (members only), \
         not `approver_group:` (a label)."
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_onboarding_survives_a_deploy_and_takes_its_signals_once() {
    let (fake, model_url) = serve_model().await;
    let stack = Stack::start("onboarding-deploy", &[]).await;
    let receiver = receiver(&stack).await;
    publish_shipped(&stack, &receiver.url, &model_url, None).await;
    let mut reducer = stack.reducer("0");
    let mut executor_process = executor(&stack);

    let ada = Hire {
        id: "h-ada",
        name: "Ada Lovelace",
        manager: "mgr-charles",
        managers_manager: "mgr-mary",
    };
    let bob = Hire {
        id: "h-bob",
        name: "Bob Kahn",
        manager: "mgr-vint",
        managers_manager: "mgr-mary",
    };
    let (a, b) = (ada.run_id(), bob.run_id());
    // The receiver refuses the first call (Ada's create_account) with a 429: its retry policy
    // calls again, under the same operation id.
    receiver.fault(json!({"status": 429, "times": 1})).await;
    stack.send(&ada.start()).await;

    // The gate names Ada's manager, from her run's input. An approver of another team tries
    // first; then her manager approves.
    let laptop = gate(&stack, &a, |_| true).await;
    assert_eq!(laptop.approver_group.as_deref(), Some(ada.manager));
    stack
        .send(&approval(
            &a,
            "approve-outsider",
            &laptop,
            "user:eve",
            "mgr-zed",
        ))
        .await;
    stack
        .send(&approval(
            &a,
            "approve-ada",
            &laptop,
            "user:charles",
            ada.manager,
        ))
        .await;
    stack
        .wait_for_states(
            "ada waits for her laptop",
            std::slice::from_ref(&a),
            LONG,
            |s| s.status == RunStatus::WaitingSignal,
        )
        .await;

    // A deploy mid-wait: both die. While they are down Bob's onboarding starts, and his
    // laptop's delivery is reported (and resent under a new command id) before his run has
    // even reached its wait.
    reducer.kill();
    executor_process.kill();
    stack.send(&bob.start()).await;
    stack.send(&bob.delivered("dlv-bob-1", "1Z-bob")).await;
    stack.send(&bob.delivered("dlv-bob-2", "1Z-bob")).await;
    let _reducer = stack.reducer("0");
    let kept = stack
        .wait_for_states(
            "bob's delivery is kept",
            std::slice::from_ref(&b),
            LONG,
            |s| s.commands.contains_key("dlv-bob-2"),
        )
        .await;
    assert!(kept[&b].waits.is_empty(), "kept before any wait opened");
    assert_eq!(kept[&b].early_signals.len(), 1, "kept once");
    let _executor = executor(&stack);

    // Ada's delivery, then the same delivery again under a new command id.
    stack.send(&ada.delivered("dlv-ada-1", "1Z-ada")).await;
    stack.send(&ada.delivered("dlv-ada-2", "1Z-ada")).await;
    let laptop = gate(&stack, &b, |_| true).await;
    assert_eq!(laptop.approver_group.as_deref(), Some(bob.manager));
    stack
        .send(&approval(
            &b,
            "approve-bob",
            &laptop,
            "user:vint",
            bob.manager,
        ))
        .await;

    let runs = [a.clone(), b.clone()];
    // A parent ends after its child's end was committed: these states hold the children's.
    let states = stack
        .wait_for_states("both hires are onboarded", &runs, LONG, |s| {
            s.status.is_terminal() && (s.run_id == b || s.commands.contains_key("dlv-ada-2"))
        })
        .await;
    let events = stack.events().await;
    let snapshot = receiver.snapshot().await;
    for (hire, run) in [(&ada, &a), (&bob, &b)] {
        check_finished(run, &states, &events, &snapshot);
        let state = &states[run];
        let account = state
            .steps
            .values()
            .find(|s| s.node == "create_account")
            .expect("create_account");
        let attempts = if run == &a { 2 } else { 1 };
        assert_eq!(
            account.attempt, attempts,
            "{run}: create_account's attempts"
        );
        let received = count(&events[run], |b| {
            matches!(b, EventBody::SignalReceived { .. })
        });
        assert_eq!(received, 1, "{run}: one signal taken");
        let wait = state.waits.values().next().expect("a wait");
        assert_eq!(wait.status, WaitStatus::Done);
        assert_eq!(wait.received.len(), 1);
        assert_eq!(
            wait.received[0].payload["tracking"],
            format!("1Z-{}", hire.id)
        );
        assert_eq!(wait.received[0].sent_by, "svc:logistics");
    }
    for (node, _) in PROVISIONING {
        let effects = snapshot
            .calls
            .iter()
            .filter(|c| c.name == node && c.effect)
            .count();
        assert_eq!(effects, 2, "{node}: once per hire");
    }
    assert_eq!(
        count(&events[&b], |e| matches!(
            e,
            EventBody::SignalBuffered { .. }
        )),
        1,
        "bob's delivery was kept once, before his wait opened"
    );
    for (run, resend) in [(&b, "dlv-bob-2"), (&a, "dlv-ada-2")] {
        assert!(
            answered_duplicate(&events[run], resend),
            "{resend} is answered as a duplicate: {:?}",
            states[run].commands.get(resend)
        );
    }
    let mut asked: Vec<String> = fake
        .exchanges()
        .iter()
        .filter_map(|x| {
            x.request["messages"][1]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    asked.sort();
    assert_eq!(asked, [ada.name, bob.name], "one plan per hire");

    check_members_only(
        &a,
        &states[&a],
        &events[&a],
        "approve-outsider",
        "user:charles",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_onboarding_escalates_and_chases_at_its_deadlines() {
    let (_fake, model_url) = serve_model().await;
    let stack = Stack::start("onboarding-deadlines", &[]).await;
    let receiver = receiver(&stack).await;
    publish_shipped(&stack, &receiver.url, &model_url, Some(("5s", "3s"))).await;
    let _reducer = stack.reducer("0");
    let _executor = executor(&stack);

    let cy = Hire {
        id: "h-cy",
        name: "Cy Young",
        manager: "mgr-dee",
        managers_manager: "mgr-mary",
    };
    let run = cy.run_id();
    stack.send(&cy.start()).await;
    let first = gate(&stack, &run, |i| i.round == 0).await;
    assert_eq!(first.approver_group.as_deref(), Some(cy.manager));

    // Nobody approves: at the deadline the gate passes to the manager's manager. Her own
    // manager answers late; the manager's manager approves.
    let escalated = gate(&stack, &run, |i| i.round == 1).await;
    assert_eq!(escalated.interrupt_id, first.interrupt_id);
    assert_eq!(
        escalated.approver_group.as_deref(),
        Some(cy.managers_manager)
    );
    stack
        .send(&approval(
            &run,
            "approve-late",
            &escalated,
            "user:dee",
            cy.manager,
        ))
        .await;
    stack
        .send(&approval(
            &run,
            "approve-skip",
            &escalated,
            "user:mary",
            cy.managers_manager,
        ))
        .await;

    // No delivery is reported: the wait expires into chase_delivery, and the run goes on.
    let states = stack
        .wait_for_states("cy is onboarded", std::slice::from_ref(&run), LONG, |s| {
            s.status.is_terminal() && s.commands.contains_key("approve-skip")
        })
        .await;
    let events = stack.events().await;
    let snapshot = receiver.snapshot().await;
    check_finished(&run, &states, &events, &snapshot);
    let state = &states[&run];
    let history = &events[&run];

    let renewed: Vec<(&str, i64)> = history
        .iter()
        .filter_map(|e| match &e.body {
            EventBody::InterruptEscalated {
                approver_group,
                expires_at,
                ..
            } => Some((approver_group.as_str(), *expires_at)),
            _ => None,
        })
        .collect();
    assert_eq!(renewed.len(), 1, "escalated once: {renewed:?}");
    assert_eq!(renewed[0].0, cy.managers_manager);
    assert!(
        first
            .expires_at
            .is_some_and(|due| renewed[0].1 >= due + 5_000),
        "a whole new window: {:?} → {}",
        first.expires_at,
        renewed[0].1
    );
    assert_eq!(
        count(history, |b| matches!(b, EventBody::InterruptExpired { .. })),
        0
    );

    let wait = state.waits.values().next().expect("a wait");
    assert_eq!(wait.status, WaitStatus::Expired, "{wait:?}");
    assert!(wait.timed_out && wait.received.is_empty());
    assert_eq!(
        count(history, |b| matches!(b, EventBody::SignalReceived { .. })),
        0
    );
    let chase: Vec<_> = state
        .steps
        .values()
        .filter(|s| s.node == "chase_delivery")
        .collect();
    assert_eq!(chase.len(), 1, "the courier is chased once");
    assert_eq!(snapshot.effects(&chase[0].operation_id), 1);
    let order = state
        .steps
        .values()
        .find(|s| s.node == "order_laptop")
        .expect("order");
    assert_eq!(
        chase[0].args["order"],
        order.output.as_ref().expect("ordered")["ledger_seq"],
        "the chase names the order"
    );

    check_members_only(&run, state, history, "approve-late", "user:mary");
}
