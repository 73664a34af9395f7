//! Commands and step results read from the wire, their ids, payloads and texts held to
//! the limits the fold relies on; what breaks them is [`Invalid`].

use serde_json::Value;
use sortie_core::{input::Command, CommandBody, StepOutcome, StepReport};
use sortie_wire::records as w;

use crate::outbound::parent_of;
use crate::{
    budget_of, client_text, clipped, id, json_opt, payload_opt, payload_or_null,
    payload_or_null_opt, Invalid,
};

pub fn command_from_wire(command: w::RunCommand) -> Result<Command, Invalid> {
    let mut breach = None;
    let command = command_with_payloads(command, &mut breach)?;
    match breach {
        None => Ok(command),
        Some(reason) => Err(Invalid(reason, Some(Box::new(command)))),
    }
}

/// [`command_from_wire`], with payloads that break the shape rule left out (`Null`) and
/// the first breach noted in `breach`.
fn command_with_payloads(
    command: w::RunCommand,
    breach: &mut Option<String>,
) -> Result<Command, Invalid> {
    id("run_id", &command.run_id)?;
    id("command_id", &command.command_id)?;
    id("tenant", &command.tenant)?;
    id("principal", &command.issuer.principal)?;
    for role in command.issuer.roles.iter().chain(&command.issuer.groups) {
        id("a role or group", role)?;
    }
    let body = match command.body {
        w::CommandBody::StartRun(start) => CommandBody::StartRun {
            graph_id: {
                id("graph_id", &start.graph_id)?;
                sortie_core::limits::check_labels(start.labels.iter()).map_err(Invalid::new)?;
                start.graph_id
            },
            graph_version: start
                .graph_version
                .map(|v| {
                    u32::try_from(v)
                        .map_err(|_| Invalid::new(format!("graph_version {v} is negative")))
                })
                .transpose()?,
            input: payload_or_null("input", &start.input, breach)?,
            labels: start.labels,
            budget: budget_of(&start.budget)?,
            fork: json_opt("fork", &start.fork)?
                .map(serde_json::from_value)
                .transpose()
                .map_err(|e| Invalid::new(format!("fork: {e}")))?,
            parent: parent_of(&start.parent)?,
        },
        w::CommandBody::ResumeRun(resume) => {
            // Empty ones are the fold's to answer (no such interrupt, not the proposal).
            for (field, value) in [
                ("interrupt_id", &resume.interrupt_id),
                ("proposal_hash", &resume.proposal_hash),
            ] {
                if !value.is_empty() {
                    id(field, value)?;
                }
            }
            client_text("comment", &resume.comment)?;
            let payload = payload_or_null_opt("payload", &resume.payload, breach)?;
            let edited_args = payload_or_null_opt("edited_args", &resume.edited_args, breach)?;
            // A producer written against 0.1 sent edited arguments as the payload.
            let (payload, edited_args) = match (resume.payload_is_input, edited_args) {
                (false, None) => (None, payload),
                (false, Some(edited)) => (payload, Some(edited)),
                (true, edited) => (payload, edited),
            };
            CommandBody::ResumeRun {
                interrupt_id: resume.interrupt_id,
                proposal_hash: resume.proposal_hash,
                approve: resume.decision == w::Decision::Approve,
                payload,
                comment: resume.comment,
                edited_args,
            }
        }
        w::CommandBody::CancelRun(cancel) => {
            client_text("reason", &cancel.reason)?;
            CommandBody::CancelRun {
                reason: cancel.reason,
            }
        }
        w::CommandBody::ForgetRun(forget) => {
            client_text("reason", &forget.reason)?;
            CommandBody::ForgetRun {
                reason: forget.reason,
            }
        }
        w::CommandBody::SignalRun(signal) => {
            id("signal name", &signal.name)?;
            if let Some(signal_id) = &signal.signal_id {
                id("signal_id", signal_id)?;
            }
            CommandBody::SignalRun {
                name: signal.name,
                signal_id: signal
                    .signal_id
                    .unwrap_or_else(|| command.command_id.clone()),
                payload: payload_or_null_opt("payload", &signal.payload, breach)?
                    .unwrap_or(Value::Null),
            }
        }
        w::CommandBody::ReconcileOperation(reconcile) => {
            id("operation_id", &reconcile.operation_id)?;
            client_text("error", &reconcile.error)?;
            CommandBody::ReconcileOperation {
                operation_id: reconcile.operation_id,
                succeeded: reconcile.outcome == w::ReconcileOutcome::Succeeded,
                output: payload_or_null_opt("output", &reconcile.output, breach)?,
                error: reconcile.error,
            }
        }
    };
    Ok(Command {
        command_id: command.command_id,
        tenant: command.tenant,
        run_id: command.run_id,
        principal: command.issuer.principal,
        roles: command.issuer.roles,
        groups: command.issuer.groups,
        at: 0,
        body,
    })
}

