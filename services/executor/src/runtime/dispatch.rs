//! Dispatch: one task per intent — decode, the pre-call commit for guarded classes, the
//! handler call with its timeout, and the per-operation lock for reconcilable steps.

use super::converse;
use super::*;

/// What every task of the process shares.
pub(super) struct Worker {
    pub(super) config: ExecutorConfig,
    pub(super) handlers: Handlers,
    pub(super) codec: Codec,
    pub(super) producer: FutureProducer,
    /// Where handlers' progress goes; `None` without the step-deltas topic.
    pub(super) deltas: Option<Deltas>,
    pub(super) result_partitions: u32,
    pub(super) health: Health,
    /// A lock per reconcilable operation with an attempt here ([`OperationLocks`]).
    pub(super) operations: OperationLocks,
    /// The blob store of `config.blobs`, opened.
    pub(super) blobs: Option<Arc<dyn sortie_blob::BlobStore>>,
    /// The run data keys of `config.seal`, opened.
    pub(super) run_keys: Option<sortie_seal::RunKeys>,
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
        if let Some(deadline) = attempt_deadline(intent).filter(|d| started_at >= *d) {
            // The reducer's timer for this attempt has fired (or is about to): it has
            // retried it or left it to an operator. A call now would be one it no longer
            // expects; for an `unsafe` step, one an operator may have just ruled out.
            meter::expired();
            tracing::info!(
                late_ms = started_at - deadline,
                "The attempt's deadline passed before it got a slot; not calling."
            );
            let error = HandlerError::retryable(
                "deadline_passed",
                "the attempt's deadline passed before an executor could start it",
            );
            self.report(intent, Err(error), started_at).await;
            ticket.done();
            return;
        }
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
        // Before anything is recorded or called: a handler sees plain JSON, and sealed
        // arguments that do not open (or whose run's key was destroyed), or a blob that
        // is lost or not the referenced one, fail the step without a call.
        let call = match self.open_args(call).await {
            Ok(call) => call,
            Err(error) => {
                self.report(intent, Err(error), started_at).await;
                ticket.done();
                return;
            }
        };
        let call = match self.resolve_args(call).await {
            Ok(call) => call,
            Err(error) => {
                self.report(intent, Err(error), started_at).await;
                ticket.done();
                return;
            }
        };
        // A conversation's call: the whole conversation stored as its transcript, the
        // handler given what the model may see.
        let (call, transcript) = match self.converse(call).await {
            Ok(prepared) => prepared,
            Err(error) => {
                self.report(intent, Err(error), started_at).await;
                ticket.done();
                return;
            }
        };
        let call = self.with_progress(call).await;
        tracing::debug!(class = ?intent.side_effect, "Intent received.");
        if intent.lookup_only {
            // The run is winding down: ask what became of the operation, never call. No
            // STARTED and no pre-call commit: nothing is called, so a redelivery only asks
            // again. Under the operation's lock, so an earlier attempt of it in this
            // process finishes (or is fenced, below) before the answer is taken.
            let outcome = match self.exclusive(&intent.operation_id, intent.attempt).await {
                Some(_guard) => only_ask(&call, self.handlers.lookup(&call).await),
                None => Err(superseded(intent.attempt)),
            };
            self.report(intent, outcome, started_at).await;
            ticket.done();
            return;
        }
        match intent.side_effect {
            SideEffectClass::Pure | SideEffectClass::Idempotent | SideEffectClass::Keyed => {
                fault(FaultPoint::BeforeCall);
                let outcome = self
                    .timed_call(&call)
                    .await
                    .map(|o| converse::with_transcript(o, transcript));
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
                let Some(guard) = self.exclusive(&intent.operation_id, intent.attempt).await else {
                    // A later attempt of the operation already asked (and maybe called):
                    // this one must not call after it. Its report is stale for the fold.
                    tracing::info!("A later attempt of the operation went first; not calling.");
                    self.report(intent, Err(superseded(intent.attempt)), started_at)
                        .await;
                    return;
                };
                if let Some(known) = self.ask_first(&call).await {
                    self.report(intent, known, started_at).await;
                    return;
                }
                Some(guard)
            }
            _ => None,
        };
        fault(FaultPoint::BeforeCall);
        let outcome = self
            .timed_call(&call)
            .await
            .map(|o| converse::with_transcript(o, transcript));
        fault(FaultPoint::AfterCall);
        self.report(intent, outcome, started_at).await;
        fault(FaultPoint::AfterResult);
    }

    /// See [`OperationLocks::exclusive`].
    pub(super) async fn exclusive(
        &self,
        operation_id: &str,
        attempt: i32,
    ) -> Option<tokio::sync::OwnedMutexGuard<i32>> {
        self.operations.exclusive(operation_id, attempt).await
    }

    /// The run's seal: how its payloads are opened and written (plaintext without
    /// sealing). An unreachable key store is a retryable failure; a key that cannot be
    /// had (no KEK for the tenant, one that does not unwrap) a permanent one.
    pub(super) async fn run_seal(
        &self,
        tenant: &str,
        run_id: &str,
    ) -> Result<sortie_seal::RunSeal, HandlerError> {
        let Some(keys) = &self.run_keys else {
            return Ok(sortie_seal::RunSeal::Plain);
        };
        match keys.seal(tenant, run_id).await {
            Ok(seal) => Ok(seal),
            Err(sortie_seal::Error::Store(e)) => Err(HandlerError::retryable(
                "key_store_unavailable",
                format!("the run's data key could not be read: {e}"),
            )),
            Err(e) => Err(HandlerError::permanent("unsealable", e.to_string())),
        }
    }

    /// The call with a progress sink of its own execution (a fresh execution id), whose
    /// deltas are sealed with the run's key; without deltas, or without the key, progress
    /// goes nowhere and the call runs all the same.
    async fn with_progress(&self, mut call: Call) -> Call {
        let Some(deltas) = &self.deltas else {
            return call;
        };
        match self.run_seal(&call.tenant, &call.run_id).await {
            Ok(seal) if !seal.is_destroyed() => call.progress = deltas.progress(&call, seal),
            _ => {}
        }
        call
    }

    /// The call with its arguments opened (see [`Worker::run_seal`]). A run whose data
    /// key was destroyed is a permanent failure (`run_forgotten`): the handler must never
    /// act on arguments it can no longer see.
    pub(super) async fn open_args(&self, mut call: Call) -> Result<Call, HandlerError> {
        if self.run_keys.is_none() {
            return Ok(call);
        }
        // Asked whether sealed or not: an intent written after the key was destroyed
        // carries `null` arguments, which must not reach a receiver either.
        let seal = self.run_seal(&call.tenant, &call.run_id).await?;
        if seal.is_destroyed() {
            return Err(HandlerError::permanent(
                "run_forgotten",
                "the run's data key was destroyed; its arguments are gone",
            ));
        }
        seal.open(&mut call.args)
            .map_err(|e| HandlerError::permanent("unsealable", e.to_string()))?;
        Ok(call)
    }

    /// The call with every blob reference in its arguments replaced by the referenced
    /// value (fetched, size and SHA-256 checked, `path` applied; see
    /// `sortie_blob::resolve`). A tampered, lost or foreign blob is a permanent failure
    /// (`blob_corrupt`, `blob_missing`, `blob_forbidden`); a store that cannot be reached
    /// (or none configured) a retryable one (`blob_unavailable`).
    pub(super) async fn resolve_args(&self, mut call: Call) -> Result<Call, HandlerError> {
        if !sortie_blob::resolve::has_refs(&call.args) {
            return Ok(call);
        }
        let args = std::mem::take(&mut call.args);
        match sortie_blob::resolve::resolve(self.blobs.as_deref(), &call.tenant, args).await {
            Ok(args) => {
                meter::blobs_read("resolved");
                call.args = args;
                Ok(call)
            }
            Err(error) => {
                meter::blobs_read(error.code());
                if error.is_retryable() {
                    tracing::warn!(code = error.code(), %error, "A blob in the arguments could not be read.");
                    Err(HandlerError::retryable(error.code(), error.to_string()))
                } else {
                    tracing::error!(code = error.code(), %error, "A blob in the arguments was refused; the handler is not called.");
                    Err(HandlerError::permanent(error.code(), error.to_string()))
                }
            }
        }
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
    /// - recorded as failed (so it had no effect) → call;
    /// - not found (404, `unknown`, `not_found`) on attempt 1 → call: no earlier attempt
    ///   exists, and this one's offset is committed only just before its call;
    /// - not found on a later attempt → unknown, unless the node's config says
    ///   `lookup_authoritative: true`. An earlier attempt may have reached the receiver
    ///   and its outcome was lost; a receiver that lost its record, or a lookup that is
    ///   only eventually consistent, answers "not found" for a call that did happen, and
    ///   calling again would be a second effect. So the run waits for an operator, like
    ///   an `unsafe` step whose outcome is unknown. Only a receiver that declares its
    ///   lookup authoritative turns "not found" into "never happened";
    /// - the handler cannot ask: call on attempt 1 (no earlier attempt can have reached
    ///   the receiver: its offset is committed only before a call), otherwise unknown;
    /// - the receiver could not be asked → unknown: the reducer pauses the run for an
    ///   operator rather than risk a second effect.
    pub(super) async fn ask_first(&self, call: &Call) -> Option<Result<Value, HandlerError>> {
        settle(call, self.handlers.lookup(call).await)
    }
}

