//! What the reducer writes for other runs: a child run's start and cancel (a command),
//! and a child's end for its parent's step (a step result), with the parent link both
//! carry ([`sortie_core::child`]).

use sortie_core::{input::Command, CommandBody, StepOutcome, StepReport};
use sortie_wire::records as w;

use crate::{budget_text, decision_to_wire, id, json_opt, text, Invalid};

/// A child run's parent link on the wire (JSON).
pub(crate) fn parent_text(link: &sortie_core::child::ParentLink) -> String {
    serde_json::to_string(link).unwrap_or_default()
}

/// A parent link from the wire, its ids held to the id rule.
pub(crate) fn parent_of(
    text: &Option<String>,
) -> Result<Option<sortie_core::child::ParentLink>, Invalid> {
    let Some(link) = json_opt("parent", text)? else {
        return Ok(None);
    };
    let link: sortie_core::child::ParentLink =
        serde_json::from_value(link).map_err(|e| Invalid::new(format!("parent: {e}")))?;
    id("parent run_id", &link.run_id)?;
    id("parent step_id", &link.step_id)?;
    id("parent operation_id", &link.operation_id)?;
    Ok(Some(link))
}

/// A command the reducer produces for another run (a child's start or cancel): the
/// inverse of [`crate::command_from_wire`] for the kinds the fold sends.
pub fn command_to_wire(command: &Command) -> w::RunCommand {
    let body = match &command.body {
        CommandBody::StartRun {
            graph_id,
            graph_version,
            input,
            labels,
            budget,
            fork,
            parent,
        } => w::CommandBody::StartRun(w::StartRun {
            graph_id: graph_id.clone(),
            graph_version: graph_version.map(|v| v as i32),
            input: text(input),
            labels: labels.clone(),
            budget: budget.as_ref().map(budget_text),
            fork: fork.as_ref().and_then(|f| serde_json::to_string(f).ok()),
            parent: parent.as_ref().map(parent_text),
        }),
        CommandBody::ResumeRun {
            interrupt_id,
            proposal_hash,
            approve,
            payload,
            comment,
            edited_args,
        } => w::CommandBody::ResumeRun(w::ResumeRun {
            interrupt_id: interrupt_id.clone(),
            proposal_hash: proposal_hash.clone(),
            decision: decision_to_wire(*approve),
            payload: payload.as_ref().map(text),
            comment: comment.clone(),
            edited_args: edited_args.as_ref().map(text),
            payload_is_input: true,
        }),
        CommandBody::CancelRun { reason } => w::CommandBody::CancelRun(w::CancelRun {
            reason: reason.clone(),
        }),
        CommandBody::ForgetRun { reason } => w::CommandBody::ForgetRun(w::ForgetRun {
            reason: reason.clone(),
        }),
        CommandBody::ReconcileOperation {
            operation_id,
            succeeded,
            output,
            error,
        } => w::CommandBody::ReconcileOperation(w::ReconcileOperation {
            operation_id: operation_id.clone(),
            outcome: if *succeeded {
                w::ReconcileOutcome::Succeeded
            } else {
                w::ReconcileOutcome::Failed
            },
            output: output.as_ref().map(text),
            error: error.clone(),
        }),
        CommandBody::SignalRun {
            name,
            signal_id,
            payload,
        } => w::CommandBody::SignalRun(w::SignalRun {
            name: name.clone(),
            signal_id: Some(signal_id.clone()),
            payload: Some(text(payload)),
        }),
    };
    w::RunCommand {
        command_id: command.command_id.clone(),
        tenant: command.tenant.clone(),
        run_id: command.run_id.clone(),
        issuer: w::Issuer {
            principal: command.principal.clone(),
            roles: command.roles.clone(),
            groups: command.groups.clone(),
        },
        issued_at: command.at,
        body,
    }
}

/// A report the reducer produces for a parent run's step (its child ended): the inverse
/// of [`crate::report_from_wire`], as an executor writes it (`executor` names the child run).
pub fn report_to_wire(report: &StepReport, executor: &str) -> w::StepResult {
    let (status, retryable, output, error) = match &report.outcome {
        StepOutcome::Started => (w::StepStatus::Started, false, None, None),
        StepOutcome::Succeeded { output } => {
            (w::StepStatus::Succeeded, false, Some(text(output)), None)
        }
        StepOutcome::Failed {
            retryable,
            code,
            message,
            retry_after_ms,
        } => (
            w::StepStatus::Failed,
            *retryable,
            None,
            Some(w::StepError {
                code: code.clone(),
                message: message.clone(),
                retry_after_ms: *retry_after_ms,
            }),
        ),
        StepOutcome::Unknown { code, message } => (
            w::StepStatus::Unknown,
            false,
            None,
            Some(w::StepError {
                code: code.clone(),
                message: message.clone(),
                retry_after_ms: None,
            }),
        ),
    };
    w::StepResult {
        operation_id: report.operation_id.clone(),
        attempt: report.attempt as i32,
        tenant: report.tenant.clone(),
        run_id: report.run_id.clone(),
        step_id: report.step_id.clone(),
        status,
        retryable,
        output,
        error,
        executor: executor.to_owned(),
        started_at: report.at,
        finished_at: Some(report.at),
        spend: report
            .spent
            .as_ref()
            .map(|s| serde_json::to_string(s).unwrap_or_default()),
    }
}
