//! Executor reports. Executors never touch run state: they report an attempt's outcome
//! and the fold decides. Reports for unknown operations, stale attempts or settled steps
//! change nothing (the reducer counts them).

use super::{advance, Ctx};
use crate::{
    event::{EventBody, StepRole},
    graph::SideEffect,
    input::{StepOutcome, StepReport},
    state::{Step, StepStatus},
};

pub(crate) fn handle(ctx: &mut Ctx<'_>, report: &StepReport) -> Result<(), &'static str> {
    let Some(run) = &ctx.state else {
        return Err("unknown run");
    };
    if run.status.is_terminal() {
        return Err("run already ended");
    }
    let Some(step) = run.step_by_operation(&report.operation_id).cloned() else {
        return Err("unknown operation");
    };
    if report.attempt != step.attempt {
        return Err("stale attempt");
    }
    // An operator may be waiting on an outcome that now arrives after all (a slow
    // executor): the receiver's real answer beats a guess, so a definite outcome for the
    // current attempt is still taken.
    let late_but_definite = step.status == StepStatus::NeedsOperator
        && matches!(
            report.outcome,
            StepOutcome::Succeeded { .. } | StepOutcome::Failed { .. }
        );
    if !step.status.is_in_flight() && !late_but_definite {
        return Err("step already settled");
    }
    settle_child(ctx, &step, report);
    match &report.outcome {
        StepOutcome::Started => {
            if step.status == StepStatus::Started {
                return Err("already started");
            }
            ctx.emit(
                EventBody::StepStarted {
                    step_id: step.step_id.clone(),
                    attempt: step.attempt,
                },
                Some(step.operation_id.clone()),
            );
            return Ok(());
        }
        StepOutcome::Succeeded { output } => match refused_usage(&step, output) {
            // A model call whose cost cannot be accounted for is not accepted (see
            // `crate::budget`): the step fails for good and its output is not recorded.
            Some(problem) => ctx.emit(
                EventBody::StepFailed {
                    step_id: step.step_id.clone(),
                    attempt: step.attempt,
                    code: "usage_refused".into(),
                    message: format!("the model call's usage was refused: {problem}"),
                    retryable: false,
                    retry_at: None,
                },
                Some(step.operation_id.clone()),
            ),
            None => ctx.emit(
                EventBody::StepSucceeded {
                    step_id: step.step_id.clone(),
                    attempt: step.attempt,
                    output: output.clone(),
                },
                Some(step.operation_id.clone()),
            ),
        },
        StepOutcome::Failed {
            retryable,
            code,
            message,
            retry_after_ms,
        } => {
            let retry_at = retry_time(ctx, &step, *retryable, *retry_after_ms);
            ctx.emit(
                EventBody::StepFailed {
                    step_id: step.step_id.clone(),
                    attempt: step.attempt,
                    code: code.clone(),
                    message: message.clone(),
                    retryable: *retryable,
                    retry_at,
                },
                Some(step.operation_id.clone()),
            );
        }
        StepOutcome::Unknown { code, message } => {
            unknown(ctx, &step, format!("{code}: {message}"), false);
        }
    }
    advance(ctx);
    Ok(())
}

/// Why the usage an `llm` step's output reports cannot be charged, if it cannot (other
/// tools' outputs are never charged, so never refused for it).
fn refused_usage(step: &Step, output: &serde_json::Value) -> Option<String> {
    if step.tool != crate::budget::LLM_TOOL {
        return None;
    }
    crate::budget::Usage::of(output).err()
}

/// When the next attempt is due, if the policy allows one.
fn retry_time(
    ctx: &Ctx<'_>,
    step: &Step,
    retryable: bool,
    retry_after_ms: Option<i64>,
) -> Option<i64> {
    if !retryable || ctx.run().ending.is_some() {
        return None;
    }
    let node = ctx.graph()?.node(&step.node)?;
    if step.attempt >= node.retry.max_attempts {
        return None;
    }
    let backoff = node.retry.backoff(step.attempt, &step.operation_id);
    Some(ctx.at + backoff.max(retry_after_ms.unwrap_or(0)))
}

/// An attempt's outcome is unknown. Classes whose receiver tolerates a repeat (or, for
/// `reconcilable`, is asked first) get a new attempt of the same operation; `unsafe` —
/// and any class whose attempts are spent — waits for an operator. For `reconcilable`, an
/// `unknown` *report* means the executor already asked the receiver and still does not
/// know: an operator decides.
///
/// A run that is winding down (cancelled, or failed and compensating) follows the same
/// rule: the operation was issued before the run began to end, and its real outcome
/// decides what is compensated, so it must become known — by the receiver or by an
/// operator, never by waiting for a result that will not come. One difference: a forward
/// `reconcilable` step's new attempt only *asks* the receiver (`lookup_only`) and never
/// calls it, since a call now would be the new work the ending forbids; an answer of
/// "never performed" settles it as failed. `pure`/`idempotent`/`keyed` steps can only
/// learn their outcome by repeating the same operation (the receiver dedupes or the
/// repeat is harmless), so they do. A compensation is the ending's own work and is
/// retried as it would be at any time.
pub(crate) fn unknown(ctx: &mut Ctx<'_>, step: &Step, message: String, timed_out: bool) {
    let node = ctx.graph().and_then(|g| g.node(&step.node));
    let reconcilable = step.side_effect == SideEffect::Reconcilable;
    let class_retries = step.side_effect.retries_unknown() && (timed_out || !reconcilable);
    let may_retry = class_retries && node.is_some_and(|n| step.attempt < n.retry.max_attempts);
    let lookup_only = reconcilable
        && ctx.run().ending.is_some()
        && !matches!(step.role, StepRole::Compensation { .. });
    ctx.emit(
        EventBody::StepOutcomeUnknown {
            step_id: step.step_id.clone(),
            attempt: step.attempt,
            message,
            needs_operator: !may_retry,
        },
        Some(step.operation_id.clone()),
    );
    if may_retry {
        if let Some(node) = node {
            ctx.dispatch_attempt(
                node,
                step.step_id.clone(),
                step.attempt + 1,
                step.args.clone(),
                step.role.clone(),
                lookup_only,
            );
        }
    }
}

/// A child run's end (its report to the step that started it): the budget set aside for
/// it is released and what it spent is charged (`BudgetSettled`). A report without a
/// spend is a start the child's fold refused (nothing ran); a spend out of bounds is
/// charged as the whole share, the most the child could have spent. (A run started before
/// reservations has none to settle.)
fn settle_child(ctx: &mut Ctx<'_>, step: &Step, report: &StepReport) {
    if step.tool != crate::child::CHILD_TOOL || matches!(report.outcome, StepOutcome::Started) {
        return;
    }
    let Some(share) = ctx.run().reserved.get(&step.step_id) else {
        return;
    };
    let spent = match &report.spent {
        None => crate::budget::Spend::default(),
        Some(spent) if spent.check().is_ok() => spent.clone(),
        Some(_) => crate::budget::Spend::default().with_reserved([share]),
    };
    ctx.emit(
        EventBody::BudgetSettled {
            step_id: step.step_id.clone(),
            spent,
        },
        Some(step.operation_id.clone()),
    );
}
