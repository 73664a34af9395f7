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

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default = "default_prefix")]
    prefix: String,
    #[serde(default = "default_replication_factor")]
    replication_factor: u16,
    #[serde(default)]
    min_insync_replicas: Option<Value>,
    run_partitions: u32,
    #[serde(default)]
    co_partitioned: Vec<String>,
    #[serde(default)]
    queues: Vec<String>,
    #[serde(default)]
    configs: BTreeMap<String, Value>,
    topics: Vec<TopicEntry>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct TopicEntry {
    name: String,
    key: String,
    value_schema: String,
    #[serde(default)]
    partitions: Option<u32>,
    cleanup_policy: String,
    #[serde(default)]
    retention: Option<Value>,
    #[serde(default)]
    configs: BTreeMap<String, Value>,
}

fn default_prefix() -> String {
    "sortie.".to_owned()
}

fn default_replication_factor() -> u16 {
    1
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

    /// What differs between the declared topics and the broker, in declaration order.
    /// Empty means the broker matches.
    pub async fn diff(&self, kafka: &KafkaConfig) -> Result<Vec<Difference>, Error> {
        let admin = Admin::new(kafka)?;
        self.diff_with(&admin).await
    }

    /// Creates missing topics and fixes config drift; never changes partition counts or
    /// replication factors (those are reported in [`ApplyReport::remaining`]).
    /// Idempotent, and safe against a concurrent apply.
    pub async fn apply(&self, kafka: &KafkaConfig) -> Result<ApplyReport, Error> {
        let admin = Admin::new(kafka)?;
        let before = self.diff_with(&admin).await?;
        let mut report = ApplyReport::default();

        let missing: BTreeSet<&str> = before
            .iter()
            .filter_map(|d| match d {
                Difference::Missing { topic } => Some(topic.as_str()),
                _ => None,
            })
            .collect();
        let to_create: Vec<&TopicSpec> = self
            .topics
            .iter()
            .filter(|t| missing.contains(t.full_name.as_str()))
            .collect();
        if !to_create.is_empty() {
            let mut ready = Vec::new();
            for (topic, outcome) in admin.create(&to_create, self.replication_factor).await? {
                match outcome {
                    Ok(()) => {
                        tracing::info!(topic = %topic, "created topic");
                        report.created.push(topic.clone());
                        ready.push(topic);
                    }
                    // Another apply created it between our diff and our create.
                    Err(RDKafkaErrorCode::TopicAlreadyExists) => ready.push(topic),
                    Err(code) => report.failed.push(Failure {
                        topic,
                        operation: "create",
                        code,
                    }),
                }
            }
            admin.wait_ready(&ready).await?;
        }

        let drift = self.diff_settled(&admin, |_| false).await?;
        let mut by_topic: BTreeMap<&str, Vec<&Difference>> = BTreeMap::new();
        for difference in drift.iter().filter(|d| d.is_config()) {
            by_topic
                .entry(difference.topic())
                .or_default()
                .push(difference);
        }
        if !by_topic.is_empty() {
            let specs: Vec<&TopicSpec> = self
                .topics
                .iter()
                .filter(|t| by_topic.contains_key(t.full_name.as_str()))
                .collect();
            for (topic, outcome) in admin.alter(&specs).await? {
                match outcome {
                    Ok(()) => {
                        let fixed = by_topic.get(topic.as_str()).cloned().unwrap_or_default();
                        for difference in &fixed {
                            tracing::info!(%difference, "fixed topic config");
                        }
                        report.altered.extend(fixed.into_iter().cloned());
                    }
                    Err(code) => report.failed.push(Failure {
                        topic,
                        operation: "alter configs",
                        code,
                    }),
                }
            }
        }

        // Altered configs reach every broker asynchronously: wait until they show.
        let altered: BTreeSet<String> = report
            .altered
            .iter()
            .map(|d| d.topic().to_owned())
            .collect();
        report.remaining = self
            .diff_settled(&admin, |d| d.is_config() && altered.contains(d.topic()))
            .await?;
        let touched: BTreeSet<&str> = report
            .created
            .iter()
            .map(String::as_str)
            .chain(altered.iter().map(String::as_str))
            .chain(report.remaining.iter().map(Difference::topic))
            .chain(report.failed.iter().map(|f| f.topic.as_str()))
            .collect();
        report.unchanged = self
            .topics
            .iter()
            .filter(|t| !touched.contains(t.full_name.as_str()))
            .map(|t| t.full_name.clone())
            .collect();
        Ok(report)
    }

    async fn diff_with(&self, admin: &Admin) -> Result<Vec<Difference>, Error> {
        let metadata = admin.metadata().await?;
        let existing: Vec<&TopicSpec> = self
            .topics
            .iter()
            .filter(|t| metadata.contains_key(&t.full_name))
            .collect();
        let mut configs = admin.describe(&existing).await?;
        let mut differences = Vec::new();
        for spec in &self.topics {
            let topic = spec.full_name.clone();
            let Some(state) = metadata.get(&topic) else {
                differences.push(Difference::Missing { topic });
                continue;
            };
            if state.partitions != spec.partitions {
                differences.push(Difference::Partitions {
                    topic: topic.clone(),
                    expected: spec.partitions,
                    actual: state.partitions,
                });
            }
            if state.replication_factor != self.replication_factor {
                differences.push(Difference::ReplicationFactor {
                    topic: topic.clone(),
                    expected: self.replication_factor,
                    actual: state.replication_factor,
                });
            }
            let actual = configs.remove(&topic).unwrap_or_default();
            for (key, expected) in &spec.configs {
                let value = actual.get(key).and_then(|c| c.value.clone());
                if !same_config(key, expected, value.as_deref()) {
                    differences.push(Difference::Config {
                        topic: topic.clone(),
                        key: key.clone(),
                        expected: expected.clone(),
                        actual: value,
                    });
                }
            }
            for (key, config) in &actual {
                if config.per_topic && !spec.configs.contains_key(key) {
                    differences.push(Difference::Undeclared {
                        topic: topic.clone(),
                        key: key.clone(),
                        actual: config.value.clone().unwrap_or_default(),
                    });
                }
            }
        }
        Ok(differences)
    }

    /// Diffs until no difference satisfies `pending` (or the deadline passes), tolerating
    /// a topic that is in the metadata but not yet known to the broker answering configs.
    async fn diff_settled(
        &self,
        admin: &Admin,
        pending: impl Fn(&Difference) -> bool,
    ) -> Result<Vec<Difference>, Error> {
        let deadline = Instant::now() + ADMIN_TIMEOUT;
        loop {
            match self.diff_with(admin).await {
                Ok(differences)
                    if !differences.iter().any(&pending) || Instant::now() >= deadline =>
                {
                    return Ok(differences)
                }
                Ok(_) => {}
                Err(Error::Broker {
                    code: RDKafkaErrorCode::UnknownTopicOrPartition,
                    ..
                }) if Instant::now() < deadline => {}
                Err(error) => return Err(error),
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }
}

/// One way the broker differs from the topology. `Display` is a sentence for operators.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Difference {
    /// The topic does not exist.
    Missing { topic: String },
    /// The partition count differs. Apply never fixes this: changing it would move run
    /// keys to other partitions.
    Partitions {
        topic: String,
        expected: u32,
        actual: u32,
    },
    /// The replication factor differs; changing it is a partition reassignment, which
    /// apply does not do.
    ReplicationFactor {
        topic: String,
        expected: u16,
        actual: u16,
    },
    /// A declared config has another value (`actual` is `None` when the broker does not
    /// report the key).
    Config {
        topic: String,
        key: String,
        expected: String,
        actual: Option<String>,
    },
    /// A per-topic config override the topology does not declare; apply resets it to the
    /// broker default.
    Undeclared {
        topic: String,
        key: String,
        actual: String,
    },
}

impl Difference {
    pub fn topic(&self) -> &str {
        match self {
            Self::Missing { topic }
            | Self::Partitions { topic, .. }
            | Self::ReplicationFactor { topic, .. }
            | Self::Config { topic, .. }
            | Self::Undeclared { topic, .. } => topic,
        }
    }

    /// Whether `apply` can remove this difference.
    pub fn fixable(&self) -> bool {
        !matches!(
            self,
            Self::Partitions { .. } | Self::ReplicationFactor { .. }
        )
    }

    fn is_config(&self) -> bool {
        matches!(self, Self::Config { .. } | Self::Undeclared { .. })
    }
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing { topic } => write!(f, "{topic}: missing"),
            Self::Partitions {
                topic,
                expected,
                actual,
            } => write!(f, "{topic}: {actual} partitions, expected {expected}"),
            Self::ReplicationFactor {
                topic,
                expected,
                actual,
            } => write!(
                f,
                "{topic}: replication factor {actual}, expected {expected}"
            ),
            Self::Config {
                topic,
                key,
                expected,
                actual: Some(actual),
            } => write!(f, "{topic}: {key} is {actual:?}, expected {expected:?}"),
            Self::Config {
                topic,
                key,
                expected,
                actual: None,
            } => write!(
                f,
                "{topic}: {key} is not reported by the broker, expected {expected:?}"
            ),
            Self::Undeclared { topic, key, actual } => write!(
                f,
                "{topic}: {key} is set to {actual:?} but not declared in the topology"
            ),
        }
    }
}

