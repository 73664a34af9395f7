//! A run state's [`Measure`] without walking its unchanged steps again.
//!
//! The fold measures every state it writes (`decide::breach`), once per input, and a state
//! holds every step of its run: walking each step's arguments and output again per input
//! made a run of n steps cost O(n²) in measuring, as in writing its JSON (see
//! `state::written`). An input changes one or two steps; [`measure_state`] takes the
//! others' measures from the last time it measured the run.
//!
//! A step's measure is reused only for the very step it was taken of: the same `Arc`.
//! [`MeasuredSteps`] keeps a reference to each, so the step cannot be changed in place
//! (`Arc::make_mut` copies a step another reference points to) and its address cannot be
//! reused: the same `Arc` is the same content, and the same content measures the same.
//! So the answer is [`measure`]'s, whatever the memo holds — a reducer that lost it, or
//! never had it, decides every input the same way.
//!
//! How: the state is walked with its `steps` written as an empty map (`state::written`
//! elides them for the length of the walk), and each step's entry is added to that:
//! `"<id>":<step>` and a comma between entries, its containers two levels below the
//! state's own (the state's object, then the `steps` map).

use std::collections::HashMap;
use std::sync::Arc;

use super::{measure, measure::string_len, measure_written, Measure};
use crate::state::{RunState, Step};

/// The measures of a run's steps as [`measure_state`] last took them, each beside the
/// step it was taken of.
#[derive(Debug, Default)]
pub struct MeasuredSteps {
    steps: HashMap<String, (Arc<Step>, Measure)>,
    /// The steps' JSON bytes, as measured: about what the steps held here take.
    bytes: usize,
}

impl MeasuredSteps {
    /// Steps held.
    pub fn len(&self) -> usize {
        self.steps.len()
    }

    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// The JSON bytes of the steps held, as measured: what a holder of many runs' bounds.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// [`measure`]`(state)`, with the measure of every step `measured` holds unchanged (the
/// same `Arc`) taken from it instead of walked again. `measured` is left holding this
/// state's steps.
pub fn measure_state(state: &RunState, measured: &mut MeasuredSteps) -> Measure {
    let Ok(rest) = crate::state::eliding_steps(|| super::measure::walk(state)) else {
        // Something the walk does not model: the definition, all of it.
        return measure_written(state);
    };
    let mut bytes = rest.bytes + state.steps.len().saturating_sub(1);
    let mut depth = rest.depth;
    let mut steps_bytes = 0;
    for (id, step) in &state.steps {
        let step_measure = match measured.steps.get(id) {
            Some((was, known)) if Arc::ptr_eq(was, step) => *known,
            _ => {
                let fresh = measure(&**step);
                measured.steps.insert(id.clone(), (step.clone(), fresh));
                fresh
            }
        };
        if step_measure.bytes == usize::MAX {
            // Not writable at all (`measure_written`'s answer to a serializer error).
            return step_measure;
        }
        bytes += string_len(id) + 1 + step_measure.bytes;
        steps_bytes += step_measure.bytes;
        depth = depth.max(STEPS_DEPTH + step_measure.depth);
    }
    if measured.steps.len() > state.steps.len() {
        // Steps the state no longer has (a step dropped, or another run's measures).
        measured.steps.retain(|id, _| state.steps.contains_key(id));
    }
    measured.bytes = steps_bytes;
    Measure { bytes, depth }
}

/// How deep a state's `steps` map sits: inside the state's object.
const STEPS_DEPTH: usize = 2;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::StepStatus;
    use proptest::prelude::*;
    use serde_json::{json, Value};

    fn state() -> RunState {
        serde_json::from_value(json!({
            "tenant": "acme", "run_id": "run-1", "graph_id": "g", "graph_version": 1,
            "status": "RUNNING", "version": 1, "last_event_seq": 1, "last_hash": null,
            "created_at": 0, "updated_at": 0, "started_by": "t", "labels": {},
            "input": {"text": "in"}, "deadline_at": null, "steps": {}, "completed": [],
            "interrupts": {}, "timers": {}, "commands": {}, "ending": null, "output": null
        }))
        .expect("state")
    }

