//! The human-approval, cancellation, compensation and versioning story end to end against
//! the real broker (SPEC §5, §10, §12): the refund graph (read order → check policy →
//! approval gate → refund (`keyed`, to the ledger) → notify customer; `reverse_refund`
//! compensates the refund), with the reducer, the executors and the ledger each their own
//! process.
//!
//! Effects are asserted on the ledger; decisions on the run's state and history. Every
//! run of a test carries its own order id, and every ledger call carries it in its body,
//! so several runs share one ledger and each reads only its own calls.
//!
//! "Hours later" is a command whose Kafka record timestamp is hours ahead: the fold's
//! "now" is the input record's timestamp, so nobody sleeps.

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, AlterConfig, ConfigSource, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{json, Value};
use sortie_core::event::StepRole;
use sortie_core::state::{Interrupt, InterruptStatus};
use sortie_core::{Event, EventBody, RunState, RunStatus};
use sortie_devkit::ledger::{Entry, Snapshot};
use sortie_tests::stack::{command, now_ms, start_run, Process, Stack, PARTITIONS};
use sortie_wire::partition_for;
use sortie_wire::records as w;

const LONG: Duration = Duration::from_secs(60);
const HOUR: i64 = 3_600_000;

// ---------------------------------------------------------------- the graph

/// The refund story modelled on `topology/graphs/refund.yaml`, every effect sent to
/// `ledger`. `read_order` echoes the order from the run input (the ledger is no order
/// service); the approval waits 24 h and fails the run on expiry unless a test changes it.
fn refund_graph(id: &str, ledger: &str) -> Value {
    let url = |name: &str| json!({ "url": format!("{ledger}/effects/{name}") });
    json!({
        "id": id,
        "version": 1,
        "description": "Refund an order after a policy check and a human approval.",
        "max_steps": 20,
        "max_duration": "7d",
        "nodes": [
            {
                "id": "read_order", "tool": "echo", "side_effect": "pure",
                "args": {
                    "order_id": "$input.order_id",
                    "customer_id": "$input.customer_id",
                    "total": "$input.total",
                    "currency": "$input.currency"
                }
            },
            {
                "id": "check_policy", "tool": "echo", "side_effect": "pure",
                "args": {
                    "order_id": "$steps.read_order.output.order_id",
                    "total": "$steps.read_order.output.total",
                    "reason": "$input.reason"
                }
            },
            {
                "id": "refund", "tool": "http", "queue": "http", "side_effect": "keyed",
                "args": {
                    "order_id": "$steps.read_order.output.order_id",
                    "amount": "$steps.read_order.output.total",
                    "currency": "$steps.read_order.output.currency",
                    "reason": "$input.reason"
                },
                "config": url("refund"),
                "timeout": "30s",
                "retry": {
                    "max_attempts": 5, "initial_backoff": "1s", "max_backoff": "1m",
                    "multiplier": 2.0, "jitter": 0.2
                },
                "interrupt_before": {
                    "reason": "A refund moves money; an approver confirms the amount.",
                    "required_role": "approver",
                    "approver_group": "support",
                    "timeout": "24h",
                    "on_timeout": "fail"
                },
                "compensate_with": "reverse_refund"
            },
            {
                "id": "notify_customer", "tool": "http", "queue": "http",
                "side_effect": "idempotent",
                "args": {
                    "customer_id": "$steps.read_order.output.customer_id",
                    "order_id": "$steps.read_order.output.order_id",
                    "refund_id": "$steps.refund.output.ledger_seq"
                },
                "config": url("notify"),
                "timeout": "30s"
            },
            {
                "id": "reverse_refund", "tool": "http", "queue": "http", "side_effect": "keyed",
                "args": {
                    "order_id": "$compensated.args.order_id",
                    "refund_id": "$compensated.output.ledger_seq",
                    "amount": "$compensated.args.amount"
                },
                "config": url("reverse_refund"),
                "timeout": "30s"
            }
        ],
        "edges": [
            {"from": "read_order", "to": "check_policy"},
            {"from": "check_policy", "to": "refund"},
            {"from": "refund", "to": "notify_customer"}
        ]
    })
}

fn node<'g>(graph: &'g mut Value, id: &str) -> &'g mut Value {
    graph["nodes"]
        .as_array_mut()
        .and_then(|nodes| nodes.iter_mut().find(|n| n["id"] == id))
        .unwrap_or_else(|| panic!("the graph has a node {id}"))
}

/// The refund graph with the approval's expiry settings replaced.
fn with_expiry(mut graph: Value, timeout: &str, on_timeout: &str, escalation: &[&str]) -> Value {
    let gate = &mut node(&mut graph, "refund")["interrupt_before"];
    gate["timeout"] = json!(timeout);
    gate["on_timeout"] = json!(on_timeout);
    if !escalation.is_empty() {
        gate["escalation"] = json!(escalation);
    }
    graph
}

async fn publish(stack: &Stack, graph: &Value) {
    // JSON is YAML: the graph loader reads it as is.
    stack.publish(&graph.to_string()).await;
}

fn input(order: &str) -> String {
    json!({
        "order_id": order,
        "customer_id": format!("customer-of-{order}"),
        "total": 120,
        "currency": "EUR",
        "reason": "arrived broken"
    })
    .to_string()
}

/// Both executor queues in one process; static membership so a restart under the same
/// name takes its partitions back at once.
fn executors(stack: &Stack) -> Process {
    stack.executor_process("executor", &["default", "http"], &["--static-membership"])
}

// ---------------------------------------------------------------- commands

fn decision(
    run: &str,
    command_id: &str,
    interrupt: &Interrupt,
    approve: bool,
    payload: Option<&Value>,
) -> w::RunCommand {
    decision_on(
        run,
        command_id,
        &interrupt.interrupt_id,
        &interrupt.proposal_hash,
        approve,
        payload,
    )
}

