//! CancelRun: stop new dispatches at once; in-flight outcomes are recorded, then
//! completed steps are compensated in reverse order.

use super::{advance, Ctx};
use crate::{
    event::EventBody,
    input::{Command, CommandBody},
    status::RunStatus,
};

pub(crate) fn handle(ctx: &mut Ctx<'_>, command: &Command) {
    let CommandBody::CancelRun { reason } = &command.body else {
        return;
    };
    let run = ctx.run();
    let refusal = ctx
        .graphs
        .get(&run.graph_id, Some(run.graph_version))
        .and_then(|g| g.access.cancel_refusal(&g.id, &command.roles));
    if let Some(refusal) = refusal {
        return ctx.reject(command, "forbidden", refusal);
    }
    ctx.accept(command);
    if ctx.run().ending.as_ref().is_some_and(|e| e.cancelled) {
        return; // already cancelling: nothing more to do
    }
    cancel(ctx, command.principal.clone(), reason.clone());
}

/// Begins cancellation (also used when an approval expires with `on_timeout: cancel`).
pub(crate) fn cancel(ctx: &mut Ctx<'_>, by: String, reason: Option<String>) {
    let reason = reason.unwrap_or_else(|| format!("cancelled by {by}"));
    ctx.emit(
        EventBody::CancelRequested {
            requested_by: by.clone(),
            reason: Some(reason.clone()),
        },
        None,
    );
    ctx.cancel_children(&reason);
    ctx.set_status(RunStatus::Cancelling, None, None);
    advance(ctx);
}
