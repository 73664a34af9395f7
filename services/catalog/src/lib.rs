//! The graph registry (SPEC §4.1): publishing mission graphs to `sortie.graphs` and the
//! global table every reducer and gateway builds from it.
//!
//! `sortie.graphs` is compacted and keyed `graph_id@version`, or `tenant/graph_id@version`
//! for a graph that belongs to one tenant (the record's `tenant`; see
//! `sortie_core::Graphs` for how starts resolve them). Versions are immutable: a
//! publisher reads the table first and refuses a different definition for a version that
//! exists, and the table keeps the first definition it reads for a version and skips any
//! later, different one. The table reads every partition from the beginning,
//! `read_committed`, with `assign()` and no group membership, so every instance sees every
//! graph and nothing is ever committed.
//!
//! Two publishers racing on the same new version can both pass the check; the table then
//! keeps the lower offset, while compaction keeps the latest record per key. Publishing is
//! an operator action (one CLI at a time), so this is accepted rather than guarded.
//!
//! **Signed graphs.** A graph's gates, roles, receiver URLs and side-effect classes are a
//! trust root: whoever writes `sortie.graphs` decides what runs ungated. A publication is
//! signed like a command (`sortie_wire::signing`: headers over the record's exact value
//! bytes) by a key with `publisher: true`, as the record's `published_by`, for its tenant.
//! With a [`Trust`], a table refuses a record whose signature does not hold, and with
//! `require` an unsigned one too — skipped, logged and counted like any untrustworthy
//! record, never fatal. A refused record never takes a version: a signed definition read
//! later still gets it. The keyring is the one in the table's [`Trust`] when the record is
//! read; a key withdrawn later refuses its graphs to readers that start afterwards (sign
//! the versions you keep again with a current key: `publish` does, as the same definition).
//!
//! Here: the crate's [`Error`] and [`Trust`]. Publishing is in `publish` (and `pin`), the
//! table in `table` over its `reader`, loading graph files in `load`.

use std::path::PathBuf;
use std::time::Duration;

use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, OwnedMessage};
use rdkafka::Message;
use sortie_core::graph::InvalidGraph;
use sortie_wire::records::GraphDefinition;
use sortie_wire::signing::Keyring;
use sortie_wire::{DecodeError, EncodeError};

mod load;
mod pin;
mod publish;
mod reader;
mod table;

pub use load::{load_dir, load_file};
pub use pin::pin;
pub use publish::{definition_hash, definition_record, publish, publish_signed, Published};
pub use table::{GraphTable, Publication};

/// Why publishing, reading or loading graphs failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The version exists with another definition; a changed graph needs a new version.
    #[error(
        "{key} is already published with a different definition; published versions are \
         immutable, so give the changed graph a new version"
    )]
    VersionExists { key: String },
    /// A version that does not fit the wire format's `int`.
    #[error("{key}: version {version} is too large (at most {max})", max = i32::MAX)]
    VersionOutOfRange { key: String, version: u32 },
    /// A graph file or folder could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A graph file does not parse or does not validate; every problem is listed.
    #[error("{}: {source}", path.display())]
    InvalidFile { path: PathBuf, source: InvalidGraph },
    /// The graphs topic does not exist.
    #[error("topic {0} does not exist; create it with `sortie topology apply`")]
    MissingTopic(String),
    #[error("kafka failed while {doing}: {source}")]
    Kafka { doing: String, source: KafkaError },
    #[error("cannot encode the graph definition: {0}")]
    Encode(#[from] EncodeError),
    /// The schema registry stayed unreachable; the record is kept and decoded again later.
    #[error("cannot decode graph definitions from {topic}: {source}")]
    RegistryUnavailable { topic: String, source: DecodeError },
    /// The signing key or keyring could not be used.
    #[error("signing: {0}")]
    Signing(String),
    #[error("timed out after {timeout:?} reading {topic} up to the offsets captured at the start")]
    Timeout { topic: String, timeout: Duration },
    /// The runtime shut down while the table was being read.
    #[error("reading {0} was cancelled")]
    Cancelled(String),
    /// An MCP server's tools could not be listed for pinning.
    #[error("{key}: listing the tools of MCP server {server} failed: {source}")]
    McpList {
        key: String,
        server: String,
        source: sortie_mcp::Error,
    },
    /// An MCP server's auth names a variable that is no secret (`SORTIE_SECRET_…`).
    #[error("{key}: MCP server {server}: auth.env {env} is not a secret variable (SORTIE_SECRET_<tenant>__<NAME>); it is not read")]
    McpSecretName {
        key: String,
        server: String,
        env: String,
    },
    /// The environment variable an MCP server's auth names is not set for the publisher.
    #[error("{key}: MCP server {server} needs the environment variable {env} (its auth) to list its tools")]
    McpSecret {
        key: String,
        server: String,
        env: String,
    },
    /// The pinned list does not make a valid graph (a tool the graph offers is missing,
    /// a name clashes with a node, a listing over the bounds).
    #[error("{key}: with the tools its MCP servers list: {source}")]
    McpPinned { key: String, source: InvalidGraph },
}

fn kafka_error(doing: impl Into<String>) -> impl FnOnce(KafkaError) -> Error {
    let doing = doing.into();
    move |source| Error::Kafka { doing, source }
}
/// Which graph records a table takes: those a publisher key of `keyring` signed; with
/// `require`, unsigned ones are refused too (a present but bad signature always is).
#[derive(Debug, Clone, Default)]
pub struct Trust {
    pub keyring: Keyring,
    pub require: bool,
}

impl Trust {
    /// The key that signed `message` (decoded as `record`), or why it is not trusted.
    fn check(
        &self,
        message: &OwnedMessage,
        record: &GraphDefinition,
    ) -> Result<Option<String>, String> {
        let headers = message.headers();
        let pairs = headers
            .into_iter()
            .flat_map(|h| h.iter().map(|header| (header.key, header.value)));
        match self.keyring.check_graph(
            pairs,
            message.payload().unwrap_or_default(),
            record.tenant.as_deref(),
            &record.published_by,
        ) {
            Ok(None) if self.require => {
                Err("it is not signed, and signed graphs are required".into())
            }
            Ok(signed) => Ok(signed),
            Err(reason) => Err(format!("its signature does not hold: {reason}")),
        }
    }
}
