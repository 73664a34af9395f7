//! The lookup on the real `sortie.commands`: the command that carried a decision or a
//! child's start, found by the broker's time.

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers;
use rdkafka::{Message, Offset, TopicPartitionList};
use sortie_kafka::KafkaConfig;
use sortie_wire::records as w;
use sortie_wire::{partition_for, Codec};

use crate::{CommandRecord, Commands, Found};

/// Looks commands up on the real `sortie.commands` (blocking: call it off the async
/// runtime). The broker stamps commands (`LogAppendTime`), so a decision's time finds its
/// record with `offsetsForTimes`; the records of that millisecond are read until one is
/// the command.
#[allow(missing_debug_implementations)]
pub struct KafkaCommands {
    consumer: BaseConsumer,
    topic: String,
    partitions: u32,
    codec: std::sync::Arc<Codec>,
    runtime: tokio::runtime::Handle,
}

/// How long one lookup may take.
const LOOKUP: Duration = Duration::from_secs(15);

impl KafkaCommands {
    pub fn open(
        kafka: &KafkaConfig,
        topic: String,
        partitions: u32,
        codec: std::sync::Arc<Codec>,
        runtime: tokio::runtime::Handle,
    ) -> Result<Self, String> {
        let consumer: BaseConsumer = kafka
            .client()
            .set("group.id", "sortie-why")
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .create()
            .map_err(|e| e.to_string())?;
        Ok(Self {
            consumer,
            topic,
            partitions,
            codec,
            runtime,
        })
    }

    fn lookup(&mut self, run_id: &str, command_id: &str, at: i64) -> Result<Found, String> {
        let partition = partition_for(run_id.as_bytes(), self.partitions);
        let (low, high) = self
            .consumer
            .fetch_watermarks(&self.topic, partition, Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        let mut times = TopicPartitionList::new();
        times
            .add_partition_offset(&self.topic, partition, Offset::Offset(at))
            .map_err(|e| e.to_string())?;
        let found = self
            .consumer
            .offsets_for_times(times, Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        let start = found
            .elements()
            .first()
            .and_then(|e| match e.offset() {
                Offset::Offset(offset) => Some(offset),
                _ => None,
            })
            .unwrap_or(high);
        if start >= high {
            return Ok(Found::Missing);
        }
        let mut assignment = TopicPartitionList::new();
        assignment
            .add_partition_offset(&self.topic, partition, Offset::Offset(start))
            .map_err(|e| e.to_string())?;
        self.consumer
            .assign(&assignment)
            .map_err(|e| e.to_string())?;
        let deadline = Instant::now() + LOOKUP;
        let mut first_time = None;
        while Instant::now() < deadline {
            let Some(polled) = self.consumer.poll(Duration::from_millis(200)) else {
                continue;
            };
            let message = polled.map_err(|e| e.to_string())?;
            let time = message.timestamp().to_millis().unwrap_or(i64::MAX);
            first_time.get_or_insert(time);
            if time > at {
                break;
            }
            if message.key() == Some(run_id.as_bytes()) {
                let decoded = self
                    .runtime
                    .block_on(self.codec.decode::<w::RunCommand>(message.payload()));
                if let Ok(command) = decoded {
                    if command.command_id == command_id && command.run_id == run_id {
                        let headers = message
                            .headers()
                            .map(|h| {
                                h.iter()
                                    .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                                    .collect()
                            })
                            .unwrap_or_default();
                        return Ok(Found::Record(Box::new(CommandRecord {
                            partition,
                            offset: message.offset(),
                            value: message.payload().unwrap_or_default().to_vec(),
                            headers,
                            command,
                        })));
                    }
                }
            }
            if message.offset() + 1 >= high {
                break;
            }
        }
        // Nothing at that time: gone with the retention if the topic now starts after it.
        if start == low && first_time.is_some_and(|t| t > at) {
            return Ok(Found::Gone);
        }
        Ok(Found::Missing)
    }
}

impl Commands for KafkaCommands {
    fn find(&mut self, run_id: &str, command_id: &str, at: i64) -> Found {
        self.lookup(run_id, command_id, at)
            .unwrap_or_else(Found::Unreadable)
    }
}