fn decision_on(
    run: &str,
    command_id: &str,
    interrupt_id: &str,
    proposal_hash: &str,
    approve: bool,
    payload: Option<&Value>,
) -> w::RunCommand {
    let mut command = command(
        run,
        command_id,
        w::CommandBody::ResumeRun(w::ResumeRun {
            interrupt_id: interrupt_id.into(),
            proposal_hash: proposal_hash.into(),
            decision: if approve {
                w::Decision::Approve
            } else {
                w::Decision::Reject
            },
            payload: payload.map(Value::to_string),
            comment: Some("checked the order".into()),
            edited_args: None,
            payload_is_input: false,
        }),
    );
    command.issuer.principal = "user:alice".into();
    command
}

fn cancel(run: &str, command_id: &str) -> w::RunCommand {
    command(
        run,
        command_id,
        w::CommandBody::CancelRun(w::CancelRun {
            reason: Some("the customer withdrew the claim".into()),
        }),
    )
}

/// Produces `command` on its run's canonical partition with an explicit record timestamp:
/// the fold's "now" for this command.
async fn send_at(stack: &Stack, command: &w::RunCommand, timestamp: i64) {
    let mut command = command.clone();
    command.issued_at = timestamp;
    let topic = stack.topics.commands();
    let bytes = stack
        .codec
        .encode(&topic, &command)
        .await
        .expect("encode command");
    let producer: FutureProducer = stack.kafka.producer().create().expect("producer");
    let record = FutureRecord::to(&topic)
        .key(&command.run_id)
        .payload(&bytes)
        .partition(partition_for(command.run_id.as_bytes(), PARTITIONS))
        .timestamp(timestamp);
    producer
        .send(record, Duration::from_secs(10))
        .await
        .map_err(|(e, _)| e)
        .expect("the command was accepted by the broker");
}

/// The topology has the broker stamp commands (`LogAppendTime`, so nobody can backdate a
/// decision), and Kafka 4 refuses records stamped more than an hour ahead
/// (`log.message.timestamp.after.max.ms`, default 1 h). A test that speaks for a client
/// "25 hours later" returns its own commands topic to producer time and lifts that limit,
/// keeping the topology's other per-topic configs (AlterConfigs is not incremental).
async fn allow_future_timestamps(stack: &Stack) {
    const KEY: &str = "message.timestamp.after.max.ms";
    const TYPE: &str = "message.timestamp.type";
    let admin: AdminClient<DefaultClientContext> =
        stack.kafka.client().create().expect("admin client");
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let topic = stack.topics.commands();
    let describe = || async {
        admin
            .describe_configs(&[ResourceSpecifier::Topic(&topic)], &options)
            .await
            .expect("describe configs")
            .into_iter()
            .next()
            .expect("one resource")
            .expect("the commands topic's configs")
    };
    let kept: Vec<(String, String)> = describe()
        .await
        .entries
        .into_iter()
        .filter(|e| e.source == ConfigSource::DynamicTopic && e.name != KEY && e.name != TYPE)
        .filter_map(|e| Some((e.name, e.value?)))
        .collect();
    let unlimited = i64::MAX.to_string();
    let alter = kept.iter().fold(
        AlterConfig::new(ResourceSpecifier::Topic(&topic))
            .set(KEY, &unlimited)
            .set(TYPE, "CreateTime"),
        |alter, (key, value)| alter.set(key, value),
    );
    let results = admin
        .alter_configs(&[alter], &options)
        .await
        .expect("alter configs");
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    sortie_tests::wait_until("the broker to apply the topic config", LONG, || async {
        let configs = describe().await;
        let value = |key| configs.get(key).and_then(|e| e.value.clone());
        value(KEY).is_some_and(|v| v == unlimited) && value(TYPE).is_some_and(|v| v == "CreateTime")
    })
    .await;
}

// ---------------------------------------------------------------- reading the outcome

async fn current(stack: &Stack, run: &str) -> Option<RunState> {
    stack.states().await.remove(run)
}

/// Waits until the run is `status` (or ended otherwise, which fails the test at once).
async fn wait_status(stack: &Stack, run: &str, status: RunStatus) -> RunState {
    let state = sortie_tests::wait_for(&format!("{run} to be {status:?}"), LONG, || async {
        current(stack, run)
            .await
            .filter(|s| s.status == status || s.status.is_terminal())
    })
    .await;
    assert_eq!(
        state.status,
        status,
        "{run} ended otherwise: {state:#?}\n{}",
        history(stack, run).await
    );
    state
}

/// Waits for an open interrupt on the run for which `which` holds.
async fn wait_interrupt(stack: &Stack, run: &str, which: impl Fn(&Interrupt) -> bool) -> Interrupt {
    let found = sortie_tests::wait_for(&format!("{run} to wait for approval"), LONG, || async {
        let state = current(stack, run).await?;
        if state.status.is_terminal() {
            return Some(Err(state));
        }
        if state.status != RunStatus::WaitingApproval {
            return None;
        }
        let found = state.open_interrupts().find(|i| which(i)).cloned();
        found.map(Ok)
    })
    .await;
    found.unwrap_or_else(|state| panic!("{run} ended instead of pausing: {state:#?}"))
}

async fn open_interrupt(stack: &Stack, run: &str) -> Interrupt {
    wait_interrupt(stack, run, |_| true).await
}

async fn events(stack: &Stack, run: &str) -> Vec<Event> {
    stack.events().await.remove(run).unwrap_or_default()
}

