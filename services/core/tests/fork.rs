//! Forking a run from a checkpoint (issue #15 item 5): the new run keeps the steps
//! completed by then — outputs and operation ids, never dispatched again — dispatches
//! unsettled pure/idempotent steps anew under new operation ids, and sends unsettled
//! keyed/reconcilable/unsafe steps to an operator. Its lineage is in its state.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use serde_json::{json, Value};
use sortie_core::{
    apply, evolve,
    input::{Command, ForkSource},
    state::StepStatus,
    Applied, CommandBody, Effect, Event, Graph, Graphs, Input, RunState, RunStatus, StepOutcome,
    StepReport,
};

const REFUND: &str = "id: refund
version: 1
nodes:
  - {id: read, tool: echo, side_effect: pure, args: {order: $input.order}}
  - {id: refund, tool: http, side_effect: keyed, args: {order: $steps.read.output.order}}
  - {id: notify, tool: echo, side_effect: idempotent, args: {order: $input.order}}
edges:
  - {from: read, to: refund}
  - {from: refund, to: notify}
";

fn graphs() -> Graphs {
    let mut graphs = Graphs::new();
    graphs.insert(Graph::parse(REFUND).unwrap()).unwrap();
    graphs
}

fn start(run_id: &str, at: i64, input: Value, fork: Option<ForkSource>) -> Input {
    Input::Command(Command {
        command_id: format!("start-{run_id}"),
        tenant: "acme".into(),
        run_id: run_id.into(),
        principal: "user:ops".into(),
        roles: vec![],
        groups: vec![],
        at,
        body: CommandBody::StartRun {
            graph_id: "refund".into(),
            graph_version: Some(1),
            input,
            labels: BTreeMap::new(),
            fork,
            parent: None,
            budget: None,
        },
    })
}

fn succeed(state: &RunState, step: &str, at: i64, output: Value) -> Input {
    let s = &state.steps[step];
    Input::StepReport(StepReport {
        spent: None,
        operation_id: s.operation_id.clone(),
        attempt: s.attempt,
        tenant: "acme".into(),
        run_id: state.run_id.clone(),
        step_id: step.into(),
        outcome: StepOutcome::Succeeded { output },
        at,
    })
}

fn dispatched(applied: &Applied) -> Vec<(String, String)> {
    applied
        .effects
        .iter()
        .filter_map(|e| match e {
            Effect::Dispatch(i) => Some((i.step_id.clone(), i.operation_id.clone())),
            _ => None,
        })
        .collect()
}

fn events(applied: &Applied) -> Vec<Event> {
    applied
        .effects
        .iter()
        .filter_map(|e| match e {
            Effect::Emit(event) => Some(event.clone()),
            _ => None,
        })
        .collect()
}

/// The source run's state after each input: version → state.
fn source(graphs: &Graphs) -> BTreeMap<i64, RunState> {
    let mut versions = BTreeMap::new();
    let s1 = apply(
        None,
        &start("src", 1, json!({"order": "o-1"}), None),
        graphs,
    )
    .state
    .unwrap(); // read#1 in flight
    versions.insert(s1.version, s1.clone());
    let s2 = apply(
        Some(&s1),
        &succeed(&s1, "read#1", 2, json!({"order": "o-1"})),
        graphs,
    )
    .state
    .unwrap(); // refund#1 in flight
    versions.insert(s2.version, s2.clone());
    let s3 = apply(
        Some(&s2),
        &succeed(&s2, "refund#1", 3, json!({"refunded": 30})),
        graphs,
    )
    .state
    .unwrap(); // notify#1 in flight
    versions.insert(s3.version, s3.clone());
    versions
}

fn fork(graphs: &Graphs, from: &RunState, run_id: &str, input: Value) -> Applied {
    let source = ForkSource {
        run_id: from.run_id.clone(),
        version: from.version,
        state: serde_json::to_value(from).unwrap(),
        history: None,
    };
    let applied = apply(None, &start(run_id, 100, input, Some(source)), graphs);
    // Event-sourced: the new run's history alone rebuilds its state.
    let refolded = events(&applied)
        .iter()
        .filter(|e| e.seq > 0)
        .fold(None, evolve);
    assert_eq!(refolded, applied.state);
    applied
}

