use std::collections::BTreeMap;

use rdkafka::ClientConfig;
use serde::{Deserialize, Serialize};

/// How a Sortie service reaches Kafka.
///
/// `properties` are passed to librdkafka unchanged, so SASL and TLS settings
/// (`security.protocol`, `sasl.mechanism`, `ssl.ca.location`, ...) need no code here.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// `bootstrap.servers`.
    pub bootstrap_servers: String,
    /// Extra librdkafka properties applied to every client.
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
}

impl KafkaConfig {
    pub fn new(bootstrap_servers: impl Into<String>) -> Self {
        Self {
            bootstrap_servers: bootstrap_servers.into(),
            properties: BTreeMap::new(),
        }
    }

    /// Base configuration for any client (admin, consumer).
    pub fn client(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.bootstrap_servers);
        for (key, value) in &self.properties {
            config.set(key, value);
        }
        config
    }

    /// Configuration for a producer. Every Sortie producer hashes keys like the Java
    /// client (murmur2) so that a key lands on the same partition whoever produced it;
    /// run-scoped records are additionally sent to an explicit partition.
    pub fn producer(&self) -> ClientConfig {
        let mut config = self.client();
        config.set("partitioner", "murmur2_random");
        config
    }
}
