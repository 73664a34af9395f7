//! The input policy: what the reducer does with one consumed record before the fold sees
//! it. In order:
//!
//! 1. a record of a partition that is not an active task (restoring, stopped, revoked) is
//!    left unread: its offset is not taken into the batch, so it is read again when the
//!    partition is next assigned and active;
//! 2. an input whose records Kafka refused before (see `txn::Refusal`) is dead-lettered
//!    by reference once it has been tried [`REFUSALS_BEFORE_LETTER`] times;
//!    an oversized value, key or headers, bytes that do not decode (after waiting out a
//!    registry outage), a record that decodes but is invalid (ids a store or Kafka cannot
//!    hold, a payload that is not JSON or breaks the shape limits of
//!    `sortie_core::limits`, a key that is not the run id) is dead-lettered with its
//!    reason;
//! 3. a record on another partition than its run's canonical one is forwarded there, once,
//!    inside the transaction;
//! 4. a command whose signature does not hold (or is missing where required, see
//!    `keys`) is answered `unauthenticated` outside its run's history; a signed one
//!    issued outside its validity window, or whose command id was taken already and the
//!    run does not know, `outside_window` or `replayed` (see `replay`);
//! 5. everything else is applied by the fold ([`Engine::apply`]).
//!
//! Cases 2 and 3 still consume the offset: the partition keeps moving. Every dead letter
//! is bounded (`sortie_wire::dead_letter`), so the letter of a hostile record is never
//! itself refused. An error while an input is handled (the registry, the key store, the
//! cache) leaves the batch broken: it is dropped, never committed.

use std::time::Duration;

use rdkafka::message::{Headers, OwnedMessage};
use rdkafka::Message;
use sortie_core::Input;
use sortie_wire::records as w;
use sortie_wire::{Codec, Record, TraceContext};
use tokio::runtime::Handle;

use crate::batch::{InputRef, Output, Source};
use crate::convert;
use crate::driver::Error;
use crate::engine::Engine;
use crate::keyring::Verdict;

/// How many times an input's records may be refused by Kafka before the input is
/// dead-lettered by reference: once to rule out a passing refusal, then set aside.
pub(crate) const REFUSALS_BEFORE_LETTER: u32 = 2;

/// Largest key of an input record: every input is keyed by an id (the run id of a
/// command, the operation id of a result).
const MAX_INPUT_KEY_BYTES: usize = sortie_core::limits::MAX_ID_BYTES;
/// Most headers on an input record, and most bytes in all of them.
const MAX_INPUT_HEADERS: usize = 64;
const MAX_INPUT_HEADER_BYTES: usize = 64 * 1024;

/// What the signature check before the fold found.
enum Check {
    /// Refused before the fold, with this code.
    Refuse(&'static str, String),
    /// Signed by a key that may sign it, issued at this time.
    Signed { issued_at: i64 },
    /// Not signed (allowed), or not a command.
    Plain,
}

/// Encodes with the registry, waiting out a short registry outage.
pub(crate) fn encode_patiently<R: Record>(
    runtime: &Handle,
    codec: &Codec,
    topic: &str,
    record: &R,
) -> Result<Vec<u8>, Error> {
    let mut backoff = Duration::from_millis(100);
    loop {
        match runtime.block_on(codec.encode(topic, record)) {
            Ok(bytes) => return Ok(bytes),
            Err(e) if e.is_retryable() && backoff < Duration::from_secs(10) => {
                tracing::warn!(topic, error = %e, "Schema registry unavailable; retrying.");
                std::thread::sleep(backoff);
                backoff *= 2;
            }
            Err(e) => return Err(Error::Registry(e.to_string())),
        }
    }
}

pub(crate) fn headers_of(message: &OwnedMessage) -> Vec<(String, Option<Vec<u8>>)> {
    message
        .headers()
        .map(|h| {
            h.iter()
                .map(|header| (header.key.to_owned(), header.value.map(<[u8]>::to_vec)))
                .collect()
        })
        .unwrap_or_default()
}

/// Why a record's key or headers are more than any input carries, if they are.
fn oversized_envelope(message: &OwnedMessage) -> Option<String> {
    let key = message.key().map_or(0, <[u8]>::len);
    if key > MAX_INPUT_KEY_BYTES {
        return Some(format!(
            "key of {key} bytes exceeds the {MAX_INPUT_KEY_BYTES} byte cap"
        ));
    }
    let headers = message.headers()?;
    if headers.count() > MAX_INPUT_HEADERS {
        return Some(format!(
            "{} headers exceed the cap of {MAX_INPUT_HEADERS}",
            headers.count()
        ));
    }
    let bytes: usize = headers
        .iter()
        .map(|h| h.key.len() + h.value.map_or(0, <[u8]>::len))
        .sum();
    (bytes > MAX_INPUT_HEADER_BYTES)
        .then(|| format!("headers of {bytes} bytes exceed the {MAX_INPUT_HEADER_BYTES} byte cap"))
}

impl Engine {
    /// Takes one consumed record into the batch (applied, forwarded or dead-lettered), or
    /// leaves it unconsumed when its partition is not an active task. An error leaves the
    /// batch broken (never committed).
    pub fn handle(&mut self, message: &OwnedMessage) -> Result<(), Error> {
        if !self.tasks.is_active(message.partition()) {
            return Ok(());
        }
        let at = InputRef {
            topic: message.topic().to_owned(),
            partition: message.partition(),
            offset: message.offset(),
        };
        self.batch.consumed(&at.topic, at.partition, at.offset);
        self.convoy.arrived(message.key());
        self.source = Some(at);
        let handled = self.handle_consumed(message);
        self.source = None;
        self.whole(handled)
    }