#[test]
fn completed_steps_are_kept_and_never_dispatched_again() {
    let graphs = graphs();
    let versions = source(&graphs);
    let at = &versions[&3];
    let applied = fork(&graphs, at, "fork-1", json!({"order": "o-1"}));
    let state = applied.state.clone().unwrap();
    for step in ["read#1", "refund#1"] {
        assert_eq!(state.steps[step].status, StepStatus::Succeeded, "{step}");
        assert_eq!(state.steps[step].operation_id, at.steps[step].operation_id);
        assert_eq!(state.steps[step].output, at.steps[step].output);
    }
    assert_eq!(state.completed, ["read#1", "refund#1"]);
    // notify#1 was in flight (idempotent): dispatched again, under a new operation id.
    let out = dispatched(&applied);
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(out[0].0, "notify#1");
    assert_ne!(out[0].1, at.steps["notify#1"].operation_id);
    assert_eq!(
        state.forked_from,
        Some(json!({"run_id": "src", "version": 3}))
    );
    assert_eq!(state.status, RunStatus::Running);
}

#[test]
fn a_keyed_call_in_flight_at_the_checkpoint_waits_for_an_operator() {
    let graphs = graphs();
    let versions = source(&graphs);
    let applied = fork(&graphs, &versions[&2], "fork-2", json!({"order": "o-1"}));
    let state = applied.state.clone().unwrap();
    assert!(
        dispatched(&applied).is_empty(),
        "the refund is not sent again"
    );
    assert_eq!(state.steps["refund#1"].status, StepStatus::NeedsOperator);
    assert_eq!(
        state.steps["refund#1"].operation_id, versions[&2].steps["refund#1"].operation_id,
        "the source's operation id, to look up what happened there"
    );
    assert_eq!(state.status, RunStatus::NeedsReconciliation);
}

#[test]
fn a_pure_step_in_flight_runs_again_with_the_patched_input() {
    let graphs = graphs();
    let versions = source(&graphs);
    let applied = fork(&graphs, &versions[&1], "fork-3", json!({"order": "o-2"}));
    let out = dispatched(&applied);
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(out[0].0, "read#1");
    assert_ne!(out[0].1, versions[&1].steps["read#1"].operation_id);
}

#[test]
fn a_fork_must_carry_the_named_run_of_its_tenant() {
    let graphs = graphs();
    let versions = source(&graphs);
    let mut other = versions[&3].clone();
    other.tenant = "globex".into();
    let source = ForkSource {
        run_id: "src".into(),
        version: 3,
        state: serde_json::to_value(&other).unwrap(),
        history: None,
    };
    let applied = apply(
        None,
        &start("fork-4", 100, json!({}), Some(source)),
        &graphs,
    );
    assert!(applied.state.is_none());
    assert!(events(&applied).iter().any(|e| matches!(
        &e.body,
        sortie_core::EventBody::CommandRejected { code, .. } if code == "bad_fork"
    )));
}

// ---------------------------------------------------------------- gates (issue #36 item 1)

/// A payment whose transfer (idempotent) and wire (unsafe) each wait for an approver.
const PAY: &str = "id: pay
version: 1
nodes:
  - {id: quote, tool: echo, side_effect: pure, args: {amount: $input.amount}}
  - id: transfer
    tool: http
    side_effect: idempotent
    args: {amount: $steps.quote.output.amount, note: $interrupt.payload.note}
    interrupt_before: {reason: money moves, required_role: approver, timeout: 1h}
  - id: wire
    tool: http
    side_effect: unsafe
    args: {amount: $input.amount}
    interrupt_before: {reason: money moves, required_role: approver, timeout: 1h}
edges:
  - {from: quote, to: transfer}
  - {from: transfer, to: wire}
";

fn pay_graphs() -> Graphs {
    let mut graphs = Graphs::new();
    graphs.insert(Graph::parse(PAY).unwrap()).unwrap();
    graphs
}

fn pay_start(run_id: &str, at: i64, amount: i64, fork: Option<ForkSource>) -> Input {
    let Input::Command(mut command) = start(run_id, at, json!({"amount": amount}), fork) else {
        unreachable!()
    };
    if let CommandBody::StartRun { graph_id, .. } = &mut command.body {
        *graph_id = "pay".into();
    }
    Input::Command(command)
}

