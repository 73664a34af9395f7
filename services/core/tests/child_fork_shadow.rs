//! Fork and shadow replay treat a child run as a step (issue 53 item 3, ADRs 0024 and
//! 0028), through the fold alone: runs folded by `apply`, the effects that cross runs (a
//! parent's `Command`s, a child's `Report`) routed by this test as the reducer routes
//! them, and each run's history kept as written.
//!
//! - A fork of a parent at a version after its child step succeeded keeps the step —
//!   output and operation id — and starts no child.
//! - A fork at a version where the child step is in flight starts no child: the step
//!   waits for an operator with the source's operation id (the source's child may have
//!   acted); the source's child still reports to the source, never to the fork.
//! - A fork of a child run is nobody's child: it reports its end to no parent.
//! - Shadow replay re-decides a parent's history with its child steps (started, retried
//!   after a failed child, cancelled with the parent) without a divergence, re-deriving
//!   each child's end as the step result it was; the starts it re-decides are the
//!   recorded ones (the same derived child ids and command ids), so a re-fold never
//!   starts another child; a budgeted parent's child end (opened by its `BudgetSettled`)
//!   is re-decided too. Seen red: before `shadow.rs` read `BudgetSettled`, that end was
//!   taken as recorded, not re-decided.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, VecDeque};

use serde_json::{json, Value};
use sortie_core::child::{child_run_id, CHILD_TOOL};
use sortie_core::decide::fork::verified_source;
use sortie_core::input::{Command, ForkSource};
use sortie_core::state::StepStatus;
use sortie_core::{
    apply, shadow, CommandBody, Effect, Event, EventBody, Graph, Graphs, Input, Plain, RunState,
    RunStatus, StepOutcome, StepReport, TimerKey,
};

const PLANNER: &str = r#"
id: planner
version: 1
nodes:
  - {id: plan, tool: echo, side_effect: pure, args: {topic: $input.topic}}
  - id: research
    run: {graph: researcher}
    args: {topic: $input.topic}
    retry: {max_attempts: 2}
  - {id: summary, tool: echo, side_effect: pure, args: {found: $steps.research.output}}
edges:
  - {from: plan, to: research}
  - {from: research, to: summary}
"#;

const RESEARCHER: &str = r#"
id: researcher
version: 1
nodes:
  - {id: search, tool: echo, side_effect: pure, args: {q: $input.topic}}
"#;

/// Every run's state and history, the inputs each took, and what waits to be folded.
struct World {
    graphs: Graphs,
    runs: BTreeMap<String, RunState>,
    histories: BTreeMap<String, Vec<Event>>,
    inputs: BTreeMap<String, Vec<Input>>,
    queue: VecDeque<Input>,
    at: i64,
    /// Intents out, not yet answered: (run, step, operation, attempt).
    intents: Vec<(String, String, String, u32)>,
    /// Retry timers armed: (run, timer, due).
    timers: Vec<(String, TimerKey, i64)>,
    /// Every command a run sent another, in order.
    sent: Vec<Command>,
}

impl World {
    fn new() -> World {
        let mut graphs = Graphs::new();
        for text in [PLANNER, RESEARCHER] {
            graphs.insert(Graph::parse(text).unwrap()).unwrap();
        }
        World {
            graphs,
            runs: BTreeMap::new(),
            histories: BTreeMap::new(),
            inputs: BTreeMap::new(),
            queue: VecDeque::new(),
            at: 1_000,
            intents: Vec::new(),
            timers: Vec::new(),
            sent: Vec::new(),
        }
    }

    fn tick(&mut self) -> i64 {
        self.at += 1_000;
        self.at
    }

    fn command(&mut self, run_id: &str, id: &str, body: CommandBody) {
        let at = self.tick();
        self.queue.push_back(Input::Command(Command {
            command_id: id.into(),
            tenant: "acme".into(),
            run_id: run_id.into(),
            principal: "user:ann".into(),
            roles: vec![],
            groups: vec![],
            at,
            body,
        }));
    }

