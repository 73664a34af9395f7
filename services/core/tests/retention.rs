//! Issue #14, item 9: a graph's `retention`. A finished run arms a retention timer that
//! long after its end; when it fires, the fold appends `RunForgotten` and the run's state
//! becomes its audit summary — no input, arguments, outputs or final output; ids,
//! statuses, operation ids, who and when kept, the hash chain continued — and asks the
//! reducer to tombstone the run's step results (`Effect::Forget`). Replaying the history
//! (what `audit replay` does) gives the same summary.
//!
//! Checked red: with `RunState::forget` keeping the input, `a_finished_run_is_forgotten…`
//! fails on "the input is gone".

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use serde_json::json;
use sortie_core::input::{Command, StepReport};
use sortie_core::{
    apply, evolve, CommandBody, Effect, EventBody, Graph, Graphs, Input, RunState, RunStatus,
    StepOutcome, TimerKey,
};

const HOUR: i64 = 3_600_000;
const KEPT: &str = "id: kept\nversion: 1\nretention: 1h\nnodes:\n  - {id: read, tool: echo, side_effect: pure, args: {secret: $input.secret}}\n";
const FOREVER: &str =
    "id: forever\nversion: 1\nnodes:\n  - {id: read, tool: echo, side_effect: pure}\n";

fn graphs() -> Graphs {
    let mut graphs = Graphs::new();
    graphs.insert(Graph::parse(KEPT).unwrap()).unwrap();
    graphs.insert(Graph::parse(FOREVER).unwrap()).unwrap();
    graphs
}

/// Alice's start of a run `r` of `graph` at 1000, its input a secret.
fn start_of(graph: &str) -> Input {
    Input::Command(Command {
        command_id: "c1".into(),
        tenant: "t".into(),
        run_id: "r".into(),
        principal: "alice".into(),
        roles: vec![],
        groups: vec![],
        at: 1000,
        body: CommandBody::StartRun {
            graph_id: graph.into(),
            graph_version: None,
            input: json!({"secret": "card 4111"}),
            labels: BTreeMap::new(),
            budget: None,
            fork: None,
            parent: None,
        },
    })
}

/// Starts a run of `graph` at 1000 and lets its one step succeed at 2000; returns the
/// finished state and every event so far.
fn finished(graph: &str, graphs: &Graphs) -> (RunState, Vec<sortie_core::Event>) {
    let start = start_of(graph);
    let started = apply(None, &start, graphs);
    let mut events = emitted(&started.effects);
    let state = started.state.unwrap();
    let step = state.steps.values().next().unwrap().clone();
    let report = Input::StepReport(StepReport {
        spent: None,
        operation_id: step.operation_id.clone(),
        attempt: step.attempt,
        tenant: "t".into(),
        run_id: "r".into(),
        step_id: step.step_id.clone(),
        outcome: StepOutcome::Succeeded {
            output: json!({"echo": "card 4111"}),
        },
        at: 2000,
    });
    let done = apply(Some(&state), &report, graphs);
    events.extend(emitted(&done.effects));
    (done.state.unwrap(), events)
}

fn emitted(effects: &[Effect]) -> Vec<sortie_core::Event> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Emit(event) => Some(event.clone()),
            _ => None,
        })
        .collect()
}

fn fire(state: &RunState, at: i64, graphs: &Graphs) -> sortie_core::Applied {
    let timer = Input::TimerFired {
        run_id: "r".into(),
        timer: TimerKey::Retention,
        at,
    };
    apply(Some(state), &timer, graphs)
}

#[test]
fn a_finished_run_is_forgotten_when_its_retention_passes() {
    let graphs = graphs();
    let (state, mut events) = finished("kept", &graphs);
    assert_eq!(state.status, RunStatus::Succeeded);
    let due = state.timer_due(&TimerKey::Retention);
    assert_eq!(due, Some(2000 + HOUR), "armed an hour after the end");
    assert!(serde_json::to_string(&state).unwrap().contains("card 4111"));

    let early = fire(&state, 2000 + HOUR - 1, &graphs);
    assert_eq!(early.ignored, Some("timer not yet due"));

    let forgotten = fire(&state, 2000 + HOUR, &graphs);
    let new_events = emitted(&forgotten.effects);
    assert_eq!(new_events.len(), 1);
    assert!(matches!(
        &new_events[0].body,
        EventBody::RunForgotten { reason } if reason == "retention"
    ));
    assert_eq!(new_events[0].seq, state.last_event_seq + 1);
    assert_eq!(
        new_events[0].prev_hash, state.last_hash,
        "the chain goes on"
    );
    let operations: Vec<String> = state
        .steps
        .values()
        .map(|s| s.operation_id.clone())
        .collect();
    assert!(
        forgotten.effects.iter().any(|e| matches!(
            e,
            Effect::Forget { run_id, operations: ops } if run_id == "r" && *ops == operations
        )),
        "the step results are tombstoned: {:?}",
        forgotten.effects
    );
    assert!(forgotten.effects.iter().any(|e| matches!(
        e,
        Effect::DisarmTimer {
            timer: TimerKey::Retention,
            ..
        }
    )));

    let summary = forgotten.state.clone().unwrap();
    let text = serde_json::to_string(&summary).unwrap();
    assert!(!text.contains("card 4111"), "the input is gone: {text}");
    assert_eq!(summary.input, serde_json::Value::Null);
    assert!(summary.output.is_none());
    assert!(summary
        .steps
        .values()
        .all(|s| s.args.is_null() && s.output.is_none()));
    assert!(summary.timers.is_empty());
    assert_eq!(summary.status, RunStatus::Succeeded, "the outcome is kept");
    assert_eq!(summary.started_by, "alice");
    assert_eq!(summary.steps.len(), state.steps.len());
    assert_eq!(summary.forgotten.as_ref().unwrap().at, 2000 + HOUR);

    // An auditor re-folding the history gets the same summary.
    events.extend(new_events);
    let replayed = events.iter().fold(None, evolve).unwrap();
    assert_eq!(
        serde_json::to_value(&replayed).unwrap()["forgotten"],
        serde_json::to_value(&summary).unwrap()["forgotten"]
    );
    assert_eq!(replayed.input, summary.input);
    assert_eq!(replayed.last_hash, summary.last_hash);

    let again = fire(&summary, 3 * HOUR, &graphs);
    assert!(again.ignored.is_some(), "forgotten once");
}

