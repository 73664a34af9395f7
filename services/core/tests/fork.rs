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
            budget: None,
        },
    })
}

fn succeed(state: &RunState, step: &str, at: i64, output: Value) -> Input {
    let s = &state.steps[step];
    Input::StepReport(StepReport {
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
