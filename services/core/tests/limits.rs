//! A run never writes more than Kafka can hold (`sortie_core::limits`): an input that would
//! break a limit is answered — rejected, or turned into a step failure the node's policy
//! handles — and the run's history stays foldable. Without these checks the reducer would
//! produce a record over `max.message.bytes`, abort its transaction and replay the batch
//! forever (checked: with `apply` returning the unchecked result, the first two tests fail;
//! the third fails without the bound in `evolve`).

#![allow(clippy::unwrap_used)]

use serde_json::json;
use sortie_core::limits::{MAX_REJECTED_COMMANDS, MAX_STATE_BYTES};
use sortie_core::state::StepStatus;
use sortie_core::{
    apply, input::Command, CommandBody, Effect, EventBody, Graph, Graphs, Input, RunState,
    RunStatus, StepOutcome, StepReport,
};

/// Four nodes that each take the whole input as their arguments: a 200 KiB input makes a
/// state of over 800 KiB once they are dispatched.
const FAN: &str = "id: fan\nversion: 1\nnodes:\n  - {id: a, tool: echo, side_effect: pure, args: {data: $input.data}}\n  - {id: b, tool: echo, side_effect: pure, args: {data: $input.data}}\n  - {id: c, tool: echo, side_effect: pure, args: {data: $input.data}}\n  - {id: d, tool: echo, side_effect: pure, args: {data: $input.data}}\nedges: []\n";
const ONE: &str =
    "id: one\nversion: 1\nnodes:\n  - {id: a, tool: echo, side_effect: pure}\nedges: []\n";

fn graphs() -> Graphs {
    let mut graphs = Graphs::new();
    graphs.insert(Graph::parse(FAN).unwrap()).unwrap();
    graphs.insert(Graph::parse(ONE).unwrap()).unwrap();
    graphs
}

fn command(id: &str, body: CommandBody) -> Input {
    Input::Command(Command {
        command_id: id.into(),
        tenant: "t".into(),
        run_id: "r".into(),
        principal: "svc".into(),
        roles: vec![],
        at: 1,
        body,
        groups: vec![],
    })
}

fn start(graph: &str, input: serde_json::Value) -> Input {
    command(
        "start",
        CommandBody::StartRun {
            graph_id: graph.into(),
            graph_version: None,
            input,
            labels: Default::default(),
            budget: None,
            fork: None,
            parent: None,
        },
    )
}

fn rejections(effects: &[Effect]) -> Vec<(String, String)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Emit(event) => match &event.body {
                EventBody::CommandRejected { code, reason, .. } => {
                    Some((code.clone(), reason.clone()))
                }
                _ => None,
            },
            _ => None,
        })
        .collect()
}

#[test]
fn a_start_whose_run_would_outgrow_a_record_is_rejected_with_a_reason() {
    let graphs = graphs();
    let big = "x".repeat(200 * 1024);
    let applied = apply(None, &start("fan", json!({ "data": big })), &graphs);
    assert_eq!(applied.state, None, "nothing of the run is kept");
    let rejected = rejections(&applied.effects);
    assert_eq!(rejected.len(), 1, "{:?}", applied.effects.len());
    assert_eq!(rejected[0].0, "too_large");
    assert!(rejected[0].1.contains("limit"), "{}", rejected[0].1);

    // A small input of the same graph runs.
    let applied = apply(None, &start("fan", json!({ "data": "small" })), &graphs);
    assert_eq!(applied.state.map(|s| s.status), Some(RunStatus::Running));
}

