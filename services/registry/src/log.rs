//! The schemas topic: creating it, replaying it, appending to it.

use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Message, Offset, TopicPartitionList};
use sortie_kafka::read::{self, ReaderContext};
use sortie_kafka::KafkaConfig;

use crate::error::Error;
use crate::record::Record;
use crate::state::State;

/// Every record lives on partition 0: one partition is one total order.
const PARTITION: i32 = 0;
const REPLAY_DEADLINE: Duration = Duration::from_secs(60);
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// Creates the topic (compacted, one partition, the broker's default replication factor)
/// unless it exists.
pub async fn ensure_topic(kafka: &KafkaConfig, topic: &str) -> Result<(), Error> {
    let admin: AdminClient<DefaultClientContext> = kafka.client().create()?;
    let new_topic =
        NewTopic::new(topic, 1, TopicReplication::Fixed(-1)).set("cleanup.policy", "compact");
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let results = admin.create_topics([&new_topic], &options).await?;
    for result in results {
        match result {
            Ok(_) => tracing::info!(topic, "Created the compacted schemas topic."),
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((_, code)) => {
                return Err(Error::CreateTopic {
                    topic: topic.to_owned(),
                    reason: code.to_string(),
                })
            }
        }
    }
    Ok(())
}

/// Reads the topic from the beginning up to its current end and folds it into a state.
///
/// Blocking: run it on a blocking thread.
pub fn replay(kafka: &KafkaConfig, topic: &str) -> Result<State, Error> {
    let started = Instant::now();
    // librdkafka refuses assign() without a group.id; the group is never joined (no
    // subscribe) and no offsets are committed.
    let consumer: BaseConsumer<ReaderContext> = kafka
        .client()
        .set("group.id", "sortie-registry-replay")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .set("auto.offset.reset", "earliest")
        .create_with_context(ReaderContext)?;
    // A freshly created topic may take a moment to show up in metadata.
    let (low, high) =
        sortie_kafka::fetch_watermarks(&consumer, topic, PARTITION, started + REPLAY_DEADLINE)?;
    let mut state = State::default();
    if high <= low {
        tracing::info!(topic, "The schemas topic is empty.");
        return Ok(state);
    }
    let mut assignment = TopicPartitionList::new();
    assignment.add_partition_offset(topic, PARTITION, Offset::Beginning)?;
    consumer.assign(&assignment)?;
    let mut records = 0u64;
    let spans = [(PARTITION, (low, high))].into_iter().collect();
    read::to_end(
        &consumer,
        topic,
        &spans,
        started + REPLAY_DEADLINE,
        |message| {
            match Record::decode(message.key(), message.payload()) {
                Ok(Some(record)) => {
                    state.apply(record);
                    records += 1;
                }
                Ok(None) => {}
                Err(reason) => {
                    return Err(Error::Corrupt {
                        topic: topic.to_owned(),
                        offset: message.offset(),
                        reason,
                    })
                }
            }
            Ok(read::Next::More)
        },
    )
    .map_err(|e| match e {
        read::ReadError::Handler(e) => e,
        read::ReadError::Kafka(e) => Error::Kafka(e),
        read::ReadError::Timeout { .. } => Error::Timeout {
            waited: REPLAY_DEADLINE,
            doing: format!("reading {topic} up to offset {high}"),
        },
    })?;
    tracing::info!(
        topic,
        records,
        end_offset = high,
        next_id = state.next_id(),
        elapsed_ms = started.elapsed().as_millis() as u64,
        "Rebuilt the registry from its topic."
    );
    Ok(state)
}

/// Appends records and waits until Kafka has them (acks=all, idempotent).
pub struct Writer {
    producer: FutureProducer,
    topic: String,
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("topic", &self.topic)
            .finish()
    }
}

impl Writer {
    pub fn new(kafka: &KafkaConfig, topic: &str) -> Result<Writer, Error> {
        let producer: FutureProducer = kafka
            .producer()
            .set("acks", "all")
            .set("enable.idempotence", "true")
            .set("linger.ms", "0")
            .set("message.timeout.ms", WRITE_TIMEOUT.as_millis().to_string())
            .create()?;
        Ok(Writer {
            producer,
            topic: topic.to_owned(),
        })
    }

    /// Returns the offset the record was written at.
    pub async fn write(&self, record: &Record) -> Result<i64, Error> {
        let (key, value) = record.encode();
        let mut message = FutureRecord::to(&self.topic).key(&key).partition(PARTITION);
        if let Some(value) = &value {
            message = message.payload(value);
        }
        match self.producer.send(message, WRITE_TIMEOUT).await {
            Ok(delivery) => Ok(delivery.offset),
            Err((error, _)) => Err(Error::Write {
                what: String::from_utf8_lossy(&key).into_owned(),
                reason: error.to_string(),
            }),
        }
    }
}
