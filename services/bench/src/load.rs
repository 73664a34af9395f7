//! The load driver: starts runs with `StartRun` commands, keeps `concurrency` of them in
//! flight (a closed loop: a run that ends makes room for the next), and follows
//! `run-events` live (`read_committed`) to see steps and runs end.
//!
//! Round trip of a step: from its `StepDispatched` event's record timestamp (produced in
//! the same transaction as the intent) to its `StepSucceeded` event's record timestamp
//! (produced when the reducer folded the result). Both are the reducer's own produce
//! times (librdkafka stamps `CreateTime` at produce), so the bench's own consumer lag
//! does not count.
//!
//! Decoding every event would cost the bench's CPU on the machine it measures, so the
//! driver decodes one calibration run fully: every run of the (linear) bench graph emits
//! the same sequence of events, so counting a run's records is enough to know when it
//! ended and which records pair up. A run's last expected record is decoded to check that
//! it is the terminal status; a run that deviates (a retry, a failure) is decoded until it
//! ends and left out of the latency figures.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::OwnedMessage;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Message, Offset, TopicPartitionList};
use sortie_kafka::KafkaConfig;
use sortie_wire::records as w;
use sortie_wire::{partition_for, Codec, Topics};
use tokio::runtime::Handle;

use crate::stack::Service;

/// The event sequence every bench run emits, learnt from a calibration run.
#[derive(Debug, Clone)]
pub struct Pattern {
    /// Records a run writes to run-events, its terminal status last.
    pub events: usize,
    /// (StepDispatched ordinal, StepSucceeded ordinal) of each step.
    pub pairs: Vec<(usize, usize)>,
}

impl Pattern {
    fn learn(events: &[w::RunEvent]) -> anyhow::Result<Pattern> {
        let mut pairs = Vec::new();
        for (succeeded_at, event) in events.iter().enumerate() {
            if let w::EventBody::StepSucceeded(done) = &event.body {
                let dispatched_at = events.iter().position(|e| {
                    matches!(&e.body, w::EventBody::StepDispatched(d)
                        if d.step_id == done.step_id && d.attempt == done.attempt)
                });
                if let Some(dispatched_at) = dispatched_at {
                    pairs.push((dispatched_at, succeeded_at));
                }
            }
        }
        match events.last().map(|e| &e.body) {
            Some(w::EventBody::RunStatusChanged(c)) if c.status == w::RunStatus::Succeeded => {}
            other => bail!("the calibration run did not succeed; its last event: {other:?}"),
        }
        Ok(Pattern {
            events: events.len(),
            pairs,
        })
    }
}

/// A run the driver follows.
#[derive(Debug)]
struct Track {
    issued: Instant,
    stamps: Vec<i64>,
    /// It deviated from the pattern: decode until it ends; no latency from it.
    deviant: bool,
}

/// What one load produced.
#[derive(Debug, Default)]
pub struct Outcome {
    pub runs_succeeded: usize,
    pub runs_failed: usize,
    pub runs_deviant: usize,
    pub runs_unfinished: usize,
    pub elapsed: Duration,
    /// Step round trips in milliseconds.
    pub round_trips: Vec<f64>,
    /// When each round trip ended (its `StepSucceeded` record timestamp, epoch ms), in
    /// the order of `round_trips`.
    pub round_trip_ends: Vec<i64>,
    /// Run durations (command produced → terminal event seen) in milliseconds.
    pub run_durations: Vec<f64>,
}

/// Produces commands and follows run-events of one prefix.
pub struct Driver {
    consumer: BaseConsumer,
    producer: BaseProducer,
    topics: Topics,
    partitions: u32,
    codec: Arc<Codec>,
    runtime: Handle,
    pub pattern: Option<Pattern>,
    /// Told how a load is going about once a second, and `""` when it ends
    /// ([`crate::Options::progress`]).
    pub progress: Option<fn(&str)>,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("topics", &self.topics)
            .field("pattern", &self.pattern)
            .finish_non_exhaustive()
    }
}

fn is_terminal(status: w::RunStatus) -> bool {
    matches!(
        status,
        w::RunStatus::Succeeded | w::RunStatus::Failed | w::RunStatus::Cancelled
    )
}

