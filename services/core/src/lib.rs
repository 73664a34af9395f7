//! The core of Sortie: ids, the graph model, and the run state machine as a pure fold.
//!
//! [`apply`] takes a run's state, one input and the published graphs, and returns the
//! effects (events to emit, intents to dispatch, timers to arm or disarm) and the new
//! state. It performs no I/O, reads no clock and draws no random number: "now" is the
//! input's timestamp and every id is derived. The same state and input always give the
//! same effects, which is what lets the reducer re-run a batch after an aborted
//! transaction and lets auditors re-fold a history and get the same state.
//!
//! State is event-sourced: [`decide`] turns an input into events, and [`evolve`] folds an
//! event into the state. Everything the state knows came from an event, so folding a
//! run's history reproduces its state at any version.

/// The `Serializer` methods that serde_json writes as what they wrap (an option's value,
/// a newtype's inner value) or as another kind (a unit struct as unit, a unit variant as
/// its name), for a serializer whose `Error` is `$err`.
macro_rules! serialize_as_serde_json_does {
    ($err:ty) => {
        fn serialize_some<T: serde::Serialize + ?Sized>(self, value: &T) -> Result<(), $err> {
            value.serialize(self)
        }
        fn serialize_unit_struct(self, _: &'static str) -> Result<(), $err> {
            serde::Serializer::serialize_unit(self)
        }
        fn serialize_unit_variant(
            self,
            _: &'static str,
            _: u32,
            variant: &'static str,
        ) -> Result<(), $err> {
            serde::Serializer::serialize_str(self, variant)
        }
        fn serialize_newtype_struct<T: serde::Serialize + ?Sized>(
            self,
            _: &'static str,
            value: &T,
        ) -> Result<(), $err> {
            value.serialize(self)
        }
    };
}

/// The `Serializer` methods of a map-key serializer for what serde_json refuses as a key
/// or writes by a rule the caller does not model (bools and floats as quoted text):
/// each returns `Err($err)` so the caller leaves the value to serde_json.
macro_rules! refuse_unmodelled_keys {
    ($ok:ty, $err:ty, $refused:expr) => {
        fn serialize_bool(self, _: bool) -> Result<$ok, $err> {
            Err($refused)
        }
        fn serialize_f32(self, _: f32) -> Result<$ok, $err> {
            Err($refused)
        }
        fn serialize_f64(self, _: f64) -> Result<$ok, $err> {
            Err($refused)
        }
        fn serialize_bytes(self, _: &[u8]) -> Result<$ok, $err> {
            Err($refused)
        }
        fn serialize_none(self) -> Result<$ok, $err> {
            Err($refused)
        }
        fn serialize_some<T: serde::Serialize + ?Sized>(self, _: &T) -> Result<$ok, $err> {
            Err($refused)
        }
        fn serialize_unit(self) -> Result<$ok, $err> {
            Err($refused)
        }
        fn serialize_unit_struct(self, _: &'static str) -> Result<$ok, $err> {
            Err($refused)
        }
        fn serialize_newtype_variant<T: serde::Serialize + ?Sized>(
            self,
            _: &'static str,
            _: u32,
            _: &'static str,
            _: &T,
        ) -> Result<$ok, $err> {
            Err($refused)
        }
        fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, $err> {
            Err($refused)
        }
        fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, $err> {
            Err($refused)
        }
        fn serialize_tuple_struct(
            self,
            _: &'static str,
            _: usize,
        ) -> Result<Self::SerializeTupleStruct, $err> {
            Err($refused)
        }
        fn serialize_tuple_variant(
            self,
            _: &'static str,
            _: u32,
            _: &'static str,
            _: usize,
        ) -> Result<Self::SerializeTupleVariant, $err> {
            Err($refused)
        }
        fn serialize_map(self, _: Option<usize>) -> Result<Self::SerializeMap, $err> {
            Err($refused)
        }
        fn serialize_struct(
            self,
            _: &'static str,
            _: usize,
        ) -> Result<Self::SerializeStruct, $err> {
            Err($refused)
        }
        fn serialize_struct_variant(
            self,
            _: &'static str,
            _: u32,
            _: &'static str,
            _: usize,
        ) -> Result<Self::SerializeStructVariant, $err> {
            Err($refused)
        }
    };
}

#[cfg(test)]
mod arbitrary;
pub mod blob;
pub mod budget;
pub mod conversation;
pub mod decide;
pub mod duration;
pub mod effect;
pub mod event;
pub mod evolve;
pub mod graph;
pub mod ids;
pub mod input;
pub mod json;
pub mod limits;
pub mod mcp;
pub mod seal;
pub mod shadow;
pub mod state;
pub mod status;

pub use decide::{apply, apply_sealed, refuse, Applied};
pub use effect::{Effect, Intent, TimerKey};
pub use event::{Event, EventBody};
pub use evolve::evolve;
pub use graph::{Graph, GraphError, GraphRef, Graphs, Node, SideEffect};
pub use input::{Command, CommandBody, Input, StepOutcome, StepReport};
pub use seal::{Plain, Seal};
pub use state::{Forgotten, RunState};
pub use status::RunStatus;
