//! A guarded step (`unsafe`, `reconcilable`) is never without a timer: its executor
//! commits the intent before calling, so an attempt whose executor dies after that commit
//! is never redelivered and only the step timer notices it. A node without a `timeout`
//! gets `GUARDED_TIMEOUT` (rules 2); past it the outcome is unknown and an operator (or a
//! lookup) settles it, so cancel and `max_duration` no longer wait for good. A run started
//! under older rules decides as it always did.
//!
//! Seen red: with the default left out of `Ctx::dispatch_attempt`, the unsafe step had no
//! timer (nothing could ever move the run on).

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use serde_json::json;
use sortie_core::budget::GUARDED_TIMEOUT;
use sortie_core::{
    apply, evolve, input::Command, CommandBody, Effect, Event, EventBody, Graph, Graphs, Input,
    Intent, RunState, RunStatus, StepOutcome, StepReport, TimerKey,
};

const GRAPH: &str = r#"
id: pay
version: 1
nodes:
  - {id: pay, tool: http, side_effect: unsafe}
  - {id: book, tool: http, side_effect: reconcilable}
  - {id: note, tool: http, side_effect: keyed}
edges:
  - {from: pay, to: book}
  - {from: book, to: note}
"#;

/// A keyed step, then an unsafe one without a timeout.
const PREP: &str = r#"
id: prep
version: 1
nodes:
  - {id: prep, tool: http, side_effect: keyed}
  - {id: pay, tool: http, side_effect: unsafe}
edges:
  - {from: prep, to: pay}
"#;

fn graphs() -> Graphs {
    let mut graphs = Graphs::new();
    graphs.insert(Graph::parse(GRAPH).unwrap()).unwrap();
    graphs.insert(Graph::parse(PREP).unwrap()).unwrap();
    graphs
}

fn start(at: i64) -> Input {
    start_of("pay", at)
}

fn start_of(graph: &str, at: i64) -> Input {
    Input::Command(Command {
        command_id: "start".into(),
        tenant: "t".into(),
        run_id: "r".into(),
        principal: "svc".into(),
        roles: vec![],
        groups: vec![],
        at,
        body: CommandBody::StartRun {
            graph_id: graph.into(),
            graph_version: None,
            input: json!({}),
            labels: BTreeMap::new(),
            budget: None,
            fork: None,
            parent: None,
        },
    })
}

fn intents(effects: &[Effect]) -> Vec<Intent> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Dispatch(i) => Some(i.clone()),
            _ => None,
        })
        .collect()
}

fn started(intent: &Intent, at: i64) -> Input {
    Input::StepReport(StepReport {
        spent: None,
        operation_id: intent.operation_id.clone(),
        attempt: intent.attempt,
        tenant: "t".into(),
        run_id: "r".into(),
        step_id: intent.step_id.clone(),
        outcome: StepOutcome::Started,
        at,
    })
}

fn step_timer(state: &RunState, step_id: &str) -> Option<i64> {
    state
        .timers
        .get(
            &TimerKey::StepTimeout {
                step_id: step_id.into(),
                attempt: 1,
            }
            .encode(),
        )
        .copied()
}

#[test]
fn a_guarded_step_without_a_timeout_still_has_a_timer() {
    let graphs = graphs();
    let applied = apply(None, &start(1_000), &graphs);
    let state = applied.state.unwrap();
    let pay = intents(&applied.effects).remove(0);
    assert_eq!(pay.step_id, "pay#1");
    assert_eq!(step_timer(&state, "pay#1"), Some(1_000 + GUARDED_TIMEOUT.0));

    // The executor recorded STARTED, committed the intent, called, and died: silence.
    let state = apply(Some(&state), &started(&pay, 1_100), &graphs)
        .state
        .unwrap();
    let due = 1_000 + GUARDED_TIMEOUT.0;
    let fired = apply(
        Some(&state),
        &Input::TimerFired {
            run_id: "r".into(),
            timer: TimerKey::StepTimeout {
                step_id: "pay#1".into(),
                attempt: 1,
            },
            at: due,
        },
        &graphs,
    );
    let state = fired.state.unwrap();
    assert_eq!(state.status, RunStatus::NeedsReconciliation);
    assert!(fired.effects.iter().any(|e| matches!(
        e,
        Effect::Emit(Event {
            body: EventBody::StepOutcomeUnknown {
                needs_operator: true,
                ..
            },
            ..
        })
    )));
}

#[test]
fn a_run_under_older_rules_decides_as_it_did() {
    let graphs = graphs();
    let applied = apply(None, &start_of("prep", 1_000), &graphs);
    let prep = intents(&applied.effects).remove(0);
    // The same start as a build of rules 1 recorded it.
    let events: Vec<Event> = applied
        .effects
        .iter()
        .filter_map(|e| match e {
            Effect::Emit(event) => {
                let mut event = event.clone();
                if let EventBody::RunStarted { rules, .. } = &mut event.body {
                    *rules = 1;
                }
                Some(event)
            }
            _ => None,
        })
        .collect();
    let older = events.iter().fold(None, evolve).unwrap();
    assert_eq!(older.rules, 1);
    let done = Input::StepReport(StepReport {
        spent: None,
        operation_id: prep.operation_id.clone(),
        attempt: 1,
        tenant: "t".into(),
        run_id: "r".into(),
        step_id: prep.step_id.clone(),
        outcome: StepOutcome::Succeeded { output: json!({}) },
        at: 2_000,
    });
    let next = apply(Some(&older), &done, &graphs);
    assert_eq!(intents(&next.effects)[0].step_id, "pay#1");
    let state = next.state.unwrap();
    assert_eq!(step_timer(&state, "pay#1"), None, "{:?}", state.timers);
    // The same under today's rules: the default timer.
    let today = apply(
        Some(
            &apply(None, &start_of("prep", 1_000), &graphs)
                .state
                .unwrap(),
        ),
        &done,
        &graphs,
    );
    assert_eq!(
        step_timer(&today.state.unwrap(), "pay#1"),
        Some(2_000 + GUARDED_TIMEOUT.0)
    );
}
