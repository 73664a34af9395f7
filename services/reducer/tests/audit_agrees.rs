//! Issue #57 item 3: `sortie audit replay --verify` agrees with the reducer on every run,
//! however it was cancelled, sealed and shredded, in any order and timing.
//!
//! One run is driven the way the reducer drives it, through the same pure code: the
//! gateway seals a command's payloads with the run's key (or, once the key is destroyed,
//! to `null`), the reducer opens them, folds with `sortie_core::apply_sealed`, writes the
//! events the fold sealed and, at each commit, the state sealed under the seal of the
//! run's last input (`Engine::finish_apply`, `txn.rs`). It keeps the state hot, or reads
//! it back from its cache opened with the seal of the moment (`Engine::open_state`). A
//! run that becomes forgotten has its key destroyed (`Engine::shred_if_forgotten`); a
//! `DELETE` destroys it first and sends the `ForgetRun` after (`delete_run`), while the
//! reducer's key cache may still hold the live key for a while.
//!
//! The actions mix cancels with and without a reason, approvals and rejections (with a
//! comment), step results (outputs and error messages), due timers (step timeouts,
//! approval expiry, retention), deletes (the `ForgetRun` delivered at once or later),
//! raw `ForgetRun`s, commits and cold reads. After every commit an auditor re-folds the
//! history as `audit replay` does (`audit::open_run` then `audit::refold`), with the keys
//! and without, and must find nothing. Seen red with `refold` taking the written state as
//! sealed under the live key only (before the fix): proptest shrank to a run cancelled
//! without a reason, shredded by its retention, then sent another cancel — the state
//! written under the destroyed key diverged in `ending` — and the issue's repro below
//! (cancelled with a reason, deleted) diverged the same way.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::Arc;

use proptest::prelude::*;
use serde_json::json;
use sortie_core::{
    apply_sealed, input::Command, CommandBody, Effect, Event, Graph, Graphs, Input, RunState,
    StepOutcome, StepReport, TimerKey,
};
use sortie_reducer::audit;
use sortie_seal::{RunKey, RunSeal, Seal};

const GRAPHS: &[&str] = &[
    // A gate that cancels when nobody decides, a compensation, a retention.
    r#"
id: refund
version: 1
retention: 1h
nodes:
  - {id: prepare, tool: echo, side_effect: idempotent, compensate_with: undo, timeout: 5s}
  - id: refund
    tool: http
    side_effect: keyed
    timeout: 5s
    args: {amount: $input.amount, note: $interrupt.payload.note}
    interrupt_before: {reason: refunds need a human, required_role: approver, timeout: 30m, on_timeout: cancel}
  - {id: undo, tool: http, side_effect: keyed, timeout: 5s}
edges:
  - {from: prepare, to: refund}
"#,
    // A gate that fails when nobody decides or someone rejects; no retention.
    r#"
id: kept
version: 1
nodes:
  - {id: prepare, tool: echo, side_effect: pure, timeout: 5s, retry: {max_attempts: 2, initial_backoff: 1s, max_backoff: 1s, multiplier: 1, jitter: 0}}
  - id: pay
    tool: http
    side_effect: keyed
    timeout: 5s
    interrupt_before: {reason: money, timeout: 10m, quorum: 2}
edges:
  - {from: prepare, to: pay}
"#,
];

const RUN: &str = "run-1";
const TENANT: &str = "acme";

#[derive(Debug, Clone)]
enum Action {
    /// A cancel, with a reason or without.
    Cancel { reason: bool },
    /// A decision on the open gate by one of three approvers.
    Decide { who: u8, approve: bool },
    /// An executor's answer for a step in flight.
    Report { pick: usize, ok: bool },
    /// Time passes.
    Wait { ms: i64 },
    /// The next armed timer fires (time jumps to it).
    NextTimer,
    /// `DELETE /v1/runs/{id}` (taken only when the gateway's view shows the run ended):
    /// the key is destroyed, its `ForgetRun` arrives after `later` more actions.
    Delete { later: u8 },
    /// A `ForgetRun` from a raw producer: nothing destroyed first.
    RawForget,
    /// The batch commits: its events and states become visible.
    Commit,
    /// The reducer drops its hot state (a restart): the next input reads the cache.
    Cold,
    /// Whether the reducer's key cache still holds a destroyed key (its TTL).
    Cache { live: bool },
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        2 => any::<bool>().prop_map(|reason| Action::Cancel { reason }),
        2 => (0u8..3, any::<bool>()).prop_map(|(who, approve)| Action::Decide { who, approve }),
        4 => (any::<usize>(), any::<bool>()).prop_map(|(pick, ok)| Action::Report { pick, ok }),
        1 => (1i64..4_000_000).prop_map(|ms| Action::Wait { ms }),
        2 => Just(Action::NextTimer),
        2 => (0u8..4).prop_map(|later| Action::Delete { later }),
        1 => Just(Action::RawForget),
        3 => Just(Action::Commit),
        1 => Just(Action::Cold),
        1 => any::<bool>().prop_map(|live| Action::Cache { live }),
    ]
}

