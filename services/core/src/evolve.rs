//! Folding one event into a run's state. Pure and total: an event that does not fit the
//! state (which the fold never emits) changes nothing but the bookkeeping.

use std::sync::Arc;

use crate::{
    effect::TimerKey,
    event::{Event, EventBody},
    signal::Received,
    state::{
        Answer, EarlySignal, Ending, Interrupt, InterruptStatus, RunState, Step, StepStatus, Wait,
        WaitStatus,
    },
};

/// Applies `event` to `state`. `None` is a run that does not exist (yet).
pub fn evolve(state: Option<RunState>, event: &Event) -> Option<RunState> {
    let mut state = match (&event.body, state) {
        (
            EventBody::RunStarted {
                graph_id,
                graph_version,
                input,
                started_by,
                labels,
                deadline_at,
                budget,
                forked_from,
                rules,
                parent,
            },
            None,
        ) => {
            let mut state = RunState {
                tenant: event.tenant.clone(),
                run_id: event.run_id.clone(),
                graph_id: graph_id.clone(),
                graph_version: *graph_version,
                status: crate::RunStatus::Running,
                version: 0,
                last_event_seq: 0,
                last_hash: None,
                created_at: event.at,
                updated_at: event.at,
                started_by: started_by.clone(),
                labels: labels.clone(),
                input: input.clone(),
                deadline_at: *deadline_at,
                steps: Default::default(),
                completed: Vec::new(),
                interrupts: Default::default(),
                timers: Default::default(),
                commands: Default::default(),
                ending: None,
                output: None,
                buffered: Vec::new(),
                rejected: Default::default(),
                budget: budget.clone(),
                spend: Default::default(),
                rules: *rules,
                forked_from: None,
                forgotten: None,
                waits: Default::default(),
                early_signals: Vec::new(),
                reserved: Default::default(),
                parent: parent.clone(),
            };
            if let Some(fork) = forked_from {
                crate::decide::fork::carry(&mut state, fork);
            }
            if let Some(due) = deadline_at {
                state.timers.insert(TimerKey::RunDeadline.encode(), *due);
            }
            state
        }
        (_, None) => return None,
        (_, Some(state)) => state,
    };
    state.version = event.state_version;
    state.last_event_seq = event.seq;
    state.last_hash = event.hash.clone();
    state.updated_at = event.at;
    apply_body(&mut state, event);
    Some(state)
}

