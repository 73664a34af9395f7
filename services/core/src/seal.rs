//! Sealed payloads: which values of a run are its payloads, and the hook the fold uses to
//! hash its history over their sealed (encrypted) form.
//!
//! A run's payloads — its input, step arguments and outputs, proposals and their context,
//! decision payloads and edited arguments, a fork's source — may be written to Kafka
//! *sealed*: each replaced by `{"$sealed": "<version>.<base64>"}`, encrypted with the
//! run's data key (`sortie-seal` does the cryptography; this crate does no I/O and holds
//! no key). Everything else — ids, statuses, hashes, timers, budgets, error codes — stays
//! readable, so a reader without the key still sees the run's shape.
//!
//! Sealing is deterministic (the same value, run and key seal to the same bytes), so the
//! fold can hash an event over its sealed form ([`crate::apply_sealed`]): the hash chain
//! then holds over what is in Kafka, and `audit replay --verify` checks it without any
//! key — also after the key was destroyed (crypto-shredding). The fold itself always works
//! on plaintext: the reducer unseals what it reads and seals what it writes.
//!
//! The payload lists here and in [`crate::RunState::forget`] / [`crate::Event::forget`]
//! name the same fields: a payload is what a forgotten run drops.

use std::sync::Arc;

use serde::Deserialize as _;
use serde_json::Value;

use crate::{
    effect::Intent,
    event::{Event, EventBody},
    input::{CommandBody, Input, StepOutcome},
    state::RunState,
};

/// The member naming a sealed value: `{"$sealed": "v1.<base64url>"}`.
pub const SEALED: &str = "$sealed";

/// What a run's payloads look like in Kafka. The fold calls it only to hash events.
pub trait Seal {
    /// The form of `value` written to Kafka. Must be deterministic: the same value (and
    /// run and key) always seals to the same JSON.
    fn seal(&self, value: &Value) -> Value;
    /// Whether [`Seal::seal`] changes anything (`false`: plaintext, nothing to copy).
    fn active(&self) -> bool;
}

/// No sealing: payloads are written as they are (encryption off, or a run started before
/// it was turned on).
#[derive(Debug, Clone, Copy, Default)]
pub struct Plain;

impl Seal for Plain {
    fn seal(&self, value: &Value) -> Value {
        value.clone()
    }
    fn active(&self) -> bool {
        false
    }
}

/// Whether `value` is a sealed payload.
pub fn is_sealed(value: &Value) -> bool {
    sealed_text(value).is_some()
}

/// The ciphertext text of a sealed payload (`"v1.<base64url>"`).
pub fn sealed_text(value: &Value) -> Option<&str> {
    match value {
        Value::Object(map) if map.len() == 1 => map.get(SEALED)?.as_str(),
        _ => None,
    }
}

fn each(value: &mut Option<Value>, f: &mut dyn FnMut(&mut Value)) {
    if let Some(value) = value {
        f(value);
    }
}

/// The prefix of a sealed free text: `"$sealed:v1.<base64url>"`. A run's free texts — an
/// approver's comment, a step's error message, a cancel's or a status change's reason —
/// say as much about the run as its payloads (a refund's reason, a customer's name in an
/// error), and `sortie.run-events` keeps them for ever; so they are sealed like payloads,
/// each kept in its own string field (the schema is unchanged). Ids, codes, statuses
/// and the fold's own rejection sentences stay readable.
pub const SEALED_TEXT: &str = "$sealed:";

/// Hands a free text to `f` as a payload — a plain text as a JSON string, a sealed text as
/// its sealed value — and writes back what `f` leaves as text (a sealed value as a sealed
/// text, a destroyed key's `null` as empty).
fn text(text: &mut String, f: &mut dyn FnMut(&mut Value)) {
    let mut value = match text.strip_prefix(SEALED_TEXT) {
        Some(sealed) => serde_json::json!({ SEALED: sealed }),
        None => Value::String(std::mem::take(text)),
    };
    f(&mut value);
    *text = match value {
        Value::String(plain) => plain,
        Value::Null => String::new(),
        other => match sealed_text(&other) {
            Some(sealed) => format!("{SEALED_TEXT}{sealed}"),
            None => other.to_string(),
        },
    };
}

