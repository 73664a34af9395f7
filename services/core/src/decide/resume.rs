//! ResumeRun: a human decision on an interrupt, bound to the exact proposal.

use super::{
    advance,
    advance::{approved_args, render},
    begin_failure, is_tool_call, Ctx,
};
use crate::{
    event::{EventBody, StepRole},
    graph::OnReject,
    input::{Command, CommandBody},
    state::InterruptStatus,
};

/// Most decisions one run keeps waiting for interrupts not registered yet.
pub(crate) const MAX_BUFFERED: usize = 16;

/// Applies decisions that were waiting for `interrupt_id`, now that it is registered.
/// Each is answered (accepted or rejected) under its own command id.
pub(crate) fn apply_buffered(ctx: &mut Ctx<'_>, interrupt_id: &str) {
    let waiting: Vec<_> = ctx
        .run()
        .buffered
        .iter()
        .filter(|b| b.interrupt_id == interrupt_id)
        .cloned()
        .collect();
    for decision in waiting {
        let command = Command {
            command_id: decision.command_id.clone(),
            tenant: ctx.tenant.clone(),
            run_id: ctx.run_id.clone(),
            principal: decision.principal,
            roles: decision.roles,
            groups: decision.groups,
            at: decision.at,
            body: CommandBody::ResumeRun {
                interrupt_id: decision.interrupt_id,
                proposal_hash: decision.proposal_hash,
                approve: decision.approve,
                payload: decision.payload,
                comment: decision.comment,
                edited_args: decision.edited_args,
            },
        };
        let current = ctx.command_id.replace(decision.command_id);
        handle(ctx, &command);
        ctx.command_id = current;
    }
}

pub(crate) fn handle(ctx: &mut Ctx<'_>, command: &Command) {
    let CommandBody::ResumeRun {
        interrupt_id,
        proposal_hash,
        approve,
        payload,
        comment,
        edited_args,
    } = &command.body
    else {
        return;
    };
    let Some(interrupt) = ctx.run().interrupts.get(interrupt_id).cloned() else {
        // Interrupt ids are derived from the run, the step and the proposal, so a decision
        // can name an interrupt before it is registered: keep it until it is.
        let run = ctx.run();
        if run
            .buffered
            .iter()
            .any(|b| b.command_id == command.command_id)
        {
            return; // the same buffered decision again: still waiting
        }
        if run.buffered.len() >= MAX_BUFFERED {
            return ctx.reject(
                command,
                "unknown_interrupt",
                format!("interrupt {interrupt_id} is not pending on this run, and {MAX_BUFFERED} early decisions already wait"),
            );
        }
        ctx.emit(
            EventBody::DecisionBuffered {
                interrupt_id: interrupt_id.clone(),
                proposal_hash: proposal_hash.clone(),
                approve: *approve,
                decided_by: command.principal.clone(),
                roles: command.roles.clone(),
                payload: payload.clone(),
                comment: comment.clone(),
                groups: command.groups.clone(),
                edited_args: edited_args.clone(),
            },
            None,
        );
        return;
    };
    match interrupt.status {
        InterruptStatus::Open => {}
        InterruptStatus::Expired => {
            return ctx.reject(
                command,
                "expired",
                format!("interrupt {interrupt_id} expired"),
            );
        }
        InterruptStatus::Superseded => {
            return ctx.reject(
                command,
                "stale_proposal",
                format!("interrupt {interrupt_id} was superseded by a newer proposal"),
            );
        }
        InterruptStatus::Approved | InterruptStatus::Rejected => {
            return ctx.reject(
                command,
                "already_decided",
                format!("interrupt {interrupt_id} is already decided"),
            );
        }
    }
    if &interrupt.proposal_hash != proposal_hash {
        return ctx.reject(
            command,
            "stale_proposal",
            format!(
                "the decision names proposal {proposal_hash}, but the pending proposal is {}",
                interrupt.proposal_hash
            ),
        );
    }
    if let Some(refusal) = interrupt.refusal(
        &command.principal,
        &command.roles,
        &command.groups,
        *approve,
        command.at,
    ) {
        return ctx.reject(command, refusal.code, refusal.reason);
    }
    if interrupt.node == crate::budget::BUDGET_NODE {
        return super::budget::decide(ctx, command, &interrupt);
    }
    let Some(graph) = ctx.graph() else { return };
    let Some(node) = graph.node(&interrupt.node) else {
        return;
    };

    ctx.accept(command);
    let is_final = !*approve || interrupt.approvals.len() as u32 + 1 >= interrupt.quorum;
    let proposed = interrupt.proposal.get("args").cloned().unwrap_or_default();
    // Only an edit that changes something is an edit; a rejection edits nothing.
    let edited = edited_args
        .as_ref()
        .filter(|e| *approve && **e != proposed)
        .cloned();
    ctx.decided(command, is_final, edited.clone());
    if !*approve {
        match &node.on_reject {
            // A rejected tool call is told to the model (a tool message), which goes on.
            _ if is_tool_call(ctx.run(), graph, &interrupt.role) => advance(ctx),
            OnReject::Fail => {
                begin_failure(ctx, format!("approval rejected by {}", command.principal))
            }
            OnReject::Goto(_) => advance(ctx),
        }
        return;
    }
    if !is_final {
        return; // waiting for the rest of the quorum
    }
    let allow_edits = node
        .interrupt_before
        .as_ref()
        .is_some_and(|a| a.allow_edits);
    if let (Some(args), false) = (&edited, allow_edits) {
        // An edited call is a new proposal and needs its own approval.
        ctx.propose_edited(
            node,
            interrupt.step_id.clone(),
            args.clone(),
            interrupt.role.clone(),
            Some(&proposed),
        );
        return advance(ctx);
    }
    // The decision is folded: the interrupt now holds its payload and edit.
    let Some(decided) = ctx.run().interrupts.get(interrupt_id).cloned() else {
        return;
    };
    match node.precheck.as_ref().and_then(|c| graph.node(c)) {
        // Check the business state again first; the call waits for its answer (advance).
        Some(check) => {
            let args = render(ctx.run(), None, Some(&decided), &check.args);
            let step_id = ctx.run().next_step_id(&check.id);
            let role = StepRole::Precheck {
                of: decided.step_id.clone(),
            };
            ctx.dispatch(check, step_id, 1, args, role);
        }
        None => {
            let args = approved_args(node, &decided);
            ctx.dispatch(node, decided.step_id.clone(), 1, args, decided.role.clone());
        }
    }
    advance(ctx);
}