    fn step(id: &str, args: Value) -> Step {
        serde_json::from_value(json!({
            "step_id": id, "node": "n", "operation_id": "op", "attempt": 1, "tool": "echo",
            "queue": "default", "side_effect": "pure", "args": args, "role": "Node",
            "status": "in_flight", "output": null, "error": null
        }))
        .expect("step")
    }

    fn nested(depth: usize, leaf: &str) -> Value {
        let mut value = json!(leaf);
        for _ in 0..depth {
            value = json!([value]);
        }
        value
    }

    /// One change to a run: add a step, settle one with an output, drop one.
    #[derive(Debug, Clone)]
    enum Change {
        Add(u8, u8, String),
        Settle(u8, u8, String),
        Drop(u8),
        Input(u8, String),
    }

    fn change() -> impl Strategy<Value = Change> {
        let text = "[a-z\"\\\\\u{0}\u{1f}é ]{0,12}";
        prop_oneof![
            (any::<u8>(), 0u8..140, text).prop_map(|(i, d, t)| Change::Add(i % 8, d, t)),
            (any::<u8>(), 0u8..140, text).prop_map(|(i, d, t)| Change::Settle(i % 8, d, t)),
            any::<u8>().prop_map(|i| Change::Drop(i % 8)),
            (0u8..140, text).prop_map(|(d, t)| Change::Input(d, t)),
        ]
    }

    fn apply(run: &mut RunState, change: &Change) {
        match change {
            Change::Add(i, depth, text) => {
                let id = format!("s{i}\"#1");
                run.steps.insert(
                    id.clone(),
                    Arc::new(step(&id, nested(*depth as usize, text))),
                );
            }
            Change::Settle(i, depth, text) => {
                if let Some(step) = run.steps.get_mut(&format!("s{i}\"#1")) {
                    let step = Arc::make_mut(step);
                    step.status = StepStatus::Succeeded;
                    step.output = Some(nested(*depth as usize, text));
                }
            }
            Change::Drop(i) => {
                run.steps.remove(&format!("s{i}\"#1"));
            }
            Change::Input(depth, text) => run.input = nested(*depth as usize, text),
        }
    }

    proptest! {
        /// Seen red with the entries counted without their commas, with their depth one
        /// level short (`STEPS_DEPTH` 1), and with a step's measure reused by its id alone
        /// (not the same `Arc`).
        #[test]
        fn a_state_measures_the_same_with_its_steps_measures_remembered(
            changes in proptest::collection::vec(change(), 0..40),
        ) {
            let mut run = state();
            let mut measured = MeasuredSteps::default();
            for change in &changes {
                // The fold's copy: unchanged steps shared with the state before it.
                let mut next = run.clone();
                apply(&mut next, change);
                run = next;
                prop_assert_eq!(measure_state(&run, &mut measured), measure(&run));
                prop_assert_eq!(measure(&run), measure_written(&run));
                prop_assert_eq!(measured.len(), run.steps.len());
                let steps_bytes: usize = run.steps.values().map(|s| measure(&**s).bytes).sum();
                prop_assert_eq!(measured.bytes(), steps_bytes);
            }
        }
    }

    #[test]
    fn another_runs_measures_are_never_taken_for_this_ones() {
        let mut a = state();
        let mut b = state();
        a.steps
            .insert("s#1".into(), Arc::new(step("s#1", json!("short"))));
        b.steps.insert(
            "s#1".into(),
            Arc::new(step("s#1", json!("a much longer argument"))),
        );
        let mut measured = MeasuredSteps::default();
        assert_eq!(measure_state(&a, &mut measured), measure(&a));
        assert_eq!(measure_state(&b, &mut measured), measure(&b));
        b.steps.clear();
        assert_eq!(measure_state(&b, &mut measured), measure(&b));
        assert!(measured.is_empty());
    }
}