    /// Folds one input; what it emits is returned, what crosses runs is queued.
    fn fold(&mut self, input: Input) -> Vec<Effect> {
        let run_id = input.run_id().to_owned();
        let applied = apply(self.runs.get(&run_id), &input, &self.graphs);
        self.inputs.entry(run_id.clone()).or_default().push(input);
        for effect in &applied.effects {
            match effect {
                Effect::Emit(e) if e.seq > 0 => {
                    self.histories
                        .entry(e.run_id.clone())
                        .or_default()
                        .push(e.clone());
                }
                Effect::Dispatch(i) => self.intents.push((
                    i.run_id.clone(),
                    i.step_id.clone(),
                    i.operation_id.clone(),
                    i.attempt,
                )),
                Effect::Command(c) => {
                    let mut c = c.clone();
                    c.at = self.tick();
                    self.sent.push(c.clone());
                    self.queue.push_back(Input::Command(c));
                }
                Effect::Report(r) => {
                    let mut r = r.clone();
                    r.at = self.tick();
                    self.queue.push_back(Input::StepReport(r));
                }
                Effect::ArmTimer {
                    run_id,
                    timer,
                    due_at,
                } if matches!(timer, TimerKey::Retry { .. }) => {
                    self.timers.push((run_id.clone(), timer.clone(), *due_at));
                }
                _ => {}
            }
        }
        if let Some(state) = applied.state {
            self.runs.insert(run_id, state);
        }
        applied.effects
    }

    /// Folds every queued input; answers no intent.
    fn settle(&mut self) {
        while let Some(input) = self.queue.pop_front() {
            self.fold(input);
        }
    }

    /// Answers every intent out with `outcome(run, step)`, then settles.
    fn answer(&mut self, outcome: impl Fn(&str, &str) -> StepOutcome) {
        for (run_id, step_id, operation_id, attempt) in std::mem::take(&mut self.intents) {
            let at = self.tick();
            let outcome = outcome(&run_id, &step_id);
            self.queue.push_back(Input::StepReport(StepReport {
                spent: None,
                operation_id,
                attempt,
                tenant: "acme".into(),
                run_id,
                step_id,
                outcome,
                at,
            }));
        }
        self.settle();
    }

    /// Fires every retry timer armed, then settles.
    fn fire_retries(&mut self) {
        for (run_id, timer, due) in std::mem::take(&mut self.timers) {
            self.at = self.at.max(due);
            let at = self.tick();
            self.queue
                .push_back(Input::TimerFired { run_id, timer, at });
        }
        self.settle();
    }

    /// The children `parent` started, by their link.
    fn children_of(&self, parent: &str) -> Vec<&RunState> {
        self.runs
            .values()
            .filter(|r| r.parent.as_ref().is_some_and(|p| p.run_id == parent))
            .collect()
    }

    /// The version of `run` right after the first event `matches`.
    fn version_at(&self, run: &str, matches: impl Fn(&EventBody) -> bool) -> i64 {
        self.histories[run]
            .iter()
            .find(|e| matches(&e.body))
            .unwrap()
            .state_version
    }

    /// Forks `source` at `version` into `run_id` as the reducer does: the source state
    /// re-derived from the source's history, held to the head the reducer holds. Returns
    /// the fork start's effects.
    fn fork(&mut self, source: &str, version: i64, run_id: &str) -> Vec<Effect> {
        let mut fork = ForkSource {
            run_id: source.into(),
            version,
            state: Value::Null,
            history: Some(self.histories[source].clone()),
        };
        let state = verified_source(&self.runs[source], &fork, &Plain).unwrap();
        assert_eq!(state.version, version);
        fork.state = serde_json::to_value(&state).unwrap();
        let graph_id = state.graph_id.clone();
        let at = self.tick();
        let effects = self.fold(Input::Command(Command {
            command_id: format!("start-{run_id}"),
            tenant: "acme".into(),
            run_id: run_id.into(),
            principal: "user:ops".into(),
            roles: vec![],
            groups: vec![],
            at,
            body: CommandBody::StartRun {
                graph_id,
                graph_version: Some(1),
                input: state.input.clone(),
                labels: BTreeMap::new(),
                budget: None,
                fork: Some(fork),
                parent: None,
            },
        }));
        self.settle();
        effects
    }
}

