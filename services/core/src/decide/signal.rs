//! SignalRun, and a node's wait for a signal: opening it, taking signals (kept ones
//! first), and its deadline.

use super::{advance, begin_failure, Ctx};
use crate::{
    event::{EventBody, StepRole},
    graph::Node,
    input::{Command, CommandBody},
    limits::{self, shown_id},
    signal::{self, OnWaitTimeout, MAX_EARLY_SIGNALS, MAX_EARLY_SIGNAL_BYTES},
    state::{EarlySignal, WaitStatus},
};

/// A signal for a run that is not ending. Checked in this order, each refusal answered in
/// the run's history and changing nothing else:
/// - the run's graph waits for no signal of this name: `unknown_signal`;
/// - the sender holds none of the wait's roles: `forbidden`;
/// - a signal with this signal id was taken or kept already: accepted as a duplicate,
///   taken once (its payload is not looked at again);
/// - the payload does not match the wait's schema: `invalid_payload` (naming the first
///   place that fails, never the payload);
/// - the wait is open: taken (`SignalReceived`); a wait that has all it wants is done and
///   the run moves on;
/// - the wait has not opened yet: kept (`SignalBuffered`) within
///   [`MAX_EARLY_SIGNALS`] and [`MAX_EARLY_SIGNAL_BYTES`], else `too_many_signals`;
/// - the wait has ended (or the run is winding down): `not_waiting`.
pub(crate) fn handle(ctx: &mut Ctx<'_>, command: &Command) {
    let CommandBody::SignalRun {
        name,
        signal_id,
        payload,
    } = &command.body
    else {
        return;
    };
    let Some(graph) = ctx.graph() else { return };
    let Some(node) = graph.waiting_for(name) else {
        return ctx.reject(
            command,
            "unknown_signal",
            format!(
                "graph {}@{} waits for no signal named {}",
                graph.id,
                graph.version,
                shown_id(name)
            ),
        );
    };
    if let Some(reason) = signal::refusal(node, &command.roles) {
        return ctx.reject(command, "forbidden", reason);
    }
    if ctx.run().has_signal(signal_id) {
        return duplicate(ctx, command);
    }
    if let Err(why) = signal::check_payload(node, payload) {
        return ctx.reject(command, "invalid_payload", why);
    }
    let run = ctx.run();
    if run.ending.is_some() {
        return ctx.reject(
            command,
            "not_waiting",
            format!(
                "the run is {}: it takes no more signals",
                run.status.as_str()
            ),
        );
    }
    let open = run
        .open_waits()
        .find(|w| w.signal == *name)
        .map(|w| w.step_id.clone());
    if let Some(step_id) = open {
        ctx.accept(command);
        take(ctx, &step_id, name, signal_id, payload, &command.principal);
        return advance(ctx);
    }
    let ended = match node.conversation {
        Some(_) => super::converse::has_ended(run, node),
        None => run.waits.values().any(|w| w.node == node.id),
    };
    if ended {
        return ctx.reject(
            command,
            "not_waiting",
            format!("the wait for signal {} has ended", shown_id(name)),
        );
    }
    let early = EarlySignal {
        command_id: command.command_id.clone(),
        signal: name.clone(),
        signal_id: signal_id.clone(),
        payload: payload.clone(),
        sent_by: command.principal.clone(),
        at: command.at,
    };
    let kept: usize = run.early_signals.iter().map(limits::json_len).sum();
    if run.early_signals.len() >= MAX_EARLY_SIGNALS
        || kept.saturating_add(limits::json_len(&early)) > MAX_EARLY_SIGNAL_BYTES
    {
        return ctx.reject(
            command,
            "too_many_signals",
            format!(
                "the run does not wait for signal {} yet, and the signals it keeps for waits \
                 not open yet are full (at most {MAX_EARLY_SIGNALS}, {MAX_EARLY_SIGNAL_BYTES} \
                 bytes)",
                shown_id(name)
            ),
        );
    }
    ctx.accept(command);
    ctx.emit(
        EventBody::SignalBuffered {
            signal: early.signal,
            signal_id: early.signal_id,
            payload: early.payload,
            sent_by: early.sent_by,
        },
        None,
    );
}

