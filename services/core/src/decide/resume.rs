//! ResumeRun: a human decision on an interrupt, bound to the exact proposal.

use super::{
    advance,
    advance::{approved_args, render},
    begin_failure, is_tool_call, Ctx,
};
use crate::{
    event::{EventBody, StepRole},
    graph::{Graph, OnReject},
    input::{Command, CommandBody},
    limits::{self, shown_id, MAX_BUFFERED, MAX_BUFFERED_BYTES},
    state::{BufferedDecision, InterruptStatus},
};

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
        edited_args,
        ..
    } = &command.body
    else {
        return;
    };
    let Some(interrupt) = ctx.run().interrupts.get(interrupt_id).cloned() else {
        // Interrupt ids are derived from the run, the step and the proposal, so a decision
        // can name an interrupt before it is registered: keep it until it is.
        return buffer(ctx, command);
    };
    match interrupt.status {
        InterruptStatus::Open => {}
        InterruptStatus::Expired => {
            return ctx.reject(
                command,
                "expired",
                format!("interrupt {} expired", shown_id(interrupt_id)),
            );
        }
        InterruptStatus::Superseded => {
            return ctx.reject(
                command,
                "stale_proposal",
                format!(
                    "interrupt {} was superseded by a newer proposal",
                    shown_id(interrupt_id)
                ),
            );
        }
        InterruptStatus::Approved | InterruptStatus::Rejected => {
            return ctx.reject(
                command,
                "already_decided",
                format!("interrupt {} is already decided", shown_id(interrupt_id)),
            );
        }
    }
    if &interrupt.proposal_hash != proposal_hash {
        // The pending hash is the run's own; the decision's is the client's and is not
        // repeated back (it can be any size the model layer lets through).
        return ctx.reject(
            command,
            "stale_proposal",
            format!(
                "the decision names another proposal than the pending one, {}",
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

/// A decision for an interrupt this run has not registered: kept until it is (SPEC §12),
/// within bounds, so that no client of the tenant can grow the run with decisions for
/// made-up interrupts. Refused, each with a fixed reason that repeats nothing the client
/// sent, and not kept:
/// - an id no interrupt can have (interrupt ids and proposal hashes are derived, so
///   their form is known): `unknown_interrupt`;
/// - a principal who may decide none of the graph's gates (the role, and the group of a
///   members-only gate, at registration): `forbidden`. Which gate an early decision is
///   for cannot be known (its id is a hash), so any gate the principal may decide
///   admits it; it is checked again, against its own gate, when the interrupt appears.
///   Budget interrupts are not counted: their proposals carry the time they were
///   raised, so nobody can name one in advance;
/// - past [`MAX_BUFFERED`] decisions or [`MAX_BUFFERED_BYTES`]: `unknown_interrupt`.
fn buffer(ctx: &mut Ctx<'_>, command: &Command) {
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
    let run = ctx.run();
    if run
        .buffered
        .iter()
        .any(|b| b.command_id == command.command_id)
    {
        return; // the same buffered decision again: still waiting
    }
    if !is_derived(interrupt_id, "int_", 24) || !is_derived(proposal_hash, "", 64) {
        return ctx.reject(
            command,
            "unknown_interrupt",
            "no interrupt is pending under this id, and none can be registered under it".into(),
        );
    }
    if let Some(graph) = ctx.graph() {
        if !may_decide_a_gate(graph, command) {
            return ctx.reject(
                command,
                "forbidden",
                "no interrupt is pending under this id, and the principal may decide none of \
                 this run's gates (their role, and group where only members decide)"
                    .into(),
            );
        }
    }
    let decision = BufferedDecision {
        command_id: command.command_id.clone(),
        interrupt_id: interrupt_id.clone(),
        proposal_hash: proposal_hash.clone(),
        approve: *approve,
        principal: command.principal.clone(),
        roles: command.roles.clone(),
        payload: payload.clone(),
        comment: comment.clone(),
        at: command.at,
        groups: command.groups.clone(),
        edited_args: edited_args.clone(),
    };
    let kept: usize = run.buffered.iter().map(limits::json_len).sum();
    if run.buffered.len() >= MAX_BUFFERED
        || kept.saturating_add(limits::json_len(&decision)) > MAX_BUFFERED_BYTES
    {
        return ctx.reject(
            command,
            "unknown_interrupt",
            format!(
                "no interrupt is pending under this id, and the decisions this run keeps for \
                 interrupts not registered yet are full (at most {MAX_BUFFERED}, \
                 {MAX_BUFFERED_BYTES} bytes)"
            ),
        );
    }
    ctx.emit(
        EventBody::DecisionBuffered {
            interrupt_id: decision.interrupt_id,
            proposal_hash: decision.proposal_hash,
            approve: decision.approve,
            decided_by: decision.principal,
            roles: decision.roles,
            payload: decision.payload,
            comment: decision.comment,
            groups: decision.groups,
            edited_args: decision.edited_args,
        },
        None,
    );
}

/// Whether `id` has the form of a derived id: `prefix` then `hex` lowercase hex digits.
fn is_derived(id: &str, prefix: &str, hex: usize) -> bool {
    id.strip_prefix(prefix).is_some_and(|rest| {
        rest.len() == hex
            && rest
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// Whether the principal of `command` could decide some gate of `graph` when its
/// interrupt is registered (round 0: the gate's own group).
fn may_decide_a_gate(graph: &Graph, command: &Command) -> bool {
    graph
        .all_nodes()
        .filter_map(|n| n.interrupt_before.as_ref())
        .any(|gate| {
            let role = gate
                .required_role
                .as_ref()
                .is_none_or(|r| command.roles.contains(r));
            // A group named by a template is known only once its interrupt opens.
            let group = gate
                .group
                .as_ref()
                .is_none_or(|g| g.starts_with('$') || command.groups.contains(g));
            role && group
        })
}
