//! Result production: step results keyed by operation id on the run's partition of
//! `step-results`, and dead letters for intents that do not decode.

use super::*;

/// An output that could not be written after the call: retryable where a repeat is
/// harmless, unknown where the call happened and must not be repeated blindly.
fn lost_output(intent: &StepIntent, code: &str, message: String) -> HandlerError {
    match intent.side_effect {
        SideEffectClass::Pure | SideEffectClass::Idempotent | SideEffectClass::Keyed => {
            HandlerError::retryable(code, message)
        }
        SideEffectClass::Reconcilable | SideEffectClass::Unsafe => {
            HandlerError::unknown(code, message)
        }
    }
}

/// The output, if it has the shape every payload has (`sortie_core::limits`): checked
/// here, before it is produced, so the reducer never has to dead-letter a result this
/// executor wrote. One that does not fails the step, `limit_exceeded`, as the fold fails
/// a step whose output is over the record limit: for good where the call could be made
/// again, and as an unknown outcome where the call happened and must not be repeated
/// blindly (its effect took place; only its answer cannot be kept).
fn shaped(intent: &StepIntent, output: Value) -> Result<Value, HandlerError> {
    match sortie_core::limits::check_shape("output", &output) {
        Ok(()) => Ok(output),
        Err(e) => {
            let message = format!(
                "the step's output cannot be kept: {e} (limit {})",
                e.limit.name()
            );
            Err(match intent.side_effect {
                SideEffectClass::Reconcilable | SideEffectClass::Unsafe => {
                    HandlerError::unknown("limit_exceeded", message)
                }
                _ => HandlerError::permanent("limit_exceeded", message),
            })
        }
    }
}

impl Worker {
    pub(super) fn result(
        &self,
        intent: &StepIntent,
        status: w::StepStatus,
        started_at: i64,
    ) -> w::StepResult {
        w::StepResult {
            spend: None,
            operation_id: intent.operation_id.clone(),
            attempt: intent.attempt,
            tenant: intent.tenant.clone(),
            run_id: intent.run_id.clone(),
            step_id: intent.step_id.clone(),
            status,
            retryable: false,
            output: None,
            error: None,
            executor: self.config.executor_id.clone(),
            started_at,
            finished_at: None,
        }
    }

    pub(super) async fn report(
        &self,
        intent: &StepIntent,
        outcome: Result<Value, HandlerError>,
        started_at: i64,
    ) {
        // The step's progress goes out before its result (ADR 0031).
        if let Some(deltas) = &self.deltas {
            deltas.flush().await;
        }
        // Checked in the form it is produced in: large parts already stored by reference,
        // not yet sealed.
        let outcome = match outcome {
            Ok(output) => match self
                .store_large(intent, output)
                .await
                .and_then(|o| shaped(intent, o))
            {
                Ok(output) => self.seal_output(intent, output).await,
                failed => failed,
            },
            failed => failed,
        };
        let mut result = match &outcome {
            Ok(_) => self.result(intent, w::StepStatus::Succeeded, started_at),
            Err(HandlerError::Unknown { .. }) => {
                self.result(intent, w::StepStatus::Unknown, started_at)
            }
            Err(_) => self.result(intent, w::StepStatus::Failed, started_at),
        };
        result.finished_at = Some(now_ms());
        match outcome {
            Ok(output) => result.output = Some(output.to_string()),
            Err(error) => {
                result.retryable = error.is_retryable();
                result.error = Some(w::StepError {
                    code: error.code().to_owned(),
                    // A receiver's answer can be long; the run keeps what a person reads.
                    message: sortie_core::limits::clip(
                        error.message(),
                        sortie_core::limits::MAX_TEXT_BYTES,
                    )
                    .to_owned(),
                    retry_after_ms: error.retry_after().map(|d| d.as_millis() as i64),
                });
            }
        }
        self.send_result(&result).await;
        let status = match result.status {
            w::StepStatus::Succeeded => "succeeded",
            w::StepStatus::Unknown => "unknown",
            w::StepStatus::Started => "started",
            _ => "failed",
        };
        meter::result(&intent.tool, status);
        match &result.error {
            None => tracing::info!(status = ?result.status, "Reported the attempt's outcome."),
            Some(error) => tracing::info!(
                status = ?result.status,
                retryable = result.retryable,
                code = %error.code,
                message = %error.message,
                "Reported the attempt's outcome."
            ),
        }
    }