    fn handle_consumed(&mut self, message: &OwnedMessage) -> Result<(), Error> {
        let topic = message.topic().to_owned();
        if let Some(refused) = self
            .source
            .clone()
            .and_then(|at| self.refused.get_mut(&Source::Input(at)))
            .filter(|r| r.times >= REFUSALS_BEFORE_LETTER)
        {
            // Kafka refused what this input makes, every time: set it aside, by reference
            // only (its own bytes may be what is refused), and go on with the partition.
            refused.lettered = true;
            let reason = format!(
                "Kafka refused the records this input makes {} times: {}",
                refused.times, refused.reason
            );
            self.dead_letter_by_reference(message, "unproducible", reason)?;
            return Ok(());
        }
        let at = message
            .timestamp()
            .to_millis()
            .unwrap_or_else(sortie_kafka::clock::now_ms);
        if message.payload().is_none() && topic == self.config.topics.step_results() {
            // A forgotten run's step result, tombstoned by the reducer itself (`Forget`).
            self.batch.counts.ignored("tombstone");
            return Ok(());
        }
        let size = message.payload().map_or(0, <[u8]>::len);
        if size > self.config.max_payload_bytes {
            let reason = format!(
                "value of {size} bytes exceeds the {} byte cap",
                self.config.max_payload_bytes
            );
            self.dead_letter(message, "oversized", reason)?;
            return Ok(());
        }
        if let Some(reason) = oversized_envelope(message) {
            self.dead_letter(message, "oversized", reason)?;
            return Ok(());
        }
        let key = message
            .key()
            .map(String::from_utf8_lossy)
            .unwrap_or_default();
        let decoded = if topic == self.config.topics.commands() {
            self.runtime
                .block_on(
                    self.codec
                        .decode_patiently::<w::RunCommand>(message.payload(), None),
                )
                .map_err(|e| (e.reason_code(), e.to_string()))
                .and_then(|command| {
                    let run_id = command.run_id.clone();
                    if key != run_id {
                        let reason =
                            format!("record key {key:?} is not the command's run id {run_id:?}");
                        return Err(("invalid", reason));
                    }
                    let issued_at = command.issued_at;
                    let check = match self.keys.verdict(message, &command) {
                        Verdict::Refused(reason) => Check::Refuse("unauthenticated", reason),
                        Verdict::Signed => Check::Signed { issued_at },
                        Verdict::Unsigned => Check::Plain,
                    };
                    match convert::command_from_wire(command) {
                        Ok(mut command) => {
                            command.at = at;
                            Ok((run_id, Input::Command(command), check))
                        }
                        // Only a payload broke the shape rule: answered, as the gateway
                        // answers it, not dead-lettered (an unsigned one is still
                        // refused as that first).
                        Err(convert::Invalid(reason, Some(mut command))) => {
                            command.at = at;
                            let check = match check {
                                Check::Refuse(..) => check,
                                _ => Check::Refuse("limit_exceeded", reason),
                            };
                            Ok((run_id, Input::Command(*command), check))
                        }
                        Err(invalid) => Err(("invalid", invalid.0)),
                    }
                })
        } else {
            self.runtime
                .block_on(
                    self.codec
                        .decode_patiently::<w::StepResult>(message.payload(), None),
                )
                .map_err(|e| (e.reason_code(), e.to_string()))
                .and_then(|result| {
                    let run_id = result.run_id.clone();
                    convert::report_from_wire(result, at)
                        .map(|report| (run_id, Input::StepReport(report), Check::Plain))
                        .map_err(|e| ("invalid", e.0))
                })
        };
        let (run_id, input, check) = match decoded {
            Ok(decoded) => decoded,
            Err((code, reason)) => {
                self.dead_letter(message, code, reason)?;
                return Ok(());
            }
        };
        let canonical = self.partition_of(&run_id);
        if canonical != message.partition() {
            // Produced by a client with another partitioner: move it to the run's partition
            // (once, inside this transaction) and let that partition's owner apply it.
            tracing::info!(
                topic,
                run_id,
                from = message.partition(),
                to = canonical,
                "Forwarding a misrouted record to its run's partition."
            );
            let source = self.source_of(&run_id);
            self.batch.outputs.push(Output {
                topic,
                partition: Some(canonical),
                key: message.key().unwrap_or_default().to_vec(),
                value: Some(message.payload().unwrap_or_default().to_vec()),
                headers: headers_of(message),
                source,
            });
            self.batch.counts.forwarded();
            return Ok(());
        }
        let trace = message
            .headers()
            .and_then(|h| TraceContext::from_headers(h.iter().map(|h| (h.key, h.value))))
            .unwrap_or_else(|| TraceContext::for_run(&run_id));
        // A signed command is valid for a window around the broker's time (see `replay`).
        let (refusal, signed) = match check {
            Check::Refuse(code, reason) => (Some((code, reason)), None),
            Check::Signed { issued_at } => {
                match self.replays.window_refusal(canonical, issued_at, at) {
                    Some(reason) => (Some(("outside_window", reason)), None),
                    None => (None, Some(issued_at)),
                }
            }
            Check::Plain => (None, None),
        };
        if let Some((code, reason)) = self.apply_or_refuse(&input, refusal, signed, &trace)? {
            self.dead_letter(message, code, reason)?;
        }
        Ok(())
    }

