//! Property tests of the fold: for any sequence of inputs, (1) applying it twice gives
//! identical effects and state, (2) re-folding the emitted history gives the state, and
//! (3) once executors answer and time passes, every run ends terminal or waiting on a
//! human (an open approval) or an operator (an unknown outcome).

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use proptest::prelude::*;
use serde_json::json;
use sortie_core::{
    apply, evolve, input::Command, state::InterruptStatus, state::StepStatus, CommandBody, Effect,
    Event, Graph, Graphs, Input, RunState, RunStatus, StepOutcome, StepReport, TimerKey,
};

const GRAPHS: &[&str] = &[
    r#"
id: mixed
version: 1
max_steps: 12
nodes:
  - {id: read, tool: echo, side_effect: pure, timeout: 5s}
  - {id: hold, tool: http, side_effect: keyed, compensate_with: release, timeout: 5s, retry: {max_attempts: 3, initial_backoff: 1s, max_backoff: 4s, multiplier: 2, jitter: 0.3}}
  - id: pay
    tool: http
    side_effect: unsafe
    timeout: 5s
    interrupt_before: {reason: money, timeout: 1h, on_timeout: escalate, escalation: [leads], quorum: 2}
  - {id: ask, tool: http, side_effect: reconcilable, timeout: 5s}
  - {id: agent, tool: llm, side_effect: idempotent, may_request: [tool], timeout: 5s}
  - {id: tool, tool: http, side_effect: pure}
  - {id: release, tool: http, side_effect: keyed}
  - {id: done, tool: echo, side_effect: pure}
edges:
  - {from: read, to: hold}
  - {from: read, to: ask, when: {path: ask, equals: true}}
  - {from: hold, to: pay}
  - {from: pay, to: agent}
  - {from: ask, to: done}
  - {from: agent, to: done}
"#,
    r#"
id: gate
version: 1
max_duration: 2h
nodes:
  - {id: a, tool: echo, side_effect: idempotent, compensate_with: undo, timeout: 5s}
  - id: b
    tool: http
    side_effect: keyed
    interrupt_before: {reason: check, timeout: 30m, on_timeout: cancel}
    on_reject: {goto: alt}
  - {id: alt, tool: echo, side_effect: pure}
  - {id: undo, tool: http, side_effect: keyed}
edges:
  - {from: a, to: b}
"#,
];

fn graphs() -> Graphs {
    let mut graphs = Graphs::new();
    for text in GRAPHS {
        graphs.insert(Graph::parse(text).unwrap()).unwrap();
    }
    graphs
}

#[derive(Debug, Clone)]
enum Action {
    Report {
        pick: usize,
        outcome: u8,
    },
    Approve {
        pick: usize,
        principal: u8,
        approve: bool,
    },
    Cancel,
    Reconcile {
        pick: usize,
        succeeded: bool,
    },
    Wait {
        ms: i64,
    },
    Duplicate,
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        5 => (any::<usize>(), 0u8..6).prop_map(|(pick, outcome)| Action::Report { pick, outcome }),
        2 => (any::<usize>(), 0u8..3, any::<bool>()).prop_map(|(pick, principal, approve)| Action::Approve { pick, principal, approve }),
        1 => Just(Action::Cancel),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(pick, succeeded)| Action::Reconcile { pick, succeeded }),
        2 => (1i64..4_000_000).prop_map(|ms| Action::Wait { ms }),
        1 => Just(Action::Duplicate),
    ]
}

/// A run driven through the fold, recording every input (with the graphs) and effect.
struct Sim {
    graphs: Graphs,
    state: Option<RunState>,
    now: i64,
    n: usize,
    inputs: Vec<Input>,
    effects: Vec<Vec<Effect>>,
    history: Vec<Event>,
}

impl Sim {
    fn new(graph: &str, input: serde_json::Value) -> Sim {
        let mut sim = Sim {
            graphs: graphs(),
            state: None,
            now: 1_000,
            n: 0,
            inputs: vec![],
            effects: vec![],
            history: vec![],
        };
        sim.command(
            CommandBody::StartRun {
                graph_id: graph.into(),
                graph_version: None,
                input,
                labels: BTreeMap::new(),
                budget: None,
                fork: None,
            },
            "svc",
            vec![],
        );
        sim
    }

