//! Sortie's stateless step executors: they consume `sortie.intents.<queue>`, run the
//! node's handler, and report a `StepResult` on the run's canonical partition of
//! `sortie.step-results`. Built-in handlers (`http`, `llm`, `echo`, `sleep`) and the
//! [`StepHandler`] trait for users' own live here, with the side-effect contract of SPEC
//! §4.2. (The ledger, the receiver that tests and the dev stack call, lives in
//! `sortie-devkit`, which no production service links.)
//!
//! The built-in handlers connect only where the [`egress`] policy allows: by default no
//! loopback, private, link-local or other non-public address, checked on the address
//! connected to; an operator allows more, for every tenant or for one.
//!
//! An executor never touches run state and never retries on its own: it makes one
//! request per attempt, reports what happened (a typed [`HandlerError`] says whether the
//! outcome is a retryable failure, a permanent one, or unknown), and the reducer decides.
//!
//! The contract per side-effect class, as this crate implements it:
//!
//! | class | before the call | intent offset committed |
//! |---|---|---|
//! | `pure`, `idempotent`, `keyed` | nothing | after the result is delivered |
//! | `reconcilable` | ask the receiver ([`StepHandler::lookup`]); report a known outcome without calling; otherwise record `STARTED` | after `STARTED` is delivered, before the call |
//! | `unsafe` | record `STARTED` | after `STARTED` is delivered, before the call |
//!
//! So a crash after an `unsafe` or `reconcilable` call can never lead to a second, silent
//! call: the intent is not redelivered, the reducer's step timeout notices the lost
//! attempt, and either an operator (`unsafe`) or a status lookup (`reconcilable`) settles
//! it. A lookup that does not find the operation settles nothing on a later attempt (the
//! outcome stays unknown, for an operator) unless the node's config says
//! `lookup_authoritative: true`. See [`runtime`] for the offset-commit design.
//!
//! With a blob store (`ExecutorConfig::blobs`), blob references in an intent's arguments
//! are fetched, checked (size, SHA-256, tenant) and projected before anything else
//! happens, so handlers see plain JSON and a tampered or lost blob fails the step without
//! a call; an output over the threshold is stored before its result is produced and
//! reported by reference (`sortie-blob`).

pub mod command;
pub mod egress;
pub mod fair;
pub mod fault;
pub mod handler;
pub mod handlers;
pub mod health;
pub mod metrics;
pub mod progress;
pub mod runtime;
pub mod secrets;
mod tracker;

pub use egress::Egress;
pub use fault::FaultPoint;
pub use handler::{Call, HandlerError, Handlers, Lookup, StepHandler};
pub use progress::{Delta, Progress};
pub use runtime::{run, run_with_health, Error, ExecutorConfig};
/// Re-exported so a user's executor binary needs only this crate.
pub use sortie_kafka::KafkaConfig;
/// Re-exported so a user's executor binary needs only this crate.
pub use sortie_wire::Topics;
