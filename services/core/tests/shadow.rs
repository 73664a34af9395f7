//! Shadow replay as a deploy gate (issue #15 item 6): a history re-decided against the
//! graph it ran with agrees; against a changed graph, the first differing decision is
//! named. (Every scenario file is also shadow-replayed by `support::run`.)

mod support;

use std::path::PathBuf;

use sortie_core::{shadow, Graph, Graphs};

fn file(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/scenarios")
        .join(format!("{name}.yaml"))
}

const REFUND_V1: &str = "id: refund
version: 1
nodes:
  - {id: read, tool: echo, side_effect: pure}
  - id: refund
    tool: http
    side_effect: keyed
    args: {amount: $steps.read.output.amount}
    interrupt_before: {reason: refunds need a human, required_role: approver, timeout: 1h}
edges:
  - {from: read, to: refund}
";

fn table(yaml: &str) -> Graphs {
    let mut graphs = Graphs::new();
    graphs
        .insert(Graph::parse(yaml).expect("graph"))
        .expect("insert");
    graphs
}

#[test]
fn the_same_graph_decides_the_same_and_a_changed_one_is_caught_where_it_differs() {
    let (history, _) = support::run(&file("approval_gate"));
    let same = shadow::replay(&history, &table(REFUND_V1));
    assert_eq!(same.divergence, None);
    assert!(same.versions >= 6, "{same:?}");

    // "refund@2": the gate removed. The run diverges when read's result comes back: the
    // recorded run asked for approval, the new graph would refund at once.
    let ungated = REFUND_V1.replace(
        "    interrupt_before: {reason: refunds need a human, required_role: approver, timeout: 1h}\n",
        "",
    );
    let changed = shadow::replay(&history, &table(&ungated));
    let divergence = changed.divergence.expect("a divergence");
    assert_eq!(divergence.version, 2);
    assert!(divergence
        .recorded
        .iter()
        .any(|l| l.starts_with("Interrupted")));
    assert!(divergence
        .redecided
        .iter()
        .any(|l| l.starts_with("StepDispatched")));
}