    /// Dead-letters `message` with what a letter keeps of it (bounded, see
    /// `sortie_wire::dead_letter`).
    pub fn dead_letter(
        &mut self,
        message: &OwnedMessage,
        code: &str,
        reason: String,
    ) -> Result<(), Error> {
        let letter = sortie_wire::dead_letter::letter(
            message,
            format!("reducer/{}", self.config.instance_id),
            code,
            reason,
            sortie_kafka::clock::now_ms(),
        );
        self.post_letter(message, letter)
    }

    /// Dead-letters `message` by where it is only: no key, value or header of it travels.
    pub fn dead_letter_by_reference(
        &mut self,
        message: &OwnedMessage,
        code: &str,
        reason: String,
    ) -> Result<(), Error> {
        let letter = sortie_wire::dead_letter::by_reference(
            message,
            format!("reducer/{}", self.config.instance_id),
            code,
            reason,
            sortie_kafka::clock::now_ms(),
        );
        self.post_letter(message, letter)
    }

    fn post_letter(
        &mut self,
        message: &OwnedMessage,
        letter: sortie_wire::records::DeadLetter,
    ) -> Result<(), Error> {
        tracing::warn!(
            topic = message.topic(),
            partition = message.partition(),
            offset = message.offset(),
            code = letter.reason_code,
            reason = letter.reason,
            "Dead-lettering a record."
        );
        let code = letter.reason_code.clone();
        let topic = self.config.topics.dead_letters();
        let value = self.encode(&topic, &letter)?;
        let source = self.source_of("");
        self.batch.outputs.push(Output {
            topic,
            partition: None,
            key: sortie_wire::dead_letter::letter_key(message),
            value: Some(value),
            headers: vec![],
            source,
        });
        self.batch.dead_letters += 1;
        self.batch.counts.dead_letter(&code);
        Ok(())
    }
}

/// Most refusals remembered; past it the inputs' ones are forgotten (and learnt again).
const MAX_REFUSALS: usize = 10_000;

impl Engine {
    /// Kafka refused a record for what it is (`refusal`): its source is set aside. An
    /// input whose record is refused [`REFUSALS_BEFORE_LETTER`] times is dead-lettered
    /// by reference when it is read again ([`Engine::handle`]); if even that letter is
    /// refused, or the refusal is of where records go (a missing topic, no right to
    /// write it), or of a run's own record, the partition stops loudly after as many
    /// tries. Either way the partition's traffic does not loop on it.
    pub(crate) fn refused<C: rdkafka::consumer::ConsumerContext>(
        &mut self,
        refusal: crate::txn::Refusal,
        consumer: &rdkafka::consumer::BaseConsumer<C>,
    ) {
        use crate::txn::RefusalKind;
        crate::metrics::record_refused(refusal.kind == RefusalKind::Record);
        if self.refused.len() >= MAX_REFUSALS {
            self.refused
                .retain(|source, _| matches!(source, Source::Run(_)));
        }
        let partition = match &refusal.source {
            Source::Input(at) => at.partition,
            Source::Run(run_id) => self.partition_of(run_id),
        };
        let entry = self.refused.entry(refusal.source.clone()).or_default();
        entry.times += 1;
        entry.reason = refusal.reason.clone();
        tracing::warn!(
            source = ?refusal.source,
            times = entry.times,
            reason = refusal.reason,
            "Kafka refused a record for what it is; its source is set aside after {REFUSALS_BEFORE_LETTER} tries."
        );
        let stop = match (&refusal.source, refusal.kind) {
            (Source::Input(_), RefusalKind::Record) => entry.lettered,
            _ => entry.times >= REFUSALS_BEFORE_LETTER,
        };
        if stop {
            let what = match &refusal.source {
                Source::Input(at) if entry.lettered => {
                    format!("input {at} could not be dead-lettered either")
                }
                Source::Input(at) => format!("the records input {at} makes are refused"),
                Source::Run(run_id) => format!("the records of run {run_id} are refused"),
            };
            let reason = format!("{what}: {}", refusal.reason);
            self.stop_partition(consumer, partition, reason);
        }
    }
}
