//! Conversations end to end on the real broker (issue 53 item 2): an `llm` node with
//! `conversation:` talks with a person through the scripted fake model
//! (`sortie_devkit::model`), each message a `SignalRun` command on `sortie.commands`, the
//! executor keeping each call's transcript in a directory blob store. After the
//! conversation a `keyed` call to the ledger records how it ended, so "the conversation
//! ended once" is checked on what the receiver got.
//!
//! - `a_conversation_survives_a_deploy_and_the_model_sees_its_context`: the first message
//!   arrives while the model still answers (kept, taken when the wait opens); the reducer
//!   and the executor are killed mid-conversation and, while they are down, the next
//!   message and a resend of the first (same signal id, new command id) arrive; after the
//!   restart the conversation goes on from its transcript: every answer is the one to the
//!   message before it, the resend is taken never, the model sees the last two turns whole
//!   (`context: {last: 2}`), every call's transcript is a blob of the run, and "goodbye"
//!   makes the model call the stop tool: one close call, `ended_by: model`, 5 turns. The
//!   audit re-fold of the history gives the reducer's state. Seen red: with the history
//!   reference left out of the next turn's marker (`history: null` in `progress`), the
//!   executor gave the model only the new messages, which it answered as a first turn.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use sortie_core::{EventBody, RunState, RunStatus};
use sortie_devkit::model::{self, FakeModel, FINAL_ANSWER, REPLY, STOP_TOOL};
use sortie_tests::stack::{check_history, command, start_run, Stack};
use sortie_wire::records as w;

const LONG: Duration = Duration::from_secs(90);

fn graph(model: &str, ledger: &str) -> String {
    format!(
        r#"
id: chat
version: 1
max_steps: 40
nodes:
  - id: chat
    tool: llm
    side_effect: pure
    args:
      messages: [{{role: system, content: Be brief.}}, {{role: user, content: $input.question}}]
    config: {{base_url: "{model}/v1", model: fake-agent}}
    timeout: 10s
    conversation: {{signal: message, roles: [customer], max_turns: 10, context: {{last: 2}}, stop_tool: {STOP_TOOL}}}
  - id: close
    tool: http
    side_effect: keyed
    args: {{ended_by: $steps.chat.output.ended_by, turns: $steps.chat.output.turns}}
    config: {{url: "{ledger}/effects/close"}}
    timeout: 30s
edges:
  - {{from: chat, to: close}}
"#
    )
}

async fn serve_model() -> (Arc<FakeModel>, String) {
    let fake = FakeModel::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(model::serve(
        listener,
        fake.clone(),
        std::future::pending::<()>(),
    ));
    (fake, url)
}

/// The customer's message as their chat service publishes it.
fn message(run_id: &str, command_id: &str, signal_id: &str, text: &str) -> w::RunCommand {
    let mut command = command(
        run_id,
        command_id,
        w::CommandBody::SignalRun(w::SignalRun {
            name: "message".into(),
            signal_id: Some(signal_id.into()),
            payload: Some(json!({ "text": text }).to_string()),
        }),
    );
    command.issuer = w::Issuer {
        principal: "user:ann".into(),
        roles: vec!["customer".into()],
        groups: vec![],
    };
    command
}

/// The model's answers so far, in order.
fn answers(state: &RunState) -> Vec<String> {
    let mut steps: Vec<_> = state
        .steps
        .values()
        .filter(|s| s.node == "chat" && s.output.is_some())
        .collect();
    steps.sort_by_key(|s| {
        s.step_id
            .rsplit_once('#')
            .and_then(|(_, n)| n.parse::<u32>().ok())
    });
    steps.iter().map(|s| s.step_id.clone()).collect()
}

/// Waiting for the next message after `n` answers.
fn waiting_after(n: usize) -> impl Fn(&RunState) -> bool {
    move |s| s.status == RunStatus::WaitingSignal && answers(s).len() == n
}

