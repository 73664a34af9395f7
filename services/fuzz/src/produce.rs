//! Producing to Kafka, shared by the campaigns: record headers from name and value pairs,
//! and one record signed by a key, its delivery awaited.

use std::time::Duration;

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sortie_wire::signing::Signer;

/// Kafka headers carrying `pairs`, in order (duplicates kept).
pub(crate) fn headers<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> OwnedHeaders {
    let mut headers = OwnedHeaders::new();
    for (key, value) in pairs {
        headers = headers.insert(Header {
            key,
            value: Some(value),
        });
    }
    headers
}

/// Produces `value` under `key` (to `partition`, or where the partitioner puts it) with
/// `signer`'s key id and signature headers, and waits for its delivery.
pub(crate) async fn send(
    producer: &FutureProducer,
    topic: &str,
    key: &str,
    partition: Option<i32>,
    value: &[u8],
    signer: &Signer,
) -> anyhow::Result<()> {
    let signature = signer.headers(value);
    let mut record = FutureRecord::to(topic)
        .key(key)
        .payload(value)
        .headers(headers(
            signature
                .iter()
                .map(|(name, bytes)| (*name, bytes.as_slice())),
        ));
    if let Some(partition) = partition {
        record = record.partition(partition);
    }
    producer
        .send(record, Duration::from_secs(30))
        .await
        .map_err(|(e, _)| anyhow::anyhow!("producing to {topic}: {e}"))?;
    Ok(())
}
