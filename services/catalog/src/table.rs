//! The published graphs as read from the topic: the fold of graph records (shared with
//! publishing) and [`GraphTable`], which keeps it up to date.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::message::OwnedMessage;
use rdkafka::Message;
use sortie_core::{Graph, Graphs};
use sortie_kafka::KafkaConfig;
use sortie_wire::records::GraphDefinition;
use sortie_wire::{Codec, DecodeError, Topics};
use tokio::runtime::Handle;

use crate::{
    definition_hash,
    reader::{Polled, Reader},
    Error, Trust,
};

/// Who published a graph version, and when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Publication {
    /// `graph_id@version`.
    pub key: String,
    pub definition_hash: String,
    pub tenant: Option<String>,
    pub published_by: String,
    /// Milliseconds since the Unix epoch.
    pub published_at: i64,
    /// The publisher key whose signature the table verified (`None`: read without a
    /// keyring, or unsigned where signatures are not required).
    pub signed_by: Option<String>,
}
/// The fold of graph records into published graphs, shared by [`publish`] and
/// [`GraphTable`].
#[derive(Debug, Default)]
pub(crate) struct Table {
    pub(crate) graphs: Graphs,
    pub(crate) publications: BTreeMap<String, Publication>,
    pub(crate) skipped: usize,
    /// Records skipped because their signature did not hold or was missing.
    pub(crate) untrusted: usize,
    /// Whose graphs are taken (`None`: signatures are not read).
    pub(crate) trust: Option<Trust>,
}

impl Table {
    /// Folds one record in; true when it added a graph version. A record that cannot be
    /// trusted is skipped with a warning and counted, never fatal.
    pub(crate) fn admit(
        &mut self,
        topic: &str,
        message: &OwnedMessage,
        decoded: Result<GraphDefinition, DecodeError>,
    ) -> bool {
        let key = String::from_utf8_lossy(message.key().unwrap_or_default()).into_owned();
        let decoded = decoded.map_err(|e| format!("it does not decode: {e}"));
        let mut signed_by = None;
        if let (Ok(record), Some(trust)) = (&decoded, &self.trust) {
            match trust.check(message, record) {
                Ok(key) => signed_by = key,
                Err(reason) => {
                    self.untrusted += 1;
                    self.skip(topic, message, &key, &reason);
                    return false;
                }
            }
        }
        let checked = decoded.and_then(|record| self.check(&key, record));
        match checked {
            Ok(Some((graph, mut publication))) => {
                publication.signed_by = signed_by;
                if let Err(error) = self.graphs.insert(graph) {
                    // check() already refused redefinitions; kept for safety.
                    self.skip(topic, message, &key, &error.to_string());
                    return false;
                }
                self.publications.insert(key, publication);
                true
            }
            Ok(None) => false,
            Err(reason) => {
                self.skip(topic, message, &key, &reason);
                false
            }
        }
    }

    fn skip(&mut self, topic: &str, message: &OwnedMessage, key: &str, reason: &str) {
        self.skipped += 1;
        tracing::warn!(
            topic,
            partition = message.partition(),
            offset = message.offset(),
            key,
            reason,
            "Skipped a record on the graphs topic that is not a trustworthy graph definition."
        );
    }

    /// The graph a record publishes, `None` when that exact version is already known.
    fn check(
        &self,
        key: &str,
        record: GraphDefinition,
    ) -> Result<Option<(Graph, Publication)>, String> {
        if definition_hash(&record.definition) != record.definition_hash {
            return Err("its definition_hash is not the SHA-256 of its definition".into());
        }
        let mut graph = Graph::parse(&record.definition)
            .map_err(|e| format!("its definition is refused: {e}"))?;
        // A tenant's graph lives in that tenant's namespace (`Graphs`); the signature was
        // checked for that tenant.
        if let Some(tenant) = &record.tenant {
            sortie_core::limits::check_id("tenant", tenant)?;
        }
        graph.owner = record.tenant.clone();
        if let Some(server) = graph.unpinned_mcp_servers().first() {
            // The fold would offer the model none of the server's tools: a version is
            // published pinned, by `publish`, or not at all.
            return Err(format!(
                "it offers the tools of MCP server {server} without their pinned list"
            ));
        }
        if graph.id != record.graph_id || i64::from(graph.version) != i64::from(record.version) {
            return Err(format!(
                "the record names {}@{} but its definition is {}",
                record.graph_id,
                record.version,
                graph.key()
            ));
        }
        if graph.key() != key {
            return Err(format!("it is keyed {key:?} instead of {:?}", graph.key()));
        }
        if let Some(existing) = self.graphs.get(&graph.pinned_id(), Some(graph.version)) {
            return if existing == &graph {
                Ok(None)
            } else {
                Err(format!(
                    "it redefines {key}, which is already published with another definition"
                ))
            };
        }
        let publication = Publication {
            key: key.to_owned(),
            definition_hash: record.definition_hash,
            tenant: record.tenant,
            published_by: record.published_by,
            published_at: record.published_at,
            signed_by: None,
        };
        Ok(Some((graph, publication)))
    }
}

