//! Progress of running steps, live: the gateway follows `sortie.step-deltas` from its end
//! (every partition, no consumer group offsets) and keeps each run's recent deltas in
//! memory, opened, for the run's event stream (`GET /v1/runs/{id}/events` as server-sent
//! events: `event: delta`). Deltas are outside the run's history: nothing here is stored
//! on disk, replayed or folded, and a gateway that restarts shows only what arrives after.
//!
//! A delta's position is its Kafka offset: a run's deltas are all on its canonical
//! partition, so the offset orders them and means the same on every gateway replica — a
//! client that reconnects to another replica with `Last-Event-ID` resumes correctly.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::{Message, Offset, TopicPartitionList};
use serde_json::{json, Value};
use sortie_kafka::KafkaConfig;
use sortie_wire::records as w;
use sortie_wire::{Codec, Topics};
use tokio::sync::watch;

/// Deltas kept per run (the oldest go first).
const PER_RUN: usize = 2_000;
/// Text kept per run, in bytes.
const PER_RUN_BYTES: usize = 1 << 20;
/// Runs kept; past it the least recently updated go.
const RUNS: usize = 10_000;
/// Text kept across every run, in bytes; past it the least recently updated runs go.
const TOTAL_BYTES: usize = 64 << 20;
/// A run whose last delta is older than this is forgotten.
const KEPT_FOR: Duration = Duration::from_secs(10 * 60);

/// One delta as a stream sends it.
#[derive(Debug, Clone)]
pub struct Retained {
    /// Its offset in the run's partition of `sortie.step-deltas`.
    pub offset: i64,
    pub tenant: String,
    /// The delta as JSON (`delta` event data), its text opened.
    pub data: Value,
    bytes: usize,
}

#[derive(Debug, Default)]
struct RunDeltas {
    items: VecDeque<Retained>,
    bytes: usize,
    touched: Option<Instant>,
}

/// Every run's recent deltas, and a counter that moves when one arrives.
#[derive(Debug)]
pub struct Hub {
    runs: Mutex<Runs>,
    arrived: watch::Sender<u64>,
}

#[derive(Debug, Default)]
struct Runs {
    by_id: HashMap<String, RunDeltas>,
    bytes: usize,
}

impl Default for Hub {
    fn default() -> Hub {
        Hub {
            runs: Mutex::new(Runs::default()),
            arrived: watch::channel(0).0,
        }
    }
}

impl Hub {
    /// Moves whenever a delta arrives (for a stream to wake up).
    pub fn arrivals(&self) -> watch::Receiver<u64> {
        self.arrived.subscribe()
    }

    /// `run_id`'s retained deltas of `tenant` after `offset`, oldest first.
    pub fn after(&self, tenant: &str, run_id: &str, offset: i64) -> Vec<Retained> {
        let runs = self.runs.lock().unwrap_or_else(|e| e.into_inner());
        runs.by_id.get(run_id).map_or_else(Vec::new, |run| {
            run.items
                .iter()
                .filter(|d| d.offset > offset && d.tenant == tenant)
                .cloned()
                .collect()
        })
    }