/// What [`Topology::apply`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApplyReport {
    /// Topics this apply created (full names).
    pub created: Vec<String>,
    /// Config differences this apply fixed.
    pub altered: Vec<Difference>,
    /// Topics that already matched (full names).
    pub unchanged: Vec<String>,
    /// Differences still present afterwards: partition counts and replication factors,
    /// which apply never changes, and anything a failed request left.
    pub remaining: Vec<Difference>,
    /// Requests the broker refused.
    pub failed: Vec<Failure>,
}

impl ApplyReport {
    /// Whether the broker now matches the topology.
    pub fn is_complete(&self) -> bool {
        self.remaining.is_empty() && self.failed.is_empty()
    }
}

/// A request the broker refused during apply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub topic: String,
    pub operation: &'static str,
    pub code: RDKafkaErrorCode,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} failed: {}",
            self.topic, self.operation, self.code
        )
    }
}

// ---------------------------------------------------------------------------------------
// Validation

fn resolve(file: File, overrides: &Overrides) -> Result<Topology, Error> {
    let invalid = Error::InvalidTopology;
    let prefix = overrides
        .prefix
        .clone()
        .unwrap_or_else(|| file.prefix.clone());
    check_name_chars(&prefix)
        .map_err(|reason| invalid(Problem::InvalidName(format!("prefix {prefix:?}: {reason}"))))?;
    let replication_factor = overrides
        .replication_factor
        .unwrap_or(file.replication_factor);
    if replication_factor == 0 {
        return Err(invalid(Problem::ZeroReplicationFactor));
    }
    let min_insync_replicas = match (overrides.min_insync_replicas, &file.min_insync_replicas) {
        (Some(n), _) => Some(n),
        (None, None) => None,
        (None, Some(Value::String(s))) if s == "auto" => None,
        (None, Some(value)) => Some(
            value
                .as_u64()
                .and_then(|n| u16::try_from(n).ok())
                .ok_or_else(|| {
                    invalid(Problem::InvalidMinInsyncReplicas {
                        value: yaml_scalar(value).unwrap_or_else(|| format!("{value:?}")),
                        replication_factor,
                    })
                })?,
        ),
    }
    .unwrap_or_else(|| replication_factor.saturating_sub(1).max(1));
    if min_insync_replicas == 0 || min_insync_replicas > replication_factor {
        return Err(invalid(Problem::InvalidMinInsyncReplicas {
            value: min_insync_replicas.to_string(),
            replication_factor,
        }));
    }
    if file.run_partitions == 0 || overrides.run_partitions == Some(0) {
        return Err(invalid(Problem::ZeroRunPartitions));
    }
    let run_partitions = overrides.run_partitions.unwrap_or(file.run_partitions);

    let mut queues: Vec<String> = Vec::new();
    for queue in &file.queues {
        check_name_chars(queue)
            .and_then(|()| {
                if queue.is_empty() {
                    Err("is empty".to_owned())
                } else {
                    Ok(())
                }
            })
            .map_err(|reason| {
                invalid(Problem::InvalidName(format!("queue {queue:?}: {reason}")))
            })?;
        if queues.contains(queue) {
            return Err(invalid(Problem::DuplicateQueue(queue.clone())));
        }
        queues.push(queue.clone());
    }
    let defaults = stringify_configs(&file.configs).map_err(invalid)?;

    let mut topics: Vec<TopicSpec> = Vec::new();
    for entry in &file.topics {
        let fail = |problem| Error::InvalidTopic {
            topic: entry.name.clone(),
            problem,
        };
        let cleanup_policy = CleanupPolicy::parse(&entry.cleanup_policy)
            .ok_or_else(|| fail(Problem::UnknownCleanupPolicy(entry.cleanup_policy.clone())))?;
        let retention_ms = match (&entry.retention, cleanup_policy.deletes()) {
            (None, true) => return Err(fail(Problem::MissingRetention)),
            (Some(_), false) => return Err(fail(Problem::RetentionWithoutDelete)),
            (None, false) => None,
            (Some(value), true) => Some(parse_retention(value).map_err(fail)?),
        };
        let co_partitioned = file.co_partitioned.contains(&entry.name);
        let partitions = match (entry.partitions, co_partitioned) {
            (Some(declared), true) if declared != file.run_partitions => {
                return Err(fail(Problem::CoPartitionMismatch {
                    declared,
                    run_partitions: file.run_partitions,
                }))
            }
            (_, true) => run_partitions,
            (None, false) => return Err(fail(Problem::MissingPartitions)),
            (Some(0), false) => return Err(fail(Problem::ZeroPartitions)),
            (Some(declared), false) => declared,
        };
        let mut configs = defaults.clone();
        configs.extend(stringify_configs(&entry.configs).map_err(fail)?);
        configs.insert(
            CLEANUP_POLICY.to_owned(),
            cleanup_policy.as_str().to_owned(),
        );
        if let Some(ms) = retention_ms {
            configs.insert(RETENTION_MS.to_owned(), ms.to_string());
        }
        configs.insert(
            MIN_INSYNC_REPLICAS.to_owned(),
            min_insync_replicas.to_string(),
        );

        let instances: Vec<(String, Option<String>)> = if entry.name.contains(QUEUE_PLACEHOLDER) {
            if queues.is_empty() {
                return Err(fail(Problem::NoQueues));
            }
            queues
                .iter()
                .map(|q| (entry.name.replace(QUEUE_PLACEHOLDER, q), Some(q.clone())))
                .collect()
        } else {
            vec![(entry.name.clone(), None)]
        };
        for (name, queue) in instances {
            let full_name = format!("{prefix}{name}");
            let fail = |problem| Error::InvalidTopic {
                topic: name.clone(),
                problem,
            };
            if name.is_empty() {
                return Err(fail(Problem::InvalidName("the name is empty".to_owned())));
            }
            check_name_chars(&name).map_err(|reason| fail(Problem::InvalidName(reason)))?;
            if full_name.len() > MAX_TOPIC_NAME || full_name == "." || full_name == ".." {
                return Err(fail(Problem::InvalidName(format!(
                    "{full_name:?} is not a legal Kafka topic name (at most {MAX_TOPIC_NAME} characters, not . or ..)"
                ))));
            }
            if topics.iter().any(|t| t.name == name) {
                return Err(fail(Problem::Duplicate));
            }
            topics.push(TopicSpec {
                name,
                full_name,
                key: entry.key.clone(),
                value_schema: entry.value_schema.clone(),
                partitions,
                co_partitioned,
                queue,
                cleanup_policy,
                retention_ms,
                configs: configs.clone(),
            });
        }
    }
    for name in &file.co_partitioned {
        if !file.topics.iter().any(|t| &t.name == name) {
            return Err(Error::InvalidTopic {
                topic: name.clone(),
                problem: Problem::UnknownCoPartitioned,
            });
        }
    }

    Ok(Topology {
        file,
        prefix,
        replication_factor,
        min_insync_replicas,
        run_partitions,
        queues,
        topics,
    })
}

