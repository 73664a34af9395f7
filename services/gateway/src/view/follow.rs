//! Following the run topics: their layout at start, the consumer assigned from the stored
//! offsets, and the task that decodes each record, opens its payloads and applies it.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::OwnedMessage;
use rdkafka::{Message, Offset, TopicPartitionList};
use sortie_kafka::read::ReaderContext;
use sortie_kafka::KafkaConfig;
use sortie_model as convert;
use sortie_wire::records as w;
use sortie_wire::{Codec, Record, Topics};
use tokio::sync::watch;

use super::{caught_up, kafka_error, Error, Progress, View};
use crate::store::{Source, Store};

const METADATA_TIMEOUT: Duration = Duration::from_secs(10);

/// Partition ids of a topic and the end offset of each.
fn layout(kafka: &KafkaConfig, group: &str, topic: &str) -> Result<BTreeMap<i32, i64>, Error> {
    let consumer: BaseConsumer = kafka
        .client()
        .set("group.id", group)
        .set("isolation.level", "read_committed")
        .create()
        .map_err(kafka_error("creating a metadata client"))?;
    let partitions = sortie_kafka::read::partition_ids(consumer.client(), topic, METADATA_TIMEOUT)
        .map_err(kafka_error(format!("fetching the metadata of {topic}")))?;
    if partitions.is_empty() {
        return Err(Error::MissingTopic(topic.to_owned()));
    }
    let marks = sortie_kafka::read::watermarks(
        &consumer,
        topic,
        partitions,
        std::time::Instant::now() + METADATA_TIMEOUT,
    )
    .map_err(kafka_error(format!("fetching the offsets of {topic}")))?;
    Ok(marks.into_iter().map(|(p, (_, high))| (p, high)).collect())
}

/// The partition count of a topic.
pub async fn partitions(kafka: &KafkaConfig, topics: &Topics, topic: &str) -> Result<u32, Error> {
    let (kafka, group, topic) = (
        kafka.clone(),
        format!("{}gateway", topics.prefix()),
        topic.to_owned(),
    );
    let ends = tokio::task::spawn_blocking(move || layout(&kafka, &group, &topic))
        .await
        .map_err(|e| Error::MissingTopic(format!("(metadata task failed: {e})")))??;
    Ok(ends.len() as u32)
}

/// Opens the view over `store` and starts following the topics. The returned task ends
/// when `shutdown` turns true.
pub async fn start(
    kafka: &KafkaConfig,
    topics: &Topics,
    codec: Arc<Codec>,
    store: Store,
    run_keys: Option<sortie_seal::RunKeys>,
    shutdown: watch::Receiver<bool>,
) -> Result<(Arc<View>, tokio::task::JoinHandle<()>), Error> {
    let group = format!("{}gateway", topics.prefix());
    let (state_topic, events_topic) = (topics.run_state(), topics.run_events());
    let (k, g, s, e) = (
        kafka.clone(),
        group.clone(),
        state_topic.clone(),
        events_topic.clone(),
    );
    let (state_ends, event_ends) = tokio::task::spawn_blocking(move || {
        Ok::<_, Error>((layout(&k, &g, &s)?, layout(&k, &g, &e)?))
    })
    .await
    .map_err(|e| Error::MissingTopic(format!("(metadata task failed: {e})")))??;

    let stored_states = store.offsets(Source::RunState)?;
    let stored_events = store.offsets(Source::RunEvents)?;
    let consumer: StreamConsumer<ReaderContext> = kafka
        .client()
        .set("group.id", &group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "true")
        .set("isolation.level", "read_committed")
        .set("auto.offset.reset", "earliest")
        .create_with_context(ReaderContext)
        .map_err(kafka_error("creating the view consumer"))?;
    let mut assignment = TopicPartitionList::new();
    for (topic, ends, stored) in [
        (&state_topic, &state_ends, &stored_states),
        (&events_topic, &event_ends, &stored_events),
    ] {
        for partition in ends.keys() {
            let offset = stored
                .get(partition)
                .map_or(Offset::Beginning, |o| Offset::Offset(*o));
            assignment
                .add_partition_offset(topic, *partition, offset)
                .map_err(kafka_error(format!("assigning {topic}")))?;
        }
    }
    consumer
        .assign(&assignment)
        .map_err(kafka_error("assigning the view's partitions"))?;

    let ready = caught_up(&stored_states, &state_ends) && caught_up(&stored_events, &event_ends);
    let (progress, _) = watch::channel(Progress {
        events: stored_events,
        states: stored_states,
        applied: 0,
        ready,
        failed: false,
    });
    let quarantined = store.quarantine_count();
    crate::metrics::quarantined_runs(quarantined);
    if quarantined > 0 {
        tracing::warn!(
            quarantined,
            "The view holds quarantined runs; their reads answer run_unreadable."
        );
    }
    let view = Arc::new(View {
        store,
        progress,
        waiters: Mutex::new(HashMap::new()),
        targets: (state_ends, event_ends),
        quarantined: AtomicUsize::new(quarantined),
    });
    tracing::info!(
        ready,
        state_partitions = view.targets.0.len(),
        event_partitions = view.targets.1.len(),
        "The view follows run-state and run-events from its stored offsets."
    );
    let follower = Follower {
        view: view.clone(),
        consumer,
        codec,
        run_keys,
        state_topic,
        events_topic,
        shutdown,
    };
    let task = tokio::spawn(follower.run());
    Ok((view, task))
}

