//! The gateway's shared state: config, auth, the view, the command producer and the graph
//! catalog; and the write path (publish a command, wait for the reducer's answer).

pub(crate) use sortie_kafka::clock::now_ms;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::StatusCode;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sortie_core::limits::Limit;
use sortie_wire::records::RunCommand;
use sortie_wire::trace::{TraceContext, TRACEPARENT};
use sortie_wire::{partition_for, Codec, CodecConfig, RecordKind, Topics};
use tokio::sync::watch;

use crate::auth::{self, Auth};
use crate::config::GatewayConfig;
use crate::error::ApiError;
use crate::fault::{self, FaultPoint};
use crate::graphs::Catalog;
use crate::store::{Store, StoredRun};
use crate::view::{self, Answer, View};
use sortie_wire::signing::Signer;

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    View(#[from] view::Error),
    #[error(transparent)]
    Store(#[from] crate::store::Error),
    #[error("the schema registry refused or did not answer: {0}")]
    Registry(#[from] sortie_wire::EncodeError),
    #[error("creating the command producer: {0}")]
    Producer(rdkafka::error::KafkaError),
    #[error(transparent)]
    Auth(#[from] auth::Error),
    #[error("serving HTTP: {0}")]
    Serve(std::io::Error),
    #[error("the command signing key: {0}")]
    SigningKey(#[from] sortie_wire::signing::KeyError),
    #[error(transparent)]
    Blobs(#[from] sortie_blob::Error),
    #[error("payload sealing: {0}")]
    Seal(#[from] sortie_seal::Error),
}

/// Everything a request handler needs; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("view", &self.inner.view)
            .finish_non_exhaustive()
    }
}

pub(crate) struct Inner {
    pub config: GatewayConfig,
    pub auth: Arc<Auth>,
    pub view: Arc<View>,
    pub graphs: Arc<Catalog>,
    producer: FutureProducer,
    codec: Arc<Codec>,
    commands_topic: String,
    partitions: u32,
    /// Signs every command for the principal behind its bearer token (a delegate key).
    signer: Option<Signer>,
    stop: watch::Sender<bool>,
    stop_graphs: Arc<AtomicBool>,
    view_task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Open live event streams per tenant.
    streams: Mutex<HashMap<String, usize>>,
    /// Each tenant's start tokens (`crate::admission`).
    admission: crate::admission::Admission,
    /// The blob store of `config.blobs`, opened.
    pub blobs: Option<Arc<dyn sortie_blob::BlobStore>>,
    /// The run data keys of `config.seal`, opened.
    pub run_keys: Option<sortie_seal::RunKeys>,
    /// Running steps' recent progress (`crate::deltas`).
    pub deltas: Arc<crate::deltas::Hub>,
}

impl AppState {
    /// Opens the store, registers the command schema, and starts the view and the graph
    /// catalog. Needs Kafka and the registry.
    pub async fn start(config: GatewayConfig) -> Result<AppState, Error> {
        let topics = Topics::new(config.prefix.clone());
        let auth = Arc::new(Auth::load(&config).await?);
        let blobs = config.blobs.as_ref().map(|b| b.open()).transpose()?;
        if let Some(store) = &blobs {
            tracing::info!(store = %store.location(), "Large inputs and payloads go to the blob store.");
        }
        let run_keys = config
            .seal
            .as_ref()
            .map(sortie_seal::SealConfig::open_logged)
            .transpose()?;
        std::fs::create_dir_all(&config.data_dir).ok();
        let store = Store::open(&config.data_dir, topics.prefix())?;
        let codec = Arc::new(Codec::new(&CodecConfig {
            registry_url: config.registry_url.clone(),
            auto_register: config.auto_register,
        }));
        codec
            .prepare(
                &topics.commands(),
                RecordKind::RunCommand,
                Duration::from_secs(30),
            )
            .await?;
        let partitions = view::partitions(&config.kafka, &topics, &topics.commands()).await?;
        let producer: FutureProducer = config
            .kafka
            .named(&format!("{}gateway-producer", topics.prefix()))
            .producer()
            .set("enable.idempotence", "true")
            .set(
                "message.timeout.ms",
                config.answer_timeout.as_millis().max(1000).to_string(),
            )
            .create()
            .map_err(Error::Producer)?;
        let signer = config
            .signing_key
            .as_deref()
            .map(Signer::load)
            .transpose()?;
        let (stop, stopped) = watch::channel(false);
        let (view, view_task) = view::start(
            &config.kafka,
            &topics,
            codec.clone(),
            store,
            run_keys.clone(),
            stopped,
        )
        .await?;
        let stop_graphs = Arc::new(AtomicBool::new(false));
        if config.require_signatures && config.keyring.is_none() {
            return Err(Error::SigningKey(sortie_wire::signing::KeyError::Invalid {
                what: "--require-signatures".into(),
                reason: "signed graphs are required but no keyring is given (--keyring)".into(),
            }));
        }
        let keyring = config
            .keyring
            .as_deref()
            .map(sortie_wire::signing::KeyringFile::load)
            .transpose()?;
        let graphs = Catalog::start(
            config.kafka.clone(),
            topics.clone(),
            codec.clone(),
            tokio::runtime::Handle::current(),
            stop_graphs.clone(),
            keyring.map(|file| (file, config.require_signatures)),
        );
        tokio::spawn(auth::watch(auth.clone(), stop.subscribe()));
        let deltas = Arc::new(crate::deltas::Hub::default());
        crate::deltas::follow(
            deltas.clone(),
            config.kafka.clone(),
            topics.clone(),
            codec.clone(),
            run_keys.clone(),
            stop.subscribe(),
        )
        .await;
        let start_rate = config.start_rate;
        Ok(AppState {
            inner: Arc::new(Inner {
                config,
                auth,
                view,
                graphs,
                producer,
                codec,
                commands_topic: topics.commands(),
                partitions,
                signer,
                stop,
                stop_graphs,
                view_task: Mutex::new(Some(view_task)),
                streams: Mutex::new(HashMap::new()),
                admission: crate::admission::Admission::new(start_rate),
                blobs,
                run_keys,
                deltas,
            }),
        })
    }

    /// Takes one of `tenant`'s live-stream slots, or `None` when all
    /// `max_streams_per_tenant` are taken. The slot is given back when the returned
    /// guard drops, i.e. when the stream ends or its client leaves.
    /// Takes one of `tenant`'s start tokens, or refuses the start: 429
    /// `start_rate_exceeded` with `Retry-After` (`crate::admission`).
    pub(crate) fn admit_start(&self, tenant: &str) -> Result<(), ApiError> {
        self.inner.admission.admit(tenant).map_err(|wait| {
            let rate = self.inner.config.start_rate.map_or(0.0, |r| r.per_second);
            ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "start_rate_exceeded",
                format!(
                    "tenant {tenant} starts runs faster than this gateway admits ({rate} a second); nothing was published, try again after Retry-After"
                ),
            )
            .retry_after(wait)
        })
    }

    pub(crate) fn stream_slot(&self, tenant: &str) -> Option<StreamSlot> {
        let mut streams = self
            .inner
            .streams
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let open = streams.entry(tenant.to_owned()).or_default();
        if *open >= self.inner.config.max_streams_per_tenant {
            return None;
        }
        *open += 1;
        Some(StreamSlot {
            inner: self.inner.clone(),
            tenant: tenant.to_owned(),
        })
    }

    /// Stops the view (flushing its store), live streams and the graph thread.
    pub async fn stop(&self) {
        self.inner.stop.send_replace(true);
        self.inner.stop_graphs.store(true, Ordering::Relaxed);
        let task = self
            .inner
            .view_task
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }

    pub(crate) fn stopping(&self) -> watch::Receiver<bool> {
        self.inner.stop.subscribe()
    }

    /// The partition of the co-partitioned topics `run_id` lives on.
    pub(crate) fn partition_of(&self, run_id: &str) -> i32 {
        partition_for(run_id.as_bytes(), self.inner.partitions)
    }

    pub(crate) fn view(&self) -> &View {
        &self.inner.view
    }

    pub(crate) fn config(&self) -> &GatewayConfig {
        &self.inner.config
    }

    /// The registry codec, and the partition count of the co-partitioned topics.
    pub(crate) fn codec(&self) -> (Arc<Codec>, u32) {
        (self.inner.codec.clone(), self.inner.partitions)
    }

    /// `value` as a command carries it: with a blob store, the parts over its threshold are
    /// stored (before anything is published, so the command never references a blob
    /// that is not there) and referenced; a store that fails is 503 `blob_store_unavailable`
    /// and nothing is published.
    pub(crate) async fn offload(
        &self,
        tenant: &str,
        run_id: &str,
        value: serde_json::Value,
    ) -> Result<serde_json::Value, ApiError> {
        let (Some(store), Some(config)) = (&self.inner.blobs, &self.inner.config.blobs) else {
            return Ok(value);
        };
        sortie_blob::offload::offload(store.as_ref(), tenant, run_id, value, config.threshold)
            .await
            .map_err(|e| {
                tracing::warn!(error = %e, "A large value could not be stored; nothing was published.");
                ApiError::unavailable(
                    "blob_store_unavailable",
                    format!("the blob store could not store a large value: {e}"),
                )
            })
    }

    /// The shape rule on `value`, the payload called `field`, as the client sent it (400
    /// `limit_exceeded`); see [`AppState::payload`] for a string past the string limit.
    pub(crate) fn check_payload(
        &self,
        field: &str,
        value: &serde_json::Value,
    ) -> Result<(), ApiError> {
        match sortie_core::limits::check_shape(field, value) {
            Err(e) if e.limit == Limit::StringBytes && self.inner.blobs.is_some() => Ok(()),
            checked => checked.map_err(crate::limits::shape_exceeded),
        }
    }

    /// `value`, the payload called `field`, held to the shape rule (400
    /// `limit_exceeded`), then [`AppState::offload`]ed. With a blob store, a string over the
    /// string limit may come in: it is stored by reference, and the rule is checked again on
    /// what the command carries.
    pub(crate) async fn payload(
        &self,
        tenant: &str,
        run_id: &str,
        field: &str,
        value: serde_json::Value,
    ) -> Result<serde_json::Value, ApiError> {
        self.check_payload(field, &value)?;
        let value = self.offload(tenant, run_id, value).await?;
        crate::limits::payload(field, &value)?;
        Ok(value)
    }

    /// How `tenant`'s run `run_id` seals its payloads (made now for a start: `create`);
    /// plaintext when sealing is off. A run whose key was destroyed is 410
    /// `run_forgotten`; a key store that cannot be reached 503 `key_store_unavailable`.
    pub(crate) async fn run_seal(
        &self,
        tenant: &str,
        run_id: &str,
        create: bool,
    ) -> Result<sortie_seal::RunSeal, ApiError> {
        let Some(keys) = &self.inner.run_keys else {
            return Ok(sortie_seal::RunSeal::Plain);
        };
        let lookup = match create {
            true => keys.get_or_create(tenant, run_id).await,
            false => keys.get(tenant, run_id).await,
        };
        let lookup = lookup.map_err(|e| match e {
            sortie_seal::Error::Store(e) => ApiError::unavailable(
                "key_store_unavailable",
                format!("the run's data key could not be read: {e}"),
            ),
            e => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "unsealable",
                e.to_string(),
            ),
        })?;
        if let sortie_seal::Lookup::Destroyed { .. } = lookup {
            return Err(ApiError::run_forgotten(run_id));
        }
        Ok(sortie_seal::RunKeys::seal_of(run_id, &lookup))
    }

    /// `value` as a command of the run carries it: sealed with the run's data key (see
    /// [`AppState::run_seal`]), so no payload of a sealed run is ever in plaintext on the
    /// commands topic either; nothing is published when this fails.
    pub(crate) async fn seal(
        &self,
        tenant: &str,
        run_id: &str,
        value: serde_json::Value,
        create: bool,
    ) -> Result<serde_json::Value, ApiError> {
        use sortie_seal::Seal as _;
        Ok(self.run_seal(tenant, run_id, create).await?.seal(&value))
    }

    /// Publishes `command` to the run's canonical partition and waits for the reducer's
    /// answer, at most the answer timeout (then 504 with the command id). A command the
    /// reducer would refuse to read is 400 and never published.
    pub(crate) async fn submit(&self, command: &RunCommand) -> Result<Answer, ApiError> {
        crate::limits::as_the_reducer_reads(command)?;
        let inner = &self.inner;
        let id = command.command_id.as_str();
        tracing::Span::current().record("run_id", command.run_id.as_str());
        let answer = inner.view.expect(id, &command.tenant, &command.run_id);
        let sent = self.publish(command).await;
        if let Err(error) = sent {
            inner.view.forget(id);
            return Err(error);
        }
        fault::check(inner.config.fault, FaultPoint::AfterPublish, id);
        match tokio::time::timeout(inner.config.answer_timeout, answer).await {
            Ok(Ok(answer)) => Ok(answer),
            _ => {
                inner.view.forget(id);
                Err(ApiError::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "answer_timeout",
                    format!(
                        "the command was published but its answer did not arrive within {} ms; check the run later",
                        inner.config.answer_timeout.as_millis()
                    ),
                )
                .with("command_id", id)
                .with("run_id", command.run_id.as_str()))
            }
        }
    }

    async fn publish(&self, command: &RunCommand) -> Result<(), ApiError> {
        let inner = &self.inner;
        let bytes = inner
            .codec
            .encode(&inner.commands_topic, command)
            .await
            .map_err(|e| ApiError::unavailable("registry_unavailable", e.to_string()))?;
        // Kafka would refuse it (MessageSizeTooLarge): not an outage to retry, a request
        // to change. Headers (trace, signature) get the margin.
        if bytes.len() + 4096 > sortie_kafka::MAX_RECORD_BYTES {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                format!(
                    "the command would be a {} byte record; Kafka takes at most {}. Large inputs and payloads go by reference with a blob store (--blob-store, --blob-threshold)",
                    bytes.len(),
                    sortie_kafka::MAX_RECORD_BYTES
                ),
            ));
        }
        let partition = partition_for(command.run_id.as_bytes(), inner.partitions);
        // The request's trace (or the run's) travels on to the reducer, intents and results.
        let trace = crate::metrics::current_trace()
            .unwrap_or_else(|| TraceContext::for_run(&command.run_id))
            .child(&command.command_id)
            .header_value();
        let record = FutureRecord::to(&inner.commands_topic)
            .key(command.run_id.as_bytes())
            .payload(&bytes)
            .partition(partition);
        let mut headers = OwnedHeaders::new().insert(Header {
            key: TRACEPARENT,
            value: Some(trace.as_bytes()),
        });
        if let Some(signer) = &inner.signer {
            for (key, value) in signer.headers(&bytes) {
                headers = headers.insert(Header {
                    key,
                    value: Some(&value),
                });
            }
        }
        let record = record.headers(headers);
        inner
            .producer
            .send(record, inner.config.answer_timeout)
            .await
            .map_err(|(e, _)| ApiError::unavailable("kafka_unavailable", e.to_string()))?;
        crate::metrics::published(command.body.kind());
        tracing::info!(
            run_id = %command.run_id,
            command_id = %command.command_id,
            command = command.body.kind(),
            partition,
            "Published a command."
        );
        Ok(())
    }

    /// The run once the view holds every event of `answer`'s state version (its changelog
    /// record, written in the same transaction, has arrived), waiting at most `timeout`;
    /// otherwise the run as the view has it.
    pub(crate) async fn settled(&self, answer: &Answer, timeout: Duration) -> Option<StoredRun> {
        let view = self.view();
        let settled = |v: &View| {
            v.store
                .run(&answer.run_id)
                .ok()
                .flatten()
                .is_some_and(|r| r.changelog_version >= answer.state_version)
                || v.store
                    .quarantined(&answer.run_id)
                    .is_ok_and(|q| q.is_some())
        };
        view.wait_until(timeout, settled).await;
        view.store.run(&answer.run_id).ok().flatten()
    }
}

/// One open live stream of a tenant; dropping it frees the slot.
pub(crate) struct StreamSlot {
    inner: Arc<Inner>,
    tenant: String,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut streams = self
            .inner
            .streams
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(open) = streams.get_mut(&self.tenant) {
            *open = open.saturating_sub(1);
            if *open == 0 {
                streams.remove(&self.tenant);
            }
        }
    }
}