/// Kafka topic names use only ASCII letters, digits, `.`, `_` and `-`.
fn check_name_chars(name: &str) -> Result<(), String> {
    match name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        Some(c) => Err(format!(
            "contains {c:?}; Kafka topic names use only ASCII letters, digits, '.', '_' and '-'"
        )),
        None => Ok(()),
    }
}

fn yaml_scalar(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

fn stringify_configs(
    configs: &BTreeMap<String, Value>,
) -> Result<BTreeMap<String, String>, Problem> {
    let mut out = BTreeMap::new();
    for (key, value) in configs {
        let field = match key.as_str() {
            CLEANUP_POLICY => Some("cleanup_policy"),
            RETENTION_MS => Some("retention"),
            MIN_INSYNC_REPLICAS => Some("min_insync_replicas"),
            _ => None,
        };
        if let Some(field) = field {
            return Err(Problem::ReservedConfig {
                key: key.clone(),
                field,
            });
        }
        let text =
            yaml_scalar(value).ok_or_else(|| Problem::InvalidConfigValue { key: key.clone() })?;
        out.insert(key.clone(), text);
    }
    Ok(out)
}

/// `30d`, `12h`, `90m`, `45s`, `500ms`, `1w`, a bare number of milliseconds, or
/// `infinite` (-1).
fn parse_retention(value: &Value) -> Result<i64, Problem> {
    let text = yaml_scalar(value).unwrap_or_else(|| format!("{value:?}"));
    let bad = || Problem::InvalidRetention(text.clone());
    if text == "infinite" || text == "-1" {
        return Ok(-1);
    }
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let number: i64 = number.parse().map_err(|_| bad())?;
    let factor: i64 = match unit {
        "" | "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        "w" => 604_800_000,
        _ => return Err(bad()),
    };
    match number.checked_mul(factor) {
        Some(ms) if ms > 0 => Ok(ms),
        _ => Err(bad()),
    }
}

/// Compares a declared config with the broker's value. `cleanup.policy` is a list whose
/// order does not matter.
fn same_config(key: &str, expected: &str, actual: Option<&str>) -> bool {
    match actual {
        None => false,
        Some(actual) if key == CLEANUP_POLICY => {
            CleanupPolicy::parse(expected).is_some()
                && CleanupPolicy::parse(expected) == CleanupPolicy::parse(actual)
        }
        Some(actual) => expected == actual,
    }
}

// ---------------------------------------------------------------------------------------
// Broker access

#[derive(Debug, Clone, Copy)]
struct TopicState {
    partitions: u32,
    replication_factor: u16,
    /// Every partition has a leader.
    ready: bool,
}

#[derive(Debug, Clone, Default)]
struct ActualConfig {
    value: Option<String>,
    /// Set on this topic (not inherited from the broker or the default).
    per_topic: bool,
}

struct Admin {
    client: Arc<AdminClient<DefaultClientContext>>,
}

impl fmt::Debug for Admin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Admin").finish_non_exhaustive()
    }
}

