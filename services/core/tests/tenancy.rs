//! Issue #14, item 3: a command of another tenant about a run id is answered before
//! anything else — before the run's command-id memory — and outside the run's history
//! (seq 0, the command's own tenant), so it writes nothing to the run and learns nothing
//! of it. Checked red twice: with the tenant check skipped, and with the answer written
//! into the run's history (`ctx.reject` instead of `answer_outside`), the first test
//! failed on the run's state (it changed).

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use serde_json::json;
use sortie_core::{
    apply, input::Command, CommandBody, Effect, Event, EventBody, Graph, Graphs, Input, RunState,
};

const GRAPH: &str = "id: g\nversion: 1\nnodes:\n  - {id: pay, tool: http, side_effect: keyed, interrupt_before: {reason: money, timeout: 1h}}\n";

fn graphs() -> Graphs {
    let mut graphs = Graphs::new();
    graphs.insert(Graph::parse(GRAPH).unwrap()).unwrap();
    graphs
}

fn command(tenant: &str, id: &str, body: CommandBody) -> Input {
    Input::Command(Command {
        command_id: id.into(),
        tenant: tenant.into(),
        run_id: "r".into(),
        principal: format!("{tenant}-user"),
        roles: vec!["approver".into(), "operator".into()],
        groups: vec![],
        at: 10,
        body,
    })
}

fn start(tenant: &str, id: &str) -> Input {
    command(
        tenant,
        id,
        CommandBody::StartRun {
            graph_id: "g".into(),
            graph_version: None,
            input: json!({"order": 1}),
            labels: BTreeMap::new(),
            budget: None,
            fork: None,
            parent: None,
        },
    )
}

fn events(effects: &[Effect]) -> Vec<&Event> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Emit(event) => Some(event),
            _ => None,
        })
        .collect()
}

/// A run of tenant `acme`, waiting for approval.
fn victim() -> RunState {
    let graphs = graphs();
    let applied = apply(None, &start("acme", "acme-start"), &graphs);
    let state = applied.state.unwrap();
    assert_eq!(state.status.as_str(), "waiting_approval");
    state
}

#[test]
fn another_tenants_commands_write_nothing_and_learn_nothing() {
    let graphs = graphs();
    let run = victim();
    let interrupt = run.open_interrupts().next().unwrap().clone();
    let attacks = [
        // The victim's own command id, replayed: must not get the victim's answer.
        start("evil", "acme-start"),
        start("evil", "evil-start"),
        command("evil", "c1", CommandBody::CancelRun { reason: None }),
        command(
            "evil",
            "c2",
            CommandBody::ResumeRun {
                interrupt_id: interrupt.interrupt_id.clone(),
                proposal_hash: interrupt.proposal_hash.clone(),
                approve: true,
                payload: None,
                comment: None,
                edited_args: None,
            },
        ),
        command(
            "evil",
            "c3",
            CommandBody::ReconcileOperation {
                operation_id: "op".into(),
                succeeded: true,
                output: None,
                error: None,
            },
        ),
    ];
    for attack in &attacks {
        let applied = apply(Some(&run), attack, &graphs);
        assert_eq!(applied.state.as_ref(), Some(&run), "{attack:?}");
        assert!(
            !applied
                .effects
                .iter()
                .any(|e| matches!(e, Effect::WriteState | Effect::Dispatch(_))),
            "{attack:?}: {:?}",
            applied.effects
        );
        let answers = events(&applied.effects);
        assert_eq!(answers.len(), 1, "{attack:?}");
        let answer = answers[0];
        assert_eq!(answer.seq, 0, "not part of the run's history");
        assert_eq!(answer.state_version, 0);
        assert!(answer.hash.is_none());
        assert_eq!(answer.tenant, "evil", "the victim's tenant is not shown");
        let EventBody::CommandRejected { code, reason, .. } = &answer.body else {
            panic!("{attack:?}: {answer:?}");
        };
        let expected = match attack {
            Input::Command(Command {
                body: CommandBody::StartRun { .. },
                ..
            }) => "run_id_unavailable",
            _ => "unknown_run",
        };
        assert_eq!(code, expected, "{attack:?}");
        assert!(!reason.contains("acme"), "{reason}");
    }
}

