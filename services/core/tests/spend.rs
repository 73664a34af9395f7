//! Spend accounting on untrusted numbers (see `sortie_core::budget`): usage is charged
//! from `llm` steps only; a count out of bounds fails the step instead of being charged;
//! counters saturate; budgets are bounded where they enter; and histories written before
//! these rules (`RunStarted.rules` 0) fold to the states they were written with.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use serde_json::{json, Value};
use sortie_core::budget::{Budget, Limits, Price, RULES};
use sortie_core::{
    apply, evolve, input::Command, CommandBody, Effect, Event, EventBody, Graph, Graphs, Input,
    RunState, RunStatus, StepOutcome, StepReport,
};

const GRAPH: &str = r#"
id: spend
version: 1
nodes:
  - {id: fetch, tool: echo, side_effect: pure}
  - {id: think, tool: llm, side_effect: pure, compensate_with: forget}
  - {id: forget, tool: echo, side_effect: pure}
edges:
  - {from: fetch, to: think}
"#;

struct Run {
    graphs: Graphs,
    state: Option<RunState>,
    history: Vec<Event>,
    at: i64,
}

impl Run {
    fn start(budget: Option<Budget>) -> Run {
        let mut graphs = Graphs::new();
        graphs.insert(Graph::parse(GRAPH).unwrap()).unwrap();
        let mut run = Run {
            graphs,
            state: None,
            history: Vec::new(),
            at: 0,
        };
        run.command(CommandBody::StartRun {
            graph_id: "spend".into(),
            graph_version: None,
            input: json!({}),
            labels: BTreeMap::new(),
            budget,
            fork: None,
            parent: None,
        });
        run
    }

    fn input(&mut self, input: Input) -> Vec<Event> {
        let applied = apply(self.state.as_ref(), &input, &self.graphs);
        let events: Vec<Event> = applied
            .effects
            .into_iter()
            .filter_map(|e| match e {
                Effect::Emit(event) => Some(event),
                _ => None,
            })
            .collect();
        self.history.extend(events.iter().cloned());
        self.state = applied.state;
        events
    }

    fn command(&mut self, body: CommandBody) -> Vec<Event> {
        self.at += 1;
        self.input(Input::Command(Command {
            command_id: format!("c{}", self.at),
            tenant: "t".into(),
            run_id: "r".into(),
            principal: "alice".into(),
            roles: vec![],
            groups: vec![],
            at: self.at,
            body,
        }))
    }

    fn run(&self) -> &RunState {
        self.state.as_ref().unwrap()
    }

    fn succeed(&mut self, step_id: &str, output: Value) -> Vec<Event> {
        let step = self.run().steps[step_id].clone();
        self.at += 1;
        self.input(Input::StepReport(StepReport {
            spent: None,
            operation_id: step.operation_id.clone(),
            attempt: step.attempt,
            tenant: "t".into(),
            run_id: "r".into(),
            step_id: step_id.into(),
            outcome: StepOutcome::Succeeded { output },
            at: self.at,
        }))
    }
}

fn priced() -> Budget {
    Budget {
        limits: Limits::default(),
        prices: BTreeMap::from([(
            "m".to_owned(),
            Price {
                input_per_1k: 1.0,
                output_per_1k: 2.0,
            },
        )]),
        ceiling: None,
    }
}

/// Any receiver can put a `usage` field in its answer; only a model call is charged.
/// Seen red: with `charge_step` ignoring the tool (every output charged, as before), the
/// echo step's 5,000 tokens were charged too.
#[test]
fn only_llm_steps_are_charged() {
    let mut run = Run::start(Some(priced()));
    assert_eq!(run.run().rules, RULES);
    run.succeed(
        "fetch#1",
        json!({"model": "m", "usage": {"prompt_tokens": 5000, "completion_tokens": 5000}}),
    );
    assert!(run.run().spend.is_zero(), "{:?}", run.run().spend);
    run.succeed(
        "think#1",
        json!({"model": "m", "content": "ok", "usage": {"prompt_tokens": 500, "completion_tokens": 250}}),
    );
    let spend = &run.run().spend;
    assert_eq!((spend.tokens(), spend.llm_calls), (750, 1));
    assert!((spend.cost_usd - 1.0).abs() < 1e-9, "{}", spend.cost_usd);
    assert_eq!(run.run().status, RunStatus::Succeeded);
}

/// A model call reporting a count nobody can account for fails its step (not retried);
/// nothing is charged, the output is not recorded, and the run follows the node's failure
/// path. Seen red: with the refusal removed from report.rs (`refused_usage` answering
/// `None`), the 10^10-token output was recorded as a success and the step never failed.
#[test]
fn an_llm_output_with_an_impossible_count_fails_the_step_and_charges_nothing() {
    for usage in [
        json!({"prompt_tokens": 10_000_000_000u64}),
        json!({"prompt_tokens": u64::MAX, "completion_tokens": u64::MAX}),
        json!({"completion_tokens": -3}),
        json!({"prompt_tokens": "100"}),
        json!({"prompt_tokens": 1.5}),
        json!("lots"),
    ] {
        let mut run = Run::start(Some(priced()));
        run.succeed("fetch#1", json!({}));
        let events = run.succeed("think#1", json!({"model": "m", "usage": usage}));
        let failed = events.iter().find_map(|e| match &e.body {
            EventBody::StepFailed {
                code,
                message,
                retryable,
                ..
            } => Some((code.clone(), message.clone(), *retryable)),
            _ => None,
        });
        let (code, message, retryable) = failed.unwrap_or_else(|| panic!("{usage}: {events:#?}"));
        assert_eq!((code.as_str(), retryable), ("usage_refused", false));
        assert!(message.len() < 200, "a fixed sentence: {message}");
        let state = run.run();
        assert!(state.spend.is_zero(), "{usage}: {:?}", state.spend);
        assert_eq!(state.steps["think#1"].output, None);
        assert_eq!(state.status, RunStatus::Failed, "{usage}");
    }
}

