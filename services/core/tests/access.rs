//! Issue #14, item 2: a graph says who may start and cancel its runs (`access`), and the
//! fold refuses the rest `forbidden` — a viewer cannot cancel a run it can read, and a
//! principal without the start role starts nothing. Without `access` anyone of the
//! tenant may, as before. Checked red: with `Access::refusal` answering `None` both
//! tests fail (the viewer's cancel is accepted; the start without the role starts a run).

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use serde_json::json;
use sortie_core::{apply, input::Command, CommandBody, Effect, EventBody, Graph, Graphs, Input};
use sortie_core::{RunState, RunStatus};

const GUARDED: &str = "id: g\nversion: 1\naccess: {start: [starter], cancel: [operator]}\nnodes:\n  - {id: wait, tool: http, side_effect: idempotent}\n";
const OPEN: &str =
    "id: open\nversion: 1\nnodes:\n  - {id: wait, tool: http, side_effect: idempotent}\n";

fn graphs() -> Graphs {
    let mut graphs = Graphs::new();
    graphs.insert(Graph::parse(GUARDED).unwrap()).unwrap();
    graphs.insert(Graph::parse(OPEN).unwrap()).unwrap();
    graphs
}

fn command(id: &str, run: &str, roles: &[&str], body: CommandBody) -> Input {
    Input::Command(Command {
        command_id: id.into(),
        tenant: "t".into(),
        run_id: run.into(),
        principal: "someone".into(),
        roles: roles.iter().map(|r| (*r).to_owned()).collect(),
        groups: vec![],
        at: 1,
        body,
    })
}

fn start(graph: &str) -> CommandBody {
    CommandBody::StartRun {
        graph_id: graph.into(),
        graph_version: None,
        input: json!({}),
        labels: BTreeMap::new(),
        budget: None,
        fork: None,
        parent: None,
    }
}

fn cancel() -> CommandBody {
    CommandBody::CancelRun { reason: None }
}

fn rejected(effects: &[Effect]) -> Option<(String, String)> {
    effects.iter().find_map(|e| match e {
        Effect::Emit(event) => match &event.body {
            EventBody::CommandRejected { code, reason, .. } => Some((code.clone(), reason.clone())),
            _ => None,
        },
        _ => None,
    })
}

#[test]
fn only_the_graphs_start_role_starts_its_runs() {
    let graphs = graphs();
    let refused = apply(None, &command("c1", "r", &["viewer"], start("g")), &graphs);
    let (code, reason) = rejected(&refused.effects).expect("refused");
    assert_eq!(code, "forbidden");
    assert!(reason.contains("starter"), "{reason}");
    assert!(refused.state.is_none(), "no run was started");

    let started = apply(None, &command("c2", "r", &["starter"], start("g")), &graphs);
    assert_eq!(started.state.unwrap().status, RunStatus::Running);

    let open = apply(None, &command("c3", "o", &[], start("open")), &graphs);
    assert!(
        open.state.is_some(),
        "a graph without access: anyone of the tenant"
    );
}

#[test]
fn a_viewer_cannot_cancel_and_an_operator_can() {
    let graphs = graphs();
    let state: RunState = apply(None, &command("c1", "r", &["starter"], start("g")), &graphs)
        .state
        .unwrap();
    let viewer = apply(
        Some(&state),
        &command("c2", "r", &["viewer"], cancel()),
        &graphs,
    );
    let (code, _) = rejected(&viewer.effects).expect("refused");
    assert_eq!(code, "forbidden");
    let after = viewer.state.unwrap();
    assert_eq!(after.status, RunStatus::Running, "still running");

    let operator = apply(
        Some(&after),
        &command("c3", "r", &["operator"], cancel()),
        &graphs,
    );
    assert!(rejected(&operator.effects).is_none());
    assert_eq!(operator.state.unwrap().status, RunStatus::Cancelling);
}