fn start(graph: &str, input: Value) -> CommandBody {
    CommandBody::StartRun {
        graph_id: graph.into(),
        graph_version: None,
        input,
        labels: BTreeMap::new(),
        budget: None,
        fork: None,
        parent: None,
    }
}

fn ok(run: &str, step: &str) -> StepOutcome {
    StepOutcome::Succeeded {
        output: json!({"run": run, "step": step}),
    }
}

/// The parent `run_p` has started its child; the child's search is out.
fn parent_with_child_in_flight() -> World {
    let mut world = World::new();
    world.command(
        "run_p",
        "start-p",
        start("planner", json!({"topic": "tides"})),
    );
    world.settle();
    world.answer(ok); // plan: the research step starts its child
    assert_eq!(world.children_of("run_p").len(), 1);
    world
}

fn commands(effects: &[Effect]) -> Vec<&Command> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Command(c) => Some(c),
            _ => None,
        })
        .collect()
}

fn step<'s>(run: &'s RunState, node: &str) -> &'s sortie_core::state::Step {
    run.steps.values().find(|s| s.node == node).unwrap()
}

#[test]
fn a_fork_after_the_child_step_succeeded_keeps_its_output_and_starts_no_child() {
    let mut world = parent_with_child_in_flight();
    world.answer(ok); // the child's search: the child ends, its end settles research
    let source = world.runs["run_p"].clone();
    let research = step(&source, "research").clone();
    assert_eq!(research.status, StepStatus::Succeeded);
    assert_eq!(step(&source, "summary").status, StepStatus::InFlight);
    let settled = world.version_at(
        "run_p",
        |b| matches!(b, EventBody::StepSucceeded { step_id, .. } if *step_id == research.step_id),
    );
    let children_before = world.runs.values().filter(|r| r.parent.is_some()).count();
    let sent_before = world.sent.len();

    let effects = world.fork("run_p", settled, "run_f");
    assert!(commands(&effects).is_empty(), "the fork started no child");
    assert_eq!(world.sent.len(), sent_before);
    assert_eq!(
        world.runs.values().filter(|r| r.parent.is_some()).count(),
        children_before
    );
    let fork = &world.runs["run_f"];
    let carried = &fork.steps[&research.step_id];
    assert_eq!(carried.status, StepStatus::Succeeded);
    assert_eq!(carried.output, research.output);
    assert_eq!(carried.operation_id, research.operation_id);
    assert_eq!(carried.tool, CHILD_TOOL);
    // The step after it runs in the fork with the child's output.
    let summary: Vec<_> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::Dispatch(i) if i.node == "summary" => Some(i),
            _ => None,
        })
        .collect();
    assert_eq!(summary.len(), 1);
    assert_eq!(summary[0].args["found"], research.output.clone().unwrap());
    world.answer(ok);
    assert_eq!(world.runs["run_f"].status, RunStatus::Succeeded);
}

