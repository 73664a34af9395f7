//! A child run as its parent and as itself sees it: the parent's start and cancel of its
//! children, and the child's report of its end (or of its refused start) to the parent's
//! step ([`crate::child`]).

use serde_json::Value;

use super::Ctx;
use crate::{
    budget::Budget,
    event::EventBody,
    input::{Command, CommandBody, StepOutcome, StepReport},
    status::RunStatus,
};

impl Ctx<'_> {
    /// The parent's command to start `child` as attempt `attempt` of its step: the
    /// child's id derives from the operation and attempt, so a re-fold sends the same
    /// start (a duplicate the child answers) and a retry starts a fresh child.
    pub(crate) fn start_child(
        &mut self,
        child: &crate::child::ChildRun,
        step_id: &str,
        operation_id: &str,
        attempt: u32,
        input: &Value,
    ) {
        let link = crate::child::ParentLink {
            run_id: self.run_id.clone(),
            step_id: step_id.to_owned(),
            operation_id: operation_id.to_owned(),
            attempt,
        };
        let child_id = link.child_id(&self.tenant);
        let budget = self.reserve_for_child(child, step_id, &child_id);
        let body = CommandBody::StartRun {
            graph_id: child.graph.clone(),
            graph_version: child.version,
            input: input.clone(),
            labels: Default::default(),
            budget,
            fork: None,
            parent: Some(link),
        };
        self.send_child("start", child_id, body);
    }

    /// The budget a child started now gets, set aside (`BudgetReserved`) until it ends:
    /// the node's `run.budget` capped by what this run has left — its limits less what it
    /// spent and what its other children in flight hold — or else an equal share of what
    /// is left among the children this plan starts, so children started together never
    /// exceed what the run had left. A run without a budget reserves nothing (its child
    /// gets the node's `run.budget`, if any).
    fn reserve_for_child(
        &mut self,
        child: &crate::child::ChildRun,
        step_id: &str,
        child_id: &str,
    ) -> Option<Budget> {
        let parts = self.children_to_start.max(1);
        self.children_to_start = self.children_to_start.saturating_sub(1);
        let run = self.run();
        let Some(budget) = run.budget.as_ref() else {
            // A run without a budget holds nothing back: the node's own cap, if any.
            return child.budget.clone().map(|limits| Budget {
                limits,
                ..Budget::default()
            });
        };
        let mut held = run.spend.with_reserved(run.reserved.values());
        // The plan's requested steps not dispatched yet (this one among them) are tool
        // calls the run will have made.
        held.tool_calls = held.tool_calls.saturating_add(self.requests_to_dispatch);
        let left = budget.remaining(&held);
        let even = left.limits.share(parts);
        let limits = match &child.budget {
            Some(asked) => asked.capped_by(&left.limits),
            None => even,
        };
        let share = Budget {
            limits,
            prices: left.prices,
            ceiling: left.ceiling,
        };
        self.emit(
            EventBody::BudgetReserved {
                step_id: step_id.to_owned(),
                child_run_id: child_id.to_owned(),
                limits: share.limits.clone(),
            },
            None,
        );
        Some(share)
    }

    /// A command from this run to its child `child_id`, under the derived command id
    /// `<what>-<child id>`, issued as the run itself (no roles).
    fn send_child(&mut self, what: &str, child_id: String, body: CommandBody) {
        self.commands.push(Command {
            command_id: format!("{what}-{child_id}"),
            tenant: self.tenant.clone(),
            run_id: child_id,
            principal: crate::child::parent_principal(&self.run_id),
            roles: Vec::new(),
            groups: Vec::new(),
            at: self.at,
            body,
        });
    }

    /// Cancels the children this run has in flight (it began to wind down): each is sent
    /// a `CancelRun`, whose id is derived, so a re-fold sends the same one.
    pub(crate) fn cancel_children(&mut self, reason: &str) {
        let children: Vec<String> = self
            .run()
            .steps
            .values()
            .filter(|s| s.tool == crate::child::CHILD_TOOL && s.status.is_in_flight())
            .map(|s| {
                crate::child::child_run_id(&self.tenant, &self.run_id, &s.operation_id, s.attempt)
            })
            .collect();
        for child_id in children {
            let reason = Some(format!("its parent run is winding down: {reason}"));
            self.send_child("cancel", child_id, CommandBody::CancelRun { reason });
        }
    }

    /// Forgets every child this run started (it was forgotten itself: `reason`): each
    /// attempt's child is sent a `ForgetRun`, whose id is derived, so a re-fold sends the
    /// same one. A run is forgotten only once it ended, and it ends only after each of
    /// its children reported its end, so every child has ended too. (An attempt whose
    /// start was refused has no run: its `ForgetRun` is answered `unknown_run`.)
    pub(crate) fn forget_children(&mut self, reason: &str) {
        let children: Vec<String> = self
            .run()
            .steps
            .values()
            .filter(|s| s.tool == crate::child::CHILD_TOOL)
            .flat_map(|s| {
                (1..=s.attempt).map(|attempt| {
                    crate::child::child_run_id(&self.tenant, &self.run_id, &s.operation_id, attempt)
                })
            })
            .collect();
        for child_id in children {
            let reason = Some(format!(
                "its parent run {} was forgotten: {reason}",
                self.run_id
            ));
            self.send_child("forget", child_id, CommandBody::ForgetRun { reason });
        }
    }

    /// A child's start that was refused (no run began) fails its parent's step for good,
    /// with the refusal's code and reason: a parent never waits on a child that will not
    /// run. Only for a link that derives the start's run id: a forged one names no parent.
    pub(crate) fn tell_parent_of_refusal(&mut self, command: &Command) {
        let CommandBody::StartRun {
            parent: Some(parent),
            ..
        } = &command.body
        else {
            return;
        };
        if parent.child_id(&command.tenant) != command.run_id {
            return;
        }
        let Some((code, reason)) = self.events.iter().find_map(|e| match &e.body {
            EventBody::CommandRejected {
                command_id,
                code,
                reason,
                ..
            } if *command_id == command.command_id => Some((code.clone(), reason.clone())),
            _ => None,
        }) else {
            return;
        };
        self.reports.push(StepReport {
            spent: None,
            operation_id: parent.operation_id.clone(),
            attempt: parent.attempt,
            tenant: command.tenant.clone(),
            run_id: parent.run_id.clone(),
            step_id: parent.step_id.clone(),
            outcome: StepOutcome::Failed {
                retryable: false,
                code: format!("child_{code}"),
                message: format!("child run {} was not started: {reason}", command.run_id),
                retry_after_ms: None,
            },
            at: self.at,
        });
    }

    /// A child run that ended reports to its parent's step, as an executor would: its
    /// output, or why it did not succeed (a failed child may be retried by the parent's
    /// policy, a cancelled one not).
    pub(crate) fn report_to_parent(&mut self) {
        let run = self.run();
        let Some(parent) = run.parent.clone() else {
            return;
        };
        let outcome = match run.status {
            RunStatus::Succeeded => StepOutcome::Succeeded {
                output: run.output.clone().unwrap_or(Value::Null),
            },
            status => {
                let reason = run
                    .ending
                    .as_ref()
                    .map(|e| e.reason.clone())
                    .unwrap_or_default();
                StepOutcome::Failed {
                    retryable: status == RunStatus::Failed,
                    code: format!("child_{}", status.as_str()),
                    message: format!("child run {} {}: {reason}", run.run_id, status.as_str()),
                    retry_after_ms: None,
                }
            }
        };
        self.reports.push(StepReport {
            spent: Some(run.spend.clone()),
            operation_id: parent.operation_id,
            attempt: parent.attempt,
            tenant: self.tenant.clone(),
            run_id: parent.run_id,
            step_id: parent.step_id,
            outcome,
            at: self.at,
        });
    }
}
