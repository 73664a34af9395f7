//! The executor's metrics: every name is a constant here, described by [`describe`] at
//! startup. The binary installs the Prometheus recorder (with [`HISTOGRAM_BUCKETS`]).

use std::time::Duration;

use metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Unit,
};

/// Intents received, by `queue`.
pub const INTENTS: &str = "sortie_executor_intents_total";
/// Results reported, by `tool` and `status` (`started`, `succeeded`, `failed`, `unknown`).
pub const RESULTS: &str = "sortie_executor_results_total";
/// One handler call (one attempt), by `tool` and `outcome` (`succeeded`, `retryable`,
/// `permanent`, `unknown`).
pub const STEP_SECONDS: &str = "sortie_step_duration_seconds";
/// Intents being worked on, by `queue`.
pub const IN_FLIGHT: &str = "sortie_executor_in_flight";
/// Intents read and held for a slot (fair share between tenants), by `queue`.
pub const HELD: &str = "sortie_executor_held";
/// How long an intent was held before it got a slot, by `queue`.
pub const HELD_SECONDS: &str = "sortie_executor_held_seconds";
/// Intents not called because their attempt's deadline passed before they got a slot.
pub const EXPIRED: &str = "sortie_executor_expired_total";
/// Intents handed back uncalled (revocation or shutdown before their pre-call commit).
pub const HANDED_BACK: &str = "sortie_executor_handed_back_total";
/// Progress deltas of running steps (`sortie.step-deltas`), by `outcome`: `sent`, or
/// `dropped` (the buffer was full, or the record could not be queued).
pub const DELTAS: &str = "sortie_executor_deltas_total";
/// Records sent to the dead-letter topic, by `reason`.
pub const DEAD_LETTERS: &str = "sortie_dead_letters_total";

/// Intents whose arguments held blob references, by `outcome` (`resolved`, or the
/// refusal's code: `blob_corrupt`, `blob_missing`, `blob_forbidden`,
/// `blob_invalid_reference`, `blob_unavailable`).
pub const BLOB_READS: &str = "sortie_executor_blob_reads_total";
/// Outputs that could not be stored in the blob store (the attempt failed or went unknown).
pub const BLOB_WRITE_FAILURES: &str = "sortie_executor_blob_write_failures_total";

/// Explicit buckets: without them the exporter renders histograms as summaries.
pub const HISTOGRAM_BUCKETS: &[(&str, &[f64])] = &[
    (
        STEP_SECONDS,
        &[
            0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
        ],
    ),
    (
        HELD_SECONDS,
        &[
            0.001, 0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
        ],
    ),
];

/// Describes every metric (call once, after the recorder is installed).
pub fn describe() {
    sortie_kafka::metrics::describe();
    describe_counter!(INTENTS, "Intents received, by queue.");
    describe_counter!(
        RESULTS,
        "Results reported, by tool and status (started, succeeded, failed, unknown)."
    );
    describe_histogram!(
        STEP_SECONDS,
        Unit::Seconds,
        "Duration of one handler call (one attempt), by tool and outcome (succeeded, retryable, permanent, unknown)."
    );
    describe_gauge!(IN_FLIGHT, "Intents being worked on, by queue.");
    describe_gauge!(
        HELD,
        "Intents read and held for a slot (tenants share a queue's slots), by queue."
    );
    describe_histogram!(
        HELD_SECONDS,
        Unit::Seconds,
        "How long an intent was held before it got a slot, by queue."
    );
    describe_counter!(
        EXPIRED,
        "Intents not called because their attempt's deadline passed before they got a slot (reported as a retryable failure)."
    );
    describe_counter!(
        HANDED_BACK,
        "Intents handed back without a call: their partition was revoked, or the executor stopped, before their pre-call commit."
    );
    describe_counter!(
        DEAD_LETTERS,
        "Records sent to sortie.dead-letters, by reason code."
    );
    describe_counter!(
        BLOB_READS,
        "Intents whose arguments referenced blobs, by outcome (resolved, or the refusal's code)."
    );
    describe_counter!(
        BLOB_WRITE_FAILURES,
        "Step outputs that could not be stored in the blob store."
    );
    describe_counter!(
        DELTAS,
        "Progress deltas of running steps (an llm step's text), by outcome: sent, or dropped (never the step's result)."
    );
    counter!(HANDED_BACK).increment(0);
    counter!(EXPIRED).increment(0);
    counter!(BLOB_WRITE_FAILURES).increment(0);
}

pub(crate) fn blobs_read(outcome: &'static str) {
    counter!(BLOB_READS, "outcome" => outcome).increment(1);
}

pub(crate) fn deltas(outcome: &'static str, n: usize) {
    counter!(DELTAS, "outcome" => outcome).increment(n as u64);
}

pub(crate) fn blob_write_failed() {
    counter!(BLOB_WRITE_FAILURES).increment(1);
}

pub(crate) fn intent(queue: &str) {
    counter!(INTENTS, "queue" => queue.to_owned()).increment(1);
}

pub(crate) fn in_flight(queue: &str, n: usize) {
    gauge!(IN_FLIGHT, "queue" => queue.to_owned()).set(n as f64);
}

pub(crate) fn held(queue: &str, n: usize) {
    gauge!(HELD, "queue" => queue.to_owned()).set(n as f64);
}

pub(crate) fn admitted(queue: &str, waited: Duration) {
    histogram!(HELD_SECONDS, "queue" => queue.to_owned()).record(waited.as_secs_f64());
}

pub(crate) fn expired() {
    counter!(EXPIRED).increment(1);
}

pub(crate) fn call(tool: &str, outcome: &'static str, took: Duration) {
    histogram!(STEP_SECONDS, "tool" => tool.to_owned(), "outcome" => outcome)
        .record(took.as_secs_f64());
}

pub(crate) fn result(tool: &str, status: &'static str) {
    counter!(RESULTS, "tool" => tool.to_owned(), "status" => status).increment(1);
}

pub(crate) fn handed_back() {
    counter!(HANDED_BACK).increment(1);
}

pub(crate) fn dead_letter(reason: &str) {
    counter!(DEAD_LETTERS, "reason" => reason.to_owned()).increment(1);
}
