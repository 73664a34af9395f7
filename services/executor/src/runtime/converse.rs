//! A conversation's call ([`sortie_core::converse`]): before the handler runs, the
//! previous call's transcript (already fetched from the blob store by
//! `Worker::resolve_args`, and opened if the run is sealed) and the call's new messages
//! become the whole conversation; it is stored as this call's transcript, and the handler
//! is given what the node's context lets the model see. The transcript's reference goes
//! into the output, so the next call continues from it. Nothing is stored for a call that
//! is not a conversation's.

use serde_json::Value;
use sortie_core::blob::{BlobKey, BlobRef, JSON_MEDIA_TYPE};
use sortie_core::converse::{self, ARG};
use sortie_core::graph::ModelApi;
use sortie_core::Seal as _;

use super::Worker;
use crate::handler::{Call, HandlerError};

impl Worker {
    /// The call as its handler sees it, and the reference to the transcript stored for
    /// it (`None` for a call that is not a conversation's, or a summary's). A transcript
    /// that cannot be stored fails the attempt retryably, before any call; a conversation
    /// on an executor without a blob store fails for good (`no_blob_store`).
    pub(super) async fn converse(
        &self,
        mut call: Call,
    ) -> Result<(Call, Option<Value>), HandlerError> {
        if call.args.get(ARG).is_none() {
            return Ok((call, None));
        }
        let seal = self.run_seal(&call.tenant, &call.run_id).await?;
        if let Some(history) = call.args.get_mut(ARG).and_then(|m| m.get_mut("history")) {
            if self.run_keys.is_some() {
                seal.open(history)
                    .map_err(|e| HandlerError::permanent("unsealable", e.to_string()))?;
            }
        }
        let api = match call.config.get("api").and_then(Value::as_str) {
            Some("anthropic") => ModelApi::Anthropic,
            _ => ModelApi::OpenAi,
        };
        let args = std::mem::take(&mut call.args);
        let prepared = converse::prepare(args, api)
            .map_err(|e| HandlerError::permanent("bad_args", format!("conversation: {e}")))?;
        call.args = prepared.args;
        let Some(transcript) = prepared.transcript else {
            return Ok((call, None));
        };
        let Some(store) = &self.blobs else {
            return Err(HandlerError::permanent(
                "no_blob_store",
                "a conversation keeps its transcript in the blob store: start the executor with --blob-store",
            ));
        };
        let stored = seal.seal(&transcript);
        let bytes = serde_json::to_vec(&stored).unwrap_or_default();
        let key = BlobKey::for_bytes(&call.tenant, &call.run_id, &bytes);
        let reference = BlobRef::new(&key, &bytes, JSON_MEDIA_TYPE).to_value();
        if let Err(error) = store.put(key.as_str(), bytes).await {
            crate::metrics::blob_write_failed();
            tracing::warn!(%error, "The conversation's transcript could not be stored.");
            return Err(HandlerError::retryable(
                "blob_unavailable",
                format!("the conversation's transcript could not be stored: {error}"),
            ));
        }
        Ok((call, Some(reference)))
    }
}

/// The output with the transcript's reference (an answer that is no object is kept
/// under `content`).
pub(super) fn with_transcript(output: Value, transcript: Option<Value>) -> Value {
    let Some(reference) = transcript else {
        return output;
    };
    let mut output = match output {
        Value::Object(map) => Value::Object(map),
        other => serde_json::json!({ "content": other }),
    };
    output["transcript"] = reference;
    output
}
