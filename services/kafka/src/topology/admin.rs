//! Broker access for the topology: metadata, configs, creating and altering topics.

use super::*;

#[derive(Debug, Clone, Copy)]
pub(super) struct TopicState {
    pub(super) partitions: u32,
    pub(super) replication_factor: u16,
    /// Every partition has a leader.
    pub(super) ready: bool,
}

#[derive(Debug, Clone, Default)]
pub(super) struct ActualConfig {
    pub(super) value: Option<String>,
    /// Set on this topic (not inherited from the broker or the default).
    pub(super) per_topic: bool,
}

pub(super) struct Admin {
    client: Arc<AdminClient<DefaultClientContext>>,
}

impl fmt::Debug for Admin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Admin").finish_non_exhaustive()
    }
}

impl Admin {
    pub(super) fn new(kafka: &KafkaConfig) -> Result<Self, Error> {
        let mut config = kafka.client();
        // The admin client is a producer to librdkafka, which would otherwise let a
        // metadata request auto-create a topic on brokers that allow it.
        config.set("allow.auto.create.topics", "false");
        let client = config.create().map_err(Error::Client)?;
        Ok(Self {
            client: Arc::new(client),
        })
    }

    pub(super) fn options() -> AdminOptions {
        AdminOptions::new()
            .request_timeout(Some(ADMIN_TIMEOUT))
            .operation_timeout(Some(ADMIN_TIMEOUT))
    }

    /// Partition counts and replication factors of every topic on the cluster. Asks for
    /// all topics: a metadata request naming a topic can auto-create it.
    pub(super) async fn metadata(&self) -> Result<HashMap<String, TopicState>, Error> {
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

    pub(super) async fn describe(
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

    pub(super) async fn create(
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
    pub(super) async fn alter(
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
    pub(super) async fn wait_ready(&self, topics: &[String]) -> Result<(), Error> {
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
