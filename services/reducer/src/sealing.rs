//! Sealed payloads in the reducer (see `sortie_seal`): the fold works on plaintext, so the
//! reducer opens what it reads (commands, step results, its own cached states) and seals
//! what it writes (events, intents, states) with the run's data key.
//!
//! - **Which key**: a run's data key belongs to its tenant and run id. A new run's key is
//!   made when its StartRun is folded (or was made by the gateway that took the start;
//!   the key store's create-if-absent makes both the same key). An input's payloads open
//!   with the key of the input's *own* tenant — a foreign tenant's command never touches
//!   the run's key — and the run's outputs seal with the run's.
//! - **Same seal, hash and write**: the fold hashes each event over its sealed form
//!   (`sortie_core::apply_sealed`) and the writer seals it with the very same `RunSeal`,
//!   so the chain in Kafka is the chain the fold computed.
//! - **A destroyed key** (crypto-shredding) seals to and opens as `null`: a run whose key
//!   is gone keeps running its structure (a ForgetRun follows) but never writes a payload
//!   again.
//! - **Bad input loses nothing and stops nothing**: a command whose payload does not open
//!   (forged, another run's, a tenant without a KEK) is refused `invalid` outside the
//!   run's history; a step result that does not open is dead-lettered with the reason.
//!   Only an unreachable key store is waited out (then the reducer restarts, like for an
//!   unreachable registry).

use std::time::{Duration, Instant};

use sortie_core::{Command, CommandBody, Input, RunState};
use sortie_seal::{Lookup, RunKeys, RunSeal};

use crate::driver::Error;
use crate::engine::Engine;

/// How long an unreachable key store is retried before the reducer gives up (and restarts).
const KEY_STORE_PATIENCE: Duration = Duration::from_secs(30);

