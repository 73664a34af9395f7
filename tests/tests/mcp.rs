//! MCP on real parts: a shop's MCP server of the official Python SDK
//! (`tests/python/mcp_server.py`, in its own venv), the real broker, the reducer and
//! executors as processes, and the scripted fake model speaking the Anthropic Messages
//! API. An agent run offers both of the server's tools (`lookup_order`, safe; `refund`,
//! which moves money): the refund waits for approval; an executor that dies after the
//! server took the refund but before it reported leaves the run waiting for an operator,
//! and the server's own ledger shows one refund call; the tools a version pinned when it
//! was published are what the model is offered after the server changed its list.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use sortie_core::{RunState, RunStatus};
use sortie_devkit::model::{self, FakeModel, FINAL_ANSWER};
use sortie_tests::stack::{command, start_run, Stack};
use sortie_tests::McpServer;
use sortie_wire::records as w;

const LONG: Duration = Duration::from_secs(90);

/// The agent: the model offered every tool of `shop`; `lookup_order` pure on the `llm`
/// queue, `refund` unsafe behind an approval on the `default` queue (so an executor of
/// that queue alone can be made to die at the refund), with a short timeout so a lost
/// attempt is noticed.
fn graph(version: u32, model: &str, server: &str) -> String {
    format!(
        r#"
id: mcp-agent
version: {version}
max_steps: 20
mcp_servers:
  - name: shop
    url: "{server}"
    tools:
      lookup_order: {{side_effect: pure, queue: llm}}
      refund:
        side_effect: unsafe
        timeout: 4s
        interrupt_before: {{reason: money moves, required_role: approver, timeout: 1h}}
nodes:
  - id: assistant
    tool: llm
    queue: llm
    side_effect: pure
    args:
      system: Look the order up before refunding it.
      messages: [{{role: user, content: $input.request}}]
    config: {{api: anthropic, base_url: "{model}/v1", model: fake-agent}}
    timeout: 10s
    mcp: [shop]
  - id: summarize
    tool: echo
    queue: llm
    side_effect: pure
    args: {{answer: $steps.assistant.output.content}}
edges:
  - {{from: assistant, to: summarize}}
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

async fn mcp_server(stack: &Stack) -> McpServer {
    McpServer::start(
        &stack.dir.join("mcp-ledger.jsonl"),
        &stack.dir.join("mcp-server.log"),
    )
    .await
}

fn calls_of<'l>(ledger: &'l [Value], tool: &str) -> Vec<&'l Value> {
    ledger.iter().filter(|e| e["tool"] == tool).collect()
}

async fn wait(
    stack: &Stack,
    run_id: &str,
    what: &str,
    done: impl Fn(&RunState) -> bool,
) -> RunState {
    stack
        .wait_for_states(what, &[run_id.to_owned()], LONG, done)
        .await
        .remove(run_id)
        .expect("the run")
}