/// When the reducer gives up on this attempt, if the node set a timeout: the attempt's
/// `issued_at` (the reducer's clock when it dispatched) plus that timeout. (Without one,
/// the reducer's default for guarded classes depends on the run's rules, which an intent
/// does not carry: no deadline is assumed.)
pub(super) fn attempt_deadline(intent: &StepIntent) -> Option<i64> {
    intent
        .timeout_ms
        .filter(|t| *t > 0)
        .map(|t| intent.issued_at.saturating_add(t))
}

/// A lock per reconcilable operation with an attempt in this process.
#[derive(Default)]
pub(super) struct OperationLocks(Mutex<HashMap<String, Arc<tokio::sync::Mutex<i32>>>>);

impl OperationLocks {
    /// Holds the operation's lock: attempts of one reconcilable operation ask and call one
    /// after the other, so a later attempt's lookup sees what an earlier one did. The lock
    /// remembers the highest attempt that held it: `None` for an attempt below it, which
    /// must neither ask nor call — a later attempt was dispatched after this one timed
    /// out, and may have been a lookup-only attempt that reported "never performed"; a
    /// call now would be an effect the run has already settled as not having happened.
    /// Within this process only (ARCHITECTURE, executors): intents of one operation share
    /// a partition, so they reach one process unless a rebalance moves it in between.
    pub(super) async fn exclusive(
        &self,
        operation_id: &str,
        attempt: i32,
    ) -> Option<tokio::sync::OwnedMutexGuard<i32>> {
        let lock = {
            let mut operations = self.0.lock().unwrap_or_else(|e| e.into_inner());
            if operations.len() > 4096 {
                // Forget locks nobody holds or waits for.
                operations.retain(|_, lock| Arc::strong_count(lock) > 1);
            }
            operations
                .entry(operation_id.to_owned())
                .or_default()
                .clone()
        };
        let mut guard = lock.lock_owned().await;
        if *guard > attempt {
            return None;
        }
        *guard = attempt;
        Some(guard)
    }
}