/// What Kafka holds of the run, and the reducer's and the key store's side of it.
struct Sim {
    graphs: Graphs,
    sealing: bool,
    key: Arc<RunKey>,
    /// The key store destroyed the run's key.
    destroyed: bool,
    /// The reducer's cache still answers the live key (until a `ForgetRun` evicts it).
    cached_live: bool,
    /// The gateway destroyed the key and its `ForgetRun` has not been folded: the
    /// reducer's cache may still hold the live key.
    may_cache: bool,
    /// The reducer's hot state (plaintext); `None`: read from the cache.
    hot: Option<RunState>,
    /// The state of the batch not yet committed.
    pending: Option<RunState>,
    /// The seal of the run's last input in the batch, which its state is written with.
    batch_seal: Option<RunSeal>,
    /// The events of the batch not yet committed.
    pending_events: Vec<Event>,
    /// `sortie.run-events` and `sortie.run-state` as committed.
    history: Vec<Event>,
    written: Option<RunState>,
    /// `ForgetRun`s a delete sent, with the actions left before each arrives.
    forgets: Vec<u8>,
    now: i64,
    n: usize,
}

impl Sim {
    fn new(graph: &str, sealing: bool) -> Sim {
        let mut graphs = Graphs::new();
        for text in GRAPHS {
            graphs.insert(Graph::parse(text).unwrap()).unwrap();
        }
        let mut sim = Sim {
            graphs,
            sealing,
            key: Arc::new(RunKey::from_dek(&[9; 32])),
            destroyed: false,
            cached_live: false,
            may_cache: false,
            hot: None,
            pending: None,
            batch_seal: None,
            pending_events: Vec::new(),
            history: Vec::new(),
            written: None,
            forgets: Vec::new(),
            now: 1_000,
            n: 0,
        };
        sim.command(CommandBody::StartRun {
            graph_id: graph.into(),
            graph_version: None,
            input: json!({"amount": 5, "customer": "jane roe"}),
            labels: BTreeMap::new(),
            budget: None,
            fork: None,
            parent: None,
        });
        sim
    }

    /// The seal the services take the run's payloads with now.
    fn seal(&self) -> RunSeal {
        match (self.sealing, self.destroyed && !self.cached_live) {
            (false, _) => RunSeal::Plain,
            (true, false) => RunSeal::Key {
                run_id: RUN.into(),
                key: self.key.clone(),
            },
            (true, true) => RunSeal::Destroyed { run_id: RUN.into() },
        }
    }

    /// The run as the reducer holds it before an input: hot, else its cache opened.
    fn take_state(&mut self, seal: &RunSeal) -> Option<RunState> {
        if let Some(state) = &self.pending {
            return Some(state.clone());
        }
        if let Some(hot) = self.hot.take() {
            return Some(hot);
        }
        let mut cached = self.written.clone()?;
        seal.open_all(|f| cached.map_payloads(f)).unwrap();
        Some(cached)
    }

    /// One input, sealed by its sender and opened by the reducer, folded and shredded as
    /// the reducer does.
    fn feed(&mut self, mut input: Input) {
        let forget = matches!(
            &input,
            Input::Command(Command {
                body: CommandBody::ForgetRun { .. },
                ..
            })
        );
        if forget {
            // A ForgetRun makes the reducer ask the key store, not its cache.
            self.cached_live = false;
            self.may_cache = false;
        }
        let seal = self.seal();
        input.map_payloads(&mut |v| *v = seal.seal(v));
        seal.open_all(|f| input.map_payloads(f)).unwrap();
        let before = self.take_state(&seal);
        let applied = apply_sealed(before.as_ref(), &input, &self.graphs, &seal);
        for effect in &applied.effects {
            if let Effect::Emit(event) = effect {
                if event.seq > 0 {
                    let written = applied
                        .sealed_events
                        .iter()
                        .find(|s| s.seq == event.seq)
                        .unwrap_or(event);
                    self.pending_events.push(written.clone());
                }
            }
        }
        let changed = applied
            .effects
            .iter()
            .any(|e| matches!(e, Effect::WriteState));
        let after = applied.state.clone();
        if let Some(state) = &after {
            let newly = before.as_ref().is_some_and(|b| b.forgotten.is_none());
            let again = forget
                && applied.effects.iter().any(|e| {
                    matches!(e, Effect::Emit(ev) if ev.seq > 0
                        && matches!(&ev.body, sortie_core::EventBody::CommandAccepted { .. }))
                });
            if self.sealing && state.forgotten.is_some() && (newly || again) {
                self.destroyed = true;
            }
        }
        if seal.active() {
            self.batch_seal = Some(seal);
        }
        match (changed, after, before) {
            (true, Some(after), _) => self.pending = Some(after),
            (false, _, Some(before)) if self.pending.is_none() => self.hot = Some(before),
            _ => {}
        }
    }