fn apply_body(state: &mut RunState, event: &Event) {
    match &event.body {
        EventBody::RunStarted { .. } => {}
        EventBody::CommandAccepted { command_id, .. } => {
            state
                .commands
                .entry(command_id.clone())
                .or_insert(Answer::Accepted);
            state.buffered.retain(|b| &b.command_id != command_id);
        }
        EventBody::CommandRejected {
            command_id,
            code,
            reason,
            ..
        } => {
            if !state.commands.contains_key(command_id) {
                state.commands.insert(
                    command_id.clone(),
                    Answer::Rejected {
                        code: code.clone(),
                        reason: reason.clone(),
                    },
                );
                state.rejected.push_back(command_id.clone());
                while state.rejected.len() > crate::limits::MAX_REJECTED_COMMANDS {
                    if let Some(oldest) = state.rejected.pop_front() {
                        state.commands.remove(&oldest);
                    }
                }
            }
            state.buffered.retain(|b| &b.command_id != command_id);
        }
        EventBody::DecisionBuffered {
            interrupt_id,
            proposal_hash,
            approve,
            decided_by,
            roles,
            payload,
            comment,
            groups,
            edited_args,
        } => {
            state.buffered.push(crate::state::BufferedDecision {
                command_id: event.command_id.clone().unwrap_or_default(),
                interrupt_id: interrupt_id.clone(),
                proposal_hash: proposal_hash.clone(),
                approve: *approve,
                principal: decided_by.clone(),
                roles: roles.clone(),
                payload: payload.clone(),
                comment: comment.clone(),
                at: event.at,
                groups: groups.clone(),
                edited_args: edited_args.clone(),
            });
        }
        EventBody::StepDispatched {
            step_id,
            node,
            attempt,
            tool,
            queue,
            side_effect,
            args,
            role,
            timeout_at,
            lookup_only: _,
        } => {
            let operation_id = event.operation_id.clone().unwrap_or_default();
            if *attempt == 1 && matches!(role, crate::event::StepRole::Requested { .. }) {
                state.spend.tool_calls += 1;
            }
            let step = state.steps.entry(step_id.clone()).or_insert_with(|| {
                Arc::new(Step {
                    step_id: step_id.clone(),
                    node: node.clone(),
                    operation_id: operation_id.clone(),
                    attempt: *attempt,
                    tool: tool.clone(),
                    queue: queue.clone(),
                    side_effect: *side_effect,
                    args: args.clone(),
                    role: role.clone(),
                    status: StepStatus::InFlight,
                    output: None,
                    error: None,
                })
            });
            let step = Arc::make_mut(step);
            step.attempt = *attempt;
            step.status = StepStatus::InFlight;
            state.timers.remove(
                &TimerKey::Retry {
                    step_id: step_id.clone(),
                    attempt: attempt.saturating_sub(1),
                }
                .encode(),
            );
            clear_step_timeouts(state, step_id);
            if let Some(due) = timeout_at {
                state.timers.insert(
                    TimerKey::StepTimeout {
                        step_id: step_id.clone(),
                        attempt: *attempt,
                    }
                    .encode(),
                    *due,
                );
            }
            if *attempt == 1 && *role == crate::event::StepRole::Node {
                compact_earlier_turns(state, node, step_id, args);
            }
        }
        EventBody::StepStarted { step_id, .. } => {
            if let Some(step) = state.steps.get_mut(step_id).map(Arc::make_mut) {
                step.status = StepStatus::Started;
            }
        }
        EventBody::StepSucceeded {
            step_id, output, ..
        } => {
            if let Some(step) = state
                .steps
                .get(step_id)
                .filter(|s| s.status != StepStatus::Succeeded)
            {
                let prices = state.budget.as_ref().map(|b| &b.prices);
                state.spend.charge_step(
                    state.rules,
                    &step.tool,
                    output,
                    prices.unwrap_or(&Default::default()),
                );
            }
            succeed(state, step_id, output.clone());
        }
        EventBody::StepFailed {
            step_id,
            attempt,
            code,
            message,
            retry_at,
            ..
        } => {
            clear_step_timeouts(state, step_id);
            if let Some(step) = state.steps.get_mut(step_id).map(Arc::make_mut) {
                step.error = Some(format!("{code}: {message}"));
                step.status = if retry_at.is_some() {
                    StepStatus::WaitingRetry
                } else {
                    StepStatus::Failed
                };
            }
            if let Some(due) = retry_at {
                state.timers.insert(
                    TimerKey::Retry {
                        step_id: step_id.clone(),
                        attempt: *attempt,
                    }
                    .encode(),
                    *due,
                );
            }
        }
        EventBody::StepOutcomeUnknown {
            step_id,
            message,
            needs_operator,
            ..
        } => {
            clear_step_timeouts(state, step_id);
            if let Some(step) = state.steps.get_mut(step_id).map(Arc::make_mut) {
                step.error = Some(format!("outcome unknown: {message}"));
                if *needs_operator {
                    step.status = StepStatus::NeedsOperator;
                }
            }
        }
        EventBody::OperationReconciled {
            step_id,
            succeeded,
            output,
            error,
            ..
        } => {
            clear_step_timeouts(state, step_id);
            if *succeeded {
                succeed(
                    state,
                    step_id,
                    output.clone().unwrap_or(serde_json::Value::Null),
                );
            } else if let Some(step) = state.steps.get_mut(step_id).map(Arc::make_mut) {
                step.status = StepStatus::Failed;
                step.error = Some(error.clone().unwrap_or_else(|| "failed (operator)".into()));
            }
        }
        EventBody::Interrupted {
            interrupt_id,
            step_id,
            node,
            proposal,
            proposal_hash,
            reason,
            required_role,
            approver_group,
            quorum,
            expires_at,
            role,
            context,
            members_only,
        } => {
            // A new proposal for the same step supersedes any earlier one (an edited payload).
            for earlier in state.interrupts.values_mut() {
                if &earlier.step_id == step_id
                    && matches!(
                        earlier.status,
                        InterruptStatus::Open | InterruptStatus::Approved
                    )
                {
                    earlier.status = InterruptStatus::Superseded;
                }
            }
            state.interrupts.insert(
                interrupt_id.clone(),
                Interrupt {
                    interrupt_id: interrupt_id.clone(),
                    step_id: step_id.clone(),
                    node: node.clone(),
                    role: role.clone(),
                    proposal: proposal.clone(),
                    proposal_hash: proposal_hash.clone(),
                    reason: reason.clone(),
                    required_role: required_role.clone(),
                    approver_group: approver_group.clone(),
                    quorum: *quorum,
                    expires_at: *expires_at,
                    round: 0,
                    approvals: Vec::new(),
                    status: InterruptStatus::Open,
                    context: context.clone(),
                    members_only: *members_only,
                    payload: None,
                    edited_args: None,
                },
            );
            if let Some(due) = expires_at {
                state.timers.insert(
                    TimerKey::ApprovalExpiry {
                        interrupt_id: interrupt_id.clone(),
                        round: 0,
                    }
                    .encode(),
                    *due,
                );
            }
        }
        EventBody::InterruptDecided {
            interrupt_id,
            approve,
            decided_by,
            is_final,
            payload,
            edited_args,
            ..
        } => {
            if let Some(interrupt) = state.interrupts.get_mut(interrupt_id) {
                if *approve {
                    interrupt.approvals.push(decided_by.clone());
                }
                if *approve && *is_final && interrupt.node == crate::budget::BUDGET_NODE {
                    // An approved budget interrupt raises the limits by what its payload says.
                    if let (Some(budget), Ok(raise)) = (
                        state.budget.as_mut(),
                        crate::budget::raise_of(payload.as_ref()),
                    ) {
                        budget.limits = budget.limits.raised(&raise);
                        if let Some(ceiling) = &budget.ceiling {
                            budget.limits = budget.limits.capped_by(ceiling);
                        }
                    }
                }
                if *is_final {
                    interrupt.payload = payload.clone();
                    interrupt.edited_args = edited_args.clone();
                    interrupt.status = if *approve {
                        InterruptStatus::Approved
                    } else {
                        InterruptStatus::Rejected
                    };
                    let round = interrupt.round;
                    state.timers.remove(
                        &TimerKey::ApprovalExpiry {
                            interrupt_id: interrupt_id.clone(),
                            round,
                        }
                        .encode(),
                    );
                }
            }
        }
        EventBody::InterruptEscalated {
            interrupt_id,
            approver_group,
            expires_at,
        } => {
            if let Some(interrupt) = state.interrupts.get_mut(interrupt_id) {
                state.timers.remove(
                    &TimerKey::ApprovalExpiry {
                        interrupt_id: interrupt_id.clone(),
                        round: interrupt.round,
                    }
                    .encode(),
                );
                interrupt.round += 1;
                interrupt.approver_group = Some(approver_group.clone());
                interrupt.expires_at = Some(*expires_at);
                state.timers.insert(
                    TimerKey::ApprovalExpiry {
                        interrupt_id: interrupt_id.clone(),
                        round: interrupt.round,
                    }
                    .encode(),
                    *expires_at,
                );
            }
        }
        EventBody::InterruptExpired { interrupt_id, .. } => {
            if let Some(interrupt) = state.interrupts.get_mut(interrupt_id) {
                interrupt.status = InterruptStatus::Expired;
                let key = TimerKey::ApprovalExpiry {
                    interrupt_id: interrupt_id.clone(),
                    round: interrupt.round,
                };
                state.timers.remove(&key.encode());
            }
        }
        EventBody::CancelRequested { reason, .. } => {
            state.ending = Some(Ending {
                cancelled: true,
                reason: reason.clone().unwrap_or_else(|| "cancelled".into()),
            });
            close_open_work(state, InterruptStatus::Superseded);
        }
        EventBody::RunStatusChanged {
            status,
            reason,
            output,
            forget_at,
        } => {
            state.status = *status;
            if *status == crate::RunStatus::Compensating && state.ending.is_none() {
                state.ending = Some(Ending {
                    cancelled: false,
                    reason: reason.clone().unwrap_or_else(|| "failed".into()),
                });
                close_open_work(state, InterruptStatus::Superseded);
            }
            if status.is_terminal() {
                state.output = output.clone();
                state.timers.clear();
                // Signals kept for waits that never opened are dropped with the run's
                // open work (their commands were answered when they were kept).
                state.early_signals.clear();
                if let Some(due) = forget_at {
                    state.timers.insert(TimerKey::Retention.encode(), *due);
                }
            }
        }
        EventBody::RunForgotten { reason } => state.forget(event.at, reason),
        EventBody::SignalWaitOpened {
            step_id,
            node,
            signal,
            many,
            wanted,
            expires_at,
        } => {
            state.waits.insert(
                step_id.clone(),
                Wait {
                    step_id: step_id.clone(),
                    node: node.clone(),
                    signal: signal.clone(),
                    many: *many,
                    wanted: *wanted,
                    expires_at: *expires_at,
                    status: WaitStatus::Open,
                    received: Vec::new(),
                    timed_out: false,
                },
            );
            if let Some(due) = expires_at {
                let key = TimerKey::SignalWait {
                    step_id: step_id.clone(),
                };
                state.timers.insert(key.encode(), *due);
            }
        }
        EventBody::SignalReceived {
            step_id,
            signal_id,
            payload,
            sent_by,
            ..
        } => {
            let command_id = event.command_id.as_deref().unwrap_or_default();
            state
                .early_signals
                .retain(|e| e.signal_id != *signal_id && e.command_id != command_id);
            if let Some(wait) = state.waits.get_mut(step_id) {
                wait.received.push(Received {
                    signal_id: signal_id.clone(),
                    payload: payload.clone(),
                    sent_by: sent_by.clone(),
                    at: event.at,
                });
                if wait.received.len() as u32 >= wait.wanted {
                    wait.status = WaitStatus::Done;
                    let key = TimerKey::SignalWait {
                        step_id: step_id.clone(),
                    };
                    state.timers.remove(&key.encode());
                }
            }
        }
        EventBody::SignalBuffered {
            signal,
            signal_id,
            payload,
            sent_by,
        } => state.early_signals.push(EarlySignal {
            command_id: event.command_id.clone().unwrap_or_default(),
            signal: signal.clone(),
            signal_id: signal_id.clone(),
            payload: payload.clone(),
            sent_by: sent_by.clone(),
            at: event.at,
        }),
        EventBody::BudgetReserved {
            step_id, limits, ..
        } => {
            state.reserved.insert(step_id.clone(), limits.clone());
        }
        EventBody::BudgetSettled { step_id, spent } => {
            state.reserved.remove(step_id);
            state.spend.add(spent);
        }
        EventBody::SignalWaitExpired {
            step_id,
            on_timeout,
        } => {
            if let Some(wait) = state.waits.get_mut(step_id) {
                wait.timed_out = true;
                wait.status = if on_timeout == "continue" {
                    WaitStatus::Done
                } else {
                    WaitStatus::Expired
                };
                let key = TimerKey::SignalWait {
                    step_id: step_id.clone(),
                };
                state.timers.remove(&key.encode());
            }
        }
    }
}

