use std::collections::BTreeMap;

use rdkafka::ClientConfig;
use serde::{Deserialize, Serialize};

/// The largest record any Sortie producer sends and any Sortie topic accepts: the
/// producers' `message.max.bytes` and the topics' `max.message.bytes`
/// (`topology/topics.yaml`) are both this, so a record is refused before it is sent, not by
/// the broker inside a transaction. The fold keeps what a run writes well below it.
pub const MAX_RECORD_BYTES: usize = 1_048_588;

/// `retry.backoff.ms` of transactional producers. librdkafka waits this long after every
/// CONCURRENT_TRANSACTIONS answer (AddOffsetsToTxn right after the previous commit gets
/// one most of the time); its 100 ms default capped a transactional loop near 10
/// transactions/s. Measured with `sortie bench`: 5 ms cut send_offsets p90 from ~120 ms
/// to ~10 ms; 1 ms cuts a back-to-back transaction of one partition from 8.2 to 4.5 ms
/// p50 and of twelve from 9.4 to 7.9 (its `transaction_shape`, alternated), the markers
/// of the previous commit being written in ~1–3 ms. The exponential backoff of other
/// retries is capped by [`TXN_RETRY_BACKOFF_MAX_MS`].
pub const TXN_RETRY_BACKOFF_MS: &str = "1";
/// `retry.backoff.max.ms` of transactional producers: librdkafka backs off
/// exponentially, and back-to-back small transactions (light load) meet
/// CONCURRENT_TRANSACTIONS several times in a row; a low cap keeps each wait short.
pub const TXN_RETRY_BACKOFF_MAX_MS: &str = "20";