    fn command(&mut self, body: CommandBody) {
        self.n += 1;
        self.now += 1;
        self.feed(Input::Command(Command {
            command_id: format!("c{}", self.n),
            tenant: TENANT.into(),
            run_id: RUN.into(),
            principal: "user:ops".into(),
            roles: vec!["approver".into(), "operator".into()],
            groups: vec![],
            at: self.now,
            body,
        }));
    }

    fn decide(&mut self, who: u8, approve: bool) {
        let Some(run) = self.current() else { return };
        let Some(open) = run
            .interrupts
            .values()
            .find(|i| i.status == sortie_core::state::InterruptStatus::Open)
            .cloned()
        else {
            return;
        };
        self.n += 1;
        self.now += 1;
        self.feed(Input::Command(Command {
            command_id: format!("c{}", self.n),
            tenant: TENANT.into(),
            run_id: RUN.into(),
            principal: format!("user:approver-{who}"),
            roles: vec!["approver".into()],
            groups: vec![],
            at: self.now,
            body: CommandBody::ResumeRun {
                interrupt_id: open.interrupt_id,
                proposal_hash: open.proposal_hash,
                approve,
                payload: Some(json!({"note": format!("ok from {who}")})),
                comment: Some(format!("approver {who} says so")),
                edited_args: None,
            },
        }));
    }

    /// The reducer's view of the run now (uncommitted included).
    fn current(&self) -> Option<RunState> {
        if let Some(state) = &self.pending {
            return Some(state.clone());
        }
        if let Some(hot) = &self.hot {
            return Some(hot.clone());
        }
        let mut cached = self.written.clone()?;
        self.seal().open_all(|f| cached.map_payloads(f)).unwrap();
        Some(cached)
    }

    fn report(&mut self, pick: usize, ok: bool) {
        let Some(run) = self.current() else { return };
        let in_flight: Vec<_> = run
            .steps
            .values()
            .filter(|s| s.status.is_in_flight())
            .cloned()
            .collect();
        if in_flight.is_empty() {
            return;
        }
        let step = &in_flight[pick % in_flight.len()];
        let outcome = if ok {
            StepOutcome::Succeeded {
                output: json!({"refunded": 5, "to": "jane roe"}),
            }
        } else {
            StepOutcome::Failed {
                code: "declined".into(),
                message: "the bank said no to jane roe".into(),
                retryable: false,
                retry_after_ms: None,
            }
        };
        self.now += 1;
        self.feed(Input::StepReport(StepReport {
            spent: None,
            operation_id: step.operation_id.clone(),
            attempt: step.attempt,
            tenant: TENANT.into(),
            run_id: RUN.into(),
            step_id: step.step_id.clone(),
            outcome,
            at: self.now,
        }));
    }

    fn next_timer(&mut self) {
        let Some(run) = self.current() else { return };
        let Some((key, due)) = run.timers.iter().min_by_key(|(_, due)| **due) else {
            return;
        };
        self.now = self.now.max(*due);
        let timer = TimerKey::decode(key).unwrap();
        self.feed(Input::TimerFired {
            run_id: RUN.into(),
            timer,
            at: self.now,
        });
    }

    /// The batch commits: its events, then the run's state sealed with the seal of its
    /// last input; the reducer keeps the state hot.
    fn commit(&mut self) {
        self.history.append(&mut self.pending_events);
        let seal = self.batch_seal.take().unwrap_or(RunSeal::Plain);
        if let Some(state) = self.pending.take() {
            self.written = Some(state.sealed(&seal));
            self.hot = Some(state);
        }
    }

