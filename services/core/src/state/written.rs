//! A run state's JSON written again without writing its unchanged steps again.
//!
//! The reducer writes a run's whole state (JSON inside the changelog record) after every
//! input that changed it, and a state holds every step the run took: writing each step's
//! arguments and output again per input made a run of n steps cost O(n²) in JSON. An
//! input changes one or two steps; [`RunState::to_json_reusing`] copies the others' JSON
//! from the previous write. Per write (`cargo run --release -p sortie-core --example
//! state_write`, 256-byte payloads): even at 5 steps, 2× faster at 50, 3× at 200.
//!
//! A step's JSON is reused only for the very step it was written from: the same `Arc`.
//! [`WrittenSteps`] keeps a reference to each, so the step cannot be changed in place
//! (`Arc::make_mut` copies a step another reference points to, and `Arc::get_mut` refuses
//! it) and its address cannot be reused: the same `Arc` is the same content.
//!
//! How: the state is written by serde_json as always; its `steps` field is written by
//! [`serialize`], which finds the previous write's JSON in a thread-local that only
//! [`RunState::to_json_reusing`] fills, for the duration of its own `serde_json` call —
//! every other serializer (the fold's measuring walk, `serde_json::to_value`, ...) finds
//! it empty and writes the steps as derived — or as an empty map while [`eliding_steps`]
//! runs (`limits::measure_state` adds the steps' measures itself). The reused JSON goes
//! out as a [`RawValue`], which serde_json writes verbatim.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::sync::Arc;

use serde::ser::{Error as _, SerializeMap};
use serde::{Serialize, Serializer};
use serde_json::value::RawValue;

use super::{RunState, Step};

/// The JSON of a run's steps as last written by [`RunState::to_json_reusing`], each
/// beside the step it was written from.
#[derive(Debug, Default)]
pub struct WrittenSteps {
    steps: BTreeMap<String, (Arc<Step>, Box<RawValue>)>,
    bytes: usize,
    /// The length of the last state written: the next write's buffer starts this big.
    last: usize,
}

impl WrittenSteps {
    /// Bytes of JSON held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

thread_local! {
    static REUSING: RefCell<Option<WrittenSteps>> = const { RefCell::new(None) };
    /// Set by [`eliding_steps`]: a state's `steps` are written as an empty map.
    static ELIDING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with every run state's `steps` serialized as an empty map: how
/// `limits::measure_state` measures a state apart from its steps, which it adds from what
/// it remembers of them. Reset however `f` ends.
pub(crate) fn eliding_steps<T>(f: impl FnOnce() -> T) -> T {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            ELIDING.with(|e| e.set(false));
        }
    }
    ELIDING.with(|e| e.set(true));
    let _reset = Reset;
    f()
}

/// Empties [`REUSING`] however the write ends (a panic in a `Serialize` included), so no
/// later serializer on this thread finds it filled.
struct Clear;

impl Drop for Clear {
    fn drop(&mut self) {
        REUSING.with(|r| r.borrow_mut().take());
    }
}

impl RunState {
    /// `serde_json::to_string(self)`, byte for byte, with the JSON of every step that
    /// `written` holds unchanged (the same `Arc`) copied from it instead of written again.
    /// `written` is left holding this write's steps.
    pub fn to_json_reusing(&self, written: &mut WrittenSteps) -> serde_json::Result<String> {
        let mut buffer = Vec::with_capacity(written.last + written.last / 8 + 256);
        REUSING.with(|r| *r.borrow_mut() = Some(std::mem::take(written)));
        let _clear = Clear;
        serde_json::to_writer(&mut buffer, self)?;
        if let Some(steps) = REUSING.with(|r| r.borrow_mut().take()) {
            *written = steps;
        }
        written.last = buffer.len();
        // serde_json writes UTF-8 only (its `to_string` skips this check).
        String::from_utf8(buffer).map_err(|e| serde_json::Error::custom(e.to_string()))
    }
}

/// Writes a state's `steps` (see the module): as derived, unless
/// [`RunState::to_json_reusing`] is writing.
pub(super) fn serialize<S: Serializer>(
    steps: &BTreeMap<String, Arc<Step>>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    // Taken out: whatever this write calls meets an empty thread-local.
    let Some(mut written) = REUSING.with(|r| r.borrow_mut().take()) else {
        if ELIDING.with(Cell::get) {
            return serializer.serialize_map(Some(0))?.end();
        }
        return steps.serialize(serializer);
    };
    let mut map = serializer.serialize_map(Some(steps.len()))?;
    let mut held = 0;
    for (id, step) in steps {
        match written.steps.get_mut(id) {
            Some((was, _)) if Arc::ptr_eq(was, step) => {}
            Some(entry) => {
                let json = serde_json::value::to_raw_value(&**step).map_err(S::Error::custom)?;
                written.bytes = written.bytes - entry.1.get().len() + json.get().len();
                *entry = (step.clone(), json);
            }
            None => {
                let json = serde_json::value::to_raw_value(&**step).map_err(S::Error::custom)?;
                written.bytes += id.len() + json.get().len();
                written.steps.insert(id.clone(), (step.clone(), json));
            }
        }
        held += 1;
        map.serialize_entry(id, &*written.steps[id].1)?;
    }
    if held != written.steps.len() {
        // Steps the state no longer has (another run's state written with this one's).
        written.steps.retain(|id, _| steps.contains_key(id));
        written.bytes = written
            .steps
            .iter()
            .map(|(id, (_, json))| id.len() + json.get().len())
            .sum();
    }
    REUSING.with(|r| *r.borrow_mut() = Some(written));
    map.end()
}
