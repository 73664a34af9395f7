//! ReconcileOperation: an operator records the real outcome of an operation whose
//! outcome was unknown. Succeeded moves the run on; failed follows the retry policy (a
//! failure the operator vouches for is safe to retry).

use super::{advance, Ctx};
use crate::{
    event::EventBody,
    input::{Command, CommandBody},
    state::StepStatus,
};

/// The role a reconciliation needs.
pub const OPERATOR_ROLE: &str = "operator";

pub(crate) fn handle(ctx: &mut Ctx<'_>, command: &Command) {
    let CommandBody::ReconcileOperation {
        operation_id,
        succeeded,
        output,
        error,
    } = &command.body
    else {
        return;
    };
    if !command.roles.iter().any(|r| r == OPERATOR_ROLE) {
        // Recording an outcome can mark an unsafe payment done: operators only.
        return ctx.reject(
            command,
            "forbidden",
            format!("reconciling an operation needs the {OPERATOR_ROLE} role"),
        );
    }
    let Some(step) = ctx.run().step_by_operation(operation_id).cloned() else {
        return ctx.reject(
            command,
            "unknown_operation",
            format!(
                "operation {} is not part of this run",
                crate::limits::shown_id(operation_id)
            ),
        );
    };
    if step.status != StepStatus::NeedsOperator {
        // Only an outcome nobody knows (lost, or timed out for a call that cannot be
        // retried) is an operator's to record: an attempt still in flight will answer for
        // itself, and a settled one has answered.
        let reason = if step.status.is_in_flight() {
            format!(
                "operation {operation_id} still has an attempt in flight; only an unknown outcome can be reconciled"
            )
        } else {
            format!(
                "operation {operation_id} is {:?}, not awaiting reconciliation",
                step.status
            )
        };
        return ctx.reject(command, "bad_state", reason);
    }
    ctx.accept(command);
    ctx.emit(
        EventBody::OperationReconciled {
            step_id: step.step_id.clone(),
            succeeded: *succeeded,
            output: if *succeeded {
                Some(output.clone().unwrap_or(serde_json::Value::Null))
            } else {
                None
            },
            error: if *succeeded {
                None
            } else {
                Some(error.clone().unwrap_or_else(|| "failed".into()))
            },
            by: command.principal.clone(),
        },
        Some(operation_id.clone()),
    );
    if !*succeeded && ctx.run().ending.is_none() {
        if let Some(node) = ctx.graph().and_then(|g| g.node(&step.node)) {
            if step.attempt < node.retry.max_attempts {
                ctx.dispatch(
                    node,
                    step.step_id.clone(),
                    step.attempt + 1,
                    step.args.clone(),
                    step.role.clone(),
                );
            }
        }
    }
    advance(ctx);
}
