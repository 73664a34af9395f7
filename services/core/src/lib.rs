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

pub mod blob;
pub mod budget;
pub mod child;
pub mod conversation;
pub mod converse;
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
pub mod secret;
pub mod shadow;
pub mod signal;
pub mod state;
pub mod status;

pub use decide::{apply, apply_measured, apply_sealed, refuse, Applied};
pub use effect::{Effect, Intent, TimerKey};
pub use event::{Event, EventBody};
pub use evolve::evolve;
pub use graph::{Graph, GraphError, GraphRef, Graphs, Node, SideEffect};
pub use input::{Command, CommandBody, Input, StepOutcome, StepReport};
pub use seal::{Plain, Seal};
pub use state::{Forgotten, RunState};
pub use status::RunStatus;
