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
//!
//! Given the reducer's transactions (when each began and when its commit was answered,
//! from its "Batch committed." lines), two hops are split where a transaction ends:
//!
//! | hop | from → to | what it holds |
//! |---|---|---|
//! | `intent_to_commit` | intent produced → its transaction's commit answered | the rest of the transaction: deliveries, offsets, `EndTxn` |
//! | `commit_to_handler` | commit answered → handler started | the markers written, the intent visible to `read_committed`, the executor's fetch and decode |
//! | `result_behind_transaction` | of `result_to_folded`: while a transaction without the result was in flight | the wait for the transaction in flight (or for one the result just missed) |
//! | `result_fetched_folded` | the rest of `result_to_folded` | the result's delivery, the reducer's fetch and fold, its transaction beginning |
//!
//! A record's timestamp is in milliseconds, the transactions' stamps in microseconds:
//! the split hops are right to within a millisecond.

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

/// A record timestamp's millisecond in µs (saturating: a timestamp is whatever the record
/// says).
fn us(ms: i64) -> i64 {
    ms.saturating_mul(1000)
}

/// The reducer's transactions, one open at a time: (began, committed), µs since the
/// epoch, in the order they began.
struct Transactions(Vec<(i64, i64)>);

impl Transactions {
    fn new(spans: &[(i64, i64)]) -> Transactions {
        let mut spans = spans.to_vec();
        spans.sort_unstable();
        Transactions(spans)
    }

    /// The transaction that produced a record stamped `at_ms`: the last to begin before
    /// that millisecond ended, if the record's millisecond reaches it (one a log line is
    /// missing for is not guessed). A transaction's records go out right after it
    /// begins, so a record of the millisecond in which one ended and the next began is
    /// the next one's.
    fn carrying(&self, at_ms: i64) -> Option<usize> {
        let i = self
            .0
            .partition_point(|&(began, _)| began <= us(at_ms).saturating_add(999))
            .checked_sub(1)?;
        (self.0[i].1 >= us(at_ms)).then_some(i)
    }

    /// The commit of the transaction that produced a record stamped `at_ms`, µs.
    fn commit_of(&self, at_ms: i64) -> Option<i64> {
        self.carrying(at_ms).map(|i| self.0[i].1)
    }

    /// Of the time from a result produced at `result_ms` to its fold's events produced at
    /// `folded_ms`, the µs during which an earlier transaction (without the result) was
    /// in flight: summed back from the one before the folding transaction while they end
    /// after the result.
    fn behind(&self, result_ms: i64, folded_ms: i64) -> Option<i64> {
        let folding = self.carrying(folded_ms)?;
        let from = us(result_ms);
        Some(
            self.0[..folding]
                .iter()
                .rev()
                .take_while(|&&(_, committed)| committed > from)
                .map(|&(began, committed)| committed - began.max(from))
                .sum(),
        )
    }
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
    transactions: &[(i64, i64)],
) -> anyhow::Result<Value> {
    let transactions = Transactions::new(transactions);
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
            ("intent_to_handler", started.saturating_sub(intent)),
            ("handler", finished.saturating_sub(started)),
            ("result_produced", result.saturating_sub(finished)),
            ("result_to_folded", folded.saturating_sub(result)),
            ("step", folded.saturating_sub(intent)),
        ] {
            hops.entry(hop).or_default().push(ms as f64);
        }
        if let (Some(commit), Some(behind)) = (
            transactions.commit_of(intent),
            transactions.behind(result, folded),
        ) {
            let behind = behind as f64 / 1000.0;
            for (hop, ms) in [
                (
                    "intent_to_commit",
                    commit.saturating_sub(us(intent)) as f64 / 1000.0,
                ),
                (
                    "commit_to_handler",
                    us(started).saturating_sub(commit) as f64 / 1000.0,
                ),
                ("result_behind_transaction", behind),
                (
                    "result_fetched_folded",
                    (folded.saturating_sub(result) as f64 - behind).max(0.0),
                ),
            ] {
                hops.entry(hop).or_default().push(ms);
            }
        }
    }
    let mut out = serde_json::Map::new();
    out.insert("steps".into(), json!(complete));
    for (hop, values) in &hops {
        out.insert((*hop).into(), summary(values));
    }
    out.insert(
        "what".into(),
        json!("ms per step: intent_to_handler = intent produced (in the reducer's transaction) → the executor's handler started (commit, read_committed visibility, fetch), split into intent_to_commit (→ the transaction's commit answered) and commit_to_handler (→ handler started: markers, visibility, fetch); handler; result_produced = handler done → result produced; result_to_folded = result produced → the reducer produced its fold's events (delivery, fetch, batch, fold), split into result_behind_transaction (a transaction without it in flight) and result_fetched_folded (the rest); step = the sum"),
    );
    Ok(Value::Object(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three transactions, µs: the second begins in the millisecond the first ended.
    fn three() -> Transactions {
        Transactions::new(&[
            (110_200_000, 110_207_400),
            (110_000_000, 110_006_300),
            (110_006_800, 110_010_100),
        ])
    }

    /// Checked red placing a record by the start of its millisecond (the second
    /// transaction's record given to the first).
    #[test]
    fn a_record_belongs_to_the_last_transaction_begun_within_its_millisecond() {
        let t = three();
        assert_eq!(t.carrying(110_000), Some(0));
        assert_eq!(t.carrying(110_005), Some(0));
        // Stamped 110_006: the first ended at .3 and the second began at .8 of that ms;
        // records go out as a transaction begins, so it is the second's.
        assert_eq!(t.carrying(110_006), Some(1));
        assert_eq!(t.carrying(110_010), Some(1));
        // Between transactions, and before the first: none is guessed.
        assert_eq!(t.carrying(110_050), None);
        assert_eq!(t.carrying(109_999), None);
        assert_eq!(t.commit_of(110_003), Some(110_006_300));
    }

    /// Checked red counting only the transaction just before the folding one.
    #[test]
    fn a_result_is_behind_every_transaction_in_flight_without_it() {
        let t = three();
        // Produced at 110_002 while the first was in flight, folded by the second: behind
        // the first from 110_002.000 to its commit at 110_006.300.
        assert_eq!(t.behind(110_002, 110_006), Some(4_300));
        // Produced before the first began and missed it: behind all of it.
        assert_eq!(t.behind(109_990, 110_007), Some(6_300));
        // Produced after the second ended, folded by the third: behind none.
        assert_eq!(t.behind(110_150, 110_200), Some(0));
        // Produced during the first, folded by the third: behind the rest of the first
        // and all of the second.
        assert_eq!(t.behind(110_004, 110_200), Some(2_300 + 3_300));
        // Folded outside every logged transaction: not known.
        assert_eq!(t.behind(110_004, 110_100), None);
    }

    /// A step result's timestamps are whatever its record says: the extremes place
    /// nothing and panic nowhere (overflow checks are on in the tests' build). Checked
    /// red with the ms → µs product unsaturated: it overflows.
    #[test]
    fn forged_timestamps_are_placed_nowhere() {
        let t = three();
        for at in [i64::MAX, i64::MIN, -1] {
            assert_eq!(t.carrying(at), None, "{at}");
            assert!(t.behind(at, 110_006).is_some(), "{at}");
            assert_eq!(t.behind(110_002, at), None, "{at}");
        }
    }
}