#[test]
fn the_owner_still_gets_its_answers() {
    let graphs = graphs();
    let run = victim();
    // The owner's replayed start is a duplicate, answered inside the history as before.
    let applied = apply(Some(&run), &start("acme", "acme-start"), &graphs);
    let answers = events(&applied.effects);
    assert_eq!(answers.len(), 1);
    assert_eq!(answers[0].seq, run.last_event_seq + 1);
    assert!(matches!(
        answers[0].body,
        EventBody::CommandAccepted {
            duplicate: true,
            ..
        }
    ));
}

/// Issue 57: a run id derived from a start's `Idempotency-Key` (`key_…`) is taken only by
/// a start whose own tenant and command id (the key) derive it, so another tenant that
/// guesses the key cannot take the id first and have the owner's start refused. Seen red:
/// with the check in `decide/start.rs` skipped, the other tenant's start under the
/// victim's derived id was accepted.
#[test]
fn a_keyed_run_id_is_taken_only_by_the_start_that_derives_it() {
    use sortie_core::ids::keyed_run_id;
    let graphs = graphs();
    let victims = keyed_run_id("acme", "order-7-start");
    let with_id = |tenant: &str, key: &str, run_id: &str| {
        let mut input = start(tenant, key);
        if let Input::Command(c) = &mut input {
            c.run_id = run_id.into();
        }
        input
    };
    // Another tenant, guessing the key, names the victim's id: refused, nothing started.
    let squat = apply(None, &with_id("globex", "order-7-start", &victims), &graphs);
    assert!(squat.state.is_none());
    assert!(events(&squat.effects).iter().any(|e| matches!(&e.body,
        EventBody::CommandRejected { code, .. } if code == "bad_run_id")));
    // Any `key_` id that the command id does not derive: refused.
    let made_up = apply(None, &with_id("acme", "other-key", &victims), &graphs);
    assert!(made_up.state.is_none());
    // The owner's start: taken.
    let owner = apply(None, &with_id("acme", "order-7-start", &victims), &graphs);
    assert_eq!(owner.state.unwrap().run_id, victims);
}

/// Issue #57: graphs are namespaced by tenant. Tenant `evil` publishes its own `g@2`
/// without the gate; `acme`'s unpinned start still runs the global `g@1` (waits for
/// approval), `acme` can neither pin `g@2` nor name `evil/g`, and `evil`'s own start runs
/// its own version, pinned as `evil/g`. Seen red with `Graphs::resolve` taking the latest
/// `g` of any namespace (the flat table of before): `acme` ran the ungated `g@2`.
#[test]
fn a_tenants_graph_is_never_another_tenants() {
    let mut graphs = graphs();
    let mut hijack =
        Graph::parse("id: g\nversion: 2\nnodes:\n  - {id: pay, tool: http, side_effect: keyed}\n")
            .unwrap();
    hijack.owner = Some("evil".into());
    graphs.insert(hijack).unwrap();

    let acme = apply(None, &start("acme", "a1"), &graphs).state.unwrap();
    assert_eq!((acme.graph_id.as_str(), acme.graph_version), ("g", 1));
    assert_eq!(acme.status.as_str(), "waiting_approval");

    for (graph_id, version) in [("g", Some(2)), ("evil/g", None), ("evil/g", Some(2))] {
        let Input::Command(mut pinned) = start("acme", "a2") else {
            unreachable!()
        };
        if let CommandBody::StartRun {
            graph_id: id,
            graph_version: v,
            ..
        } = &mut pinned.body
        {
            *id = graph_id.into();
            *v = version;
        }
        let applied = apply(None, &Input::Command(pinned), &graphs);
        assert!(applied.state.is_none(), "{graph_id}@{version:?} started");
        let rejected = events(&applied.effects).into_iter().any(|e| {
            matches!(&e.body, EventBody::CommandRejected { code, .. } if code == "unknown_graph")
        });
        assert!(rejected, "{graph_id}@{version:?} is not refused as unknown");
    }

    let evil = apply(None, &start("evil", "e1"), &graphs).state.unwrap();
    assert_eq!((evil.graph_id.as_str(), evil.graph_version), ("evil/g", 2));
    assert_eq!(evil.status.as_str(), "running");
    // The same start again is the same run (the start names `g`, the run pinned `evil/g`).
    let again = apply(Some(&evil), &start("evil", "e2"), &graphs);
    let duplicate = events(&again.effects).into_iter().any(|e| {
        matches!(
            &e.body,
            EventBody::CommandAccepted {
                duplicate: true,
                ..
            }
        )
    });
    assert!(
        duplicate,
        "an identical start is not recognised: {:?}",
        again.effects
    );
}
