//! A member of a tenant without the role to decide (or with it, but deciding made-up
//! interrupts) sends a flood of decisions: huge proposal hashes, made-up interrupt ids,
//! large payloads and comments. None of it may make the run fail or grow it toward its
//! state limit: rejections store a code and a fixed reason (ids clipped), and decisions
//! kept for interrupts not registered yet need a gate's role and stay within a count and
//! a byte cap. Then the run's real approval goes through and it succeeds.
//!
//! Seen red, each separately: with `Ctx::reject` not clipping and the stale-proposal
//! reason quoting the client's hash (as before), the first stale decision grew the state
//! to 380 KB (the 250 KB hash kept as the command's answer), a step result away from the
//! 512 KiB limit past which the run fails; with the byte cap in `resume::buffer`
//! disabled, an approver's 60 KB early decisions grew it past 200 KB (the count cap
//! alone lets sixteen of them reach ~1 MB); with the role check disabled, decisions from
//! a member without the gate's role were kept.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use serde_json::json;
use sortie_core::{
    apply, ids, input::Command, limits, CommandBody, Effect, EventBody, Graph, Graphs, Input,
    RunState, RunStatus, StepOutcome, StepReport,
};

const GRAPH: &str = "id: g\nversion: 1\nnodes:\n  - {id: read, tool: echo, side_effect: pure}\n  - {id: pay, tool: http, side_effect: keyed, args: {amount: $steps.read.output.amount}, interrupt_before: {reason: money, timeout: 1h, required_role: approver}}\nedges:\n  - {from: read, to: pay}\n";

struct Run {
    graphs: Graphs,
    state: Option<RunState>,
    at: i64,
    n: usize,
    /// Every rejection seen: (code, reason).
    rejections: Vec<(String, String)>,
}