/// [`Worker::ask_first`]'s decision, given the lookup's answer.
fn settle(
    call: &Call,
    lookup: Result<Lookup, HandlerError>,
) -> Option<Result<Value, HandlerError>> {
    match lookup {
        Ok(Lookup::Succeeded(output)) => {
            tracing::info!(
                "The receiver already has the operation; recording its outcome without calling."
            );
            Some(Ok(output))
        }
        Ok(Lookup::NotFound) if call.attempt <= 1 || lookup_authoritative(&call.config) => None,
        Ok(Lookup::NotFound) => {
            tracing::warn!(
                "The receiver has no record of the operation, and its lookup is not authoritative: \
                 the outcome of an earlier attempt stays unknown."
            );
            Some(Err(HandlerError::unknown(
                "lookup_not_found",
                "the receiver has no record of the operation, but an earlier attempt may have \
                 reached it and its lookup is not declared authoritative \
                 (config.lookup_authoritative): not calling again",
            )))
        }
        Ok(Lookup::Failed { code, message }) => {
            tracing::info!(%code, %message, "The receiver recorded the operation as failed; calling again.");
            None
        }
        Ok(Lookup::Unsupported) if call.attempt <= 1 => None,
        Ok(Lookup::Unsupported) => Some(Err(HandlerError::unknown(
            "not_reconcilable",
            "a later attempt of a reconcilable step, but its handler cannot ask the receiver \
             (no status_url)",
        ))),
        Err(error @ HandlerError::Permanent { .. }) => Some(Err(error)),
        Err(error) => Some(Err(HandlerError::unknown(
            "lookup_failed",
            format!("the receiver could not be asked: {error}"),
        ))),
    }
}

