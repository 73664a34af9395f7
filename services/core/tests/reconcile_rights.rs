//! Issue #14, item 2: recording an operation's outcome can mark an unsafe payment done, so
//! `ReconcileOperation` needs the `operator` role, and is refused for an operation that
//! still has an attempt in flight — only an unknown outcome is an operator's to record.
//! Checked red: with the role check removed the first test's approver reconciled the
//! payment; with `Started | InFlight` allowed again the second test's reconciliation of a
//! call in flight was accepted.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use serde_json::json;
use sortie_core::{
    apply, input::Command, CommandBody, Effect, EventBody, Graph, Graphs, Input, RunState,
    StepOutcome, StepReport,
};

const GRAPH: &str = "id: g\nversion: 1\nnodes:\n  - {id: pay, tool: http, side_effect: unsafe}\n";

struct Run {
    graphs: Graphs,
    state: Option<RunState>,
    at: i64,
}

impl Run {
    fn start() -> Run {
        let mut graphs = Graphs::new();
        graphs.insert(Graph::parse(GRAPH).unwrap()).unwrap();
        let mut run = Run {
            graphs,
            state: None,
            at: 0,
        };
        run.command(
            &[],
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
        run
    }

    fn apply(&mut self, input: Input) -> Vec<EventBody> {
        let applied = apply(self.state.as_ref(), &input, &self.graphs);
        self.state = applied.state;
        applied
            .effects
            .into_iter()
            .filter_map(|e| match e {
                Effect::Emit(event) => Some(event.body),
                _ => None,
            })
            .collect()
    }

    fn command(&mut self, roles: &[&str], body: CommandBody) -> Vec<EventBody> {
        self.at += 1;
        self.apply(Input::Command(Command {
            command_id: format!("c{}", self.at),
            tenant: "t".into(),
            run_id: "r".into(),
            principal: "someone".into(),
            roles: roles.iter().map(|r| (*r).to_owned()).collect(),
            groups: vec![],
            at: self.at,
            body,
        }))
    }

    fn report(&mut self, outcome: StepOutcome) {
        self.at += 1;
        let step = self.state.as_ref().unwrap().steps.values().next().unwrap();
        let report = StepReport {
            spent: None,
            operation_id: step.operation_id.clone(),
            attempt: step.attempt,
            tenant: "t".into(),
            run_id: "r".into(),
            step_id: step.step_id.clone(),
            outcome,
            at: self.at,
        };
        self.apply(Input::StepReport(report));
    }

    fn reconcile(&mut self, roles: &[&str]) -> String {
        let operation_id = self
            .state
            .as_ref()
            .unwrap()
            .steps
            .values()
            .next()
            .unwrap()
            .operation_id
            .clone();
        let events = self.command(
            roles,
            CommandBody::ReconcileOperation {
                operation_id,
                succeeded: true,
                output: Some(json!({"ref": "W-1"})),
                error: None,
            },
        );
        match &events[0] {
            EventBody::CommandAccepted { .. } => "accepted".into(),
            EventBody::CommandRejected { code, .. } => code.clone(),
            other => format!("{other:?}"),
        }
    }
}

#[test]
fn only_an_operator_records_an_unknown_outcome() {
    let mut run = Run::start();
    run.report(StepOutcome::Started);
    run.report(StepOutcome::Unknown {
        code: "timeout".into(),
        message: "no answer".into(),
    });
    assert_eq!(run.reconcile(&[]), "forbidden");
    assert_eq!(run.reconcile(&["approver", "viewer"]), "forbidden");
    assert_eq!(run.reconcile(&["operator"]), "accepted");
    assert_eq!(run.state.unwrap().status.as_str(), "succeeded");
}

#[test]
fn a_call_in_flight_is_not_reconciled() {
    let mut run = Run::start();
    // Dispatched, then started: the executor is calling the receiver right now.
    assert_eq!(run.reconcile(&["operator"]), "bad_state");
    run.report(StepOutcome::Started);
    assert_eq!(run.reconcile(&["operator"]), "bad_state");
    assert_eq!(run.state.unwrap().status.as_str(), "running");
}
