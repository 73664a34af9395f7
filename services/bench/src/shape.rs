//! The transaction's shape: how long one transaction of Sortie's transactional producers
//! takes on this broker, by the number of partitions it writes to, with nothing else
//! running. One small record to each of `P` partitions, the offsets of one input
//! partition sent with a group member's metadata, every delivery awaited, commit — back
//! to back, as a light-load reducer commits: two producers taking turns, as the
//! reducer's, and one alone (whose next transaction meets the markers of its last).
//!
//! It says what bounds a light-load step: librdkafka sends one produce request per
//! partition, and the broker answers the requests of one connection one at a time, each
//! after it verified the partition's membership in the transaction (KIP-890); so a
//! transaction costs a fixed part plus a part per partition, whatever the records.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::bail;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::ToBytes;
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{json, Value};
use sortie_kafka::produce::PolledProducer;
use sortie_kafka::KafkaConfig;
use tokio::runtime::Handle;

use crate::stats::summary;

/// The partition counts measured, and the topic's partitions.
const SHAPES: [usize; 4] = [1, 4, 12, 24];
const TOPIC_PARTITIONS: u32 = 24;
/// Measured blocks of each way per shape, and transactions measured per block.
const BLOCKS: usize = 10;
const BLOCK: usize = 10;

pub(crate) type TxnProducer = PolledProducer<DefaultProducerContext>;

/// Two initialised transactional producers that take turns, a transaction each, as the
/// reducer's (see its `Engine::turn`): `<id>` and `<id>#2`.
pub(crate) fn taking_turns(kafka: &KafkaConfig, id: &str) -> anyhow::Result<[TxnProducer; 2]> {
    let init = |id: String| -> anyhow::Result<TxnProducer> {
        let producer =
            PolledProducer::create(&kafka.transactional_producer(&id), DefaultProducerContext)?;
        producer.init_transactions(Duration::from_secs(30))?;
        Ok(producer)
    };
    Ok([init(id.to_owned())?, init(format!("{id}#2"))?])
}

/// Hands `record` to `producer`, serving delivery reports while its queue is full.
pub(crate) fn send<K, P>(
    producer: &TxnProducer,
    mut record: BaseRecord<'_, K, P>,
) -> anyhow::Result<()>
where
    K: ToBytes + ?Sized,
    P: ToBytes + ?Sized,
{
    loop {
        match producer.send(record) {
            Ok(()) => return Ok(()),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                producer.serve(Duration::from_millis(5));
                record = back;
            }
            Err((e, _)) => return Err(e.into()),
        }
    }
}

/// One transaction as the reducer runs it: begin, `produce` hands the records over, the
/// consumed `offsets` go in with `consumer`'s group metadata, every delivery report is
/// served on this thread (as the reducer's are: the flush inside `commit_transaction`
/// would wait for the same), commit. Returns the phases, ms: begin and produce, send
/// offsets, await deliveries, commit.
pub(crate) fn transaction<C: ConsumerContext>(
    producer: &TxnProducer,
    consumer: &BaseConsumer<C>,
    offsets: &TopicPartitionList,
    produce: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<[f64; 4]> {
    let ms = |since: Instant| since.elapsed().as_secs_f64() * 1000.0;
    let phase = Instant::now();
    producer.begin_transaction()?;
    produce()?;
    let produced = ms(phase);
    let phase = Instant::now();
    let metadata = consumer
        .group_metadata()
        .ok_or_else(|| anyhow::anyhow!("no consumer group metadata"))?;
    producer.send_offsets_to_transaction(offsets, &metadata, Duration::from_secs(10))?;
    let sent_offsets = ms(phase);
    let phase = Instant::now();
    let deadline = phase + Duration::from_secs(60);
    while producer.in_flight_count() > 0 {
        if Instant::now() > deadline {
            bail!("a transaction's deliveries did not come in 60 s");
        }
        producer.serve(deadline.saturating_duration_since(Instant::now()));
    }
    let delivered = ms(phase);
    let phase = Instant::now();
    producer.commit_transaction(Duration::from_secs(15))?;
    Ok([produced, sent_offsets, delivered, ms(phase)])
}

/// Measures every shape; `prefix` names the topics and the group.
pub fn run(kafka: &KafkaConfig, prefix: &str, runtime: &Handle) -> anyhow::Result<Value> {
    let output = format!("{prefix}shape.out");
    let input = format!("{prefix}shape.in");
    runtime.block_on(crate::ceiling::create_topics(
        kafka,
        &[&output, &input],
        TOPIC_PARTITIONS,
    ))?;
    let kafka = kafka.named(&format!("{prefix}shape"));
    let consumer: BaseConsumer = kafka
        .group_member(
            &format!("{prefix}shape"),
            "range",
            Duration::from_secs(10),
            None,
        )
        .create()?;
    consumer.subscribe(&[&input])?;
    // Joined once the group has assigned the input topic: its metadata is then what a
    // reducer sends with its offsets.
    let joined_by = Instant::now() + Duration::from_secs(30);
    while consumer.assignment()?.count() == 0 {
        if Instant::now() > joined_by {
            bail!("the transaction-shape consumer was not assigned its topic in 30 s");
        }
        consumer.poll(Duration::from_millis(100));
    }
    let producers = taking_turns(&kafka, &format!("{prefix}shape"))?;
    let value = vec![b'x'; 256];
    // As the reducer commits: two producers taking turns; and one alone, back to back.
    // The two ways alternate in blocks, so neither gets the broker's warm-up alone; the
    // first transaction of a block follows the other way's last and is not measured.
    let mut by_turns = BTreeMap::new();
    let mut by_one = BTreeMap::new();
    let mut i = 0usize;
    for partitions in SHAPES {
        let (mut turns, mut one) = (Vec::new(), Vec::new());
        for block in 0..2 * BLOCKS + 2 {
            let taking_turns = if block % 2 == 0 { 2 } else { 1 };
            for j in 0..=BLOCK {
                i += 1;
                let producer = &producers[j % taking_turns];
                let started = Instant::now();
                let mut offsets = TopicPartitionList::new();
                offsets.add_partition_offset(&input, 0, Offset::Offset(0))?;
                transaction(producer, &consumer, &offsets, || {
                    for p in 0..partitions {
                        let partition = ((i + p) % TOPIC_PARTITIONS as usize) as i32;
                        let record = BaseRecord::to(&output)
                            .key("k")
                            .payload(&value)
                            .partition(partition);
                        send(producer, record)?;
                    }
                    Ok(())
                })?;
                // The first two blocks warm up; a block's first transaction follows the
                // other way's.
                if block >= 2 && j > 0 {
                    let took = started.elapsed().as_secs_f64() * 1000.0;
                    match taking_turns {
                        2 => turns.push(took),
                        _ => one.push(took),
                    }
                }
            }
        }
        by_turns.insert(partitions.to_string(), summary(&turns));
        by_one.insert(partitions.to_string(), summary(&one));
    }
    Ok(json!({
        "what": "ms per transaction of Sortie's transactional producers (two taking turns, as the reducer's), back to back on an otherwise idle broker, by partitions written (one 256 B record each) with one input partition's offsets; one_producer_ms_by_partitions: the same from one producer alone",
        "transaction_ms_by_partitions": by_turns,
        "one_producer_ms_by_partitions": by_one,
    }))
}
