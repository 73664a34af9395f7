//! Child runs through the fold alone: several runs, each folded by `apply`, with the
//! effects that cross runs (a parent's `Command`s, a child's `Report`) routed between them
//! by this test as the reducer routes them through Kafka. A planner asks for three
//! researchers in parallel (`next_steps`), each a child run on its own; their outputs
//! come back as the planner's step results, and the planner ends. Cancelling a parent
//! cancels its children, and their cancelled ends settle its steps. A `sub_` id is taken
//! only by the start its parent link derives.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, VecDeque};

use serde_json::{json, Value};
use sortie_core::child::ParentLink;
use sortie_core::{
    apply, input::Command, CommandBody, Effect, EventBody, Graph, Graphs, Input, RunState,
    RunStatus, StepOutcome, StepReport,
};

const PLANNER: &str = r#"
id: planner
version: 1
nodes:
  - {id: plan, tool: echo, side_effect: pure, may_request: [research]}
  - id: research
    run: {graph: researcher}
    args: {topic: $input.topic}
  - {id: summary, tool: echo, side_effect: pure, args: {findings: $steps.plan.output.results}}
edges:
  - {from: plan, to: summary}
"#;

const RESEARCHER: &str = r#"
id: researcher
version: 1
nodes:
  - {id: search, tool: echo, side_effect: pure, args: {q: $input.topic}}
"#;

const ORPHAN: &str = r#"
id: orphan
version: 1
nodes:
  - {id: ghost, run: {graph: never_published}, args: {}}
"#;

const LOCKED: &str = r#"
id: locked
version: 1
access: {start: [admin]}
nodes:
  - {id: a, tool: echo, side_effect: pure}
"#;

/// Every run's state, and the inputs waiting to be folded, in order.
struct World {
    graphs: Graphs,
    runs: BTreeMap<String, RunState>,
    queue: VecDeque<Input>,
    at: i64,
    /// Intents dispatched to executors, not yet answered: (run, step, op, attempt).
    intents: Vec<(String, String, String, u32)>,
}

impl World {
    fn new() -> World {
        let mut graphs = Graphs::new();
        for text in [PLANNER, RESEARCHER, LOCKED, ORPHAN] {
            graphs.insert(Graph::parse(text).unwrap()).unwrap();
        }
        World {
            graphs,
            runs: BTreeMap::new(),
            queue: VecDeque::new(),
            at: 1_000,
            intents: Vec::new(),
        }
    }

    fn command(&mut self, run_id: &str, id: &str, body: CommandBody) {
        self.at += 1;
        self.queue.push_back(Input::Command(Command {
            command_id: id.into(),
            tenant: "acme".into(),
            run_id: run_id.into(),
            principal: "user:ann".into(),
            roles: vec![],
            groups: vec![],
            at: self.at,
            body,
        }));
    }

    /// Folds every queued input, routing what crosses runs; answers no intent.
    fn settle(&mut self) -> Vec<sortie_core::Event> {
        let mut events = Vec::new();
        while let Some(input) = self.queue.pop_front() {
            let run_id = input.run_id().to_owned();
            let applied = apply(self.runs.get(&run_id), &input, &self.graphs);
            for effect in applied.effects {
                match effect {
                    Effect::Emit(e) => events.push(e),
                    Effect::Dispatch(i) => self.intents.push((
                        i.run_id.clone(),
                        i.step_id.clone(),
                        i.operation_id.clone(),
                        i.attempt,
                    )),
                    Effect::Command(mut c) => {
                        self.at += 1;
                        c.at = self.at;
                        self.queue.push_back(Input::Command(c));
                    }
                    Effect::Report(mut r) => {
                        self.at += 1;
                        r.at = self.at;
                        self.queue.push_back(Input::StepReport(r));
                    }
                    _ => {}
                }
            }
            if let Some(state) = applied.state {
                self.runs.insert(run_id, state);
            }
        }
        events
    }

    /// Answers every intent out with `output(step)`.
    fn answer(&mut self, output: impl Fn(&str) -> Value) {
        for (run_id, step_id, operation_id, attempt) in std::mem::take(&mut self.intents) {
            self.at += 1;
            self.queue.push_back(Input::StepReport(StepReport {
                operation_id,
                attempt,
                tenant: "acme".into(),
                run_id,
                step_id: step_id.clone(),
                outcome: StepOutcome::Succeeded {
                    output: output(&step_id),
                },
                at: self.at,
            }));
        }
    }

    fn children(&self) -> Vec<&RunState> {
        self.runs.values().filter(|r| r.parent.is_some()).collect()
    }
}

fn start(graph: &str, input: Value) -> CommandBody {
    child_start(graph, input, None)
}

fn child_start(graph: &str, input: Value, parent: Option<ParentLink>) -> CommandBody {
    CommandBody::StartRun {
        graph_id: graph.into(),
        graph_version: None,
        input,
        labels: BTreeMap::new(),
        budget: None,
        fork: None,
        parent,
    }
}

fn plan_output(step: &str) -> Value {
    if step.starts_with("plan#1") {
        json!({"next_steps": [
            {"node": "research", "args": {"topic": "tides"}},
            {"node": "research", "args": {"topic": "winds"}},
            {"node": "research", "args": {"topic": "reefs"}},
        ]})
    } else {
        json!({"echo": step})
    }
}

