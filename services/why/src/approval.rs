//! The approval and proposal links of a gated step ([ADR 0022]): every approval that
//! released the step, held to the gate as the **signed graph version** the run pinned
//! states it — never to what the history says of the gate, which a writer of
//! `sortie.run-events` chains as freely as the rest.
//!
//! - **The rules** are the node's `interrupt_before` in that graph version (as the graph
//!   table read it under the keyring): the required role, the members-only group and the
//!   groups it escalates to, the timeout of each round, the quorum. The history's copy of
//!   them (its `Interrupted` event) must say the same.
//! - **An approval counts** only when all of these hold: its command is on
//!   `sortie.commands`, signed by a key of the keyring and saying what the history says;
//!   the roles and groups that signed command claims meet the gate, judged as the fold
//!   judges a decision ([`Interrupt::refusal`]: the role, the group of the round the
//!   decision fell in, the round's deadline, one approval per principal); and the fold
//!   accepted it (the history answers its command `accepted`, never `rejected`). An
//!   approval in the history that the rules refuse is a forgery and breaks the link, named
//!   with the rule it breaks.
//! - **The step is released** only by a quorum of counted approvals by distinct
//!   principals; fewer is a broken link. Approvals whose proof is not at hand (a command
//!   past the topic's retention, no keyring, a group named from a sealed input) leave the
//!   link `unchecked` when the quorum depends on them.
//!
//! [ADR 0022]: ../../../docs/adr/0022-audit-why-holds-approvals-to-their-commands.md

use serde_json::{json, Value};
use sortie_core::event::StepRole;
use sortie_core::graph::Approval;
use sortie_core::json::Reference;
use sortie_core::state::{Answer, Interrupt, InterruptStatus, RunState};
use sortie_core::{ids, Event, EventBody};
use sortie_wire::records as w;
use sortie_wire::signing::Keyring;

use crate::{link, sha, signed_command, Commands, Expected, Link, Signature, SEALED_ARGS};

/// The gated step an approval must have released, and its gate in the signed graph.
pub(crate) struct Gate<'a> {
    pub(crate) node: &'a sortie_core::Node,
    /// The node's `interrupt_before` in the graph version the run pinned.
    pub(crate) rules: &'a Approval,
    /// `graph_id@version`, for the problems.
    pub(crate) graph_key: &'a str,
    pub(crate) step_id: &'a str,
    pub(crate) role: &'a StepRole,
    pub(crate) args: &'a Value,
}

/// What the audit reads besides the gate.
pub(crate) struct Seen<'a> {
    pub(crate) state: &'a RunState,
    pub(crate) history: &'a [Event],
    pub(crate) readable: bool,
    pub(crate) keyring: Option<&'a Keyring>,
}

/// How one approval stands against the gate.
enum Counted {
    /// Proven: signed, within the gate's rules, accepted by the fold.
    Yes,
    /// Refused by the gate's rules or by the fold: never counted (why, when it is not
    /// already a problem of the link).
    No(Option<String>),
    /// Its proof is not at hand.
    Unknown,
}

