//! Approvals people can judge (issue #15 items 3 and 8): the interrupt carries the agent's
//! rationale, what the step affects and what a rejection does; the decision's payload is
//! human input delivered to the node (`$interrupt.payload`), edited arguments are their own
//! field; a precheck re-reads the business state after approval; a members-only gate takes
//! decisions only from its group (the escalated one after an escalation), and a quorum
//! counts distinct principals.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use serde_json::{json, Value};
use sortie_core::{
    apply, evolve, input::Command, CommandBody, Effect, Event, EventBody, Graph, Graphs, Input,
    RunState, RunStatus, StepOutcome, StepReport, TimerKey,
};

/// One run driven input by input; every applied input is checked to be event-sourced
/// (re-folding the whole history gives the same state).
struct Run {
    graphs: Graphs,
    state: Option<RunState>,
    history: Vec<Event>,
    at: i64,
    n: usize,
}

struct Who<'a> {
    principal: &'a str,
    roles: &'a [&'a str],
    groups: &'a [&'a str],
}

const ALICE: Who = Who {
    principal: "user:alice",
    roles: &["approver"],
    groups: &["finance"],
};
const BOB: Who = Who {
    principal: "user:bob",
    roles: &["approver"],
    groups: &["finance"],
};
const MALLORY: Who = Who {
    principal: "user:mallory",
    roles: &["approver"],
    groups: &["sales"],
};
const CFO: Who = Who {
    principal: "user:cfo",
    roles: &["approver"],
    groups: &["cfo"],
};

impl Run {
    fn start(graph: &str, input: Value) -> (Run, Vec<Event>) {
        let mut graphs = Graphs::new();
        graphs.insert(Graph::parse(graph).unwrap()).unwrap();
        let mut run = Run {
            graphs,
            state: None,
            history: Vec::new(),
            at: 0,
            n: 0,
        };
        let id = graph
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("id: "))
            .unwrap()
            .to_owned();
        let events = run.command(
            &ALICE,
            CommandBody::StartRun {
                graph_id: id,
                graph_version: None,
                input,
                labels: BTreeMap::new(),
                fork: None,
                parent: None,
                budget: None,
            },
        );
        (run, events)
    }

    fn state(&self) -> &RunState {
        self.state.as_ref().unwrap()
    }

    fn feed(&mut self, input: Input) -> Vec<Event> {
        let applied = apply(self.state.as_ref(), &input, &self.graphs);
        let events: Vec<Event> = applied
            .effects
            .iter()
            .filter_map(|e| match e {
                Effect::Emit(event) if event.seq > 0 => Some(event.clone()),
                _ => None,
            })
            .collect();
        self.history.extend(events.iter().cloned());
        self.state = applied.state;
        let refolded = self.history.iter().fold(None, evolve);
        assert_eq!(refolded.as_ref(), self.state.as_ref(), "event-sourced");
        events
    }

    fn command(&mut self, who: &Who, body: CommandBody) -> Vec<Event> {
        self.at += 10;
        self.n += 1;
        let input = Input::Command(Command {
            command_id: format!("cmd-{}", self.n),
            tenant: "acme".into(),
            run_id: "run_1".into(),
            principal: who.principal.into(),
            roles: who.roles.iter().map(|r| (*r).to_owned()).collect(),
            groups: who.groups.iter().map(|g| (*g).to_owned()).collect(),
            at: self.at,
            body,
        });
        self.feed(input)
    }

    fn decide(
        &mut self,
        who: &Who,
        node: &str,
        approve: bool,
        payload: Option<Value>,
        edited_args: Option<Value>,
    ) -> Vec<Event> {
        let interrupt = self
            .state()
            .open_interrupts()
            .find(|i| i.node == node)
            .unwrap()
            .clone();
        self.command(
            who,
            CommandBody::ResumeRun {
                interrupt_id: interrupt.interrupt_id,
                proposal_hash: interrupt.proposal_hash,
                approve,
                payload,
                comment: None,
                edited_args,
            },
        )
    }

    fn succeed(&mut self, step: &str, output: Value) -> Vec<Event> {
        self.at += 10;
        let s = self.state().steps[step].clone();
        self.feed(Input::StepReport(StepReport {
            spent: None,
            operation_id: s.operation_id.clone(),
            attempt: s.attempt,
            tenant: "acme".into(),
            run_id: "run_1".into(),
            step_id: step.into(),
            outcome: StepOutcome::Succeeded { output },
            at: self.at,
        }))
    }

    fn fail(&mut self, step: &str) -> Vec<Event> {
        self.at += 10;
        let s = self.state().steps[step].clone();
        self.feed(Input::StepReport(StepReport {
            spent: None,
            operation_id: s.operation_id.clone(),
            attempt: s.attempt,
            tenant: "acme".into(),
            run_id: "run_1".into(),
            step_id: step.into(),
            outcome: StepOutcome::Failed {
                retryable: false,
                code: "http_404".into(),
                message: "order not found".into(),
                retry_after_ms: None,
            },
            at: self.at,
        }))
    }

    fn fire(&mut self, at: i64, timer: TimerKey) -> Vec<Event> {
        self.at = at;
        self.feed(Input::TimerFired {
            run_id: "run_1".into(),
            timer,
            at,
        })
    }
}

