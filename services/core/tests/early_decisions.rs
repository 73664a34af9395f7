//! A decision that arrives before its interrupt is registered is buffered, not lost: it is
//! applied (and answered) the moment the interrupt appears, and rejected if the run ends
//! first. Interrupt ids are derived, so an approver can know one in advance.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use serde_json::json;
use sortie_core::{
    apply, ids, input::Command, CommandBody, Effect, EventBody, Graph, Graphs, Input, RunState,
    StepOutcome, StepReport,
};

const GRAPH: &str = "id: g\nversion: 1\nnodes:\n  - {id: read, tool: echo, side_effect: pure}\n  - {id: pay, tool: http, side_effect: keyed, args: {amount: $steps.read.output.amount}, interrupt_before: {reason: money, timeout: 1h}}\nedges:\n  - {from: read, to: pay}\n";

fn graphs() -> Graphs {
    let mut graphs = Graphs::new();
    graphs.insert(Graph::parse(GRAPH).unwrap()).unwrap();
    graphs
}

fn command(id: &str, at: i64, body: CommandBody) -> Input {
    Input::Command(Command {
        command_id: id.into(),
        tenant: "t".into(),
        run_id: "r".into(),
        principal: "alice".into(),
        roles: vec![],
        at,
        body,
        groups: vec![],
    })
}

fn names(effects: &[Effect]) -> Vec<String> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Emit(event) => Some(match &event.body {
                EventBody::CommandAccepted { command_id, .. } => {
                    format!("CommandAccepted {command_id}")
                }
                EventBody::CommandRejected {
                    command_id, code, ..
                } => format!("CommandRejected {command_id} {code}"),
                other => other.name().to_owned(),
            }),
            _ => None,
        })
        .collect()
}

fn started(graphs: &Graphs) -> RunState {
    let start = command(
        "start",
        1,
        CommandBody::StartRun {
            graph_id: "g".into(),
            graph_version: None,
            input: json!({}),
            labels: BTreeMap::new(),
            budget: None,
            fork: None,
            parent: None,
        },
    );
    apply(None, &start, graphs).state.unwrap()
}

/// The interrupt id and hash the run will register once `read` returns `amount`.
fn expected_interrupt(amount: i64) -> (String, String) {
    let proposal =
        json!({"node": "pay", "step_id": "pay#1", "tool": "http", "args": {"amount": amount}});
    let hash = ids::proposal_hash(&proposal);
    (ids::interrupt_id("r", "pay#1", &hash), hash)
}

fn read_done(graphs: &Graphs, state: &RunState, amount: i64) -> (Vec<Effect>, RunState) {
    let op = state.steps["read#1"].operation_id.clone();
    let report = Input::StepReport(StepReport {
        spent: None,
        operation_id: op,
        attempt: 1,
        tenant: "t".into(),
        run_id: "r".into(),
        step_id: "read#1".into(),
        outcome: StepOutcome::Succeeded {
            output: json!({"amount": amount}),
        },
        at: 5,
    });
    let applied = apply(Some(state), &report, graphs);
    (applied.effects, applied.state.unwrap())
}

#[test]
fn an_early_approval_is_applied_when_its_interrupt_appears() {
    let graphs = graphs();
    let state = started(&graphs);
    let (interrupt_id, hash) = expected_interrupt(30);
    let early = command(
        "early",
        2,
        CommandBody::ResumeRun {
            interrupt_id,
            proposal_hash: hash,
            approve: true,
            payload: None,
            comment: None,
            edited_args: None,
        },
    );
    let buffered = apply(Some(&state), &early, &graphs);
    assert_eq!(names(&buffered.effects), vec!["DecisionBuffered"]);
    let state = buffered.state.unwrap();
    assert_eq!(state.buffered.len(), 1);
    // Sent again while waiting: still one.
    assert!(apply(Some(&state), &early, &graphs).effects.is_empty());

    let (effects, state) = read_done(&graphs, &state, 30);
    assert_eq!(
        names(&effects),
        vec![
            "StepSucceeded",
            "Interrupted",
            "CommandAccepted early",
            "InterruptDecided",
            "StepDispatched"
        ],
        "approved at once: the run never waited"
    );
    assert!(state.buffered.is_empty());
    assert_eq!(state.steps["pay#1"].args, json!({"amount": 30}));
}

#[test]
fn an_early_decision_for_another_proposal_is_rejected_when_the_interrupt_appears() {
    let graphs = graphs();
    let state = started(&graphs);
    // The approver agreed to 30; the run proposes 3000 under another interrupt id, so the
    // early decision never matches and is answered when the run ends.
    let (interrupt_id, hash) = expected_interrupt(30);
    let early = command(
        "early",
        2,
        CommandBody::ResumeRun {
            interrupt_id,
            proposal_hash: hash,
            approve: true,
            payload: None,
            comment: None,
            edited_args: None,
        },
    );
    let state = apply(Some(&state), &early, &graphs).state.unwrap();
    let (effects, state) = read_done(&graphs, &state, 3000);
    assert_eq!(
        names(&effects),
        vec!["StepSucceeded", "Interrupted", "RunStatusChanged"],
        "nothing dispatched without approval"
    );
    let cancel = command("cancel", 9, CommandBody::CancelRun { reason: None });
    let ended = apply(Some(&state), &cancel, &graphs);
    let names = names(&ended.effects);
    assert!(
        names.contains(&"CommandRejected early unknown_interrupt".to_owned()),
        "{names:?}"
    );
    assert!(ended.state.unwrap().buffered.is_empty());
}
