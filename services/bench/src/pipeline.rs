//! The pipeline ceiling: Sortie's client legs per step, with no Sortie logic, on the same
//! broker in the same run — the physical limit a Kafka-native design of this shape has on
//! this machine.
//!
//! - **Reducer leg**: a `read_committed` member of its own group (range) reading
//!   `commands` and `results`, folding in two transactional producers that take turns, a
//!   transaction each, as the reducer's (Sortie's transactional settings, polled on its
//!   own thread): per input it writes `fan_out` records — Sortie's records per input
//!   from the calibration run — an intent (or, when the run is done, an end event), a
//!   state, and events; then the consumed offsets with the group metadata, every
//!   delivery awaited, commit. The fold is a step counter per run in a map. Every
//!   record carries the run's payload as Sortie's do (a run's own random text of
//!   `payload_bytes`, the state twice that), so compression saves the pipeline no more
//!   than it saves Sortie.
//! - **Executor leg**: a `read_committed` member (cooperative-sticky) reading `intents`,
//!   answering each with its echo (the bench's steps are echoes) from an idempotent
//!   `acks=all` producer (the executor's settings: 1 ms linger, lz4), committing its
//!   offsets every 100 ms.
//! - **Driver**: Sortie's closed loop (starts runs to keep `concurrency` in flight and
//!   follows the events topic `read_committed`, 20 ms fetch wait); a step's round trip is
//!   the same pair of record timestamps as Sortie's (the intent's transaction → the
//!   transaction that folded its result).
//!
//! All three run as threads of the bench process: their CPU is the bench's, beside the
//! broker's.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::producer::{BaseProducer, BaseRecord, DefaultProducerContext, ThreadedProducer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Message, Offset, TopicPartitionList};
use serde_json::{json, Value};
use sortie_kafka::KafkaConfig;
use tokio::runtime::Handle;

use crate::procfs::CpuWindow;
use crate::stats::{round, summary};

/// What the pipeline is given.
#[derive(Debug, Clone)]
pub struct Setup {
    pub prefix: String,
    pub partitions: u32,
    pub steps: usize,
    pub payload_bytes: usize,
    /// Records the reducer leg writes per input (Sortie's, from the calibration run).
    pub fan_out: usize,
    /// The reducer's longest wait for a batch's first input.
    pub commit_interval: Duration,
    pub max_batch: usize,
    /// Processes (name, pid) whose CPU each load is measured with.
    pub watch: Vec<(String, u32)>,
}

/// One closed-loop load through the pipeline.
#[derive(Debug, Clone)]
pub struct Load {
    pub name: String,
    pub runs: usize,
    pub concurrency: usize,
}

/// The reducer leg's transactions since the driver last took them: per transaction the
/// ms it spent in each phase — produce, send offsets, deliveries, commit — and the ms
/// between the previous commit and its begin.
type Phases = Arc<std::sync::Mutex<Vec<[f64; 5]>>>;

/// The pipeline's topics.
struct Names {
    commands: String,
    results: String,
    intents: String,
    events: String,
    states: String,
}

impl Names {
    fn new(prefix: &str) -> Names {
        let name = |what: &str| format!("{prefix}pipeline.{what}");
        Names {
            commands: name("commands"),
            results: name("results"),
            intents: name("intents"),
            events: name("events"),
            states: name("states"),
        }
    }
}

/// Event values the driver reads: `d<step>` dispatched, `s<step>` folded, `e` the end,
/// `x` filler (the rest of an input's records); a space, then the payload.
fn event(tag: &str, payload: &[u8]) -> Vec<u8> {
    let mut value = Vec::with_capacity(tag.len() + 1 + payload.len());
    value.extend_from_slice(tag.as_bytes());
    value.push(b' ');
    value.extend_from_slice(payload);
    value
}