/// A conversation's call `step_id` of `node` was dispatched: the payloads of its earlier
/// calls, of their summaries and of the messages that started them are replaced by
/// [`crate::converse::COMPACTED`] — the events and the transcript keep them, and nothing
/// reads them from the state again, so a long conversation keeps the state small. (A tool
/// call's step keeps its payloads: a compensation renders from them.)
fn compact_earlier_turns(
    state: &mut RunState,
    node: &str,
    step_id: &str,
    args: &serde_json::Value,
) {
    use crate::converse::{compacted, Turn, COMPACTED};
    if Turn::of(args).is_none_or(|t| t.turn == 1 && t.history.is_null()) {
        return;
    }
    let earlier: Vec<String> = state
        .steps
        .values()
        .filter(|s| {
            s.node == node
                && s.step_id != step_id
                && s.role == crate::event::StepRole::Node
                && s.status.is_settled()
                && s.args.get(COMPACTED).is_none()
        })
        .map(|s| s.step_id.clone())
        .collect();
    for id in &earlier {
        if let Some(step) = state.steps.get_mut(id).map(Arc::make_mut) {
            step.args = compacted();
            step.output = step.output.as_ref().map(|_| compacted());
        }
        if let Some(wait) = state.waits.get_mut(id) {
            for received in &mut wait.received {
                received.payload = compacted();
            }
        }
    }
    let summaries: Vec<String> = state
        .steps
        .values()
        .filter(|s| match &s.role {
            crate::event::StepRole::Requested { by } => {
                earlier.contains(by)
                    && s.status.is_settled()
                    && Turn::of(&s.args).is_some_and(|t| t.summarize.is_some())
            }
            _ => false,
        })
        .map(|s| s.step_id.clone())
        .collect();
    for id in summaries {
        if let Some(step) = state.steps.get_mut(&id).map(Arc::make_mut) {
            step.args = compacted();
            step.output = step.output.as_ref().map(|_| compacted());
        }
    }
}