    fn feed(&mut self, input: Input) {
        let applied = apply(self.state.as_ref(), &input, &self.graphs);
        for effect in &applied.effects {
            if let Effect::Emit(event) = effect {
                self.history.push(event.clone());
            }
        }
        self.state = applied.state;
        self.inputs.push(input);
        self.effects.push(applied.effects);
    }

    fn command(&mut self, body: CommandBody, principal: &str, roles: Vec<String>) {
        self.n += 1;
        self.now += 1;
        self.feed(Input::Command(Command {
            command_id: format!("c{}", self.n),
            tenant: "t".into(),
            run_id: "r".into(),
            principal: principal.into(),
            roles,
            at: self.now,
            body,
            groups: vec![],
        }));
    }

    fn run(&self) -> &RunState {
        self.state.as_ref().unwrap()
    }

    fn report(&mut self, step_id: &str, outcome: StepOutcome) {
        let step = self.run().steps[step_id].clone();
        self.now += 1;
        self.feed(Input::StepReport(StepReport {
            operation_id: step.operation_id,
            attempt: step.attempt,
            tenant: "t".into(),
            run_id: "r".into(),
            step_id: step.step_id,
            outcome,
            at: self.now,
        }));
    }

    fn fire_due(&mut self) -> bool {
        let due: Vec<String> = self
            .run()
            .timers
            .iter()
            .filter(|(_, d)| **d <= self.now)
            .map(|(k, _)| k.clone())
            .collect();
        for key in &due {
            if self
                .state
                .as_ref()
                .is_some_and(|r| r.timers.contains_key(key))
            {
                self.feed(Input::TimerFired {
                    run_id: "r".into(),
                    timer: TimerKey::decode(key).unwrap(),
                    at: self.now,
                });
            }
        }
        !due.is_empty()
    }

    fn in_flight(&self) -> Vec<String> {
        self.run()
            .steps
            .values()
            .filter(|s| s.status.is_in_flight())
            .map(|s| s.step_id.clone())
            .collect()
    }

    fn act(&mut self, action: &Action) {
        match action {
            Action::Report { pick, outcome } => {
                let in_flight = self.in_flight();
                if in_flight.is_empty() {
                    return;
                }
                let step = &in_flight[pick % in_flight.len()];
                let outcome = match outcome {
                    0 | 1 => StepOutcome::Succeeded {
                        output: json!({"ask": true, "next_steps": if *outcome == 1 { json!([{"node": "tool", "args": {}}]) } else { json!([]) }}),
                    },
                    2 => StepOutcome::Failed {
                        retryable: true,
                        code: "http_503".into(),
                        message: "busy".into(),
                        retry_after_ms: None,
                    },
                    3 => StepOutcome::Failed {
                        retryable: false,
                        code: "http_400".into(),
                        message: "no".into(),
                        retry_after_ms: None,
                    },
                    4 => StepOutcome::Unknown {
                        code: "reset".into(),
                        message: "?".into(),
                    },
                    _ => StepOutcome::Started,
                };
                self.report(&step.clone(), outcome);
            }
            Action::Approve {
                pick,
                principal,
                approve,
            } => {
                let open: Vec<_> = self
                    .run()
                    .interrupts
                    .values()
                    .filter(|i| i.status == InterruptStatus::Open)
                    .cloned()
                    .collect();
                if open.is_empty() {
                    // A decision for an interrupt not registered (yet): buffered, then
                    // answered when it appears or when the run ends.
                    self.command(
                        CommandBody::ResumeRun {
                            interrupt_id: format!("int_early{}", pick % 3),
                            proposal_hash: "h".into(),
                            approve: *approve,
                            payload: None,
                            comment: None,
                            edited_args: None,
                        },
                        &format!("user{principal}"),
                        vec![],
                    );
                    return;
                }
                let interrupt = &open[pick % open.len()];
                self.command(
                    CommandBody::ResumeRun {
                        interrupt_id: interrupt.interrupt_id.clone(),
                        proposal_hash: interrupt.proposal_hash.clone(),
                        approve: *approve,
                        payload: None,
                        comment: None,
                        edited_args: None,
                    },
                    &format!("user{principal}"),
                    vec![],
                );
            }
            Action::Cancel => self.command(CommandBody::CancelRun { reason: None }, "user", vec![]),
            Action::Reconcile { pick, succeeded } => {
                let steps: Vec<_> = self
                    .run()
                    .steps
                    .values()
                    .map(|s| s.operation_id.clone())
                    .collect();
                let operation_id = steps[pick % steps.len()].clone();
                self.command(
                    CommandBody::ReconcileOperation {
                        operation_id,
                        succeeded: *succeeded,
                        output: Some(json!({})),
                        error: None,
                    },
                    "ops",
                    vec!["operator".into()],
                );
            }
            Action::Wait { ms } => {
                self.now += ms;
                self.fire_due();
            }
            Action::Duplicate => {
                if let Some(Input::Command(c)) = self
                    .inputs
                    .iter()
                    .rev()
                    .find(|i| matches!(i, Input::Command(_)))
                    .cloned()
                {
                    self.now += 1;
                    self.feed(Input::Command(Command { at: self.now, ..c }));
                }
            }
        }
    }

