//! Run events to the wire and back, losslessly: an auditor folding decoded events gets
//! the reducer's state exactly.

use sortie_core::{event::StepRole, graph::SideEffect, Event, EventBody};
use sortie_wire::records as w;

use crate::outbound::{parent_of, parent_text};
use crate::{
    budget_text, decision_to_wire, json, json_opt, recorded_budget_of, side_effect_from_wire,
    side_effect_to_wire, status_from_wire, status_to_wire, text, Invalid,
};

fn role_fields(role: &StepRole) -> (Option<String>, Option<String>, Option<String>) {
    match role {
        StepRole::Node => (None, None, None),
        StepRole::Requested { by } => (None, Some(by.clone()), None),
        StepRole::Compensation { of } => (Some(of.clone()), None, None),
        StepRole::Substitute { for_node } => (None, None, Some(for_node.clone())),
        StepRole::Precheck { .. } => (None, None, None),
    }
}

fn precheck_for(role: &StepRole) -> Option<String> {
    match role {
        StepRole::Precheck { of } => Some(of.clone()),
        _ => None,
    }
}

fn role_from(
    compensates: Option<String>,
    requested_by: Option<String>,
    substitute_for: Option<String>,
) -> StepRole {
    match (compensates, requested_by, substitute_for) {
        (Some(of), _, _) => StepRole::Compensation { of },
        (_, Some(by), _) => StepRole::Requested { by },
        (_, _, Some(for_node)) => StepRole::Substitute { for_node },
        _ => StepRole::Node,
    }
}

fn u32_of(field: &str, n: i32) -> Result<u32, Invalid> {
    u32::try_from(n).map_err(|_| Invalid::new(format!("{field} {n} is negative")))
}