async fn history(stack: &Stack, run: &str) -> String {
    events(stack, run)
        .await
        .iter()
        .map(|e| {
            format!(
                "  {} {}",
                e.body.name(),
                serde_json::to_string(&e.body).unwrap_or_default()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn answers_to<'e>(events: &'e [Event], command_id: &str) -> Vec<&'e EventBody> {
    events
        .iter()
        .map(|e| &e.body)
        .filter(|b| match b {
            EventBody::CommandAccepted { command_id: id, .. }
            | EventBody::CommandRejected { command_id: id, .. } => id == command_id,
            _ => false,
        })
        .collect()
}

/// The `n`th answer (1-based) to `command_id`.
async fn answer(stack: &Stack, run: &str, command_id: &str, n: usize) -> EventBody {
    sortie_tests::wait_for(
        &format!("answer {n} to command {command_id} of {run}"),
        LONG,
        || async {
            let events = events(stack, run).await;
            answers_to(&events, command_id)
                .get(n - 1)
                .map(|b| (*b).clone())
        },
    )
    .await
}

/// Waits for the first answer to `command_id`, which must be a rejection; returns its code.
async fn rejected(stack: &Stack, run: &str, command_id: &str) -> String {
    match answer(stack, run, command_id, 1).await {
        EventBody::CommandRejected { code, .. } => code,
        other => panic!(
            "{command_id} should have been rejected: {other:?}\n{}",
            history(stack, run).await
        ),
    }
}

/// Waits for the first answer to `command_id`, which must be an acceptance.
async fn accepted(stack: &Stack, run: &str, command_id: &str) {
    match answer(stack, run, command_id, 1).await {
        EventBody::CommandAccepted {
            duplicate: false, ..
        } => {}
        other => panic!(
            "{command_id} should have been accepted: {other:?}\n{}",
            history(stack, run).await
        ),
    }
}

fn dispatches<'e>(events: &'e [Event], node: &str) -> Vec<&'e EventBody> {
    events
        .iter()
        .map(|e| &e.body)
        .filter(|b| matches!(b, EventBody::StepDispatched { node: n, .. } if n == node))
        .collect()
}

/// Index of the first event for which `what` holds.
fn position(events: &[Event], what: impl Fn(&EventBody) -> bool) -> usize {
    events
        .iter()
        .position(|e| what(&e.body))
        .unwrap_or(usize::MAX)
}

/// The ledger's calls for one order (every body names its order), in ledger order.
fn calls<'s>(snapshot: &'s Snapshot, order: &str) -> Vec<&'s Entry> {
    snapshot
        .calls
        .iter()
        .filter(|c| c.body["order_id"] == order)
        .collect()
}

/// Names of the calls that took effect for one order, in ledger order.
fn effects(snapshot: &Snapshot, order: &str) -> Vec<String> {
    calls(snapshot, order)
        .into_iter()
        .filter(|c| c.effect)
        .map(|c| c.name.clone())
        .collect()
}

fn step<'s>(state: &'s RunState, step_id: &str) -> &'s sortie_core::state::Step {
    state
        .steps
        .get(step_id)
        .unwrap_or_else(|| panic!("{} has no step {step_id}: {state:#?}", state.run_id))
}

// ---------------------------------------------------------------- 1. restarts while paused

/// The reducer and the executors are stopped while the run waits for its approver and
/// new processes (a reducer with an empty cache, restoring from the changelog) take over;
/// the approval then dispatches exactly the proposed call, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_after_restarting_every_service_refunds_once() {
    let stack = Stack::start("appr-restart", &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    publish(&stack, &refund_graph("refund", &ledger.url)).await;
    let mut reducer = stack.reducer("0");
    let mut executor = executors(&stack);
    let run = "order-restart";
    stack.send(&start_run(run, "refund", &input(run))).await;

    let interrupt = open_interrupt(&stack, run).await;
    assert_eq!(
        interrupt.proposal,
        json!({
            "node": "refund",
            "step_id": "refund#1",
            "tool": "http",
            "args": {"order_id": run, "amount": 120, "currency": "EUR", "reason": "arrived broken"}
        })
    );
    assert_eq!(
        (
            interrupt.required_role.as_deref(),
            interrupt.approver_group.as_deref()
        ),
        (Some("approver"), Some("support"))
    );
    assert!(
        effects(&ledger.snapshot().await, run).is_empty(),
        "nothing is paid before the approval"
    );

    reducer.stop();
    executor.stop();
    let _reducer = stack.reducer("1");
    let _executor = executors(&stack);
    stack
        .send(&decision(run, "approve-1", &interrupt, true, None))
        .await;

    let state = wait_status(&stack, run, RunStatus::Succeeded).await;
    let snapshot = ledger.snapshot().await;
    assert_eq!(
        effects(&snapshot, run),
        ["refund", "notify"],
        "one refund, then the notification: {snapshot:#?}"
    );
    let refund = step(&state, "refund#1");
    let paid: Vec<_> = calls(&snapshot, run)
        .into_iter()
        .filter(|c| c.name == "refund")
        .collect();
    assert_eq!(paid.len(), 1, "the receiver was called once: {snapshot:#?}");
    assert_eq!(
        paid[0].operation_id.as_deref(),
        Some(refund.operation_id.as_str())
    );
    assert_eq!(
        paid[0].body, interrupt.proposal["args"],
        "exactly the approved call"
    );
    assert_eq!(refund.output.as_ref(), Some(&paid[0].answer));
    assert_eq!(
        step(&state, "notify_customer#1").args["refund_id"],
        paid[0].answer["ledger_seq"]
    );

    let events = events(&stack, run).await;
    assert_eq!(
        dispatches(&events, "refund").len(),
        1,
        "one dispatch of the refund"
    );
    assert!(
        events.iter().any(|e| matches!(&e.body,
            EventBody::InterruptDecided { approve: true, decided_by, is_final: true, .. }
                if decided_by == "user:alice")),
        "who approved is recorded"
    );
}