    /// The output to report: parts over the blob threshold stored first and referenced
    /// (`sortie_blob::offload`), so the result is never produced before its blobs exist.
    /// A failed write loses nothing and claims nothing: for `pure`, `idempotent` and
    /// `keyed` steps (a repeat is harmless) the attempt fails retryably; for
    /// `reconcilable` and `unsafe` ones the call did happen, so its outcome is reported
    /// unknown (the next attempt asks the receiver, or an operator records it).
    async fn store_large(&self, intent: &StepIntent, output: Value) -> Result<Value, HandlerError> {
        let (Some(store), Some(config)) = (&self.blobs, &self.config.blobs) else {
            return Ok(output);
        };
        match sortie_blob::offload::offload(
            store.as_ref(),
            &intent.tenant,
            &intent.run_id,
            output,
            config.threshold,
        )
        .await
        {
            Ok(output) => Ok(output),
            Err(error) => {
                meter::blob_write_failed();
                tracing::warn!(%error, "The output could not be stored in the blob store.");
                let message = format!("the step's output could not be stored: {error}");
                Err(lost_output(intent, "blob_unavailable", message))
            }
        }
    }

    /// The output as the run's data key seals it (as it is without sealing). An output
    /// is never reported in plaintext for a sealed run: if the key cannot be read the
    /// attempt fails like a blob write that failed (retryable where a repeat is harmless,
    /// unknown where the call happened).
    async fn seal_output(&self, intent: &StepIntent, output: Value) -> Result<Value, HandlerError> {
        use sortie_seal::Seal as _;
        if self.run_keys.is_none() {
            return Ok(output);
        }
        match self.run_seal(&intent.tenant, &intent.run_id).await {
            Ok(seal) => Ok(seal.seal(&output)),
            Err(error) => {
                tracing::warn!(%error, "The output could not be sealed.");
                let message = format!("the step's output could not be sealed: {error}");
                Err(lost_output(intent, "key_store_unavailable", message))
            }
        }
    }

    /// Produces a result to the run's canonical partition and waits for its delivery,
    /// retrying until it is delivered (at shutdown the task is aborted instead; its
    /// offset then stays uncommitted).
    pub(super) async fn send_result(&self, result: &w::StepResult) {
        let topic = self.config.topics.step_results();
        let partition = partition_for(result.run_id.as_bytes(), self.result_partitions);
        let trace = TRACE
            .try_with(Clone::clone)
            .unwrap_or_else(|_| TraceContext::for_run(&result.run_id))
            .child(&format!(
                "{}/{}/{:?}",
                result.operation_id, result.attempt, result.status
            ));
        let trace_value = trace.header_value();
        let mut backoff = Duration::from_millis(100);
        loop {
            let error = match self.codec.encode(&topic, result).await {
                Ok(bytes) => {
                    let headers =
                        rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
                            key: sortie_wire::trace::TRACEPARENT,
                            value: Some(trace_value.as_bytes()),
                        });
                    let record = FutureRecord::to(&topic)
                        .key(&result.operation_id)
                        .payload(&bytes)
                        .partition(partition)
                        .headers(headers);
                    match self.producer.send(record, Duration::from_secs(30)).await {
                        Ok(_) => return,
                        Err((error, _)) => error.to_string(),
                    }
                }
                Err(error) => error.to_string(),
            };
            tracing::warn!(%error, ?backoff, "Producing a result failed; retrying.");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    pub(super) async fn dead_letter(&self, message: &OwnedMessage, error: &DecodeError) {
        tracing::warn!(
            topic = message.topic(),
            partition = message.partition(),
            offset = message.offset(),
            code = error.reason_code(),
            %error,
            "Dead-lettering an undecodable intent."
        );
        let letter = sortie_wire::dead_letter::letter(
            message,
            format!("executor/{}", self.config.executor_id),
            error.reason_code(),
            error.to_string(),
            now_ms(),
        );
        let topic = self.config.topics.dead_letters();
        let key = message.key().unwrap_or_default();
        let mut backoff = Duration::from_millis(100);
        loop {
            let error = match self.codec.encode(&topic, &letter).await {
                Ok(bytes) => {
                    let record = FutureRecord::to(&topic).key(key).payload(&bytes);
                    match self.producer.send(record, Duration::from_secs(30)).await {
                        Ok(_) => {
                            meter::dead_letter(error.reason_code());
                            return;
                        }
                        Err((error, _)) => error.to_string(),
                    }
                }
                Err(error) => error.to_string(),
            };
            tracing::warn!(%error, ?backoff, "Producing a dead letter failed; retrying.");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }
}