/// The texts of a request's messages.
fn texts(request: &Value) -> Vec<String> {
    request["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["content"].as_str().map(str::to_owned))
        .collect()
}

fn files_under(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| {
            let path = e.path();
            if path.is_dir() {
                files_under(&path)
            } else {
                1
            }
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_survives_a_deploy_and_the_model_sees_its_context() {
    let (fake, model_url) = serve_model().await;
    let stack = Stack::start("conversations-deploy", &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    stack.publish(&graph(&model_url, &ledger.url)).await;
    let blobs = stack.dir.join("blobs");
    let store = format!("file://{}", blobs.display());
    let executor_args = ["--blob-store", store.as_str()];
    let mut reducer = stack.reducer("0");
    let mut executor = stack.executor_process("executor", &["default"], &executor_args);

    let run = "chat-ann".to_owned();
    let runs = std::slice::from_ref(&run);
    stack
        .send(&start_run(
            &run,
            "chat",
            r#"{"question": "Where is order 7?"}"#,
        ))
        .await;
    // Sent at once: the model is (most likely) still answering, so it is kept.
    stack.send(&message(&run, "cmd-1", "msg-1", "first")).await;
    stack
        .wait_for_states("two answers", runs, LONG, waiting_after(2))
        .await;

    // A deploy mid-conversation; the next message, and a resend of the first, arrive
    // while both are down.
    reducer.kill();
    executor.kill();
    stack.send(&message(&run, "cmd-2", "msg-2", "second")).await;
    stack.send(&message(&run, "cmd-1b", "msg-1", "first")).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor_process("executor", &["default"], &executor_args);
    stack
        .wait_for_states("three answers", runs, LONG, waiting_after(3))
        .await;
    stack.send(&message(&run, "cmd-3", "msg-3", "third")).await;
    stack
        .wait_for_states("four answers", runs, LONG, waiting_after(4))
        .await;
    stack
        .send(&message(&run, "cmd-4", "msg-4", "Thanks, goodbye!"))
        .await;
    let states = stack
        .wait_for_states("the conversation ended", runs, LONG, |s| {
            s.status == RunStatus::Succeeded
        })
        .await;
    let state = &states[&run];

    // The answers, each to the message before it, from the events (the state keeps the
    // latest turn's payloads only).
    let events = stack.events().await;
    let history = &events[&run];
    check_history(&run, history, state);
    let said: Vec<Value> = history
        .iter()
        .filter_map(|e| match &e.body {
            EventBody::StepSucceeded {
                step_id, output, ..
            } if step_id.starts_with("chat#") => Some(output.clone()),
            _ => None,
        })
        .collect();
    let contents: Vec<&str> = said
        .iter()
        .map(|o| o["content"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        contents,
        [
            FINAL_ANSWER,
            &format!("{REPLY}first"),
            &format!("{REPLY}second"),
            &format!("{REPLY}third"),
            "",
        ],
        "{said:#?}"
    );
    assert_eq!(said[4]["tool_calls"][0]["function"]["name"], STOP_TOOL);
    let taken: Vec<&str> = history
        .iter()
        .filter_map(|e| match &e.body {
            EventBody::SignalReceived { signal_id, .. } => Some(signal_id.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(
        taken,
        ["msg-1", "msg-2", "msg-3", "msg-4"],
        "each message once"
    );

    // What the model saw: the whole conversation until it was longer than two turns,
    // then the system message and the last two turns.
    let requests: Vec<Value> = fake
        .exchanges()
        .into_iter()
        .map(|e| e.request)
        .filter(|r| r["model"] == "fake-agent")
        .collect();
    let last = requests.last().expect("a request");
    let seen = texts(last);
    assert_eq!(seen.first().map(String::as_str), Some("Be brief."));
    assert!(
        seen.iter().any(|t| t == "third") && seen.iter().any(|t| t == "Thanks, goodbye!"),
        "{seen:?}"
    );
    assert!(
        !seen
            .iter()
            .any(|t| t == "first" || t == "Where is order 7?"),
        "older turns are out of the window: {seen:?}"
    );
    let second_turn = requests
        .iter()
        .find(|r| texts(r).iter().any(|t| t == "first"))
        .expect("the second turn's request");
    assert_eq!(
        texts(second_turn),
        ["Be brief.", "Where is order 7?", FINAL_ANSWER, "first"],
        "the second turn continues the first from its transcript"
    );

    // Every call's transcript is a blob of the run; the output refers to it.
    let transcript = &said[4]["transcript"];
    assert!(
        sortie_core::blob::BlobRef::from_value(transcript).is_some(),
        "{transcript}"
    );
    assert!(files_under(&blobs) >= 5, "{} blobs", files_under(&blobs));

    // One close call, saying how it ended.
    let closes: Vec<Value> = ledger
        .snapshot()
        .await
        .calls
        .iter()
        .filter(|c| c.name == "close")
        .map(|c| c.body.clone())
        .collect();
    assert_eq!(closes, [json!({"ended_by": "model", "turns": 5})]);
}
