//! Sortie's topic topology (`topology/topics.yaml`): loading and validation, the
//! difference between the declared topics and a broker, and `apply`, which creates missing
//! topics and fixes config drift but never changes a partition count.
//!
//! The yaml is the whole truth for the topic-level configs of the topics it declares:
//! `apply` sends the full declared set with (non-incremental) AlterConfigs, which also
//! resets any other per-topic override to the broker default, and `diff` reports such
//! overrides as [`Difference::Undeclared`] so that `check` and `apply` agree.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::admin::{
    AdminClient, AdminOptions, AlterConfig, ConfigSource, NewTopic, OwnedResourceSpecifier,
    ResourceSpecifier, TopicReplication,
};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use serde::Deserialize;
use serde_yaml::Value;

use crate::KafkaConfig;

mod admin;
mod diff;
mod model;
#[cfg(test)]
mod tests;

use admin::Admin;
pub use diff::{ApplyReport, Difference, Failure};
use model::{resolve, same_config, File};

/// Where the topology lives, relative to the workspace root.
pub const DEFAULT_PATH: &str = "topology/topics.yaml";

/// How long one admin request, and waiting for its effect, may take.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(30);
const POLL_INTERVAL: Duration = Duration::from_millis(100);

const CLEANUP_POLICY: &str = "cleanup.policy";
const RETENTION_MS: &str = "retention.ms";
const MIN_INSYNC_REPLICAS: &str = "min.insync.replicas";
const QUEUE_PLACEHOLDER: &str = "{queue}";
/// Kafka's limit on topic name length.
const MAX_TOPIC_NAME: usize = 249;

/// Why a topology cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read the topology file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the topology yaml does not have the expected shape: {0}")]
    Yaml(#[from] serde_yaml::Error),
    #[error("topology: {0}")]
    InvalidTopology(Problem),
    #[error("topic {topic:?}: {problem}")]
    InvalidTopic { topic: String, problem: Problem },
    #[error("cannot create a Kafka admin client: {0}")]
    Client(#[source] KafkaError),
    #[error("{operation} failed: {source}")]
    Kafka {
        operation: &'static str,
        #[source]
        source: KafkaError,
    },
    #[error("{topic}: {operation} failed: {code}")]
    Broker {
        topic: String,
        operation: &'static str,
        code: RDKafkaErrorCode,
    },
    #[error("topics {topics:?} were not ready in the broker's metadata after {waited:?}")]
    Timeout {
        topics: Vec<String>,
        waited: Duration,
    },
}

/// What is wrong with a topology or one of its topics.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    #[error("unknown cleanup policy {0:?} (expected delete, compact or compact,delete)")]
    UnknownCleanupPolicy(String),
    #[error("the partition count is zero")]
    ZeroPartitions,
    #[error("run_partitions is zero")]
    ZeroRunPartitions,
    #[error("declares no partition count (only co-partitioned topics take run_partitions)")]
    MissingPartitions,
    #[error(
        "declares {declared} partitions but is co-partitioned, and run_partitions is {run_partitions}"
    )]
    CoPartitionMismatch { declared: u32, run_partitions: u32 },
    #[error("declared more than once")]
    Duplicate,
    #[error("listed under co_partitioned but not declared under topics")]
    UnknownCoPartitioned,
    #[error("{0}")]
    InvalidName(String),
    #[error(
        "invalid retention {0:?} (expected a duration like 30d, 12h, 90m, 45s, 500ms, or infinite)"
    )]
    InvalidRetention(String),
    #[error("cleanup policy delete needs a retention (a duration, or infinite)")]
    MissingRetention,
    #[error("retention has no effect on a compact-only topic")]
    RetentionWithoutDelete,
    #[error("sets {key} under configs; use the {field} field instead")]
    ReservedConfig { key: String, field: &'static str },
    #[error("config {key} must be a string, a number or a boolean")]
    InvalidConfigValue { key: String },
    #[error("the replication factor is zero")]
    ZeroReplicationFactor,
    #[error("min_insync_replicas {value} must be auto or between 1 and the replication factor {replication_factor}")]
    InvalidMinInsyncReplicas {
        value: String,
        replication_factor: u16,
    },
    #[error("uses {{queue}} but the topology lists no queues")]
    NoQueues,
    #[error("queue {0:?} is listed more than once")]
    DuplicateQueue(String),
}

