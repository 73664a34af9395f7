//! The reducer's metrics: every name is a constant here, described by [`describe`] at
//! startup. The binary installs the Prometheus recorder (with [`HISTOGRAM_BUCKETS`]).
//!
//! Counters move only when a batch's transaction has committed, so a batch that is
//! aborted and applied again is counted once. Fold-level numbers come from the events
//! the fold emitted (counters) and from the run states of the partitions this instance
//! owns (gauges, exact: rebuilt from the cache after each restore and updated from every
//! committed batch's before/after states). Summed over reducers, the gauges cover every
//! partition once, except for a moment during a rebalance.

use std::collections::BTreeMap;
use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, Unit};
use sortie_core::{Event, EventBody, Input, RunState, RunStatus};

/// Inputs applied, by kind (`command`, `step_result`, `timer`).
pub const INPUTS_APPLIED: &str = "sortie_reducer_inputs_applied_total";
/// Inputs the fold ignored, by reason (duplicates, stale attempts, ...).
pub const INPUTS_IGNORED: &str = "sortie_reducer_inputs_ignored_total";
/// Records forwarded to their run's canonical partition.
pub const FORWARDED: &str = "sortie_reducer_forwarded_total";
/// Committed transactions.
pub const BATCHES: &str = "sortie_reducer_batches_total";
/// Inputs (records consumed plus timers fired) per committed transaction.
pub const BATCH_SIZE: &str = "sortie_reducer_batch_inputs";
/// Time from the first produce of a batch to its committed transaction.
pub const COMMIT_SECONDS: &str = "sortie_reducer_transaction_commit_seconds";
/// Transactions aborted or failed (the batch is applied again).
pub const TRANSACTIONS_FAILED: &str = "sortie_reducer_transactions_failed_total";
/// Restore of one assignment (all its partitions) from the changelog, by `warm` (true:
/// every partition from its cache marker).
pub const RESTORE_SECONDS: &str = "sortie_reducer_restore_seconds";
/// Changelog records read by restores.
pub const RECORDS_RESTORED: &str = "sortie_reducer_restored_records_total";
/// Partitions stopped because Kafka kept refusing records of their own (see the runbook).
pub const PARTITIONS_STOPPED: &str = "sortie_reducer_partitions_stopped_total";
/// Run partitions this instance owns.
pub const OWNED_PARTITIONS: &str = "sortie_reducer_owned_partitions";
/// Records Kafka refused for what they are, by `kind` (`record`: size or content;
/// `destination`: topic or authorization).
pub const RECORDS_REFUSED: &str = "sortie_reducer_records_refused_total";
/// Cached run states that did not read back (their partition is restored again).
pub const CACHE_UNREADABLE: &str = "sortie_reducer_cache_entries_unreadable_total";
/// Runs quarantined because their changelog record does not read back (gauge).
pub const RUNS_QUARANTINED: &str = "sortie_reducer_runs_quarantined";
/// Commands refused before the fold, by `code`: `unauthenticated` (unsigned where
/// required, or a signature that does not hold) or `limit_exceeded` (a payload breaks the
/// shape rule).
pub const COMMANDS_REFUSED: &str = "sortie_reducer_commands_refused_total";
/// Graph records the graph table refused for their signature (unsigned where signatures
/// are required, or a signature that does not hold) since the process started (gauge).
pub const GRAPHS_UNTRUSTED: &str = "sortie_reducer_graph_records_untrusted";
/// Records sent to the dead-letter topic, by `reason`.
pub const DEAD_LETTERS: &str = "sortie_dead_letters_total";
/// Runs by `status` in the partitions this instance owns (gauge).
pub const RUNS: &str = "sortie_runs";
/// Runs entering a `status` (RunStarted counts as `running`).
pub const RUN_TRANSITIONS: &str = "sortie_run_transitions_total";
/// Attempts dispatched, by `tool`.
pub const STEPS_DISPATCHED: &str = "sortie_steps_dispatched_total";
/// Attempts after the first, by `tool`.
pub const STEPS_RETRIED: &str = "sortie_steps_retried_total";
/// Steps succeeded, by `tool`.
pub const STEPS_SUCCEEDED: &str = "sortie_steps_succeeded_total";
/// Attempts failed, by `tool` and `retryable`.
pub const STEPS_FAILED: &str = "sortie_steps_failed_total";
/// Attempts whose outcome is unknown, by `tool` and `needs_operator`.
pub const STEPS_UNKNOWN: &str = "sortie_steps_outcome_unknown_total";
/// Interrupts opened (approval gates reached).
pub const INTERRUPTS_OPENED: &str = "sortie_interrupts_opened_total";
/// Final decisions on interrupts, by `outcome` (`approved`, `rejected`, `expired`).
pub const INTERRUPTS_CLOSED: &str = "sortie_interrupts_closed_total";
/// Interrupts open now in the owned partitions (gauge).
pub const INTERRUPTS_OPEN: &str = "sortie_interrupts_open";
/// Age of the oldest open interrupt in the owned partitions (gauge, 0 when none).
pub const INTERRUPT_OLDEST_AGE: &str = "sortie_interrupts_oldest_open_age_seconds";
/// Operations whose outcome is unknown and waits for an operator (gauge).
pub const AWAITING_OPERATOR: &str = "sortie_operations_awaiting_operator";