/// The pay run up to its transfer approved (with the approver's note) and in flight:
/// every version's state, and the whole history.
fn pay_source(graphs: &Graphs) -> (BTreeMap<i64, RunState>, Vec<Event>) {
    let mut versions = BTreeMap::new();
    let mut history = Vec::new();
    let mut state: Option<RunState> = None;
    let mut step = |state: &mut Option<RunState>, input: Input| {
        let applied = apply(state.as_ref(), &input, graphs);
        history.extend(events(&applied).into_iter().filter(|e| e.seq > 0));
        *state = applied.state;
        let s = state.clone().unwrap();
        versions.insert(s.version, s);
    };
    step(&mut state, pay_start("pay-src", 1, 30, None));
    let quoted = succeed(state.as_ref().unwrap(), "quote#1", 2, json!({"amount": 30}));
    step(&mut state, quoted);
    let interrupt = state
        .as_ref()
        .unwrap()
        .interrupts
        .values()
        .next()
        .unwrap()
        .clone();
    let approve = Input::Command(Command {
        command_id: "approve-1".into(),
        tenant: "acme".into(),
        run_id: "pay-src".into(),
        principal: "user:alice".into(),
        roles: vec!["approver".into()],
        groups: vec![],
        at: 3,
        body: CommandBody::ResumeRun {
            interrupt_id: interrupt.interrupt_id.clone(),
            proposal_hash: interrupt.proposal_hash.clone(),
            approve: true,
            payload: Some(json!({"note": "checked with the customer"})),
            comment: None,
            edited_args: None,
        },
    });
    step(&mut state, approve);
    let s = state.as_ref().unwrap();
    assert_eq!(s.steps["transfer#1"].status, StepStatus::InFlight);
    assert_eq!(
        s.steps["transfer#1"].args["note"], "checked with the customer",
        "the approved call carries the approver's payload"
    );
    (versions, history)
}

fn fork_pay(graphs: &Graphs, from: &RunState, run_id: &str, amount: i64) -> Applied {
    let source = ForkSource {
        run_id: from.run_id.clone(),
        version: from.version,
        state: serde_json::to_value(from).unwrap(),
        history: None,
    };
    apply(None, &pay_start(run_id, 100, amount, Some(source)), graphs)
}

/// Seen red: before forks took gates from the graph, the approved transfer in flight was
/// dispatched again at once in the fork, its arguments rendered from the patched input
/// without the approver's note — a call no approver saw.
#[test]
fn an_approved_gated_call_in_flight_is_proposed_again_not_dispatched() {
    let graphs = pay_graphs();
    let (versions, _) = pay_source(&graphs);
    let at = versions.values().last().unwrap();
    let applied = fork_pay(&graphs, at, "pay-fork", 999);
    assert!(
        dispatched(&applied).is_empty(),
        "nothing gated runs without an approval in the fork: {:?}",
        dispatched(&applied)
    );
    let state = applied.state.unwrap();
    assert_eq!(state.status, RunStatus::WaitingApproval);
    assert!(!state.steps.contains_key("transfer#1"));
    let open: Vec<_> = state.open_interrupts().collect();
    assert_eq!(open.len(), 1, "{:?}", state.interrupts);
    assert_eq!(open[0].step_id, "transfer#1");
    assert!(
        open[0].approvals.is_empty(),
        "no decision of the source counts"
    );
    assert!(
        !at.interrupts.contains_key(&open[0].interrupt_id),
        "a fresh interrupt of the fork"
    );
    // The source's approval is not carried: its call had not settled.
    assert!(state
        .interrupts
        .values()
        .all(|i| i.status != sortie_core::state::InterruptStatus::Approved));
}

/// Seen red: the fork read the side-effect class from the carried state, so a state
/// claiming the gated `unsafe` wire is a `pure` step in flight had it dispatched at once.
#[test]
fn classes_and_gates_come_from_the_graph_not_the_carried_state() {
    let graphs = pay_graphs();
    let (versions, _) = pay_source(&graphs);
    let mut forged = versions.values().last().unwrap().clone();
    let mut wire = sortie_core::state::Step::clone(&forged.steps["transfer#1"]);
    wire.step_id = "wire#1".into();
    wire.node = "wire".into();
    wire.tool = "http".into();
    wire.side_effect = sortie_core::SideEffect::Pure;
    wire.args = json!({"amount": 1_000_000});
    forged.steps.insert("wire#1".into(), wire.into());
    let applied = fork_pay(&graphs, &forged, "pay-forged", 30);
    assert!(
        dispatched(&applied).is_empty(),
        "{:?}",
        dispatched(&applied)
    );
    let state = applied.state.unwrap();
    assert_eq!(state.steps["wire#1"].status, StepStatus::NeedsOperator);
    assert_eq!(
        state.steps["wire#1"].side_effect,
        sortie_core::SideEffect::Unsafe,
        "the graph's class"
    );
}

