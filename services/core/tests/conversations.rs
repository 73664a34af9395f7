//! Conversations as the fold decides them: an `llm` node with `conversation:` waits for the
//! person's next message after each answer without tool calls, and calls the model again
//! with only what is new beside the reference to the previous call's transcript; it ends
//! on `end`, `max_turns`, the idle deadline or the model's stop tool, and its output says
//! which. Earlier turns' payloads are compacted in the state, so 200 turns of long
//! messages keep the state small and every record small.
//!
//! Seen red: with `compact_earlier_turns` skipped in `evolve`, the state of
//! `two_hundred_turns_of_long_messages_keep_the_state_small` passed half the state limit
//! by turn 48; with the
//! signal-id check skipped in `decide/signal.rs`, a resent message started a second turn.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use serde_json::{json, Value};
use sortie_core::converse::{ARG, COMPACTED};
use sortie_core::limits::{self, MAX_RECORD_BYTES, MAX_STATE_BYTES};
use sortie_core::{
    apply, input::Command, CommandBody, Effect, Event, EventBody, Graph, Graphs, Input, Intent,
    RunState, RunStatus, StepOutcome, StepReport, TimerKey,
};

fn graph(conversation: &str, max_steps: u32) -> String {
    format!(
        r#"
id: chat
version: 1
max_steps: {max_steps}
nodes:
  - id: assistant
    tool: llm
    side_effect: pure
    args:
      messages: [{{role: system, content: Be brief.}}, {{role: user, content: $input.question}}]
    config: {{base_url: "http://model/v1", model: fake}}
    may_request: [lookup, summarize]
    tools: [lookup]
    conversation: {conversation}
  - {{id: lookup, tool: echo, side_effect: pure, args: {{q: The query}}}}
  - {{id: summarize, tool: llm, side_effect: pure, args: {{messages: [{{role: system, content: Summarize.}}]}}, config: {{base_url: "http://model/v1", model: fake}}}}
  - {{id: done, tool: echo, side_effect: pure, args: {{by: $steps.assistant.output.ended_by, turns: $steps.assistant.output.turns, last: $steps.assistant.output.content}}}}
edges:
  - {{from: assistant, to: done}}
"#
    )
}

struct Run {
    graphs: Graphs,
    state: Option<RunState>,
    intents: Vec<Intent>,
    events: Vec<Event>,
    at: i64,
    sent: u32,
}

impl Run {
    fn start(conversation: &str) -> Run {
        Run::start_with(conversation, 100)
    }

    fn start_with(conversation: &str, max_steps: u32) -> Run {
        let mut graphs = Graphs::new();
        graphs
            .insert(Graph::parse(&graph(conversation, max_steps)).unwrap())
            .unwrap();
        let mut run = Run {
            graphs,
            state: None,
            intents: Vec::new(),
            events: Vec::new(),
            at: 0,
            sent: 0,
        };
        run.command(
            "alice",
            vec![],
            CommandBody::StartRun {
                graph_id: "chat".into(),
                graph_version: None,
                input: json!({"question": "hello"}),
                labels: BTreeMap::new(),
                budget: None,
                fork: None,
                parent: None,
            },
        );
        run
    }

    fn input(&mut self, input: Input) {
        let applied = apply(self.state.as_ref(), &input, &self.graphs);
        for effect in applied.effects {
            match effect {
                Effect::Dispatch(intent) => self.intents.push(intent),
                Effect::Emit(event) => {
                    let record = serde_json::to_string(&event).unwrap();
                    assert!(record.len() < MAX_RECORD_BYTES, "{} bytes", record.len());
                    self.events.push(event);
                }
                _ => {}
            }
        }
        self.state = applied.state;
    }

    fn command(&mut self, principal: &str, roles: Vec<String>, body: CommandBody) {
        self.at += 1;
        self.input(Input::Command(Command {
            command_id: format!("c{}", self.at),
            tenant: "t".into(),
            run_id: "r".into(),
            principal: principal.into(),
            roles,
            groups: vec![],
            at: self.at,
            body,
        }));
    }

