//! The exactly-once loop around the fold: the reducer as tasks.
//!
//! One thread owns a consumer (commands + step-results, `read_committed`, range
//! assignment so partition N of both topics lands on the same member) and, through the
//! [`Engine`], a transactional producer. The modules split the loop along Kafka Streams'
//! task model:
//!
//! - `tasks`: ownership. The rebalance callback commits the open batch on revocation and
//!   restores (after stable offsets) on assignment; one task per partition.
//! - `input`: the input policy — skip, dead-letter, forward, or apply with the fold.
//! - `txn`: the transaction of a batch (outputs, run states, offsets) and its failures.
//! - `cache`: the sled write after the commit.
//!
//! Batching is adaptive: a small batch commits as soon as no input is waiting, at once
//! (light load: one input, one short transaction); a batch past a quarter of
//! `max_batch` waits for `max_batch` inputs or `commit_interval` of age (full load).
//!
//! Under load the commit is a pipeline of two: while batch N is in flight (records sent,
//! offsets sent, deliveries coming in) the loop folds N+1, reading runs through N's
//! after-states; between polls it serves N's delivery reports, and once they are in it
//! commits N and writes sled, and only then may N+1 begin its transaction.
//!
//! Invariants:
//! - sled never runs ahead of Kafka: it is written after the commit, so after a crash it
//!   is at most behind, and the restore reads the changelog from its marker.
//! - one transaction open at a time; sled is written for N before N+1's transaction
//!   begins.
//! - an aborted or failed transaction leaves nothing visible to `read_committed` readers;
//!   it takes the batch folded on it along, the consumer seeks back to the first offset
//!   either batch read and their in-memory state is dropped, so the same inputs are
//!   applied again to the same state: same effects.
//! - offsets sent are "last processed + 1", only for partitions owned in the generation
//!   the inputs were read in.
//! - transient failures retry in place with the same clients; only a fenced or fatal
//!   producer rebuilds them (a rejoin of the group).

mod config;
mod pipeline;
mod poll_loop;

pub use config::ReducerConfig;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::error::KafkaError;
use sortie_wire::{Codec, CodecConfig};
use tokio::runtime::Handle;

use crate::health::Health;
use crate::store::{self, Store};
use crate::watchdog::Watchdog;
use poll_loop::Reducer;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kafka: {0}")]
    Kafka(#[from] KafkaError),
    #[error("local store: {0}")]
    Store(#[from] store::Error),
    #[error("graph table: {0}")]
    Graphs(#[from] crate::graphs::Error),
    #[error("schema registry: {0}")]
    Registry(String),
    #[error("this instance was fenced by a newer one with the same transactional id")]
    Fenced,
    /// A cached run state that does not read back (see `Engine::recover`).
    #[error("the cached state of run {run_id} cannot be read: {reason}")]
    UnreadableCache { run_id: String, reason: String },
    /// The clients are rebuilt, so that a partition is assigned (and restored) again.
    #[error("{0}")]
    Rebuild(String),
    #[error("{0}")]
    Setup(String),
}

/// Runs the reducer until `shutdown` is set. Blocking: call it from a dedicated thread (or
/// `spawn_blocking`). A fenced or fatal producer makes it rebuild its clients and carry
/// on; it returns only on shutdown, a setup error or a local store failure.
pub fn run(config: ReducerConfig, runtime: Handle, shutdown: Arc<AtomicBool>) -> Result<(), Error> {
    run_with_health(config, runtime, shutdown, Health::default())
}

/// [`run`], reporting readiness to `health` (see [`crate::health`]).
pub fn run_with_health(
    config: ReducerConfig,
    runtime: Handle,
    shutdown: Arc<AtomicBool>,
    health: Health,
) -> Result<(), Error> {
    check_commands_clock(&config, &runtime)?;
    let store = Arc::new(
        Store::open_with_cache(&config.data_dir.join("sled"), config.store_cache_bytes)?
            .with_dictionary_after(config.store_dictionary_after),
    );
    let codec = Arc::new(Codec::new(&CodecConfig {
        registry_url: config.registry_url.clone(),
        auto_register: config.auto_register,
    }));
    let watchdog = Watchdog::start(config.stall_grace, "reducer");
    let membership = Watchdog::start(config.stall_grace, "reducer");
    let mut failures = 0u32;
    while !shutdown.load(Ordering::Relaxed) {
        match Reducer::new(
            &config,
            runtime.clone(),
            codec.clone(),
            store.clone(),
            health.clone(),
            watchdog.clone(),
            membership.clone(),
        )
        .and_then(|mut r| r.run(&shutdown))
        {
            Ok(()) => return Ok(()),
            Err(e @ Error::Store(store::Error::Corrupt(_))) => {
                // Never trust it again: the next start wipes it and restores from Kafka.
                tracing::error!(error = %e, "The local store holds an unreadable entry; it is invalidated and will be rebuilt from the changelog at the next start.");
                if let Err(invalidate) = store.invalidate() {
                    tracing::error!(error = %invalidate, "Invalidating the local store failed.");
                }
                return Err(e);
            }
            Err(e @ (Error::Setup(_) | Error::Store(_))) => return Err(e),
            Err(e) => {
                failures += 1;
                health.set(Err(format!("rebuilding the Kafka clients after: {e}")));
                let backoff = Duration::from_millis(200 * u64::from(failures.min(10)));
                tracing::warn!(error = %e, ?backoff, "The reducer's producer cannot go on; rebuilding its Kafka clients.");
                std::thread::sleep(backoff);
            }
        }
    }
    Ok(())
}

/// The fold's clock is the broker's (ADR 0003): on a commands topic that keeps each
/// producer's own time (`message.timestamp.type: CreateTime`) whoever produces a command
/// chooses its time, and can backdate an approval past its expiry. The reducer refuses
/// to start on one, or on one whose config it cannot read.
fn check_commands_clock(config: &ReducerConfig, runtime: &Handle) -> Result<(), Error> {
    use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
    use rdkafka::client::DefaultClientContext;
    const KEY: &str = "message.timestamp.type";
    let topic = config.topics.commands();
    let admin: AdminClient<DefaultClientContext> = config
        .kafka
        .named(&format!("{}-config-check", config.transactional_id()))
        .client()
        .create()?;
    let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(30)));
    let described = runtime
        .block_on(admin.describe_configs(&[ResourceSpecifier::Topic(&topic)], &options))
        .map_err(|e| e.to_string())
        .and_then(|found| match found.into_iter().next() {
            Some(Ok(resource)) => Ok(resource.get(KEY).and_then(|e| e.value.clone())),
            Some(Err(code)) => Err(code.to_string()),
            None => Err("no answer".to_owned()),
        });
    let kind = described.map_err(|e| {
        Error::Setup(format!(
            "cannot read the configs of the commands topic {topic} to check that the broker stamps commands ({e}); it must exist (`sortie topology apply`) and the reducer's principal needs DESCRIBE_CONFIGS on it"
        ))
    })?;
    if kind.as_deref() == Some("LogAppendTime") {
        return Ok(());
    }
    let kind = kind.unwrap_or_else(|| "unset".to_owned());
    if config.allow_create_time {
        tracing::warn!(topic, kind, "The commands topic keeps producer time: anyone who produces a command chooses its time (allowed by --allow-create-time, for tests only).");
        return Ok(());
    }
    Err(Error::Setup(format!(
        "the commands topic {topic} has {KEY}: {kind}, so whoever produces a command could backdate it; the fold's clock must be the broker's. Run `sortie topology apply` to set {KEY}: LogAppendTime on it"
    )))
}