// ---------------------------------------------------------------- 2, 3, 5, 6. decisions (and §10 / §12 checks)

/// Decisions are checked against the clock of their record, the proposal and the answers
/// already given; one stack, one ledger, a run per case.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_are_bound_to_time_proposal_and_the_first_answer() {
    let stack = Stack::start("appr-decide", &[]).await;
    allow_future_timestamps(&stack).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    let base = refund_graph("refund", &ledger.url);
    publish(&stack, &base).await;
    let mut goto = base.clone();
    goto["id"] = json!("refund-voucher");
    node(&mut goto, "refund")["on_reject"] = json!({"goto": "voucher"});
    goto["nodes"].as_array_mut().expect("nodes").push(json!({
        "id": "voucher", "tool": "http", "queue": "http", "side_effect": "keyed",
        "args": {"order_id": "$input.order_id", "voucher_for": "$steps.read_order.output.total"},
        "config": {"url": format!("{}/effects/voucher", ledger.url)},
        "timeout": "30s"
    }));
    publish(&stack, &goto).await;
    // The commands topic keeps producer time now, which a reducer refuses without this.
    let _reducer = stack.reducer_with("0", &["--allow-create-time"]);
    let _executor = executors(&stack);

    let (late, reject, voucher, dup, edit, early) = (
        "order-late",
        "order-reject",
        "order-voucher",
        "order-dup",
        "order-edit",
        "order-early",
    );
    for (run, graph) in [
        (late, "refund"),
        (reject, "refund"),
        (voucher, "refund-voucher"),
        (dup, "refund"),
        (edit, "refund"),
    ] {
        stack.send(&start_run(run, graph, &input(run))).await;
    }

    // Interrupt ids are derived, so an approver may decide before the interrupt exists:
    // the decision is produced right behind the StartRun, by the same producer in the same
    // call. Two sends (a producer each) once let two echo steps finish in between on a
    // loaded CI host, and the decision met a registered interrupt.
    let proposal = json!({
        "node": "refund",
        "step_id": "refund#1",
        "tool": "http",
        "args": {"order_id": early, "amount": 120, "currency": "EUR", "reason": "arrived broken"}
    });
    let hash = sortie_core::ids::proposal_hash(&proposal);
    let interrupt_id = sortie_core::ids::interrupt_id(early, "refund#1", &hash);
    stack
        .send_many(&[
            start_run(early, "refund", &input(early)),
            decision_on(early, "approve-early", &interrupt_id, &hash, true, None),
        ])
        .await;

    tokio::join!(
        hours_later(&stack, late),
        rejected_to_fail(&stack, reject),
        rejected_to_goto(&stack, voucher),
        duplicates(&stack, dup),
        stale_and_edited(&stack, edit),
        decided_early(&stack, early),
    );

    let snapshot = ledger.snapshot().await;
    assert_eq!(
        effects(&snapshot, late),
        ["refund", "notify"],
        "{snapshot:#?}"
    );
    assert!(effects(&snapshot, reject).is_empty(), "{snapshot:#?}");
    assert_eq!(
        effects(&snapshot, voucher),
        ["voucher", "notify"],
        "{snapshot:#?}"
    );
    assert_eq!(
        effects(&snapshot, dup),
        ["refund", "notify"],
        "{snapshot:#?}"
    );
    assert_eq!(
        effects(&snapshot, edit),
        ["refund", "notify"],
        "{snapshot:#?}"
    );
    assert_eq!(
        effects(&snapshot, early),
        ["refund", "notify"],
        "{snapshot:#?}"
    );
    for order in [late, dup, edit, early] {
        let refunds = calls(&snapshot, order)
            .into_iter()
            .filter(|c| c.name == "refund")
            .count();
        assert_eq!(refunds, 1, "{order}: the receiver saw one refund call");
    }
}

/// 25 h later the 24 h approval has expired; 23 h later it has not.
async fn hours_later(stack: &Stack, run: &str) {
    let interrupt = open_interrupt(stack, run).await;
    let interrupted_at = events(stack, run)
        .await
        .iter()
        .find(|e| matches!(e.body, EventBody::Interrupted { .. }))
        .map(|e| e.at)
        .expect("the Interrupted event");
    assert_eq!(interrupt.expires_at, Some(interrupted_at + 24 * HOUR));

    let approve = decision(run, "approve-25h-later", &interrupt, true, None);
    send_at(stack, &approve, now_ms() + 25 * HOUR).await;
    assert_eq!(rejected(stack, run, "approve-25h-later").await, "expired");
    let state = current(stack, run).await.expect("state");
    assert_eq!(state.status, RunStatus::WaitingApproval);
    assert!(!state.steps.contains_key("refund#1"), "nothing dispatched");

    let approve = decision(run, "approve-23h-later", &interrupt, true, None);
    send_at(stack, &approve, now_ms() + 23 * HOUR).await;
    accepted(stack, run, "approve-23h-later").await;
    wait_status(stack, run, RunStatus::Succeeded).await;
}

/// `on_reject: fail`: the run fails and nothing is refunded.
async fn rejected_to_fail(stack: &Stack, run: &str) {
    let interrupt = open_interrupt(stack, run).await;
    stack
        .send(&decision(run, "reject-1", &interrupt, false, None))
        .await;
    accepted(stack, run, "reject-1").await;
    let state = wait_status(stack, run, RunStatus::Failed).await;
    let events = events(stack, run).await;
    assert!(dispatches(&events, "refund").is_empty());
    assert!(dispatches(&events, "notify_customer").is_empty());
    assert!(
        events.iter().any(|e| matches!(&e.body,
            EventBody::RunStatusChanged { status: RunStatus::Failed, reason: Some(r), .. }
                if r.contains("rejected by user:alice"))),
        "the failure names the rejection: {state:#?}"
    );
}