impl Admin {
    fn new(kafka: &KafkaConfig) -> Result<Self, Error> {
        let mut config = kafka.client();
        // The admin client is a producer to librdkafka, which would otherwise let a
        // metadata request auto-create a topic on brokers that allow it.
        config.set("allow.auto.create.topics", "false");
        let client = config.create().map_err(Error::Client)?;
        Ok(Self {
            client: Arc::new(client),
        })
    }

    fn options() -> AdminOptions {
        AdminOptions::new()
            .request_timeout(Some(ADMIN_TIMEOUT))
            .operation_timeout(Some(ADMIN_TIMEOUT))
    }

    /// Partition counts and replication factors of every topic on the cluster. Asks for
    /// all topics: a metadata request naming a topic can auto-create it.
    async fn metadata(&self) -> Result<HashMap<String, TopicState>, Error> {
        let client = Arc::clone(&self.client);
        let metadata =
            tokio::task::spawn_blocking(move || client.inner().fetch_metadata(None, ADMIN_TIMEOUT))
                .await
                .unwrap_or_else(|join| match join.try_into_panic() {
                    Ok(panic) => std::panic::resume_unwind(panic),
                    Err(_) => Err(KafkaError::Canceled),
                })
                .map_err(|source| Error::Kafka {
                    operation: "fetch metadata",
                    source,
                })?;
        Ok(metadata
            .topics()
            .iter()
            .filter(|t| t.error().is_none())
            .map(|t| {
                let partitions = t.partitions();
                let state = TopicState {
                    partitions: u32::try_from(partitions.len()).unwrap_or(u32::MAX),
                    replication_factor: partitions
                        .iter()
                        .map(|p| u16::try_from(p.replicas().len()).unwrap_or(u16::MAX))
                        .min()
                        .unwrap_or(0),
                    ready: !partitions.is_empty()
                        && partitions
                            .iter()
                            .all(|p| p.error().is_none() && p.leader() >= 0),
                };
                (t.name().to_owned(), state)
            })
            .collect())
    }

