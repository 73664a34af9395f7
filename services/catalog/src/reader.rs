//! The reader under the table: an assigned, never-committing `read_committed` consumer over
//! every partition of the graphs topic.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::OwnedMessage;
use rdkafka::{Message, Offset, TopicPartitionList};
use sortie_kafka::read::{self, ReaderContext};
use sortie_kafka::KafkaConfig;

use crate::{kafka_error, Error};

/// How long opening the table may wait for the topic's metadata.
const METADATA_TIMEOUT: Duration = Duration::from_secs(10);
/// librdkafka needs a `group.id` for `assign()`; the table never joins it or commits.
const THROWAWAY_GROUP: &str = "sortie-graph-table";
pub(crate) enum Polled {
    Message(OwnedMessage),
    /// An event (end of partition, a transient error) but no record.
    Other,
    Nothing,
}

/// An assigned, never-committing `read_committed` consumer over every partition of a topic,
/// tracking how far each partition has been read.
pub(crate) struct Reader {
    consumer: BaseConsumer<ReaderContext>,
    pub(crate) topic: String,
    /// Per partition: every offset below this has been read (or does not exist).
    next: BTreeMap<i32, i64>,
}

impl Reader {
    pub(crate) fn open(kafka: &KafkaConfig, topic: &str) -> Result<Self, Error> {
        let consumer: BaseConsumer<ReaderContext> = kafka
            .client()
            .set("group.id", THROWAWAY_GROUP)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "true")
            .set("isolation.level", "read_committed")
            .set("auto.offset.reset", "earliest")
            .create_with_context(ReaderContext)
            .map_err(kafka_error("creating a consumer"))?;
        let partitions = read::partition_ids(consumer.client(), topic, METADATA_TIMEOUT)
            .map_err(kafka_error(format!("fetching the metadata of {topic}")))?;
        if partitions.is_empty() {
            return Err(Error::MissingTopic(topic.to_owned()));
        }
        let mut assignment = TopicPartitionList::new();
        for &partition in &partitions {
            assignment
                .add_partition_offset(topic, partition, Offset::Beginning)
                .map_err(kafka_error(format!("assigning {topic}")))?;
        }
        consumer
            .assign(&assignment)
            .map_err(kafka_error(format!("assigning {topic}")))?;
        Ok(Self {
            consumer,
            topic: topic.to_owned(),
            next: partitions.into_iter().map(|p| (p, 0)).collect(),
        })
    }

    pub(crate) fn poll(&mut self, timeout: Duration) -> Polled {
        match self.consumer.poll(timeout) {
            None => Polled::Nothing,
            Some(Ok(message)) => {
                let next = self.next.entry(message.partition()).or_insert(0);
                *next = (*next).max(message.offset() + 1);
                Polled::Message(message.detach())
            }
            Some(Err(KafkaError::PartitionEOF(partition))) => {
                // At the end the position may be past the last record (transaction markers,
                // compacted gaps); it is where the next fetch starts.
                let position = self.consumer.position().ok().and_then(|list| {
                    match list.find_partition(&self.topic, partition)?.offset() {
                        Offset::Offset(offset) => Some(offset),
                        _ => None,
                    }
                });
                if let Some(offset) = position {
                    let next = self.next.entry(partition).or_insert(0);
                    *next = (*next).max(offset);
                }
                Polled::Other
            }
            Some(Err(error)) => {
                tracing::warn!(topic = %self.topic, %error, "Reading the graphs topic failed; reading on.");
                Polled::Other
            }
        }
    }

    /// Reads every record up to the ends of the moment (last stable offsets: graphs are
    /// published without transactions, so they are the high watermarks), handing each to `f`.
    pub(crate) fn read_to_end(
        &mut self,
        deadline: Instant,
        timeout: Duration,
        mut f: impl FnMut(OwnedMessage) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let marks = read::watermarks(
            &self.consumer,
            &self.topic,
            self.next.keys().copied(),
            deadline,
        )
        .map_err(kafka_error(format!(
            "fetching the offsets of {}",
            self.topic
        )))?;
        // Nothing below the log start offset exists any more.
        let spans = marks
            .iter()
            .map(|(&p, &(low, high))| (p, (self.next.get(&p).copied().unwrap_or(0).max(low), high)))
            .collect();
        let reached = read::to_end(&self.consumer, &self.topic, &spans, deadline, |message| {
            f(message.detach()).map(|()| read::Next::More)
        })
        .map_err(|e| match e {
            read::ReadError::Handler(e) => e,
            read::ReadError::Kafka(source) => Error::Kafka {
                doing: format!("reading {}", self.topic),
                source,
            },
            read::ReadError::Timeout { .. } => Error::Timeout {
                topic: self.topic.clone(),
                timeout,
            },
        })?;
        for (partition, next) in reached {
            let at = self.next.entry(partition).or_insert(0);
            *at = (*at).max(next);
        }
        Ok(())
    }
}
