//! MCP servers in the fold: a node offers a server's pinned tools to its model (here on
//! the Anthropic Messages API); each tool call is a step of the tool's derived node
//! (tool `mcp`, the declared class, `unsafe` when undeclared, the declared approval),
//! dispatched with the server's url and auth *reference* in its config; results go back
//! as `tool_result` blocks. What the model is offered is the pinned list, never anything
//! read later.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use serde_json::{json, Value};
use sortie_core::mcp::{Pinned, PinnedTool};
use sortie_core::{
    apply, input::Command, CommandBody, Effect, Graph, Graphs, Input, Intent, RunState, RunStatus,
    SideEffect, StepOutcome, StepReport,
};

const GRAPH: &str = r#"
id: agent
version: 1
mcp_servers:
  - name: shop
    url: http://shop.example/mcp
    auth: {header: Authorization, scheme: Bearer, env: SORTIE_SECRET_t__SHOP_TOKEN}
    tools:
      lookup_order: {side_effect: pure}
      refund:
        side_effect: unsafe
        interrupt_before: {reason: money moves, timeout: 1h}
nodes:
  - id: assistant
    tool: llm
    side_effect: pure
    args:
      system: Be brief.
      messages: [{role: user, content: $input.question}]
    config: {api: anthropic, base_url: "http://model/v1", model: fake}
    mcp: [shop]
  - id: done
    tool: echo
    side_effect: pure
    args: {answer: $steps.assistant.output.content}
edges:
  - {from: assistant, to: done}
"#;

fn listed() -> Vec<PinnedTool> {
    let tool = |name: &str, schema: Value| PinnedTool {
        name: name.into(),
        description: Some(format!("The {name} tool.")),
        input_schema: schema,
    };
    vec![
        tool(
            "lookup_order",
            json!({"type": "object", "properties": {"order_id": {"type": "string"}}}),
        ),
        tool(
            "refund",
            json!({"type": "object", "properties": {"order_id": {"type": "string"}, "amount": {"type": "number"}}}),
        ),
        tool("ping.v2", json!({"type": "object"})),
    ]
}

fn pinned(text: &str, tools: Vec<PinnedTool>) -> Graph {
    Graph::parse(text)
        .unwrap()
        .with_pinned("shop", Pinned::new(tools))
        .unwrap()
}

struct Run {
    graphs: Graphs,
    state: Option<RunState>,
    intents: Vec<Intent>,
    events: Vec<sortie_core::Event>,
    at: i64,
}

impl Run {
    fn start(graph: Graph) -> Run {
        let mut graphs = Graphs::new();
        graphs.insert(graph).unwrap();
        let mut run = Run {
            graphs,
            state: None,
            intents: Vec::new(),
            events: Vec::new(),
            at: 0,
        };
        run.command(CommandBody::StartRun {
            graph_id: "agent".into(),
            graph_version: None,
            input: json!({"question": "refund order 7"}),
            labels: BTreeMap::new(),
            budget: None,
            fork: None,
            parent: None,
        });
        run
    }

    fn input(&mut self, input: Input) {
        let applied = apply(self.state.as_ref(), &input, &self.graphs);
        for effect in applied.effects {
            match effect {
                Effect::Dispatch(intent) => self.intents.push(intent),
                Effect::Emit(event) if event.seq > 0 => self.events.push(event),
                _ => {}
            }
        }
        self.state = applied.state;
    }