/// A fork at a version where the child step is in flight starts no child: the source's
/// child may have acted (its own keyed or unsafe steps), and a fresh child would act
/// again. The step waits for an operator, keeping the source's operation id (whose child
/// is `sub_` of it), as a keyed step in flight does (ADR 0024). Seen red: the first
/// build re-dispatched the step (it is `idempotent`) and started a fresh child.
#[test]
fn a_fork_while_the_child_runs_starts_no_child_and_waits_for_an_operator() {
    let mut world = parent_with_child_in_flight();
    let source = world.runs["run_p"].clone();
    let research = step(&source, "research").clone();
    assert_eq!(research.status, StepStatus::InFlight);
    let source_child = world.children_of("run_p")[0].run_id.clone();
    assert_eq!(
        source_child,
        child_run_id("acme", "run_p", &research.operation_id, 1)
    );
    let in_flight = world.version_at(
        "run_p",
        |b| matches!(b, EventBody::StepDispatched { tool, .. } if tool == CHILD_TOOL),
    );

    let effects = world.fork("run_p", in_flight, "run_f");
    let fork = world.runs["run_f"].clone();
    let waiting = &fork.steps[&research.step_id];
    assert_eq!(waiting.status, StepStatus::NeedsOperator);
    assert_eq!(waiting.operation_id, research.operation_id);
    assert!(
        waiting
            .error
            .as_deref()
            .unwrap_or_default()
            .contains("run_p"),
        "{waiting:?}"
    );
    assert_eq!(fork.status, RunStatus::NeedsReconciliation);
    assert!(commands(&effects).is_empty(), "no child started");
    assert!(world.children_of("run_f").is_empty());

    // The source's child ends and reports to the source only.
    world.answer(|run, step| StepOutcome::Succeeded {
        output: json!({"by": run, "step": step}),
    });
    world.answer(ok);
    assert_eq!(world.runs["run_p"].status, RunStatus::Succeeded);
    assert_eq!(
        world.runs["run_f"].steps[&research.step_id].status,
        StepStatus::NeedsOperator
    );
    assert_eq!(
        world.runs.values().filter(|r| r.parent.is_some()).count(),
        1
    );
}

#[test]
fn a_fork_of_a_child_run_is_nobodys_child() {
    let mut world = parent_with_child_in_flight();
    let child = world.children_of("run_p")[0].clone();
    let effects = world.fork(&child.run_id, child.version, "run_cf");
    assert!(commands(&effects).is_empty());
    assert_eq!(world.runs["run_cf"].parent, None);
    // The fork's search ends it; it reports to no parent (only the source child does).
    let reports_before = world.histories["run_p"].len();
    world.intents.retain(|(run, ..)| run == "run_cf");
    world.answer(ok);
    assert_eq!(world.runs["run_cf"].status, RunStatus::Succeeded);
    assert_eq!(world.histories["run_p"].len(), reports_before);
    assert_eq!(
        step(&world.runs["run_p"], "research").status,
        StepStatus::InFlight
    );
}

/// Shadow replay of `run` agrees with every recorded decision, re-deciding each (none
/// taken as recorded).
fn replays_as_recorded(world: &World, run: &str) {
    let history = &world.histories[run];
    let outcome = shadow::replay(history, &world.graphs);
    let versions = history
        .iter()
        .map(|e| e.state_version)
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    assert_eq!(outcome.divergence, None, "{run}: {outcome:?}");
    assert_eq!(outcome.versions, versions, "{run}");
    assert_eq!(outcome.taken_as_recorded, 0, "{run}: {outcome:?}");
}

/// The commands a run sends when its inputs are folded again from nothing: the same as
/// it sent, so a re-fold (or a re-decision) never starts another child.
fn refolds_to_the_same_starts(world: &World, run: &str) {
    let mut state: Option<RunState> = None;
    let mut again = Vec::new();
    for input in &world.inputs[run] {
        let applied = apply(state.as_ref(), input, &world.graphs);
        again.extend(applied.effects.into_iter().filter_map(|e| match e {
            Effect::Command(c) => Some((c.command_id, c.run_id)),
            _ => None,
        }));
        state = applied.state;
    }
    let sent: Vec<(String, String)> = world
        .sent
        .iter()
        .filter(|c| c.principal == format!("run:{run}"))
        .map(|c| (c.command_id.clone(), c.run_id.clone()))
        .collect();
    assert_eq!(again, sent, "{run}");
    // Sent again, a start is a duplicate of the child it started.
    for start in world
        .sent
        .iter()
        .filter(|c| c.principal == format!("run:{run}"))
        .filter(|c| matches!(c.body, CommandBody::StartRun { .. }))
    {
        let Some(child) = world.runs.get(&start.run_id) else {
            continue;
        };
        let applied = apply(Some(child), &Input::Command(start.clone()), &world.graphs);
        let answer: Vec<&EventBody> = applied
            .effects
            .iter()
            .filter_map(|e| match e {
                Effect::Emit(e) => Some(&e.body),
                _ => None,
            })
            .collect();
        assert!(
            matches!(
                answer[..],
                [EventBody::CommandAccepted {
                    duplicate: true,
                    ..
                }]
            ),
            "{answer:?}"
        );
    }
}