#[test]
fn an_output_too_large_to_keep_fails_its_step_and_the_run_with_the_reason() {
    let graphs = graphs();
    let state = apply(None, &start("one", json!({})), &graphs)
        .state
        .unwrap();
    let step = state.steps.values().next().unwrap().clone();
    let report = Input::StepReport(StepReport {
        spent: None,
        operation_id: step.operation_id.clone(),
        attempt: 1,
        tenant: "t".into(),
        run_id: "r".into(),
        step_id: step.step_id.clone(),
        outcome: StepOutcome::Succeeded {
            output: json!({ "blob": "y".repeat(MAX_STATE_BYTES) }),
        },
        at: 2,
    });
    let applied = apply(Some(&state), &report, &graphs);
    let after = applied.state.unwrap();
    let step = &after.steps[&step.step_id];
    assert_eq!(step.status, StepStatus::Failed);
    assert!(
        step.error
            .as_deref()
            .unwrap_or_default()
            .contains("too_large")
            || step.error.as_deref().unwrap_or_default().contains("limit"),
        "{:?}",
        step.error
    );
    assert_eq!(after.status, RunStatus::Failed);
    assert!(sortie_core::limits::json_len(&after) < MAX_STATE_BYTES);
}

#[test]
fn only_the_last_rejected_commands_are_remembered() {
    let graphs = graphs();
    let mut state: RunState = apply(None, &start("one", json!({})), &graphs)
        .state
        .unwrap();
    for i in 0..(MAX_REJECTED_COMMANDS + 40) {
        // Approving an interrupt that does not exist: rejected every time.
        let resume = command(
            &format!("bad-{i}"),
            CommandBody::ResumeRun {
                interrupt_id: "int_none".into(),
                proposal_hash: "h".into(),
                approve: true,
                payload: None,
                comment: None,
                edited_args: None,
            },
        );
        state = apply(Some(&state), &resume, &graphs).state.unwrap();
    }
    assert_eq!(state.rejected.len(), MAX_REJECTED_COMMANDS);
    let rejected = state
        .commands
        .values()
        .filter(|a| matches!(a, sortie_core::state::Answer::Rejected { .. }))
        .count();
    assert_eq!(rejected, MAX_REJECTED_COMMANDS);
    assert!(
        !state.commands.contains_key("bad-0"),
        "the oldest is forgotten"
    );
    assert!(state
        .commands
        .contains_key(&format!("bad-{}", MAX_REJECTED_COMMANDS + 39)));
}

/// Graph definitions are held to the payload shape too: a node's `args` nested past
/// `MAX_DEPTH` is refused by name when the graph is parsed (checked red with
/// `Graph::check_limits` not called: the graph parsed).
#[test]
fn a_graph_whose_args_nest_too_deep_is_refused_by_name() {
    let mut args = String::from("1");
    for _ in 0..=sortie_core::limits::MAX_DEPTH {
        args = format!("{{a: {args}}}");
    }
    let yaml = format!(
        "id: deep\nversion: 1\nnodes:\n  - {{id: a, tool: echo, side_effect: pure, args: {args}}}\nedges: []\n"
    );
    let refused = Graph::parse(&yaml).expect_err("too deep");
    let text = refused.to_string();
    assert!(text.contains("limit depth"), "{text}");
}

/// YAML aliases that expand exponentially ("billion laughs") inside a node's `args` do
/// not make the parser build the expansion: the definition is refused, and quickly.
#[test]
fn a_yaml_alias_bomb_is_refused_quickly() {
    let mut args = String::from("      x0: &x0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for i in 1..10 {
        let prev = i - 1;
        let refs = vec![format!("*x{prev}"); 9].join(", ");
        args.push_str(&format!("      x{i}: &x{i} [{refs}]\n"));
    }
    let yaml = format!(
        "id: bomb\nversion: 1\nnodes:\n  - id: a\n    tool: echo\n    side_effect: pure\n    args:\n{args}edges: []\n"
    );
    let started = std::time::Instant::now();
    let refused = Graph::parse(&yaml).expect_err("refused");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "{refused}"
    );
}

/// Found by the decoder campaign (`sortie-fuzz`, target `graph_yaml`): a node that
/// requests a node the graph does not have made `Graph::topological` subtract past zero
/// (a panic in debug builds, a wrap in release) instead of a refusal naming it.
#[test]
fn a_request_for_a_missing_node_is_refused_not_a_panic() {
    let yaml = "id: g\nversion: 1\nnodes:\n  - {id: a, tool: echo, side_effect: pure, may_request: [nowhere, elsewhere]}\nedges: []\n";
    let refused = Graph::parse(yaml).expect_err("refused");
    assert!(refused.to_string().contains("nowhere"), "{refused}");
}