    /// A message from the person (signal id `m<n>`, or `signal_id`).
    fn say(&mut self, payload: Value) {
        self.sent += 1;
        let id = format!("m{}", self.sent);
        self.say_as(&id, payload);
    }

    fn say_as(&mut self, signal_id: &str, payload: Value) {
        self.command(
            "ann",
            vec!["customer".into()],
            CommandBody::SignalRun {
                name: "message".into(),
                signal_id: signal_id.into(),
                payload,
            },
        );
    }

    fn next(&mut self, node: &str) -> Intent {
        assert_eq!(self.intents.len(), 1, "{:#?}", self.intents);
        let intent = self.intents.remove(0);
        assert_eq!(intent.node, node, "{intent:#?}");
        intent
    }

    fn succeed(&mut self, intent: &Intent, output: Value) {
        self.at += 1;
        self.input(Input::StepReport(StepReport {
            spent: None,
            operation_id: intent.operation_id.clone(),
            attempt: intent.attempt,
            tenant: "t".into(),
            run_id: "r".into(),
            step_id: intent.step_id.clone(),
            outcome: StepOutcome::Succeeded { output },
            at: self.at,
        }));
    }

    /// The model answers the pending call with `text` (and the executor's transcript).
    fn answer(&mut self, text: &str) -> Intent {
        let intent = self.next("assistant");
        let output = answer(&intent, Some(text), vec![]);
        self.succeed(&intent, output);
        intent
    }

    fn fire_idle(&mut self, step_id: &str) {
        let due = *self
            .state()
            .timers
            .get(
                &TimerKey::SignalWait {
                    step_id: step_id.into(),
                }
                .encode(),
            )
            .expect("the idle timer is armed");
        self.at = due;
        self.input(Input::TimerFired {
            run_id: "r".into(),
            timer: TimerKey::SignalWait {
                step_id: step_id.into(),
            },
            at: due,
        });
    }

    fn state(&self) -> &RunState {
        self.state.as_ref().unwrap()
    }

    fn rejections(&self) -> Vec<String> {
        self.events
            .iter()
            .filter_map(|e| match &e.body {
                EventBody::CommandRejected { code, .. } => Some(code.clone()),
                _ => None,
            })
            .collect()
    }
}

/// A model's output for `intent` as the executor reports it: with the reference to the
/// transcript it stored.
fn answer(intent: &Intent, content: Option<&str>, calls: Vec<Value>) -> Value {
    let sha = format!("{:0>64}", intent.step_id.replace('#', "").len());
    json!({
        "content": content,
        "tool_calls": calls,
        "usage": {"prompt_tokens": 10, "completion_tokens": 5},
        "model": "fake",
        "transcript": {"$blob": format!("sortie-blob:t/r/{sha}"), "sha256": sha, "size": 10,
                       "media_type": "application/json"},
    })
}

fn marker(intent: &Intent) -> &Value {
    &intent.args[ARG]
}

#[test]
fn a_conversation_takes_turns_until_the_person_ends_it() {
    let mut run = Run::start("{roles: [customer]}");
    let first = run.answer("Hi! What do you need?");
    assert_eq!(marker(&first)["turn"], 1);
    assert_eq!(marker(&first)["history"], Value::Null);
    assert_eq!(first.args["messages"].as_array().unwrap().len(), 2);
    assert_eq!(run.state().status, RunStatus::WaitingSignal);
    assert!(run.intents.is_empty());

    run.say(json!({"text": "Where is order 7?"}));
    let second = run.next("assistant");
    assert_eq!(second.step_id, "assistant#2");
    assert_ne!(second.operation_id, first.operation_id);
    assert_eq!(marker(&second)["turn"], 2);
    assert_eq!(
        marker(&second)["history"]["$blob"],
        answer(&first, None, vec![])["transcript"]["$blob"],
        "the history is the previous call's transcript"
    );
    assert_eq!(
        second.args["messages"],
        json!([
            {"role": "assistant", "content": "Hi! What do you need?"},
            {"role": "user", "content": "Where is order 7?"},
        ]),
        "only what is new since the previous call"
    );
    assert_eq!(second.args["temperature"], Value::Null);
    run.succeed(&second, answer(&second, Some("It shipped."), vec![]));

    run.say(json!({"end": true}));
    let done = run.next("done");
    assert_eq!(
        done.args,
        json!({"by": "person", "turns": 2, "last": "It shipped."})
    );
    run.succeed(&done, json!({}));
    assert_eq!(run.state().status, RunStatus::Succeeded);
}

