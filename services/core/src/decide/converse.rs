//! The fold's side of conversations ([`crate::converse`]): the first call's marker, the
//! next call's arguments, the wait for the person's next message after an answer (taking
//! one kept for it), and a summary step when the node's context asks for one.

use serde_json::{json, Value};

use super::advance::{assistant_message, render, NodeState, Proposal};
use super::Ctx;
use crate::{
    blob::BlobRef,
    converse::{self, Context, Conversation, Summary, Turn, ARG},
    event::{EventBody, StepRole},
    graph::{Graph, Node},
    state::{RunState, Step, StepStatus, WaitStatus},
};

/// The first call's arguments: the node's template, the stop tool among the tools, and
/// the marker of turn 1.
pub(super) fn first_call(node: &Node, conversation: &Conversation, args: &mut Value) {
    let Value::Object(map) = args else { return };
    if let Some(stop) = &conversation.stop_tool {
        let spec = converse::stop_tool_spec(node.model_api(), stop);
        match map.get_mut("tools") {
            Some(Value::Array(tools)) => tools.push(spec),
            _ => {
                map.insert("tools".into(), json!([spec]));
            }
        }
    }
    if map
        .get("tools")
        .is_some_and(|t| t.as_array().is_some_and(Vec::is_empty))
    {
        map.remove("tools");
    }
    let turn = Turn {
        turn: 1,
        max_turns: conversation.max_turns,
        history: Value::Null,
        last: conversation.context.last(),
        stop_tool: conversation.stop_tool.clone(),
        ..Turn::default()
    };
    map.insert(ARG.into(), turn.to_value());
}

/// `args` (the previous call's, with the new `messages` set) as the call after `latest`
/// within its turn: the history is `latest`'s transcript.
pub(super) fn continue_from(latest: &Step, args: &mut Value) -> Result<(), String> {
    let mut turn = marker(latest)?;
    turn.history = transcript(latest)?;
    args[ARG] = turn.to_value();
    Ok(())
}

/// Where a conversation stands after its latest call `latest` succeeded: ended (its
/// output), waiting for the next message (opening the wait the first time), summarizing,
/// or its next turn proposed. `None`: the answer called tools, which the tool loop runs.
pub(super) fn progress<'g>(
    run: &RunState,
    graph: &'g Graph,
    node: &'g Node,
    conversation: &Conversation,
    latest: &Step,
    out: &mut Vec<Proposal<'g>>,
) -> Result<Option<NodeState>, String> {
    if let Some(by) = converse::ended_by(run, latest) {
        return Ok(Some(NodeState::Done(converse::ended_output(latest, by))));
    }
    let output = latest.output.clone().unwrap_or(Value::Null);
    if output
        .get("tool_calls")
        .and_then(Value::as_array)
        .is_some_and(|calls| !calls.is_empty())
    {
        return Ok(None);
    }
    let turn = marker(latest)?;
    let Some(wait) = run.waits.get(&latest.step_id) else {
        out.push(Proposal {
            node,
            step_id: latest.step_id.clone(),
            args: Value::Null,
            role: StepRole::Node,
            opens_turn: true,
        });
        return Ok(Some(NodeState::Active));
    };
    let said = match (wait.status, wait.received.first()) {
        (WaitStatus::Done, Some(received)) => converse::message(&received.payload)
            .map_err(|e| format!("the message after step {}: {e}", latest.step_id))?,
        _ => return Ok(Some(NodeState::Active)),
    };
    // `ended_by` took a bare `end`: this message has a text.
    let text = said.text.unwrap_or_default();
    let mut next = Turn {
        turn: turn.turn + 1,
        history: transcript(latest)?,
        closing: said.end,
        ..turn.clone()
    };
    let answer = assistant_message(node.model_api(), &output);
    if let Context::Summary {
        last,
        node: summarizer,
    } = &conversation.context
    {
        // Every `last` turns, the turns the model no longer sees whole are summarized.
        let hidden = next.turn.saturating_sub(*last);
        let upto = hidden / last * last;
        let covered = turn.summary.as_ref().map_or(0, |s| s.turns);
        if upto > covered {
            let role = StepRole::Requested {
                by: latest.step_id.clone(),
            };
            match run
                .steps
                .values()
                .find(|s| s.role == role && s.node == *summarizer)
            {
                None => {
                    let target = graph
                        .node(summarizer)
                        .ok_or_else(|| format!("unknown node {summarizer}"))?;
                    let mut args = render(run, None, None, &target.args);
                    let ask = Turn {
                        summarize: Some(upto),
                        answer: Some(answer),
                        ..next.clone()
                    };
                    if let Value::Object(map) = &mut args {
                        map.insert(ARG.into(), ask.to_value());
                    }
                    out.push(Proposal {
                        node: target,
                        step_id: run.next_step_id(summarizer),
                        args,
                        role,
                        opens_turn: false,
                    });
                    return Ok(Some(NodeState::Active));
                }
                Some(step) if step.status == StepStatus::Succeeded => {
                    let text = step
                        .output
                        .as_ref()
                        .and_then(|o| o.get("content"))
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_owned();
                    next.summary = Some(Summary { turns: upto, text });
                }
                Some(_) => return Ok(Some(NodeState::Active)),
            }
        }
    }
    let mut args = latest.args.clone();
    if let Value::Object(map) = &mut args {
        map.insert(
            "messages".into(),
            json!([answer, converse::user_message(&text)]),
        );
        map.insert(ARG.into(), next.to_value());
    }
    out.push(Proposal {
        node,
        step_id: run.next_step_id(&node.id),
        args,
        role: StepRole::Node,
        opens_turn: false,
    });
    Ok(Some(NodeState::Active))
}

/// Opens the wait for the person's message after the answer of step `answered`, its
/// deadline the conversation's `idle`, and takes the oldest message kept for it.
pub(super) fn open(ctx: &mut Ctx<'_>, node: &Node, answered: String) {
    let Some(conversation) = &node.conversation else {
        return;
    };
    ctx.emit(
        EventBody::SignalWaitOpened {
            step_id: answered.clone(),
            node: node.id.clone(),
            signal: conversation.signal.clone(),
            many: false,
            wanted: 1,
            expires_at: Some(ctx.at.saturating_add(conversation.idle.0)),
        },
        None,
    );
    let kept = ctx
        .run()
        .early_signals
        .iter()
        .find(|e| e.signal == conversation.signal)
        .cloned();
    if let Some(early) = kept {
        super::signal::take_kept(ctx, &answered, early);
        ctx.wait_satisfied = true;
    }
}

/// Whether the conversation `node` ended (or has not begun: a message for it is kept).
pub(super) fn has_ended(run: &RunState, node: &Node) -> bool {
    run.steps
        .values()
        .filter(|s| s.node == node.id && s.role == StepRole::Node)
        .max_by_key(|s| super::advance::iteration(&s.step_id))
        .is_some_and(|latest| converse::ended_by(run, latest).is_some())
}

fn marker(step: &Step) -> Result<Turn, String> {
    Turn::of(&step.args).ok_or_else(|| {
        format!(
            "step {} of a conversation carries no {ARG} marker",
            step.step_id
        )
    })
}

/// The transcript reference `step`'s output carries (the executor stores it).
fn transcript(step: &Step) -> Result<Value, String> {
    step.output
        .as_ref()
        .and_then(|o| o.get("transcript"))
        .filter(|t| BlobRef::from_value(t).is_some())
        .cloned()
        .ok_or_else(|| {
            format!(
                "step {}'s output carries no transcript reference: a conversation's executor \
                 needs a blob store (--blob-store)",
                step.step_id
            )
        })
}