impl Driver {
    /// Blocking. Assigns every run-events partition at its current end, so only runs
    /// started from now on are seen.
    pub fn new(
        kafka: &KafkaConfig,
        topics: &Topics,
        partitions: u32,
        codec: Arc<Codec>,
        runtime: Handle,
    ) -> anyhow::Result<Driver> {
        let kafka = kafka.named(&format!("{}bench-driver", topics.prefix()));
        let mut config = kafka.client();
        config
            .set("group.id", format!("{}bench-driver", topics.prefix()))
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .set("fetch.wait.max.ms", "20");
        let consumer: BaseConsumer = config.create()?;
        let topic = topics.run_events();
        let mut assignment = TopicPartitionList::new();
        // Freshly created topics may not have leaders yet: retry for a while.
        let deadline = Instant::now() + Duration::from_secs(30);
        for partition in 0..partitions as i32 {
            let high = loop {
                match consumer.fetch_watermarks(&topic, partition, Duration::from_secs(10)) {
                    Ok((_, high)) => break high,
                    Err(e) if Instant::now() > deadline => return Err(e.into()),
                    Err(_) => std::thread::sleep(Duration::from_millis(100)),
                }
            };
            assignment.add_partition_offset(&topic, partition, Offset::Offset(high))?;
        }
        consumer.assign(&assignment)?;
        let mut producer_config = kafka.producer();
        producer_config
            .set("linger.ms", "1")
            .set("queue.buffering.max.messages", "1000000");
        let producer: BaseProducer = producer_config.create()?;
        Ok(Driver {
            consumer,
            producer,
            topics: topics.clone(),
            partitions,
            codec,
            runtime,
            pattern: None,
            progress: None,
        })
    }

    /// Encodes a StartRun of the bench graph with `payload_bytes` of payload.
    pub async fn start_command(
        codec: &Codec,
        topics: &Topics,
        run_id: &str,
        graph_id: &str,
        payload_bytes: usize,
    ) -> anyhow::Result<Vec<u8>> {
        let input = serde_json::json!({ "payload": crate::payload_text(payload_bytes, run_id) })
            .to_string();
        let command = w::RunCommand {
            command_id: format!("start-{run_id}"),
            tenant: "bench".into(),
            run_id: run_id.into(),
            issuer: w::Issuer {
                principal: "svc:bench".into(),
                roles: vec![],
                groups: Vec::new(),
            },
            issued_at: crate::now_ms(),
            body: w::CommandBody::StartRun(w::StartRun {
                graph_id: graph_id.into(),
                graph_version: Some(1),
                input,
                labels: Default::default(),
                budget: None,
                fork: None,
                parent: None,
            }),
        };
        Ok(codec.encode(&topics.commands(), &command).await?)
    }