/// Runs the pipeline's legs, drives every load through them in order and reports each.
/// Blocking.
pub fn run(
    kafka: &KafkaConfig,
    setup: &Setup,
    loads: &[Load],
    runtime: &Handle,
) -> anyhow::Result<Vec<Value>> {
    let names = Names::new(&setup.prefix);
    let all = [
        &names.commands,
        &names.results,
        &names.intents,
        &names.events,
        &names.states,
    ];
    runtime.block_on(crate::ceiling::create_topics(
        kafka,
        &all.map(String::as_str),
        setup.partitions,
    ))?;
    let stop = Arc::new(AtomicBool::new(false));
    let phases = Phases::default();
    let reducer = {
        let (kafka, setup, stop, phases) =
            (kafka.clone(), setup.clone(), stop.clone(), phases.clone());
        std::thread::Builder::new()
            .name("pipeline-reducer".into())
            .spawn(move || reducer_leg(&kafka, &setup, &stop, &phases))?
    };
    let executor = {
        let (kafka, setup, stop) = (kafka.clone(), setup.clone(), stop.clone());
        std::thread::Builder::new()
            .name("pipeline-executor".into())
            .spawn(move || executor_leg(&kafka, &setup, &stop))?
    };
    let driven = (|| {
        let mut driver = Driver::new(kafka, setup, phases)?;
        loads
            .iter()
            .map(|load| driver.drive(setup, load))
            .collect::<anyhow::Result<Vec<_>>>()
    })();
    stop.store(true, Ordering::Relaxed);
    let legs = [("reducer", reducer.join()), ("executor", executor.join())];
    let reports = driven?;
    for (leg, joined) in legs {
        match joined {
            Ok(result) => result.with_context(|| format!("the pipeline's {leg} leg"))?,
            Err(_) => bail!("the pipeline's {leg} leg panicked"),
        }
    }
    Ok(reports)
}

fn reducer_leg(
    kafka: &KafkaConfig,
    setup: &Setup,
    stop: &AtomicBool,
    phases: &Phases,
) -> anyhow::Result<()> {
    let names = Names::new(&setup.prefix);
    let kafka = kafka.named(&format!("{}pipeline-reducer", setup.prefix));
    let consumer: BaseConsumer = kafka
        .group_member(
            &format!("{}pipeline.reducer", setup.prefix),
            "range",
            Duration::from_secs(10),
            None,
        )
        .set("fetch.wait.max.ms", "100")
        .create()?;
    let producers =
        crate::shape::taking_turns(&kafka, &format!("{}pipeline-reducer", setup.prefix))?;
    let mut turn = 0usize;
    consumer.subscribe(&[&names.commands, &names.results])?;
    let mut done: HashMap<Vec<u8>, usize> = HashMap::new();
    let mut last_commit = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        // The reducer's batch: block for the first input, then take what is there.
        let mut batch = Vec::new();
        let mut wait = setup.commit_interval;
        while batch.len() < setup.max_batch {
            match consumer.poll(wait) {
                None => break,
                Some(Err(e)) => tracing::warn!(error = %e, "pipeline reducer consumer error"),
                Some(Ok(message)) => batch.push(message.detach()),
            }
            wait = Duration::ZERO;
        }
        if batch.is_empty() {
            continue;
        }
        let producer = &producers[turn % 2];
        turn += 1;
        let begun = Instant::now();
        let gap = (begun - last_commit).as_secs_f64() * 1000.0;
        let mut offsets: HashMap<(String, i32), i64> = HashMap::new();
        let mut outputs = Vec::new();
        for message in &batch {
            let run = message.key().unwrap_or_default().to_vec();
            let partition = message.partition();
            // The run's payload, as Sortie's records carry it: a start's value, or a
            // result's echo of its intent (`<step> <payload>`).
            let is_start = message.topic() == names.commands;
            let value = message.payload().unwrap_or_default();
            let payload = match is_start {
                true => value,
                false => value
                    .iter()
                    .position(|b| *b == b' ')
                    .map_or(value, |space| &value[space + 1..]),
            };
            let step = match is_start {
                true => 0,
                false => done.get(&run).copied().unwrap_or(0) + 1,
            };
            done.insert(run.clone(), step);
            let mut records: Vec<(&str, Vec<u8>)> = Vec::with_capacity(setup.fan_out);
            if step > 0 {
                records.push((&names.events, event(&format!("s{}", step - 1), payload)));
            }
            if step < setup.steps {
                records.push((&names.intents, event(&step.to_string(), payload)));
                records.push((&names.events, event(&format!("d{step}"), payload)));
            } else {
                done.remove(&run);
                records.push((&names.events, event("e", payload)));
            }
            // A state carries the run's input and its steps' outputs: twice the payload.
            records.push((&names.states, [payload, payload].concat()));
            while records.len() < setup.fan_out {
                records.push((&names.events, event("x", payload)));
            }
            // Keyed by the input's key, borrowed from the batch: no copy per record.
            let key = message.key().unwrap_or_default();
            outputs.extend(
                records
                    .into_iter()
                    .map(|(topic, value)| (topic, key, value, partition)),
            );
            offsets.insert(
                (message.topic().to_owned(), partition),
                message.offset() + 1,
            );
        }
        let mut list = TopicPartitionList::new();
        for ((topic, partition), next) in offsets {
            list.add_partition_offset(&topic, partition, Offset::Offset(next))?;
        }
        let [produced, sent_offsets, delivered, committed] =
            crate::shape::transaction(producer, &consumer, &list, || {
                for (topic, key, value, partition) in &outputs {
                    let record = BaseRecord::to(topic)
                        .key(*key)
                        .payload(value)
                        .partition(*partition);
                    crate::shape::send(producer, record)?;
                }
                Ok(())
            })?;
        last_commit = Instant::now();
        let timings = [produced, sent_offsets, delivered, committed, gap];
        phases.lock().expect("phases").push(timings);
    }
    Ok(())
}