/// The approval and proposal links of a gated step.
pub(crate) fn links(gate: &Gate<'_>, seen: &Seen<'_>, commands: &mut dyn Commands) -> Vec<Link> {
    let Seen {
        state,
        history,
        readable,
        keyring,
    } = *seen;
    let (mut problems, mut unchecked) = (Vec::new(), Vec::new());
    let approved: Vec<&Interrupt> = state
        .interrupts
        .values()
        .filter(|i| {
            i.step_id == gate.step_id
                && &i.role == gate.role
                && i.status == InterruptStatus::Approved
        })
        .collect();
    // The approval whose released arguments are the dispatched ones (with sealed
    // arguments: the last approved).
    let interrupt = approved
        .iter()
        .find(|i| readable && &sortie_core::decide::approved_args(gate.node, i) == gate.args)
        .or(approved.last())
        .copied();
    let Some(interrupt) = interrupt else {
        return vec![link(
            "approval",
            json!({"gated": true, "step_id": gate.step_id}),
            vec![format!(
                "the graph gates node {}, and no approval released step {}",
                gate.node.id, gate.step_id
            )],
            vec![],
        )];
    };
    if readable && &sortie_core::decide::approved_args(gate.node, interrupt) != gate.args {
        problems.push(format!(
            "the dispatched arguments are not the ones approval {} released",
            interrupt.interrupt_id
        ));
    }
    problems.extend(misstated(gate, interrupt));
    let quorum = gate.rules.quorum.max(1);
    let rounds = rounds(history, &interrupt.interrupt_id);
    let input = run_input(history, readable);
    let mut approvals = Vec::new();
    // Every principal whose approval the history shows so far (the fold's
    // `Interrupt::approvals`), those proven, and those whose proof is not at hand.
    let (mut seen_principals, mut counted, mut unknown) = (Vec::new(), Vec::new(), Vec::new());
    for event in history {
        if matches!(&event.body, EventBody::Interrupted { interrupt_id, .. } if *interrupt_id == interrupt.interrupt_id)
        {
            // The same proposal for the same step proposed again (an edit undone): the
            // fold registers the interrupt anew, and only its new approvals count.
            approvals.clear();
            seen_principals.clear();
            counted.clear();
            unknown.clear();
            continue;
        }
        let EventBody::InterruptDecided {
            interrupt_id,
            proposal_hash,
            approve: true,
            decided_by,
            is_final,
            ..
        } = &event.body
        else {
            continue;
        };
        if interrupt_id != &interrupt.interrupt_id {
            continue;
        }
        if proposal_hash != &interrupt.proposal_hash {
            problems.push(format!(
                "{decided_by}'s approval binds proposal {proposal_hash}, not the interrupt's {}",
                interrupt.proposal_hash
            ));
        }
        let command_id = event.command_id.clone().unwrap_or_default();
        // An early decision was sent when it was buffered, not when it was applied; the
        // fold judged it at that time too.
        let sent_at = history
            .iter()
            .find_map(|e| match &e.body {
                EventBody::DecisionBuffered { .. }
                    if e.command_id.as_deref() == Some(command_id.as_str()) =>
                {
                    Some(e.at)
                }
                _ => None,
            })
            .unwrap_or(event.at);
        let says = |body: &w::CommandBody| match body {
            w::CommandBody::ResumeRun(resume) => {
                resume.interrupt_id == *interrupt_id
                    && resume.proposal_hash == *proposal_hash
                    && resume.decision == w::Decision::Approve
            }
            _ => false,
        };
        let (signature, record, issuer) = signed_command(
            commands,
            keyring,
            &event.run_id,
            &command_id,
            sent_at,
            Expected {
                tenant: &event.tenant,
                principal: decided_by,
                noun: "decision",
                verb: "decided",
                says: &says,
            },
        );
        match &signature {
            Signature::Verified(_) => {}
            Signature::Broken(why) => problems.push(format!("{decided_by}'s approval: {why}")),
            Signature::Unchecked(why) => unchecked.push(format!("{decided_by}'s approval: {why}")),
        }
        let decision = Decision {
            principal: decided_by,
            command_id: &command_id,
            sent_at,
            round: round_of(&rounds, event.seq),
            issuer: issuer.as_ref(),
        };
        let judged = judge(
            gate,
            interrupt,
            &Judging {
                history,
                input: input.as_ref(),
                approved_before: &seen_principals,
            },
            &decision,
            &signature,
        );
        let (is_counted, why_not) = match judged {
            Counted::Yes => {
                if !counted.contains(decided_by) {
                    counted.push(decided_by.clone());
                }
                (true, None)
            }
            Counted::No(why) => {
                if let Some(why) = &why {
                    problems.push(format!("{decided_by}'s approval is not counted: {why}"));
                }
                (false, why)
            }
            Counted::Unknown => {
                if !unknown.contains(decided_by) {
                    unknown.push(decided_by.clone());
                }
                (false, None)
            }
        };
        if !seen_principals.contains(decided_by) {
            seen_principals.push(decided_by.clone());
        }
        approvals.push(json!({
            "principal": decided_by,
            "command_id": command_id,
            "at": sent_at,
            "final": is_final,
            "proposal_hash": proposal_hash,
            "key_id": signature.facts().0,
            "signature": signature.facts().1,
            "record": record,
            "roles": issuer.as_ref().map(|i| &i.roles),
            "groups": issuer.as_ref().map(|i| &i.groups),
            "counted": is_counted,
            "not_counted": why_not,
        }));
    }
    let short = quorum as usize > counted.len();
    let maybe = counted.len() + unknown.iter().filter(|p| !counted.contains(p)).count();
    if short && maybe >= quorum as usize {
        unchecked.push(format!(
            "the quorum of {quorum} is met only with approvals whose proof is not at hand"
        ));
    } else if short {
        problems.push(format!(
            "{} approval(s) by distinct principals meet the gate of {} ({}), which needs {quorum}",
            counted.len(),
            gate.graph_key,
            describe(gate.rules)
        ));
    }
    let released = readable.then(|| sha(gate.args));
    if !readable {
        unchecked.push(SEALED_ARGS.to_owned());
    }
    let approval = link(
        "approval",
        json!({
            "gated": true,
            "interrupt_id": interrupt.interrupt_id,
            "rules_from": gate.graph_key,
            "required_role": gate.rules.required_role,
            "group": gate.rules.group,
            "escalation": gate.rules.escalation,
            "approver_group": interrupt.approver_group,
            "quorum": quorum,
            "counted": counted.len(),
            "approvals": approvals,
            "released_args_sha256": released,
            "edited": interrupt.edited_args.is_some(),
        }),
        problems,
        unchecked,
    );
    vec![approval, proposal_link(interrupt, readable)]
}