fn each_text(value: &mut Option<String>, f: &mut dyn FnMut(&mut Value)) {
    if let Some(value) = value {
        text(value, f);
    }
}

/// The payloads inside a `RunStarted.forked_from`: the carried steps' arguments and
/// outputs and the carried interrupts' proposals and decisions — each sealed on its own,
/// like the state they become, so the fork's structure stays readable and `evolve` can
/// carry it over sealed or not.
fn fork_payloads(fork: &mut Value, f: &mut dyn FnMut(&mut Value)) {
    if let Some(steps) = fork.get_mut("steps").and_then(Value::as_object_mut) {
        for step in steps.values_mut() {
            if let Some(args) = step.get_mut("args") {
                f(args);
            }
            if let Some(output) = step.get_mut("output").filter(|v| !v.is_null()) {
                f(output);
            }
        }
    }
    if let Some(interrupts) = fork.get_mut("interrupts").and_then(Value::as_object_mut) {
        for interrupt in interrupts.values_mut() {
            if let Some(proposal) = interrupt.get_mut("proposal") {
                f(proposal);
            }
            for field in ["context", "payload", "edited_args"] {
                if let Some(value) = interrupt.get_mut(field).filter(|v| !v.is_null()) {
                    f(value);
                }
            }
        }
    }
}

impl Event {
    /// Calls `f` on every payload this event carries, its free texts included (each as
    /// a JSON string, see [`SEALED_TEXT`]).
    pub fn map_payloads(&mut self, f: &mut dyn FnMut(&mut Value)) {
        self.map_values(f, true);
    }

    fn map_texts(&mut self, f: &mut dyn FnMut(&mut Value)) {
        match &mut self.body {
            EventBody::StepFailed { message, .. }
            | EventBody::StepOutcomeUnknown { message, .. } => text(message, f),
            EventBody::OperationReconciled { error, .. } => each_text(error, f),
            EventBody::InterruptDecided { comment, .. }
            | EventBody::DecisionBuffered { comment, .. } => each_text(comment, f),
            EventBody::CancelRequested { reason, .. }
            | EventBody::RunStatusChanged { reason, .. } => each_text(reason, f),
            // No free text of a person's or a receiver's: the fold's own words (an
            // answer's reason, an interrupt's reason from the graph, a forget's reason),
            // ids, counts and payloads (sealed in `map_values`). Every kind is named, so
            // a new event with free text is a compile error here, not a text shipped
            // unsealed.
            EventBody::CommandAccepted { .. }
            | EventBody::CommandRejected { .. }
            | EventBody::RunStarted { .. }
            | EventBody::StepDispatched { .. }
            | EventBody::StepStarted { .. }
            | EventBody::StepSucceeded { .. }
            | EventBody::Interrupted { .. }
            | EventBody::InterruptEscalated { .. }
            | EventBody::InterruptExpired { .. }
            | EventBody::RunForgotten { .. }
            | EventBody::SignalWaitOpened { .. }
            | EventBody::SignalReceived { .. }
            | EventBody::SignalBuffered { .. }
            | EventBody::SignalWaitExpired { .. }
            | EventBody::BudgetReserved { .. }
            | EventBody::BudgetSettled { .. } => {}
        }
    }

    fn map_values(&mut self, f: &mut dyn FnMut(&mut Value), texts: bool) {
        if texts {
            self.map_texts(f);
        }
        match &mut self.body {
            EventBody::RunStarted {
                input, forked_from, ..
            } => {
                f(input);
                if let Some(fork) = forked_from {
                    fork_payloads(fork, f);
                }
            }
            EventBody::StepDispatched { args, .. } => f(args),
            EventBody::StepSucceeded { output, .. } => f(output),
            EventBody::OperationReconciled { output, .. } => each(output, f),
            EventBody::Interrupted {
                proposal, context, ..
            } => {
                f(proposal);
                each(context, f);
            }
            EventBody::InterruptDecided {
                payload,
                edited_args,
                ..
            }
            | EventBody::DecisionBuffered {
                payload,
                edited_args,
                ..
            } => {
                each(payload, f);
                each(edited_args, f);
            }
            EventBody::RunStatusChanged { output, .. } => each(output, f),
            EventBody::SignalReceived { payload, .. }
            | EventBody::SignalBuffered { payload, .. } => f(payload),
            // Budgets are counts, not payloads: never sealed.
            EventBody::SignalWaitOpened { .. }
            | EventBody::SignalWaitExpired { .. }
            | EventBody::BudgetReserved { .. }
            | EventBody::BudgetSettled { .. } => {}
            EventBody::CommandAccepted { .. }
            | EventBody::CommandRejected { .. }
            | EventBody::StepStarted { .. }
            | EventBody::StepFailed { .. }
            | EventBody::StepOutcomeUnknown { .. }
            | EventBody::InterruptEscalated { .. }
            | EventBody::InterruptExpired { .. }
            | EventBody::CancelRequested { .. }
            | EventBody::RunForgotten { .. } => {}
        }
    }

