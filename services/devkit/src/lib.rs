//! Sortie's dev and test machinery: the local single-node Kafka broker launcher
//! ([`local`]), the ledger that records every side effect a receiver is asked for
//! ([`ledger`]), and the dev receiver that answers the example graphs' URLs
//! ([`receiver`]), with the scripted fake OpenAI-compatible model the `llm` examples
//! call ([`model`]). `sortie dev`, `sortie broker`, `sortie ledger`, the bench and the
//! test suites use it.
//!
//! Production services (`sortie-executor`, `sortie-gateway`, `sortie-reducer`,
//! `sortie-kafka`) must never depend on this crate: it spawns JVMs, writes fsynced files
//! and answers fake payments. `tests/tests/deps.rs` keeps it so.

pub mod ledger;
pub mod local;
pub mod mcp;
pub mod model;
pub mod receiver;