/// The gate's rules in words: `role "approver", members of "finance"`.
fn describe(rules: &Approval) -> String {
    let mut parts = Vec::new();
    if let Some(role) = &rules.required_role {
        parts.push(format!("role {role:?}"));
    }
    if let Some(group) = &rules.group {
        parts.push(format!("members of {group:?}"));
    }
    if parts.is_empty() {
        parts.push("any principal of the tenant".to_owned());
    }
    parts.join(", ")
}

/// Where the history's copy of the gate's rules differs from the signed graph's.
fn misstated(gate: &Gate<'_>, interrupt: &Interrupt) -> Vec<String> {
    let rules = gate.rules;
    let key = gate.graph_key;
    let mut out = Vec::new();
    if interrupt.quorum != rules.quorum {
        out.push(format!(
            "the history's gate asks a quorum of {}, the signed graph {key}'s {}",
            interrupt.quorum, rules.quorum
        ));
    }
    if interrupt.required_role != rules.required_role {
        out.push(format!(
            "the history's gate requires role {:?}, the signed graph {key}'s {:?}",
            interrupt.required_role, rules.required_role
        ));
    }
    if interrupt.members_only != rules.group.is_some() {
        out.push(format!(
            "the history's gate is {}members-only, the signed graph {key}'s is {}",
            if interrupt.members_only { "" } else { "not " },
            if rules.group.is_some() { "" } else { "not" }
        ));
    }
    out
}

/// An event that begins a round of the interrupt: its opening, or an escalation.
#[derive(Debug, Clone, Copy)]
struct Begins {
    seq: i64,
    at: i64,
    opening: bool,
}

fn rounds(history: &[Event], interrupt_id: &str) -> Vec<Begins> {
    history
        .iter()
        .filter_map(|e| {
            match &e.body {
                EventBody::Interrupted {
                    interrupt_id: id, ..
                } if id == interrupt_id => Some(true),
                EventBody::InterruptEscalated {
                    interrupt_id: id, ..
                } if id == interrupt_id => Some(false),
                _ => None,
            }
            .map(|opening| Begins {
                seq: e.seq,
                at: e.at,
                opening,
            })
        })
        .collect()
}

/// The round a decision at `seq` fell in.
#[derive(Debug, Clone, Copy)]
struct Round {
    /// 0 before any escalation, then one more per escalation.
    number: usize,
    /// When it began (`None`: the history never opened the interrupt).
    started_at: Option<i64>,
}

fn round_of(begins: &[Begins], seq: i64) -> Round {
    let before: Vec<&Begins> = begins.iter().filter(|b| b.seq < seq).collect();
    let opened = before.iter().rposition(|b| b.opening);
    let since = opened.map_or(&before[..0], |i| &before[i..]);
    Round {
        number: since.len().saturating_sub(1),
        started_at: since.last().map(|b| b.at),
    }
}

/// The run's input as started, when it can be read (group templates read it).
fn run_input(history: &[Event], readable: bool) -> Option<Value> {
    if !readable {
        return None;
    }
    history.iter().find_map(|e| match &e.body {
        EventBody::RunStarted { input, .. } if !input.is_null() => Some(input.clone()),
        _ => None,
    })
}

/// One approval of the history.
struct Decision<'a> {
    principal: &'a str,
    command_id: &'a str,
    /// When the fold judged it (its command's time).
    sent_at: i64,
    /// The escalation round it fell in.
    round: Round,
    /// Who its command on `sortie.commands` says sent it (`None`: no command found).
    issuer: Option<&'a w::Issuer>,
}

/// What judging one approval reads besides it.
struct Judging<'a> {
    history: &'a [Event],
    input: Option<&'a Value>,
    /// The principals whose approvals of this interrupt came before it.
    approved_before: &'a [String],
}

