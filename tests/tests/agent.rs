//! The LLM tool loop end to end against the real broker: `topology/graphs/agent.yaml`'s
//! shape with the scripted fake model (`sortie_devkit::model`) served in this process, the
//! reducer and an executor each their own process. The model calls `lookup_order`, then
//! `refund` (behind an approval), then answers; each call is a step through the normal
//! dispatch path and each result goes back to the model as a `role: tool` message.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use sortie_core::state::InterruptStatus;
use sortie_core::{RunState, RunStatus};
use sortie_devkit::model::{self, FakeModel, FINAL_ANSWER};
use sortie_tests::stack::{command, start_run, Stack};
use sortie_wire::records as w;

const LONG: Duration = Duration::from_secs(60);

fn graph(id: &str, model: &str) -> String {
    format!(
        r#"
id: {id}
version: 1
max_steps: 20
nodes:
  - id: assistant
    tool: llm
    side_effect: pure
    args:
      messages: [{{role: user, content: $input.request}}]
    config: {{base_url: "{model}/v1", model: fake-agent}}
    timeout: 10s
    may_request: [lookup_order, refund]
    tools: [lookup_order, refund]
  - id: lookup_order
    tool: echo
    side_effect: pure
    description: Reads an order.
    args: {{order_id: The order's id.}}
  - id: refund
    tool: echo
    side_effect: keyed
    args: {{order_id: The order's id., amount: {{type: number}}}}
    interrupt_before: {{reason: money moves, required_role: approver, timeout: 1h}}
  - id: summarize
    tool: echo
    side_effect: pure
    args: {{answer: $steps.assistant.output.content}}
edges:
  - {{from: assistant, to: summarize}}
"#
    )
}

/// A stack with the fake model, the `agent` graph (`on_budget_exceeded` when given), a
/// reducer and an executor.
struct Agent {
    fake: Arc<FakeModel>,
    stack: Stack,
    _services: [sortie_tests::stack::Process; 2],
}

async fn agent(name: &str, on_budget_exceeded: Option<&str>) -> Agent {
    let (fake, url) = serve_model().await;
    let stack = Stack::start(name, &[]).await;
    let mut text = graph("agent", &url);
    if let Some(action) = on_budget_exceeded {
        text = text.replace(
            "max_steps: 20\n",
            &format!("max_steps: 20\non_budget_exceeded: {action}\n"),
        );
    }
    stack.publish(&text).await;
    let services = [
        stack.reducer("0"),
        stack.executor_process("executor", &["default"], &[]),
    ];
    Agent {
        fake,
        stack,
        _services: services,
    }
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

async fn decide(stack: &Stack, run_id: &str, approve: bool) -> RunState {
    decide_on(stack, run_id, "refund", approve, None).await
}

/// Waits for an open interrupt of `node` and decides it.
async fn decide_on(
    stack: &Stack,
    run_id: &str,
    node: &str,
    approve: bool,
    payload: Option<Value>,
) -> RunState {
    let states = stack
        .wait_for_states(
            &format!("an approval of {node}"),
            &[run_id.to_owned()],
            LONG,
            |s| s.open_interrupts().any(|i| i.node == node),
        )
        .await;
    let state = states[run_id].clone();
    let interrupt = state
        .open_interrupts()
        .find(|i| i.node == node)
        .expect("open")
        .clone();
    let decision = if approve {
        w::Decision::Approve
    } else {
        w::Decision::Reject
    };
    stack
        .send(&command(
            run_id,
            &format!("decide-{}", interrupt.interrupt_id),
            w::CommandBody::ResumeRun(w::ResumeRun {
                interrupt_id: interrupt.interrupt_id.clone(),
                proposal_hash: interrupt.proposal_hash.clone(),
                decision,
                payload: payload.map(|p| p.to_string()),
                comment: None,
                edited_args: None,
                // The payload is the approver's input (a budget raise), not an edit.
                payload_is_input: true,
            }),
        ))
        .await;
    state
}

fn tool_messages(request: &Value) -> Vec<(String, Value)> {
    request["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            let content = serde_json::from_str(m["content"].as_str().unwrap_or("null"))
                .unwrap_or(Value::Null);
            (m["tool_call_id"].as_str().unwrap_or("").to_owned(), content)
        })
        .collect()
}

/// The fold's side of this is `services/core/tests/tool_loop.rs`, seen red there with the
/// re-invocation leaving the tool messages out of `messages`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_calls_two_tools_one_approved_and_answers() {
    let Agent {
        fake,
        stack,
        _services,
    } = agent("agent-loop", None).await;
    let run_id = "run-agent";
    stack
        .send(&start_run(
            run_id,
            "agent",
            r#"{"request": "refund ord-1"}"#,
        ))
        .await;

    let waiting = decide(&stack, run_id, true).await;
    assert_eq!(waiting.status, RunStatus::WaitingApproval);
    assert!(
        !waiting.steps.contains_key("refund#1"),
        "the refund waits for its approval"
    );
    let states = stack
        .wait_for_states("the run to end", &[run_id.to_owned()], LONG, |s| {
            s.status.is_terminal()
        })
        .await;
    let state = &states[run_id];
    assert_eq!(state.status, RunStatus::Succeeded, "{state:#?}");
    assert_eq!(
        state
            .output
            .as_ref()
            .map(|o| o["summarize"]["answer"].clone()),
        Some(json!(FINAL_ANSWER))
    );
    assert_eq!(
        state.steps["lookup_order#1"].args,
        json!({"order_id": "fake-order_id"})
    );
    assert_eq!(
        state.steps["refund#1"].args,
        json!({"order_id": "fake-order_id", "amount": 1})
    );
    assert_eq!(
        state.interrupts.values().next().map(|i| i.status),
        Some(InterruptStatus::Approved)
    );

    // What the model was asked: tools every time, then each tool's result under the id
    // of the call it answers.
    let exchanges = fake.exchanges();
    assert_eq!(exchanges.len(), 3, "{exchanges:#?}");
    for exchange in &exchanges {
        let names: Vec<&str> = exchange.request["tools"]
            .as_array()
            .expect("tools")
            .iter()
            .filter_map(|t| t["function"]["name"].as_str())
            .collect();
        assert_eq!(names, ["lookup_order", "refund"]);
    }
    assert!(tool_messages(&exchanges[0].request).is_empty());
    let first_call = exchanges[0].message["tool_calls"][0]["id"].clone();
    let second_call = exchanges[1].message["tool_calls"][0]["id"].clone();
    assert_eq!(
        tool_messages(&exchanges[1].request),
        vec![(
            first_call.as_str().unwrap_or_default().to_owned(),
            json!({"order_id": "fake-order_id"})
        )]
    );
    let last = tool_messages(&exchanges[2].request);
    assert_eq!(last.len(), 2, "{last:?}");
    assert_eq!(json!(last[1].0), second_call);
    assert_eq!(last[1].1, json!({"order_id": "fake-order_id", "amount": 1}));

    // Every model call is a recorded step whose output carries the usage it answered.
    for (i, exchange) in exchanges.iter().enumerate() {
        let step = &state.steps[&format!("assistant#{}", i + 1)];
        assert_eq!(
            step.output.as_ref().map(|o| o["usage"].clone()),
            Some(exchange.usage.clone())
        );
    }
    // A replay folds the recorded history and never calls the model.
    let events = stack.events().await;
    let folded = events[run_id]
        .iter()
        .fold(None, sortie_core::evolve)
        .expect("a state");
    assert_eq!(&folded, state);
    assert_eq!(fake.exchanges().len(), 3);
}

/// A rejected tool call does not fail the run (whatever the tool node's `on_reject`): the
/// model gets a tool message saying it was rejected, and decides what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_tool_call_is_told_to_the_model() {
    let Agent {
        fake,
        stack,
        _services,
    } = agent("agent-reject", None).await;
    let run_id = "run-agent-rejected";
    stack
        .send(&start_run(
            run_id,
            "agent",
            r#"{"request": "refund ord-2"}"#,
        ))
        .await;
    decide(&stack, run_id, false).await;
    let states = stack
        .wait_for_states("the run to end", &[run_id.to_owned()], LONG, |s| {
            s.status.is_terminal()
        })
        .await;
    let state = &states[run_id];
    assert_eq!(state.status, RunStatus::Succeeded, "{state:#?}");
    assert!(
        !state.steps.contains_key("refund#1"),
        "the refund never ran"
    );
    let exchanges = fake.exchanges();
    assert_eq!(exchanges.len(), 3, "{exchanges:#?}");
    let told = tool_messages(&exchanges[2].request);
    let refund_call = exchanges[1].message["tool_calls"][0]["id"].clone();
    assert_eq!(json!(told[1].0), refund_call);
    assert_eq!(told[1].1["rejected"], true, "{told:?}");
}

/// A spend budget as run state: the run starts with a 1-token limit, so after the model's
/// first answer the next dispatch would exceed it and the graph says `pause`: a budget
/// interrupt asks to raise it, the approval's payload raises it, and the run goes on to
/// succeed. The usage of every model call is charged to the run, priced per model.
///
/// Seen red: with the approved raise not applied to the limits (evolve), the run asked
/// for a raise again at once and never reached the refund's approval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_pause_is_raised_by_approval_and_the_run_goes_on() {
    let Agent {
        fake,
        stack,
        _services,
    } = agent("agent-budget", Some("pause")).await;
    let run_id = "run-agent-budget";
    let mut start = start_run(run_id, "agent", r#"{"request": "refund ord-3"}"#);
    if let w::CommandBody::StartRun(body) = &mut start.body {
        body.budget = Some(
            json!({
                "limits": {"tokens": 1},
                "prices": {"fake-agent": {"input_per_1k": 1.0, "output_per_1k": 2.0}}
            })
            .to_string(),
        );
    }
    stack.send(&start).await;

    let paused = decide_on(
        &stack,
        run_id,
        "$budget",
        true,
        Some(json!({"raise": {"tokens": 1000000}})),
    )
    .await;
    assert_eq!(paused.status, RunStatus::WaitingApproval);
    assert!(
        !paused.steps.contains_key("lookup_order#1"),
        "the tool call waited for the budget"
    );
    assert_eq!(paused.spend.llm_calls, 1);
    assert!(!paused.steps.contains_key("assistant#2"));

    decide(&stack, run_id, true).await;
    let states = stack
        .wait_for_states("the run to end", &[run_id.to_owned()], LONG, |s| {
            s.status.is_terminal()
        })
        .await;
    let state = &states[run_id];
    assert_eq!(state.status, RunStatus::Succeeded, "{state:#?}");
    assert_eq!(
        state.budget.as_ref().and_then(|b| b.limits.tokens),
        Some(1_000_001)
    );
    let exchanges = fake.exchanges();
    let prompt: u64 = exchanges
        .iter()
        .map(|e| e.usage["prompt_tokens"].as_u64().unwrap_or(0))
        .sum();
    let completion: u64 = exchanges
        .iter()
        .map(|e| e.usage["completion_tokens"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(
        (state.spend.prompt_tokens, state.spend.completion_tokens),
        (prompt, completion)
    );
    assert_eq!(state.spend.llm_calls, 3);
    assert_eq!(state.spend.tool_calls, 2);
    let cost = (prompt as f64 * 1.0 + completion as f64 * 2.0) / 1000.0;
    assert!(
        (state.spend.cost_usd - cost).abs() < 1e-9,
        "{:?}",
        state.spend
    );
}