/// `on_reject: {goto: voucher}`: the voucher runs in the refund's place (with its own
/// arguments), and the run carries on to notify the customer.
async fn rejected_to_goto(stack: &Stack, run: &str) {
    let interrupt = open_interrupt(stack, run).await;
    stack
        .send(&decision(run, "reject-1", &interrupt, false, None))
        .await;
    accepted(stack, run, "reject-1").await;
    let state = wait_status(stack, run, RunStatus::Succeeded).await;
    let voucher = step(&state, "voucher#1");
    assert_eq!(
        voucher.role,
        StepRole::Substitute {
            for_node: "refund".into()
        }
    );
    assert_eq!(
        voucher.args,
        json!({"order_id": run, "voucher_for": 120}),
        "the substitute runs with its own arguments"
    );
    assert!(!state.steps.contains_key("refund#1"), "no refund step");
    assert!(state.steps.contains_key("notify_customer#1"));
}

/// Two different command ids, and the same id twice: one refund; the second decision is
/// answered `already_decided`, the repeat of the first gets the first answer again.
async fn duplicates(stack: &Stack, run: &str) {
    let interrupt = open_interrupt(stack, run).await;
    let first = decision(run, "approve-a", &interrupt, true, None);
    let mut second = decision(run, "approve-b", &interrupt, true, None);
    second.issuer.principal = "user:bob".into();
    // One producer, the three back to back: the second must meet the run while its refund
    // is still out. Produced one by one (a producer each), the reducer — which commits as
    // soon as no input waits — could finish the refund first and answer `bad_state`.
    stack
        .send_many(&[first.clone(), second, first.clone()])
        .await;

    accepted(stack, run, "approve-a").await;
    assert_eq!(rejected(stack, run, "approve-b").await, "already_decided");
    assert!(matches!(
        answer(stack, run, "approve-a", 2).await,
        EventBody::CommandAccepted {
            duplicate: true,
            ..
        }
    ));
    wait_status(stack, run, RunStatus::Succeeded).await;
    let events = events(stack, run).await;
    assert_eq!(dispatches(&events, "refund").len(), 1);
    assert_eq!(
        events
            .iter()
            .filter(|e| matches!(e.body, EventBody::InterruptDecided { .. }))
            .count(),
        1,
        "one decision recorded"
    );
}

/// A decision for another proposal hash is `stale_proposal` and dispatches nothing; an
/// approver's edited payload is a new proposal with its own hash, and the old hash is no
/// longer accepted; approving the new one pays the edited amount.
async fn stale_and_edited(stack: &Stack, run: &str) {
    let interrupt = open_interrupt(stack, run).await;
    let mut foreign = decision(run, "approve-foreign", &interrupt, true, None);
    foreign.tenant = "globex".into();
    stack.send(&foreign).await;
    assert_eq!(rejected(stack, run, "approve-foreign").await, "unknown_run");
    let mut roleless = decision(run, "approve-roleless", &interrupt, true, None);
    roleless.issuer.roles = vec!["viewer".into()];
    stack.send(&roleless).await;
    assert_eq!(rejected(stack, run, "approve-roleless").await, "forbidden");

    stack
        .send(&decision_on(
            run,
            "approve-stale",
            &interrupt.interrupt_id,
            &"0".repeat(64),
            true,
            None,
        ))
        .await;
    assert_eq!(
        rejected(stack, run, "approve-stale").await,
        "stale_proposal"
    );
    let state = current(stack, run).await.expect("state");
    assert!(!state.steps.contains_key("refund#1"), "nothing dispatched");

    let mut edited = interrupt.proposal["args"].clone();
    edited["amount"] = json!(60);
    stack
        .send(&decision(
            run,
            "approve-edited",
            &interrupt,
            true,
            Some(&edited),
        ))
        .await;
    accepted(stack, run, "approve-edited").await;
    let renewed = wait_interrupt(stack, run, |i| i.interrupt_id != interrupt.interrupt_id).await;
    assert_ne!(renewed.proposal_hash, interrupt.proposal_hash);
    assert_eq!(renewed.proposal["args"], edited);
    assert_eq!(renewed.step_id, "refund#1", "the same step, a new proposal");
    let state = current(stack, run).await.expect("state");
    assert_eq!(
        state.interrupts[&interrupt.interrupt_id].status,
        InterruptStatus::Superseded
    );
    assert!(
        !state.steps.contains_key("refund#1"),
        "the edit alone pays nothing"
    );

    stack
        .send(&decision(run, "approve-old-hash", &interrupt, true, None))
        .await;
    assert_eq!(
        rejected(stack, run, "approve-old-hash").await,
        "stale_proposal"
    );
    stack
        .send(&decision_on(
            run,
            "approve-old-hash-new-id",
            &renewed.interrupt_id,
            &interrupt.proposal_hash,
            true,
            None,
        ))
        .await;
    assert_eq!(
        rejected(stack, run, "approve-old-hash-new-id").await,
        "stale_proposal"
    );

    stack
        .send(&decision(run, "approve-renewed", &renewed, true, None))
        .await;
    accepted(stack, run, "approve-renewed").await;
    let state = wait_status(stack, run, RunStatus::Succeeded).await;
    assert_eq!(step(&state, "refund#1").args, edited);
}

