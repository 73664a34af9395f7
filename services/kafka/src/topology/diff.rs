//! What differs between the declared topics and a broker, and `apply`, which fixes what
//! it may (missing topics, config drift) and reports the rest.

use super::*;

impl Topology {
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
        // Topics created now (by this apply or a concurrent one): their configs were set by
        // the create, but on a cluster they reach the broker that answers DescribeConfigs
        // a moment later — until then they read as absent, so they are waited for, not
        // taken for drift.
        let mut ready = Vec::new();
        if !to_create.is_empty() {
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

        let fresh: BTreeSet<String> = ready.into_iter().collect();
        // A topic just created can still be missing from the metadata of the broker that
        // answers the diff (in a cluster each broker learns of it on its own): wait for
        // it like for its configs, rather than report it missing.
        let settling = |d: &Difference| {
            (d.is_config() || matches!(d, Difference::Missing { .. })) && fresh.contains(d.topic())
        };
        let drift = self.diff_settled(&admin, settling).await?;
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
            .diff_settled(&admin, |d| {
                settling(d) || (d.is_config() && altered.contains(d.topic()))
            })
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