fn succeed(state: &mut RunState, step_id: &str, output: serde_json::Value) {
    clear_step_timeouts(state, step_id);
    if let Some(step) = state.steps.get_mut(step_id).map(Arc::make_mut) {
        step.status = StepStatus::Succeeded;
        step.output = Some(output);
        step.error = None;
        if !state.completed.iter().any(|s| s == step_id) {
            state.completed.push(step_id.to_owned());
        }
    }
}

fn clear_step_timeouts(state: &mut RunState, step_id: &str) {
    let prefix = format!("timeout/{step_id}/");
    state.timers.retain(|key, _| !key.starts_with(&prefix));
}

/// When a run starts winding down: open approvals close, pending retries are abandoned,
/// and their timers go. In-flight attempts stay: their real outcomes will be recorded.
fn close_open_work(state: &mut RunState, interrupt_status: InterruptStatus) {
    for interrupt in state.interrupts.values_mut() {
        if interrupt.status == InterruptStatus::Open {
            interrupt.status = interrupt_status;
        }
    }
    for step in state.steps.values_mut() {
        if step.status == StepStatus::WaitingRetry {
            Arc::make_mut(step).status = StepStatus::Abandoned;
        }
    }
    for wait in state.waits.values_mut() {
        if wait.status == WaitStatus::Open {
            wait.status = WaitStatus::Closed;
        }
    }
    state.timers.retain(|key, _| key.starts_with("timeout/"));
}