/// A decision that arrived before its interrupt was buffered, then applied when the
/// interrupt was registered: one refund, with the approver recorded.
async fn decided_early(stack: &Stack, run: &str) {
    let state = wait_status(stack, run, RunStatus::Succeeded).await;
    let events = events(stack, run).await;
    let buffered = position(&events, |b| matches!(b, EventBody::DecisionBuffered { .. }));
    let interrupted = position(&events, |b| matches!(b, EventBody::Interrupted { .. }));
    let decided = position(
        &events,
        |b| matches!(b, EventBody::InterruptDecided { approve: true, decided_by, .. } if decided_by == "user:alice"),
    );
    assert!(
        buffered < interrupted && interrupted < decided,
        "buffered, registered, then decided:\n{}",
        history(stack, run).await
    );
    assert_eq!(
        answers_to(&events, "approve-early").len(),
        1,
        "answered once"
    );
    assert_eq!(dispatches(&events, "refund").len(), 1);
    assert!(state.buffered.is_empty());
}

// ---------------------------------------------------------------- 4. expiry

/// The reducer's own timers expire approvals: `fail` fails the run, `cancel` cancels it,
/// `escalate` re-arms with the next approver group, whose approval is then accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_approvals_fail_cancel_or_escalate() {
    let stack = Stack::start("appr-expiry", &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    let graph = |id: &str, timeout: &str, on_timeout: &str, escalation: &[&str]| {
        with_expiry(
            refund_graph(id, &ledger.url),
            timeout,
            on_timeout,
            escalation,
        )
    };
    publish(&stack, &graph("refund-fail", "3s", "fail", &[])).await;
    publish(&stack, &graph("refund-cancel", "3s", "cancel", &[])).await;
    publish(
        &stack,
        &graph("refund-escalate", "5s", "escalate", &["finance"]),
    )
    .await;
    let _reducer = stack.reducer("0");
    let _executor = executors(&stack);
    let (fail, cancel, escalate) = ("order-fail", "order-cancel", "order-escalate");
    stack
        .send(&start_run(fail, "refund-fail", &input(fail)))
        .await;
    stack
        .send(&start_run(cancel, "refund-cancel", &input(cancel)))
        .await;
    stack
        .send(&start_run(escalate, "refund-escalate", &input(escalate)))
        .await;

    let expired_with = |events: &[Event], what: &str| {
        events.iter().any(|e| {
            matches!(&e.body, EventBody::InterruptExpired { on_timeout, .. } if on_timeout == what)
        })
    };
    let on_fail = async {
        let state = wait_status(&stack, fail, RunStatus::Failed).await;
        let events = events(&stack, fail).await;
        assert!(expired_with(&events, "fail"), "{state:#?}");
        assert!(dispatches(&events, "refund").is_empty());
    };
    let on_cancel = async {
        wait_status(&stack, cancel, RunStatus::Cancelled).await;
        let events = events(&stack, cancel).await;
        assert!(expired_with(&events, "cancel"));
        assert!(events.iter().any(|e| matches!(&e.body,
            EventBody::CancelRequested { requested_by, .. } if requested_by == "system:approval-expiry")));
        assert!(dispatches(&events, "refund").is_empty());
    };
    let on_escalate = async {
        let escalated = wait_interrupt(&stack, escalate, |i| i.round == 1).await;
        assert_eq!(escalated.approver_group.as_deref(), Some("finance"));
        // The new window is open: the same proposal is approved in it.
        stack
            .send(&decision(
                escalate,
                "approve-finance",
                &escalated,
                true,
                None,
            ))
            .await;
        accepted(&stack, escalate, "approve-finance").await;
        wait_status(&stack, escalate, RunStatus::Succeeded).await;
        let events = events(&stack, escalate).await;
        let first = events.iter().find_map(|e| match &e.body {
            EventBody::Interrupted {
                interrupt_id,
                approver_group,
                expires_at,
                ..
            } => Some((interrupt_id, approver_group.as_deref(), *expires_at)),
            _ => None,
        });
        let (interrupt_id, group, first_expiry) = first.expect("Interrupted");
        assert_eq!(
            (interrupt_id, group),
            (&escalated.interrupt_id, Some("support"))
        );
        let renewed = events.iter().find_map(|e| match &e.body {
            EventBody::InterruptEscalated {
                approver_group,
                expires_at,
                ..
            } => Some((approver_group.as_str(), *expires_at)),
            _ => None,
        });
        let (group, second_expiry) = renewed.expect("InterruptEscalated");
        assert_eq!(group, "finance", "the escalation names the next group");
        assert!(
            first_expiry.is_some_and(|first| second_expiry >= first + 5_000),
            "the escalation re-armed a whole window: {first_expiry:?} → {second_expiry}"
        );
        assert_eq!(escalated.expires_at, Some(second_expiry));
        assert!(!expired_with(&events, "escalate"));
    };
    tokio::join!(on_fail, on_cancel, on_escalate);

    let snapshot = ledger.snapshot().await;
    assert!(effects(&snapshot, fail).is_empty());
    assert!(effects(&snapshot, cancel).is_empty());
    assert_eq!(effects(&snapshot, escalate), ["refund", "notify"]);
}

// ---------------------------------------------------------------- 7, 8. cancel and compensate