    /// This event as written to Kafka under `seal`.
    pub fn sealed(&self, seal: &dyn Seal) -> Event {
        sealed_copy(self, Event::map_payloads, seal)
    }

    /// This event as a build that did not seal free texts wrote it under `seal` (its
    /// payloads sealed, its texts plain): what the hash of an event written before texts
    /// were sealed was taken over.
    pub fn sealed_before_texts(&self, seal: &dyn Seal) -> Event {
        sealed_copy(self, |e, f| e.map_values(f, false), seal)
    }
}

/// A type's `map_payloads`.
type MapPayloads<T> = fn(&mut T, &mut dyn FnMut(&mut Value));

/// `value` with every payload sealed (a plain copy when `seal` changes nothing).
fn sealed_copy<T: Clone>(value: &T, map: MapPayloads<T>, seal: &dyn Seal) -> T {
    let mut copy = value.clone();
    if seal.active() {
        map(&mut copy, &mut |v| *v = seal.seal(v));
    }
    copy
}

impl RunState {
    /// Calls `f` on every payload the state holds.
    pub fn map_payloads(&mut self, f: &mut dyn FnMut(&mut Value)) {
        f(&mut self.input);
        each(&mut self.output, f);
        // `forked_from` in a state is only the source's {run_id, version}.
        for step in self.steps.values_mut() {
            let step = Arc::make_mut(step);
            f(&mut step.args);
            each(&mut step.output, f);
            each_text(&mut step.error, f);
        }
        if let Some(ending) = &mut self.ending {
            text(&mut ending.reason, f);
        }
        for interrupt in self.interrupts.values_mut() {
            f(&mut interrupt.proposal);
            each(&mut interrupt.context, f);
            each(&mut interrupt.payload, f);
            each(&mut interrupt.edited_args, f);
        }
        for decision in &mut self.buffered {
            each(&mut decision.payload, f);
            each(&mut decision.edited_args, f);
            each_text(&mut decision.comment, f);
        }
        for wait in self.waits.values_mut() {
            for signal in &mut wait.received {
                f(&mut signal.payload);
            }
        }
        for early in &mut self.early_signals {
            f(&mut early.payload);
        }
    }

    /// This state as written to Kafka (and sled) under `seal`.
    pub fn sealed(&self, seal: &dyn Seal) -> RunState {
        sealed_copy(self, RunState::map_payloads, seal)
    }
}

impl Intent {
    /// Calls `f` on the intent's payload: its arguments.
    pub fn map_payloads(&mut self, f: &mut dyn FnMut(&mut Value)) {
        f(&mut self.args);
    }

    /// This intent as written to Kafka under `seal`.
    pub fn sealed(&self, seal: &dyn Seal) -> Intent {
        sealed_copy(self, Intent::map_payloads, seal)
    }
}

