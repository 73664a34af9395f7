//! Restoring a partition's run states from the compacted `sortie.run-state` changelog into
//! sled: from the cache's marker (warm: reads almost nothing) or from the beginning (cold:
//! a new pod, or a cache that could not be trusted).

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Message, Offset, TopicPartitionList};
use sortie_core::RunState;
use sortie_kafka::KafkaConfig;
use sortie_wire::records as w;
use sortie_wire::{Codec, Topics};
use tokio::runtime::Handle;

use crate::convert;
use crate::driver::Error;
use crate::store::{Batch, Store};

const CHUNK: usize = 2_000;

/// Restores `partition`, returning how many changelog records were read.
pub fn partition(
    kafka: &KafkaConfig,
    topics: &Topics,
    codec: &Codec,
    runtime: &Handle,
    store: &Store,
    partition: i32,
    from: Option<u64>,
) -> Result<usize, Error> {
    let topic = topics.run_state();
    let mut config = kafka.client();
    config
        .set("group.id", format!("{}restore", topics.prefix()))
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .set("allow.auto.create.topics", "false");
    let consumer: BaseConsumer = config.create()?;
    let (_, high) = sortie_kafka::fetch_watermarks(
        &consumer,
        &topic,
        partition,
        Instant::now() + Duration::from_secs(30),
    )?;
    if from.is_none() {
        store.forget_partition(partition)?;
    }
    let start = from.map_or(Offset::Beginning, |o| Offset::Offset(o as i64));
    let mut assignment = TopicPartitionList::new();
    assignment.add_partition_offset(&topic, partition, start)?;
    consumer.assign(&assignment)?;

    let deadline = Instant::now() + Duration::from_secs(300);
    let mut read = 0usize;
    let mut next_offset = from.unwrap_or(0) as i64;
    let mut batch = Batch::default();
    let mut pending = 0usize;
    loop {
        if next_offset >= high {
            break;
        }
        if Instant::now() > deadline {
            return Err(Error::Setup(format!(
                "restoring {topic}[{partition}] did not reach offset {high} in time"
            )));
        }
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(message)) => {
                next_offset = message.offset() + 1;
                read += 1;
                let Some(key) = message
                    .key()
                    .map(|k| String::from_utf8_lossy(k).into_owned())
                else {
                    continue;
                };
                let old = store
                    .get_run(&key)?
                    .and_then(|b| serde_json::from_slice::<RunState>(&b).ok());
                if let Some(old) = &old {
                    for (timer, due) in &old.timers {
                        batch.disarm_timer(partition, &key, timer, *due);
                    }
                }
                match message.payload() {
                    None => {
                        batch.remove_run(&key);
                    }
                    Some(_) => {
                        let decoded =
                            runtime.block_on(codec.decode::<w::RunState>(message.payload()));
                        let state = decoded
                            .map_err(|e| e.to_string())
                            .and_then(|r| convert::state_from_wire(&r).map_err(|e| e.0));
                        match state {
                            Ok(state) => {
                                for (timer, due) in &state.timers {
                                    batch.arm_timer(partition, &key, timer, *due);
                                }
                                if let Ok(bytes) = serde_json::to_vec(&state) {
                                    batch.put_run(&key, bytes);
                                }
                            }
                            Err(e) => {
                                tracing::error!(run_id = key, offset = message.offset(), error = %e, "A changelog record does not decode; the run is left out of the cache.")
                            }
                        }
                    }
                }
                pending += 1;
                if pending >= CHUNK {
                    batch.set_changelog_offset(partition, next_offset as u64);
                    store.apply(std::mem::take(&mut batch))?;
                    pending = 0;
                }
            }
            Some(Err(e)) => tracing::warn!(error = %e, "Changelog read error."),
            None => {
                // Control records (transaction markers) advance the position without a message.
                if let Ok(position) = consumer.position() {
                    if let Some(Offset::Offset(o)) = position
                        .find_partition(&topic, partition)
                        .map(|e| e.offset())
                    {
                        next_offset = next_offset.max(o);
                    }
                }
            }
        }
    }
    batch.set_changelog_offset(partition, next_offset.max(0) as u64);
    store.apply(batch)?;
    Ok(read)
}