#[test]
fn a_graph_without_retention_keeps_its_runs() {
    let graphs = graphs();
    let (state, _) = finished("forever", &graphs);
    assert_eq!(state.status, RunStatus::Succeeded);
    assert_eq!(state.timer_due(&TimerKey::Retention), None);
    assert!(fire(&state, i64::MAX / 2, &graphs).ignored.is_some());
}

fn forget_command(id: &str, roles: &[&str], at: i64) -> Input {
    Input::Command(Command {
        command_id: id.into(),
        tenant: "t".into(),
        run_id: "r".into(),
        principal: "ops".into(),
        roles: roles.iter().map(|r| r.to_string()).collect(),
        groups: vec![],
        at,
        body: CommandBody::ForgetRun {
            reason: Some("erasure request".into()),
        },
    })
}

fn rejection(applied: &sortie_core::Applied) -> Option<String> {
    emitted(&applied.effects)
        .iter()
        .find_map(|e| match &e.body {
            EventBody::CommandRejected { code, .. } => Some(code.clone()),
            _ => None,
        })
}

/// Issue #14, item 8: `ForgetRun` (`DELETE /v1/runs/{id}`) forgets a finished run now,
/// as its retention would; only an operator may, and only once the run has ended.
/// Checked red: with the role check removed from `decide::forget`, "a viewer may not"
/// fails.
#[test]
fn an_operator_forgets_a_finished_run_at_once_and_only_then() {
    let graphs = graphs();
    let (state, _) = finished("forever", &graphs);
    let viewer = apply(Some(&state), &forget_command("f0", &[], 3000), &graphs);
    assert_eq!(
        rejection(&viewer).as_deref(),
        Some("forbidden"),
        "a viewer may not"
    );
    assert!(viewer.state.unwrap().forgotten.is_none());

    let forgotten = apply(
        Some(&state),
        &forget_command("f1", &["operator"], 3000),
        &graphs,
    );
    assert_eq!(rejection(&forgotten), None);
    let events = emitted(&forgotten.effects);
    assert!(events.iter().any(|e| matches!(
        &e.body,
        EventBody::RunForgotten { reason } if reason == "deleted: erasure request"
    )));
    assert!(forgotten
        .effects
        .iter()
        .any(|e| matches!(e, Effect::Forget { .. })));
    let summary = forgotten.state.unwrap();
    assert!(!serde_json::to_string(&summary)
        .unwrap()
        .contains("card 4111"));
    assert_eq!(summary.status, RunStatus::Succeeded);

    let again = apply(
        Some(&summary),
        &forget_command("f2", &["operator"], 4000),
        &graphs,
    );
    assert_eq!(rejection(&again), None, "idempotent");
    assert!(!emitted(&again.effects)
        .iter()
        .any(|e| matches!(e.body, EventBody::RunForgotten { .. })));
}

#[test]
fn a_running_run_is_not_forgotten() {
    let graphs = graphs();
    let start = start_of("kept");
    let running = apply(None, &start, &graphs).state.unwrap();
    let refused = apply(
        Some(&running),
        &forget_command("f1", &["operator"], 1500),
        &graphs,
    );
    assert_eq!(rejection(&refused).as_deref(), Some("bad_state"));
    assert!(refused.state.unwrap().forgotten.is_none());
}

/// Issue #14, item 7: with a seal, the fold's hash chain is taken over the sealed events
/// (what Kafka holds), so it verifies without the key; the effects stay plaintext.
#[test]
fn a_sealed_runs_hash_chain_is_taken_over_its_sealed_events() {
    struct Tagged;
    impl sortie_core::Seal for Tagged {
        fn seal(&self, value: &serde_json::Value) -> serde_json::Value {
            json!({"$sealed": format!("t.{}", value.to_string().len())})
        }
        fn active(&self) -> bool {
            true
        }
    }
    let graphs = graphs();
    let start = start_of("kept");
    let sealed = sortie_core::apply_sealed(None, &start, &graphs, &Tagged);
    let plain = apply(None, &start, &graphs);
    let (sealed_events, plain_events) = (emitted(&sealed.effects), emitted(&plain.effects));
    assert_eq!(sealed_events.len(), plain_events.len());
    assert_eq!(sealed.sealed_events.len(), sealed_events.len());
    for ((s, p), w) in sealed_events
        .iter()
        .zip(&plain_events)
        .zip(&sealed.sealed_events)
    {
        assert_eq!(s.body, p.body, "the effects are plaintext");
        let mut written = s.sealed(&Tagged);
        assert_eq!(s.hash, Some(written.compute_hash()), "hashed as written");
        written.hash = s.hash.clone();
        assert_eq!(
            *w, written,
            "the writer gets the copy the hash was taken over"
        );
        assert_ne!(s.hash, p.hash);
    }
    assert!(plain.sealed_events.is_empty());
    assert_eq!(sealed.state.unwrap().input, json!({"secret": "card 4111"}));
}
