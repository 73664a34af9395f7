//! Sortie's hostile-input campaign: what it sends to every entry point and what it
//! checks. `decoders` holds the targets for the parsers (Avro bodies, the wire ↔ model
//! mapping, graph YAML, signature headers, canonical JSON), each run over a committed
//! seed corpus and seeded mutations of it (`mutate`) by the suite, and by cargo-fuzz.
//! `kafka` draws hostile records for the reducer's input topics and `campaign` runs them
//! against a live stack with a canary tenant, and `tenancy` an attacker tenant's every
//! escape against a victim tenant; `http` draws hostile requests for every
//! route of the gateway's OpenAPI document and judges each answer. `values` holds the
//! hostile values they share.
//!
//! Dev and test machinery: no production service links this crate.

pub mod campaign;
pub mod decoders;
pub mod http;
pub mod kafka;
pub mod mutate;
mod produce;
pub mod tenancy;
pub mod values;
