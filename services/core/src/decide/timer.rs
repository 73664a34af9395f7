//! Due timers: step timeouts, retry backoff, approval expiry, the run's deadline. A timer
//! lives in the run state; the reducer feeds it back here when due, through the same
//! transactional path as any input.

use super::{advance, begin_failure, cancel::cancel, report::unknown, Ctx};
use crate::{
    effect::TimerKey,
    event::EventBody,
    graph::OnTimeout,
    state::{InterruptStatus, StepStatus},
};

pub(crate) fn handle(ctx: &mut Ctx<'_>, timer: &TimerKey) -> Result<(), &'static str> {
    let Some(run) = &ctx.state else {
        return Err("unknown run");
    };
    if *timer == TimerKey::Retention {
        return forget(ctx);
    }
    if run.status.is_terminal() {
        return Err("run already ended");
    }
    let Some(due) = run.timer_due(timer) else {
        return Err("timer not armed");
    };
    if due > ctx.at {
        return Err("timer not yet due");
    }
    match timer {
        TimerKey::StepTimeout { step_id, attempt } => {
            let Some(step) = run.steps.get(step_id).cloned() else {
                return Err("unknown step");
            };
            if step.attempt != *attempt || !step.status.is_in_flight() {
                return Err("step already settled");
            }
            unknown(
                ctx,
                &step,
                "no result before the step's timeout".into(),
                true,
            );
        }
        TimerKey::Retry { step_id, attempt } => {
            let Some(step) = run.steps.get(step_id).cloned() else {
                return Err("unknown step");
            };
            if step.attempt != *attempt || step.status != StepStatus::WaitingRetry {
                return Err("retry no longer pending");
            }
            let Some(node) = ctx.graph().and_then(|g| g.node(&step.node)) else {
                return Err("unknown node");
            };
            ctx.dispatch(
                node,
                step.step_id.clone(),
                step.attempt + 1,
                step.args.clone(),
                step.role.clone(),
            );
        }
        TimerKey::ApprovalExpiry {
            interrupt_id,
            round,
        } => {
            let Some(interrupt) = run.interrupts.get(interrupt_id).cloned() else {
                return Err("unknown interrupt");
            };
            if interrupt.status != InterruptStatus::Open || interrupt.round != *round {
                return Err("interrupt no longer open");
            }
            let Some(approval) = ctx
                .graph()
                .and_then(|g| g.node(&interrupt.node))
                .and_then(|n| n.interrupt_before.clone())
            else {
                return Err("unknown node");
            };
            let next_group = approval
                .escalation
                .get(*round as usize)
                .map(|g| super::advance::group_name(ctx.run(), g));
            match (approval.on_timeout, next_group) {
                (OnTimeout::Escalate, Some(group)) => {
                    ctx.emit(
                        EventBody::InterruptEscalated {
                            interrupt_id: interrupt_id.clone(),
                            approver_group: group,
                            expires_at: ctx.at + approval.timeout.0,
                        },
                        None,
                    );
                    return Ok(());
                }
                (on_timeout, _) => {
                    ctx.emit(
                        EventBody::InterruptExpired {
                            interrupt_id: interrupt_id.clone(),
                            on_timeout: on_timeout.as_str().into(),
                        },
                        None,
                    );
                    let reason = format!("approval {interrupt_id} expired");
                    if on_timeout == OnTimeout::Cancel {
                        cancel(ctx, "system:approval-expiry".into(), Some(reason));
                    } else {
                        begin_failure(ctx, reason);
                    }
                    return Ok(());
                }
            }
        }
        TimerKey::RunDeadline => {
            begin_failure(ctx, "the run exceeded its graph's max_duration".into());
            return Ok(());
        }
        TimerKey::Retention => return forget(ctx),
        TimerKey::SignalWait { step_id } => return super::signal::expire(ctx, step_id),
    }
    advance(ctx);
    Ok(())
}

/// A finished run's retention passed: its state becomes its audit summary.
fn forget(ctx: &mut Ctx<'_>) -> Result<(), &'static str> {
    let run = ctx.run();
    if !run.status.is_terminal() || run.forgotten.is_some() {
        return Err("nothing to forget");
    }
    match run.timer_due(&TimerKey::Retention) {
        None => return Err("timer not armed"),
        Some(due) if due > ctx.at => return Err("timer not yet due"),
        Some(_) => {}
    }
    ctx.emit(
        EventBody::RunForgotten {
            reason: "retention".into(),
        },
        None,
    );
    ctx.forget_children("retention");
    Ok(())
}
