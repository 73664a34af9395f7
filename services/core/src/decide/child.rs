//! A child run as its parent and as itself sees it: the parent's start and cancel of its
//! children, and the child's report of its end (or of its refused start) to the parent's
//! step ([`crate::child`]).

use serde_json::Value;

use super::Ctx;
use crate::{
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
        let body = CommandBody::StartRun {
            graph_id: child.graph.clone(),
            graph_version: child.version,
            input: input.clone(),
            labels: Default::default(),
            budget: self
                .run()
                .budget
                .as_ref()
                .map(|b| b.remaining(&self.run().spend)),
            fork: None,
            parent: Some(link),
        };
        self.send_child("start", child_id, body);
    }

    /// A command from this run to its child `child_id`, under the derived command id
    /// `<what>-<child id>`, issued as the run itself (no roles).
    fn send_child(&mut self, what: &str, child_id: String, body: CommandBody) {
        self.commands.push(Command {
            command_id: format!("{what}-{child_id}"),
            tenant: self.tenant.clone(),
            run_id: child_id,
            principal: format!("{}{}", crate::child::PARENT_PRINCIPAL, self.run_id),
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