    /// Executors answer everything with success and time passes, until nothing moves.
    fn drain(&mut self) {
        for _ in 0..400 {
            if self.run().status.is_terminal() {
                return;
            }
            let in_flight = self.in_flight();
            if let Some(step) = in_flight.first() {
                self.report(&step.clone(), StepOutcome::Succeeded { output: json!({}) });
                continue;
            }
            let next_due = self.run().timers.values().min().copied();
            match next_due {
                Some(due) => {
                    self.now = self.now.max(due);
                    self.fire_due();
                }
                None => return,
            }
        }
        panic!("the run did not settle: {:?}", self.run().status);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, .. ProptestConfig::default() })]

    #[test]
    fn the_fold_is_deterministic_event_sourced_and_terminates(
        graph in prop_oneof![Just("mixed"), Just("gate")],
        ask in any::<bool>(),
        actions in proptest::collection::vec(action(), 0..40),
    ) {
        let mut sim = Sim::new(graph, json!({"ask": ask}));
        for action in &actions {
            sim.act(action);
        }
        sim.drain();

        // (1) the same inputs give the same effects and state.
        let mut state: Option<RunState> = None;
        for (input, effects) in sim.inputs.iter().zip(&sim.effects) {
            let again = apply(state.as_ref(), input, &sim.graphs);
            prop_assert_eq!(&again.effects, effects);
            state = again.state;
        }
        prop_assert_eq!(state.as_ref(), sim.state.as_ref());

        // (2) folding the history gives the state; seq is gap-free; the hash chain holds.
        let mut folded: Option<RunState> = None;
        let mut prev = None;
        for (i, event) in sim.history.iter().enumerate() {
            prop_assert_eq!(event.seq, i as i64 + 1);
            prop_assert_eq!(&event.prev_hash, &prev);
            prop_assert_eq!(event.hash.clone(), Some(event.compute_hash()));
            prev = event.hash.clone();
            folded = evolve(folded, event);
        }
        prop_assert_eq!(folded.as_ref(), sim.state.as_ref());

        // (3) terminal, or waiting on a human or an operator, with nothing else pending.
        let run = sim.run();
        match run.status {
            RunStatus::Succeeded | RunStatus::Failed | RunStatus::Cancelled => {
                prop_assert!(run.timers.is_empty());
                prop_assert!(run.buffered.is_empty(), "an ended run still holds early decisions");
            }
            RunStatus::WaitingApproval => prop_assert!(run.open_interrupts().next().is_some()),
            RunStatus::NeedsReconciliation | RunStatus::Cancelling | RunStatus::Compensating => {
                prop_assert!(run.steps.values().any(|s| s.status == StepStatus::NeedsOperator), "{:?} without an operator task", run.status);
            }
            RunStatus::Running => prop_assert!(false, "a running run with nothing in flight and no timers"),
        }
    }
}