    /// Produces a command to its run's canonical partition (not waiting for delivery).
    pub fn send(&self, run_id: &str, bytes: &[u8]) -> anyhow::Result<()> {
        let topic = self.topics.commands();
        let partition = partition_for(run_id.as_bytes(), self.partitions);
        loop {
            let record = BaseRecord::to(&topic)
                .key(run_id)
                .payload(bytes)
                .partition(partition);
            match self.producer.send(record) {
                Ok(()) => return Ok(()),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    self.producer.poll(Duration::from_millis(10));
                }
                Err((e, _)) => return Err(e.into()),
            }
        }
    }

    pub fn flush(&self) -> anyhow::Result<()> {
        self.producer.flush(Duration::from_secs(30))?;
        Ok(())
    }

    fn next(&self, timeout: Duration) -> anyhow::Result<Option<OwnedMessage>> {
        self.producer.poll(Duration::ZERO);
        match self.consumer.poll(timeout) {
            None => Ok(None),
            Some(Ok(message)) => Ok(Some(message.detach())),
            Some(Err(e)) => {
                tracing::warn!(error = %e, "run-events read error");
                Ok(None)
            }
        }
    }

    fn decode(&self, message: &OwnedMessage) -> anyhow::Result<w::RunEvent> {
        Ok(self
            .runtime
            .block_on(self.codec.decode::<w::RunEvent>(message.payload()))?)
    }

    /// Starts one run and decodes its every event until it ends; learns the pattern.
    pub fn calibrate(
        &mut self,
        run_id: &str,
        command: &[u8],
        deadline: Duration,
        services: &mut [&mut Service],
    ) -> anyhow::Result<Pattern> {
        self.send(run_id, command)?;
        self.flush()?;
        let started = Instant::now();
        let mut events = Vec::new();
        let mut checked = Instant::now();
        loop {
            if started.elapsed() > deadline {
                bail!("the calibration run {run_id} did not end within {deadline:?}");
            }
            if checked.elapsed() > Duration::from_secs(1) {
                for service in services.iter_mut() {
                    service.check_alive()?;
                }
                checked = Instant::now();
            }
            let Some(message) = self.next(Duration::from_millis(100))? else {
                continue;
            };
            if message.key() != Some(run_id.as_bytes()) {
                continue;
            }
            let event = self.decode(&message)?;
            let ended =
                matches!(&event.body, w::EventBody::RunStatusChanged(c) if is_terminal(c.status));
            events.push(event);
            if ended {
                let pattern = Pattern::learn(&events)?;
                self.pattern = Some(pattern.clone());
                return Ok(pattern);
            }
        }
    }

    /// Waits for the first committed event of `run_id`; returns when it was seen.
    pub fn first_event(
        &mut self,
        run_id: &str,
        deadline: Duration,
        service: &mut Service,
    ) -> anyhow::Result<Instant> {
        let started = Instant::now();
        let mut checked = Instant::now();
        loop {
            if started.elapsed() > deadline {
                bail!("no event of {run_id} within {deadline:?}");
            }
            if checked.elapsed() > Duration::from_millis(500) {
                service.check_alive()?;
                checked = Instant::now();
            }
            if let Some(message) = self.next(Duration::from_millis(5))? {
                if message.key() == Some(run_id.as_bytes()) {
                    return Ok(Instant::now());
                }
            }
        }
    }

    /// Drives `commands` (run id, encoded StartRun) with at most `concurrency` runs in
    /// flight, until every run ended or `deadline` passed.
    pub fn run(
        &mut self,
        commands: &[(String, Vec<u8>)],
        concurrency: usize,
        deadline: Duration,
        services: &mut [&mut Service],
    ) -> anyhow::Result<Outcome> {
        let pattern = self
            .pattern
            .clone()
            .context("calibrate the driver before a load")?;
        let mut tracks: HashMap<String, Track> = HashMap::with_capacity(commands.len());
        let mut outcome = Outcome::default();
        let mut next = 0usize;
        let started = Instant::now();
        let mut last_end = started;
        let mut checked = Instant::now();
        while next < commands.len().min(concurrency.max(1)) {
            let (run_id, bytes) = &commands[next];
            self.send(run_id, bytes)?;
            tracks.insert(run_id.clone(), new_track());
            next += 1;
        }
        let mut ended = 0usize;
        while ended < commands.len() {
            if started.elapsed() > deadline {
                outcome.runs_unfinished = commands.len() - ended;
                break;
            }
            if checked.elapsed() > Duration::from_secs(1) {
                for service in services.iter_mut() {
                    service.check_alive()?;
                }
                checked = Instant::now();
                if let Some(progress) = self.progress {
                    progress(&format!(
                        "sortie bench: {ended}/{} runs ended, {} s",
                        commands.len(),
                        started.elapsed().as_secs()
                    ));
                }
            }
            let Some(message) = self.next(Duration::from_millis(50))? else {
                continue;
            };
            let Some(run_id) = message
                .key()
                .map(|k| String::from_utf8_lossy(k).into_owned())
            else {
                continue;
            };
            let Some(track) = tracks.get_mut(&run_id) else {
                continue;
            };
            track
                .stamps
                .push(message.timestamp().to_millis().unwrap_or(0));
            let seen = track.stamps.len();
            if seen < pattern.events && !track.deviant {
                continue;
            }
            let event = self.decode(&message)?;
            let terminal = match &event.body {
                w::EventBody::RunStatusChanged(c) if is_terminal(c.status) => Some(c.status),
                _ => None,
            };
            match terminal {
                None => {
                    track.deviant = true;
                    continue;
                }
                Some(status) => {
                    if status == w::RunStatus::Succeeded {
                        outcome.runs_succeeded += 1;
                    } else {
                        outcome.runs_failed += 1;
                    }
                    if track.deviant || seen != pattern.events {
                        outcome.runs_deviant += 1;
                    } else {
                        for (dispatched, succeeded) in &pattern.pairs {
                            let ms = track.stamps[*succeeded] - track.stamps[*dispatched];
                            outcome.round_trips.push(ms as f64);
                            outcome.round_trip_ends.push(track.stamps[*succeeded]);
                        }
                    }
                    outcome
                        .run_durations
                        .push(track.issued.elapsed().as_secs_f64() * 1000.0);
                }
            }
            tracks.remove(&run_id);
            ended += 1;
            last_end = Instant::now();
            if next < commands.len() {
                let (run_id, bytes) = &commands[next];
                self.send(run_id, bytes)?;
                tracks.insert(run_id.clone(), new_track());
                next += 1;
            }
        }
        if let Some(progress) = self.progress {
            progress("");
        }
        outcome.elapsed = last_end.duration_since(started);
        Ok(outcome)
    }
}

fn new_track() -> Track {
    Track {
        issued: Instant::now(),
        stamps: Vec::new(),
        deviant: false,
    }
}
