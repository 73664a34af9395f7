//! The commit pipeline on the [`Engine`]: the batch in flight served, committed and
//! written to the cache, and what an aborted or failed batch takes along (the rewind, the
//! back-off, readiness).

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::Offset;

use super::Error;
use crate::batch::{PendingBatch, Source};
use crate::engine::Engine;
use crate::fault::FaultPoint;
use crate::metrics::{self as meter};
use crate::txn::Failure;

/// Runs `step` (a commit, or progress of the transaction in flight). If it aborted, what
/// it dropped — the batch in flight and the open batch folded on it, or the open batch
/// alone — is read again: the consumer seeks back to the first offset each dropped batch
/// read ([`Engine::dropped`]), never to a batch that committed. A refused record sets its
/// source aside ([`Engine::refused`]); aborts in a row back off. The same clients go on;
/// a fatal failure returns.
pub(super) fn rewinding<C: ConsumerContext>(
    engine: &mut Engine,
    consumer: &BaseConsumer<C>,
    step: impl FnOnce(&mut Engine) -> Result<(), Failure>,
) -> Result<(), Error> {
    match step(engine) {
        Ok(()) => Ok(()),
        Err(Failure::Fatal(e)) => Err(e),
        Err(Failure::Aborted(e, refusal)) => {
            tracing::warn!(error = %e, "The batch was aborted; reading its inputs again.");
            if let Some(refusal) = refusal {
                engine.refused(*refusal, consumer);
            }
            seek_back(engine, consumer)?;
            engine.back_off(&e.to_string());
            Ok(())
        }
    }
}

/// Seeks the consumer back to where the dropped batches began (see [`Engine::dropped`]).
fn seek_back<C: ConsumerContext>(
    engine: &mut Engine,
    consumer: &BaseConsumer<C>,
) -> Result<(), Error> {
    for ((topic, partition), first) in std::mem::take(&mut engine.rewind) {
        if !engine.tasks.is_active(partition) {
            // Stopped or gone: nothing of it is read until it is assigned again.
            continue;
        }
        if let Err(e) = consumer.seek(
            &topic,
            partition,
            Offset::Offset(first),
            Duration::from_secs(5),
        ) {
            // Without the seek the batch's inputs would be skipped: rebuild instead.
            tracing::warn!(topic, partition, error = %e, "Seeking back after a dropped batch failed.");
            return Err(Error::Kafka(e));
        }
    }
    Ok(())
}

/// Most aborted transactions in a row before the reducer says it is not ready.
const ABORTS_BEFORE_UNREADY: u32 = 3;

/// The commit pipeline: at most one batch in flight (its transaction open, its records
/// sent) while the next one folds. See ARCHITECTURE "The transaction boundary".
impl Engine {
    /// Serves the deliveries of the transaction in flight for up to `wait`, and once
    /// they are all in, commits it and writes the cache.
    pub(crate) fn progress(&mut self, wait: Duration) -> Result<(), Failure> {
        let Some(mut sending) = self.sending.take() else {
            return Ok(());
        };
        match self.serve_deliveries(&mut sending, wait) {
            Ok(delivered) => {
                if delivered
                    && self.fault_armed(FaultPoint::AbortInFlight)
                    && !self.batch.on_in_flight
                    && sending.sent.elapsed() < Duration::from_millis(500)
                {
                    // Test only: a batch is held in flight (up to half a second) until the
                    // next one has read a run from it; `settle` then aborts it.
                    self.sending = Some(sending);
                    return Ok(());
                }
                self.sending = Some(sending);
                match delivered {
                    true => self.settle(),
                    false => Ok(()),
                }
            }
            Err(failure) => Err(self.failed(failure, Some(&sending.batch))),
        }
    }