fn names(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .map(|e| match &e.body {
            EventBody::CommandRejected { code, .. } => format!("CommandRejected {code}"),
            EventBody::StepDispatched { step_id, .. } => format!("StepDispatched {step_id}"),
            EventBody::RunStatusChanged { status, .. } => {
                format!("RunStatusChanged {}", status.as_str())
            }
            other => other.name().to_owned(),
        })
        .collect()
}

fn interrupted(events: &[Event]) -> (Value, bool) {
    events
        .iter()
        .find_map(|e| match &e.body {
            EventBody::Interrupted {
                context,
                members_only,
                ..
            } => Some((context.clone().unwrap(), *members_only)),
            _ => None,
        })
        .expect("an Interrupted event")
}

const AGENT: &str = "id: support
version: 1
nodes:
  - {id: agent, tool: llm, side_effect: pure, may_request: [refund]}
  - id: refund
    tool: http
    side_effect: keyed
    args: {amount: 0, note: $interrupt.payload.note}
    interrupt_before: {reason: money leaves the company, required_role: approver}
    on_reject: {goto: apologise}
  - {id: apologise, tool: echo, side_effect: pure, args: {why: $interrupt.payload.why}}
";

#[test]
fn an_agent_requested_call_carries_the_model_message_what_it_affects_and_the_reject_path() {
    let (mut run, _) = Run::start(AGENT, json!({}));
    let events = run.succeed(
        "agent#1",
        json!({
            "content": "The parcel arrived broken and the customer is entitled to a refund of 30.",
            "next_steps": [{"node": "refund", "args": {"amount": 30, "order_id": "o-1"}}],
        }),
    );
    let (context, members_only) = interrupted(&events);
    assert_eq!(
        context,
        json!({
            "rationale": "The parcel arrived broken and the customer is entitled to a refund of 30.",
            "affects": {"node": "refund", "tool": "http", "side_effect": "keyed",
                        "args": {"amount": 30, "order_id": "o-1"}},
            "on_reject": {"action": "goto", "node": "apologise"},
        })
    );
    assert!(!members_only, "no approver group: any approver may decide");
    let interrupt = run.state().open_interrupts().next().unwrap();
    assert_eq!(interrupt.context.as_ref(), Some(&context));
}

#[test]
fn a_graph_node_has_no_rationale_and_its_rejection_runs_the_substitute_with_the_human_input() {
    const GATED: &str = "id: gated
version: 1
nodes:
  - {id: read, tool: echo, side_effect: pure}
  - id: refund
    tool: http
    side_effect: keyed
    args: {amount: $steps.read.output.amount, note: $interrupt.payload.note}
    interrupt_before: {reason: money}
    on_reject: {goto: apologise}
  - {id: apologise, tool: echo, side_effect: pure, args: {why: $interrupt.payload.why}}
edges:
  - {from: read, to: refund}
";
    let (mut run, _) = Run::start(GATED, json!({}));
    let events = run.succeed("read#1", json!({"amount": 30}));
    let (context, _) = interrupted(&events);
    assert_eq!(context.get("rationale"), None, "no llm step proposed it");
    // The proposal shows where the human input goes.
    let interrupt = run.state().open_interrupts().next().unwrap().clone();
    assert_eq!(
        interrupt.proposal["args"],
        json!({"amount": 30, "note": "$interrupt.payload.note"})
    );
    let events = run.decide(
        &ALICE,
        "refund",
        false,
        Some(json!({"why": "already refunded by the shop"})),
        None,
    );
    assert!(names(&events).contains(&"StepDispatched apologise#1".to_owned()));
    assert_eq!(
        run.state().steps["apologise#1"].args,
        json!({"why": "already refunded by the shop"})
    );
}

