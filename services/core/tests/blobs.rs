//! Large values by reference, as the fold sees them (`sortie_core::blob`): the fold never
//! reads a blob, so a template path that goes *into* a referenced input or output renders
//! as that reference narrowed by the rest of the path, and the executor resolves it. The
//! same inputs give the same intents (replays and audits fold the same), and the run's
//! state keeps the small reference, not the value. (Checked: with `render` reading
//! through `json::at_path` instead of `blob::project`, `total`'s arguments are `null`.)

#![allow(clippy::unwrap_used)]

use serde_json::{json, Value};
use sortie_core::blob::{BlobKey, BlobRef, JSON_MEDIA_TYPE};
use sortie_core::{
    apply, input::Command, CommandBody, Effect, Graph, Graphs, Input, RunState, StepOutcome,
    StepReport,
};

const GRAPH: &str = "id: big\nversion: 1\nnodes:\n  - {id: read, tool: echo, side_effect: pure, args: {doc: $input.doc, whole: $input}}\n  - {id: total, tool: echo, side_effect: pure, args: {total: $steps.read.output.doc.total, first: $steps.read.output.doc.items.0, small: $steps.read.output.small}}\nedges:\n  - {from: read, to: total}\n";

fn reference(tenant: &str, run: &str, value: &Value) -> Value {
    let bytes = serde_json::to_vec(value).unwrap();
    let key = BlobKey::for_bytes(tenant, run, &bytes);
    BlobRef::new(&key, &bytes, JSON_MEDIA_TYPE).to_value()
}

fn start(input: Value) -> Input {
    Input::Command(Command {
        command_id: "start".into(),
        tenant: "t".into(),
        run_id: "r".into(),
        principal: "svc".into(),
        roles: vec![],
        at: 1,
        body: CommandBody::StartRun {
            graph_id: "big".into(),
            graph_version: None,
            input,
            labels: Default::default(),
            budget: None,
            fork: None,
            parent: None,
        },
        groups: vec![],
    })
}

fn dispatched(effects: &[Effect]) -> Vec<&sortie_core::Intent> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Dispatch(intent) => Some(intent),
            _ => None,
        })
        .collect()
}

fn run_once() -> (Vec<Value>, RunState) {
    let mut graphs = Graphs::new();
    graphs.insert(Graph::parse(GRAPH).unwrap()).unwrap();
    let doc = json!({"text": "x".repeat(1000), "total": 42, "items": ["a", "b"]});
    let input_ref = reference("t", "r", &doc);
    let applied = apply(None, &start(json!({"doc": input_ref})), &graphs);
    let state = applied.state.unwrap();
    let read = dispatched(&applied.effects)[0].clone();
    // A whole reference passes as it is; the input keeps the reference.
    assert_eq!(read.args["doc"], input_ref);
    assert_eq!(read.args["whole"]["doc"], input_ref);

    // `read` answers with its document stored by reference (as the executor reports it).
    let output_ref = reference("t", "r", &json!({"stored": true}));
    let report = Input::StepReport(StepReport {
        spent: None,
        operation_id: read.operation_id.clone(),
        attempt: 1,
        tenant: "t".into(),
        run_id: "r".into(),
        step_id: read.step_id.clone(),
        outcome: StepOutcome::Succeeded {
            output: json!({"doc": output_ref, "small": 7}),
        },
        at: 2,
    });
    let applied = apply(Some(&state), &report, &graphs);
    let total = dispatched(&applied.effects)[0].clone();
    (
        vec![
            total.args["total"].clone(),
            total.args["first"].clone(),
            total.args["small"].clone(),
            json!(total.operation_id),
        ],
        applied.state.unwrap(),
    )
}

#[test]
fn paths_into_a_reference_render_as_the_reference_with_the_rest_of_the_path() {
    let (args, state) = run_once();
    let total = BlobRef::from_value(&args[0]).expect("a reference");
    assert_eq!(total.path.as_deref(), Some("total"));
    let first = BlobRef::from_value(&args[1]).expect("a reference");
    assert_eq!(first.path.as_deref(), Some("items.0"));
    assert_eq!(total.uri, first.uri);
    // A path beside the reference reads as before.
    assert_eq!(args[2], json!(7));
    // The state holds references, never the values.
    assert!(sortie_core::limits::json_len(&state) < 8 * 1024);
    // Deterministic: the same history renders the same arguments and operation ids.
    let (again, _) = run_once();
    assert_eq!(args, again);
}
