//! The chain on histories the fold writes, and forged ones.

use super::*;
use sortie_core::input::{Command, CommandBody, Input, StepOutcome, StepReport};
use sortie_core::{apply, Effect, Graphs, Plain};

const GATED: &str = "id: gated
version: 1
nodes:
  - {id: prepare, tool: echo, side_effect: pure}
  - id: refund
    tool: echo
    side_effect: keyed
    args: {amount: $input.amount}
    interrupt_before: {reason: refunds need a human, required_role: approver}
edges:
  - {from: prepare, to: refund}
";

/// Commands as a map from command id to what was found.
struct Table(std::collections::BTreeMap<String, Found>);

impl Commands for Table {
    fn find(&mut self, _run_id: &str, command_id: &str, _at: i64) -> Found {
        self.0.get(command_id).cloned().unwrap_or(Found::Missing)
    }
}

/// Who sends a command, with the roles and groups it claims (the fold judges them).
#[derive(Debug, Clone)]
pub(crate) struct Decider {
    pub(crate) principal: String,
    pub(crate) roles: Vec<String>,
    pub(crate) groups: Vec<String>,
}

pub(crate) fn decider(principal: &str, roles: &[&str], groups: &[&str]) -> Decider {
    Decider {
        principal: principal.into(),
        roles: roles.iter().map(|r| r.to_string()).collect(),
        groups: groups.iter().map(|g| g.to_string()).collect(),
    }
}

/// The harness's service: an approver and an operator.
pub(crate) fn service() -> Decider {
    decider("svc:test", &["approver", "operator"], &[])
}

fn command(id: &str, by: &Decider, body: CommandBody, at: i64) -> Input {
    Input::Command(Command {
        command_id: id.into(),
        tenant: "acme".into(),
        run_id: "run-1".into(),
        principal: by.principal.clone(),
        roles: by.roles.clone(),
        groups: by.groups.clone(),
        at,
        body,
    })
}

/// The refund story folded with `graph`: started with `input`, its first step done, then
/// each of `approvals` (command id, who) deciding the gate's interrupt in turn, one
/// millisecond apart. The history as the fold wrote it, and the run's state.
pub(crate) fn fold_story(
    graph: &Graph,
    input: Value,
    approvals: &[(&str, Decider)],
) -> (Vec<Event>, RunState) {
    let mut graphs = Graphs::new();
    graphs.insert(graph.clone()).expect("insert");
    let mut history = Vec::new();
    let mut state = None;
    let mut step = |state: &mut Option<RunState>, input: Input| {
        let applied = apply(state.as_ref(), &input, &graphs);
        for effect in applied.effects {
            if let Effect::Emit(e) = effect {
                if e.seq > 0 {
                    history.push(e);
                }
            }
        }
        *state = applied.state;
    };
    let start = CommandBody::StartRun {
        graph_id: graph.id.clone(),
        graph_version: None,
        input,
        labels: Default::default(),
        budget: None,
        fork: None,
        parent: None,
    };
    step(&mut state, command("start", &service(), start, 1));
    let s = state.clone().expect("state");
    let prepare = &s.steps["prepare#1"];
    let done = Input::StepReport(StepReport {
        spent: None,
        operation_id: prepare.operation_id.clone(),
        attempt: 1,
        tenant: "acme".into(),
        run_id: "run-1".into(),
        step_id: "prepare#1".into(),
        outcome: StepOutcome::Succeeded { output: json!({}) },
        at: 2,
    });
    step(&mut state, done);
    for (i, (id, by)) in approvals.iter().enumerate() {
        let interrupt = gate_of(state.as_ref().expect("state"));
        let approve = CommandBody::ResumeRun {
            interrupt_id: interrupt.interrupt_id.clone(),
            proposal_hash: interrupt.proposal_hash.clone(),
            approve: true,
            payload: None,
            comment: None,
            edited_args: None,
        };
        step(&mut state, command(id, by, approve, 3 + i as i64));
    }
    (history, state.expect("state"))
}

/// The refund's interrupt.
pub(crate) fn gate_of(state: &RunState) -> sortie_core::state::Interrupt {
    state
        .interrupts
        .values()
        .find(|i| i.node == "refund")
        .cloned()
        .expect("the refund's gate")
}

/// The approval `id` of `interrupt` as `by` sent it on `sortie.commands`.
pub(crate) fn wire_approval(
    id: &str,
    by: &Decider,
    interrupt: &sortie_core::state::Interrupt,
) -> w::RunCommand {
    w::RunCommand {
        command_id: id.into(),
        tenant: "acme".into(),
        run_id: "run-1".into(),
        issuer: w::Issuer {
            principal: by.principal.clone(),
            roles: by.roles.clone(),
            groups: by.groups.clone(),
        },
        issued_at: 3,
        body: w::CommandBody::ResumeRun(w::ResumeRun {
            interrupt_id: interrupt.interrupt_id.clone(),
            proposal_hash: interrupt.proposal_hash.clone(),
            decision: w::Decision::Approve,
            payload: None,
            comment: None,
            edited_args: None,
            payload_is_input: false,
        }),
    }
}

/// The refund story's history, and the approval as its command carried it.
fn story() -> (Vec<Event>, Graph, w::RunCommand) {
    let graph = Graph::parse(GATED).expect("graph");
    let approver = decider("svc:test", &["approver"], &[]);
    let (history, state) = fold_story(
        &graph,
        json!({"amount": 5}),
        &[("approve", approver.clone())],
    );
    let wire = wire_approval("approve", &approver, &gate_of(&state));
    (history, graph, wire)
}

