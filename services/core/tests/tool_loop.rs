//! The LLM tool loop as the fold decides it: a node with `tools` offers its `may_request`
//! nodes to the model, the model's `tool_calls` become steps of those nodes (each through
//! the normal dispatch path, so an approval gate interrupts), and their outputs go back to
//! the model as `role: tool` messages on the next call, until it answers without tool
//! calls. A rejected call is told to the model, which goes on.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use serde_json::{json, Value};
use sortie_core::budget::{Budget, Limits, Price};
use sortie_core::state::Answer;
use sortie_core::{
    apply, input::Command, CommandBody, Effect, Graph, Graphs, Input, Intent, RunState, RunStatus,
    StepOutcome, StepReport,
};

const GRAPH: &str = r#"
id: agent
version: 1
nodes:
  - id: assistant
    tool: llm
    side_effect: pure
    args:
      messages: [{role: user, content: $input.question}]
    config: {base_url: "http://model/v1", model: fake}
    may_request: [lookup_order, refund]
    tools: [lookup_order, refund]
  - id: lookup_order
    tool: echo
    side_effect: pure
    description: Reads an order.
    args: {order_id: The order's id}
  - id: refund
    tool: echo
    side_effect: keyed
    args: {order_id: {type: string}, amount: {type: number}}
    interrupt_before: {reason: money moves, timeout: 1h}
  - id: done
    tool: echo
    side_effect: pure
    args: {answer: $steps.assistant.output.content}
edges:
  - {from: assistant, to: done}
"#;

struct Run {
    graphs: Graphs,
    state: Option<RunState>,
    intents: Vec<Intent>,
    at: i64,
    /// The roles the next commands carry.
    roles: Vec<String>,
}

impl Run {
    fn start() -> Run {
        Run::start_with(GRAPH, None)
    }

    fn start_with(graph: &str, budget: Option<Budget>) -> Run {
        let mut graphs = Graphs::new();
        graphs.insert(Graph::parse(graph).unwrap()).unwrap();
        let mut run = Run {
            graphs,
            state: None,
            intents: Vec::new(),
            at: 0,
            roles: vec!["operator".into()],
        };
        run.command(CommandBody::StartRun {
            graph_id: "agent".into(),
            graph_version: None,
            input: json!({"question": "refund order 7"}),
            labels: BTreeMap::new(),
            budget,
            fork: None,
            parent: None,
        });
        run
    }

    fn input(&mut self, input: Input) {
        let applied = apply(self.state.as_ref(), &input, &self.graphs);
        for effect in applied.effects {
            if let Effect::Dispatch(intent) = effect {
                self.intents.push(intent);
            }
        }
        self.state = applied.state;
    }

    fn command(&mut self, body: CommandBody) {
        self.at += 1;
        let input = Input::Command(Command {
            command_id: format!("c{}", self.at),
            tenant: "t".into(),
            run_id: "r".into(),
            principal: "alice".into(),
            roles: self.roles.clone(),
            groups: vec![],
            at: self.at,
            body,
        });
        self.input(input);
    }

    /// The one intent not answered yet, which must be for `node`.
    fn next(&mut self, node: &str) -> Intent {
        assert_eq!(self.intents.len(), 1, "{:#?}", self.intents);
        let intent = self.intents.remove(0);
        assert_eq!(intent.node, node, "{intent:#?}");
        intent
    }

    fn succeed(&mut self, intent: &Intent, output: Value) {
        self.at += 1;
        let report = Input::StepReport(StepReport {
            spent: None,
            operation_id: intent.operation_id.clone(),
            attempt: intent.attempt,
            tenant: "t".into(),
            run_id: "r".into(),
            step_id: intent.step_id.clone(),
            outcome: StepOutcome::Succeeded { output },
            at: self.at,
        });
        self.input(report);
    }

    fn decide(&mut self, approve: bool) {
        self.decide_with(approve, None);
    }

    fn decide_with(&mut self, approve: bool, payload: Option<Value>) {
        let state = self.state.as_ref().unwrap();
        let interrupt = state.open_interrupts().next().expect("an open interrupt");
        let body = CommandBody::ResumeRun {
            interrupt_id: interrupt.interrupt_id.clone(),
            proposal_hash: interrupt.proposal_hash.clone(),
            approve,
            payload,
            comment: None,
            edited_args: None,
        };
        self.command(body);
    }

    fn state(&self) -> &RunState {
        self.state.as_ref().unwrap()
    }
}

fn call(id: &str, name: &str, args: Value) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": args.to_string()}})
}