/// The money tool waits for its approval; once approved, the executor that calls it dies
/// after the server took the call (`executor.after_call`) and before it could report; its
/// restart calls nothing again: the run waits for an operator, the server's ledger holds
/// one refund, with the step's operation id in `_meta`; the operator records the outcome
/// and the run finishes.
///
/// Seen red, each with the fix reverted once:
/// - the approval gate: with `mcp::tool_node` dropping the declared `interrupt_before`,
///   the refund was dispatched as soon as the model asked ("the refund was dispatched
///   before its approval");
/// - no second call: with the executor treating `unsafe` like `keyed` (its intent offset
///   committed after the result, not before the call), the restarted executor got the
///   intent again and called the server a second time ("a second refund of one operation
///   after the crash": 2 refunds in the server's ledger).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_refund_waits_for_approval_and_a_crash_mid_call_calls_it_once() {
    let (fake, model_url) = serve_model().await;
    let stack = Stack::start("mcp-agent", &[]).await;
    let server = mcp_server(&stack).await;
    stack.publish(&graph(1, &model_url, &server.url)).await;
    let _reducer = stack.reducer("0");
    let _llm = stack.executor_process("executor-llm", &["llm"], &[]);
    let mut money = stack.executor_process(
        "executor-money",
        &["default"],
        &["--fault", "executor.after_call"],
    );
    let run_id = "run-mcp";
    stack
        .send(&start_run(
            run_id,
            "mcp-agent",
            r#"{"request": "refund order 7"}"#,
        ))
        .await;

    // The gate: the model asked for the refund; nothing moved yet.
    let waiting = wait(&stack, run_id, "the refund's approval (or its step)", |s| {
        s.open_interrupts().any(|i| i.node == "refund") || s.steps.contains_key("refund#1")
    })
    .await;
    assert!(
        !waiting.steps.contains_key("refund#1"),
        "the refund was dispatched before its approval: {waiting:#?}"
    );
    let ledger = server.ledger().await;
    assert!(
        calls_of(&ledger, "refund").is_empty(),
        "a refund before its approval: {ledger:#?}"
    );
    let lookups = calls_of(&ledger, "lookup_order");
    assert_eq!(lookups.len(), 1, "{ledger:#?}");
    assert_eq!(
        lookups[0]["operation_id"].as_str(),
        Some(waiting.steps["lookup_order#1"].operation_id.as_str()),
        "the operation id travels in _meta"
    );
    assert_eq!(lookups[0]["run_id"], run_id);
    let interrupt = waiting
        .open_interrupts()
        .find(|i| i.node == "refund")
        .expect("open")
        .clone();
    assert_eq!(interrupt.proposal["tool"], "mcp");
    stack
        .send(&command(
            run_id,
            "approve-refund",
            w::CommandBody::ResumeRun(w::ResumeRun {
                interrupt_id: interrupt.interrupt_id.clone(),
                proposal_hash: interrupt.proposal_hash.clone(),
                decision: w::Decision::Approve,
                payload: None,
                comment: None,
                edited_args: None,
                payload_is_input: true,
            }),
        ))
        .await;

    // The executor dies right after the server answered the refund.
    let status = money
        .wait_exit(LONG)
        .await
        .expect("the executor dies at the fault");
    assert!(!status.success());
    let _money = stack.executor_process("executor-money-2", &["default"], &[]);
    // Waits for the refund to be settled one way or another, so that a second call shows
    // in the server's ledger before anything else is asserted.
    let state = wait(
        &stack,
        run_id,
        "the refund settled or left to an operator",
        |s| {
            s.status == RunStatus::NeedsReconciliation
                || s.steps
                    .get("refund#1")
                    .is_some_and(|r| r.status.is_settled())
        },
    )
    .await;
    let op = state.steps["refund#1"].operation_id.clone();
    let refunds: Vec<Value> = calls_of(&server.ledger().await, "refund")
        .into_iter()
        .cloned()
        .collect();
    assert_eq!(refunds.len(), 1, "one refund on the server: {refunds:#?}");
    assert_eq!(refunds[0]["operation_id"].as_str(), Some(op.as_str()));
    assert_eq!(state.status, RunStatus::NeedsReconciliation, "{state:#?}");
    assert_eq!(
        state.steps["refund#1"].attempt, 1,
        "unsafe is never dispatched again"
    );

    // The operator reads the server's ledger and records the outcome.
    stack
        .send(&command(
            run_id,
            "reconcile-refund",
            w::CommandBody::ReconcileOperation(w::ReconcileOperation {
                operation_id: op.clone(),
                outcome: w::ReconcileOutcome::Succeeded,
                output: Some(
                    json!({"content": [{"type": "text", "text": "Refunded 1 on order fake-order_id."}]})
                        .to_string(),
                ),
                error: None,
            }),
        ))
        .await;
    let state = wait(&stack, run_id, "the run to end", |s| s.status.is_terminal()).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{state:#?}");
    assert_eq!(
        state
            .output
            .as_ref()
            .map(|o| o["summarize"]["answer"].clone()),
        Some(json!(FINAL_ANSWER))
    );
    // After the run ended too: no executor took the intent again later.
    let refunds = calls_of(&server.ledger().await, "refund").len();
    assert_eq!(
        refunds, 1,
        "a second refund of one operation after the crash"
    );

    // The model saw the tool results as tool_result blocks, in the Anthropic format.
    let exchanges = fake.exchanges();
    assert_eq!(exchanges.len(), 3, "{exchanges:#?}");
    let second = exchanges[1].request["messages"]
        .as_array()
        .expect("messages");
    assert_eq!(second[2]["content"][0]["type"], "tool_result");
    assert_eq!(
        second[2]["content"][0]["content"],
        "Order fake-order_id: delivered, total 30.00 EUR."
    );
    // Usage in input/output tokens is charged as prompt/completion tokens.
    assert_eq!(state.spend.llm_calls, 3);
    assert_eq!(
        state.spend.completion_tokens,
        3 * sortie_devkit::model::COMPLETION_TOKENS
    );
}

