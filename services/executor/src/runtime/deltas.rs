//! Progress of running steps: what a handler reports through [`Call::progress`] (an `llm`
//! step's text as the model writes it) goes to the run's partition of
//! `sortie.step-deltas`, keyed by run id, outside any transaction and outside the run's
//! history. Reports are coalesced (text of one execution within 50 ms becomes one record)
//! and never wait: past [`BUFFERED`] pending reports, new ones are dropped and counted.
//! The committed step result stays the one truth, so a lost delta costs nothing but a
//! moment of live text.

use sortie_core::seal::Seal as _;

use super::*;
use crate::progress::{Delta, Progress};

/// Pending reports, across every running step, before new ones are dropped.
pub(super) const BUFFERED: usize = 4096;
/// How long reports are gathered into one record per execution.
const COALESCE: Duration = Duration::from_millis(50);
/// The most text one record carries (a longer coalesced text goes in several).
const MAX_TEXT: usize = 64 * 1024;

/// One execution of one attempt: what its deltas say they belong to.
pub(super) struct Execution {
    tenant: String,
    run_id: String,
    step_id: String,
    node: String,
    operation_id: String,
    attempt: i32,
    execution_id: String,
    seal: sortie_seal::RunSeal,
    seq: std::sync::atomic::AtomicI64,
}

struct Report {
    execution: Arc<Execution>,
    delta: Delta,
}

enum Message {
    Report(Report),
    /// Send what is gathered now, then answer.
    Flush(oneshot::Sender<()>),
}

/// Where the executor's handlers' progress goes (one per process).
#[derive(Clone)]
pub(super) struct Deltas {
    reports: tokio::sync::mpsc::Sender<Message>,
    /// Whether a report was taken since the last flush.
    dirty: Arc<AtomicBool>,
}

impl Deltas {
    /// Starts the task that sends reports to `topic` (with `partitions` partitions) through
    /// `producer`.
    pub(super) fn start(
        producer: FutureProducer,
        codec: Codec,
        topic: String,
        partitions: u32,
    ) -> Deltas {
        let (reports, mut received) = tokio::sync::mpsc::channel::<Message>(BUFFERED);
        tokio::spawn(async move {
            while let Some(first) = received.recv().await {
                let mut batch = Vec::new();
                let mut flushed = Vec::new();
                match first {
                    Message::Report(report) => batch.push(report),
                    Message::Flush(done) => flushed.push(done),
                }
                let until = tokio::time::Instant::now() + COALESCE;
                while flushed.is_empty() && batch.len() < 256 {
                    match tokio::time::timeout_at(until, received.recv()).await {
                        Ok(Some(Message::Report(report))) => batch.push(report),
                        Ok(Some(Message::Flush(done))) => flushed.push(done),
                        Ok(None) | Err(_) => break,
                    }
                }
                for delta in coalesce(batch) {
                    send(&producer, &codec, &topic, partitions, delta).await;
                }
                for done in flushed {
                    let _ = done.send(());
                }
            }
        });
        Deltas {
            reports,
            dirty: Arc::default(),
        }
    }

    /// Sends every report taken so far before returning (bounded by a second), so a
    /// step's last text is queued before its result: a client sees the text complete
    /// before (or with) the result that settles it. Free when nothing was reported.
    pub(super) async fn flush(&self) {
        if !self.dirty.swap(false, Ordering::AcqRel) {
            return;
        }
        let (done, flushed) = oneshot::channel();
        let flush = async {
            if self.reports.send(Message::Flush(done)).await.is_ok() {
                let _ = flushed.await;
            }
        };
        // A result never waits long for progress: past a second it goes regardless.
        let _ = tokio::time::timeout(Duration::from_secs(1), flush).await;
    }

    /// The progress sink of one execution of `call`, sealing with `seal`.
    pub(super) fn progress(&self, call: &Call, seal: sortie_seal::RunSeal) -> Progress {
        let execution = Arc::new(Execution {
            tenant: call.tenant.clone(),
            run_id: call.run_id.clone(),
            step_id: call.step_id.clone(),
            node: call.node.clone(),
            operation_id: call.operation_id.clone(),
            attempt: i32::try_from(call.attempt).unwrap_or(i32::MAX),
            execution_id: format!("exe_{}", ulid::Ulid::generate()),
            seal,
            seq: Default::default(),
        });
        let (reports, dirty) = (self.reports.clone(), self.dirty.clone());
        Progress::new(move |delta| {
            let report = Report {
                execution: execution.clone(),
                delta,
            };
            match reports.try_send(Message::Report(report)) {
                Ok(()) => dirty.store(true, Ordering::Release),
                Err(_) => meter::deltas("dropped", 1),
            }
        })
    }
}

/// Consecutive text of one execution joined (up to [`MAX_TEXT`]); a status note kept
/// only if no later one of the same execution follows in the batch.
fn coalesce(batch: Vec<Report>) -> Vec<Report> {
    let mut out: Vec<Report> = Vec::with_capacity(batch.len());
    for report in batch {
        if let Some(last) = out
            .iter_mut()
            .rev()
            .find(|r| Arc::ptr_eq(&r.execution, &report.execution))
        {
            match (&mut last.delta, &report.delta) {
                (Delta::Text(text), Delta::Text(more)) if text.len() + more.len() <= MAX_TEXT => {
                    text.push_str(more);
                    continue;
                }
                (Delta::Status(note), Delta::Status(newer)) => {
                    note.clone_from(newer);
                    continue;
                }
                _ => {}
            }
        }
        out.push(report);
    }
    out
}

async fn send(
    producer: &FutureProducer,
    codec: &Codec,
    topic: &str,
    partitions: u32,
    report: Report,
) {
    let execution = &report.execution;
    let (kind, text) = match report.delta {
        Delta::Text(text) => (w::DeltaKind::Text, text),
        Delta::Status(note) => (w::DeltaKind::Status, note),
    };
    // Sealed like every payload of the run: the text as a JSON string, sealed.
    let text = execution.seal.seal(&Value::String(text)).to_string();
    let delta = w::StepDelta {
        tenant: execution.tenant.clone(),
        run_id: execution.run_id.clone(),
        step_id: execution.step_id.clone(),
        node: execution.node.clone(),
        operation_id: execution.operation_id.clone(),
        attempt: execution.attempt,
        execution_id: execution.execution_id.clone(),
        seq: execution.seq.fetch_add(1, Ordering::Relaxed) + 1,
        kind,
        text,
        at: now_ms(),
    };
    let bytes = match codec.encode(topic, &delta).await {
        Ok(bytes) => bytes,
        Err(error) => {
            tracing::warn!(%error, run_id = %delta.run_id, "A progress delta could not be encoded; dropped.");
            meter::deltas("dropped", 1);
            return;
        }
    };
    let partition = sortie_wire::partition_for(delta.run_id.as_bytes(), partitions);
    let record = FutureRecord::to(topic)
        .key(&delta.run_id)
        .payload(&bytes)
        .partition(partition);
    // Queued, not awaited: delivery happens in the background, in order per partition
    // (the producer is idempotent), and a delta is never worth slowing a step for.
    match producer.send_result(record) {
        Ok(_delivery) => meter::deltas("sent", 1),
        Err((error, _)) => {
            tracing::debug!(%error, "A progress delta could not be queued; dropped.");
            meter::deltas("dropped", 1);
        }
    }
}