/// Counts at the bound are charged, and a run's counters saturate rather than wrap.
/// Seen red: with `+=` back in `Spend::charge`, the old-history rule's u64::MAX count
/// panicked ("attempt to add with overflow") in this debug build.
#[test]
fn counts_at_the_bound_are_charged_and_counters_saturate() {
    let mut run = Run::start(None);
    run.succeed("fetch#1", json!({}));
    run.succeed(
        "think#1",
        json!({"usage": {"prompt_tokens": 1_000_000_000u64, "completion_tokens": 1_000_000_000u64}}),
    );
    assert_eq!(run.run().spend.tokens(), 2_000_000_000);
    assert_eq!(run.run().status, RunStatus::Succeeded);

    let mut spend = sortie_core::budget::Spend {
        prompt_tokens: u64::MAX - 1,
        completion_tokens: u64::MAX,
        llm_calls: u64::MAX,
        ..Default::default()
    };
    // The rule of old histories charges whatever count an output carries: saturating.
    spend.charge_step(
        0,
        "echo",
        &json!({"usage": {"prompt_tokens": u64::MAX}}),
        &BTreeMap::new(),
    );
    assert_eq!(
        (spend.prompt_tokens, spend.tokens(), spend.llm_calls),
        (u64::MAX, u64::MAX, u64::MAX)
    );
}

/// A history written before `RunStarted.rules` (its RunStarted has no `rules`) keeps
/// the rule it was written under: its non-llm output that carried usage was charged, and
/// the budget decisions in its history were made against that spend, so replay must show
/// the same spend. The same history under today's rules would not charge it: that is why
/// the rule is gated by the run's recorded rules rather than changed for every history.
/// Seen red: with the gate removed (`charge_step` ignoring `rules`), the old history
/// folded to a spend of 0 instead of its stored 5,000 tokens.
#[test]
fn an_old_history_folds_to_the_spend_it_was_written_with() {
    let mut run = Run::start(Some(priced()));
    run.succeed(
        "fetch#1",
        json!({"model": "m", "usage": {"prompt_tokens": 4000, "completion_tokens": 1000}}),
    );
    // The same history as an older build wrote it: RunStarted without `rules`.
    let old: Vec<Event> = run
        .history
        .iter()
        .map(|event| {
            let mut text = serde_json::to_value(event).unwrap();
            if let Some(started) = text["body"]
                .get_mut("RunStarted")
                .and_then(Value::as_object_mut)
            {
                started.remove("rules");
            }
            serde_json::from_value(text).unwrap()
        })
        .collect();
    let folded = old.iter().fold(None, evolve);
    let folded = folded.unwrap();
    assert_eq!(folded.rules, 0);
    assert_eq!(folded.spend.tokens(), 5000, "charged as it was written");
    assert!((folded.spend.cost_usd - 6.0).abs() < 1e-9);
    // The run as written today is not charged for it.
    assert!(run.run().spend.is_zero());
    // And its state serializes as before (no `rules` key when 0).
    assert!(serde_json::to_value(&folded)
        .unwrap()
        .get("rules")
        .is_none());
}

/// Limits and prices are held to `Budget::check` wherever they enter: the fold refuses a
/// start with one out of bounds (the model layer refuses it before the fold), and a budget
/// approval's raise is held to the same check. Seen red: without the check in start.rs,
/// the start with a negative cost limit was accepted.
#[test]
fn budgets_out_of_bounds_are_refused() {
    let bad = |limits: Limits| Budget {
        limits,
        prices: BTreeMap::new(),
        ceiling: None,
    };
    for budget in [
        bad(Limits {
            cost_usd: Some(-1.0),
            ..Limits::default()
        }),
        bad(Limits {
            cost_usd: Some(f64::NAN),
            ..Limits::default()
        }),
        bad(Limits {
            cost_usd: Some(f64::INFINITY),
            ..Limits::default()
        }),
        bad(Limits {
            tokens: Some(u64::MAX),
            ..Limits::default()
        }),
        bad(Limits {
            tool_calls: Some(u64::MAX),
            ..Limits::default()
        }),
        bad(Limits {
            wall_time: Some(sortie_core::duration::Millis(-1)),
            ..Limits::default()
        }),
        Budget {
            limits: Limits::default(),
            prices: BTreeMap::from([(
                "m".to_owned(),
                Price {
                    input_per_1k: f64::NAN,
                    output_per_1k: 0.0,
                },
            )]),
            ceiling: None,
        },
    ] {
        assert!(budget.check().is_err(), "{budget:?}");
        let run = Run::start(Some(budget.clone()));
        assert!(run.state.is_none(), "{budget:?}: started");
        let codes: Vec<_> = run
            .history
            .iter()
            .map(|e| match &e.body {
                EventBody::CommandRejected { code, .. } => code.as_str(),
                other => other.name(),
            })
            .collect();
        assert_eq!(codes, ["bad_budget"], "{budget:?}");
    }
    assert!(priced().check().is_ok());
    assert!(Limits {
        tokens: Some(sortie_core::budget::MAX_TOKEN_LIMIT),
        cost_usd: Some(0.0),
        tool_calls: Some(0),
        wall_time: Some(sortie_core::duration::Millis(0)),
    }
    .check()
    .is_ok());
}