fn executor_leg(kafka: &KafkaConfig, setup: &Setup, stop: &AtomicBool) -> anyhow::Result<()> {
    let names = Names::new(&setup.prefix);
    let kafka = kafka.named(&format!("{}pipeline-executor", setup.prefix));
    let consumer: BaseConsumer = kafka
        .group_member(
            &format!("{}pipeline.executor", setup.prefix),
            "cooperative-sticky",
            Duration::from_secs(10),
            None,
        )
        .create()?;
    let [compression] = sortie_kafka::COMPRESSION;
    let producer: ThreadedProducer<DefaultProducerContext> = kafka
        .producer_with(&[("linger.ms", "1"), compression])
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()?;
    consumer.subscribe(&[&names.intents])?;
    let mut positions: HashMap<i32, i64> = HashMap::new();
    let mut committed = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        if let Some(message) = consumer.poll(Duration::from_millis(100)) {
            let message = message?;
            // An echo, as the bench's steps are: the result carries the intent's payload.
            let mut result = BaseRecord::to(&names.results)
                .key(message.key().unwrap_or_default())
                .payload(message.payload().unwrap_or_default())
                .partition(message.partition());
            loop {
                match producer.send(result) {
                    Ok(()) => break,
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                        std::thread::sleep(Duration::from_millis(1));
                        result = back;
                    }
                    Err((e, _)) => bail!("pipeline result produce failed: {e}"),
                }
            }
            positions.insert(message.partition(), message.offset() + 1);
        }
        if committed.elapsed() >= Duration::from_millis(100) && !positions.is_empty() {
            // The executor commits what it answered every 100 ms. Its commit blocks only
            // its consumer thread while results keep going out from the handlers'; here,
            // where one thread does both, the commit is asynchronous so that results
            // never wait behind it (the broker sees the same requests).
            let mut list = TopicPartitionList::new();
            for (partition, next) in positions.drain() {
                list.add_partition_offset(&names.intents, partition, Offset::Offset(next))?;
            }
            consumer.commit(&list, CommitMode::Async)?;
            committed = Instant::now();
        }
    }
    Ok(())
}

/// A run the driver follows.
struct Track {
    issued: Instant,
    dispatched: HashMap<String, i64>,
}

struct Driver {
    phases: Phases,
    consumer: BaseConsumer,
    producer: BaseProducer,
    commands: String,
    partitions: u32,
    next_run: usize,
}

impl Driver {
    fn new(kafka: &KafkaConfig, setup: &Setup, phases: Phases) -> anyhow::Result<Driver> {
        let names = Names::new(&setup.prefix);
        let kafka = kafka.named(&format!("{}pipeline-driver", setup.prefix));
        let consumer: BaseConsumer = kafka
            .client()
            .set("group.id", format!("{}pipeline.driver", setup.prefix))
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .set("fetch.wait.max.ms", "20")
            .create()?;
        let mut assignment = TopicPartitionList::new();
        // Freshly created topics may not have leaders everywhere yet: retry for a while.
        let deadline = Instant::now() + Duration::from_secs(30);
        for partition in 0..setup.partitions as i32 {
            let high = loop {
                match consumer.fetch_watermarks(&names.events, partition, Duration::from_secs(10)) {
                    Ok((_, high)) => break high,
                    Err(e) if Instant::now() > deadline => return Err(e.into()),
                    Err(_) => std::thread::sleep(Duration::from_millis(100)),
                }
            };
            assignment.add_partition_offset(&names.events, partition, Offset::Offset(high))?;
        }
        consumer.assign(&assignment)?;
        let producer: BaseProducer = kafka
            .producer()
            .set("linger.ms", "1")
            .set("queue.buffering.max.messages", "1000000")
            .create()?;
        Ok(Driver {
            phases,
            consumer,
            producer,
            commands: names.commands,
            partitions: setup.partitions,
            next_run: 0,
        })
    }

