//! Spend budgets at dispatch: before proposing new steps, the run's spend is held to its
//! limits (see [`crate::budget`]); a budget interrupt's decision raises them or ends the
//! run. Compensations are never held: they are not proposed here.

use serde_json::json;

use super::{advance, begin_failure, cancel, Ctx};
use crate::{
    budget::{self, BUDGET_NODE},
    event::{EventBody, StepRole},
    graph::OnBudgetExceeded,
    ids,
    input::{Command, CommandBody},
    state::Interrupt,
    status::RunStatus,
};

/// What the budget says about dispatching `new_tool_calls` agent-requested steps among
/// `proposals` more steps.
pub(crate) enum Verdict {
    Go,
    /// The run waits (a budget interrupt is open) or ended: propose nothing.
    Hold,
}

/// Holds the run to its budget before `proposals` new steps are proposed, acting as the
/// graph says when one would exceed it.
pub(crate) fn check(ctx: &mut Ctx<'_>, proposals: usize, new_tool_calls: u64) -> Verdict {
    let run = ctx.run();
    if run.open_interrupts().any(|i| i.node == BUDGET_NODE) {
        return Verdict::Hold;
    }
    let Some(limits) = run.budget.as_ref().map(|b| &b.limits) else {
        return Verdict::Go;
    };
    if proposals == 0 {
        return Verdict::Go;
    }
    let elapsed = ctx.at - run.created_at;
    // What children in flight hold counts as spent until they end.
    let held = run.spend.with_reserved(run.reserved.values());
    let Some(what) = budget::exceeded(limits, &held, new_tool_calls, elapsed) else {
        return Verdict::Go;
    };
    let Some(graph) = ctx.graph() else {
        return Verdict::Hold;
    };
    let reason = format!("the run's budget would be exceeded ({what})");
    match graph.on_budget_exceeded {
        OnBudgetExceeded::Fail => begin_failure(ctx, reason),
        OnBudgetExceeded::Cancel => cancel::cancel(ctx, "sortie:budget".into(), Some(reason)),
        OnBudgetExceeded::Pause => {
            let run = ctx.run();
            let run_rules = run.rules;
            let step_id = run.next_step_id(BUDGET_NODE);
            let proposal = json!({
                "kind": "budget",
                "node": BUDGET_NODE,
                "step_id": step_id,
                "exceeded": what,
                "limits": run.budget.as_ref().map(|b| &b.limits),
                "spend": run.spend,
                "at": ctx.at,
            });
            let proposal_hash = ids::proposal_hash(&proposal);
            let interrupt_id = ids::interrupt_id(&ctx.run_id, &step_id, &proposal_hash);
            // What an approver judges: the limit hit and what was spent; a rejection
            // fails the run.
            let context = serde_json::json!({
                "affects": {
                    "node": BUDGET_NODE,
                    "exceeded": what,
                    "limits": run.budget.as_ref().map(|b| &b.limits),
                    "spend": run.spend,
                },
                "on_reject": {"action": "fail"},
            });
            ctx.emit(
                EventBody::Interrupted {
                    interrupt_id,
                    step_id,
                    node: BUDGET_NODE.into(),
                    proposal,
                    proposal_hash,
                    reason: format!(
                        "{reason}: approve with payload {{\"raise\": {{...}}}} to raise it"
                    ),
                    // From rules 3 a budget decision needs its role; before, anyone's.
                    required_role: (run_rules >= 3).then(|| graph.access.budget_role().to_owned()),
                    approver_group: None,
                    quorum: 1,
                    expires_at: None,
                    role: StepRole::Node,
                    context: Some(context),
                    members_only: false,
                },
                None,
            );
            ctx.set_status(RunStatus::WaitingApproval, None, None);
        }
    }
    Verdict::Hold
}

/// A decision on a budget interrupt: approval raises the limits by `payload.raise` and the
/// run goes on; rejection fails the run.
pub(crate) fn decide(ctx: &mut Ctx<'_>, command: &Command, interrupt: &Interrupt) {
    let CommandBody::ResumeRun {
        approve, payload, ..
    } = &command.body
    else {
        return;
    };
    if *approve {
        // Checked here, not in `raise_of`: `evolve` reads raises of histories written
        // before the check with it, and must fold them as they were.
        let raise = budget::raise_of(payload.as_ref()).and_then(|raise| {
            raise
                .check()
                .map_err(|problem| format!("payload.raise: {problem}"))
        });
        if let Err(problem) = raise {
            return ctx.reject(command, "invalid", problem);
        }
    }
    ctx.accept(command);
    ctx.decided(command, true, None);
    if *approve {
        advance(ctx);
    } else {
        let reason = format!(
            "the budget was not raised ({} rejected {})",
            command.principal, interrupt.interrupt_id
        );
        begin_failure(ctx, reason);
    }
}