    /// Keeps one delta (its text opened) at `offset`.
    pub fn keep(&self, offset: i64, delta: &w::StepDelta, text: String) {
        let bytes = text.len() + 256;
        let kind = match delta.kind {
            w::DeltaKind::Text => "text",
            w::DeltaKind::Status => "status",
        };
        let data = json!({
            "run_id": delta.run_id,
            "step_id": delta.step_id,
            "node": delta.node,
            "operation_id": delta.operation_id,
            "attempt": delta.attempt,
            "execution_id": delta.execution_id,
            "seq": delta.seq,
            "kind": kind,
            "text": text,
            "at": delta.at,
            "offset": offset,
        });
        let now = Instant::now();
        {
            let mut guard = self.runs.lock().unwrap_or_else(|e| e.into_inner());
            let runs = &mut *guard;
            let run = runs.by_id.entry(delta.run_id.clone()).or_default();
            if run.touched.is_some_and(|t| now - t >= KEPT_FOR) {
                runs.bytes -= run.bytes;
                *run = RunDeltas::default();
            }
            run.touched = Some(now);
            run.bytes += bytes;
            runs.bytes += bytes;
            run.items.push_back(Retained {
                offset,
                tenant: delta.tenant.clone(),
                data,
                bytes,
            });
            while run.items.len() > PER_RUN || run.bytes > PER_RUN_BYTES {
                match run.items.pop_front() {
                    Some(gone) => {
                        run.bytes -= gone.bytes;
                        runs.bytes -= gone.bytes;
                    }
                    None => break,
                }
            }
            // Past the bounds across runs, the least recently updated runs go (never
            // the one just updated).
            while runs.by_id.len() > RUNS || runs.bytes > TOTAL_BYTES {
                let oldest = runs
                    .by_id
                    .iter()
                    .filter(|(id, _)| **id != delta.run_id)
                    .min_by_key(|(_, run)| run.touched)
                    .map(|(id, _)| id.clone());
                match oldest.and_then(|id| runs.by_id.remove(&id)) {
                    Some(gone) => runs.bytes -= gone.bytes,
                    None => break,
                }
            }
        }
        self.arrived.send_modify(|n| *n += 1);
    }
}

/// Starts following `sortie.step-deltas` into `hub` from where it ends now (fixed before
/// this returns, so nothing written after the gateway is up is missed) until `shutdown`.
/// A topology without the topic leaves the hub empty (streams carry history only) and
/// says so.
pub async fn follow(
    hub: Arc<Hub>,
    kafka: KafkaConfig,
    topics: Topics,
    codec: Arc<Codec>,
    run_keys: Option<sortie_seal::RunKeys>,
    shutdown: watch::Receiver<bool>,
) {
    let topic = topics.step_deltas();
    let group = format!("{}gateway-deltas", topics.prefix());
    let ends = {
        let (kafka, topic, group) = (kafka.clone(), topic.clone(), group.clone());
        tokio::task::spawn_blocking(move || {
            let probe: rdkafka::consumer::BaseConsumer =
                kafka.client().set("group.id", &group).create().ok()?;
            let partitions =
                sortie_kafka::read::partition_ids(probe.client(), &topic, Duration::from_secs(10))
                    .ok()?;
            let deadline = Instant::now() + Duration::from_secs(10);
            sortie_kafka::read::watermarks(&probe, &topic, partitions, deadline).ok()
        })
        .await
        .ok()
        .flatten()
        .unwrap_or_default()
    };
    if ends.is_empty() {
        tracing::warn!(%topic, "Live step progress is off: the topic does not exist (apply the topology).");
        return;
    }
    let consumer: StreamConsumer = match kafka
        .client()
        .set("group.id", &group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .create()
    {
        Ok(consumer) => consumer,
        Err(error) => {
            tracing::warn!(%error, "Live step progress is off: no consumer for the deltas topic.");
            return;
        }
    };
    let mut assignment = TopicPartitionList::new();
    for (partition, (_, high)) in &ends {
        if let Err(error) =
            assignment.add_partition_offset(&topic, *partition, Offset::Offset(*high))
        {
            tracing::warn!(%error, "Live step progress is off: the deltas topic cannot be assigned.");
            return;
        }
    }
    if let Err(error) = consumer.assign(&assignment) {
        tracing::warn!(%error, "Live step progress is off: the deltas topic cannot be assigned.");
        return;
    }
    tracing::info!(%topic, partitions = ends.len(), "Following live step progress.");
    tokio::spawn(keep(hub, consumer, codec, run_keys, shutdown));
}

/// Reads the assigned deltas into `hub` until `shutdown`.
async fn keep(
    hub: Arc<Hub>,
    consumer: StreamConsumer,
    codec: Arc<Codec>,
    run_keys: Option<sortie_seal::RunKeys>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let message = tokio::select! {
            message = consumer.recv() => message,
            _ = shutdown.wait_for(|stop| *stop) => return,
        };
        let message = match message {
            Ok(message) => message,
            Err(error) => {
                tracing::debug!(%error, "Reading the deltas topic.");
                continue;
            }
        };
        // A delta that does not decode or open is dropped: it is a hint, never history.
        let Ok(delta) = codec.decode::<w::StepDelta>(message.payload()).await else {
            continue;
        };
        let Some(text) = opened(&delta, run_keys.as_ref()).await else {
            continue;
        };
        hub.keep(message.offset(), &delta, text);
    }
}

