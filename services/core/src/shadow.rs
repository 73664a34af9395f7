//! Shadow replay: re-decide a recorded history with this build and a given graph version,
//! and find the first decision that differs — a deploy gate for a new engine or graph.
//!
//! The inputs are re-derived from the history itself, one per state version (every
//! version is one applied input): a command from its answer and the events it caused
//! (`RunStarted`, `InterruptDecided`, `DecisionBuffered`, `CancelRequested`,
//! `OperationReconciled`), an executor report from the step event it caused, a timer
//! from what it did (a retry's dispatch, a timeout's unknown outcome, an approval's
//! escalation or expiry, the deadline). A re-decided event agrees with the recorded one
//! when every field the recorded one has is the same (fields a newer build adds, absent
//! from an older history, are annotations, not decisions). The approver's roles and groups are not in the
//! history; an accepted decision is re-decided with the role and group its gate required
//! (it was accepted, so the approver had them). Inputs that left too little to rebuild
//! them — a rejected command (its body is not recorded) or a fork's start (the source
//! state is not in the history) — are taken as recorded: their events are folded, not
//! re-decided, and counted as `taken_as_recorded`.

use serde::Serialize;
use serde_json::Value;

use crate::{
    decide::apply,
    effect::{Effect, TimerKey},
    event::{Event, EventBody},
    evolve::evolve,
    graph::Graphs,
    input::{Command, CommandBody, Input, StepOutcome, StepReport},
    state::RunState,
};

/// What re-deciding one run found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Outcome {
    pub versions: usize,
    pub taken_as_recorded: usize,
    /// The first version whose re-decided events differ from the recorded ones.
    pub divergence: Option<Divergence>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Divergence {
    pub version: i64,
    /// The input re-derived for that version.
    pub input: String,
    /// One line per event: kind and body.
    pub recorded: Vec<String>,
    pub redecided: Vec<String>,
}

fn line(event: &Event) -> String {
    format!(
        "{} {}",
        event.body.name(),
        serde_json::to_string(&event.body).unwrap_or_default()
    )
}

/// Re-decides `history` (one run, in order) against `graphs`.
pub fn replay(history: &[Event], graphs: &Graphs) -> Outcome {
    let mut out = Outcome {
        versions: 0,
        taken_as_recorded: 0,
        divergence: None,
    };
    let mut state: Option<RunState> = None;
    let mut rest = history.iter().filter(|e| e.seq > 0).peekable();
    while let Some(first) = rest.next() {
        let mut group = vec![first.clone()];
        while let Some(next) = rest.next_if(|e| e.state_version == first.state_version) {
            group.push(next.clone());
        }
        out.versions += 1;
        let Some(input) = input_of(state.as_ref(), &group, graphs) else {
            out.taken_as_recorded += 1;
            state = group.iter().fold(state, evolve);
            continue;
        };
        let applied = apply(state.as_ref(), &input, graphs);
        let redecided: Vec<Event> = applied
            .effects
            .iter()
            .filter_map(|e| match e {
                Effect::Emit(event) if event.seq > 0 => Some(event.clone()),
                _ => None,
            })
            .collect();
        let same = redecided.len() == group.len()
            && group.iter().zip(&redecided).all(|(r, d)| agrees(r, d));
        if !same {
            out.divergence = Some(Divergence {
                version: first.state_version,
                input: format!("{input:?}"),
                recorded: group.iter().map(line).collect(),
                redecided: redecided.iter().map(line).collect(),
            });
            return out;
        }
        state = applied.state;
    }
    out
}

/// Whether a re-decided event makes the recorded decision: every field the recorded event
/// has is the same. Fields this build added (absent from an older history: their default
/// there) are annotations, not decisions; the hash chain covers them and is not compared.
fn agrees(recorded: &Event, redecided: &Event) -> bool {
    let strip = |e: &Event| {
        let mut v = serde_json::to_value(e).unwrap_or(Value::Null);
        if let Value::Object(map) = &mut v {
            map.remove("hash");
            map.remove("prev_hash");
        }
        v
    };
    covers(&strip(recorded), &strip(redecided))
}

fn covers(recorded: &Value, redecided: &Value) -> bool {
    match (recorded, redecided) {
        (Value::Object(r), Value::Object(d)) => r
            .iter()
            .all(|(k, v)| d.get(k).is_some_and(|dv| covers(v, dv))),
        (r, d) => r == d,
    }
}