    fn command(&mut self, body: CommandBody) {
        self.at += 1;
        self.input(Input::Command(Command {
            command_id: format!("c{}", self.at),
            tenant: "t".into(),
            run_id: "r".into(),
            principal: "alice".into(),
            roles: vec![],
            groups: vec![],
            at: self.at,
            body,
        }));
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

    fn approve(&mut self) {
        let state = self.state.as_ref().unwrap();
        let interrupt = state.open_interrupts().next().expect("an open interrupt");
        let body = CommandBody::ResumeRun {
            interrupt_id: interrupt.interrupt_id.clone(),
            proposal_hash: interrupt.proposal_hash.clone(),
            approve: true,
            payload: None,
            comment: None,
            edited_args: None,
        };
        self.command(body);
    }

    fn state(&self) -> &RunState {
        self.state.as_ref().unwrap()
    }
}

/// An Anthropic answer as the `llm` handler records it.
fn answer(text: &str, calls: &[(&str, &str, Value)]) -> Value {
    let mut blocks = vec![json!({"type": "text", "text": text})];
    let mut tool_calls = Vec::new();
    for (id, name, input) in calls {
        blocks.push(json!({"type": "tool_use", "id": id, "name": name, "input": input}));
        tool_calls.push(
            json!({"id": id, "type": "function", "function": {"name": name, "arguments": input}}),
        );
    }
    json!({
        "content": text,
        "tool_calls": tool_calls,
        "blocks": blocks,
        "usage": {"input_tokens": 10, "output_tokens": 5, "prompt_tokens": 10, "completion_tokens": 5},
        "model": "fake",
        "finish_reason": if calls.is_empty() { "end_turn" } else { "tool_use" },
    })
}

fn mcp_result(text: &str) -> Value {
    json!({"content": [{"type": "text", "text": text}], "structuredContent": {"text": text}})
}

#[test]
fn an_anthropic_agent_calls_pinned_mcp_tools_as_steps_and_the_money_tool_waits() {
    let mut run = Run::start(pinned(GRAPH, listed()));
    let first = run.next("assistant");
    // Offered: the pinned tools, Anthropic-shaped, the schemas as the server listed them;
    // a name outside [A-Za-z0-9_-] is made a node id.
    let tools = first.args["tools"].as_array().unwrap();
    let names: Vec<_> = tools.iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["lookup_order", "refund", "ping_v2"]);
    assert_eq!(tools[1]["input_schema"], listed()[1].input_schema);
    assert_eq!(tools[1]["description"], "The refund tool.");
    assert_eq!(first.args["system"], "Be brief.");

    run.succeed(
        &first,
        answer(
            "Let me look.",
            &[("toolu_1", "lookup_order", json!({"order_id": "7"}))],
        ),
    );
    let lookup = run.next("lookup_order");
    assert_eq!(lookup.tool, "mcp");
    assert_eq!(lookup.side_effect, SideEffect::Pure);
    assert_eq!(lookup.args, json!({"order_id": "7"}));
    assert_eq!(
        lookup.config,
        json!({"server": "shop", "tool": "lookup_order", "url": "http://shop.example/mcp",
               "auth": {"header": "Authorization", "scheme": "Bearer", "env": "SORTIE_SECRET_t__SHOP_TOKEN"}}),
        "the secret's name travels, never the secret"
    );
    run.succeed(&lookup, mcp_result("Order 7: 30 EUR."));

