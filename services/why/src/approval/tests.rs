//! The gate held to the signed graph: forged histories the fold never wrote.

use serde_json::json;
use sortie_core::{Event, EventBody, Graph};
use sortie_wire::signing::{keyring_text, Keyring, Signer};

use crate::tests::{chain_with, decider, fold_story, gate_of, record_of, wire_approval};
use crate::{render, Chain, Link, Status};

/// The refund gate: role `approver`, and whatever `more` adds to `interrupt_before`.
fn gated(more: &str) -> Graph {
    Graph::parse(&format!(
        "id: gated
version: 1
nodes:
  - {{id: prepare, tool: echo, side_effect: pure}}
  - id: refund
    tool: echo
    side_effect: keyed
    args: {{amount: $input.amount}}
    interrupt_before: {{reason: refunds need a human, required_role: approver{more}}}
edges:
  - {{from: prepare, to: refund}}
"
    ))
    .expect("graph")
}

/// The gateway's key: a delegate, which signs any principal's command with the roles
/// and groups its token holds.
fn gateway() -> (Signer, Keyring) {
    let signer = Signer::from_seed("gateway-1", [7; 32]);
    let ring = keyring_text(&[signer.entry("svc:gateway", &["acme".to_owned()], &[], true)]);
    (signer, Keyring::parse(&ring).expect("keyring"))
}

fn approval(chain: &Chain) -> &Link {
    chain
        .links
        .iter()
        .find(|l| l.link == "approval")
        .expect("an approval link")
}

/// `history` with every event numbered and chained anew, as its forger writes it.
fn rechained(mut history: Vec<Event>) -> Vec<Event> {
    let mut prev = None;
    for (i, event) in history.iter_mut().enumerate() {
        event.seq = i as i64 + 1;
        event.prev_hash = prev.clone();
        event.hash = Some(event.compute_hash());
        prev = event.hash.clone();
    }
    history
}

/// Issue #57 item 3, the forged-history probe: a viewer's approval, which the fold
/// refused (`forbidden`: the gate needs role `approver`), shown in a history chained
/// anew as the approval that released the refund. The viewer's command is on
/// `sortie.commands`, signed by the gateway's key, and says exactly what the forged
/// decision says; only the gate's rules, taken from the signed graph and held to the
/// roles that signed command claims, tell the forgery. Seen red: with `judge` taking
/// every signed approval the fold accepted as counted (the rule check skipped), this
/// chain verified.
#[test]
fn a_rechained_history_with_a_viewers_refused_approval_does_not_verify() {
    let graph = gated("");
    let viewer = decider("user:viewer", &["viewer"], &[]);
    let (honest, state) = fold_story(
        &graph,
        json!({"amount": 5}),
        &[("approve-viewer", viewer.clone())],
    );
    assert!(
        honest.iter().any(|e| matches!(&e.body,
            EventBody::CommandRejected { command_id, code, .. }
                if command_id == "approve-viewer" && code == "forbidden")),
        "the fold refuses the viewer"
    );
    let interrupt = gate_of(&state);
    // The forger writes what the fold would have written had the viewer held the
    // role: from the viewer's decision on, an approval and the refund's dispatch.
    let as_approver = decider("user:viewer", &["approver"], &[]);
    let (forged, _) = fold_story(
        &graph,
        json!({"amount": 5}),
        &[("approve-viewer", as_approver)],
    );
    let kept = honest
        .iter()
        .take_while(|e| !matches!(e.body, EventBody::CommandRejected { .. }))
        .count();
    let forged = rechained(
        honest[..kept]
            .iter()
            .chain(&forged[kept..])
            .cloned()
            .collect(),
    );
    let (signer, keyring) = gateway();
    let sent = wire_approval("approve-viewer", &viewer, &interrupt);
    let chain = chain_with(
        &forged,
        &graph,
        vec![("approve-viewer", record_of(sent, Some(&signer)))],
        &keyring,
    );
    let shown = render(&chain);
    assert!(!chain.verified, "{shown}");
    let link = approval(&chain);
    assert_eq!(link.status, Status::Broken, "{shown}");
    assert_eq!(
        link.facts["approvals"][0]["signature"], "verified",
        "the command itself holds: {shown}"
    );
    let problems = link.problems.join("\n");
    assert!(
        problems.contains("user:viewer's approval is not counted")
            && problems.contains("forbidden: deciding needs role \"approver\""),
        "{problems}"
    );
    assert!(
        problems.contains(
            "0 approval(s) by distinct principals meet the gate of gated@1 (role \"approver\"), which needs 1"
        ),
        "{problems}"
    );
    // Every other link holds: the history, the effect, the graph, the proposal.
    for other in chain.links.iter().filter(|l| l.link != "approval") {
        assert_eq!(other.status, Status::Verified, "{shown}");
    }

    // The same story with an approver's approval, signed by the same key, verifies.
    let approver = decider("user:alice", &["approver"], &[]);
    let (history, state) = fold_story(
        &graph,
        json!({"amount": 5}),
        &[("approve", approver.clone())],
    );
    let sent = wire_approval("approve", &approver, &gate_of(&state));
    let chain = chain_with(
        &history,
        &graph,
        vec![("approve", record_of(sent, Some(&signer)))],
        &keyring,
    );
    assert!(chain.verified, "{}", render(&chain));
    assert_eq!(approval(&chain).facts["counted"], 1);
}