#[test]
fn the_payload_is_human_input_delivered_to_the_node_and_edits_are_their_own_field() {
    const EDITABLE: &str = "id: editable
version: 1
nodes:
  - id: refund
    tool: http
    side_effect: keyed
    args: {amount: $input.amount, note: $interrupt.payload.note}
    interrupt_before: {reason: money}
";
    // Approve with human input only: the proposal's call runs with the note filled in.
    let (mut run, _) = Run::start(EDITABLE, json!({"amount": 30}));
    let events = run.decide(
        &ALICE,
        "refund",
        true,
        Some(json!({"note": "checked with the customer"})),
        None,
    );
    assert_eq!(
        names(&events),
        [
            "CommandAccepted",
            "InterruptDecided",
            "StepDispatched refund#1",
            "RunStatusChanged running"
        ]
    );
    assert_eq!(
        run.state().steps["refund#1"].args,
        json!({"amount": 30, "note": "checked with the customer"})
    );

    // Edited arguments are a new proposal (the node does not allow edits) showing the diff;
    // the payload of that first decision is not an edit.
    let (mut run, _) = Run::start(EDITABLE, json!({"amount": 30}));
    let events = run.decide(
        &ALICE,
        "refund",
        true,
        Some(json!({"note": "half only"})),
        Some(json!({"amount": 15, "note": "$interrupt.payload.note"})),
    );
    let decided = events
        .iter()
        .find_map(|e| match &e.body {
            EventBody::InterruptDecided {
                payload,
                edited_args,
                ..
            } => Some((payload.clone(), edited_args.clone())),
            _ => None,
        })
        .unwrap();
    assert_eq!(
        decided,
        (
            Some(json!({"note": "half only"})),
            Some(json!({"amount": 15, "note": "$interrupt.payload.note"}))
        )
    );
    let (context, _) = interrupted(&events);
    assert_eq!(
        context["affects"]["diff"],
        json!({"amount": {"from": 30, "to": 15}})
    );
    assert!(run.state().steps.is_empty(), "nothing runs before approval");
    run.decide(&BOB, "refund", true, Some(json!({"note": "ok"})), None);
    assert_eq!(
        run.state().steps["refund#1"].args,
        json!({"amount": 15, "note": "ok"})
    );
}

const PRECHECKED: &str = "id: prechecked
version: 1
nodes:
  - id: refund
    tool: http
    side_effect: keyed
    args: {order_id: $input.order_id}
    interrupt_before: {reason: money}
    precheck: still_refundable
  - {id: still_refundable, tool: http, side_effect: pure, args: {order_id: $input.order_id, approver_note: $interrupt.payload.note}}
";

#[test]
fn a_precheck_runs_after_approval_and_before_the_call() {
    let (mut run, _) = Run::start(PRECHECKED, json!({"order_id": "o-1"}));
    let events = run.decide(&ALICE, "refund", true, Some(json!({"note": "n"})), None);
    assert!(names(&events).contains(&"StepDispatched still_refundable#1".to_owned()));
    assert!(!run.state().steps.contains_key("refund#1"), "not yet");
    assert_eq!(
        run.state().steps["still_refundable#1"].args,
        json!({"order_id": "o-1", "approver_note": "n"})
    );
    let events = run.succeed("still_refundable#1", json!({"ok": true}));
    assert!(names(&events).contains(&"StepDispatched refund#1".to_owned()));
    run.succeed("refund#1", json!({"refunded": true}));
    assert_eq!(run.state().status, RunStatus::Succeeded);
}