/// A lookup-only attempt's outcome, given the lookup's answer (it never calls):
///
/// - succeeded → that output;
/// - recorded as failed → failed (not retryable): it had no effect;
/// - not found, where the node's lookup is authoritative → failed (`not_performed`, not
///   retryable): the operation never reached the receiver, and it is not called now;
/// - anything else (not found without an authoritative lookup, a handler that cannot
///   ask, a lookup that failed in any way) → unknown: an operator decides, since none of
///   these says whether the earlier call took effect.
fn only_ask(call: &Call, lookup: Result<Lookup, HandlerError>) -> Result<Value, HandlerError> {
    match lookup {
        Ok(Lookup::Succeeded(output)) => Ok(output),
        Ok(Lookup::Failed { code, message }) => Err(HandlerError::permanent(code, message)),
        Ok(Lookup::NotFound) if lookup_authoritative(&call.config) => Err(HandlerError::permanent(
            "not_performed",
            "the receiver has no record of the operation (its lookup is authoritative): \
                 it was never performed, and the run is winding down, so it is not called",
        )),
        Ok(Lookup::NotFound) => Err(HandlerError::unknown(
            "lookup_not_found",
            "the receiver has no record of the operation, but its lookup is not declared \
             authoritative (config.lookup_authoritative): the earlier attempt may have reached it",
        )),
        Ok(Lookup::Unsupported) => Err(HandlerError::unknown(
            "not_reconcilable",
            "a lookup-only attempt, but its handler cannot ask the receiver (no status_url)",
        )),
        Err(error) => Err(HandlerError::unknown(
            "lookup_failed",
            format!("the receiver could not be asked: {error}"),
        )),
    }
}

/// The report of an attempt that a later attempt of its operation overtook.
fn superseded(attempt: i32) -> HandlerError {
    HandlerError::unknown(
        "superseded",
        format!("a later attempt of the operation came before attempt {attempt}; it did not call"),
    )
}

/// The node's `config.lookup_authoritative`: its receiver's "not found" means the
/// operation never reached it (the receiver keeps every record, and its lookup reads
/// what its calls wrote). Absent or not `true` → "not found" proves nothing.
pub(crate) fn lookup_authoritative(config: &Value) -> bool {
    config.get(LOOKUP_AUTHORITATIVE).and_then(Value::as_bool) == Some(true)
}