    fn act(&mut self, action: &Action) {
        match action {
            Action::Cancel { reason } => self.command(CommandBody::CancelRun {
                reason: reason.then(|| "jane roe asked us to stop".to_owned()),
            }),
            Action::Decide { who, approve } => self.decide(*who, *approve),
            Action::Report { pick, ok } => self.report(*pick, *ok),
            Action::Wait { ms } => self.now += ms,
            Action::NextTimer => self.next_timer(),
            Action::Delete { later } => {
                // The gateway's view is sortie.run-state: only an ended run is deleted.
                let ended = self
                    .written
                    .as_ref()
                    .is_some_and(|s| s.status.is_terminal());
                if ended {
                    if self.sealing {
                        // The reducer's cache may still hold the key the gateway destroys
                        // now; one destroyed before (a forget it folded) it no longer holds.
                        if !self.destroyed {
                            self.cached_live = true;
                            self.may_cache = true;
                        }
                        self.destroyed = true;
                    }
                    self.forgets.push(*later);
                }
            }
            Action::RawForget => self.command(CommandBody::ForgetRun { reason: None }),
            Action::Commit => self.commit(),
            Action::Cold => {
                self.commit();
                self.hot = None;
            }
            Action::Cache { live } => self.cached_live = *live && self.may_cache,
        }
        // The deletes' ForgetRuns that are due now.
        let due = self.forgets.iter().filter(|later| **later == 0).count();
        self.forgets.retain(|later| *later > 0);
        for later in &mut self.forgets {
            *later -= 1;
        }
        for _ in 0..due {
            self.command(CommandBody::ForgetRun {
                reason: Some("asked".into()),
            });
        }
    }

    /// `audit replay` on what is committed, without the keys and with them.
    fn audit(&self) -> Result<(), String> {
        let seals = [
            None,
            self.sealing.then(|| match self.destroyed {
                true => RunSeal::Destroyed { run_id: RUN.into() },
                false => RunSeal::Key {
                    run_id: RUN.into(),
                    key: self.key.clone(),
                },
            }),
        ];
        for seal in &seals {
            let mut problems = Vec::new();
            let (history, written, sealed) = audit::open_run(
                &self.history,
                self.written.as_ref(),
                seal.as_ref(),
                &mut problems,
            );
            audit::refold(&history, written.as_ref(), sealed, &mut problems);
            if !problems.is_empty() {
                return Err(format!(
                    "{} keys: {problems:?}\nwritten: {}\nhistory: {}",
                    if seal.is_some() { "with" } else { "without" },
                    serde_json::to_string(&self.written).unwrap(),
                    serde_json::to_string(&self.history).unwrap()
                ));
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn audit_replay_agrees_with_the_reducer_however_a_run_is_cancelled_sealed_and_shredded(
        graph in 0usize..GRAPHS.len(),
        sealing in prop::bool::weighted(0.8),
        actions in prop::collection::vec(action(), 1..40),
    ) {
        let id = if graph == 0 { "refund" } else { "kept" };
        let mut sim = Sim::new(id, sealing);
        sim.commit();
        prop_assert!(sim.audit().is_ok(), "{}", sim.audit().unwrap_err());
        for (i, action) in actions.iter().enumerate() {
            sim.act(action);
            if matches!(action, Action::Commit | Action::Cold) {
                if let Err(why) = sim.audit() {
                    prop_assert!(false, "after action {i} ({action:?}): {why}");
                }
            }
        }
        // Everything sent arrives and commits; the audit still agrees.
        for _ in 0..4 {
            sim.act(&Action::Wait { ms: 0 });
        }
        sim.commit();
        if let Err(why) = sim.audit() {
            prop_assert!(false, "at the end: {why}");
        }
    }
}

/// The issue's repro, by hand: cancelled with a reason at its gate (its first step
/// compensated), deleted as soon as it ended.
#[test]
fn a_run_cancelled_with_a_reason_and_deleted_at_once_agrees() {
    let mut sim = Sim::new("refund", true);
    sim.act(&Action::Report { pick: 0, ok: true });
    sim.act(&Action::Commit);
    sim.act(&Action::Cancel { reason: true });
    sim.act(&Action::Report { pick: 0, ok: true });
    sim.act(&Action::Commit);
    assert_eq!(
        sim.written.as_ref().map(|s| s.status),
        Some(sortie_core::RunStatus::Cancelled)
    );
    sim.act(&Action::Delete { later: 0 });
    sim.act(&Action::Commit);
    let state = sim.written.clone().unwrap();
    assert!(
        state.forgotten.is_some() && state.ending.is_some(),
        "{state:?}"
    );
    assert!(sim.destroyed);
    sim.audit().unwrap();
}
