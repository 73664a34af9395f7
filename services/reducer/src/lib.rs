//! The reducer: folds commands and step results into run state with exactly-once
//! semantics. It consumes the assigned partitions `read_committed`, applies a batch with
//! `sortie-core`'s pure fold, and in ONE Kafka transaction produces intents, run events,
//! run-state records and the consumed offsets. sled is a cache written only after the
//! transaction commits; Kafka is the truth and can always rebuild it.
//!
//! The reducer never calls a receiver and never reads a clock inside the fold: the only
//! clock it reads is for due timers, whose firing is itself an input recorded in history.

pub mod audit;
mod batch;
mod cache;
mod convoy;
/// The wire ↔ domain mapping now lives in `sortie-model`; re-exported so the reducer
/// (and its callers) keep their paths.
pub use sortie_model as convert;
pub mod driver;
mod engine;
pub mod fault;
mod fork;
pub mod gauges;
/// The graph catalog now lives in `sortie-catalog`, shared with the gateway and bench.
pub use sortie_catalog as graphs;
pub mod health;
mod input;
mod keyring;
pub mod metrics;
pub mod pack;
mod per_run;
mod queues;
mod replay_window;
pub mod restore;
mod sealing;
pub mod store;
mod tasks;
mod txn;
/// The watchdog on librdkafka's blocking calls, shared with the executor.
pub use sortie_kafka::watchdog;
