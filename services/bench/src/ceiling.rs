//! The ceiling: a bare transactional read-process-write loop on the same broker, with the
//! reducer's partition count, batch and commit settings and producer settings, fed the
//! same number of input records as Sortie consumed. It does what the reducer's
//! transaction does minus Sortie's work (decode, fold, encode, sled): consume
//! `read_committed`, produce one output per input, `send_offsets_to_transaction`, await
//! every delivery (SPEC §13: `commit_transaction`'s own flush polls in 100 ms slices),
//! commit. Whatever Sortie cannot reach of this is Sortie's own cost.
//!
//! It runs in up to three settings, all reported: *untuned* (librdkafka's default 100 ms
//! `retry.backoff.ms`, which it waits after every CONCURRENT_TRANSACTIONS answer),
//! *tuned* (the transactional producer settings Sortie uses, `KafkaConfig::
//! transactional_producer`), and *tuned with Sortie's fan-out* (as many records out per
//! input as Sortie writes: events, intents and states). The last is the fair ceiling.

use std::time::{Duration, Instant};

use anyhow::bail;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::producer::{BaseProducer, BaseRecord, DefaultProducerContext, Producer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Message, Offset, TopicPartitionList};
use serde_json::{json, Value};
use sortie_kafka::produce::PolledProducer;
use sortie_kafka::KafkaConfig;
use tokio::runtime::Handle;

use crate::procfs::CpuWindow;
use crate::stats::{round, summary};

/// What the ceiling loop is given.
#[derive(Debug, Clone)]
pub struct Setup {
    pub prefix: String,
    pub partitions: u32,
    pub records: usize,
    pub value_bytes: usize,
    pub commit_interval: Duration,
    pub max_batch: usize,
    /// Records produced per consumed record.
    pub fan_out: usize,
    /// Sortie's transactional producer settings (else librdkafka's retry defaults).
    pub tuned: bool,
    /// Distinguishes the topics and group of several loops in one bench.
    pub name: String,
    /// Processes (name, pid) whose CPU the timed loop is measured with: the broker, and
    /// this process, which runs the loop.
    pub watch: Vec<(String, u32)>,
}

/// Figures of the bare loop.
#[derive(Debug)]
pub struct Ceiling {
    pub fan_out: usize,
    pub tuned: bool,
    pub records: usize,
    pub elapsed: Duration,
    /// Whole transaction: begin, produce, offsets, drain, commit.
    pub commit_ms: Vec<f64>,
    pub records_per_txn: Vec<f64>,
    /// Where a transaction's time goes: begin + produce calls, send_offsets, awaiting
    /// deliveries, commit_transaction.
    pub phases_ms: [Vec<f64>; 4],
    /// CPU of the watched processes from the first record consumed to the last commit
    /// (`procfs::CpuWindow::finish`).
    pub processes: Option<Value>,
}