struct Follower {
    view: Arc<View>,
    consumer: StreamConsumer<ReaderContext>,
    codec: Arc<Codec>,
    /// Opens sealed payloads as they come in (`None`: they are kept as they are).
    run_keys: Option<sortie_seal::RunKeys>,
    state_topic: String,
    events_topic: String,
    shutdown: watch::Receiver<bool>,
}

enum Decoded<R> {
    Record(R),
    /// Undecodable for good: skipped, the offset moves on.
    Skip,
    /// Shutting down while the registry was unreachable.
    Stop,
}

impl Follower {
    async fn run(mut self) {
        loop {
            let received = tokio::select! {
                _ = self.shutdown.wait_for(|stop| *stop) => break,
                received = self.consumer.recv() => received.map(|m| m.detach()),
            };
            let outcome = match received {
                Ok(message) => self.take(message).await,
                Err(KafkaError::PartitionEOF(_)) => {
                    self.at_end();
                    Ok(true)
                }
                Err(error) => {
                    tracing::warn!(%error, "Reading the run topics failed; reading on.");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    Ok(true)
                }
            };
            match outcome {
                Ok(true) => {}
                Ok(false) => break,
                Err(error) => {
                    // The store as a whole failed (one run's trouble quarantines that run):
                    // reading on would leave it behind without knowing.
                    tracing::error!(%error, "The view store failed; the view stops.");
                    self.view.progress.send_modify(|p| {
                        p.ready = false;
                        p.failed = true;
                    });
                    break;
                }
            }
        }
        if let Err(error) = self.view.store.flush().await {
            tracing::warn!(%error, "Flushing the view store failed.");
        }
        tracing::info!("The view stopped.");
    }

    /// At the end of a partition the position may be past the last record (transaction
    /// markers); it counts for readiness.
    fn at_end(&self) {
        let Ok(positions) = self.consumer.position() else {
            return;
        };
        for element in positions.elements() {
            let Offset::Offset(next) = element.offset() else {
                continue;
            };
            let source = if element.topic() == self.state_topic {
                Source::RunState
            } else if element.topic() == self.events_topic {
                Source::RunEvents
            } else {
                continue;
            };
            self.view.publish(source, element.partition(), next, false);
        }
    }

