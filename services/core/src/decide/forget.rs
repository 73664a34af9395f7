//! ForgetRun: forget a finished run now, as its retention would (`DELETE /v1/runs/{id}`).
//!
//! The sender destroyed the run's data key first (crypto-shredding): this drops the
//! payloads from the state, tombstones the step results and records who asked, so the
//! gateway, the reducer and the views agree the run is forgotten. Needs the operator role;
//! a run still going is refused (cancel it first: forgetting must not race its steps).
//! A run's children are forgotten with it (each sent a `ForgetRun` from the run, which a
//! child takes from its parent only), so a child is never forgotten before its parent.

use super::{reconcile::OPERATOR_ROLE, Ctx};
use crate::{
    event::EventBody,
    input::{Command, CommandBody},
    limits::shown_id,
};

pub(crate) fn handle(ctx: &mut Ctx<'_>, command: &Command) {
    let CommandBody::ForgetRun { reason } = &command.body else {
        return;
    };
    let Some(run) = &ctx.state else {
        return ctx.reject(
            command,
            "unknown_run",
            format!("run {} does not exist", command.run_id),
        );
    };
    // A child run is forgotten with its parent, by its parent, never before it.
    let from_parent = match &run.parent {
        Some(parent) => {
            if command.principal != crate::child::parent_principal(&parent.run_id) {
                let reason = format!(
                    "run {} is a child of run {}: it is forgotten with its parent; delete the parent",
                    shown_id(&command.run_id),
                    shown_id(&parent.run_id)
                );
                return ctx.reject(command, "bad_state", reason);
            }
            true
        }
        None => false,
    };
    if !from_parent && !command.roles.iter().any(|r| r == OPERATOR_ROLE) {
        return ctx.reject(
            command,
            "forbidden",
            format!("forgetting a run needs the {OPERATOR_ROLE} role"),
        );
    }
    if !run.status.is_terminal() {
        let reason = format!(
            "run is {}; cancel it before forgetting it",
            run.status.as_str()
        );
        return ctx.reject(command, "bad_state", reason);
    }
    let already = run.forgotten.is_some();
    ctx.accept(command);
    if already {
        return;
    }
    let reason = match reason {
        Some(reason) if !reason.trim().is_empty() => format!("deleted: {reason}"),
        _ => format!("deleted by {}", command.principal),
    };
    ctx.emit(
        EventBody::RunForgotten {
            reason: reason.clone(),
        },
        None,
    );
    ctx.forget_children(&reason);
}
