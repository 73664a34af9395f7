//! Where a step's time goes, hop by hop, read back from the topics after a load phase:
//! for every step of the phase's runs, the intent's record (its timestamp: when the
//! reducer produced it, inside its transaction), the step result (`started_at` and
//! `finished_at` from the executor's clock, and its record's timestamp: when the executor
//! produced it) and the run event that folded it (`StepSucceeded`, produced by the
//! reducer with the next step's intent in the same transaction). Every process runs on
//! this machine, so the clocks agree to the millisecond.
//!
//! | hop | from → to | what it holds |
//! |---|---|---|
//! | `intent_to_handler` | intent produced → handler started | the reducer's transaction commit, the intent becoming visible to a `read_committed` reader, the executor's fetch and decode |
//! | `handler` | handler started → done | the tool itself (`echo`: nothing) |
//! | `result_produced` | handler done → result produced | sealing and encoding the result |
//! | `result_to_folded` | result produced → its fold's events produced | the result's delivery, the reducer's fetch, batching and fold |
//! | `step` | intent produced → folded | the sum |

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{json, Value};
use sortie_kafka::read::{self, Next};
use sortie_kafka::KafkaConfig;
use sortie_wire::records as w;
use sortie_wire::{Codec, Topics};
use tokio::runtime::Handle;

use crate::stats::summary;

/// One step's stamps, in epoch milliseconds.
#[derive(Debug, Default, Clone, Copy)]
struct Stamps {
    intent: Option<i64>,
    started: Option<i64>,
    finished: Option<i64>,
    result: Option<i64>,
    folded: Option<i64>,
}

/// Reads every record of `topic` from its start to its end (`read_committed`) and hands
/// each to `handle`.
fn read_all(
    kafka: &KafkaConfig,
    topic: &str,
    mut handle: impl FnMut(&rdkafka::message::BorrowedMessage<'_>),
) -> anyhow::Result<()> {
    let consumer: BaseConsumer = kafka
        .client()
        .set("group.id", format!("{topic}.bench-hops"))
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .create()?;
    let deadline = Instant::now() + Duration::from_secs(120);
    let partitions = read::partition_ids(consumer.client(), topic, Duration::from_secs(30))?;
    let spans = read::watermarks(&consumer, topic, partitions, deadline)?;
    let mut assignment = TopicPartitionList::new();
    for (&partition, &(low, _)) in &spans {
        assignment.add_partition_offset(topic, partition, Offset::Offset(low))?;
    }
    consumer.assign(&assignment)?;
    read::to_end(&consumer, topic, &spans, deadline, |message| {
        handle(message);
        Ok::<_, std::convert::Infallible>(Next::More)
    })
    .map_err(|e| anyhow::anyhow!("reading {topic}: {e:?}"))?;
    Ok(())
}

/// The hops of every step of the runs whose ids start with `runs` (a phase's name and
/// `-`), summarised (p50, p99, ... in ms), with the number of steps they cover.
pub fn measure(
    kafka: &KafkaConfig,
    codec: &Codec,
    runtime: &Handle,
    topics: &Topics,
    queues: &[String],
    runs: &str,
) -> anyhow::Result<Value> {
    // (run, step, attempt) → stamps; the step result is keyed by operation id, which the
    // intent maps back to its step.
    let mut steps: HashMap<(String, String, i32), Stamps> = HashMap::new();
    let mut operations: HashMap<String, (String, String, i32)> = HashMap::new();
    let ours = |key: Option<&[u8]>| key.is_some_and(|k| k.starts_with(runs.as_bytes()));
    for queue in queues {
        // Intents are keyed by operation id: filtered by their run once decoded.
        read_all(kafka, &topics.intents(queue), |message| {
            let Ok(intent) = runtime.block_on(codec.decode::<w::StepIntent>(message.payload()))
            else {
                return;
            };
            if !intent.run_id.starts_with(runs) {
                return;
            }
            let step = (intent.run_id, intent.step_id, intent.attempt);
            operations.insert(intent.operation_id, step.clone());
            steps.entry(step).or_default().intent = message.timestamp().to_millis();
        })?;
    }
    let mut results = Vec::new();
    read_all(kafka, &topics.step_results(), |message| {
        let Ok(result) = runtime.block_on(codec.decode::<w::StepResult>(message.payload())) else {
            return;
        };
        if result.run_id.starts_with(runs) && result.finished_at.is_some() {
            results.push((result, message.timestamp().to_millis()));
        }
    })?;
    for (result, at) in results {
        let step = operations.get(&result.operation_id).cloned().unwrap_or((
            result.run_id,
            result.step_id,
            result.attempt,
        ));
        let stamps = steps.entry(step).or_default();
        stamps.started = Some(result.started_at);
        stamps.finished = result.finished_at;
        stamps.result = at;
    }
    read_all(kafka, &topics.run_events(), |message| {
        if !ours(message.key()) {
            return;
        }
        let Ok(event) = runtime.block_on(codec.decode::<w::RunEvent>(message.payload())) else {
            return;
        };
        if let w::EventBody::StepSucceeded(s) = event.body {
            let step = (event.run_id, s.step_id, s.attempt);
            if let Some(stamps) = steps.get_mut(&step) {
                stamps.folded = message.timestamp().to_millis();
            }
        }
    })?;
    let mut hops: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut complete = 0usize;
    for stamps in steps.values() {
        let (Some(intent), Some(started), Some(finished), Some(result), Some(folded)) = (
            stamps.intent,
            stamps.started,
            stamps.finished,
            stamps.result,
            stamps.folded,
        ) else {
            continue;
        };
        complete += 1;
        for (hop, ms) in [
            ("intent_to_handler", started - intent),
            ("handler", finished - started),
            ("result_produced", result - finished),
            ("result_to_folded", folded - result),
            ("step", folded - intent),
        ] {
            hops.entry(hop).or_default().push(ms as f64);
        }
    }
    let mut out = serde_json::Map::new();
    out.insert("steps".into(), json!(complete));
    for (hop, values) in &hops {
        out.insert((*hop).into(), summary(values));
    }
    out.insert(
        "what".into(),
        json!("ms per step: intent_to_handler = intent produced (in the reducer's transaction) → the executor's handler started (commit, read_committed visibility, fetch); handler; result_produced = handler done → result produced; result_to_folded = result produced → the reducer produced its fold's events (delivery, fetch, batch, fold); step = the sum"),
    );
    Ok(Value::Object(out))
}