#[test]
fn shadow_replay_takes_a_childs_end_as_the_recorded_step_result() {
    let mut world = parent_with_child_in_flight();
    world.answer(ok); // the child ends; its end settles research; summary goes out
    world.answer(ok); // summary
    assert_eq!(world.runs["run_p"].status, RunStatus::Succeeded);
    let child = world.children_of("run_p")[0].run_id.clone();
    replays_as_recorded(&world, "run_p");
    replays_as_recorded(&world, &child);
    refolds_to_the_same_starts(&world, "run_p");
}

#[test]
fn shadow_replay_takes_a_failed_child_and_its_retry_as_recorded() {
    let mut world = parent_with_child_in_flight();
    // The first child's search fails for good: the child fails, the parent's step fails
    // retryably (`child_failed`), and its retry starts a fresh child.
    world.answer(|_, _| StepOutcome::Failed {
        retryable: false,
        code: "nope".into(),
        message: "no tides today".into(),
        retry_after_ms: None,
    });
    let research = step(&world.runs["run_p"], "research").clone();
    assert_eq!(research.status, StepStatus::WaitingRetry, "{research:?}");
    world.fire_retries();
    let children = world.children_of("run_p");
    assert_eq!(children.len(), 2);
    assert!(children.iter().any(|c| c.status == RunStatus::Failed));
    world.answer(ok); // the second child's search
    world.answer(ok); // summary
    assert_eq!(world.runs["run_p"].status, RunStatus::Succeeded);
    assert_eq!(step(&world.runs["run_p"], "research").attempt, 2);
    replays_as_recorded(&world, "run_p");
    for child in world.children_of("run_p") {
        replays_as_recorded(&world, &child.run_id);
    }
    refolds_to_the_same_starts(&world, "run_p");
}

#[test]
fn shadow_replay_takes_a_cancelled_parent_and_its_cancelled_child_as_recorded() {
    let mut world = parent_with_child_in_flight();
    world.command(
        "run_p",
        "cancel-p",
        CommandBody::CancelRun {
            reason: Some("enough".into()),
        },
    );
    world.settle();
    world.answer(ok); // the child's search, late: the child ends cancelled
    assert_eq!(world.runs["run_p"].status, RunStatus::Cancelled);
    let child = world.children_of("run_p")[0].run_id.clone();
    assert_eq!(world.runs[&child].status, RunStatus::Cancelled);
    replays_as_recorded(&world, "run_p");
    replays_as_recorded(&world, &child);
    refolds_to_the_same_starts(&world, "run_p");
}

/// Seen red: with a budget, a child's end opens its version with `BudgetSettled` (the
/// reservation released, the child's spend charged) before the step's outcome, and
/// `shadow::input_of` looks only at the version's first event, so the child's end is
/// taken as recorded instead of re-decided (`taken_as_recorded: 1`, no divergence). The
/// fix belongs in `shadow.rs`: a version that opens with `BudgetSettled { spent }` is the
/// report of the step event after it, with `spent: Some(spent)`.
#[test]

fn shadow_replay_of_a_budgeted_parent_re_decides_its_childs_end() {
    let mut world = World::new();
    world.command(
        "run_p",
        "start-p",
        CommandBody::StartRun {
            graph_id: "planner".into(),
            graph_version: None,
            input: json!({"topic": "tides"}),
            labels: BTreeMap::new(),
            budget: Some(serde_json::from_value(json!({"limits": {"tool_calls": 10}})).unwrap()),
            fork: None,
            parent: None,
        },
    );
    world.settle();
    world.answer(ok); // plan
    world.answer(ok); // the child's search
    world.answer(ok); // summary
    assert_eq!(world.runs["run_p"].status, RunStatus::Succeeded);
    assert!(world.histories["run_p"]
        .iter()
        .any(|e| matches!(e.body, EventBody::BudgetSettled { .. })));
    let child = world.children_of("run_p")[0].run_id.clone();
    replays_as_recorded(&world, &child);
    replays_as_recorded(&world, "run_p");
}
