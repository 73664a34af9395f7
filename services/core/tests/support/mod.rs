//! Scenario files: a run's inputs, each with the events it must produce, folded by the
//! real `apply`. Every scenario is also checked for determinism (the same inputs give the
//! same effects), for event sourcing (re-folding the emitted history gives the same
//! state) and for an intact hash chain.

#![allow(dead_code, clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;
use sortie_core::{
    apply, evolve, input::Command, Applied, CommandBody, Effect, Event, EventBody, Graph, Graphs,
    Input, RunState, StepOutcome, StepReport, TimerKey,
};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub description: String,
    pub graphs: Vec<Value>,
    #[serde(default = "default_run")]
    pub run: String,
    #[serde(default = "default_tenant")]
    pub tenant: String,
    pub steps: Vec<Step>,
    /// The run's final status.
    pub status: Option<String>,
    /// Fields of the final state (compared as a JSON subset).
    #[serde(default)]
    pub state: Option<Value>,
}

fn default_run() -> String {
    "run_1".into()
}

fn default_tenant() -> String {
    "acme".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    pub at: i64,
    #[serde(default)]
    pub start: Option<Start>,
    #[serde(default)]
    pub approve: Option<Decision>,
    #[serde(default)]
    pub reject: Option<Decision>,
    #[serde(default)]
    pub cancel: Option<Cmd>,
    #[serde(default)]
    pub reconcile: Option<Reconcile>,
    #[serde(default)]
    pub report: Option<Report>,
    #[serde(default)]
    pub signal: Option<Signal>,
    /// Fire every timer due at `at`.
    #[serde(default)]
    pub timers: bool,
    /// Publish a graph (a new version) before this step's input.
    #[serde(default)]
    pub publish: Option<Value>,
    /// The events the input must produce, as one-line summaries.
    pub then: Vec<String>,
    /// Intents dispatched: "step_id aN" (and " lookup only" for an attempt that only asks).
    #[serde(default)]
    pub dispatched: Option<Vec<String>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Cmd {
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub tenant: Option<String>,
    #[serde(default)]
    pub run: Option<String>,
    #[serde(default = "default_principal")]
    pub by: String,
    #[serde(default)]
    pub roles: Vec<String>,
    #[serde(default)]
    pub groups: Vec<String>,
    #[serde(default)]
    pub reason: Option<String>,
}

fn default_principal() -> String {
    "user:ops".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Start {
    #[serde(flatten)]
    pub cmd: Cmd,
    pub graph: String,
    #[serde(default)]
    pub version: Option<u32>,
    #[serde(default)]
    pub input: Value,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Decision {
    #[serde(flatten)]
    pub cmd: Cmd,
    /// The node whose open interrupt is decided (its id and hash are looked up).
    pub node: String,
    /// Override the proposal hash (to test stale decisions).
    #[serde(default)]
    pub hash: Option<String>,
    #[serde(default)]
    pub payload: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Signal {
    #[serde(flatten)]
    pub cmd: Cmd,
    pub name: String,
    /// Defaults to the command id.
    #[serde(default)]
    pub signal_id: Option<String>,
    #[serde(default)]
    pub payload: Value,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reconcile {
    #[serde(flatten)]
    pub cmd: Cmd,
    pub step: String,
    pub succeeded: bool,
    #[serde(default)]
    pub output: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Report {
    pub step: String,
    /// Defaults to the step's current attempt.
    #[serde(default)]
    pub attempt: Option<u32>,
    /// started | succeeded | failed | retryable | unknown
    pub outcome: String,
    #[serde(default)]
    pub output: Value,
}

pub fn load(path: &Path) -> Scenario {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn graphs(values: &[Value]) -> Graphs {
    let mut graphs = Graphs::new();
    for value in values {
        let graph = Graph::parse(&serde_json::to_string(value).unwrap()).unwrap();
        graphs.insert(graph).unwrap();
    }
    graphs
}

/// One line per event: what happened, compactly.
pub fn summary(event: &Event) -> String {
    match &event.body {
        EventBody::CommandAccepted {
            command, duplicate, ..
        } => {
            format!(
                "CommandAccepted {command}{}",
                if *duplicate { " duplicate" } else { "" }
            )
        }
        EventBody::CommandRejected { command, code, .. } => {
            format!("CommandRejected {command} {code}")
        }
        EventBody::RunStarted {
            graph_id,
            graph_version,
            ..
        } => format!("RunStarted {graph_id}@{graph_version}"),
        EventBody::StepDispatched {
            step_id,
            attempt,
            role,
            lookup_only,
            ..
        } => {
            let role = match role {
                sortie_core::event::StepRole::Node => String::new(),
                sortie_core::event::StepRole::Requested { by } => format!(" requested by {by}"),
                sortie_core::event::StepRole::Compensation { of } => format!(" compensating {of}"),
                sortie_core::event::StepRole::Substitute { for_node } => {
                    format!(" instead of {for_node}")
                }
                sortie_core::event::StepRole::Precheck { of } => format!(" prechecking {of}"),
            };
            let lookup = if *lookup_only { " lookup only" } else { "" };
            format!("StepDispatched {step_id} a{attempt}{role}{lookup}")
        }
        EventBody::StepStarted { step_id, attempt } => format!("StepStarted {step_id} a{attempt}"),
        EventBody::StepSucceeded {
            step_id, attempt, ..
        } => format!("StepSucceeded {step_id} a{attempt}"),
        EventBody::StepFailed {
            step_id,
            attempt,
            code,
            retry_at,
            ..
        } => format!(
            "StepFailed {step_id} a{attempt} {code}{}",
            retry_at
                .map(|t| format!(" retry at {t}"))
                .unwrap_or_default()
        ),
        EventBody::StepOutcomeUnknown {
            step_id,
            attempt,
            needs_operator,
            ..
        } => format!(
            "StepOutcomeUnknown {step_id} a{attempt}{}",
            if *needs_operator {
                " needs operator"
            } else {
                ""
            }
        ),
        EventBody::OperationReconciled {
            step_id, succeeded, ..
        } => {
            format!(
                "OperationReconciled {step_id} {}",
                if *succeeded { "succeeded" } else { "failed" }
            )
        }
        EventBody::Interrupted { node, step_id, .. } => format!("Interrupted {node} {step_id}"),
        EventBody::InterruptDecided {
            approve,
            decided_by,
            is_final,
            ..
        } => format!(
            "InterruptDecided {} by {decided_by}{}",
            if *approve { "approve" } else { "reject" },
            if *is_final { " final" } else { "" }
        ),
        EventBody::InterruptEscalated { approver_group, .. } => {
            format!("InterruptEscalated {approver_group}")
        }
        EventBody::InterruptExpired { on_timeout, .. } => format!("InterruptExpired {on_timeout}"),
        EventBody::CancelRequested { .. } => "CancelRequested".into(),
        EventBody::RunStatusChanged { status, .. } => {
            format!("RunStatusChanged {}", status.as_str())
        }
        EventBody::DecisionBuffered { interrupt_id, .. } => {
            format!("DecisionBuffered {interrupt_id}")
        }
        EventBody::RunForgotten { reason } => format!("RunForgotten {reason}"),
        EventBody::SignalWaitOpened {
            step_id, signal, ..
        } => {
            format!("SignalWaitOpened {step_id} {signal}")
        }
        EventBody::SignalReceived {
            step_id, signal_id, ..
        } => format!("SignalReceived {step_id} {signal_id}"),
        EventBody::SignalBuffered { signal_id, .. } => format!("SignalBuffered {signal_id}"),
        EventBody::SignalWaitExpired {
            step_id,
            on_timeout,
        } => format!("SignalWaitExpired {step_id} {on_timeout}"),
        EventBody::BudgetReserved {
            step_id,
            child_run_id,
            ..
        } => format!("BudgetReserved {step_id} {child_run_id}"),
        EventBody::BudgetSettled { step_id, spent } => {
            format!("BudgetSettled {step_id} {}", spent.tokens())
        }
    }
}

fn command(s: &Scenario, cmd: &Cmd, n: usize, at: i64, body: CommandBody) -> Input {
    Input::Command(Command {
        command_id: cmd.id.clone().unwrap_or_else(|| format!("cmd-{n}")),
        tenant: cmd.tenant.clone().unwrap_or_else(|| s.tenant.clone()),
        run_id: cmd.run.clone().unwrap_or_else(|| s.run.clone()),
        principal: cmd.by.clone(),
        roles: cmd.roles.clone(),
        at,
        body,
        groups: cmd.groups.clone(),
    })
}

/// Turns a scenario step into inputs, resolving ids from the current state.
fn inputs(s: &Scenario, n: usize, step: &Step, state: Option<&RunState>) -> Vec<Input> {
    if let Some(start) = &step.start {
        return vec![command(
            s,
            &start.cmd,
            n,
            step.at,
            CommandBody::StartRun {
                graph_id: start.graph.clone(),
                graph_version: start.version,
                input: start.input.clone(),
                labels: start.labels.clone(),
                budget: None,
                fork: None,
                parent: None,
            },
        )];
    }
    for (decision, approve) in [(&step.approve, true), (&step.reject, false)] {
        if let Some(d) = decision {
            let interrupt = state.and_then(|run| {
                run.interrupts
                    .values()
                    .filter(|i| i.node == d.node)
                    .max_by_key(|i| i.status == sortie_core::state::InterruptStatus::Open)
            });
            let (id, hash) = interrupt
                .map(|i| (i.interrupt_id.clone(), i.proposal_hash.clone()))
                .unwrap_or_else(|| ("int_missing".into(), "none".into()));
            return vec![command(
                s,
                &d.cmd,
                n,
                step.at,
                CommandBody::ResumeRun {
                    interrupt_id: id,
                    proposal_hash: d.hash.clone().unwrap_or(hash),
                    approve,
                    payload: d.payload.clone(),
                    comment: None,
                    edited_args: None,
                },
            )];
        }
    }
    if let Some(cmd) = &step.cancel {
        return vec![command(
            s,
            cmd,
            n,
            step.at,
            CommandBody::CancelRun {
                reason: cmd.reason.clone(),
            },
        )];
    }
    if let Some(sig) = &step.signal {
        let input = command(
            s,
            &sig.cmd,
            n,
            step.at,
            CommandBody::SignalRun {
                name: sig.name.clone(),
                signal_id: String::new(),
                payload: sig.payload.clone(),
            },
        );
        let Input::Command(mut command) = input else {
            unreachable!()
        };
        if let CommandBody::SignalRun { signal_id, .. } = &mut command.body {
            *signal_id = sig.signal_id.clone().unwrap_or(command.command_id.clone());
        }
        return vec![Input::Command(command)];
    }
    if let Some(r) = &step.reconcile {
        let operation_id = state
            .and_then(|run| run.steps.get(&r.step))
            .map(|st| st.operation_id.clone())
            .unwrap_or_else(|| "op_missing".into());
        return vec![command(
            s,
            &r.cmd,
            n,
            step.at,
            CommandBody::ReconcileOperation {
                operation_id,
                succeeded: r.succeeded,
                output: r.output.clone(),
                error: if r.succeeded {
                    None
                } else {
                    Some("declined".into())
                },
            },
        )];
    }
    if let Some(r) = &step.report {
        let st = state.and_then(|run| run.steps.get(&r.step));
        let outcome = match r.outcome.as_str() {
            "started" => StepOutcome::Started,
            "succeeded" => StepOutcome::Succeeded {
                output: r.output.clone(),
            },
            "failed" => StepOutcome::Failed {
                retryable: false,
                code: "http_400".into(),
                message: "bad request".into(),
                retry_after_ms: None,
            },
            "retryable" => StepOutcome::Failed {
                retryable: true,
                code: "http_503".into(),
                message: "unavailable".into(),
                retry_after_ms: None,
            },
            "unknown" => StepOutcome::Unknown {
                code: "connection_reset".into(),
                message: "connection reset after sending".into(),
            },
            other => panic!("unknown outcome {other}"),
        };
        return vec![Input::StepReport(StepReport {
            spent: None,
            operation_id: st
                .map(|x| x.operation_id.clone())
                .unwrap_or_else(|| "op_missing".into()),
            attempt: r.attempt.or(st.map(|x| x.attempt)).unwrap_or(1),
            tenant: s.tenant.clone(),
            run_id: s.run.clone(),
            step_id: r.step.clone(),
            outcome,
            at: step.at,
        })];
    }
    if step.timers {
        let mut due: Vec<(i64, String)> = state
            .map(|run| {
                run.timers
                    .iter()
                    .filter(|(_, d)| **d <= step.at)
                    .map(|(k, d)| (*d, k.clone()))
                    .collect()
            })
            .unwrap_or_default();
        due.sort();
        return due
            .into_iter()
            .map(|(_, key)| Input::TimerFired {
                run_id: s.run.clone(),
                timer: TimerKey::decode(&key).unwrap(),
                at: step.at,
            })
            .collect();
    }
    panic!("step at {} has no input", step.at)
}

/// Runs a scenario file and checks every expectation. Returns the events and final state.
pub fn run(path: &Path) -> (Vec<Event>, Option<RunState>) {
    let s = load(path);
    let mut graphs = graphs(&s.graphs);
    let mut states: BTreeMap<String, RunState> = BTreeMap::new();
    let mut history: Vec<Event> = Vec::new();
    let mut replay: Vec<(Graphs, Input, Vec<Effect>)> = Vec::new();
    for (n, step) in s.steps.iter().enumerate() {
        if let Some(graph) = &step.publish {
            graphs
                .insert(Graph::parse(&serde_json::to_string(graph).unwrap()).unwrap())
                .unwrap();
        }
        let mut got = Vec::new();
        let mut dispatched = Vec::new();
        // Resolve all inputs of a step against the state before it (timers due together).
        let step_inputs = inputs(&s, n, step, states.get(&s.run));
        for input in step_inputs {
            let run_id = input.run_id().to_owned();
            let Applied {
                effects,
                state: next,
                ..
            } = apply(states.get(&run_id), &input, &graphs);
            for effect in &effects {
                match effect {
                    Effect::Emit(e) => {
                        got.push(summary(e));
                        if e.run_id == s.run {
                            history.push(e.clone());
                        }
                    }
                    Effect::Dispatch(i) => dispatched.push(format!(
                        "{} a{}{}",
                        i.step_id,
                        i.attempt,
                        if i.lookup_only { " lookup only" } else { "" }
                    )),
                    _ => {}
                }
            }
            if run_id == s.run {
                replay.push((graphs.clone(), input, effects));
            }
            match next {
                Some(next) => {
                    states.insert(run_id, next);
                }
                None => {
                    states.remove(&run_id);
                }
            }
        }
        assert_eq!(
            got,
            step.then,
            "{}: events of step {n} (at {})",
            path.display(),
            step.at
        );
        if let Some(expected) = &step.dispatched {
            assert_eq!(
                &dispatched,
                expected,
                "{}: intents of step {n}",
                path.display()
            );
        }
    }
    let state = states.get(&s.run).cloned();
    if let Some(status) = &s.status {
        let actual = state.as_ref().map(|r| r.status.as_str().to_uppercase());
        assert_eq!(
            actual.as_deref(),
            Some(status.as_str()),
            "{}: final status",
            path.display()
        );
    }
    if let Some(expected) = &s.state {
        let actual = serde_json::to_value(&state).unwrap();
        assert_subset(expected, &actual, path, "state");
    }
    check_invariants(path, &replay, &history, state.as_ref());
    // Shadow replay: the inputs re-derived from the history re-decide the same events.
    let shadow = sortie_core::shadow::replay(&history, &graphs);
    assert_eq!(
        shadow.divergence,
        None,
        "{}: shadow replay diverges",
        path.display()
    );
    (history, state)
}

fn assert_subset(expected: &Value, actual: &Value, path: &Path, at: &str) {
    match (expected, actual) {
        (Value::Object(e), Value::Object(a)) => {
            for (k, v) in e {
                let inner = a.get(k).unwrap_or(&Value::Null);
                assert_subset(v, inner, path, &format!("{at}.{k}"));
            }
        }
        _ => assert_eq!(expected, actual, "{}: {at}", path.display()),
    }
}

/// Determinism, event sourcing and the hash chain.
/// `replay` holds each input with the graph table it was applied against.
pub fn check_invariants(
    path: &Path,
    replay: &[(Graphs, Input, Vec<Effect>)],
    history: &[Event],
    last: Option<&RunState>,
) {
    // Same inputs, same effects.
    let mut state: Option<RunState> = None;
    for (graphs, input, effects) in replay {
        let again = apply(state.as_ref(), input, graphs);
        assert_eq!(
            &again.effects,
            effects,
            "{}: apply is not deterministic",
            path.display()
        );
        state = again.state;
    }
    // Re-folding the history reproduces the state.
    let mut folded: Option<RunState> = None;
    let mut prev: Option<String> = None;
    for event in history.iter().filter(|e| e.seq > 0) {
        folded = evolve(folded, event);
        assert_eq!(
            event.prev_hash,
            prev,
            "{}: hash chain broken at seq {}",
            path.display(),
            event.seq
        );
        assert_eq!(
            event.hash.as_deref(),
            Some(event.compute_hash().as_str()),
            "{}: hash of seq {}",
            path.display(),
            event.seq
        );
        prev = event.hash.clone();
    }
    assert_eq!(
        folded.as_ref(),
        last,
        "{}: folding the history does not give the state",
        path.display()
    );
}
