//! Kafka plumbing shared by every Sortie service: client configuration (with SASL/TLS
//! pass-through and the Java-compatible partitioner), the topology in `topology/` and its
//! apply/check against a broker. (The local single-node broker of `sortie dev` and the
//! tests lives in `sortie-devkit`, which no production service links.)
//!
//! This crate knows topics and clients, never run semantics: it must not decode Sortie
//! records or decide anything about runs.

pub mod clock;
mod config;
pub mod fault;
pub mod metrics;
pub mod produce;
pub mod read;
pub mod topology;
pub mod watchdog;
mod watermarks;

pub use config::{KafkaConfig, COMPRESSION, MAX_RECORD_BYTES};
pub use watermarks::{fetch_watermarks, is_transient, list_offsets, End};