pub fn event_to_wire(event: &Event) -> w::RunEvent {
    let body = match &event.body {
        EventBody::CommandAccepted {
            command_id,
            command,
            duplicate,
        } => w::EventBody::CommandAccepted(w::CommandAccepted {
            command_id: command_id.clone(),
            command: command.clone(),
            duplicate: *duplicate,
        }),
        EventBody::CommandRejected {
            command_id,
            command,
            code,
            reason,
        } => w::EventBody::CommandRejected(w::CommandRejected {
            command_id: command_id.clone(),
            command: command.clone(),
            code: code.clone(),
            reason: reason.clone(),
        }),
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
        } => w::EventBody::RunStarted(w::RunStarted {
            graph_id: graph_id.clone(),
            graph_version: *graph_version as i32,
            input: text(input),
            started_by: started_by.clone(),
            labels: labels.clone(),
            deadline_at: *deadline_at,
            budget: budget.as_ref().map(budget_text),
            forked_from: forked_from.as_ref().map(text),
            rules: *rules as i32,
            parent: parent.as_ref().map(parent_text),
        }),
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
            lookup_only,
        } => {
            let (compensates, requested_by, substitute_for) = role_fields(role);
            w::EventBody::StepDispatched(w::StepDispatched {
                step_id: step_id.clone(),
                node: node.clone(),
                attempt: *attempt as i32,
                tool: tool.clone(),
                queue: queue.clone(),
                args: text(args),
                compensates,
                side_effect: Some(side_effect_to_wire(*side_effect)),
                timeout_at: *timeout_at,
                requested_by,
                substitute_for,
                precheck_for: precheck_for(role),
                lookup_only: *lookup_only,
            })
        }
        EventBody::StepStarted { step_id, attempt } => w::EventBody::StepStarted(w::StepStarted {
            step_id: step_id.clone(),
            attempt: *attempt as i32,
        }),
        EventBody::StepSucceeded {
            step_id,
            attempt,
            output,
        } => w::EventBody::StepSucceeded(w::StepSucceeded {
            step_id: step_id.clone(),
            attempt: *attempt as i32,
            output: text(output),
        }),
        EventBody::StepFailed {
            step_id,
            attempt,
            code,
            message,
            retryable,
            retry_at,
        } => w::EventBody::StepFailed(w::StepFailed {
            step_id: step_id.clone(),
            attempt: *attempt as i32,
            code: code.clone(),
            message: message.clone(),
            retryable: *retryable,
            retry_at: *retry_at,
        }),
        EventBody::StepOutcomeUnknown {
            step_id,
            attempt,
            message,
            needs_operator,
        } => w::EventBody::StepOutcomeUnknown(w::StepOutcomeUnknown {
            step_id: step_id.clone(),
            attempt: *attempt as i32,
            message: message.clone(),
            needs_operator: *needs_operator,
        }),
        EventBody::OperationReconciled {
            step_id,
            succeeded,
            output,
            error,
            by,
        } => w::EventBody::OperationReconciled(w::OperationReconciled {
            step_id: step_id.clone(),
            outcome: if *succeeded {
                w::ReconcileOutcome::Succeeded
            } else {
                w::ReconcileOutcome::Failed
            },
            by: by.clone(),
            output: output.as_ref().map(text),
            error: error.clone(),
        }),
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
            let (_, requested_by, substitute_for) = role_fields(role);
            w::EventBody::Interrupted(w::Interrupted {
                interrupt_id: interrupt_id.clone(),
                step_id: step_id.clone(),
                node: node.clone(),
                proposal: text(proposal),
                proposal_hash: proposal_hash.clone(),
                reason: reason.clone(),
                required_role: required_role.clone(),
                approver_group: approver_group.clone(),
                quorum: *quorum as i32,
                expires_at: *expires_at,
                requested_by,
                substitute_for,
                context: context.as_ref().map(text),
                members_only: *members_only,
            })
        }
        EventBody::InterruptDecided {
            interrupt_id,
            proposal_hash,
            approve,
            decided_by,
            payload,
            comment,
            is_final,
            edited_args,
        } => w::EventBody::InterruptDecided(w::InterruptDecided {
            interrupt_id: interrupt_id.clone(),
            proposal_hash: proposal_hash.clone(),
            decision: decision_to_wire(*approve),
            decided_by: decided_by.clone(),
            payload: payload.as_ref().map(text),
            comment: comment.clone(),
            is_final: *is_final,
            edited_args: edited_args.as_ref().map(text),
        }),
        EventBody::InterruptEscalated {
            interrupt_id,
            approver_group,
            expires_at,
        } => w::EventBody::InterruptEscalated(w::InterruptEscalated {
            interrupt_id: interrupt_id.clone(),
            approver_group: approver_group.clone(),
            expires_at: *expires_at,
        }),
        EventBody::InterruptExpired {
            interrupt_id,
            on_timeout,
        } => w::EventBody::InterruptExpired(w::InterruptExpired {
            interrupt_id: interrupt_id.clone(),
            on_timeout: on_timeout.clone(),
        }),
        EventBody::CancelRequested {
            requested_by,
            reason,
        } => w::EventBody::CancelRequested(w::CancelRequested {
            requested_by: requested_by.clone(),
            reason: reason.clone(),
        }),
        EventBody::RunStatusChanged {
            status,
            reason,
            output,
            forget_at,
        } => w::EventBody::RunStatusChanged(w::RunStatusChanged {
            status: status_to_wire(*status),
            reason: reason.clone(),
            output: output.as_ref().map(text),
            forget_at: *forget_at,
        }),
        EventBody::RunForgotten { reason } => w::EventBody::RunForgotten(w::RunForgotten {
            reason: reason.clone(),
        }),
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
        } => w::EventBody::DecisionBuffered(w::DecisionBuffered {
            interrupt_id: interrupt_id.clone(),
            proposal_hash: proposal_hash.clone(),
            decision: decision_to_wire(*approve),
            decided_by: decided_by.clone(),
            roles: roles.clone(),
            payload: payload.as_ref().map(text),
            comment: comment.clone(),
            groups: groups.clone(),
            edited_args: edited_args.as_ref().map(text),
        }),
        EventBody::SignalWaitOpened {
            step_id,
            node,
            signal,
            many,
            wanted,
            expires_at,
        } => w::EventBody::SignalWaitOpened(w::SignalWaitOpened {
            step_id: step_id.clone(),
            node: node.clone(),
            signal: signal.clone(),
            many: *many,
            wanted: *wanted as i32,
            expires_at: *expires_at,
        }),
        EventBody::SignalReceived {
            step_id,
            signal,
            signal_id,
            payload,
            sent_by,
        } => w::EventBody::SignalReceived(w::SignalReceived {
            step_id: step_id.clone(),
            signal: signal.clone(),
            signal_id: signal_id.clone(),
            payload: text(payload),
            sent_by: sent_by.clone(),
        }),
        EventBody::SignalBuffered {
            signal,
            signal_id,
            payload,
            sent_by,
        } => w::EventBody::SignalBuffered(w::SignalBuffered {
            signal: signal.clone(),
            signal_id: signal_id.clone(),
            payload: text(payload),
            sent_by: sent_by.clone(),
        }),
        EventBody::SignalWaitExpired {
            step_id,
            on_timeout,
        } => w::EventBody::SignalWaitExpired(w::SignalWaitExpired {
            step_id: step_id.clone(),
            on_timeout: on_timeout.clone(),
        }),
        EventBody::BudgetReserved {
            step_id,
            child_run_id,
            limits,
        } => w::EventBody::BudgetReserved(w::BudgetReserved {
            step_id: step_id.clone(),
            child_run_id: child_run_id.clone(),
            limits: serde_json::to_string(limits).unwrap_or_default(),
        }),
        EventBody::BudgetSettled { step_id, spent } => {
            w::EventBody::BudgetSettled(w::BudgetSettled {
                step_id: step_id.clone(),
                spent: serde_json::to_string(spent).unwrap_or_default(),
            })
        }
    };
    w::RunEvent {
        tenant: event.tenant.clone(),
        run_id: event.run_id.clone(),
        seq: event.seq,
        state_version: event.state_version,
        at: event.at,
        command_id: event.command_id.clone(),
        operation_id: event.operation_id.clone(),
        prev_hash: event.prev_hash.clone(),
        hash: event.hash.clone(),
        body,
    }
}