    async fn describe(
        &self,
        topics: &[&TopicSpec],
    ) -> Result<HashMap<String, BTreeMap<String, ActualConfig>>, Error> {
        if topics.is_empty() {
            return Ok(HashMap::new());
        }
        let specifiers: Vec<ResourceSpecifier<'_>> = topics
            .iter()
            .map(|t| ResourceSpecifier::Topic(&t.full_name))
            .collect();
        let results = self
            .client
            .describe_configs(&specifiers, &Self::options())
            .await
            .map_err(|source| Error::Kafka {
                operation: "describe configs",
                source,
            })?;
        // librdkafka returns the results in request order; an error carries no name.
        let mut out = HashMap::new();
        for (spec, result) in topics.iter().zip(results) {
            let resource = result.map_err(|code| Error::Broker {
                topic: spec.full_name.clone(),
                operation: "describe configs",
                code,
            })?;
            let name = match resource.specifier {
                OwnedResourceSpecifier::Topic(name) => name,
                _ => spec.full_name.clone(),
            };
            let entries = resource
                .entries
                .into_iter()
                .map(|e| {
                    let config = ActualConfig {
                        value: e.value,
                        per_topic: e.source == ConfigSource::DynamicTopic,
                    };
                    (e.name, config)
                })
                .collect();
            out.insert(name, entries);
        }
        Ok(out)
    }