/// The delta's text: a JSON string, sealed with the run's key when sealing is on. A
/// sealed run's delta in plaintext is not the executor's (which seals what it sends): it
/// is dropped, so nobody with write access to the topic puts words in a run's mouth
/// without its key.
async fn opened(delta: &w::StepDelta, run_keys: Option<&sortie_seal::RunKeys>) -> Option<String> {
    let mut value: Value = serde_json::from_str(&delta.text).ok()?;
    if let Some(keys) = run_keys {
        let seal = keys.seal(&delta.tenant, &delta.run_id).await.ok()?;
        if matches!(seal, sortie_seal::RunSeal::Key { .. }) && !sortie_core::seal::is_sealed(&value)
        {
            return None;
        }
        seal.open(&mut value).ok()?;
    }
    match value {
        Value::String(text) => Some(text),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delta(tenant: &str, run_id: &str, seq: i64, text: &str) -> w::StepDelta {
        w::StepDelta {
            tenant: tenant.into(),
            run_id: run_id.into(),
            step_id: "write#1".into(),
            node: "write".into(),
            operation_id: "op_1".into(),
            attempt: 1,
            execution_id: "exe_1".into(),
            seq,
            kind: w::DeltaKind::Text,
            text: Value::String(text.into()).to_string(),
            at: 0,
        }
    }

    #[test]
    fn a_run_keeps_its_recent_deltas_for_its_tenant_only_and_within_bounds() {
        let hub = Hub::default();
        for offset in 0..(PER_RUN as i64 + 10) {
            hub.keep(
                offset,
                &delta("acme", "r1", offset + 1, "word "),
                "word ".into(),
            );
        }
        let kept = hub.after("acme", "r1", -1);
        assert_eq!(kept.len(), PER_RUN, "the oldest go first");
        assert_eq!(kept[0].offset, 10);
        assert_eq!(hub.after("acme", "r1", PER_RUN as i64 + 7).len(), 2);
        assert!(hub.after("globex", "r1", -1).is_empty(), "another tenant's");
        assert!(hub.after("acme", "r2", -1).is_empty());
        // Bytes bound a run too: two 600 KiB texts do not both stay; and every run's
        // together: 120 runs of 600 KiB keep under 64 MiB, the newest kept.
        for n in 0..120 {
            let run = format!("many-{n}");
            hub.keep(n, &delta("acme", &run, 1, "x"), "y".repeat(600 * 1024));
        }
        let total = hub.runs.lock().expect("runs").bytes;
        assert!(total <= TOTAL_BYTES, "{total}");
        assert_eq!(hub.after("acme", "many-119", -1).len(), 1);
        assert!(hub.after("acme", "many-0", -1).is_empty());
        let big = "x".repeat(600 * 1024);
        hub.keep(1, &delta("acme", "r3", 1, "x"), big.clone());
        hub.keep(2, &delta("acme", "r3", 2, "x"), big);
        let kept = hub.after("acme", "r3", -1);
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].offset, 2);
        assert_eq!(
            kept[0].data["text"].as_str().map(str::len),
            Some(600 * 1024)
        );
    }

    #[tokio::test]
    async fn a_delta_whose_text_is_not_a_json_string_is_dropped() {
        for hostile in ["not json", "{\"a\": 1}", "42", "null", "", "\"\\ud800\""] {
            let mut d = delta("acme", "r1", 1, "");
            d.text = hostile.into();
            let opened = opened(&d, None).await;
            assert!(
                opened.is_none() || hostile.starts_with('"'),
                "{hostile:?} opened as {opened:?}"
            );
        }
        assert_eq!(
            opened(&delta("acme", "r1", 1, "hello"), None)
                .await
                .as_deref(),
            Some("hello")
        );
    }
}