#[test]
fn a_planner_runs_three_researchers_in_parallel_and_reads_their_outputs() {
    let mut world = World::new();
    world.command(
        "run_p",
        "start-p",
        start("planner", json!({"topic": "sea"})),
    );
    world.settle();
    world.answer(plan_output);
    world.settle();
    let children = world.children();
    assert_eq!(children.len(), 3, "three children started");
    let mut partitions_differ = false;
    for child in &children {
        assert!(child.run_id.starts_with("sub_"), "{}", child.run_id);
        let link = child.parent.as_ref().unwrap();
        assert_eq!(link.run_id, "run_p");
        assert_eq!(child.run_id, link.child_id("acme"));
        partitions_differ |= child.run_id != children[0].run_id;
    }
    assert!(partitions_differ);
    assert_eq!(world.runs["run_p"].status, RunStatus::Running);

    // Each researcher's step answers; they end; their ends reach the planner, which asks
    // `plan` again with their outputs, then ends.
    world.answer(|step| json!({"found": step}));
    world.settle();
    for child in world.children() {
        assert_eq!(child.status, RunStatus::Succeeded, "{}", child.run_id);
    }
    let planner = &world.runs["run_p"];
    let research: Vec<_> = planner
        .steps
        .values()
        .filter(|s| s.node == "research")
        .collect();
    assert_eq!(research.len(), 3);
    assert!(research
        .iter()
        .all(|s| s.output.as_ref().unwrap()["search"]["found"]
            .as_str()
            .is_some()));
    world.answer(plan_output);
    world.settle();
    world.answer(plan_output);
    world.settle();
    assert_eq!(world.runs["run_p"].status, RunStatus::Succeeded);

    // The same start again (a re-fold) is the same child, answered as a duplicate.
    let child = world.children()[0].clone();
    let link = child.parent.clone().unwrap();
    world.queue.push_back(Input::Command(Command {
        command_id: format!("start-{}", child.run_id),
        tenant: "acme".into(),
        run_id: child.run_id.clone(),
        principal: "run:run_p".into(),
        roles: vec![],
        groups: vec![],
        at: world.at,
        body: child_start("researcher", child.input.clone(), Some(link)),
    }));
    let events = world.settle();
    assert!(matches!(
        &events[..],
        [e] if matches!(e.body, EventBody::CommandAccepted { duplicate: true, .. })
    ));
}

#[test]
fn cancelling_a_parent_cancels_its_children_and_their_ends_settle_its_steps() {
    let mut world = World::new();
    world.command(
        "run_p",
        "start-p",
        start("planner", json!({"topic": "sea"})),
    );
    world.settle();
    world.answer(plan_output);
    world.settle();
    assert_eq!(world.children().len(), 3);
    // The researchers' searches are in flight when the planner is cancelled.
    world.command(
        "run_p",
        "cancel-p",
        CommandBody::CancelRun {
            reason: Some("enough".into()),
        },
    );
    world.settle();
    assert_eq!(world.runs["run_p"].status, RunStatus::Cancelling);
    for child in world.children() {
        assert_eq!(child.status, RunStatus::Cancelling, "{}", child.run_id);
    }
    // Their in-flight steps answer; each child ends cancelled and tells the parent.
    world.answer(|step| json!({"late": step}));
    world.settle();
    for child in world.children() {
        assert_eq!(child.status, RunStatus::Cancelled, "{}", child.run_id);
    }
    let planner = &world.runs["run_p"];
    assert_eq!(planner.status, RunStatus::Cancelled);
    assert!(planner
        .steps
        .values()
        .filter(|s| s.node == "research")
        .all(|s| s
            .error
            .as_deref()
            .unwrap_or_default()
            .contains("child_cancelled")));
}

#[test]
fn a_child_id_is_taken_only_as_its_parent_derives_it() {
    let mut world = World::new();
    // Nobody takes a sub_ id without the link that derives it, nor with a forged one.
    let squat = "sub_0123456789abcdef0123456789abcdef";
    world.command(squat, "c1", start("researcher", json!({})));
    let forged = ParentLink {
        run_id: "run_p".into(),
        step_id: "research#1".into(),
        operation_id: "op_x".into(),
        attempt: 1,
    };
    world.command(
        squat,
        "c2",
        child_start("researcher", json!({}), Some(forged.clone())),
    );
    // A graph that limits who starts its runs cannot be a child.
    world.command(
        &forged.child_id("acme"),
        "c3",
        child_start("locked", json!({}), Some(forged)),
    );
    let events = world.settle();
    let codes: Vec<&str> = events
        .iter()
        .filter_map(|e| match &e.body {
            EventBody::CommandRejected { code, .. } => Some(code.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(codes, ["bad_run_id", "bad_run_id", "forbidden"]);
    assert!(world.runs.is_empty());
}

/// A child that cannot start (its graph is not published) fails its parent's step for
/// good: the parent never waits on a child that will not run.
#[test]
fn a_child_that_cannot_start_fails_its_parents_step() {
    let mut world = World::new();
    world.command("run_o", "start-o", start("orphan", json!({})));
    world.settle();
    let parent = &world.runs["run_o"];
    assert_eq!(parent.status, RunStatus::Failed);
    let ghost = parent.steps.values().next().unwrap();
    assert!(
        ghost
            .error
            .as_deref()
            .unwrap_or_default()
            .starts_with("child_unknown_graph"),
        "{ghost:?}"
    );
    assert!(world.children().is_empty());
}