/// Judges one approval against the signed gate, as the fold judges a decision, and
/// against the fold's answer to its command.
fn judge(
    gate: &Gate<'_>,
    interrupt: &Interrupt,
    judging: &Judging<'_>,
    decision: &Decision<'_>,
    signature: &Signature,
) -> Counted {
    let mut refused = Vec::new();
    // The fold's answer to the command: its first in the history (as `evolve` keeps it),
    // read from the events rather than the state, which forgets old refusals.
    let answer = judging.history.iter().find_map(|e| match &e.body {
        EventBody::CommandAccepted { command_id, .. } if command_id == decision.command_id => {
            Some(Answer::Accepted)
        }
        EventBody::CommandRejected {
            command_id,
            code,
            reason,
            ..
        } if command_id == decision.command_id => Some(Answer::Rejected {
            code: code.clone(),
            reason: reason.clone(),
        }),
        _ => None,
    });
    match answer {
        Some(Answer::Accepted) => {}
        Some(Answer::Rejected { code, reason }) => refused.push(format!(
            "the fold refused command {} ({code}: {reason})",
            decision.command_id
        )),
        None => refused.push(format!(
            "the history answers no command {}: the fold never accepted it",
            decision.command_id
        )),
    }
    let mut unknown = false;
    match decision.issuer {
        // No command found: a problem of the link already (missing, or past retention).
        None => unknown = true,
        Some(issuer) => match members_of(gate.rules, decision.round.number, judging.input) {
            Err(why) => refused.push(why),
            Ok(Membership::Unreadable) => unknown = true,
            Ok(Membership::Group(group)) => {
                let deadline = decision
                    .round
                    .started_at
                    .map(|at| at.saturating_add(gate.rules.timeout.0));
                let as_signed = Interrupt {
                    required_role: gate.rules.required_role.clone(),
                    approver_group: group.clone(),
                    members_only: group.is_some(),
                    expires_at: deadline,
                    approvals: judging.approved_before.to_vec(),
                    ..interrupt.clone()
                };
                if let Some(refusal) = as_signed.refusal(
                    decision.principal,
                    &issuer.roles,
                    &issuer.groups,
                    true,
                    decision.sent_at,
                ) {
                    refused.push(format!(
                        "the gate of {} refuses it ({}: {}); command {} claims roles {:?}, groups {:?}",
                        gate.graph_key,
                        refusal.code,
                        refusal.reason,
                        decision.command_id,
                        issuer.roles,
                        issuer.groups
                    ));
                }
            }
        },
    }
    if !refused.is_empty() {
        return Counted::No(Some(refused.join("; ")));
    }
    match signature {
        Signature::Verified(_) if !unknown => Counted::Yes,
        // Broken: a problem of the link already; never counted.
        Signature::Broken(_) => Counted::No(None),
        _ => Counted::Unknown,
    }
}

/// Who may decide a round of a gate.
enum Membership {
    /// `None`: anyone with the role; `Some`: only members of this group.
    Group(Option<String>),
    /// The group is named from the run's input, which cannot be read.
    Unreadable,
}

/// The members-only group of `round` as the signed gate names it: its `group`, then
/// after each escalation the next of `escalation`, a template rendered against the run's
/// input as the fold renders it (`decide::advance::group_name`: a reference that renders
/// to no string stays as written, which no principal's group matches).
fn members_of(rules: &Approval, round: usize, input: Option<&Value>) -> Result<Membership, String> {
    let Some(first) = &rules.group else {
        return Ok(Membership::Group(None));
    };
    let named = match round {
        0 => first,
        r => rules.escalation.get(r - 1).ok_or_else(|| {
            format!(
                "it was decided in escalation round {r}, and the gate escalates {} time(s)",
                rules.escalation.len()
            )
        })?,
    };
    if !named.starts_with('$') {
        return Ok(Membership::Group(Some(named.clone())));
    }
    let Some(input) = input else {
        return Ok(Membership::Unreadable);
    };
    let rendered = match sortie_core::json::reference(named) {
        Some(Ok(Reference::Input(path))) => sortie_core::blob::project(input, path),
        _ => None,
    };
    Ok(Membership::Group(Some(match rendered {
        Some(Value::String(name)) if !name.is_empty() => name,
        _ => named.clone(),
    })))
}

/// What the approvers saw.
fn proposal_link(interrupt: &Interrupt, readable: bool) -> Link {
    let (mut problems, mut unchecked) = (Vec::new(), Vec::new());
    if readable {
        let recomputed = ids::proposal_hash(&interrupt.proposal);
        if recomputed != interrupt.proposal_hash {
            problems.push(format!(
                "the proposal hashes to {recomputed}, not the {} its approvals bind",
                interrupt.proposal_hash
            ));
        }
    } else {
        unchecked.push("the proposal is sealed: give the run keys to check it".to_owned());
    }
    link(
        "proposal",
        json!({
            "interrupt_id": interrupt.interrupt_id,
            "proposal_hash": interrupt.proposal_hash,
            "node": interrupt.proposal.get("node"),
            "tool": interrupt.proposal.get("tool"),
            "args_sha256": readable.then(|| interrupt.proposal.get("args").map(sha)),
            "reason": interrupt.reason,
        }),
        problems,
        unchecked,
    )
}

#[cfg(test)]
mod tests;
