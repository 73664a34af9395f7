//! `sortie-registry`: the subset of the Confluent Schema Registry REST API that Avro
//! clients use (register, look up, fetch by id or version, compatibility, config), for
//! development and tests. Production points Sortie at a real registry by URL; nothing in
//! Sortie depends on this crate being the registry.
//!
//! **Persistence.** The state lives in one compacted, single-partition Kafka topic
//! (`_schemas` by default), in the Confluent registry's own record format: JSON keys
//! `{"keytype":"SCHEMA","subject":S,"version":V,"magic":1}` with values
//! `{"subject","version","id","schema","deleted"}`, and
//! `{"keytype":"CONFIG","subject":S|null,"magic":0}` with `{"compatibilityLevel":L}`.
//! [`Registry::open`] creates the topic if it is missing, then reads it from the beginning
//! to its high watermark and folds every record into memory. A write is produced with
//! `acks=all` and idempotence, awaited, and only then applied to memory through the same
//! fold, so **a restart rebuilds exactly the same subjects, versions and ids** (ids are
//! global; the next id is the largest one seen plus one). Writes are serialised through
//! one mutex and run on their own task, so a client that hangs up mid-write cannot leave
//! memory behind the log. If Kafka fails a write, the outcome is unknown: the registry
//! re-reads the topic before its next write.
//!
//! **Single writer.** One registry instance owns a topic. There is no leader election:
//! two instances writing the same topic could hand out the same id twice. Give each
//! registry (and each test) its own topic.
//!
//! Permanent deletes are refused: a compacted tombstone would let a later replay reuse an
//! id that old Kafka messages still carry. Schema references and non-Avro schema types are
//! refused too.
//!
//! This crate must never decode Sortie's own records or know about runs.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use sortie_kafka::KafkaConfig;
use tokio::net::TcpListener;

mod access;
mod compat;
mod error;
mod http;
mod log;
mod record;
mod state;

pub use access::Writes;
pub use compat::Level;
pub use error::Error;
pub use http::{router, CONTENT_TYPE_V1};

use http::ApiError;
use record::Record;
use state::State;

/// The default name of the schemas topic (the Confluent registry's).
pub const DEFAULT_TOPIC: &str = "_schemas";

/// A schema registry backed by one Kafka topic. Share it as `Arc<Registry>`.
#[derive(Debug)]
pub struct Registry {
    kafka: KafkaConfig,
    topic: String,
    writer: log::Writer,
    state: RwLock<State>,
    /// Held for a whole write: plan, produce, await, apply.
    write_lock: tokio::sync::Mutex<()>,
    /// A write failed with an unknown outcome: re-read the topic before the next one.
    stale: AtomicBool,
}

impl Registry {
    /// Creates `topic` if missing and rebuilds the registry from it.
    pub async fn open(kafka: &KafkaConfig, topic: &str) -> Result<Registry, Error> {
        log::ensure_topic(kafka, topic).await?;
        let writer = log::Writer::new(kafka, topic)?;
        let state = replay(kafka, topic).await?;
        Ok(Registry {
            kafka: kafka.clone(),
            topic: topic.to_owned(),
            writer,
            state: RwLock::new(state),
            write_lock: tokio::sync::Mutex::new(()),
            stale: AtomicBool::new(false),
        })
    }

    /// The topic this registry persists to.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    pub(crate) fn read<T>(&self, f: impl FnOnce(&State) -> T) -> T {
        let state = self.state.read().unwrap_or_else(PoisonError::into_inner);
        f(&state)
    }

    /// Plans records against the current state, writes them, and applies each one once
    /// Kafka has confirmed it. Runs on its own task so that it completes even if the
    /// caller's future is dropped.
    pub(crate) async fn write<T, F>(self: &Arc<Self>, plan: F) -> Result<T, ApiError>
    where
        T: Send + 'static,
        F: FnOnce(&State) -> Result<(Vec<Record>, T), ApiError> + Send + 'static,
    {
        let this = Arc::clone(self);
        let task = tokio::spawn(async move {
            let _guard = this.write_lock.lock().await;
            if this.stale.load(Ordering::SeqCst) {
                let state = replay(&this.kafka, &this.topic)
                    .await
                    .map_err(ApiError::store)?;
                *this.state.write().unwrap_or_else(PoisonError::into_inner) = state;
                this.stale.store(false, Ordering::SeqCst);
            }
            let (records, answer) = this.read(plan)?;
            for record in records {
                if let Err(error) = this.writer.write(&record).await {
                    tracing::error!(topic = %this.topic, %error, "A registry write failed; the topic will be re-read before the next write.");
                    this.stale.store(true, Ordering::SeqCst);
                    return Err(ApiError::store(error));
                }
                this.state
                    .write()
                    .unwrap_or_else(PoisonError::into_inner)
                    .apply(record);
            }
            Ok(answer)
        });
        task.await.map_err(ApiError::internal)?
    }
}

async fn replay(kafka: &KafkaConfig, topic: &str) -> Result<State, Error> {
    let kafka = kafka.clone();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || log::replay(&kafka, &topic))
        .await
        .map_err(|e| Error::Task(e.to_string()))?
}

/// Serves the registry's HTTP API on `listener` until `shutdown` completes, then lets
/// in-flight requests finish. No write token: writes are open on a loopback listener and
/// refused on any other (see [`Writes`]).
pub async fn serve<F>(
    listener: TcpListener,
    registry: Arc<Registry>,
    shutdown: F,
) -> Result<(), Error>
where
    F: Future<Output = ()> + Send + 'static,
{
    serve_with_token(listener, registry, None, shutdown).await
}

/// [`serve`] with a write token: every write must present it (see [`Writes`]).
pub async fn serve_with_token<F>(
    listener: TcpListener,
    registry: Arc<Registry>,
    token: Option<String>,
    shutdown: F,
) -> Result<(), Error>
where
    F: Future<Output = ()> + Send + 'static,
{
    let writes = Writes::for_listener(listener.local_addr()?, token);
    if writes == Writes::Closed {
        tracing::warn!(
            "The schema registry listens beyond loopback without a write token: it refuses every write."
        );
    }
    axum::serve(listener, guarded(registry, writes))
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}

/// [`router`] behind the write policy `writes`.
pub fn guarded(registry: Arc<Registry>, writes: Writes) -> axum::Router {
    router(registry).layer(axum::middleware::from_fn_with_state(
        Arc::new(writes),
        access::guard,
    ))
}