impl Run {
    fn start() -> Run {
        let mut graphs = Graphs::new();
        graphs.insert(Graph::parse(GRAPH).unwrap()).unwrap();
        let mut run = Run {
            graphs,
            state: None,
            at: 0,
            n: 0,
            rejections: vec![],
        };
        run.command(
            "svc",
            &[],
            CommandBody::StartRun {
                graph_id: "g".into(),
                graph_version: None,
                input: json!({}),
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
        for effect in &applied.effects {
            if let Effect::Emit(event) = effect {
                if let EventBody::CommandRejected { code, reason, .. } = &event.body {
                    self.rejections.push((code.clone(), reason.clone()));
                }
            }
        }
        self.state = applied.state;
        let run = self.state.as_ref().unwrap();
        assert!(
            !matches!(run.status, RunStatus::Failed | RunStatus::Compensating),
            "the run failed: {:?}",
            run.status
        );
        let bytes = limits::json_len(run);
        assert!(
            bytes < 160 * 1024,
            "the run grew to {bytes} bytes after input {}",
            self.n
        );
    }

    fn command(&mut self, principal: &str, roles: &[&str], body: CommandBody) {
        self.n += 1;
        self.at += 1;
        self.input(Input::Command(Command {
            command_id: format!("c{}", self.n),
            tenant: "t".into(),
            run_id: "r".into(),
            principal: principal.into(),
            roles: roles.iter().map(|r| (*r).to_owned()).collect(),
            groups: vec![],
            at: self.at,
            body,
        }));
    }

    fn decide(&mut self, roles: &[&str], interrupt_id: String, proposal_hash: String, big: usize) {
        self.command(
            "user:mallory",
            roles,
            CommandBody::ResumeRun {
                interrupt_id,
                proposal_hash,
                approve: true,
                payload: Some(json!({ "blob": "p".repeat(big) })),
                comment: Some("c".repeat(big.min(limits::MAX_TEXT_BYTES))),
                edited_args: None,
            },
        );
    }

    fn run(&self) -> &RunState {
        self.state.as_ref().unwrap()
    }

    fn succeed(&mut self, step_id: &str, output: serde_json::Value) {
        let step = self.run().steps[step_id].clone();
        self.at += 1;
        self.input(Input::StepReport(StepReport {
            spent: None,
            operation_id: step.operation_id.clone(),
            attempt: step.attempt,
            tenant: "t".into(),
            run_id: "r".into(),
            step_id: step_id.into(),
            outcome: StepOutcome::Succeeded { output },
            at: self.at,
        }));
    }
}

/// A made-up interrupt id of the derived form (`int_` + 24 hex), and a hash of its form.
fn made_up(i: usize) -> (String, String) {
    (format!("int_{i:024x}"), format!("{i:064x}"))
}

#[test]
fn a_flood_of_bogus_decisions_cannot_make_a_run_fail() {
    let mut run = Run::start();
    let huge_hash = "h".repeat(250 * 1024);

    // A member without the gate's role: nothing is kept, whatever the id.
    for i in 0..200 {
        let (id, hash) = made_up(i);
        run.decide(&[], id, hash, 50 * 1024);
    }
    assert!(run.run().buffered.is_empty());
    // Ids no interrupt can have, with a 250 KB "hash": refused, nothing of it repeated.
    for i in 0..100 {
        run.decide(&["approver"], format!("bogus-{i}"), huge_hash.clone(), 10);
    }
    // An approver's made-up interrupts: kept up to the caps, then refused.
    for i in 0..100 {
        let (id, hash) = made_up(1000 + i);
        run.decide(&["approver"], id, hash, 60 * 1024);
    }
    for i in 0..100 {
        let (id, hash) = made_up(2000 + i);
        run.decide(&["approver"], id, hash, 100);
    }
    let kept = &run.run().buffered;
    assert!(kept.len() <= limits::MAX_BUFFERED, "{}", kept.len());
    assert!(kept.iter().map(limits::json_len).sum::<usize>() <= limits::MAX_BUFFERED_BYTES);

    // The real gate comes up; stale decisions on it with a huge hash are refused too.
    run.succeed(
        "read#1",
        json!({"amount": 30, "notes": "x".repeat(100 * 1024)}),
    );
    let interrupt = run.run().open_interrupts().next().unwrap().clone();
    for _ in 0..100 {
        run.decide(
            &["approver"],
            interrupt.interrupt_id.clone(),
            huge_hash.clone(),
            10,
        );
    }
    let codes: BTreeMap<&str, usize> =
        run.rejections
            .iter()
            .fold(BTreeMap::new(), |mut codes, (code, _)| {
                *codes.entry(code.as_str()).or_default() += 1;
                codes
            });
    assert_eq!(codes.get("forbidden"), Some(&200), "{codes:?}");
    assert_eq!(codes.get("stale_proposal"), Some(&100), "{codes:?}");
    assert!(codes.get("unknown_interrupt") >= Some(&100), "{codes:?}");
    for (code, reason) in &run.rejections {
        assert!(
            reason.len() <= limits::MAX_REASON_BYTES,
            "{code}: {}",
            reason.len()
        );
        assert!(
            !reason.contains("hhhh"),
            "{code}: the client's hash is repeated"
        );
    }
    assert!(run.run().rejected.len() <= limits::MAX_REJECTED_COMMANDS);

    // The approver's real decision still goes through, and the run finishes.
    let proposal_hash = interrupt.proposal_hash.clone();
    run.command(
        "user:alice",
        &["approver"],
        CommandBody::ResumeRun {
            interrupt_id: interrupt.interrupt_id.clone(),
            proposal_hash,
            approve: true,
            payload: None,
            comment: None,
            edited_args: None,
        },
    );
    run.succeed("pay#1", json!({"paid": 30}));
    assert_eq!(run.run().status, RunStatus::Succeeded);
    assert!(run.run().buffered.is_empty(), "answered when the run ended");
}

/// An early decision that can be known to be someone's still waits for its interrupt:
/// the role check admits a principal who may decide a gate of the graph.
#[test]
fn an_approvers_early_decision_is_still_kept_and_applied() {
    let mut run = Run::start();
    let proposal =
        json!({"node": "pay", "step_id": "pay#1", "tool": "http", "args": {"amount": 30}});
    let hash = ids::proposal_hash(&proposal);
    let id = ids::interrupt_id("r", "pay#1", &hash);
    run.decide(&["approver"], id, hash, 10);
    assert_eq!(run.run().buffered.len(), 1);
    run.succeed("read#1", json!({"amount": 30}));
    assert!(
        run.run().steps.contains_key("pay#1"),
        "approved early, dispatched at once"
    );
}