    fn start(
        &mut self,
        payload_bytes: usize,
        tracks: &mut HashMap<Vec<u8>, Track>,
    ) -> anyhow::Result<()> {
        let id = format!("pipeline-run-{}", self.next_run);
        // Sortie's bench payload: text drawn per run, which compression cannot shrink
        // much (one byte repeated would make the pipeline's batches nearly free).
        let payload = crate::payload_text(payload_bytes, &id);
        let run = id.into_bytes();
        let partition = (self.next_run % self.partitions as usize) as i32;
        self.next_run += 1;
        let record = BaseRecord::to(&self.commands)
            .key(&run)
            .payload(&payload)
            .partition(partition);
        self.producer
            .send(record)
            .map_err(|(e, _)| anyhow::anyhow!("starting a pipeline run: {e}"))?;
        self.producer.poll(Duration::ZERO);
        tracks.insert(
            run,
            Track {
                issued: Instant::now(),
                dispatched: HashMap::new(),
            },
        );
        Ok(())
    }

    fn drive(&mut self, setup: &Setup, load: &Load) -> anyhow::Result<Value> {
        eprintln!(
            "sortie bench: pipeline {}: {} runs x {} steps, {} in flight",
            load.name, load.runs, setup.steps, load.concurrency
        );
        self.phases.lock().expect("phases").clear();
        let window = CpuWindow::start(&setup.watch);
        let started = Instant::now();
        let deadline = started + Duration::from_secs(600);
        let mut tracks: HashMap<Vec<u8>, Track> = HashMap::new();
        let (mut issued, mut finished) = (0usize, 0usize);
        let mut round_trips = Vec::new();
        let mut runs_ms = Vec::new();
        while finished < load.runs {
            while issued < load.runs && tracks.len() < load.concurrency {
                self.start(setup.payload_bytes, &mut tracks)?;
                issued += 1;
            }
            if Instant::now() > deadline {
                bail!(
                    "the pipeline finished {finished} of {} runs in 600 s",
                    load.runs
                );
            }
            self.producer.poll(Duration::ZERO);
            let Some(message) = self.consumer.poll(Duration::from_millis(50)) else {
                continue;
            };
            let message = message?;
            let Some(track) = tracks.get_mut(message.key().unwrap_or_default()) else {
                continue; // a run of an earlier load
            };
            let value = message.payload().unwrap_or_default();
            let tag = value.split(|b| *b == b' ').next().unwrap_or_default();
            let at = message.timestamp().to_millis().unwrap_or(0);
            match tag.first() {
                Some(b'd') => {
                    track
                        .dispatched
                        .insert(String::from_utf8_lossy(&tag[1..]).into_owned(), at);
                }
                Some(b's') => {
                    let step = String::from_utf8_lossy(&tag[1..]);
                    if let Some(sent) = track.dispatched.get(step.as_ref()) {
                        round_trips.push((at - sent) as f64);
                    }
                }
                Some(b'e') => {
                    let key = message.key().unwrap_or_default().to_vec();
                    if let Some(track) = tracks.remove(&key) {
                        runs_ms.push(track.issued.elapsed().as_secs_f64() * 1000.0);
                    }
                    finished += 1;
                }
                _ => {}
            }
        }
        let elapsed = started.elapsed().as_secs_f64();
        let steps = load.runs * setup.steps;
        let transactions = std::mem::take(&mut *self.phases.lock().expect("phases"));
        let phase = |i: usize| summary(&transactions.iter().map(|t| t[i]).collect::<Vec<_>>());
        let total: Vec<f64> = transactions.iter().map(|t| t[..4].iter().sum()).collect();
        Ok(json!({
            "load": load.name,
            "runs": load.runs,
            "concurrency": load.concurrency,
            "elapsed_s": round(elapsed),
            "steps_per_s": round(steps as f64 / elapsed.max(1e-9)),
            "step_round_trip_ms": summary(&round_trips),
            "run_duration_ms": summary(&runs_ms),
            "transactions": transactions.len(),
            "transaction_ms": summary(&total),
            "transaction_phase_ms": {
                "produce": phase(0),
                "send_offsets": phase(1),
                "await_deliveries": phase(2),
                "commit": phase(3),
                "since_previous_commit": phase(4),
            },
            "processes": window.finish(),
        }))
    }
}