/// Cancel while the refund is in flight (the ledger holds its answer): nothing new is
/// dispatched, the refund's real outcome is recorded, then reverse_refund runs. And a run
/// with several completed compensable steps is compensated latest first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancellation_records_in_flight_outcomes_and_compensates_latest_first() {
    let stack = Stack::start("appr-cancel", &[]).await;
    let slow = stack.ledger_process("slow-ledger", "keyed").await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    publish(&stack, &refund_graph("refund-slow", &slow.url)).await;
    // hold_stock (compensable) before the refund, and a second approval after notify.
    let mut multi = refund_graph("refund-multi", &ledger.url);
    let nodes = multi["nodes"].as_array_mut().expect("nodes");
    nodes.push(json!({
        "id": "hold_stock", "tool": "http", "queue": "http", "side_effect": "keyed",
        "args": {"order_id": "$steps.check_policy.output.order_id"},
        "config": {"url": format!("{}/effects/hold_stock", ledger.url)},
        "timeout": "30s",
        "compensate_with": "release_stock"
    }));
    nodes.push(json!({
        "id": "release_stock", "tool": "http", "queue": "http", "side_effect": "keyed",
        "args": {"order_id": "$compensated.args.order_id", "hold": "$compensated.output.ledger_seq"},
        "config": {"url": format!("{}/effects/release_stock", ledger.url)},
        "timeout": "30s"
    }));
    nodes.push(json!({
        "id": "close_case", "tool": "echo", "side_effect": "pure",
        "args": {"order_id": "$steps.notify_customer.args.order_id"},
        "interrupt_before": {"reason": "A lead closes the case.", "timeout": "24h"}
    }));
    multi["edges"] = json!([
        {"from": "read_order", "to": "check_policy"},
        {"from": "check_policy", "to": "hold_stock"},
        {"from": "hold_stock", "to": "refund"},
        {"from": "refund", "to": "notify_customer"},
        {"from": "notify_customer", "to": "close_case"}
    ]);
    publish(&stack, &multi).await;
    let _reducer = stack.reducer("0");
    let _executor = executors(&stack);
    let (inflight, several) = ("order-inflight", "order-several");
    stack
        .send(&start_run(inflight, "refund-slow", &input(inflight)))
        .await;
    stack
        .send(&start_run(several, "refund-multi", &input(several)))
        .await;

    let in_flight = async {
        let run = inflight;
        let interrupt = open_interrupt(&stack, run).await;
        // The ledger records the refund, then holds its answer.
        slow.fault(json!({"delay_ms": 4000})).await;
        stack
            .send(&decision(run, "approve-1", &interrupt, true, None))
            .await;
        sortie_tests::wait_until("the ledger to record the refund", LONG, || async {
            effects(&slow.snapshot().await, run) == ["refund"]
        })
        .await;
        stack.send(&cancel(run, "cancel-1")).await;
        accepted(&stack, run, "cancel-1").await;

        let state = wait_status(&stack, run, RunStatus::Cancelled).await;
        let snapshot = slow.snapshot().await;
        assert_eq!(
            effects(&snapshot, run),
            ["refund", "reverse_refund"],
            "refund once, reverse once, in that order: {snapshot:#?}"
        );
        let paid = calls(&snapshot, run)[0];
        let reversed = calls(&snapshot, run)[1];
        let refund = step(&state, "refund#1");
        let reverse = step(&state, "reverse_refund#1");
        assert_eq!(
            refund.output.as_ref(),
            Some(&paid.answer),
            "the real outcome"
        );
        assert_eq!(
            reverse.role,
            StepRole::Compensation {
                of: "refund#1".into()
            }
        );
        assert_ne!(reverse.operation_id, refund.operation_id, "a new operation");
        assert_eq!(
            reversed.operation_id.as_deref(),
            Some(reverse.operation_id.as_str())
        );
        assert_eq!(
            reversed.body,
            json!({"order_id": run, "refund_id": paid.answer["ledger_seq"], "amount": 120})
        );

        let events = events(&stack, run).await;
        let cancel_at = position(&events, |b| matches!(b, EventBody::CancelRequested { .. }));
        let refunded_at = position(
            &events,
            |b| matches!(b, EventBody::StepSucceeded { step_id, .. } if step_id == "refund#1"),
        );
        let reverse_at = position(
            &events,
            |b| matches!(b, EventBody::StepDispatched { node, .. } if node == "reverse_refund"),
        );
        assert!(
            cancel_at < refunded_at && refunded_at < reverse_at,
            "cancel while in flight, outcome recorded, then compensation:\n{}",
            history(&stack, run).await
        );
        assert!(
            dispatches(&events, "notify_customer").is_empty(),
            "no new dispatch"
        );
        let dispatched_after_cancel: Vec<_> = events[cancel_at..]
            .iter()
            .filter_map(|e| match &e.body {
                EventBody::StepDispatched { node, .. } => Some(node.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(dispatched_after_cancel, ["reverse_refund"]);
        assert_eq!(state.output, None, "a cancelled run has no output");
        assert!(events.iter().any(|e| matches!(&e.body,
            EventBody::RunStatusChanged { status: RunStatus::Cancelled, reason: Some(r), .. }
                if r.contains("compensation completed (1 steps)"))));
    };

    let latest_first = async {
        let run = several;
        let refund_gate = open_interrupt(&stack, run).await;
        assert_eq!(refund_gate.node, "refund");
        stack
            .send(&decision(run, "approve-refund", &refund_gate, true, None))
            .await;
        let close_gate = wait_interrupt(&stack, run, |i| i.node == "close_case").await;
        assert_eq!(close_gate.required_role, None);
        stack.send(&cancel(run, "cancel-1")).await;
        let state = wait_status(&stack, run, RunStatus::Cancelled).await;
        let snapshot = ledger.snapshot().await;
        assert_eq!(
            effects(&snapshot, run),
            [
                "hold_stock",
                "refund",
                "notify",
                "reverse_refund",
                "release_stock"
            ],
            "completed steps compensated latest first: {snapshot:#?}"
        );
        let at = |name: &str| {
            calls(&snapshot, run)
                .into_iter()
                .find(|c| c.name == name)
                .map(|c| (c.seq, c.at))
                .expect("the call")
        };
        assert!(at("reverse_refund") < at("release_stock"));
        assert_eq!(
            state.completed,
            [
                "read_order#1",
                "check_policy#1",
                "hold_stock#1",
                "refund#1",
                "notify_customer#1",
                "reverse_refund#1",
                "release_stock#1"
            ]
        );
        let events = events(&stack, run).await;
        assert!(events.iter().any(|e| matches!(&e.body,
            EventBody::RunStatusChanged { status: RunStatus::Cancelled, reason: Some(r), .. }
                if r.contains("compensation completed (2 steps)"))));
    };
    tokio::join!(in_flight, latest_first);
}

// ---------------------------------------------------------------- 9. versions

/// Version 2 is published while a run waits on version 1: the paused run resumes on its
/// pinned version (the old definition's calls), a run started on version 2 uses the new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_run_resumes_on_its_pinned_graph_version() {
    let stack = Stack::start("appr-version", &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    let v1 = refund_graph("refund", &ledger.url);
    publish(&stack, &v1).await;
    let _reducer = stack.reducer("0");
    let _executor = executors(&stack);
    let (old, new) = ("order-on-v1", "order-on-v2");
    stack.send(&start_run(old, "refund", &input(old))).await;
    let paused = open_interrupt(&stack, old).await;

    let mut v2 = v1.clone();
    v2["version"] = json!(2);
    node(&mut v2, "refund")["config"]["url"] = json!(format!("{}/effects/refund_v2", ledger.url));
    node(&mut v2, "refund")["args"]["policy"] = json!("v2");
    node(&mut v2, "notify_customer")["config"]["url"] =
        json!(format!("{}/effects/notify_v2", ledger.url));
    publish(&stack, &v2).await;
    let mut start_new = start_run(new, "refund", &input(new));
    if let w::CommandBody::StartRun(start) = &mut start_new.body {
        start.graph_version = Some(2);
    }
    stack.send(&start_new).await;
    let renewed = open_interrupt(&stack, new).await;
    assert_eq!(renewed.proposal["args"]["policy"], "v2");

    stack
        .send(&decision(old, "approve-old", &paused, true, None))
        .await;
    stack
        .send(&decision(new, "approve-new", &renewed, true, None))
        .await;
    let old_state = wait_status(&stack, old, RunStatus::Succeeded).await;
    let new_state = wait_status(&stack, new, RunStatus::Succeeded).await;
    assert_eq!((old_state.graph_version, new_state.graph_version), (1, 2));
    let snapshot = ledger.snapshot().await;
    assert_eq!(
        effects(&snapshot, old),
        ["refund", "notify"],
        "{snapshot:#?}"
    );
    assert_eq!(
        effects(&snapshot, new),
        ["refund_v2", "notify_v2"],
        "{snapshot:#?}"
    );
    assert_eq!(step(&old_state, "refund#1").args, paused.proposal["args"]);
    assert!(step(&old_state, "refund#1").args.get("policy").is_none());
}

// ---------------------------------------------------------------- the fold's clock (issue #14, 4)

/// A backdated decision: a raw producer sends an approval stamped before the interrupt's
/// expiry, but produces it after the expiry. The topology has the broker stamp commands
/// (`message.timestamp.type: LogAppendTime`), so the fold sees the append time: the
/// approval is refused as `expired` and the run takes the expiry path (`on_timeout: fail`).
///
/// The reducer starts only once both records are on the topic, so it folds the StartRun
/// (which opens the gate; interrupt ids are derived, so the decision can name it ahead)
/// and then the approval before its own clock fires the expiry timer: the decision's
/// record time alone decides.
///
/// Proved red once: with the `LogAppendTime` config removed from `topology/topics.yaml`,
/// the approval was accepted (`should have been rejected: CommandAccepted`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backdated_approval_after_the_expiry_is_refused() {
    const TIMEOUT: i64 = 3_000;
    let stack = Stack::start("appr-backdate", &[]).await;
    let graph = json!({
        "id": "gate-first",
        "version": 1,
        "nodes": [{
            "id": "refund", "tool": "http", "queue": "http", "side_effect": "keyed",
            "args": {"order_id": "$input.order_id", "amount": "$input.total"},
            "config": {"url": "http://127.0.0.1:9/effects/refund"},
            "timeout": "30s",
            "interrupt_before": {
                "reason": "A refund moves money.",
                "required_role": "approver",
                "approver_group": "support",
                "timeout": format!("{TIMEOUT}ms"),
                "on_timeout": "fail"
            }
        }],
        "edges": []
    });
    publish(&stack, &graph).await;
    let run = "order-backdated";

    let before_start = now_ms();
    stack.send(&start_run(run, "gate-first", &input(run))).await;
    let after_start = now_ms();
    let proposal = json!({
        "node": "refund",
        "step_id": "refund#1",
        "tool": "http",
        "args": {"order_id": run, "amount": 120}
    });
    let hash = sortie_core::ids::proposal_hash(&proposal);
    let interrupt_id = sortie_core::ids::interrupt_id(run, "refund#1", &hash);

    // The gate opens at the StartRun's record time (between `before_start` and
    // `after_start`) and expires TIMEOUT later; the approval is produced after that.
    let expired = after_start + TIMEOUT + 500;
    sortie_tests::wait_until("the approval's expiry to pass", LONG, || async {
        now_ms() > expired
    })
    .await;
    let approve = decision_on(run, "approve-backdated", &interrupt_id, &hash, true, None);
    send_at(&stack, &approve, before_start + TIMEOUT / 3).await;

    let _reducer = stack.reducer("0");
    assert_eq!(
        rejected(&stack, run, "approve-backdated").await,
        "expired",
        "{}",
        history(&stack, run).await
    );
    let state = wait_status(&stack, run, RunStatus::Failed).await;
    let events = events(&stack, run).await;
    assert!(dispatches(&events, "refund").is_empty(), "{state:#?}");
    let interrupt = state
        .interrupts
        .values()
        .find(|i| i.interrupt_id == interrupt_id)
        .unwrap_or_else(|| panic!("the gate's interrupt: {state:#?}"));
    assert_eq!(interrupt.status, InterruptStatus::Expired, "{interrupt:#?}");
}