    let second = run.next("assistant");
    let messages = second.args["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 3, "{messages:#?}");
    assert_eq!(messages[1]["role"], "assistant");
    assert_eq!(messages[1]["content"][1]["type"], "tool_use");
    assert_eq!(messages[1]["content"][1]["id"], "toolu_1");
    assert_eq!(
        messages[2],
        json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Order 7: 30 EUR."}]})
    );

    // The money tool is gated: nothing is dispatched before the approval.
    run.succeed(
        &second,
        answer(
            "Refunding.",
            &[("toolu_2", "refund", json!({"order_id": "7", "amount": 30}))],
        ),
    );
    assert!(run.intents.is_empty(), "{:#?}", run.intents);
    assert_eq!(run.state().status, RunStatus::WaitingApproval);
    let interrupt = run.state().open_interrupts().next().unwrap().clone();
    assert_eq!(interrupt.node, "refund");
    assert_eq!(
        interrupt.context.as_ref().unwrap()["rationale"],
        "Refunding.",
        "the approver sees the model's message"
    );
    run.approve();
    let refund = run.next("refund");
    assert_eq!(refund.tool, "mcp");
    assert_eq!(refund.side_effect, SideEffect::Unsafe);
    run.succeed(&refund, mcp_result("Refunded 30."));

    let third = run.next("assistant");
    assert_eq!(third.args["messages"].as_array().unwrap().len(), 5);
    run.succeed(&third, answer("Done.", &[]));
    let done = run.next("done");
    assert_eq!(done.args, json!({"answer": "Done."}));
    run.succeed(&done, json!({}));
    assert_eq!(run.state().status, RunStatus::Succeeded);
    assert_eq!(
        run.state().spend.prompt_tokens,
        30,
        "Anthropic usage is charged"
    );

    // The conversation as people read it, in order.
    let entries = sortie_core::conversation::of(&run.events);
    let kinds: Vec<String> = entries
        .iter()
        .map(|e| {
            let v = serde_json::to_value(e).unwrap();
            match v["kind"].as_str().unwrap() {
                "message" => format!("message {}", v["role"].as_str().unwrap()),
                "approval" => format!(
                    "approval {} {}",
                    v["tool"].as_str().unwrap(),
                    v["state"].as_str().unwrap()
                ),
                "tool_result" => format!(
                    "result {} {}",
                    v["tool"].as_str().unwrap(),
                    v["text"].as_str().unwrap()
                ),
                "model" => format!("model {}", v["text"].as_str().unwrap_or("")),
                other => other.to_owned(),
            }
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "message system",
            "message user",
            "model Let me look.",
            "result lookup_order Order 7: 30 EUR.",
            "model Refunding.",
            "approval refund requested",
            "approval refund approved",
            "result refund Refunded 30.",
            "model Done.",
        ]
    );
    let approved = serde_json::to_value(&entries[6]).unwrap();
    assert_eq!(approved["call_id"], "toolu_2");
    assert_eq!(approved["by"], "alice");
    // The model message that asked for the approved call, as the inbox shows it.
    let interrupt = run.state().interrupts.values().next().unwrap().clone();
    let asking = sortie_core::conversation::asking_message(
        run.state(),
        &interrupt.role,
        &interrupt.node,
        &interrupt.step_id,
    )
    .unwrap();
    assert_eq!(asking["text"], "Refunding.");
    assert_eq!(asking["tool_call"]["id"], "toolu_2");
    assert_eq!(asking["tool_call"]["arguments"]["amount"], 30);
}

impl Run {
    fn report(&mut self, intent: &Intent, outcome: StepOutcome) {
        self.at += 1;
        self.input(Input::StepReport(StepReport {
            spent: None,
            operation_id: intent.operation_id.clone(),
            attempt: intent.attempt,
            tenant: "t".into(),
            run_id: "r".into(),
            step_id: intent.step_id.clone(),
            outcome,
            at: self.at,
        }));
    }

    /// Fires every timer due by `at` (a retry's backoff), as the reducer would.
    fn fire_timers(&mut self) {
        self.at += 3_600_000;
        let due: Vec<String> = self.state().timers.keys().cloned().collect();
        for key in due {
            let Some(timer) = sortie_core::TimerKey::decode(&key) else {
                continue;
            };
            self.input(Input::TimerFired {
                run_id: "r".into(),
                timer,
                at: self.at,
            });
        }
    }
}

/// An MCP tool's step follows its declared retry policy and class: a `pure` tool whose
/// outcome is unknown is called again (the same operation id, attempt 2) after its
/// backoff, a retryable failure likewise; the `unsafe` refund whose outcome is unknown
/// (the executor's `mcp_no_answer`) is never called again: an operator decides.
#[test]
fn an_mcp_tools_class_and_retries_decide_what_a_lost_answer_does() {
    let text = GRAPH.replace(
        "lookup_order: {side_effect: pure}",
        "lookup_order: {side_effect: pure, retry: {max_attempts: 3, initial_backoff: 1s, max_backoff: 1s, multiplier: 1, jitter: 0}}",
    );
    let mut run = Run::start(pinned(&text, listed()));
    let first = run.next("assistant");
    run.succeed(
        &first,
        answer(
            "Look.",
            &[("toolu_1", "lookup_order", json!({"order_id": "7"}))],
        ),
    );
    let lookup = run.next("lookup_order");
    run.report(
        &lookup,
        StepOutcome::Unknown {
            code: "mcp_no_answer".into(),
            message: "sent, no answer".into(),
        },
    );
    run.fire_timers();
    let again = run.next("lookup_order");
    assert_eq!(
        (again.attempt, &again.operation_id),
        (2, &lookup.operation_id)
    );
    run.report(
        &again,
        StepOutcome::Failed {
            retryable: true,
            code: "mcp_busy".into(),
            message: "503".into(),
            retry_after_ms: None,
        },
    );
    run.fire_timers();
    let third = run.next("lookup_order");
    assert_eq!(third.attempt, 3);
    run.succeed(&third, mcp_result("Order 7."));

    let second = run.next("assistant");
    run.succeed(
        &second,
        answer(
            "Refund.",
            &[("toolu_2", "refund", json!({"order_id": "7", "amount": 1}))],
        ),
    );
    run.approve();
    let refund = run.next("refund");
    run.report(
        &refund,
        StepOutcome::Unknown {
            code: "mcp_no_answer".into(),
            message: "sent, no answer".into(),
        },
    );
    run.fire_timers();
    assert!(
        run.intents.is_empty(),
        "never called again: {:#?}",
        run.intents
    );
    assert_eq!(run.state().status, RunStatus::NeedsReconciliation);
}

#[test]
fn an_undeclared_tool_is_unsafe_and_a_subset_offers_only_its_tools() {
    let text = GRAPH.replace(
        "mcp: [shop]",
        "mcp: [{server: shop, tools: [ping.v2, lookup_order]}]",
    );
    let graph = pinned(&text, listed());
    let ping = graph.node("ping_v2").unwrap();
    assert_eq!(ping.side_effect, SideEffect::Unsafe);
    assert!(ping.interrupt_before.is_none());
    let offered = graph.offers(graph.node("assistant").unwrap());
    assert_eq!(offered, ["ping_v2", "lookup_order"]);
    assert!(
        graph.node("refund").is_none(),
        "a tool no node offers is no node"
    );
    let mut run = Run::start(graph);
    let first = run.next("assistant");
    assert_eq!(first.args["tools"].as_array().unwrap().len(), 2);
    // A call of a tool the node does not offer fails the run, as for any node.
    run.succeed(&first, answer("x", &[("t", "refund", json!({}))]));
    assert_eq!(run.state().status, RunStatus::Failed);
}

#[test]
fn the_pinned_list_is_part_of_the_definition_and_a_changed_one_is_another_version() {
    let first = pinned(GRAPH, listed());
    let again = pinned(GRAPH, listed());
    assert_eq!(first.canonical_json(), again.canonical_json());
    // Read back from its canonical JSON (what the graphs topic holds), it is the same
    // graph: the tool nodes derived again, nothing asked of the server.
    let read_back = Graph::parse(&first.canonical_json()).unwrap();
    assert_eq!(read_back, first);
    assert_eq!(read_back.node("refund").unwrap().tool, "mcp");
    assert!(read_back.unpinned_mcp_servers().is_empty());

    let mut changed = listed();
    changed[1].description = Some("Refunds, now with a fee.".into());
    let changed = pinned(GRAPH, changed);
    assert_ne!(changed.canonical_json(), first.canonical_json());
    let mut graphs = Graphs::new();
    graphs.insert(first).unwrap();
    assert!(
        graphs.insert(changed).is_err(),
        "a changed server is a new graph version"
    );

    // A pinned list edited by hand does not match its hash: refused.
    let tampered = read_back
        .canonical_json()
        .replace("The refund tool.", "Refund anything.");
    let error = Graph::parse(&tampered).unwrap_err().to_string();
    assert!(error.contains("pinned.hash"), "{error}");
    // Unpinned, the server's tools are not offered yet: publishing pins them.
    assert_eq!(
        Graph::parse(GRAPH).unwrap().unpinned_mcp_servers(),
        ["shop"]
    );
}

#[test]
fn mcp_graphs_are_checked_where_they_are_defined() {
    let problems = |text: &str, tools: Vec<PinnedTool>| -> String {
        match Graph::parse(text).and_then(|g| g.with_pinned("shop", Pinned::new(tools))) {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        }
    };
    let text = GRAPH.replace("mcp: [shop]", "mcp: [warehouse]");
    assert!(
        problems(&text, listed()).contains("does not declare"),
        "{}",
        problems(&text, listed())
    );
    // A tool named like a node of the graph.
    let mut clash = listed();
    clash[2].name = "done".into();
    assert!(problems(GRAPH, clash).contains("prefix"));
    // A schema that is not an object, a description over its bound.
    let mut bad = listed();
    bad[0].input_schema = json!("nope");
    bad[1].description = Some("x".repeat(sortie_core::mcp::MAX_TOOL_DESCRIPTION_BYTES + 1));
    let found = problems(GRAPH, bad);
    assert!(
        found.contains("not an object") && found.contains("description"),
        "{found}"
    );
    // A schema nested past the payload shape's depth (sortie_core::limits::check_shape).
    let mut deep = listed();
    let mut schema = json!({"type": "object"});
    for _ in 0..sortie_core::limits::MAX_DEPTH + 1 {
        schema = json!({"type": "object", "properties": {"x": schema}});
    }
    deep[0].input_schema = schema;
    let found = problems(GRAPH, deep);
    assert!(found.contains("(limit depth)"), "{found}");
    // Too many tools.
    let mut many = listed();
    many.extend((0..sortie_core::mcp::MAX_PINNED_TOOLS).map(|i| PinnedTool {
        name: format!("t{i}"),
        description: None,
        input_schema: json!({"type": "object"}),
    }));
    assert!(problems(GRAPH, many).contains("at most 128"));
    // A secret in the graph is not a thing: auth names an environment variable.
    let secret = GRAPH.replace(
        "env: SORTIE_SECRET_t__SHOP_TOKEN",
        "env: \"Bearer abc.def\"",
    );
    assert!(problems(&secret, listed()).contains("auth.env"));
    // Only a secret variable: never the executor's own (HOME, a cloud key).
    let home = GRAPH.replace("env: SORTIE_SECRET_t__SHOP_TOKEN", "env: HOME");
    assert!(problems(&home, listed()).contains("SORTIE_SECRET_"));
    // A plain mcp node names a declared server and a tool, and nothing else.
    let plain = GRAPH.replace(
        "  - id: done\n",
        "  - id: check\n    tool: mcp\n    side_effect: pure\n    config: {server: shop, tool: lookup_order, url: http://elsewhere}\n  - id: done\n",
    );
    assert!(problems(&plain, listed()).contains("config.url"));
    let api = GRAPH.replace("api: anthropic", "api: gemini");
    assert!(problems(&api, listed()).contains("config.api"));
}

/// The same server offered on the OpenAI API: functions with the pinned schemas as their
/// parameters, and each MCP result's text as the `role: tool` message.
#[test]
fn on_the_openai_api_mcp_tools_are_functions_and_results_tool_messages() {
    let text = GRAPH
        .replace("config: {api: anthropic, ", "config: {")
        .replace("      system: Be brief.\n", "");
    let mut run = Run::start(pinned(&text, listed()));
    let first = run.next("assistant");
    let tools = first.args["tools"].as_array().unwrap();
    assert_eq!(tools[0]["type"], "function");
    assert_eq!(tools[0]["function"]["name"], "lookup_order");
    assert_eq!(tools[0]["function"]["parameters"], listed()[0].input_schema);
    run.succeed(
        &first,
        json!({
            "content": null,
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "lookup_order", "arguments": "{\"order_id\":\"7\"}"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1},
            "model": "fake",
        }),
    );
    let lookup = run.next("lookup_order");
    assert_eq!(lookup.tool, "mcp");
    run.succeed(&lookup, mcp_result("Order 7: 30 EUR."));
    let second = run.next("assistant");
    let messages = second.args["messages"].as_array().unwrap();
    assert_eq!(
        messages[2],
        json!({"role": "tool", "tool_call_id": "call_1", "content": "Order 7: 30 EUR."})
    );
}