/// A topic's `cleanup.policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CleanupPolicy {
    Delete,
    Compact,
    CompactDelete,
}

impl CleanupPolicy {
    pub fn parse(text: &str) -> Option<Self> {
        let parts: BTreeSet<&str> = text.split(',').map(str::trim).collect();
        match parts.into_iter().collect::<Vec<_>>().as_slice() {
            ["delete"] => Some(Self::Delete),
            ["compact"] => Some(Self::Compact),
            ["compact", "delete"] => Some(Self::CompactDelete),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Delete => "delete",
            Self::Compact => "compact",
            Self::CompactDelete => "compact,delete",
        }
    }

    pub fn deletes(self) -> bool {
        matches!(self, Self::Delete | Self::CompactDelete)
    }
}

impl fmt::Display for CleanupPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Values that replace the file's, e.g. from command-line flags. Tests use a unique prefix
/// and small partition counts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    pub prefix: Option<String>,
    /// The partition count of the co-partitioned group.
    pub run_partitions: Option<u32>,
    /// The partition count of every intents topic (`intents.{queue}`): how many executors
    /// of one queue can share its work, and how many produce requests a reducer's
    /// transaction can spread its intents over.
    pub intent_partitions: Option<u32>,
    pub replication_factor: Option<u16>,
    pub min_insync_replicas: Option<u16>,
}

/// One declared topic, resolved: queue templates expanded, defaults merged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicSpec {
    /// Name without the prefix, e.g. `intents.http`.
    pub name: String,
    /// Name with the prefix, as on the broker.
    pub full_name: String,
    /// What the record key is (documentation).
    pub key: String,
    /// The value schema, relative to the workspace root.
    pub value_schema: String,
    pub partitions: u32,
    pub co_partitioned: bool,
    /// The queue of an intents topic.
    pub queue: Option<String>,
    pub cleanup_policy: CleanupPolicy,
    /// `retention.ms`; -1 is infinite. `None` on compact-only topics.
    pub retention_ms: Option<i64>,
    /// Every topic-level config the topology declares for this topic, including
    /// `cleanup.policy`, `retention.ms` and `min.insync.replicas`.
    pub configs: BTreeMap<String, String>,
}

/// The validated topology. Build it with [`Topology::load`] or [`Topology::from_yaml`].
#[derive(Debug, Clone)]
pub struct Topology {
    file: File,
    prefix: String,
    replication_factor: u16,
    min_insync_replicas: u16,
    run_partitions: u32,
    queues: Vec<String>,
    topics: Vec<TopicSpec>,
}

impl Topology {
    /// Reads and validates a topology file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let yaml = std::fs::read_to_string(path).map_err(|source| Error::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_yaml(&yaml)
    }

    /// Parses and validates a topology.
    pub fn from_yaml(yaml: &str) -> Result<Self, Error> {
        let file: File = serde_yaml::from_str(yaml)?;
        resolve(file, &Overrides::default())
    }

    /// The same topology with some values replaced; validated again.
    pub fn with_overrides(&self, overrides: &Overrides) -> Result<Self, Error> {
        resolve(self.file.clone(), overrides)
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn replication_factor(&self) -> u16 {
        self.replication_factor
    }

    pub fn min_insync_replicas(&self) -> u16 {
        self.min_insync_replicas
    }

    /// The partition count shared by the co-partitioned topics.
    pub fn run_partitions(&self) -> u32 {
        self.run_partitions
    }

    pub fn queues(&self) -> &[String] {
        &self.queues
    }

    pub fn topics(&self) -> &[TopicSpec] {
        &self.topics
    }

    /// A topic by its name without the prefix.
    pub fn topic(&self, name: &str) -> Option<&TopicSpec> {
        self.topics.iter().find(|t| t.name == name)
    }
}