/// A version pins the tools its server listed when it was published: after the server
/// changes its list (a new tool, another description), a run of that version offers the
/// model exactly the pinned tools; re-publishing the pinned definition reads nothing and
/// changes nothing; publishing the graph file again under the same version is refused
/// (a changed server is a new version), and under a new version pins the new list.
///
/// Seen red with the fix reverted once: with `sortie_catalog::pin` listing the tools of
/// a server that is already pinned again, re-publishing the pinned version read the
/// changed list and was refused as a different definition of version 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pinned_tool_list_survives_the_server_changing_its_tools() {
    let (fake, model_url) = serve_model().await;
    let stack = Stack::start("mcp-pinned", &[]).await;
    let server = mcp_server(&stack).await;
    let source = graph(1, &model_url, &server.url);
    let published = sortie_catalog::pin(&sortie_core::Graph::parse(&source).expect("valid"))
        .await
        .expect("pinned");
    stack.publish(&source).await;
    let pinned = published.mcp_servers[0].pinned.clone().expect("pinned");
    let names: Vec<&str> = pinned.tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["lookup_order", "refund"]);
    assert_eq!(pinned.hash, sortie_core::mcp::pinned_hash(&pinned.tools));

    server.change_tools().await;

    // Re-publishing what was published (as `sortie dev` does at every start) asks the
    // server nothing: the same definition, already published.
    let again = sortie_catalog::publish(
        &stack.kafka,
        &stack.codec,
        &stack.topics,
        &published,
        "test",
        sortie_tests::stack::now_ms(),
    )
    .await
    .expect("the pinned definition publishes as it is");
    assert_eq!(again, sortie_catalog::Published::AlreadyPublished);
    // The file again, same version: the server's new list makes another definition.
    let graph = sortie_core::Graph::parse(&source).expect("valid");
    let refused = sortie_catalog::publish(
        &stack.kafka,
        &stack.codec,
        &stack.topics,
        &graph,
        "test",
        sortie_tests::stack::now_ms(),
    )
    .await
    .expect_err("a changed server is a new version");
    assert!(
        matches!(refused, sortie_catalog::Error::VersionExists { .. }),
        "{refused}"
    );

    let _reducer = stack.reducer("0");
    let _executor = stack.executor_process("executor", &["llm", "default"], &[]);
    let run_id = "run-pinned";
    stack
        .send(&start_run(
            run_id,
            "mcp-agent",
            r#"{"request": "refund order 7"}"#,
        ))
        .await;
    wait(&stack, run_id, "the refund's approval", |s| {
        s.open_interrupts().any(|i| i.node == "refund")
    })
    .await;
    for exchange in fake.exchanges() {
        let offered = exchange.request["tools"].as_array().expect("tools").clone();
        let names: Vec<&str> = offered.iter().filter_map(|t| t["name"].as_str()).collect();
        assert_eq!(
            names,
            ["lookup_order", "refund"],
            "the pinned tools, not the server's new list"
        );
        assert_eq!(
            offered[1]["description"],
            json!(pinned.tools[1].description),
            "the pinned description"
        );
        assert_eq!(offered[1]["input_schema"], pinned.tools[1].input_schema);
    }

    // A new version reads the new list.
    let v2 = sortie_catalog::pin(&sortie_core::Graph::parse(&graph_v(2, &source)).expect("valid"))
        .await
        .expect("pinned");
    let names: Vec<String> = v2.mcp_servers[0]
        .pinned
        .as_ref()
        .expect("pinned")
        .tools
        .iter()
        .map(|t| t.name.clone())
        .collect();
    assert!(names.contains(&"close_account".to_owned()), "{names:?}");
}

fn graph_v(version: u32, source: &str) -> String {
    source.replace("version: 1\n", &format!("version: {version}\n"))
}
