//! The input policy: what the reducer does with one consumed record before the fold sees
//! it. In order:
//!
//! 1. a record of a partition that is not an active task (restoring, stopped, revoked) is
//!    left unread: its offset is not taken into the batch, so it is read again when the
//!    partition is next assigned and active;
//! 2. an oversized value, bytes that do not decode (after waiting out a registry outage),
//!    a record that decodes but is invalid (ids a store or Kafka cannot hold, a payload
//!    that is not JSON, a key that is not the run id) is dead-lettered with its reason;
//! 3. a record on another partition than its run's canonical one is forwarded there, once,
//!    inside the transaction;
//! 4. a command whose signature does not hold (or is missing where required, see
//!    `keys`) is answered `unauthenticated` outside its run's history;
//! 5. everything else is applied by the fold ([`Engine::apply`]).
//!
//! Cases 2 and 3 still consume the offset: the partition keeps moving.

use std::time::Duration;

use rdkafka::message::{Headers, OwnedMessage};
use rdkafka::Message;
use sortie_core::Input;
use sortie_wire::records as w;
use sortie_wire::{Codec, Record, TraceContext};
use tokio::runtime::Handle;

use crate::batch::Output;
use crate::convert;
use crate::driver::Error;
use crate::engine::Engine;

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

impl Engine {
    /// Takes one consumed record into the batch (applied, forwarded or dead-lettered), or
    /// leaves it unconsumed when its partition is not an active task.
    pub fn handle(&mut self, message: &OwnedMessage) -> Result<(), Error> {
        if !self.tasks.is_active(message.partition()) {
            return Ok(());
        }
        let topic = message.topic().to_owned();
        self.batch
            .consumed(&topic, message.partition(), message.offset());
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
                    let refusal = self.keys.refusal(message, &command);
                    convert::command_from_wire(command)
                        .map(|mut command| {
                            command.at = at;
                            (run_id, Input::Command(command), refusal)
                        })
                        .map_err(|e| ("invalid", e.0))
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
                        .map(|report| (run_id, Input::StepReport(report), None))
                        .map_err(|e| ("invalid", e.0))
                })
        };
        let (run_id, input, refusal) = match decoded {
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
            self.batch.outputs.push(Output {
                topic,
                partition: Some(canonical),
                key: message.key().unwrap_or_default().to_vec(),
                value: Some(message.payload().unwrap_or_default().to_vec()),
                headers: headers_of(message),
            });
            self.batch.counts.forwarded();
            return Ok(());
        }
        let trace = message
            .headers()
            .and_then(|h| TraceContext::from_headers(h.iter().map(|h| (h.key, h.value))))
            .unwrap_or_else(|| TraceContext::for_run(&run_id));
        if let Some(reason) = self.apply_or_refuse(&input, refusal, &trace)? {
            self.dead_letter(message, "unsealable", reason)?;
        }
        Ok(())
    }

    pub fn dead_letter(
        &mut self,
        message: &OwnedMessage,
        code: &str,
        reason: String,
    ) -> Result<(), Error> {
        tracing::warn!(
            topic = message.topic(),
            partition = message.partition(),
            offset = message.offset(),
            code,
            reason,
            "Dead-lettering a record."
        );
        let letter = sortie_wire::dead_letter::letter(
            message,
            format!("reducer/{}", self.config.instance_id),
            code,
            reason,
            sortie_kafka::clock::now_ms(),
        );
        let topic = self.config.topics.dead_letters();
        let value = self.encode(&topic, &letter)?;
        self.batch.outputs.push(Output {
            topic,
            partition: None,
            key: message.key().unwrap_or_default().to_vec(),
            value: Some(value),
            headers: vec![],
        });
        self.batch.dead_letters += 1;
        self.batch.counts.dead_letter(code);
        Ok(())
    }
}