/// The longest wait a failed step may ask for before its retry (a week).
const MAX_RETRY_AFTER_MS: i64 = 7 * 24 * 3600 * 1000;

pub fn report_from_wire(result: w::StepResult, at: i64) -> Result<StepReport, Invalid> {
    id("run_id", &result.run_id)?;
    id("operation_id", &result.operation_id)?;
    id("tenant", &result.tenant)?;
    id("step_id", &result.step_id)?;
    let attempt = u32::try_from(result.attempt)
        .map_err(|_| Invalid::new(format!("attempt {} is negative", result.attempt)))?;
    let error = result.error.clone().unwrap_or(w::StepError {
        code: "unspecified".into(),
        message: "no error given".into(),
        retry_after_ms: None,
    });
    id("error code", &error.code)?;
    if error
        .retry_after_ms
        .is_some_and(|ms| !(0..=MAX_RETRY_AFTER_MS).contains(&ms))
    {
        return Err(Invalid::new(format!(
            "retry_after_ms must be 0 to {MAX_RETRY_AFTER_MS}"
        )));
    }
    let error = w::StepError {
        message: clipped(error.message, sortie_core::limits::MAX_TEXT_BYTES),
        ..error
    };
    let outcome = match result.status {
        w::StepStatus::Started => StepOutcome::Started,
        w::StepStatus::Succeeded => StepOutcome::Succeeded {
            output: payload_opt("output", &result.output)?.unwrap_or(Value::Null),
        },
        w::StepStatus::Failed => StepOutcome::Failed {
            retryable: result.retryable,
            code: error.code,
            message: error.message,
            retry_after_ms: error.retry_after_ms,
        },
        w::StepStatus::Unknown => StepOutcome::Unknown {
            code: error.code,
            message: error.message,
        },
    };
    // A child run's spend (the reducer writes it in a child's report): bounded like a
    // budget, or the record is refused.
    let spent = match &result.spend {
        None => None,
        Some(text) => {
            let refused = || Invalid::new("spend is not a run's spend (a JSON object)".to_owned());
            let value: Value = serde_json::from_str(text).map_err(|_| refused())?;
            if !value.is_object() {
                return Err(refused());
            }
            let spent: sortie_core::budget::Spend =
                serde_json::from_value(value).map_err(|_| refused())?;
            spent.check().map_err(Invalid::new)?;
            Some(spent)
        }
    };
    Ok(StepReport {
        spent,
        operation_id: result.operation_id,
        attempt,
        tenant: result.tenant,
        run_id: result.run_id,
        step_id: result.step_id,
        outcome,
        at,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child's report carries its spend; one out of bounds (a forged record) is
    /// refused, and the spend survives the trip to the wire and back.
    #[test]
    fn a_childs_spend_is_bounded_and_round_trips() {
        let report = StepReport {
            spent: Some(sortie_core::budget::Spend {
                prompt_tokens: 400,
                completion_tokens: 100,
                cost_usd: 0.05,
                llm_calls: 1,
                tool_calls: 2,
            }),
            operation_id: "op".into(),
            attempt: 1,
            tenant: "t".into(),
            run_id: "r".into(),
            step_id: "research#1".into(),
            outcome: sortie_core::StepOutcome::Succeeded {
                output: serde_json::json!({}),
            },
            at: 5,
        };
        let wire = crate::outbound::report_to_wire(&report, "reducer");
        assert_eq!(report_from_wire(wire.clone(), 5).expect("decodes"), report);
        for forged in [
            r#"{"cost_usd": -1}"#,
            r#"{"prompt_tokens": 18446744073709551615}"#,
            r#"{"cost_usd": "lots"}"#,
            "[]",
        ] {
            let mut bad = wire.clone();
            bad.spend = Some(forged.into());
            assert!(report_from_wire(bad, 5).is_err(), "{forged}");
        }
    }
}