#[test]
fn a_precheck_that_does_not_answer_ok_true_stops_the_call_and_follows_on_reject() {
    for answer in [
        json!({"ok": false, "reason": "already shipped back"}),
        json!({}),
    ] {
        let (mut run, _) = Run::start(PRECHECKED, json!({"order_id": "o-1"}));
        run.decide(&ALICE, "refund", true, None, None);
        run.succeed("still_refundable#1", answer.clone());
        let state = run.state();
        assert!(
            !state.steps.contains_key("refund#1"),
            "{answer}: never runs"
        );
        assert_eq!(state.status, RunStatus::Failed, "{answer}: on_reject fail");
    }
    // A precheck that fails outright refuses too; with on_reject goto the run continues.
    let goto = PRECHECKED.replace(
        "    precheck: still_refundable\n",
        "    precheck: still_refundable\n    on_reject: {goto: tell}\n",
    ) + "  - {id: tell, tool: echo, side_effect: pure}\n";
    let (mut run, _) = Run::start(&goto, json!({"order_id": "o-1"}));
    run.decide(&ALICE, "refund", true, None, None);
    let events = run.fail("still_refundable#1");
    assert!(names(&events).contains(&"StepDispatched tell#1".to_owned()));
    run.succeed("tell#1", json!({}));
    assert!(!run.state().steps.contains_key("refund#1"));
    assert_eq!(run.state().status, RunStatus::Succeeded);
}

const QUORUM: &str = "id: payout
version: 1
nodes:
  - id: pay
    tool: http
    side_effect: keyed
    args: {amount: 5000}
    approval: {quorum: 2, group: finance, timeout: 1h, on_timeout: escalate, escalation: [cfo]}
";

#[test]
fn a_quorum_needs_distinct_members_of_the_group() {
    let (mut run, events) = Run::start(QUORUM, json!({}));
    let (_, members_only) = interrupted(&events);
    assert!(members_only);
    let events = run.decide(&MALLORY, "pay", true, None, None);
    assert_eq!(names(&events), ["CommandRejected not_in_group"]);
    let events = run.decide(&ALICE, "pay", true, None, None);
    assert_eq!(names(&events), ["CommandAccepted", "InterruptDecided"]);
    let events = run.decide(&ALICE, "pay", true, None, None);
    assert_eq!(
        names(&events),
        ["CommandRejected duplicate_approver"],
        "the same principal counts once"
    );
    assert!(run.state().steps.is_empty());
    let events = run.decide(&BOB, "pay", true, None, None);
    assert!(names(&events).contains(&"StepDispatched pay#1".to_owned()));
}

#[test]
fn interrupt_payload_is_refused_where_no_decision_precedes_and_a_precheck_needs_a_gate() {
    let ungated = "id: g\nversion: 1\nnodes:\n  - {id: a, tool: echo, side_effect: pure, args: {x: $interrupt.payload.x}}\n";
    let err = Graph::parse(ungated).unwrap_err().to_string();
    assert!(err.contains("$interrupt.payload"), "{err}");
    let ungated_precheck = "id: g\nversion: 1\nnodes:\n  - {id: a, tool: echo, side_effect: pure, precheck: b}\n  - {id: b, tool: echo, side_effect: pure}\n";
    let err = Graph::parse(ungated_precheck).unwrap_err().to_string();
    assert!(err.contains("interrupt_before"), "{err}");
    assert!(Graph::parse(PRECHECKED).is_ok());
    assert!(Graph::parse(AGENT).is_ok());
}

#[test]
fn an_approver_group_alone_stays_a_label_as_before() {
    let labelled = QUORUM.replace("group: finance", "approver_group: finance");
    let (mut run, events) = Run::start(&labelled, json!({}));
    let (_, members_only) = interrupted(&events);
    assert!(!members_only);
    let events = run.decide(&MALLORY, "pay", true, None, None);
    assert_eq!(names(&events), ["CommandAccepted", "InterruptDecided"]);
}

#[test]
fn escalation_changes_who_may_approve() {
    let (mut run, _) = Run::start(QUORUM, json!({}));
    let interrupt = run.state().open_interrupts().next().unwrap().clone();
    let due = interrupt.expires_at.unwrap();
    let events = run.fire(
        due,
        TimerKey::ApprovalExpiry {
            interrupt_id: interrupt.interrupt_id.clone(),
            round: 0,
        },
    );
    assert_eq!(names(&events), ["InterruptEscalated"]);
    let events = run.decide(&ALICE, "pay", true, None, None);
    assert_eq!(
        names(&events),
        ["CommandRejected not_in_group"],
        "finance no longer decides"
    );
    let events = run.decide(&CFO, "pay", true, None, None);
    assert_eq!(names(&events), ["CommandAccepted", "InterruptDecided"]);
}