/// The same event again (a retry under a new command id): accepted as a duplicate, taken
/// once.
pub(crate) fn duplicate(ctx: &mut Ctx<'_>, command: &Command) {
    ctx.emit(
        EventBody::CommandAccepted {
            command_id: command.command_id.clone(),
            command: command.body.kind().into(),
            duplicate: true,
        },
        None,
    );
}

fn take(
    ctx: &mut Ctx<'_>,
    step_id: &str,
    name: &str,
    signal_id: &str,
    payload: &serde_json::Value,
    sent_by: &str,
) {
    ctx.emit(
        EventBody::SignalReceived {
            step_id: step_id.to_owned(),
            signal: name.to_owned(),
            signal_id: signal_id.to_owned(),
            payload: payload.clone(),
            sent_by: sent_by.to_owned(),
        },
        None,
    );
}

/// Opens `node`'s wait as step `step_id`, arming its deadline, and takes the signals kept
/// for it, oldest first, until it has what it wants. Each is recorded under the command
/// that carried it.
pub(crate) fn open(ctx: &mut Ctx<'_>, node: &Node, step_id: String, role: &StepRole) {
    let Some(wait) = &node.wait else { return };
    debug_assert_eq!(*role, StepRole::Node, "waits are reached by edges only");
    ctx.emit(
        EventBody::SignalWaitOpened {
            step_id: step_id.clone(),
            node: node.id.clone(),
            signal: wait.signal.clone(),
            many: wait.many,
            wanted: wait.wanted(),
            expires_at: Some(ctx.at.saturating_add(wait.timeout.0)),
        },
        None,
    );
    let kept: Vec<EarlySignal> = ctx
        .run()
        .early_signals
        .iter()
        .filter(|e| e.signal == wait.signal)
        .take(wait.wanted() as usize)
        .cloned()
        .collect();
    for early in kept {
        take_kept(ctx, &step_id, early);
    }
}

/// Takes a signal kept for a wait not open then into the wait `step_id`, recorded under
/// the command that carried it.
pub(crate) fn take_kept(ctx: &mut Ctx<'_>, step_id: &str, early: EarlySignal) {
    let current = ctx.command_id.replace(early.command_id.clone());
    take(
        ctx,
        step_id,
        &early.signal,
        &early.signal_id,
        &early.payload,
        &early.sent_by,
    );
    ctx.command_id = current;
}

/// A wait's deadline passed while it was open: `on_timeout` decides.
pub(crate) fn expire(ctx: &mut Ctx<'_>, step_id: &str) -> Result<(), &'static str> {
    let Some(wait) = ctx.run().waits.get(step_id).cloned() else {
        return Err("unknown wait");
    };
    if wait.status != WaitStatus::Open {
        return Err("wait no longer open");
    }
    // A conversation's wait for the next message ends it when its idle deadline passes.
    let Some(on_timeout) = ctx.graph().and_then(|g| g.node(&wait.node)).and_then(|n| {
        match (&n.wait, &n.conversation) {
            (Some(w), _) => Some(w.on_timeout.clone()),
            (None, Some(_)) => Some(OnWaitTimeout::Continue),
            (None, None) => None,
        }
    }) else {
        return Err("unknown node");
    };
    ctx.emit(
        EventBody::SignalWaitExpired {
            step_id: step_id.to_owned(),
            on_timeout: on_timeout.as_str().into(),
        },
        None,
    );
    match on_timeout {
        OnWaitTimeout::Fail => begin_failure(
            ctx,
            format!(
                "signal {} did not arrive before its wait's deadline",
                wait.signal
            ),
        ),
        OnWaitTimeout::Continue | OnWaitTimeout::Goto(_) => advance(ctx),
    }
    Ok(())
}