/// The input that produced one version's events, when they tell enough to rebuild it.
fn input_of(state: Option<&RunState>, group: &[Event], graphs: &Graphs) -> Option<Input> {
    let first = group.first()?;
    let run_id = first.run_id.clone();
    let at = first.at;
    if let Some(command_id) = &first.command_id {
        let mut principal = String::new();
        let mut roles = Vec::new();
        let mut groups = Vec::new();
        let mut body = None;
        for event in group {
            if event.command_id.as_ref() != Some(command_id) {
                continue;
            }
            match &event.body {
                EventBody::CommandAccepted {
                    duplicate: true,
                    command,
                    ..
                } => {
                    // Answered from the run's memory before the body is looked at: only
                    // its kind shows in the answer.
                    body = Some(match state {
                        // A signal id taken before, under a new command id: any signal
                        // id the run took gets the same answer.
                        Some(run) if command == "SignalRun" => {
                            let (name, signal_id) = run
                                .waits
                                .values()
                                .flat_map(|w| w.received.iter().map(move |r| (&w.signal, r)))
                                .map(|(name, r)| (name.clone(), r.signal_id.clone()))
                                .chain(
                                    run.early_signals
                                        .iter()
                                        .map(|e| (e.signal.clone(), e.signal_id.clone())),
                                )
                                .next()?;
                            roles.extend(sender_role(graphs, Some(run), &name));
                            CommandBody::SignalRun {
                                name,
                                signal_id,
                                payload: Value::Null,
                            }
                        }
                        // A start under a new command id is a duplicate when it asks for
                        // the same run: the run's own request.
                        Some(run) if command == "StartRun" => CommandBody::StartRun {
                            graph_id: run.graph_id.clone(),
                            graph_version: Some(run.graph_version),
                            input: run.input.clone(),
                            labels: run.labels.clone(),
                            fork: None,
                            budget: run.budget.clone(),
                            parent: run.parent.clone(),
                        },
                        _ => placeholder(command)?,
                    });
                }
                EventBody::RunStarted {
                    graph_id,
                    graph_version,
                    input,
                    started_by,
                    labels,
                    forked_from,
                    budget,
                    parent,
                    ..
                } => {
                    if forked_from.is_some() {
                        return None;
                    }
                    principal.clone_from(started_by);
                    body = Some(CommandBody::StartRun {
                        graph_id: graph_id.clone(),
                        graph_version: Some(*graph_version),
                        input: input.clone(),
                        labels: labels.clone(),
                        fork: None,
                        budget: budget.clone(),
                        parent: parent.clone(),
                    });
                }
                EventBody::SignalReceived {
                    signal,
                    signal_id,
                    payload,
                    sent_by,
                    ..
                }
                | EventBody::SignalBuffered {
                    signal,
                    signal_id,
                    payload,
                    sent_by,
                } if body.is_none() => {
                    principal.clone_from(sent_by);
                    // Taken or kept, so it was allowed: its sender held a role the wait
                    // asks for.
                    roles.extend(sender_role(graphs, state, signal));
                    body = Some(CommandBody::SignalRun {
                        name: signal.clone(),
                        signal_id: signal_id.clone(),
                        payload: payload.clone(),
                    });
                }
                EventBody::InterruptDecided {
                    interrupt_id,
                    proposal_hash,
                    approve,
                    decided_by,
                    payload,
                    comment,
                    edited_args,
                    ..
                } if body.is_none() => {
                    principal.clone_from(decided_by);
                    if let Some(interrupt) = state.and_then(|s| s.interrupts.get(interrupt_id)) {
                        roles.extend(interrupt.required_role.clone());
                        if interrupt.members_only {
                            groups.extend(interrupt.approver_group.clone());
                        }
                    }
                    body = Some(CommandBody::ResumeRun {
                        interrupt_id: interrupt_id.clone(),
                        proposal_hash: proposal_hash.clone(),
                        approve: *approve,
                        payload: payload.clone(),
                        comment: comment.clone(),
                        edited_args: edited_args.clone(),
                    });
                }
                EventBody::DecisionBuffered {
                    interrupt_id,
                    proposal_hash,
                    approve,
                    decided_by,
                    roles: r,
                    payload,
                    comment,
                    groups: g,
                    edited_args,
                } => {
                    principal.clone_from(decided_by);
                    roles.clone_from(r);
                    groups.clone_from(g);
                    body = Some(CommandBody::ResumeRun {
                        interrupt_id: interrupt_id.clone(),
                        proposal_hash: proposal_hash.clone(),
                        approve: *approve,
                        payload: payload.clone(),
                        comment: comment.clone(),
                        edited_args: edited_args.clone(),
                    });
                }
                EventBody::CancelRequested {
                    requested_by,
                    reason,
                } => {
                    principal.clone_from(requested_by);
                    body = Some(CommandBody::CancelRun {
                        reason: reason.clone(),
                    });
                }
                EventBody::OperationReconciled {
                    step_id,
                    succeeded,
                    output,
                    error,
                    by,
                } => {
                    principal.clone_from(by);
                    // Recorded, so it was allowed: its issuer had the role it needs.
                    roles.push(crate::decide::reconcile::OPERATOR_ROLE.to_owned());
                    let operation_id = state?.steps.get(step_id)?.operation_id.clone();
                    body = Some(CommandBody::ReconcileOperation {
                        operation_id,
                        succeeded: *succeeded,
                        output: output.clone(),
                        error: error.clone(),
                    });
                }
                _ => {}
            }
        }
        return Some(Input::Command(Command {
            command_id: command_id.clone(),
            tenant: first.tenant.clone(),
            run_id,
            principal,
            roles,
            groups,
            at,
            body: body?,
        }));
    }
    let state = state?;
    // A child's end opens its version with the settlement of its budget: the report is
    // the step event after it, with the spend it charged.
    let (first, spent) = match &first.body {
        EventBody::BudgetSettled { spent, .. } => (group.get(1)?, Some(spent.clone())),
        _ => (first, None),
    };
    let report = |step_id: &str, attempt: u32, outcome: StepOutcome| {
        Some(Input::StepReport(StepReport {
            spent: spent.clone(),
            operation_id: first.operation_id.clone()?,
            attempt,
            tenant: first.tenant.clone(),
            run_id: run_id.clone(),
            step_id: step_id.to_owned(),
            outcome,
            at,
        }))
    };
    let timer = |timer: TimerKey| {
        Some(Input::TimerFired {
            run_id: run_id.clone(),
            timer,
            at,
        })
    };
    match &first.body {
        EventBody::StepStarted { step_id, attempt } => {
            report(step_id, *attempt, StepOutcome::Started)
        }
        EventBody::StepSucceeded {
            step_id,
            attempt,
            output,
        } => report(
            step_id,
            *attempt,
            StepOutcome::Succeeded {
                output: output.clone(),
            },
        ),
        EventBody::StepFailed {
            step_id,
            attempt,
            code,
            message,
            retryable,
            retry_at,
        } => report(
            step_id,
            *attempt,
            StepOutcome::Failed {
                retryable: *retryable,
                code: code.clone(),
                message: message.clone(),
                retry_after_ms: retry_at.map(|due| due - at),
            },
        ),
        EventBody::StepOutcomeUnknown {
            step_id,
            attempt,
            message,
            ..
        } => {
            if message == "no result before the step's timeout" {
                timer(TimerKey::StepTimeout {
                    step_id: step_id.clone(),
                    attempt: *attempt,
                })
            } else {
                let (code, text) = message.split_once(": ").unwrap_or(("", message));
                report(
                    step_id,
                    *attempt,
                    StepOutcome::Unknown {
                        code: code.to_owned(),
                        message: text.to_owned(),
                    },
                )
            }
        }
        EventBody::StepDispatched {
            step_id, attempt, ..
        } if *attempt > 1 => timer(TimerKey::Retry {
            step_id: step_id.clone(),
            attempt: attempt - 1,
        }),
        EventBody::SignalWaitExpired { step_id, .. } => timer(TimerKey::SignalWait {
            step_id: step_id.clone(),
        }),
        EventBody::InterruptEscalated { interrupt_id, .. }
        | EventBody::InterruptExpired { interrupt_id, .. } => {
            let round = state.interrupts.get(interrupt_id)?.round;
            timer(TimerKey::ApprovalExpiry {
                interrupt_id: interrupt_id.clone(),
                round,
            })
        }
        EventBody::RunStatusChanged { .. }
            if state
                .timer_due(&TimerKey::RunDeadline)
                .is_some_and(|due| due <= at) =>
        {
            timer(TimerKey::RunDeadline)
        }
        _ => None,
    }
}