impl Engine {
    /// Looks `run_id`'s key up — first among the keys this batch made, then in the store
    /// — waiting out an unreachable store. With `create`, a run without a key gets one,
    /// made in memory and stored when the batch commits (`persist_new_keys`): a batch of
    /// new runs is one store flush, not one durable write each in the loop.
    /// `Ok(Err(reason))`: the key cannot be had for this input (no KEK for the tenant, a
    /// wrapped key that does not unwrap).
    pub(crate) fn lookup(
        &mut self,
        keys: &RunKeys,
        tenant: &str,
        run_id: &str,
        create: bool,
    ) -> Result<Result<Lookup, String>, Error> {
        if let Some(pending) = self
            .batch
            .new_keys
            .iter()
            .find(|k| k.tenant == tenant && k.run_id == run_id)
        {
            return Ok(Ok(Lookup::Key(pending.key.clone())));
        }
        let started = Instant::now();
        let mut pause = Duration::from_millis(50);
        loop {
            let found = self.runtime.block_on(keys.get(tenant, run_id));
            match found {
                Ok(Lookup::Missing) if create => {
                    return Ok(match keys.prepare(tenant, run_id) {
                        Ok(pending) => {
                            let key = pending.key.clone();
                            self.batch.new_keys.push(pending);
                            Ok(Lookup::Key(key))
                        }
                        Err(e) => Err(e.to_string()),
                    })
                }
                Ok(lookup) => return Ok(Ok(lookup)),
                Err(sortie_seal::Error::Store(e)) if started.elapsed() < KEY_STORE_PATIENCE => {
                    tracing::warn!(run_id, error = %e, "Key store unavailable; retrying.");
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
                Err(sortie_seal::Error::Store(e)) => {
                    return Err(Error::Setup(format!(
                        "the key store stayed unavailable: {e}"
                    )))
                }
                Err(e) => return Ok(Err(e.to_string())),
            }
        }
    }

    /// The seal `input`'s run writes with, and the input with its payloads opened.
    /// `Ok(Err(reason))`: the input cannot be taken as it is (refuse or dead-letter it).
    pub(crate) fn sealing(
        &mut self,
        state: Option<&RunState>,
        input: &Input,
    ) -> Result<Result<(RunSeal, Input), String>, Error> {
        let Some(keys) = self.run_keys.clone() else {
            return Ok(Ok((RunSeal::Plain, input.clone())));
        };
        let keys = &keys;
        let run_id = input.run_id();
        let own_tenant = match input {
            Input::Command(c) => Some(c.tenant.as_str()),
            Input::StepReport(r) => Some(r.tenant.as_str()),
            Input::TimerFired { .. } => None,
        };
        let starts = matches!(
            input,
            Input::Command(Command {
                body: CommandBody::StartRun { .. },
                ..
            })
        );
        if matches!(
            input,
            Input::Command(Command {
                body: CommandBody::ForgetRun { .. },
                ..
            })
        ) {
            // Sent after the key was destroyed: ask the store, not the cache.
            if let Some(tenant) = state.map(|s| s.tenant.as_str()).or(own_tenant) {
                keys.evict(tenant, run_id);
            }
        }
        let write = match (state, own_tenant) {
            (Some(run), _) => match self.lookup(keys, &run.tenant, run_id, false)? {
                Ok(lookup) => RunKeys::seal_of(run_id, &lookup),
                Err(reason) => return Ok(Err(reason)),
            },
            (None, Some(tenant)) => match self.lookup(keys, tenant, run_id, starts)? {
                Ok(lookup) => RunKeys::seal_of(run_id, &lookup),
                Err(reason) => return Ok(Err(reason)),
            },
            (None, None) => RunSeal::Plain,
        };
        let open = match (state, own_tenant) {
            (Some(run), Some(tenant)) if run.tenant != tenant => {
                match self.lookup(keys, tenant, run_id, false)? {
                    Ok(lookup) => RunKeys::seal_of(run_id, &lookup),
                    Err(reason) => return Ok(Err(reason)),
                }
            }
            _ => write.clone(),
        };
        let mut opened = input.clone();
        if let Err(unopened) = open.open_all(|f| opened.map_payloads(f)) {
            return Ok(Err(unopened.first.to_string()));
        }
        Ok(Ok((write, opened)))
    }

    /// A run that becomes forgotten — its retention passed, or a `ForgetRun` was
    /// accepted, whoever sent it — has its data key destroyed: with sealing, forgetting
    /// is shredding, and the history's payloads on `sortie.run-events` become unreadable
    /// too. (The gateway destroyed it already for a delete: idempotent.) Done before the
    /// batch commits, like the reducer's other side effects: an abort re-applies the
    /// input and destroys again, which changes nothing.
    pub(crate) fn shred_if_forgotten(
        &mut self,
        before: Option<&RunState>,
        input: &Input,
        applied: &sortie_core::Applied,
    ) -> Result<(), Error> {
        let (Some(keys), Some(state)) = (self.run_keys.clone(), &applied.state) else {
            return Ok(());
        };
        let Some(forgotten) = &state.forgotten else {
            return Ok(());
        };
        let newly = before.is_some_and(|b| b.forgotten.is_none());
        // A delete of a run forgotten earlier (by retention, or a delete whose key
        // destruction never happened): only when the fold accepted it.
        let deleted_again = match input {
            Input::Command(
                command @ Command {
                    body: CommandBody::ForgetRun { .. },
                    ..
                },
            ) => applied.effects.iter().any(|e| {
                matches!(e, sortie_core::Effect::Emit(event) if matches!(
                    &event.body,
                    sortie_core::EventBody::CommandAccepted { command_id, .. }
                        if *command_id == command.command_id
                ) && event.seq > 0)
            }),
            _ => false,
        };
        if !newly && !deleted_again {
            return Ok(());
        }
        let at = forgotten.at;
        // A key this very batch made is simply never stored: what it sealed is gone.
        let (tenant, run_id) = (state.tenant.clone(), state.run_id.clone());
        self.batch
            .new_keys
            .retain(|k| !(k.tenant == tenant && k.run_id == run_id));
        let started = Instant::now();
        loop {
            match self
                .runtime
                .block_on(keys.destroy(&state.tenant, &state.run_id, at))
            {
                Ok(()) => return Ok(()),
                Err(e) if started.elapsed() < KEY_STORE_PATIENCE => {
                    tracing::warn!(run_id = %state.run_id, error = %e, "Could not destroy a run key; retrying.");
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => {
                    return Err(Error::Setup(format!(
                        "the data key of run {} could not be destroyed: {e}",
                        state.run_id
                    )))
                }
            }
        }
    }

    /// Stores the keys this batch made (one group write), before anything sealed with
    /// them is produced. A key store that stays unreachable, or a run that got another
    /// key meanwhile (a gateway, a fenced zombie), aborts the batch: its inputs are read
    /// again and sealed with the key the store has.
    pub(crate) fn persist_new_keys(&self) -> Result<(), Error> {
        let (Some(keys), false) = (&self.run_keys, self.batch.new_keys.is_empty()) else {
            return Ok(());
        };
        let started = Instant::now();
        loop {
            match self.runtime.block_on(keys.persist(&self.batch.new_keys)) {
                Ok(()) => return Ok(()),
                Err(sortie_seal::Error::Store(e)) if started.elapsed() < KEY_STORE_PATIENCE => {
                    tracing::warn!(error = %e, "Key store unavailable; retrying the batch's new keys.");
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => {
                    return Err(Error::Setup(format!(
                        "storing the batch's new run keys: {e}"
                    )))
                }
            }
        }
    }

    /// Opens a state read from sled (sealed as the changelog holds it) with its run's key.
    pub(crate) fn open_state(&mut self, state: &mut RunState) -> Result<(), Error> {
        let Some(keys) = self.run_keys.clone() else {
            return Ok(());
        };
        let keys = &keys;
        let run_id = state.run_id.clone();
        let seal = match self.lookup(keys, &state.tenant, &run_id, false)? {
            Ok(lookup) => RunKeys::seal_of(&run_id, &lookup),
            Err(reason) => {
                return Err(crate::store::Error::Corrupt(format!(
                    "cached state of run {run_id}: {reason}"
                ))
                .into())
            }
        };
        // Never treat an unopenable state as readable: stop loudly (a key store that is
        // not the one the run was sealed with), as for a corrupt cache entry.
        seal.open_all(|f| state.map_payloads(f)).map_err(|unopened| {
            crate::store::Error::Corrupt(format!(
                "cached state of run {run_id} does not open: {} (is --seal-key-store the store its key is in?)",
                unopened.first
            ))
            .into()
        })
    }
}