impl Input {
    /// Calls `f` on every payload the input carries (a fork's source state included).
    pub fn map_payloads(&mut self, f: &mut dyn FnMut(&mut Value)) {
        match self {
            Input::Command(command) => match &mut command.body {
                CommandBody::StartRun { input, fork, .. } => {
                    f(input);
                    // A fork's source state is carried as the new run's payloads.
                    if let Some(fork) = fork {
                        if let Ok(mut state) = RunState::deserialize(&fork.state) {
                            state.map_payloads(f);
                            if let Ok(value) = serde_json::to_value(&state) {
                                fork.state = value;
                            }
                        }
                        for event in fork.history.iter_mut().flatten() {
                            event.map_payloads(f);
                        }
                    }
                }
                CommandBody::ResumeRun {
                    payload,
                    edited_args,
                    comment,
                    ..
                } => {
                    each(payload, f);
                    each(edited_args, f);
                    each_text(comment, f);
                }
                CommandBody::ReconcileOperation { output, error, .. } => {
                    each(output, f);
                    each_text(error, f);
                }
                CommandBody::CancelRun { reason } => each_text(reason, f),
                // Why a run was forgotten stays readable: it is the audit summary's.
                CommandBody::ForgetRun { .. } => {}
                CommandBody::SignalRun { payload, .. } => f(payload),
            },
            Input::StepReport(report) => {
                if let StepOutcome::Succeeded { output } = &mut report.outcome {
                    f(output);
                }
            }
            Input::TimerFired { .. } => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Seals a value as `{"$sealed": "t.<its JSON>"}`: deterministic, visible in tests.
    struct Tagged;
    impl Seal for Tagged {
        fn seal(&self, value: &Value) -> Value {
            json!({ SEALED: format!("t.{value}") })
        }
        fn active(&self) -> bool {
            true
        }
    }

    #[test]
    fn free_texts_are_sealed_in_their_string_fields_and_old_hashes_still_derive() {
        let event = Event {
            tenant: "t".into(),
            run_id: "r".into(),
            seq: 3,
            state_version: 3,
            at: 5,
            command_id: Some("c".into()),
            operation_id: None,
            prev_hash: Some("h".into()),
            hash: None,
            body: EventBody::InterruptDecided {
                interrupt_id: "i".into(),
                proposal_hash: "p".into(),
                approve: true,
                decided_by: "user:alice".into(),
                payload: None,
                comment: Some("Jane Roe called".into()),
                is_final: true,
                edited_args: None,
            },
        };
        let sealed = event.sealed(&Tagged);
        let EventBody::InterruptDecided { comment, .. } = &sealed.body else {
            panic!("body changed kind");
        };
        assert_eq!(
            comment.as_deref(),
            Some("$sealed:t.\"Jane Roe called\""),
            "sealed in its own field"
        );
        // Opening hands the sealed text over as a sealed value, and writes back text.
        let mut opened = sealed.clone();
        opened.map_payloads(&mut |v| {
            if let Some(text) = sealed_text(v) {
                let inner = text.strip_prefix("t.").unwrap_or_default();
                *v = serde_json::from_str(inner).unwrap_or(Value::Null);
            }
        });
        assert_eq!(opened, event);
        // An event written before texts were sealed: its payloads sealed, its texts not.
        let before = event.sealed_before_texts(&Tagged);
        assert_eq!(before.body, event.body, "no payload in this one");
        assert_ne!(before.compute_hash(), sealed.compute_hash());
    }

    #[test]
    fn a_sealed_value_is_one_member_holding_text() {
        assert!(is_sealed(&json!({"$sealed": "v1.abc"})));
        assert!(!is_sealed(&json!({"$sealed": "v1.abc", "x": 1})));
        assert!(!is_sealed(&json!({"$sealed": 1})));
        assert!(!is_sealed(&json!("v1.abc")));
    }

    #[test]
    fn sealing_an_event_keeps_its_structure_and_hides_its_payloads() {
        let event = Event {
            tenant: "t".into(),
            run_id: "r".into(),
            seq: 2,
            state_version: 2,
            at: 5,
            command_id: None,
            operation_id: Some("op".into()),
            prev_hash: Some("h".into()),
            hash: None,
            body: EventBody::StepSucceeded {
                step_id: "a#1".into(),
                attempt: 1,
                output: json!({"secret": 42}),
            },
        };
        let sealed = event.sealed(&Tagged);
        let EventBody::StepSucceeded {
            step_id, output, ..
        } = &sealed.body
        else {
            panic!("body changed kind");
        };
        assert_eq!(step_id, "a#1");
        assert!(is_sealed(output));
        assert_ne!(sealed.compute_hash(), event.compute_hash());
        assert_eq!(event.sealed(&Plain), event);
    }
}