    /// Finishes the transaction in flight, if any: the rest of its deliveries, the
    /// commit, then the cache write — sled is written only after Kafka has the
    /// transaction, and before the next one begins.
    pub(crate) fn settle(&mut self) -> Result<(), Failure> {
        let Some(sending) = self.sending.take() else {
            return Ok(());
        };
        if self.batch.on_in_flight && self.fault_once(FaultPoint::AbortInFlight) {
            let refused = KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut);
            let failure = self.abort_after(refused);
            return Err(self.failed(failure, Some(&sending.batch)));
        }
        let first = crate::batch::first_offsets([&sending.batch]);
        match self.finish_sending(sending) {
            Ok((batch, committed)) => {
                // The other producer begins the next transaction: this one's commit
                // markers may still be being written (see `Engine::turn`).
                std::mem::swap(&mut self.producer, &mut self.turn);
                self.committed(&batch);
                self.write_cache(batch, committed).map_err(Failure::Fatal)
            }
            Err(failure) => {
                self.rewind_to(first);
                Err(self.failed(failure, None))
            }
        }
    }

    /// A batch committed: its offsets are the partitions' committed positions now, and
    /// the transactions no longer fail in a row.
    fn committed(&mut self, batch: &PendingBatch) {
        for (at, consumed) in &batch.offsets {
            self.positions.insert(at.clone(), consumed.next);
        }
        let committed = &self.positions;
        // Refusals of inputs now behind the committed offsets are settled.
        self.refused.retain(|source, _| match source {
            Source::Input(at) => committed
                .get(&(at.topic.clone(), at.partition))
                .is_none_or(|next| at.offset >= *next),
            Source::Run(_) => true,
        });
        if self.aborts.0 > 0 {
            tracing::info!(
                after = self.aborts.0,
                "A transaction committed after aborted ones."
            );
            self.aborts = (0, String::new());
        }
    }

    /// Commits everything: the transaction in flight, then the open batch, waiting for
    /// both (revocation, shutdown).
    pub(crate) fn commit_open<C: ConsumerContext>(
        &mut self,
        consumer: &BaseConsumer<C>,
    ) -> Result<(), Failure> {
        self.settle()?;
        if !self.batch.is_empty() {
            self.start_sending(consumer)?;
            self.settle()?;
        }
        Ok(())
    }

    /// The transaction in flight (`in_flight`) did not commit: the open batch, folded on
    /// its states, goes with it, and both are read again.
    fn failed(&mut self, failure: Failure, in_flight: Option<&PendingBatch>) -> Failure {
        meter::transaction_failed();
        if let Some(in_flight) = in_flight {
            self.dropped(in_flight);
        }
        let dropped = std::mem::take(&mut self.batch);
        if !dropped.is_empty() {
            tracing::warn!(
                inputs = dropped.inputs,
                "The open batch was folded on an aborted one; it is read again too."
            );
            self.dropped(&dropped);
        }
        failure
    }

    /// Drops the open batch because an input or timer of it failed halfway (`error`),
    /// and says what the loop does next: the same clients go on, reading the dropped
    /// inputs again after a back-off (the registry, the key store or a graph may be
    /// back), while the batch in flight, which was whole, still commits. An unreadable
    /// cache entry also has its partition rebuilt from the changelog. Only a failure of
    /// the store itself returns.
    pub(crate) fn recover<C: ConsumerContext>(
        &mut self,
        error: Error,
        consumer: &BaseConsumer<C>,
    ) -> Result<(), Error> {
        let batch = std::mem::take(&mut self.batch);
        tracing::warn!(
            error = %error,
            inputs = batch.inputs,
            timers = batch.fired.len(),
            "An input could not be applied whole; the open batch is dropped, never committed, and read again."
        );
        meter::transaction_failed();
        self.dropped(&batch);
        match error {
            Error::UnreadableCache { run_id, reason } => {
                // One unreadable entry is not the whole cache: the entry goes, and its
                // run's partition is restored from the changelog at the next assignment
                // (the clients are rebuilt for it) while the others start from the cache.
                let partition = self.partition_of(&run_id);
                tracing::error!(run_id, partition, reason, "A cached run state cannot be read; its partition is restored from the changelog.");
                meter::cache_entry_unreadable();
                self.store.write_run(&run_id, None)?;
                self.store.forget_partition(partition)?;
                Err(Error::Rebuild(format!(
                    "partition {partition} is restored again: the cached state of run {run_id} cannot be read ({reason})"
                )))
            }
            Error::Store(e) => Err(Error::Store(e)),
            other => {
                self.back_off(&other.to_string());
                seek_back(self, consumer)
            }
        }
    }

    /// Counts an aborted transaction or dropped batch and sleeps a little, longer for
    /// each one in a row, so a failure that repeats is not a spin; past
    /// [`ABORTS_BEFORE_UNREADY`] in a row, readiness says why.
    pub(crate) fn back_off(&mut self, reason: &str) {
        self.aborts.0 += 1;
        self.aborts.1 = reason.to_owned();
        let n = self.aborts.0;
        let pause = Duration::from_millis(50 * 2u64.pow(n.min(7) - 1)).min(Duration::from_secs(5));
        if n >= ABORTS_BEFORE_UNREADY {
            tracing::error!(in_a_row = n, reason, ?pause, "Transactions keep failing; the reducer backs off and is not ready until one commits.");
        }
        self.health.set(self.readiness());
        std::thread::sleep(pause);
    }

    /// Ready: every owned partition active, and transactions committing.
    pub(crate) fn readiness(&self) -> Result<(), String> {
        let tasks = self.tasks.readiness();
        if self.aborts.0 >= ABORTS_BEFORE_UNREADY {
            let failing = format!(
                "{} transactions in a row did not commit, the last: {}",
                self.aborts.0, self.aborts.1
            );
            return Err(match tasks {
                Ok(()) => failing,
                Err(stopped) => format!("{stopped}; {failing}"),
            });
        }
        tasks
    }
}
