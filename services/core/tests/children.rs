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

/// The planner of [`PLANNER`], its researchers thinking with a model (charged).
const SPENDER: &str = r#"
id: spender
version: 1
nodes:
  - {id: plan, tool: echo, side_effect: pure, may_request: [research]}
  - id: research
    run: {graph: thinker}
    args: {topic: $input.topic}
  - {id: summary, tool: echo, side_effect: pure, args: {findings: $steps.plan.output.results}}
edges:
  - {from: plan, to: summary}
"#;

/// [`SPENDER`] whose researchers ask for a budget of their own.
const CAPPED: &str = r#"
id: capped
version: 1
nodes:
  - {id: plan, tool: echo, side_effect: pure, may_request: [research]}
  - id: research
    run: {graph: thinker, budget: {tokens: 200, tool_calls: 5}}
    args: {topic: $input.topic}
"#;

const THINKER: &str = r#"
id: thinker
version: 1
nodes:
  - {id: think, tool: llm, side_effect: pure, args: {messages: [{role: user, content: $input.topic}]}}
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
        for text in [
            PLANNER, RESEARCHER, LOCKED, ORPHAN, SPENDER, THINKER, CAPPED,
        ] {
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
                spent: None,
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
    // A graph that limits who starts its runs cannot be a child (even from its parent).
    world.command(
        &forged.child_id("acme"),
        "c3",
        child_start("locked", json!({}), Some(forged.clone())),
    );
    if let Some(Input::Command(c)) = world.queue.back_mut() {
        c.principal = "run:run_p".into();
    }
    // The id its link derives, taken by anyone but the parent run: an operation id can be
    // computed ahead from the arguments, so only the parent may start its child. Seen red:
    // before the principal check in `child_refusal`, this start was accepted.
    world.command(
        &forged.child_id("acme"),
        "c4",
        child_start("researcher", json!({}), Some(forged)),
    );
    let events = world.settle();
    let codes: Vec<&str> = events
        .iter()
        .filter_map(|e| match &e.body {
            EventBody::CommandRejected { code, .. } => Some(code.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(
        codes,
        ["bad_run_id", "bad_run_id", "forbidden", "forbidden"]
    );
    assert!(
        events.iter().any(|e| matches!(&e.body,
        EventBody::CommandRejected { reason, .. } if reason.contains("started by its parent run")))
    );
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

/// A parent with a budget gives its children, started together, equal shares of what it
/// has left (`BudgetReserved`, the child's own budget), holds that share as spent while
/// they run, and when each ends releases it and charges what the child spent
/// (`BudgetSettled`, from the child's report). Seen red: with the share not divided among
/// the children started together, the first child was given everything left.
#[test]
fn children_share_what_the_parent_has_left_and_their_spend_is_settled() {
    use sortie_core::budget::{Budget, Limits, Price};
    let mut world = World::new();
    let budget = Budget {
        limits: Limits {
            tokens: Some(3_000),
            cost_usd: Some(0.3),
            ..Limits::default()
        },
        prices: [(
            "m".to_owned(),
            Price {
                input_per_1k: 0.1,
                output_per_1k: 0.1,
            },
        )]
        .into(),
        ceiling: None,
    };
    world.command("run_s", "start-s", budgeted("spender", budget.clone()));
    world.settle();
    world.answer(plan_output);
    let events = world.settle();
    let parent = &world.runs["run_s"];
    assert_eq!(parent.reserved.len(), 3, "{:?}", parent.reserved);
    for share in parent.reserved.values() {
        assert_eq!(share.tokens, Some(1_000));
        assert!((share.cost_usd.unwrap() - 0.1).abs() < 1e-9);
    }
    let reserved = events
        .iter()
        .filter(|e| matches!(e.body, EventBody::BudgetReserved { .. }))
        .count();
    assert_eq!(reserved, 3);
    for child in world.children() {
        let limits = &child.budget.as_ref().expect("a child's budget").limits;
        assert_eq!(limits.tokens, Some(1_000), "{}", child.run_id);
    }

    // Each child's model call spends 500 tokens (0.05 USD); their ends settle.
    world.answer(|_| {
        json!({"content": "found", "model": "m",
               "usage": {"prompt_tokens": 400, "completion_tokens": 100}})
    });
    let events = world.settle();
    let settled: Vec<u64> = events
        .iter()
        .filter_map(|e| match &e.body {
            EventBody::BudgetSettled { spent, .. } => Some(spent.tokens()),
            _ => None,
        })
        .collect();
    assert_eq!(settled, [500, 500, 500]);
    let parent = &world.runs["run_s"];
    assert!(parent.reserved.is_empty(), "{:?}", parent.reserved);
    assert_eq!(parent.spend.tokens(), 1_500);
    assert!((parent.spend.cost_usd - 0.15).abs() < 1e-9);
    assert_eq!(parent.spend.llm_calls, 3);
    // The planner reads its children's results, then summarizes.
    for _ in 0..2 {
        world.answer(|_| json!({}));
        world.settle();
    }
    assert_eq!(world.runs["run_s"].status, RunStatus::Succeeded);
}

/// Retention and deletion: a child is forgotten with its parent and never before it. A
/// child arms no retention timer of its own; an operator's `ForgetRun` for a child is
/// refused (`bad_state`, naming the parent); forgetting the parent sends each child a
/// `ForgetRun` from the parent, which the child takes. Seen red: with the parent's
/// `forget_children` skipped, the children kept their payloads after the parent was
/// forgotten.
#[test]
fn children_are_forgotten_with_their_parent_and_never_before_it() {
    let mut world = World::new();
    world.command(
        "run_p",
        "start-p",
        start("planner", json!({"topic": "sea"})),
    );
    world.settle();
    world.answer(plan_output);
    world.settle();
    world.answer(|step| json!({"found": step}));
    world.settle();
    for _ in 0..2 {
        world.answer(plan_output);
        world.settle();
    }
    assert_eq!(world.runs["run_p"].status, RunStatus::Succeeded);
    let children: Vec<String> = world.children().iter().map(|c| c.run_id.clone()).collect();
    assert_eq!(children.len(), 3);
    for child in world.children() {
        assert!(
            child.timers.is_empty(),
            "a child arms no retention: {:?}",
            child.timers
        );
    }

    // An operator cannot forget a child on its own.
    world.at += 1;
    world.queue.push_back(Input::Command(Command {
        command_id: "forget-child".into(),
        tenant: "acme".into(),
        run_id: children[0].clone(),
        principal: "user:ops".into(),
        roles: vec!["operator".into()],
        groups: vec![],
        at: world.at,
        body: CommandBody::ForgetRun { reason: None },
    }));
    let events = world.settle();
    assert!(
        events.iter().any(|e| matches!(&e.body,
        EventBody::CommandRejected { code, reason, .. }
            if code == "bad_state" && reason.contains("run_p"))),
        "{events:#?}"
    );
    assert!(world.runs[&children[0]].forgotten.is_none());

    // Forgetting the parent forgets every child.
    world.at += 1;
    world.queue.push_back(Input::Command(Command {
        command_id: "forget-parent".into(),
        tenant: "acme".into(),
        run_id: "run_p".into(),
        principal: "user:ops".into(),
        roles: vec!["operator".into()],
        groups: vec![],
        at: world.at,
        body: CommandBody::ForgetRun {
            reason: Some("a deletion request".into()),
        },
    }));
    world.settle();
    assert!(world.runs["run_p"].forgotten.is_some());
    for child in &children {
        let state = &world.runs[child];
        let forgotten = state.forgotten.as_ref().expect("the child was forgotten");
        assert!(forgotten.reason.contains("run_p"), "{}", forgotten.reason);
        assert_eq!(state.input, Value::Null);
    }
}

/// A start of `graph` with `budget`.
fn budgeted(graph: &str, budget: sortie_core::budget::Budget) -> CommandBody {
    CommandBody::StartRun {
        graph_id: graph.into(),
        graph_version: None,
        input: json!({"topic": "sea"}),
        labels: BTreeMap::new(),
        budget: Some(budget),
        fork: None,
        parent: None,
    }
}

/// A node's `run.budget` is what its child gets, capped by what the parent has left.
#[test]
fn a_node_asks_for_its_childs_budget_within_what_is_left() {
    use sortie_core::budget::{Budget, Limits};
    let mut world = World::new();
    let budget = Budget {
        limits: Limits {
            tokens: Some(3_000),
            tool_calls: Some(4),
            ..Limits::default()
        },
        prices: Default::default(),
        ceiling: None,
    };
    world.command("run_c", "start-c", budgeted("capped", budget));
    world.settle();
    world.answer(plan_output);
    world.settle();
    let parent = &world.runs["run_c"];
    // The plan's three requests are tool calls: one left of four.
    assert_eq!(parent.spend.tool_calls, 3);
    let shares: Vec<&Limits> = parent.reserved.values().collect();
    assert_eq!(shares.len(), 3);
    assert_eq!(shares[0].tokens, Some(200), "as asked, under what is left");
    assert_eq!(shares[0].tool_calls, Some(1), "capped by what is left");
}