/// The node config key that declares a status lookup authoritative.
pub(crate) const LOOKUP_AUTHORITATIVE: &str = "lookup_authoritative";

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(attempt: u32, config: Value) -> Call {
        Call {
            operation_id: "op-1".into(),
            attempt,
            tenant: "t".into(),
            run_id: "r".into(),
            step_id: "pay#1".into(),
            node: "pay".into(),
            tool: "http".into(),
            side_effect: SideEffectClass::Reconcilable,
            args: json!({}),
            config,
            timeout: Duration::from_secs(1),
            progress: Default::default(),
        }
    }

    fn plain() -> Value {
        json!({"url": "http://x/effects", "status_url": "http://x/status"})
    }

    fn authoritative() -> Value {
        json!({"url": "http://x/effects", "status_url": "http://x/status", "lookup_authoritative": true})
    }

    fn unknown_code(settled: Option<Result<Value, HandlerError>>) -> Option<String> {
        match settled {
            Some(Err(HandlerError::Unknown { code, .. })) => Some(code),
            _ => None,
        }
    }

    #[test]
    fn not_found_after_an_earlier_attempt_stays_unknown() {
        // Seed 001: "not found" may be a lost record or a lookup that lags the call.
        for config in [
            plain(),
            json!({"status_url": "http://x/status", "lookup_authoritative": false}),
            json!({"status_url": "http://x/status", "lookup_authoritative": "true"}),
        ] {
            assert_eq!(
                unknown_code(settle(&call(2, config.clone()), Ok(Lookup::NotFound))).as_deref(),
                Some("lookup_not_found"),
                "{config}"
            );
        }
    }

    #[test]
    fn not_found_calls_when_the_lookup_is_authoritative_or_no_attempt_came_before() {
        assert!(settle(&call(2, authoritative()), Ok(Lookup::NotFound)).is_none());
        assert!(settle(&call(5, authoritative()), Ok(Lookup::NotFound)).is_none());
        assert!(settle(&call(1, plain()), Ok(Lookup::NotFound)).is_none());
    }

    #[test]
    fn a_found_call_settles_without_calling() {
        let out = json!({"ledger_seq": 7});
        for config in [plain(), authoritative()] {
            assert_eq!(
                settle(&call(2, config), Ok(Lookup::Succeeded(out.clone()))),
                Some(Ok(out.clone()))
            );
        }
        let failed = Lookup::Failed {
            code: "declined".into(),
            message: "no".into(),
        };
        // A recorded failure had no effect: the attempt may call (unchanged).
        assert!(settle(&call(2, plain()), Ok(failed)).is_none());
    }

    fn code(outcome: &Result<Value, HandlerError>) -> (&'static str, String) {
        match outcome {
            Ok(_) => ("ok", String::new()),
            Err(HandlerError::Permanent { code, .. }) => ("permanent", code.clone()),
            Err(HandlerError::Unknown { code, .. }) => ("unknown", code.clone()),
            Err(HandlerError::Retryable { code, .. }) => ("retryable", code.clone()),
        }
    }

    /// A lookup-only attempt (a reconcilable step of a run winding down) has no "call"
    /// answer at all (`only_ask` returns an outcome, never "go ahead"): only the
    /// receiver's record settles it. Seen red: with the authoritative not-found arm
    /// disabled, "never performed" came back unknown (an operator task) instead of a
    /// failure.
    #[test]
    fn a_lookup_only_attempt_reports_what_the_receiver_knows_and_never_calls() {
        let out = json!({"ledger_seq": 7});
        assert_eq!(
            only_ask(&call(2, plain()), Ok(Lookup::Succeeded(out.clone()))).ok(),
            Some(out)
        );
        let declined = Lookup::Failed {
            code: "declined".into(),
            message: "no".into(),
        };
        assert_eq!(
            code(&only_ask(&call(2, plain()), Ok(declined))),
            ("permanent", "declined".into())
        );
        assert_eq!(
            code(&only_ask(&call(2, authoritative()), Ok(Lookup::NotFound))),
            ("permanent", "not_performed".into()),
            "never performed: a failure, and no call"
        );
        assert_eq!(
            code(&only_ask(&call(2, plain()), Ok(Lookup::NotFound))),
            ("unknown", "lookup_not_found".into())
        );
        assert_eq!(
            code(&only_ask(
                &call(2, authoritative()),
                Ok(Lookup::Unsupported)
            )),
            ("unknown", "not_reconcilable".into())
        );
        for error in [
            HandlerError::retryable("x", "503"),
            HandlerError::permanent("x", "400 from the status endpoint"),
        ] {
            assert_eq!(
                code(&only_ask(&call(2, authoritative()), Err(error))),
                ("unknown", "lookup_failed".into()),
                "a lookup that failed says nothing about the call"
            );
        }
    }

    /// An earlier attempt that reaches the operation's lock after a later one neither
    /// asks nor calls (the later one may have settled it as never performed). Seen red:
    /// with the attempt check in `exclusive` disabled, attempt 1 got the lock after
    /// attempt 2.
    #[tokio::test]
    async fn an_overtaken_attempt_does_not_get_the_operation() {
        let locks = OperationLocks::default();
        drop(
            locks
                .exclusive("op-1", 2)
                .await
                .expect("attempt 2 goes first"),
        );
        assert!(
            locks.exclusive("op-1", 1).await.is_none(),
            "attempt 1 is overtaken"
        );
        assert!(
            locks.exclusive("op-1", 2).await.is_some(),
            "a redelivered attempt 2"
        );
        assert!(locks.exclusive("op-1", 3).await.is_some());
        assert!(locks.exclusive("op-2", 1).await.is_some(), "per operation");
    }

    #[test]
    fn unaskable_or_failed_lookups_stay_unknown() {
        assert_eq!(
            unknown_code(settle(&call(2, authoritative()), Ok(Lookup::Unsupported))).as_deref(),
            Some("not_reconcilable")
        );
        assert_eq!(
            unknown_code(settle(
                &call(2, authoritative()),
                Err(HandlerError::retryable("x", "503"))
            ))
            .as_deref(),
            Some("lookup_failed")
        );
    }
}