/// What each run spent, recorded once when it ends, by final status (histograms).
pub const RUN_COST_USD: &str = "sortie_run_cost_usd";
pub const RUN_TOKENS: &str = "sortie_run_tokens";

/// Explicit buckets: without them the exporter renders histograms as summaries.
pub const HISTOGRAM_BUCKETS: &[(&str, &[f64])] = &[
    (
        COMMIT_SECONDS,
        &[
            0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
        ],
    ),
    (
        BATCH_SIZE,
        &[1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0],
    ),
    (
        RESTORE_SECONDS,
        &[0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0],
    ),
    (
        RUN_COST_USD,
        &[
            0.0, 0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 50.0, 100.0,
        ],
    ),
    (RUN_TOKENS, &[0.0, 100.0, 1e3, 1e4, 5e4, 1e5, 5e5, 1e6, 1e7]),
];

/// Describes every metric (call once, after the recorder is installed).
pub fn describe() {
    describe_counter!(COMMANDS_REFUSED, "Commands refused before the fold, by code: unauthenticated (unsigned where signatures are required, a signature that does not hold, or outside its validity window), replayed (a signed command id already taken) or limit_exceeded (a payload breaks the shape rule); counted as they are seen.");
    describe_gauge!(GRAPHS_UNTRUSTED, "Graph records the graph table refused for their signature (unsigned where signatures are required, or one that does not hold) since the process started.");
    describe_counter!(INPUTS_APPLIED, "Inputs applied by the fold, by kind (command, step_result, timer); counted when their transaction commits.");
    describe_counter!(
        INPUTS_IGNORED,
        "Inputs the fold ignored (duplicates, stale attempts, ...), by reason."
    );
    describe_counter!(
        FORWARDED,
        "Records produced on a partition other than their run's, forwarded to it."
    );
    describe_counter!(BATCHES, "Committed reducer transactions.");
    describe_run_spend();
    describe_histogram!(
        BATCH_SIZE,
        Unit::Count,
        "Inputs (records consumed and timers fired) per committed transaction."
    );
    describe_histogram!(
        COMMIT_SECONDS,
        Unit::Seconds,
        "Time from the first produce of a batch to its committed transaction."
    );
    describe_counter!(
        TRANSACTIONS_FAILED,
        "Transactions aborted or failed; their batch is applied again from the committed offsets."
    );
    describe_histogram!(
        RESTORE_SECONDS,
        Unit::Seconds,
        "Restore of one assignment (all its partitions) from sortie.run-state, by warm (every partition from its cache marker) or cold."
    );
    describe_counter!(
        RECORDS_RESTORED,
        "Changelog records read while restoring partitions."
    );
    describe_gauge!(OWNED_PARTITIONS, "Run partitions this reducer owns.");
    sortie_kafka::metrics::describe();
    describe_counter!(
        DEAD_LETTERS,
        "Records sent to sortie.dead-letters, by reason code."
    );
    describe_gauge!(
        RUNS,
        "Runs by status in the partitions this reducer owns (sum over reducers for the total)."
    );
    describe_counter!(
        RUN_TRANSITIONS,
        "Runs entering a status (RunStarted counts as running)."
    );
    describe_counter!(STEPS_DISPATCHED, "Step attempts dispatched, by tool.");
    describe_counter!(
        STEPS_RETRIED,
        "Step attempts after the first (retries and re-dispatches), by tool."
    );
    describe_counter!(STEPS_SUCCEEDED, "Steps succeeded, by tool.");
    describe_counter!(STEPS_FAILED, "Step attempts failed, by tool and retryable.");
    describe_counter!(
        STEPS_UNKNOWN,
        "Step attempts with an unknown outcome, by tool and needs_operator."
    );
    describe_counter!(INTERRUPTS_OPENED, "Interrupts (approval gates) opened.");
    describe_counter!(
        INTERRUPTS_CLOSED,
        "Interrupts closed, by outcome (approved, rejected, expired)."
    );
    describe_gauge!(
        INTERRUPTS_OPEN,
        "Interrupts waiting for a human decision in the partitions this reducer owns."
    );
    describe_gauge!(INTERRUPT_OLDEST_AGE, Unit::Seconds, "Age of the oldest open interrupt in the owned partitions (0: none). Interrupts found by a restore are aged from their run's last update, which can underestimate.");
    describe_gauge!(
        AWAITING_OPERATOR,
        "Operations with an unknown outcome waiting for an operator's ReconcileOperation."
    );
    // Label-less series exist from the start, so a dashboard shows 0, not "no data".
    describe_counter!(
        PARTITIONS_STOPPED,
        "Partitions stopped because Kafka kept refusing records of their own (not consumed until assigned again)."
    );
    describe_counter!(
        RECORDS_REFUSED,
        "Records Kafka refused for what they are, by kind (record: size or content; destination: topic or authorization); their input is set aside."
    );
    describe_counter!(
        CACHE_UNREADABLE,
        "Cached run states that did not read back; their partition is restored from the changelog again."
    );
    describe_gauge!(
        RUNS_QUARANTINED,
        "Runs whose changelog record does not read back; their inputs are dead-lettered (quarantined)."
    );
    for name in [
        BATCHES,
        TRANSACTIONS_FAILED,
        RECORDS_RESTORED,
        FORWARDED,
        PARTITIONS_STOPPED,
        CACHE_UNREADABLE,
    ] {
        counter!(name).increment(0);
    }
    for name in [
        INTERRUPTS_OPEN,
        INTERRUPT_OLDEST_AGE,
        AWAITING_OPERATOR,
        OWNED_PARTITIONS,
        RUNS_QUARANTINED,
    ] {
        gauge!(name).set(0.0);
    }
}