/// A role the sender of a signal the run took held: one the wait asks for (none when it
/// asks for none).
fn sender_role(graphs: &Graphs, state: Option<&RunState>, signal: &str) -> Option<String> {
    let run = state?;
    let graph = graphs.get(&run.graph_id, Some(run.graph_version))?;
    let wait = graph.waiting_for(signal)?.wait.as_ref()?;
    wait.roles.first().cloned()
}

/// A command of `kind` whose content does not matter (a duplicate's).
fn placeholder(kind: &str) -> Option<CommandBody> {
    Some(match kind {
        "StartRun" => CommandBody::StartRun {
            graph_id: String::new(),
            graph_version: None,
            input: Value::Null,
            labels: Default::default(),
            fork: None,
            budget: None,
            parent: None,
        },
        "ResumeRun" => CommandBody::ResumeRun {
            interrupt_id: String::new(),
            proposal_hash: String::new(),
            approve: false,
            payload: None,
            comment: None,
            edited_args: None,
        },
        "CancelRun" => CommandBody::CancelRun { reason: None },
        "ReconcileOperation" => CommandBody::ReconcileOperation {
            operation_id: String::new(),
            succeeded: false,
            output: None,
            error: None,
        },
        "SignalRun" => CommandBody::SignalRun {
            name: String::new(),
            signal_id: String::new(),
            payload: Value::Null,
        },
        _ => return None,
    })
}

/// `value` without serde noise, for reports.
pub fn summary(outcome: &Outcome) -> Value {
    serde_json::to_value(outcome).unwrap_or(Value::Null)
}