/// The inverse of [`event_to_wire`], for audit replays: folding decoded events must
/// reproduce the state exactly, so this mapping is lossless for every event Sortie writes.
pub fn event_from_wire(event: w::RunEvent) -> Result<Event, Invalid> {
    let body = match event.body {
        w::EventBody::CommandAccepted(e) => EventBody::CommandAccepted {
            command_id: e.command_id,
            command: e.command,
            duplicate: e.duplicate,
        },
        w::EventBody::CommandRejected(e) => EventBody::CommandRejected {
            command_id: e.command_id,
            command: e.command,
            code: e.code,
            reason: e.reason,
        },
        w::EventBody::RunStarted(e) => EventBody::RunStarted {
            graph_id: e.graph_id,
            graph_version: u32_of("graph_version", e.graph_version)?,
            input: json("input", &e.input)?,
            started_by: e.started_by,
            labels: e.labels,
            deadline_at: e.deadline_at,
            budget: recorded_budget_of(&e.budget)?,
            forked_from: json_opt("forked_from", &e.forked_from)?,
            rules: u32_of("rules", e.rules)?,
            parent: parent_of(&e.parent)?,
        },
        w::EventBody::StepDispatched(e) => EventBody::StepDispatched {
            step_id: e.step_id,
            node: e.node,
            attempt: u32_of("attempt", e.attempt)?,
            tool: e.tool,
            queue: e.queue,
            side_effect: e
                .side_effect
                .map(side_effect_from_wire)
                .unwrap_or(SideEffect::Unsafe),
            args: json("args", &e.args)?,
            role: match e.precheck_for {
                Some(of) => StepRole::Precheck { of },
                None => role_from(e.compensates, e.requested_by, e.substitute_for),
            },
            timeout_at: e.timeout_at,
            lookup_only: e.lookup_only,
        },
        w::EventBody::StepStarted(e) => EventBody::StepStarted {
            step_id: e.step_id,
            attempt: u32_of("attempt", e.attempt)?,
        },
        w::EventBody::StepSucceeded(e) => EventBody::StepSucceeded {
            step_id: e.step_id,
            attempt: u32_of("attempt", e.attempt)?,
            output: json("output", &e.output)?,
        },
        w::EventBody::StepFailed(e) => EventBody::StepFailed {
            step_id: e.step_id,
            attempt: u32_of("attempt", e.attempt)?,
            code: e.code,
            message: e.message,
            retryable: e.retryable,
            retry_at: e.retry_at,
        },
        w::EventBody::StepOutcomeUnknown(e) => EventBody::StepOutcomeUnknown {
            step_id: e.step_id,
            attempt: u32_of("attempt", e.attempt)?,
            message: e.message,
            needs_operator: e.needs_operator,
        },
        w::EventBody::OperationReconciled(e) => EventBody::OperationReconciled {
            step_id: e.step_id,
            succeeded: e.outcome == w::ReconcileOutcome::Succeeded,
            output: json_opt("output", &e.output)?,
            error: e.error,
            by: e.by,
        },
        w::EventBody::Interrupted(e) => EventBody::Interrupted {
            interrupt_id: e.interrupt_id,
            step_id: e.step_id,
            node: e.node,
            proposal: json("proposal", &e.proposal)?,
            proposal_hash: e.proposal_hash,
            reason: e.reason,
            required_role: e.required_role,
            approver_group: e.approver_group,
            quorum: u32_of("quorum", e.quorum)?,
            expires_at: e.expires_at,
            role: role_from(None, e.requested_by, e.substitute_for),
            context: json_opt("context", &e.context)?,
            members_only: e.members_only,
        },
        w::EventBody::InterruptDecided(e) => EventBody::InterruptDecided {
            interrupt_id: e.interrupt_id,
            proposal_hash: e.proposal_hash,
            approve: e.decision == w::Decision::Approve,
            decided_by: e.decided_by,
            payload: json_opt("payload", &e.payload)?,
            comment: e.comment,
            is_final: e.is_final,
            edited_args: json_opt("edited_args", &e.edited_args)?,
        },
        w::EventBody::InterruptEscalated(e) => EventBody::InterruptEscalated {
            interrupt_id: e.interrupt_id,
            approver_group: e.approver_group,
            expires_at: e.expires_at,
        },
        w::EventBody::InterruptExpired(e) => EventBody::InterruptExpired {
            interrupt_id: e.interrupt_id,
            on_timeout: e.on_timeout,
        },
        w::EventBody::CancelRequested(e) => EventBody::CancelRequested {
            requested_by: e.requested_by,
            reason: e.reason,
        },
        w::EventBody::RunStatusChanged(e) => EventBody::RunStatusChanged {
            status: status_from_wire(e.status),
            reason: e.reason,
            output: json_opt("output", &e.output)?,
            forget_at: e.forget_at,
        },
        w::EventBody::RunForgotten(e) => EventBody::RunForgotten { reason: e.reason },
        w::EventBody::DecisionBuffered(e) => EventBody::DecisionBuffered {
            interrupt_id: e.interrupt_id,
            proposal_hash: e.proposal_hash,
            approve: e.decision == w::Decision::Approve,
            decided_by: e.decided_by,
            roles: e.roles,
            payload: json_opt("payload", &e.payload)?,
            comment: e.comment,
            groups: e.groups,
            edited_args: json_opt("edited_args", &e.edited_args)?,
        },
        w::EventBody::SignalWaitOpened(e) => EventBody::SignalWaitOpened {
            step_id: e.step_id,
            node: e.node,
            signal: e.signal,
            many: e.many,
            wanted: u32_of("wanted", e.wanted)?,
            expires_at: e.expires_at,
        },
        w::EventBody::SignalReceived(e) => EventBody::SignalReceived {
            step_id: e.step_id,
            signal: e.signal,
            signal_id: e.signal_id,
            payload: json("payload", &e.payload)?,
            sent_by: e.sent_by,
        },
        w::EventBody::SignalBuffered(e) => EventBody::SignalBuffered {
            signal: e.signal,
            signal_id: e.signal_id,
            payload: json("payload", &e.payload)?,
            sent_by: e.sent_by,
        },
        w::EventBody::SignalWaitExpired(e) => EventBody::SignalWaitExpired {
            step_id: e.step_id,
            on_timeout: e.on_timeout,
        },
        w::EventBody::BudgetReserved(e) => EventBody::BudgetReserved {
            step_id: e.step_id,
            child_run_id: e.child_run_id,
            limits: serde_json::from_str(&e.limits)
                .map_err(|_| Invalid::new("limits is not a budget's limits".to_owned()))?,
        },
        w::EventBody::BudgetSettled(e) => EventBody::BudgetSettled {
            step_id: e.step_id,
            spent: serde_json::from_str(&e.spent)
                .map_err(|_| Invalid::new("spent is not a spend".to_owned()))?,
        },
    };
    Ok(Event {
        tenant: event.tenant,
        run_id: event.run_id,
        seq: event.seq,
        state_version: event.state_version,
        at: event.at,
        command_id: event.command_id,
        operation_id: event.operation_id,
        prev_hash: event.prev_hash,
        hash: event.hash,
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{state_from_wire, state_to_wire};
    use sortie_core::{
        apply, input::Command, CommandBody, Effect, Graph, Graphs, Input, StepOutcome, StepReport,
    };

    /// Every event of a realistic run survives the trip to the wire and back, so an
    /// auditor folding decoded events gets exactly the reducer's state.
    #[test]
    fn events_round_trip_through_the_wire_types() {
        let mut graphs = Graphs::new();
        let graph = Graph::parse(
            "id: g\nversion: 1\nmax_duration: 1h\nnodes:\n  - {id: a, tool: http, side_effect: keyed, timeout: 5s, compensate_with: undo}\n  - {id: b, tool: http, side_effect: unsafe, interrupt_before: {reason: check, quorum: 1}}\n  - {id: undo, tool: http, side_effect: keyed}\nedges:\n  - {from: a, to: b}\n",
        )
        .expect("graph");
        graphs.insert(graph).expect("insert");
        let start = Input::Command(Command {
            command_id: "c1".into(),
            tenant: "t".into(),
            run_id: "r".into(),
            principal: "svc".into(),
            roles: vec![],
            at: 10,
            body: CommandBody::StartRun {
                graph_id: "g".into(),
                graph_version: None,
                input: serde_json::json!({"x": [1, "two"]}),
                labels: [("k".to_owned(), "v".to_owned())].into(),
                budget: None,
                fork: None,
                parent: None,
            },
            groups: vec![],
        });
        let applied = apply(None, &start, &graphs);
        let state = applied.state.clone().expect("state");
        let op = state.steps["a#1"].operation_id.clone();
        let report = Input::StepReport(StepReport {
            spent: None,
            operation_id: op,
            attempt: 1,
            tenant: "t".into(),
            run_id: "r".into(),
            step_id: "a#1".into(),
            outcome: StepOutcome::Succeeded {
                output: serde_json::json!({"ok": true}),
            },
            at: 20,
        });
        let second = apply(Some(&state), &report, &graphs);
        let cancel = Input::Command(Command {
            command_id: "c2".into(),
            tenant: "t".into(),
            run_id: "r".into(),
            principal: "u".into(),
            roles: vec![],
            at: 30,
            body: CommandBody::CancelRun { reason: None },
            groups: vec![],
        });
        let third = apply(second.state.as_ref(), &cancel, &graphs);
        let mut folded = None;
        for effect in applied
            .effects
            .iter()
            .chain(&second.effects)
            .chain(&third.effects)
        {
            if let Effect::Emit(event) = effect {
                let back = event_from_wire(event_to_wire(event)).expect("from wire");
                assert_eq!(&back, event);
                folded = sortie_core::evolve(folded, &back);
            }
        }
        assert_eq!(folded, third.state);
        let header = state_to_wire(third.state.as_ref().expect("state"));
        assert_eq!(state_from_wire(&header).ok(), third.state);
    }
    /// The fields this build adds to events survive the wire, so their hashes verify.
    #[test]
    fn lookup_only_and_rules_round_trip() {
        let event = |body| Event {
            tenant: "t".into(),
            run_id: "r".into(),
            seq: 1,
            state_version: 1,
            at: 0,
            command_id: None,
            operation_id: Some("op".into()),
            prev_hash: None,
            hash: None,
            body,
        };
        for body in [
            EventBody::StepDispatched {
                step_id: "book#1".into(),
                node: "book".into(),
                attempt: 2,
                tool: "http".into(),
                queue: "http".into(),
                side_effect: SideEffect::Reconcilable,
                args: serde_json::json!({}),
                role: StepRole::Node,
                timeout_at: Some(9),
                lookup_only: true,
            },
            EventBody::RunStarted {
                graph_id: "g".into(),
                graph_version: 1,
                input: serde_json::json!({}),
                started_by: "svc".into(),
                labels: Default::default(),
                deadline_at: None,
                budget: None,
                forked_from: None,
                rules: sortie_core::budget::RULES,
                parent: None,
            },
        ] {
            let event = event(body);
            assert_eq!(event_from_wire(event_to_wire(&event)).ok(), Some(event));
        }
    }
}