type Labels = Vec<(&'static str, String)>;

/// What one batch decided, counted when (and only if) its transaction commits.
#[derive(Debug, Default)]
pub(crate) struct BatchCounts {
    counters: BTreeMap<(&'static str, Labels), u64>,
    /// Runs that ended in this batch: final status, cost (USD) and tokens.
    ended: Vec<(&'static str, f64, u64)>,
}

impl BatchCounts {
    fn add(&mut self, name: &'static str, labels: Labels) {
        *self.counters.entry((name, labels)).or_default() += 1;
    }

    pub fn dead_letter(&mut self, reason: &str) {
        self.add(DEAD_LETTERS, vec![("reason", reason.to_owned())]);
    }

    pub fn forwarded(&mut self) {
        self.add(FORWARDED, vec![]);
    }

    /// An input record skipped before the fold (`reason`: a tombstone).
    pub fn ignored(&mut self, reason: &str) {
        self.add(INPUTS_IGNORED, vec![("reason", reason.to_owned())]);
    }

    /// One applied input: its kind, whether it was ignored, and the events it emitted
    /// (`state` is the run after it, for the tool of a step).
    pub fn applied(
        &mut self,
        input: &Input,
        ignored: Option<&'static str>,
        events: &[&Event],
        state: Option<&RunState>,
    ) {
        let kind = match input {
            Input::Command(_) => "command",
            Input::StepReport(_) => "step_result",
            Input::TimerFired { .. } => "timer",
        };
        self.add(INPUTS_APPLIED, vec![("kind", kind.to_owned())]);
        if let Some(reason) = ignored {
            self.add(INPUTS_IGNORED, vec![("reason", reason.to_owned())]);
        }
        let tool = |step_id: &str| {
            state
                .and_then(|s| s.steps.get(step_id))
                .map_or_else(|| "unknown".to_owned(), |s| s.tool.clone())
        };
        for event in events {
            match &event.body {
                EventBody::RunStarted { .. } => self.add(
                    RUN_TRANSITIONS,
                    vec![("status", RunStatus::Running.as_str().to_owned())],
                ),
                EventBody::RunStatusChanged { status, .. } => {
                    self.add(
                        RUN_TRANSITIONS,
                        vec![("status", status.as_str().to_owned())],
                    );
                    if status.is_terminal() {
                        self.run_ended(status.as_str(), state);
                    }
                }
                EventBody::StepDispatched { tool, attempt, .. } => {
                    self.add(STEPS_DISPATCHED, vec![("tool", tool.clone())]);
                    if *attempt > 1 {
                        self.add(STEPS_RETRIED, vec![("tool", tool.clone())]);
                    }
                }
                EventBody::StepSucceeded { step_id, .. } => {
                    self.add(STEPS_SUCCEEDED, vec![("tool", tool(step_id))])
                }
                EventBody::StepFailed {
                    step_id, retryable, ..
                } => self.add(
                    STEPS_FAILED,
                    vec![
                        ("tool", tool(step_id)),
                        ("retryable", retryable.to_string()),
                    ],
                ),
                EventBody::StepOutcomeUnknown {
                    step_id,
                    needs_operator,
                    ..
                } => self.add(
                    STEPS_UNKNOWN,
                    vec![
                        ("tool", tool(step_id)),
                        ("needs_operator", needs_operator.to_string()),
                    ],
                ),
                EventBody::Interrupted { .. } => self.add(INTERRUPTS_OPENED, vec![]),
                EventBody::InterruptDecided {
                    approve, is_final, ..
                } if *is_final => {
                    let outcome = if *approve { "approved" } else { "rejected" };
                    self.add(INTERRUPTS_CLOSED, vec![("outcome", outcome.to_owned())])
                }
                EventBody::InterruptExpired { .. } => {
                    self.add(INTERRUPTS_CLOSED, vec![("outcome", "expired".to_owned())])
                }
                _ => {}
            }
        }
    }

    /// The batch committed: publish its counts and its size and latency.
    pub fn committed(self, inputs: usize, commit: Duration) {
        counter!(BATCHES).increment(1);
        metrics::histogram!(BATCH_SIZE).record(inputs as f64);
        metrics::histogram!(COMMIT_SECONDS).record(commit.as_secs_f64());
        for ((name, labels), n) in self.counters {
            counter!(name, labels.as_slice()).increment(n);
        }
        record_run_spend(&self.ended);
    }

    /// A run ended: what it spent is recorded when the batch commits.
    fn run_ended(&mut self, status: &'static str, state: Option<&RunState>) {
        let spend = state.map(|s| s.spend.clone()).unwrap_or_default();
        self.ended.push((status, spend.cost_usd, spend.tokens()));
    }
}

/// A restore of one partition finished.
pub(crate) fn restored(records: usize, warm: bool, took: Duration) {
    counter!(RECORDS_RESTORED).increment(records as u64);
    metrics::histogram!(RESTORE_SECONDS, "warm" => warm.to_string()).record(took.as_secs_f64());
}

/// A partition was stopped (records of its own kept being refused).
pub(crate) fn partition_stopped() {
    counter!(PARTITIONS_STOPPED).increment(1);
}

/// Kafka refused a record: of its size or content (`record`), or of where it goes.
pub(crate) fn record_refused(record: bool) {
    let kind = if record { "record" } else { "destination" };
    counter!(RECORDS_REFUSED, "kind" => kind).increment(1);
}

/// A cached run state did not read back.
pub(crate) fn cache_entry_unreadable() {
    counter!(CACHE_UNREADABLE).increment(1);
}

/// How many runs are quarantined now.
pub(crate) fn runs_quarantined(runs: usize) {
    gauge!(RUNS_QUARANTINED).set(runs as f64);
}

/// A command refused before the fold, by `code` (`unauthenticated`, `limit_exceeded`).
pub(crate) fn command_refused(code: &'static str) {
    counter!(COMMANDS_REFUSED, "code" => code).increment(1);
}

pub(crate) fn graphs_untrusted(count: usize) {
    gauge!(GRAPHS_UNTRUSTED).set(count as f64);
}

pub(crate) fn transaction_failed() {
    counter!(TRANSACTIONS_FAILED).increment(1);
}

fn describe_run_spend() {
    describe_histogram!(
        RUN_COST_USD,
        Unit::Count,
        "What each ended run spent on models, in USD (its usage priced with its budget's price table), by final status."
    );
    describe_histogram!(
        RUN_TOKENS,
        Unit::Count,
        "Model tokens (prompt plus completion) each ended run used, by final status."
    );
}

fn record_run_spend(ended: &[(&'static str, f64, u64)]) {
    for (status, cost, tokens) in ended {
        metrics::histogram!(RUN_COST_USD, "status" => *status).record(*cost);
        metrics::histogram!(RUN_TOKENS, "status" => *status).record(*tokens as f64);
    }
}