/// The quorum and the role are the signed graph's: a history whose gate says quorum 1
/// and no role (folded under another definition of `gated@1`, or simply written so)
/// is held to the signed version's quorum of 2, and one approval does not release it;
/// two approvers' do.
#[test]
fn the_quorum_and_the_role_are_the_signed_graphs_not_the_historys() {
    let signed = gated(", quorum: 2");
    let (signer, keyring) = gateway();
    let alice = decider("user:alice", &["approver"], &[]);
    let bob = decider("user:bob", &["approver"], &[]);
    let lax = Graph::parse(
        "id: gated
version: 1
nodes:
  - {id: prepare, tool: echo, side_effect: pure}
  - {id: refund, tool: echo, side_effect: keyed, args: {amount: $input.amount}, interrupt_before: {reason: refunds need a human}}
edges:
  - {from: prepare, to: refund}
",
    )
    .expect("graph");
    let (forged, state) = fold_story(&lax, json!({"amount": 5}), &[("a", alice.clone())]);
    let sent = wire_approval("a", &alice, &gate_of(&state));
    let chain = chain_with(
        &forged,
        &signed,
        vec![("a", record_of(sent, Some(&signer)))],
        &keyring,
    );
    let problems = approval(&chain).problems.join("\n");
    assert_eq!(approval(&chain).status, Status::Broken, "{problems}");
    for expected in [
        "the history's gate asks a quorum of 1, the signed graph gated@1's 2",
        "the history's gate requires role None, the signed graph gated@1's Some(\"approver\")",
        "1 approval(s) by distinct principals meet the gate of gated@1 (role \"approver\"), which needs 2",
    ] {
        assert!(problems.contains(expected), "{expected}\n{problems}");
    }

    let (history, state) = fold_story(
        &signed,
        json!({"amount": 5}),
        &[("a", alice.clone()), ("b", bob.clone())],
    );
    let interrupt = gate_of(&state);
    let chain = chain_with(
        &history,
        &signed,
        vec![
            (
                "a",
                record_of(wire_approval("a", &alice, &interrupt), Some(&signer)),
            ),
            (
                "b",
                record_of(wire_approval("b", &bob, &interrupt), Some(&signer)),
            ),
        ],
        &keyring,
    );
    assert!(chain.verified, "{}", render(&chain));
    assert_eq!(approval(&chain).facts["counted"], 2);
}

/// A members-only gate counts only members of its group (named from the run's input
/// here, as the fold names it): an approver outside it is refused `not_in_group`.
#[test]
fn a_members_only_gate_counts_only_its_groups_members() {
    let graph = gated(", group: $input.desk");
    let (signer, keyring) = gateway();
    let input = json!({"amount": 5, "desk": "finance"});
    let outsider = decider("user:carol", &["approver"], &["sales"]);
    let as_member = decider("user:carol", &["approver"], &["finance"]);
    let (forged, state) = fold_story(&graph, input.clone(), &[("c", as_member)]);
    let sent = wire_approval("c", &outsider, &gate_of(&state));
    let chain = chain_with(
        &forged,
        &graph,
        vec![("c", record_of(sent, Some(&signer)))],
        &keyring,
    );
    let problems = approval(&chain).problems.join("\n");
    assert_eq!(approval(&chain).status, Status::Broken, "{problems}");
    assert!(
        problems.contains("not_in_group: deciding needs membership of group \"finance\""),
        "{problems}"
    );

    let member = decider("user:dave", &["approver"], &["finance"]);
    let (history, state) = fold_story(&graph, input, &[("d", member.clone())]);
    let sent = wire_approval("d", &member, &gate_of(&state));
    let chain = chain_with(
        &history,
        &graph,
        vec![("d", record_of(sent, Some(&signer)))],
        &keyring,
    );
    assert!(chain.verified, "{}", render(&chain));
}

/// An approval whose command the history answers `rejected` was refused by the fold
/// and is never counted, whatever event follows it.
#[test]
fn a_command_the_fold_refused_is_never_counted() {
    let graph = gated("");
    let (signer, keyring) = gateway();
    let alice = decider("user:alice", &["approver"], &[]);
    let (history, state) = fold_story(&graph, json!({"amount": 5}), &[("approve", alice.clone())]);
    let at = history
        .iter()
        .position(|e| matches!(&e.body, EventBody::CommandAccepted { command_id, .. } if command_id == "approve"))
        .expect("accepted");
    let mut refused = history[at].clone();
    refused.body = EventBody::CommandRejected {
        command_id: "approve".into(),
        command: "resume_run".into(),
        code: "expired".into(),
        reason: "the interrupt expired".into(),
    };
    let mut forged = history.clone();
    forged.insert(at, refused);
    let forged = rechained(forged);
    let sent = wire_approval("approve", &alice, &gate_of(&state));
    let chain = chain_with(
        &forged,
        &graph,
        vec![("approve", record_of(sent, Some(&signer)))],
        &keyring,
    );
    let problems = approval(&chain).problems.join("\n");
    assert_eq!(approval(&chain).status, Status::Broken, "{problems}");
    assert!(
        problems.contains("the fold refused command approve (expired: the interrupt expired)"),
        "{problems}"
    );
}
