//! Dispatch: one task per intent — decode, the pre-call commit for guarded classes, the
//! handler call with its timeout, and the per-operation lock for reconcilable steps.

use super::*;

/// What every task of the process shares.
pub(super) struct Worker {
    pub(super) config: ExecutorConfig,
    pub(super) handlers: Handlers,
    pub(super) codec: Codec,
    pub(super) producer: FutureProducer,
    pub(super) result_partitions: u32,
    pub(super) health: Health,
    /// A lock per reconcilable operation with an attempt here ([`Worker::exclusive`]).
    pub(super) operations: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Worker {
    pub(super) async fn process(self: Arc<Self>, ticket: Ticket, message: OwnedMessage) {
        let started_at = now_ms();
        let intent = match self
            .codec
            .decode_patiently::<StepIntent>(message.payload(), None)
            .await
        {
            Ok(intent) => intent,
            Err(error) => {
                self.dead_letter(&message, &error).await;
                ticket.done();
                return;
            }
        };
        let trace = message
            .headers()
            .and_then(|h| TraceContext::from_headers(h.iter().map(|h| (h.key, h.value))))
            .unwrap_or_else(|| TraceContext::for_run(&intent.run_id));
        let span = tracing::info_span!(
            "intent",
            run_id = %intent.run_id,
            operation_id = %intent.operation_id,
            attempt = intent.attempt,
            step_id = %intent.step_id,
            tool = %intent.tool,
            trace_id = %trace.trace_id,
        );
        TRACE
            .scope(
                trace,
                self.perform(&ticket, &intent, started_at).instrument(span),
            )
            .await;
    }

    pub(super) async fn perform(&self, ticket: &Ticket, intent: &StepIntent, started_at: i64) {
        let fault = |point| fault::check(self.config.fault, point, &intent.operation_id);
        let call = match Call::from_intent(intent, self.config.default_timeout) {
            Ok(call) => call,
            Err(error) => {
                self.report(intent, Err(error), started_at).await;
                ticket.done();
                return;
            }
        };
        if !self.handlers.contains(&call.tool) {
            let error = HandlerError::permanent(
                "unknown_tool",
                format!("no handler for tool {:?} in this executor", call.tool),
            );
            self.report(intent, Err(error), started_at).await;
            ticket.done();
            return;
        }
        tracing::debug!(class = ?intent.side_effect, "Intent received.");
        match intent.side_effect {
            SideEffectClass::Pure | SideEffectClass::Idempotent | SideEffectClass::Keyed => {
                fault(FaultPoint::BeforeCall);
                let outcome = self.timed_call(&call).await;
                fault(FaultPoint::AfterCall);
                self.report(intent, outcome, started_at).await;
                fault(FaultPoint::AfterResult);
                ticket.done();
                return;
            }
            SideEffectClass::Reconcilable | SideEffectClass::Unsafe => {}
        }
        // Guarded classes: record STARTED, commit the intent, then call.
        self.send_result(&self.result(intent, w::StepStatus::Started, started_at))
            .await;
        meter::result(&intent.tool, "started");
        if !ticket.commit_first().await {
            meter::handed_back();
            tracing::info!(
                "Handing the intent back: its offset could not be committed before the call."
            );
            return;
        }
        // Reconcilable: ask the receiver first, one attempt of the operation at a time.
        // Committing an intent only waits for earlier intents to *reach* their call, so
        // an attempt that timed out before anyone picked it up and its successor can both
        // get here together; without the lock both lookups say "never seen" and both call.
        let _one_attempt_at_a_time = match intent.side_effect {
            SideEffectClass::Reconcilable => {
                let guard = self.exclusive(&intent.operation_id).await;
                if let Some(known) = self.ask_first(&call).await {
                    self.report(intent, known, started_at).await;
                    return;
                }
                Some(guard)
            }
            _ => None,
        };
        fault(FaultPoint::BeforeCall);
        let outcome = self.timed_call(&call).await;
        fault(FaultPoint::AfterCall);
        self.report(intent, outcome, started_at).await;
        fault(FaultPoint::AfterResult);
    }

    /// Holds the operation's lock: attempts of one reconcilable operation ask and call one
    /// after the other, so a later attempt's lookup sees what an earlier one did.
    pub(super) async fn exclusive(&self, operation_id: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = {
            let mut operations = self.operations.lock().unwrap_or_else(|e| e.into_inner());
            if operations.len() > 4096 {
                // Forget locks nobody holds or waits for.
                operations.retain(|_, lock| Arc::strong_count(lock) > 1);
            }
            operations
                .entry(operation_id.to_owned())
                .or_default()
                .clone()
        };
        lock.lock_owned().await
    }

    /// One handler call, timed for [`meter::STEP_SECONDS`].
    pub(super) async fn timed_call(&self, call: &Call) -> Result<Value, HandlerError> {
        let started = Instant::now();
        let outcome = self.handlers.call(call).await;
        let kind = match &outcome {
            Ok(_) => "succeeded",
            Err(HandlerError::Unknown { .. }) => "unknown",
            Err(e) if e.is_retryable() => "retryable",
            Err(_) => "permanent",
        };
        meter::call(&call.tool, kind, started.elapsed());
        outcome
    }

    /// `reconcilable`: asks the receiver before calling. `Some(outcome)` settles the
    /// attempt without a call; `None` means calling is safe.
    ///
    /// - succeeded → that output, no call;
    /// - never seen, or recorded as failed (so it had no effect) → call;
    /// - the handler cannot ask: call on attempt 1 (no earlier attempt can have reached
    ///   the receiver: its offset is committed only before a call), otherwise unknown;
    /// - the receiver could not be asked → unknown: the reducer pauses the run for an
    ///   operator rather than risk a second effect.
    pub(super) async fn ask_first(&self, call: &Call) -> Option<Result<Value, HandlerError>> {
        match self.handlers.lookup(call).await {
            Ok(Lookup::Succeeded(output)) => {
                tracing::info!("The receiver already has the operation; recording its outcome without calling.");
                Some(Ok(output))
            }
            Ok(Lookup::NotFound) => None,
            Ok(Lookup::Failed { code, message }) => {
                tracing::info!(%code, %message, "The receiver recorded the operation as failed; calling again.");
                None
            }
            Ok(Lookup::Unsupported) if call.attempt <= 1 => None,
            Ok(Lookup::Unsupported) => Some(Err(HandlerError::unknown(
                "not_reconcilable",
                "a later attempt of a reconcilable step, but its handler cannot ask the receiver (no status_url)",
            ))),
            Err(error @ HandlerError::Permanent { .. }) => Some(Err(error)),
            Err(error) => Some(Err(HandlerError::unknown(
                "lookup_failed",
                format!("the receiver could not be asked: {error}"),
            ))),
        }
    }
}
