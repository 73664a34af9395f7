//! ForgetRun: forget a finished run now, as its retention would (`DELETE /v1/runs/{id}`).
//!
//! The sender destroyed the run's data key first (crypto-shredding): this drops the
//! payloads from the state, tombstones the step results and records who asked, so the
//! gateway, the reducer and the views agree the run is forgotten. Needs the operator role;
//! a run still going is refused (cancel it first: forgetting must not race its steps).

use super::{reconcile::OPERATOR_ROLE, Ctx};
use crate::{
    event::EventBody,
    input::{Command, CommandBody},
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
    if !command.roles.iter().any(|r| r == OPERATOR_ROLE) {
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
    ctx.emit(EventBody::RunForgotten { reason }, None);
}