    async fn create(
        &self,
        topics: &[&TopicSpec],
        replication_factor: u16,
    ) -> Result<Vec<(String, Result<(), RDKafkaErrorCode>)>, Error> {
        let new_topics: Vec<NewTopic<'_>> = topics
            .iter()
            .map(|t| {
                let mut new = NewTopic::new(
                    &t.full_name,
                    i32::try_from(t.partitions).unwrap_or(i32::MAX),
                    TopicReplication::Fixed(i32::from(replication_factor)),
                );
                for (key, value) in &t.configs {
                    new = new.set(key, value);
                }
                new
            })
            .collect();
        let results = self
            .client
            .create_topics(&new_topics, &Self::options())
            .await
            .map_err(|source| Error::Kafka {
                operation: "create topics",
                source,
            })?;
        Ok(results
            .into_iter()
            .map(|r| match r {
                Ok(name) => (name, Ok(())),
                Err((name, code)) => (name, Err(code)),
            })
            .collect())
    }

    /// Sets each topic's full declared config set. AlterConfigs is not incremental: it
    /// resets every per-topic override it is not given, which is what makes the yaml the
    /// whole truth.
    async fn alter(
        &self,
        topics: &[&TopicSpec],
    ) -> Result<Vec<(String, Result<(), RDKafkaErrorCode>)>, Error> {
        let alters: Vec<AlterConfig<'_>> = topics
            .iter()
            .map(|t| {
                t.configs.iter().fold(
                    AlterConfig::new(ResourceSpecifier::Topic(&t.full_name)),
                    |alter, (key, value)| alter.set(key, value),
                )
            })
            .collect();
        let results = self
            .client
            .alter_configs(&alters, &Self::options())
            .await
            .map_err(|source| Error::Kafka {
                operation: "alter configs",
                source,
            })?;
        let name = |specifier: OwnedResourceSpecifier| match specifier {
            OwnedResourceSpecifier::Topic(name) | OwnedResourceSpecifier::Group(name) => name,
            OwnedResourceSpecifier::Broker(id) => format!("broker {id}"),
        };
        Ok(results
            .into_iter()
            .map(|r| match r {
                Ok(specifier) => (name(specifier), Ok(())),
                Err((specifier, code)) => (name(specifier), Err(code)),
            })
            .collect())
    }