impl Ceiling {
    pub fn records_per_s(&self) -> f64 {
        self.records as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    pub fn json(&self) -> Value {
        json!({
            "fan_out": self.fan_out,
            "tuned": self.tuned,
            "records": self.records,
            "elapsed_s": round(self.elapsed.as_secs_f64()),
            "records_per_s": round(self.records_per_s()),
            "transactions": self.commit_ms.len(),
            "commit_ms": summary(&self.commit_ms),
            "records_per_txn": summary(&self.records_per_txn),
            "processes": self.processes,
            "phase_ms": {
                "begin_and_produce": summary(&self.phases_ms[0]),
                "send_offsets": summary(&self.phases_ms[1]),
                "await_deliveries": summary(&self.phases_ms[2]),
                "commit_transaction": summary(&self.phases_ms[3]),
            },
        })
    }
}

/// Creates the loop's topics, preloads its input (not timed), runs the loop. Blocking.
pub fn run(kafka: &KafkaConfig, setup: &Setup, runtime: &Handle) -> anyhow::Result<Ceiling> {
    let input = format!("{}ceiling.{}.in", setup.prefix, setup.name);
    let output = format!("{}ceiling.{}.out", setup.prefix, setup.name);
    runtime.block_on(create_topics(kafka, &[&input, &output], setup.partitions))?;
    preload(kafka, &input, setup)?;

    let kafka = &kafka.named(&format!("{}ceiling-{}", setup.prefix, setup.name));
    let mut consumer_config = kafka.client();
    consumer_config
        .set(
            "group.id",
            format!("{}ceiling.{}", setup.prefix, setup.name),
        )
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("isolation.level", "read_committed")
        .set("auto.offset.reset", "earliest")
        .set("partition.assignment.strategy", "range");
    let consumer: BaseConsumer = consumer_config.create()?;
    // The reducer's producer settings (tuned), or librdkafka's retry defaults.
    let transactional_id = format!("{}ceiling-{}", setup.prefix, setup.name);
    let mut producer_config = kafka.transactional_producer(&transactional_id);
    if !setup.tuned {
        producer_config
            .set("retry.backoff.ms", "100")
            .set("retry.backoff.max.ms", "1000");
        for (key, value) in &kafka.properties {
            producer_config.set(key, value); // given properties still win
        }
    }
    // Polled by this thread, like the reducer's (and woken the same way: a producer with
    // a background polling thread makes commit_transaction's flush wait out 100 ms
    // slices).
    let producer = PolledProducer::create(&producer_config, DefaultProducerContext)?;
    producer.init_transactions(Duration::from_secs(30))?;
    consumer.subscribe(&[&input])?;

    let deadline = Instant::now() + Duration::from_secs(600);
    let mut consumed = 0usize;
    let mut first: Option<Instant> = None;
    let mut window: Option<CpuWindow> = None;
    let mut last_commit = Instant::now();
    let mut commit_ms = Vec::new();
    let mut records_per_txn = Vec::new();
    let mut phases_ms: [Vec<f64>; 4] = Default::default();
    while consumed < setup.records {
        if Instant::now() > deadline {
            bail!(
                "the ceiling loop consumed {consumed} of {} records in 600 s",
                setup.records
            );
        }
        let mut batch = Vec::with_capacity(setup.max_batch);
        let batch_deadline = Instant::now() + setup.commit_interval;
        while batch.len() < setup.max_batch {
            let left = batch_deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match consumer.poll(left) {
                None => break,
                Some(Err(e)) => tracing::warn!(error = %e, "ceiling consumer error"),
                Some(Ok(message)) => {
                    if first.is_none() {
                        first = Some(Instant::now());
                        window = Some(CpuWindow::start(&setup.watch));
                    }
                    batch.push(message.detach());
                }
            }
        }
        if batch.is_empty() {
            continue;
        }
        let started = Instant::now();
        let mut offsets = std::collections::BTreeMap::new();
        for message in &batch {
            offsets.insert(message.partition(), message.offset() + 1);
        }
        let mut list = TopicPartitionList::new();
        for (partition, next) in offsets {
            list.add_partition_offset(&input, partition, Offset::Offset(next))?;
        }
        let phases = crate::shape::transaction(&producer, &consumer, &list, || {
            for message in &batch {
                for _ in 0..setup.fan_out.max(1) {
                    let record = BaseRecord::to(&output)
                        .key(message.key().unwrap_or_default())
                        .payload(message.payload().unwrap_or_default())
                        .partition(message.partition());
                    crate::shape::send(&producer, record)?;
                }
            }
            Ok(())
        })?;
        for (phase, took) in phases_ms.iter_mut().zip(phases) {
            phase.push(took);
        }
        last_commit = Instant::now();
        commit_ms.push(started.elapsed().as_secs_f64() * 1000.0);
        records_per_txn.push(batch.len() as f64);
        consumed += batch.len();
    }
    let processes = window.map(|w| w.finish());
    consumer.unsubscribe();
    Ok(Ceiling {
        fan_out: setup.fan_out.max(1),
        tuned: setup.tuned,
        records: consumed,
        elapsed: last_commit.duration_since(first.unwrap_or(last_commit)),
        commit_ms,
        records_per_txn,
        phases_ms,
        processes,
    })
}

pub(crate) async fn create_topics(
    kafka: &KafkaConfig,
    names: &[&str],
    partitions: u32,
) -> anyhow::Result<()> {
    let admin: AdminClient<DefaultClientContext> = kafka.client().create()?;
    let topics: Vec<NewTopic> = names
        .iter()
        .map(|name| {
            NewTopic::new(name, partitions as i32, TopicReplication::Fixed(1))
                .set("compression.type", "producer")
        })
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    for result in admin.create_topics(&topics, &options).await? {
        if let Err((topic, code)) = result {
            if code != RDKafkaErrorCode::TopicAlreadyExists {
                bail!("creating {topic}: {code}");
            }
        }
    }
    crate::stack::wait_for_leaders(kafka, names.iter().map(|n| (*n).to_owned()).collect()).await
}

fn preload(kafka: &KafkaConfig, topic: &str, setup: &Setup) -> anyhow::Result<()> {
    let mut config = kafka.producer();
    config
        .set("enable.idempotence", "true")
        .set("linger.ms", "20")
        .set("compression.type", sortie_kafka::COMPRESSION[0].1)
        .set("queue.buffering.max.messages", "1000000");
    let producer: BaseProducer = config.create()?;
    let value = vec![b'x'; setup.value_bytes];
    for i in 0..setup.records {
        let key = format!("k{i}");
        let partition = (i % setup.partitions as usize) as i32;
        loop {
            let record = BaseRecord::to(topic)
                .key(&key)
                .payload(&value)
                .partition(partition);
            match producer.send(record) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    producer.poll(Duration::from_millis(10));
                }
                Err((e, _)) => bail!("preloading the ceiling input: {e}"),
            }
        }
    }
    producer.flush(Duration::from_secs(120))?;
    Ok(())
}