/// The global view of the graphs topic: every partition from the beginning,
/// `read_committed`. Blocking; meant for a plain std thread (decoding runs on `runtime`).
pub struct GraphTable {
    reader: Reader,
    fold: Fold,
}

/// What the records read so far add up to.
struct Fold {
    topic: String,
    codec: Arc<Codec>,
    runtime: Handle,
    table: Table,
    /// A record that could not be decoded because the registry was unreachable; it is
    /// decoded again before anything after it.
    pending: Option<OwnedMessage>,
    registry_down: bool,
}

impl std::fmt::Debug for GraphTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphTable")
            .field("topic", &self.reader.topic)
            .field("graphs", &self.fold.table.publications.len())
            .field("skipped", &self.fold.table.skipped)
            .field("pending", &self.fold.pending.is_some())
            .finish_non_exhaustive()
    }
}

impl GraphTable {
    /// Assigns every partition of the graphs topic from the beginning. Reads nothing yet:
    /// call [`GraphTable::catch_up`].
    pub fn open(
        kafka: &KafkaConfig,
        topics: &Topics,
        codec: Arc<Codec>,
        runtime: Handle,
    ) -> Result<Self, Error> {
        Ok(Self {
            reader: Reader::open(kafka, &topics.graphs())?,
            fold: Fold {
                topic: topics.graphs(),
                codec,
                runtime,
                table: Table::default(),
                pending: None,
                registry_down: false,
            },
        })
    }

    /// Reads until every partition reaches the high watermark it had when this was called;
    /// returns how many graph versions were added.
    pub fn catch_up(&mut self, timeout: Duration) -> Result<usize, Error> {
        let deadline = Instant::now() + timeout;
        let mut added = 0;
        if let Some(message) = self.fold.pending.take() {
            added += usize::from(self.fold.take(message, Some(deadline))?);
        }
        let Self { reader, fold } = self;
        reader.read_to_end(deadline, timeout, |message| {
            added += usize::from(fold.take(message, Some(deadline))?);
            Ok(())
        })?;
        Ok(added)
    }

    /// Takes whatever has arrived, without waiting; returns how many versions were added.
    pub fn poll(&mut self) -> usize {
        let mut added = 0;
        if let Some(message) = self.fold.pending.take() {
            match self.fold.take(message, None) {
                Ok(new) => added += usize::from(new),
                Err(_) => return added,
            }
        }
        loop {
            match self.reader.poll(Duration::ZERO) {
                Polled::Nothing => return added,
                Polled::Other => {}
                Polled::Message(message) => match self.fold.take(message, None) {
                    Ok(new) => added += usize::from(new),
                    Err(_) => return added,
                },
            }
        }
    }

    /// The published graphs read so far.
    pub fn graphs(&self) -> &Graphs {
        &self.fold.table.graphs
    }

    /// Who published `graph_id@version`, and when.
    pub fn publication(&self, key: &str) -> Option<&Publication> {
        self.fold.table.publications.get(key)
    }

    /// How many records were skipped (undecodable, invalid, hash mismatch, redefinition,
    /// untrusted).
    pub fn skipped(&self) -> usize {
        self.fold.table.skipped
    }

    /// How many records were skipped because their signature did not hold, or was missing
    /// where signatures are required.
    pub fn untrusted(&self) -> usize {
        self.fold.table.untrusted
    }

    /// Reads graph records with `trust` from now on (a reloaded keyring); versions already
    /// taken stay.
    pub fn set_trust(&mut self, trust: Option<Trust>) {
        self.fold.table.trust = trust;
    }
}

impl Fold {
    /// Decodes and folds one record. A registry outage keeps the record pending (retried
    /// until `deadline` when given, once otherwise) and is returned as the error.
    fn take(&mut self, message: OwnedMessage, deadline: Option<Instant>) -> Result<bool, Error> {
        // Without a deadline, one try: the reducer's loop calls this between polls.
        let until = deadline.unwrap_or_else(Instant::now);
        let decoded = self.runtime.block_on(
            self.codec
                .decode_patiently::<GraphDefinition>(message.payload(), Some(until)),
        );
        let decoded = match decoded {
            Err(error) if error.is_retryable() => {
                if !self.registry_down {
                    self.registry_down = true;
                    tracing::warn!(topic = %self.topic, %error, "The schema registry is unreachable; graph definitions will be decoded again.");
                }
                self.pending = Some(message);
                return Err(Error::RegistryUnavailable {
                    topic: self.topic.clone(),
                    source: error,
                });
            }
            decoded => decoded,
        };
        if self.registry_down {
            self.registry_down = false;
            tracing::info!(topic = %self.topic, "The schema registry is reachable again.");
        }
        Ok(self.table.admit(&self.topic, &message, decoded))
    }
}