#[test]
fn tool_calls_inside_a_turn_carry_only_what_is_new() {
    let mut run = Run::start("{}");
    let first = run.next("assistant");
    let call = json!({"id": "c1", "type": "function",
                      "function": {"name": "lookup", "arguments": "{\"q\": \"7\"}"}});
    run.succeed(&first, answer(&first, None, vec![call.clone()]));
    let lookup = run.next("lookup");
    run.succeed(&lookup, json!({"found": true}));
    let again = run.next("assistant");
    assert_eq!(
        marker(&again)["turn"],
        1,
        "a tool call does not start a turn"
    );
    assert_eq!(
        marker(&again)["history"]["$blob"],
        answer(&first, None, vec![])["transcript"]["$blob"]
    );
    let messages = again.args["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 2, "{messages:#?}");
    assert_eq!(messages[0]["tool_calls"][0], call);
    assert_eq!(messages[1]["role"], "tool");
    run.succeed(&again, answer(&again, Some("Found it."), vec![]));
    assert_eq!(run.state().status, RunStatus::WaitingSignal);
}

#[test]
fn the_idle_deadline_the_turn_limit_and_the_stop_tool_end_it() {
    let mut idle = Run::start("{idle: 1h}");
    let first = idle.answer("Hello.");
    idle.fire_idle(&first.step_id);
    assert_eq!(idle.next("done").args["by"], "idle");

    let mut limited = Run::start("{max_turns: 2}");
    limited.answer("One.");
    limited.say(json!({"text": "more"}));
    limited.answer("Two.");
    let done = limited.next("done");
    assert_eq!(done.args["by"], "max_turns");
    assert_eq!(done.args["turns"], 2);
    assert!(limited.state().open_waits().next().is_none());

    let mut stopped = Run::start("{stop_tool: end_chat}");
    let first = stopped.next("assistant");
    let tools = first.args["tools"].as_array().unwrap();
    assert_eq!(tools.last().unwrap()["function"]["name"], "end_chat");
    let stop =
        json!({"id": "s", "type": "function", "function": {"name": "end_chat", "arguments": "{}"}});
    stopped.succeed(&first, answer(&first, Some("Bye."), vec![stop]));
    assert_eq!(stopped.next("done").args["by"], "model");

    let mut closing = Run::start("{}");
    closing.answer("Hi.");
    closing.say(json!({"text": "thanks, bye", "end": true}));
    let last = closing.answer("Goodbye!");
    assert_eq!(marker(&last)["closing"], true);
    assert_eq!(
        closing.next("done").args,
        json!({"by": "person", "turns": 2, "last": "Goodbye!"})
    );
}

#[test]
fn messages_are_checked_kept_early_and_taken_once() {
    let mut run = Run::start("{roles: [customer]}");
    // Before the first answer: kept, and taken when the wait opens.
    run.say_as("early", json!({"text": "also: order 9"}));
    assert!(run.rejections().is_empty());
    run.answer("Hi.");
    let second = run.next("assistant");
    assert_eq!(second.args["messages"][1]["content"], "also: order 9");
    // The same message again (a resend under a new command id) while the model thinks:
    // taken once, never a turn of its own.
    run.say_as("early", json!({"text": "also: order 9"}));
    run.succeed(&second, answer(&second, Some("Noted."), vec![]));
    assert!(run.intents.is_empty(), "{:#?}", run.intents);
    assert_eq!(run.state().status, RunStatus::WaitingSignal);

    // Refused, changing nothing: a payload that is no message, a sender without the role.
    run.say(json!({"text": 7}));
    run.command(
        "mallory",
        vec![],
        CommandBody::SignalRun {
            name: "message".into(),
            signal_id: "x".into(),
            payload: json!({"text": "hi"}),
        },
    );
    assert_eq!(run.rejections(), ["invalid_payload", "forbidden"]);
    assert!(run.intents.is_empty());

    run.say(json!({"end": true}));
    run.next("done");
    run.say(json!({"text": "hello?"}));
    assert_eq!(run.rejections().last().unwrap(), "not_waiting");
}

/// 200 turns, each message 1 KiB or 16 KiB: the state stays far under its limit, and does
/// not grow with the messages' length (earlier turns are compacted; the events and the
/// transcript keep them).
#[test]
fn two_hundred_turns_of_long_messages_keep_the_state_small() {
    let mut sizes = Vec::new();
    for length in [1024, 16 * 1024] {
        let mut run = Run::start_with("{max_turns: 200}", 250);
        let text = "x".repeat(length);
        for turn in 1..=200 {
            let intent = run.next("assistant");
            assert_eq!(marker(&intent)["turn"], turn);
            run.succeed(&intent, answer(&intent, Some(&text), vec![]));
            if turn < 200 {
                run.say(json!({ "text": text }));
            }
            let bytes = limits::json_len(run.state());
            assert!(bytes < MAX_STATE_BYTES / 2, "turn {turn}: {bytes} bytes");
        }
        assert_eq!(run.next("done").args["by"], "max_turns");
        let state = run.state();
        let compacted = state
            .steps
            .values()
            .filter(|s| s.args.get(COMPACTED).is_some())
            .count();
        assert_eq!(compacted, 199);
        sizes.push(limits::json_len(state));
    }
    assert!(
        sizes[1] < sizes[0] + 64 * 1024,
        "the state grows with the messages: {sizes:?}"
    );
}

#[test]
fn a_summary_step_covers_the_turns_the_model_no_longer_sees() {
    let mut run = Run::start("{context: {last: 2, summary: summarize}}");
    run.answer("1");
    for (turn, text) in [(2, "two"), (3, "three")] {
        run.say(json!({ "text": text }));
        let intent = run.answer(&turn.to_string());
        assert!(marker(&intent).get("summary").is_none());
    }
    // Turn 4 hides turns 1 and 2: they are summarized first.
    run.say(json!({"text": "four"}));
    let summary = run.next("summarize");
    assert_eq!(marker(&summary)["summarize"], 2);
    assert_eq!(summary.args["messages"][0]["content"], "Summarize.");
    assert_eq!(marker(&summary)["answer"]["content"], "3");
    run.succeed(&summary, json!({"content": "They counted to two."}));
    let fourth = run.answer("4");
    assert_eq!(
        marker(&fourth)["summary"],
        json!({"turns": 2, "text": "They counted to two."})
    );
    assert_eq!(marker(&fourth)["last"], 2);
    // Turn 5 still fits: no new summary; turn 6 summarizes up to 4.
    run.say(json!({"text": "five"}));
    let fifth = run.answer("5");
    assert_eq!(marker(&fifth)["summary"]["turns"], 2);
    run.say(json!({"text": "six"}));
    let summary = run.next("summarize");
    assert_eq!(marker(&summary)["summarize"], 4);
    assert_eq!(marker(&summary)["summary"]["turns"], 2);
}

#[test]
fn a_conversation_is_checked_when_published() {
    for (conversation, why) in [
        ("{max_turns: 0}", "max_turns"),
        ("{max_turns: 500}", "max_steps"),
        ("{context: {last: 2, summary: nowhere}}", "unknown node"),
        ("{context: {last: 0}}", "at least 1"),
        ("{stop_tool: lookup}", "stop_tool"),
        ("{idle: 0s}", "idle"),
    ] {
        let error = Graph::parse(&graph(conversation, 100))
            .unwrap_err()
            .to_string();
        assert!(error.contains(why), "{conversation}: {error}");
    }
    let shipped = include_str!("../../../topology/graphs/support_chat.yaml");
    let graph = Graph::parse(shipped).unwrap();
    assert!(graph.node("chat").unwrap().conversation.is_some());
}
