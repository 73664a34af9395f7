//! Publishing a graph version: its record, checked against the table read first, signed
//! when a signer is given, and produced with `acks=all`.

use std::time::{Duration, Instant};

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::Message;
use sortie_core::Graph;
use sortie_kafka::KafkaConfig;
use sortie_wire::records::GraphDefinition;
use sortie_wire::signing::{Keyring, Signer};
use sortie_wire::{Codec, Topics};

use crate::{kafka_error, pin, reader::Reader, table::Table, Error, Trust};

/// How long [`publish`] may take to read the current table and to deliver its record.
const PUBLISH_PATIENCE: Duration = Duration::from_secs(30);

/// What [`publish`] did.
// Named as its callers read it: `Published::AlreadyPublished`.
#[allow(clippy::enum_variant_names)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Published {
    /// A new version was written to the graphs topic.
    Published { version: u32 },
    /// The same definition was already published; nothing was written.
    AlreadyPublished,
}
/// Lower-case hex SHA-256 of a definition's text (a record's `definition_hash`).
pub fn definition_hash(definition: &str) -> String {
    sortie_core::blob::sha256_hex(definition.as_bytes())
}

/// The record that publishing `graph` writes: its canonical JSON and that text's hash.
pub fn definition_record(
    graph: &Graph,
    published_by: &str,
    now_ms: i64,
) -> Result<GraphDefinition, Error> {
    let version = i32::try_from(graph.version).map_err(|_| Error::VersionOutOfRange {
        key: graph.key(),
        version: graph.version,
    })?;
    let definition = graph.canonical_json();
    Ok(GraphDefinition {
        graph_id: graph.id.clone(),
        version,
        tenant: graph.owner.clone(),
        definition_hash: definition_hash(&definition),
        definition,
        published_by: published_by.to_owned(),
        published_at: now_ms,
    })
}
/// Publishes `graph` unsigned unless that exact definition is already published (see
/// [`publish_signed`]).
pub async fn publish(
    kafka: &KafkaConfig,
    codec: &Codec,
    topics: &Topics,
    graph: &Graph,
    published_by: &str,
    now_ms: i64,
) -> Result<Published, Error> {
    publish_signed(
        kafka,
        codec,
        topics,
        graph,
        published_by,
        now_ms,
        None,
        None,
    )
    .await
}

/// Publishes `graph` unless that exact definition is already published.
///
/// Reads the whole table first: the same definition → [`Published::AlreadyPublished`]
/// (nothing produced); another definition of the same version → [`Error::VersionExists`].
/// Otherwise produces the record keyed `id@version` with `acks=all` and awaits delivery.
///
/// With `signer` the record is signed (it must be a publisher key whose principal is
/// `published_by`), and the table is read as a reader requiring signatures reads it:
/// with `trust`'s keyring, else trusting the signer's own key only — so an unsigned or
/// forged record of the version neither counts as published nor blocks the real one.
#[allow(clippy::too_many_arguments)]
pub async fn publish_signed(
    kafka: &KafkaConfig,
    codec: &Codec,
    topics: &Topics,
    graph: &Graph,
    published_by: &str,
    now_ms: i64,
    signer: Option<&Signer>,
    trust: Option<&Trust>,
) -> Result<Published, Error> {
    // The tool lists of the MCP servers it offers are pinned first, so what is compared,
    // signed and written is the pinned definition.
    let pinned = pin(graph).await?;
    let graph = &pinned;
    let topic = topics.graphs();
    let trust = match (signer, trust) {
        (_, Some(trust)) => Some(Trust {
            require: trust.require || signer.is_some(),
            ..trust.clone()
        }),
        (Some(signer), None) => {
            let mut own = signer.entry(published_by, &["*".to_owned()], &[], false);
            own.publisher = true;
            let keyring = Keyring::parse(&sortie_wire::signing::keyring_text(&[own]))
                .map_err(|e| Error::Signing(e.to_string()))?;
            Some(Trust {
                keyring,
                require: true,
            })
        }
        (None, None) => None,
    };
    let key = graph.key();
    let record = definition_record(graph, published_by, now_ms)?;
    let deadline = Instant::now() + PUBLISH_PATIENCE;

    let messages = {
        let kafka = kafka.clone();
        let reading = topic.clone();
        let read = tokio::task::spawn_blocking(move || {
            let mut reader = Reader::open(&kafka, &reading)?;
            let mut messages = Vec::new();
            reader.read_to_end(deadline, PUBLISH_PATIENCE, |m| {
                messages.push(m);
                Ok(())
            })?;
            Ok::<_, Error>(messages)
        });
        match read.await {
            Ok(messages) => messages?,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => return Err(Error::Cancelled(topic)),
        }
    };
    let mut table = Table {
        trust: trust.clone(),
        ..Table::default()
    };
    for message in &messages {
        let decoded = match codec
            .decode_patiently::<GraphDefinition>(message.payload(), Some(deadline))
            .await
        {
            Err(source) if source.is_retryable() => {
                return Err(Error::RegistryUnavailable {
                    topic: topic.clone(),
                    source,
                })
            }
            decoded => decoded,
        };
        table.admit(&topic, message, decoded);
    }
    if let Some(existing) = table.publications.get(&key) {
        let same = existing.definition_hash == record.definition_hash
            || table.graphs.get(&graph.pinned_id(), Some(graph.version)) == Some(graph);
        return if same {
            Ok(Published::AlreadyPublished)
        } else {
            Err(Error::VersionExists { key })
        };
    }

    let payload = codec.encode(&topic, &record).await?;
    let producer: FutureProducer = kafka
        .producer()
        .set("acks", "all")
        .set("linger.ms", "0")
        .create()
        .map_err(kafka_error("creating a producer"))?;
    let remaining = deadline.saturating_duration_since(Instant::now());
    let mut record = FutureRecord::to(&topic).key(&key).payload(&payload);
    if let Some(signer) = signer {
        let signed = signer.headers(&payload);
        if let Some(trust) = &trust {
            // What readers holding this keyring would refuse is not published: a key that
            // may not publish for the graph's tenant fails here, not silently at every reader.
            let pairs = signed.iter().map(|(k, v)| (*k, Some(v.as_slice())));
            if let Err(reason) =
                trust
                    .keyring
                    .check_graph(pairs, &payload, graph.owner.as_deref(), published_by)
            {
                return Err(Error::Signing(format!(
                    "readers with this keyring would refuse {key}: {reason}"
                )));
            }
        }
        let mut headers = OwnedHeaders::new();
        for (name, value) in signed {
            headers = headers.insert(Header {
                key: name,
                value: Some(&value),
            });
        }
        record = record.headers(headers);
    }
    producer
        .send(record, remaining)
        .await
        .map_err(|(error, _)| kafka_error(format!("publishing {key} to {topic}"))(error))?;
    tracing::info!(graph = %key, topic = %topic, published_by, "Published a graph version.");
    Ok(Published::Published {
        version: graph.version,
    })
}