/// The reducer's check of a fork's source: the carried history, held to the head the
/// reducer holds, decides the state — never a state the sender claims.
#[test]
fn a_forks_source_is_its_own_history_held_to_its_chain_head() {
    use sortie_core::decide::fork::verified_source;
    let graphs = pay_graphs();
    let (versions, history) = pay_source(&graphs);
    let head = versions.values().last().unwrap().clone();
    let at = |version: i64, history: Option<Vec<Event>>| ForkSource {
        run_id: head.run_id.clone(),
        version,
        state: serde_json::to_value(&versions[&1]).unwrap(),
        history,
    };
    let plain = sortie_core::Plain;
    // The latest version needs no history: the head is the state.
    assert_eq!(
        verified_source(&head, &at(head.version, None), &plain),
        Ok(head.clone())
    );
    // An earlier one does, and gets the state the history folds to, whatever was claimed.
    let err = verified_source(&head, &at(2, None), &plain).unwrap_err();
    assert!(err.contains("must carry"), "{err}");
    assert_eq!(
        verified_source(&head, &at(2, Some(history.clone())), &plain),
        Ok(versions[&2].clone())
    );
    // A cut history, an event changed, a forged history chained anew: refused.
    let mut cut = history.clone();
    cut.pop();
    assert!(verified_source(&head, &at(2, Some(cut)), &plain).is_err());
    let mut changed = history.clone();
    let success = changed
        .iter_mut()
        .find_map(|e| match &mut e.body {
            sortie_core::EventBody::StepSucceeded { output, .. } => Some(output),
            _ => None,
        })
        .expect("quote's success");
    *success = json!({"amount": 1});
    let err = verified_source(&head, &at(2, Some(changed.clone())), &plain).unwrap_err();
    assert!(err.contains("does not hash"), "{err}");
    let mut prev = None;
    for event in &mut changed {
        event.prev_hash = prev.clone();
        event.hash = Some(event.compute_hash());
        prev = event.hash.clone();
    }
    let err = verified_source(&head, &at(2, Some(changed)), &plain).unwrap_err();
    assert!(err.contains("chain head"), "{err}");
    let err = verified_source(&head, &at(99, Some(history)), &plain).unwrap_err();
    assert!(err.contains("no version"), "{err}");
}

/// Issue #57: a fork made under an `Idempotency-Key` without a run id gets a `key_…_n`
/// id the reducer recomputes from the tenant and the key (the command id), so nobody who
/// guesses the key takes it first; the same id under another key, or on a start that is
/// no fork, is refused `bad_run_id`. Seen red with the fork candidates not recognised
/// (`is_keyed_id` ignoring `fork`): the gateway's own fork was refused.
#[test]
fn a_keyed_fork_id_is_taken_only_by_the_fork_that_derives_it() {
    use sortie_core::ids::keyed_fork_id;
    let graphs = graphs();
    let versions = source(&graphs);
    let from = &versions[&3];
    let id = keyed_fork_id("acme", "fork-key", 3);
    let attempt = |command_id: &str, forked: bool| {
        let source = forked.then(|| ForkSource {
            run_id: from.run_id.clone(),
            version: from.version,
            state: serde_json::to_value(from).unwrap(),
            history: None,
        });
        let mut input = start(&id, 100, json!({"order": "o-1"}), source);
        if let Input::Command(c) = &mut input {
            c.command_id = command_id.into();
        }
        apply(None, &input, &graphs)
    };
    let refused = |applied: &Applied| {
        applied.state.is_none()
            && events(applied).iter().any(|e| {
                matches!(&e.body, sortie_core::EventBody::CommandRejected { code, .. } if code == "bad_run_id")
            })
    };
    assert!(refused(&attempt("guessed-wrong", true)));
    assert!(
        refused(&attempt("fork-key", false)),
        "a start that is no fork"
    );
    let owner = attempt("fork-key", true);
    assert_eq!(owner.state.map(|s| s.run_id), Some(id));
}