    /// Waits until every named topic is in the metadata with a leader for each partition.
    async fn wait_ready(&self, topics: &[String]) -> Result<(), Error> {
        let started = Instant::now();
        loop {
            let metadata = self.metadata().await?;
            let pending: Vec<String> = topics
                .iter()
                .filter(|name| !metadata.get(name.as_str()).is_some_and(|state| state.ready))
                .cloned()
                .collect();
            if pending.is_empty() {
                return Ok(());
            }
            if started.elapsed() >= ADMIN_TIMEOUT {
                return Err(Error::Timeout {
                    topics: pending,
                    waited: started.elapsed(),
                });
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
run_partitions: 4
co_partitioned: [commands, run-state]
queues: [default, http]
configs:
  compression.type: zstd
topics:
  - name: commands
    key: run_id
    value_schema: schemas/run-command.avsc
    cleanup_policy: delete
    retention: 30d
  - name: run-state
    key: run_id
    value_schema: schemas/run-state.avsc
    cleanup_policy: compact
  - name: "intents.{queue}"
    key: operation_id
    value_schema: schemas/step-intent.avsc
    partitions: 2
    cleanup_policy: delete
    retention: infinite
"#;

    fn invalid(yaml: &str) -> (Option<String>, Problem) {
        match Topology::from_yaml(yaml) {
            Err(Error::InvalidTopic { topic, problem }) => (Some(topic), problem),
            Err(Error::InvalidTopology(problem)) => (None, problem),
            other => panic!("expected a validation error, got {other:?}"),
        }
    }

    #[test]
    fn minimal_topology_resolves() {
        let topology = Topology::from_yaml(MINIMAL).expect("valid");
        assert_eq!(topology.prefix(), "sortie.");
        assert_eq!(topology.replication_factor(), 1);
        assert_eq!(topology.min_insync_replicas(), 1);
        let names: Vec<&str> = topology
            .topics()
            .iter()
            .map(|t| t.full_name.as_str())
            .collect();
        assert_eq!(
            names,
            [
                "sortie.commands",
                "sortie.run-state",
                "sortie.intents.default",
                "sortie.intents.http"
            ]
        );
        let commands = topology.topic("commands").expect("declared");
        assert_eq!(commands.partitions, 4);
        assert!(commands.co_partitioned);
        assert_eq!(commands.configs["retention.ms"], "2592000000");
        assert_eq!(commands.configs["cleanup.policy"], "delete");
        assert_eq!(commands.configs["compression.type"], "zstd");
        assert_eq!(commands.configs["min.insync.replicas"], "1");
        let state = topology.topic("run-state").expect("declared");
        assert_eq!(state.retention_ms, None);
        assert!(!state.configs.contains_key("retention.ms"));
        let http = topology.topic("intents.http").expect("declared");
        assert_eq!(http.queue.as_deref(), Some("http"));
        assert_eq!(http.partitions, 2);
        assert_eq!(http.configs["retention.ms"], "-1");
    }

    #[test]
    fn overrides_apply_to_the_whole_group() {
        let topology = Topology::from_yaml(MINIMAL)
            .and_then(|t| {
                t.with_overrides(&Overrides {
                    prefix: Some("t1.".into()),
                    run_partitions: Some(2),
                    replication_factor: Some(3),
                    min_insync_replicas: None,
                })
            })
            .expect("valid");
        assert_eq!(topology.run_partitions(), 2);
        assert_eq!(topology.topic("commands").map(|t| t.partitions), Some(2));
        assert_eq!(topology.topic("run-state").map(|t| t.partitions), Some(2));
        assert_eq!(
            topology.topic("intents.default").map(|t| t.partitions),
            Some(2)
        );
        assert_eq!(
            topology.topic("commands").map(|t| t.full_name.as_str()),
            Some("t1.commands")
        );
        // auto: replication factor - 1.
        assert_eq!(topology.min_insync_replicas(), 2);
        assert_eq!(topology.topics()[0].configs["min.insync.replicas"], "2");
    }

    #[test]
    fn unknown_cleanup_policy_names_the_topic() {
        let yaml = MINIMAL.replace("cleanup_policy: compact", "cleanup_policy: compacted");
        assert_eq!(
            invalid(&yaml),
            (
                Some("run-state".into()),
                Problem::UnknownCleanupPolicy("compacted".into())
            )
        );
        let message = Topology::from_yaml(&yaml).expect_err("invalid").to_string();
        assert!(
            message.contains("run-state") && message.contains("compacted"),
            "{message}"
        );
    }

    #[test]
    fn zero_partitions_is_rejected() {
        let yaml = MINIMAL.replace("partitions: 2", "partitions: 0");
        assert_eq!(
            invalid(&yaml),
            (Some("intents.{queue}".into()), Problem::ZeroPartitions)
        );
        let yaml = MINIMAL.replace("run_partitions: 4", "run_partitions: 0");
        assert_eq!(invalid(&yaml), (None, Problem::ZeroRunPartitions));
        let topology = Topology::from_yaml(MINIMAL).expect("valid");
        let overridden = topology.with_overrides(&Overrides {
            run_partitions: Some(0),
            ..Overrides::default()
        });
        assert!(matches!(
            overridden,
            Err(Error::InvalidTopology(Problem::ZeroRunPartitions))
        ));
    }

    #[test]
    fn co_partitioned_topic_may_not_declare_another_count() {
        let yaml = MINIMAL.replace(
            "    cleanup_policy: compact",
            "    partitions: 6\n    cleanup_policy: compact",
        );
        assert_eq!(
            invalid(&yaml),
            (
                Some("run-state".into()),
                Problem::CoPartitionMismatch {
                    declared: 6,
                    run_partitions: 4
                }
            )
        );
        // Declaring the same count is allowed.
        let yaml = MINIMAL.replace(
            "    cleanup_policy: compact",
            "    partitions: 4\n    cleanup_policy: compact",
        );
        assert!(Topology::from_yaml(&yaml).is_ok());
    }

    #[test]
    fn duplicates_are_rejected() {
        let yaml = MINIMAL.replace("name: run-state", "name: commands");
        assert_eq!(
            invalid(&yaml),
            (Some("commands".into()), Problem::Duplicate)
        );
        // A hand-written topic that collides with an expanded queue topic.
        let yaml = format!(
            "{MINIMAL}  - name: intents.http\n    key: k\n    value_schema: s\n    partitions: 1\n    cleanup_policy: compact\n"
        );
        assert_eq!(
            invalid(&yaml),
            (Some("intents.http".into()), Problem::Duplicate)
        );
        let yaml = MINIMAL.replace("[default, http]", "[default, default]");
        assert_eq!(
            invalid(&yaml),
            (None, Problem::DuplicateQueue("default".into()))
        );
    }

    #[test]
    fn other_problems_are_named() {
        let cases: [(&str, &str, Problem); 7] = [
            (
                "retention: 30d",
                "retention: 30 days",
                Problem::InvalidRetention("30 days".into()),
            ),
            ("    retention: 30d\n", "", Problem::MissingRetention),
            (
                "    cleanup_policy: compact\n",
                "    cleanup_policy: compact\n    retention: 1d\n",
                Problem::RetentionWithoutDelete,
            ),
            ("    partitions: 2\n", "", Problem::MissingPartitions),
            (
                "[commands, run-state]",
                "[commands, run-state, graphs]",
                Problem::UnknownCoPartitioned,
            ),
            (
                "  compression.type: zstd",
                "  cleanup.policy: compact",
                Problem::ReservedConfig {
                    key: "cleanup.policy".into(),
                    field: "cleanup_policy",
                },
            ),
            ("queues: [default, http]", "queues: []", Problem::NoQueues),
        ];
        for (from, to, expected) in cases {
            let yaml = MINIMAL.replacen(from, to, 1);
            assert_eq!(invalid(&yaml).1, expected, "replacing {from:?} with {to:?}");
        }
        let yaml = MINIMAL.replace(
            "run_partitions: 4",
            "run_partitions: 4\nreplication_factor: 0",
        );
        assert_eq!(invalid(&yaml), (None, Problem::ZeroReplicationFactor));
        let yaml = MINIMAL.replace(
            "run_partitions: 4",
            "run_partitions: 4\nmin_insync_replicas: 2",
        );
        assert!(matches!(
            invalid(&yaml),
            (None, Problem::InvalidMinInsyncReplicas { .. })
        ));
        let yaml = MINIMAL.replace("queues: [default, http]", "queues: [default, \"h/ttp\"]");
        assert!(matches!(invalid(&yaml), (None, Problem::InvalidName(_))));
        assert!(matches!(
            Topology::from_yaml("run_partitions: 1\ntopics: []\nextra: 1\n"),
            Err(Error::Yaml(_))
        ));
    }

    #[test]
    fn retention_parses_units() {
        let ms = |s: &str| parse_retention(&Value::String(s.into()));
        assert_eq!(ms("14d"), Ok(14 * 86_400_000));
        assert_eq!(ms("12h"), Ok(43_200_000));
        assert_eq!(ms("500ms"), Ok(500));
        assert_eq!(ms("infinite"), Ok(-1));
        assert!(ms("0d").is_err());
        assert!(ms("d").is_err());
        assert_eq!(parse_retention(&Value::Number(60_000.into())), Ok(60_000));
    }

    #[test]
    fn cleanup_policy_compares_as_a_set() {
        assert!(same_config(
            "cleanup.policy",
            "compact,delete",
            Some("delete,compact")
        ));
        assert!(!same_config("cleanup.policy", "compact", Some("delete")));
        assert!(same_config("retention.ms", "-1", Some("-1")));
        assert!(!same_config("retention.ms", "-1", None));
    }

    #[test]
    fn difference_sentences() {
        let sentences = [
            Difference::Missing {
                topic: "sortie.commands".into(),
            },
            Difference::Partitions {
                topic: "sortie.run-state".into(),
                expected: 12,
                actual: 3,
            },
            Difference::Config {
                topic: "sortie.step-results".into(),
                key: "cleanup.policy".into(),
                expected: "compact".into(),
                actual: Some("delete".into()),
            },
        ]
        .map(|d| d.to_string());
        assert_eq!(
            sentences,
            [
                "sortie.commands: missing",
                "sortie.run-state: 3 partitions, expected 12",
                r#"sortie.step-results: cleanup.policy is "delete", expected "compact""#,
            ]
        );
    }

    /// The shipped file loads and names schema files that exist.
    #[test]
    fn shipped_topology_loads() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let topology =
            Topology::load(root.join(DEFAULT_PATH)).expect("topology/topics.yaml is valid");
        assert_eq!(topology.prefix(), "sortie.");
        assert_eq!(topology.replication_factor(), 1);
        for topic in topology.topics() {
            assert!(
                root.join(&topic.value_schema).is_file(),
                "{}: value schema {} does not exist",
                topic.name,
                topic.value_schema
            );
        }
        let group: Vec<&str> = topology
            .topics()
            .iter()
            .filter(|t| t.co_partitioned)
            .map(|t| t.name.as_str())
            .collect();
        assert_eq!(
            group,
            ["commands", "step-results", "run-state", "run-events"]
        );
        assert_eq!(topology.queues(), ["default", "http", "llm"]);
    }
}