fn model(content: Option<&str>, calls: Vec<Value>) -> Value {
    json!({
        "content": content,
        "tool_calls": calls,
        "usage": {"prompt_tokens": 10, "completion_tokens": 5},
        "model": "fake",
        "finish_reason": if content.is_some() { "stop" } else { "tool_calls" },
    })
}

#[test]
fn tool_calls_become_steps_and_their_outputs_go_back_as_tool_messages() {
    let mut run = Run::start();
    let first = run.next("assistant");
    let tools = first.args["tools"].as_array().expect("tools offered");
    assert_eq!(tools.len(), 2);
    assert_eq!(tools[0]["function"]["name"], "lookup_order");
    assert_eq!(tools[0]["function"]["description"], "Reads an order.");
    assert_eq!(
        tools[0]["function"]["parameters"]["properties"]["order_id"],
        json!({"type": "string", "description": "The order's id"})
    );
    assert_eq!(
        tools[1]["function"]["parameters"]["required"],
        json!(["amount", "order_id"])
    );

    // The model calls tool A; A runs with the model's arguments.
    run.succeed(
        &first,
        model(
            None,
            vec![call("call_a", "lookup_order", json!({"order_id": "7"}))],
        ),
    );
    let lookup = run.next("lookup_order");
    assert_eq!(lookup.args, json!({"order_id": "7"}));
    assert_ne!(lookup.operation_id, first.operation_id);
    run.succeed(&lookup, json!({"order_id": "7", "total": 30}));

    // Called again with the conversation: user, assistant (tool call), tool result.
    let second = run.next("assistant");
    assert_eq!(second.step_id, "assistant#2");
    let messages = second.args["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 3, "{messages:#?}");
    assert_eq!(messages[1]["role"], "assistant");
    assert_eq!(messages[1]["tool_calls"][0]["id"], "call_a");
    assert_eq!(messages[2]["role"], "tool");
    assert_eq!(messages[2]["tool_call_id"], "call_a");
    assert_eq!(
        serde_json::from_str::<Value>(messages[2]["content"].as_str().unwrap()).unwrap(),
        json!({"order_id": "7", "total": 30})
    );
    assert_eq!(second.args["tools"], first.args["tools"]);

    // Tool B is behind an approval: the run waits, nothing is dispatched.
    run.succeed(
        &second,
        model(
            None,
            vec![call(
                "call_b",
                "refund",
                json!({"order_id": "7", "amount": 30}),
            )],
        ),
    );
    assert!(run.intents.is_empty(), "{:#?}", run.intents);
    assert_eq!(run.state().status, RunStatus::WaitingApproval);
    run.decide(true);
    let refund = run.next("refund");
    assert_eq!(refund.args, json!({"order_id": "7", "amount": 30}));
    run.succeed(&refund, json!({"refund_id": "rf_1"}));

    let third = run.next("assistant");
    let messages = third.args["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 5, "{messages:#?}");
    assert_eq!(messages[4]["tool_call_id"], "call_b");

    // A final answer: the graph goes on along the node's edge.
    run.succeed(&third, model(Some("Refunded 30."), vec![]));
    let done = run.next("done");
    assert_eq!(done.args, json!({"answer": "Refunded 30."}));
    run.succeed(&done, json!({"ok": true}));
    assert_eq!(run.state().status, RunStatus::Succeeded);
}

#[test]
fn a_rejected_tool_call_is_told_to_the_model() {
    let mut run = Run::start();
    let first = run.next("assistant");
    run.succeed(
        &first,
        model(
            None,
            vec![call(
                "call_b",
                "refund",
                json!({"order_id": "7", "amount": 30}),
            )],
        ),
    );
    run.decide(false);
    assert_eq!(run.state().status, RunStatus::Running);
    let second = run.next("assistant");
    let messages = second.args["messages"].as_array().unwrap();
    assert_eq!(messages[2]["tool_call_id"], "call_b");
    let told: Value = serde_json::from_str(messages[2]["content"].as_str().unwrap()).unwrap();
    assert_eq!(told["rejected"], true, "{told}");
    assert!(
        !run.state().steps.contains_key("refund#1"),
        "the refund never ran"
    );
    run.succeed(&second, model(Some("I may not refund."), vec![]));
    let done = run.next("done");
    run.succeed(&done, json!({}));
    assert_eq!(run.state().status, RunStatus::Succeeded);
}

#[test]
fn a_call_to_a_tool_the_node_does_not_offer_fails_the_run() {
    let mut run = Run::start();
    let first = run.next("assistant");
    run.succeed(&first, model(None, vec![call("x", "done", json!({}))]));
    assert_eq!(run.state().status, RunStatus::Failed);
}

#[test]
fn a_tool_not_in_may_request_is_refused() {
    let text = GRAPH.replace(
        "may_request: [lookup_order, refund]",
        "may_request: [lookup_order]",
    );
    let error = Graph::parse(&text).unwrap_err().to_string();
    assert!(
        error.contains("must also be listed in may_request"),
        "{error}"
    );
}

// ---------------------------------------------------------------- spend budgets

fn budgeted(on_exceeded: &str, limits: Limits) -> Run {
    budgeted_with(on_exceeded, limits, None)
}

fn budgeted_with(on_exceeded: &str, limits: Limits, ceiling: Option<Limits>) -> Run {
    let graph = GRAPH.replace(
        "version: 1\n",
        &format!("version: 1\non_budget_exceeded: {on_exceeded}\n"),
    );
    let prices = BTreeMap::from([(
        "fake".to_owned(),
        Price {
            input_per_1k: 2.0,
            output_per_1k: 4.0,
        },
    )]);
    Run::start_with(
        &graph,
        Some(Budget {
            limits,
            prices,
            ceiling,
        }),
    )
}

fn tokens(max: u64) -> Limits {
    Limits {
        tokens: Some(max),
        ..Limits::default()
    }
}

#[test]
fn usage_is_charged_to_the_run_with_the_price_table() {
    let mut run = budgeted("fail", Limits::default());
    let first = run.next("assistant");
    run.succeed(&first, model(Some("hi"), vec![]));
    let spend = &run.state().spend;
    assert_eq!((spend.prompt_tokens, spend.completion_tokens), (10, 5));
    // 10 × 2.0 / 1000 + 5 × 4.0 / 1000
    assert!((spend.cost_usd - 0.04).abs() < 1e-9, "{spend:?}");
    assert_eq!(spend.llm_calls, 1);
}

#[test]
fn pause_asks_to_raise_the_budget_and_an_approved_raise_goes_on() {
    let mut run = budgeted("pause", tokens(15));
    let first = run.next("assistant");
    run.succeed(
        &first,
        model(
            None,
            vec![call("call_a", "lookup_order", json!({"order_id": "7"}))],
        ),
    );
    // 15 tokens spent of 15: the tool call is not dispatched, an approver is asked.
    assert!(run.intents.is_empty(), "{:#?}", run.intents);
    let state = run.state();
    assert_eq!(state.status, RunStatus::WaitingApproval);
    let interrupt = state.open_interrupts().next().expect("a budget interrupt");
    assert_eq!(interrupt.node, "$budget");
    assert_eq!(interrupt.proposal["kind"], "budget");
    assert!(interrupt.reason.contains("tokens"), "{}", interrupt.reason);

    // An approval that raises nothing is refused; the interrupt stays open.
    run.decide_with(true, Some(json!({"note": "go"})));
    assert_eq!(run.state().open_interrupts().count(), 1);
    assert!(run.intents.is_empty());
    // So is a raise out of bounds (`Limits::check`): it would saturate the limit or never
    // trip. Seen red: without the check in decide/budget.rs, the u64::MAX raise was
    // accepted and closed the interrupt.
    for raise in [
        json!({"tokens": u64::MAX}),
        json!({"tokens": 10, "cost_usd": -1.0}),
        json!({"wall_time": -1}),
    ] {
        run.decide_with(true, Some(json!({ "raise": raise })));
        assert_eq!(run.state().open_interrupts().count(), 1, "{raise}");
        assert_eq!(
            run.state().budget.as_ref().and_then(|b| b.limits.tokens),
            Some(15)
        );
    }

    run.decide_with(true, Some(json!({"raise": {"tokens": 100}})));
    assert_eq!(
        run.state().budget.as_ref().and_then(|b| b.limits.tokens),
        Some(115)
    );
    let lookup = run.next("lookup_order");
    run.succeed(&lookup, json!({"total": 30}));
    let second = run.next("assistant");
    run.succeed(&second, model(Some("done"), vec![]));
    let done = run.next("done");
    run.succeed(&done, json!({}));
    assert_eq!(run.state().status, RunStatus::Succeeded);
    assert_eq!(run.state().spend.tokens(), 30);
}

/// Issue #57: a budget pause is decided by its role (`access.budget`, default
/// `operator`), from rules 3: a member without it can neither raise the limits nor reject
/// (which fails the run and runs compensations); a run started under rules 2 keeps being
/// decided by anyone. Seen red with the interrupt's `required_role` left `None`: the
/// member's raise went through.
#[test]
fn only_the_budget_role_decides_a_budget_pause() {
    let mut run = budgeted("pause", tokens(15));
    let first = run.next("assistant");
    run.succeed(
        &first,
        model(
            None,
            vec![call("call_a", "lookup_order", json!({"order_id": "7"}))],
        ),
    );
    let interrupt = run.state().open_interrupts().next().unwrap().clone();
    assert_eq!(interrupt.required_role.as_deref(), Some("operator"));
    run.roles = vec!["approver".into()];
    run.decide_with(true, Some(json!({"raise": {"tokens": 1_000_000}})));
    run.decide(false);
    assert_eq!(run.state().open_interrupts().count(), 1, "still open");
    assert_eq!(run.state().status, RunStatus::WaitingApproval);
    assert_eq!(
        run.state().budget.as_ref().and_then(|b| b.limits.tokens),
        Some(15)
    );
    let forbidden = run
        .state()
        .commands
        .values()
        .filter(|a| matches!(a, Answer::Rejected { code, .. } if code == "forbidden"))
        .count();
    assert_eq!(forbidden, 2, "{:#?}", run.state().commands);
    run.roles = vec!["operator".into()];
    run.decide_with(true, Some(json!({"raise": {"tokens": 100}})));
    assert_eq!(run.state().open_interrupts().count(), 0);

    // A run of rules 2 paused: anyone of the tenant decides, as before.
    let mut old = budgeted("pause", tokens(15));
    old.state.as_mut().unwrap().rules = 2;
    let first = old.next("assistant");
    old.succeed(
        &first,
        model(
            None,
            vec![call("call_a", "lookup_order", json!({"order_id": "7"}))],
        ),
    );
    let interrupt = old.state().open_interrupts().next().unwrap().clone();
    assert_eq!(interrupt.required_role, None);
    old.roles = vec![];
    old.decide_with(true, Some(json!({"raise": {"tokens": 100}})));
    assert_eq!(old.state().open_interrupts().count(), 0);
}

/// A tenant's ceiling recorded in the run's budget caps what a raise can reach.
#[test]
fn a_raise_stops_at_the_ceiling() {
    let mut run = budgeted_with("pause", tokens(15), Some(tokens(50)));
    let first = run.next("assistant");
    run.succeed(
        &first,
        model(
            None,
            vec![call("call_a", "lookup_order", json!({"order_id": "7"}))],
        ),
    );
    run.decide_with(true, Some(json!({"raise": {"tokens": 1_000}})));
    assert_eq!(
        run.state().budget.as_ref().and_then(|b| b.limits.tokens),
        Some(50)
    );
}

#[test]
fn a_rejected_raise_fails_the_run() {
    let mut run = budgeted("pause", tokens(1));
    let first = run.next("assistant");
    run.succeed(&first, model(Some("hi"), vec![]));
    assert_eq!(run.state().status, RunStatus::WaitingApproval);
    run.decide(false);
    assert_eq!(run.state().status, RunStatus::Failed);
}

#[test]
fn fail_and_cancel_end_the_run_instead() {
    let mut run = budgeted("fail", tokens(1));
    let first = run.next("assistant");
    run.succeed(&first, model(Some("hi"), vec![]));
    assert!(run.intents.is_empty());
    assert_eq!(run.state().status, RunStatus::Failed);

    let mut run = budgeted("cancel", tokens(1));
    let first = run.next("assistant");
    run.succeed(&first, model(Some("hi"), vec![]));
    assert!(run.intents.is_empty());
    assert_eq!(run.state().status, RunStatus::Cancelled);
    assert!(run.state().ending.as_ref().is_some_and(|e| e.cancelled));
}

#[test]
fn tool_calls_and_wall_time_are_limits_too() {
    let mut run = budgeted(
        "fail",
        Limits {
            tool_calls: Some(1),
            ..Limits::default()
        },
    );
    let first = run.next("assistant");
    run.succeed(
        &first,
        model(
            None,
            vec![
                call("a", "lookup_order", json!({"order_id": "7"})),
                call("b", "lookup_order", json!({"order_id": "8"})),
            ],
        ),
    );
    assert!(run.intents.is_empty());
    assert_eq!(
        run.state().status,
        RunStatus::Failed,
        "two calls, one allowed"
    );

    let mut run = budgeted(
        "fail",
        Limits {
            wall_time: Some(sortie_core::duration::Millis(1)),
            ..Limits::default()
        },
    );
    let first = run.next("assistant");
    run.succeed(&first, model(Some("hi"), vec![]));
    assert_eq!(run.state().status, RunStatus::Failed);
}
