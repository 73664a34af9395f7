//! How a reducer instance runs ([`ReducerConfig`]), and the transactional ids it derives
//! from its instance id.

use std::path::PathBuf;
use std::time::Duration;

use sortie_kafka::KafkaConfig;
use sortie_wire::Topics;

use super::Error;
use crate::fault::FaultPoint;

/// How a reducer instance runs.
#[derive(Debug, Clone)]
pub struct ReducerConfig {
    pub kafka: KafkaConfig,
    pub registry_url: String,
    /// Register schemas when missing (dev, tests).
    pub auto_register: bool,
    pub topics: Topics,
    /// Consumer group of all reducers.
    pub group_id: String,
    /// Stable per instance: the transactional id is derived from it, so a restarted
    /// instance fences and aborts its previous incarnation.
    pub instance_id: String,
    /// Use `group.instance.id` (static membership: a restart within the session timeout
    /// keeps the assignment without a rebalance).
    pub static_membership: bool,
    pub data_dir: PathBuf,
    /// sled's page cache in bytes. sled holds more than this after a scan of the whole
    /// store; the reducer then opens the store again (see `Store::reopen`).
    pub store_cache_bytes: u64,
    /// Bytes of run states sampled before the store trains its zstd dictionary, if it has
    /// none (see `crate::pack`).
    pub store_dictionary_after: usize,
    pub commit_interval: Duration,
    /// A batch stays open at least this long even when no input is waiting (0: adaptive,
    /// commit as soon as no input waits).
    pub batch_linger: Duration,
    pub max_batch: usize,
    pub max_payload_bytes: usize,
    /// The keyring command signatures are checked against (see `keys`).
    pub keyring: Option<PathBuf>,
    /// Refuse unsigned commands (production); without it they are taken as before.
    pub require_signatures: bool,
    /// The key the reducer signs the commands it produces for other runs with (a child
    /// run's start and cancel); `None`: they go unsigned.
    pub signing_key: Option<PathBuf>,
    /// How long before the broker's time a signed command may have been issued, and how
    /// far after it (clock skew); its id is remembered that long (see `replay`).
    pub command_window: Duration,
    pub command_skew: Duration,
    /// Seal run payloads with per-run data keys (see `sortie_seal`); `None`: plaintext.
    pub seal: Option<sortie_seal::SealConfig>,
    pub session_timeout: Duration,
    /// How long past its own timeout a transactional call may block before the process
    /// ends itself for its supervisor to restart it (see `watchdog`).
    pub stall_grace: Duration,
    /// Die on purpose at this point, on its `fault_after`-th pass (crash tests only; never
    /// set by default).
    pub fault: Option<FaultPoint>,
    pub fault_after: u32,
    /// Start even on a commands topic that keeps producer time (`CreateTime`), with a
    /// warning: only for tests that speak for a client hours later (see
    /// `check_commands_clock`).
    pub allow_create_time: bool,
}

impl ReducerConfig {
    pub fn new(
        kafka: KafkaConfig,
        registry_url: impl Into<String>,
        topics: Topics,
        data_dir: PathBuf,
    ) -> Self {
        Self {
            kafka,
            registry_url: registry_url.into(),
            auto_register: true,
            group_id: format!("{}reducer", topics.prefix()),
            topics,
            instance_id: "0".into(),
            static_membership: false,
            data_dir,
            store_cache_bytes: crate::store::CACHE_CAPACITY,
            store_dictionary_after: crate::pack::TRAIN_AFTER,
            commit_interval: Duration::from_millis(100),
            batch_linger: Duration::ZERO,
            max_batch: 500,
            max_payload_bytes: 1024 * 1024,
            keyring: None,
            require_signatures: false,
            signing_key: None,
            command_window: Duration::from_secs(300),
            command_skew: Duration::from_secs(30),
            seal: None,
            session_timeout: Duration::from_secs(10),
            stall_grace: Duration::from_secs(30),
            fault: None,
            fault_after: 1,
            allow_create_time: false,
        }
    }

    /// The instance's transactional id, `<group>-<instance id>`; also the prefix of its
    /// clients' names.
    pub fn transactional_id(&self) -> String {
        format!("{}-{}", self.group_id, self.instance_id)
    }

    /// The transactional ids of the instance's two producers, which take turns (see
    /// `Engine::turn`): the instance's own, then `<own>#2`. An instance id may not hold a
    /// `#`, so no instance's first id is another's second.
    pub fn transactional_ids(&self) -> Result<[String; 2], Error> {
        if self.instance_id.contains('#') {
            return Err(Error::Setup(format!(
                "the instance id {:?} holds a '#', which marks its second producer's transactional id",
                self.instance_id
            )));
        }
        let own = self.transactional_id();
        let second = format!("{own}#2");
        Ok([own, second])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(instance_id: &str) -> ReducerConfig {
        let topics = Topics::new("t.");
        ReducerConfig {
            instance_id: instance_id.into(),
            ..ReducerConfig::new(KafkaConfig::new("127.0.0.1:9092"), "", topics, ".".into())
        }
    }

    #[test]
    fn the_first_producer_keeps_the_instances_transactional_id_and_the_second_is_marked() {
        let ids = config("reducer-0").transactional_ids().expect("ids");
        // The first is the id every earlier version used: an upgrade fences the old one.
        assert_eq!(ids, ["t.reducer-reducer-0", "t.reducer-reducer-0#2"]);
        let other = config("reducer-0#2").transactional_ids();
        assert!(
            matches!(other, Err(Error::Setup(ref why)) if why.contains("'#'")),
            "an instance id whose first id would be another's second is refused: {other:?}"
        );
    }
}