/// The compression of Sortie's batching producers (the reducer's transactions, the
/// executors' results), as producer defaults; set properties win. lz4: in a profile of
/// the reducer under full load, librdkafka's zstd (level 1) took 9.8 % of its CPU
/// samples and lz4 4.2 % (`perf record` during `sortie bench`'s run phase, topics storing
/// what producers send). The topics keep what the producer sent (`compression.type:
/// producer` in `topology/topics.yaml`), so the broker never recompresses a batch.
pub const COMPRESSION: [(&str, &str); 1] = [("compression.type", "lz4")];

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

    /// A copy whose clients send `client.id` `id`, or `<client.id>-<id>` when the
    /// properties set one (a prefix, as Kafka Streams derives its clients' ids). Without
    /// it every librdkafka client is `rdkafka`, and the broker's per-client quotas,
    /// request logs and metrics cannot tell a reducer's producer from an executor's.
    pub fn named(&self, id: &str) -> KafkaConfig {
        let mut named = self.clone();
        let client_id = match self.properties.get("client.id") {
            Some(base) if !base.is_empty() => format!("{base}-{id}"),
            _ => id.to_owned(),
        };
        named.properties.insert("client.id".into(), client_id);
        named
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
        self.producer_with(&[])
    }

    /// [`KafkaConfig::producer`] with a caller's `defaults` (batching, compression, ...),
    /// which the properties file overrides, as everywhere. Settings that must win over the
    /// properties are set by the caller afterwards.
    pub fn producer_with(&self, defaults: &[(&str, &str)]) -> ClientConfig {
        let mut config = self.client();
        config
            .set("partitioner", "murmur2_random")
            .set("message.max.bytes", MAX_RECORD_BYTES.to_string());
        for (key, value) in defaults {
            config.set(*key, *value);
        }
        for (key, value) in &self.properties {
            config.set(key, value);
        }
        config
    }

    /// Configuration for a transactional producer with id `transactional_id`: idempotent,
    /// a transaction timeout short enough that a dead producer cannot hold
    /// `read_committed` readers for long, the retry backoff transactions need, a 2 ms
    /// linger (a transaction's records are handed over at once and go out in few
    /// requests) and [`COMPRESSION`] (a run's states repeat its payloads). Set
    /// properties win, as everywhere.
    pub fn transactional_producer(&self, transactional_id: &str) -> ClientConfig {
        let [compression] = COMPRESSION;
        self.producer_with(&[
            ("transactional.id", transactional_id),
            ("enable.idempotence", "true"),
            ("transaction.timeout.ms", "15000"),
            ("retry.backoff.ms", TXN_RETRY_BACKOFF_MS),
            ("retry.backoff.max.ms", TXN_RETRY_BACKOFF_MAX_MS),
            ("linger.ms", "2"),
            compression,
        ])
    }

    /// A librdkafka setting in milliseconds as the properties file sets it, else
    /// librdkafka's `default_ms`.
    pub fn property_ms(&self, key: &str, default_ms: u64) -> std::time::Duration {
        let ms = self.properties.get(key).and_then(|ms| ms.parse().ok());
        std::time::Duration::from_millis(ms.unwrap_or(default_ms))
    }

    /// How long a group member may stay outside a settled group while its coordinator
    /// answers (see `watchdog::Watchdog::watch_membership`): another member's rebalance
    /// may hold it up to that member's `max.poll.interval.ms` (300 s unless the properties
    /// set it), and a member that left is dropped after `session_timeout`.
    pub fn rejoin_timeout(&self, session_timeout: std::time::Duration) -> std::time::Duration {
        self.property_ms("max.poll.interval.ms", 300_000) + session_timeout
    }

    /// Configuration for a member of consumer group `group` that commits its own offsets
    /// (no auto-commit, no auto offset store), reads `read_committed` (which also makes
    /// OffsetFetch require stable offsets, KIP-447) from the earliest offset, never creates
    /// topics, reports statistics for the lag gauges, heartbeats at a quarter of
    /// `session_timeout`, and — when `instance_id` is given — is a static member.
    pub fn group_member(
        &self,
        group: &str,
        assignment_strategy: &str,
        session_timeout: std::time::Duration,
        instance_id: Option<&str>,
    ) -> ClientConfig {
        let mut config = self.client();
        let session_ms = session_timeout.as_millis();
        config
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("isolation.level", "read_committed")
            .set("auto.offset.reset", "earliest")
            .set("partition.assignment.strategy", assignment_strategy)
            .set("session.timeout.ms", session_ms.to_string())
            .set(
                "heartbeat.interval.ms",
                (session_ms / 4).max(500).to_string(),
            )
            .set("allow.auto.create.topics", "false")
            .set(
                "statistics.interval.ms",
                crate::metrics::STATISTICS_INTERVAL_MS,
            );
        if let Some(instance) = instance_id {
            config.set("group.instance.id", instance);
        }
        // Unlike the producers', these settings win over the properties file: a
        // `read_uncommitted` or auto-committing member would break exactly-once.
        config
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_properties_file_overrides_the_transactional_producers_defaults() {
        let mut kafka = KafkaConfig::new("127.0.0.1:9092");
        let defaults = kafka.transactional_producer("t.reducer-0");
        assert_eq!(defaults.get("linger.ms"), Some("2"));
        assert_eq!(defaults.get("compression.type"), Some("lz4"));
        assert_eq!(defaults.get("retry.backoff.ms"), Some(TXN_RETRY_BACKOFF_MS));
        for (key, value) in [
            ("linger.ms", "0"),
            ("compression.type", "zstd"),
            ("compression.level", "3"),
        ] {
            kafka.properties.insert(key.into(), value.into());
        }
        let set = kafka.transactional_producer("t.reducer-0");
        assert_eq!(set.get("linger.ms"), Some("0"));
        assert_eq!(set.get("compression.type"), Some("zstd"));
        assert_eq!(set.get("compression.level"), Some("3"));
        assert_eq!(set.get("transactional.id"), Some("t.reducer-0"));
    }

    #[test]
    fn named_clients_carry_their_role_under_the_properties_client_id() {
        let kafka = KafkaConfig::new("127.0.0.1:9092");
        let named = kafka.named("t.reducer-0-producer");
        assert_eq!(
            named.producer().get("client.id"),
            Some("t.reducer-0-producer")
        );
        assert_eq!(
            named.named("graphs").client().get("client.id"),
            Some("t.reducer-0-producer-graphs")
        );
        let mut prefixed = KafkaConfig::new("127.0.0.1:9092");
        prefixed
            .properties
            .insert("client.id".into(), "acme".into());
        assert_eq!(
            prefixed
                .named("t.reducer-0-consumer")
                .group_member("g", "range", std::time::Duration::from_secs(6), None)
                .get("client.id"),
            Some("acme-t.reducer-0-consumer")
        );
    }
}