/// A command record as found on the topic, signed by `signer` when given.
pub(crate) fn record_of(
    command: w::RunCommand,
    signer: Option<&sortie_wire::signing::Signer>,
) -> Found {
    let value = format!("\0\0\0\0\x01{}", command.command_id).into_bytes();
    let headers = signer
        .map(|s| {
            s.headers(&value)
                .into_iter()
                .map(|(k, v)| (k.to_owned(), Some(v)))
                .collect()
        })
        .unwrap_or_default();
    Found::Record(Box::new(CommandRecord {
        partition: 1,
        offset: 42,
        value,
        headers,
        command,
    }))
}

/// The chain of the refund's operation in `history`, its commands looked up in
/// `commands` (command id → what is found).
pub(crate) fn chain_with(
    history: &[Event],
    graph: &Graph,
    commands: Vec<(&str, Found)>,
    keyring: &Keyring,
) -> Chain {
    let publication = Publication {
        key: format!("{}@{}", graph.id, graph.version),
        definition_hash: "d".into(),
        tenant: None,
        published_by: "ops".into(),
        published_at: 0,
        signed_by: Some("publisher".into()),
    };
    let op = history
        .iter()
        .find_map(|e| match &e.body {
            EventBody::StepDispatched { step_id, .. } if step_id == "refund#1" => {
                e.operation_id.clone()
            }
            _ => None,
        })
        .expect("the refund's dispatch");
    let mut commands = Table(
        commands
            .into_iter()
            .map(|(id, found)| (id.to_owned(), found))
            .collect(),
    );
    why(Inputs {
        operation_id: &op,
        history,
        seal: &Plain,
        readable: true,
        graph: Some(graph),
        publication: Some(&publication),
        keyring: Some(keyring),
        commands: &mut commands,
    })
}

fn chain_of(history: &[Event], graph: &Graph, found: Found, keyring: &Keyring) -> Chain {
    chain_with(history, graph, vec![("approve", found)], keyring)
}

#[test]
fn a_signed_approval_verifies_and_a_missing_unsigned_or_changed_one_is_named() {
    let (history, graph, wire) = story();
    let signer = sortie_wire::signing::Signer::from_seed("svc-1", [3; 32]);
    let keyring = Keyring::parse(&sortie_wire::signing::keyring_text(&[signer.entry(
        "svc:test",
        &["acme".to_owned()],
        &["approver".to_owned()],
        false,
    )]))
    .expect("keyring");
    let value = b"\0\0\0\0\x01the approval".to_vec();
    let record = |value: Vec<u8>, headers: Vec<(String, Option<Vec<u8>>)>, command| {
        Found::Record(Box::new(CommandRecord {
            partition: 1,
            offset: 42,
            value,
            headers,
            command,
        }))
    };
    let signed: Vec<(String, Option<Vec<u8>>)> = signer
        .headers(&value)
        .into_iter()
        .map(|(k, v)| (k.to_owned(), Some(v)))
        .collect();
    let chain = chain_of(
        &history,
        &graph,
        record(value.clone(), signed.clone(), wire.clone()),
        &keyring,
    );
    assert!(chain.verified, "{}", render(&chain));
    assert!(render(&chain).contains("svc:test (key svc-1, sortie.commands[1]@42"));

    let chain = chain_of(&history, &graph, Found::Missing, &keyring);
    assert!(!chain.verified);
    assert!(render(&chain).contains("BROKEN"), "{}", render(&chain));

    let chain = chain_of(
        &history,
        &graph,
        record(value.clone(), vec![], wire.clone()),
        &keyring,
    );
    assert!(
        render(&chain).contains("is not signed"),
        "{}",
        render(&chain)
    );

    let mut other = wire.clone();
    other.issuer.principal = "user:mallory".into();
    let chain = chain_of(&history, &graph, record(value, signed, other), &keyring);
    assert!(
        render(&chain).contains("does not say what the history says"),
        "{}",
        render(&chain)
    );

    let chain = chain_of(&history, &graph, Found::Gone, &keyring);
    assert_eq!(
        chain
            .links
            .iter()
            .find(|l| l.link == "approval")
            .map(|l| l.status),
        Some(Status::Unchecked)
    );
}

#[test]
fn a_gated_effect_without_an_approval_is_broken() {
    let (history, graph, _) = story();
    // The history without the decision: the refund as if it had been dispatched on
    // its own (chained anew).
    let mut forged: Vec<Event> = history
        .into_iter()
        .filter(|e| !matches!(e.body, EventBody::InterruptDecided { .. }))
        .collect();
    let mut prev = None;
    for (i, event) in forged.iter_mut().enumerate() {
        event.seq = i as i64 + 1;
        event.prev_hash = prev.clone();
        event.hash = Some(event.compute_hash());
        prev = event.hash.clone();
    }
    let chain = chain_of(&forged, &graph, Found::Missing, &Keyring::default());
    let approval = chain
        .links
        .iter()
        .find(|l| l.link == "approval")
        .expect("link");
    assert_eq!(approval.status, Status::Broken);
    assert!(
        approval.problems[0].contains("no approval released"),
        "{:?}",
        approval.problems
    );
}
