//! Sortie's public contract on the wire: the Rust types of every topic's Avro value
//! (`schemas/*.avsc` are the source of truth and are embedded here), their encoding in the
//! Confluent wire format through a schema registry, the canonical partitioner
//! (`murmur2(key) % n`, identical to the Java client's default), and topic names.
//!
//! This crate converts bytes to types and back, once, at the edge. It performs no Kafka
//! I/O (it reads rdkafka's message type only to build dead letters) and holds no run semantics: whether a decoded record makes sense is the caller's
//! business; whether it decodes at all is this crate's, and the answer is a typed
//! [`DecodeError`] the caller can dead-letter.

mod codec;
pub mod dead_letter;
mod partitioner;
pub mod records;
mod resolve;
mod schemas;
pub mod signing;
mod topics;
pub mod trace;

/// The header naming an intent's tenant, written by the reducer so that an executor can
/// share a queue's slots between tenants before it decodes anything.
pub const TENANT_HEADER: &str = "sortie-tenant";

pub use codec::{from_datum, to_datum, Codec, CodecConfig, DecodeError, EncodeError};
pub use partitioner::{murmur2, partition_for};
pub use records::Record;
pub use schemas::RecordKind;
pub use topics::Topics;
pub use trace::TraceContext;