    /// Applies one record; false when shutting down.
    async fn take(&mut self, message: OwnedMessage) -> Result<bool, Error> {
        let (partition, offset) = (message.partition(), message.offset());
        if message.topic() == self.events_topic {
            let event = match self.decode::<w::RunEvent>(&message).await {
                Decoded::Record(record) => {
                    let (tenant, run_id) = (record.tenant.clone(), record.run_id.clone());
                    match convert::event_from_wire(record) {
                        Ok(mut event) => {
                            if let Some(seal) = self.seal_of(&event.tenant, &event.run_id).await {
                                if let Err(unopened) = seal.open_all(|f| event.map_payloads(f)) {
                                    tracing::warn!(error = %unopened.first, partition, offset, run_id = %event.run_id, "Payloads of a run event do not open; the view keeps them sealed.");
                                }
                            }
                            Some(event)
                        }
                        Err(error) => {
                            let reason = format!("a run event does not read: {error}");
                            self.view
                                .unreadable_event(partition, offset, &tenant, &run_id, &reason)?;
                            return Ok(true);
                        }
                    }
                }
                Decoded::Skip => None,
                Decoded::Stop => return Ok(false),
            };
            self.view.apply_event(partition, offset, event)?;
        } else {
            let record = match self.decode::<w::RunState>(&message).await {
                Decoded::Record(mut record) => {
                    if let Some(seal) = self.seal_of(&record.tenant, &record.run_id).await {
                        if let Ok(mut state) =
                            serde_json::from_str::<sortie_core::RunState>(&record.state)
                        {
                            if let Err(unopened) = seal.open_all(|f| state.map_payloads(f)) {
                                tracing::warn!(error = %unopened.first, partition, offset, run_id = %record.run_id, "Payloads of a run state do not open; the view keeps them sealed.");
                            }
                            if let Ok(json) = serde_json::to_string(&state) {
                                record.state = json;
                            }
                        }
                    }
                    Some(record)
                }
                Decoded::Skip => None,
                Decoded::Stop => return Ok(false),
            };
            self.view.apply_state(partition, offset, record)?;
        }
        Ok(true)
    }

    /// The seal to open `run_id`'s payloads with, if payloads are sealed here. An
    /// unreachable key store is waited out, like an unreachable registry (the view must
    /// not keep payloads sealed for good because of an outage); `None` when shutting down
    /// meanwhile, or when the run's key cannot be had (no KEK for its tenant, a key that
    /// does not unwrap): its payloads then stay sealed in the view.
    async fn seal_of(&mut self, tenant: &str, run_id: &str) -> Option<sortie_seal::RunSeal> {
        let keys = self.run_keys.clone()?;
        let mut pause = Duration::from_millis(100);
        loop {
            match keys.seal(tenant, run_id).await {
                Ok(seal) => return Some(seal),
                Err(sortie_seal::Error::Store(e)) => {
                    tracing::warn!(run_id, error = %e, "Key store unavailable; the view waits.");
                    tokio::select! {
                        _ = self.shutdown.wait_for(|stop| *stop) => return None,
                        () = tokio::time::sleep(pause) => {}
                    }
                    pause = (pause * 2).min(Duration::from_secs(5));
                }
                Err(e) => {
                    tracing::warn!(run_id, error = %e, "A run's data key cannot be had; its payloads stay sealed in the view.");
                    return None;
                }
            }
        }
    }

    async fn decode<R: Record>(&mut self, message: &OwnedMessage) -> Decoded<R> {
        let decoded = tokio::select! {
            _ = self.shutdown.wait_for(|stop| *stop) => return Decoded::Stop,
            decoded = self.codec.decode_patiently::<R>(message.payload(), None) => decoded,
        };
        match decoded {
            Ok(record) => Decoded::Record(record),
            Err(error) => {
                tracing::warn!(
                    topic = message.topic(),
                    partition = message.partition(),
                    offset = message.offset(),
                    %error,
                    "Skipped a record the view cannot decode."
                );
                Decoded::Skip
            }
        }
    }
}
