//! The graph registry (SPEC §4.1): publishing mission graphs to `sortie.graphs` and the
//! global table every reducer and gateway builds from it.
//!
//! `sortie.graphs` is compacted and keyed `graph_id@version`, or `tenant/graph_id@version`
//! for a graph that belongs to one tenant (the record's `tenant`; see
//! `sortie_core::Graphs` for how starts resolve them). Versions are immutable: a
//! publisher reads the table first and refuses a different definition for a version that
//! exists, and the table keeps the first definition it reads for a version and skips any
//! later, different one. The table reads every partition from the beginning,
//! `read_committed`, with `assign()` and no group membership, so every instance sees every
//! graph and nothing is ever committed.
//!
//! Two publishers racing on the same new version can both pass the check; the table then
//! keeps the lower offset, while compaction keeps the latest record per key. Publishing is
//! an operator action (one CLI at a time), so this is accepted rather than guarded.
//!
//! **Signed graphs.** A graph's gates, roles, receiver URLs and side-effect classes are a
//! trust root: whoever writes `sortie.graphs` decides what runs ungated. A publication is
//! signed like a command (`sortie_wire::signing`: headers over the record's exact value
//! bytes) by a key with `publisher: true`, as the record's `published_by`, for its tenant.
//! With a [`Trust`], a table refuses a record whose signature does not hold, and with
//! `require` an unsigned one too — skipped, logged and counted like any untrustworthy
//! record, never fatal. A refused record never takes a version: a signed definition read
//! later still gets it. The keyring is the one in the table's [`Trust`] when the record is
//! read; a key withdrawn later refuses its graphs to readers that start afterwards (sign
//! the versions you keep again with a current key: `publish` does, as the same definition).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, Headers, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Message, Offset, TopicPartitionList};
use sortie_core::graph::InvalidGraph;
use sortie_core::{Graph, Graphs};
use sortie_kafka::read::{self, ReaderContext};
use sortie_kafka::KafkaConfig;
use sortie_wire::records::GraphDefinition;
use sortie_wire::signing::{Keyring, Signer};
use sortie_wire::{Codec, DecodeError, EncodeError, Topics};
use tokio::runtime::Handle;

/// How long [`publish`] may take to read the current table and to deliver its record.
const PUBLISH_PATIENCE: Duration = Duration::from_secs(30);
/// How long opening the table may wait for the topic's metadata.
const METADATA_TIMEOUT: Duration = Duration::from_secs(10);
/// librdkafka needs a `group.id` for `assign()`; the table never joins it or commits.
const THROWAWAY_GROUP: &str = "sortie-graph-table";

/// Why publishing, reading or loading graphs failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The version exists with another definition; a changed graph needs a new version.
    #[error(
        "{key} is already published with a different definition; published versions are \
         immutable, so give the changed graph a new version"
    )]
    VersionExists { key: String },
    /// A version that does not fit the wire format's `int`.
    #[error("{key}: version {version} is too large (at most {max})", max = i32::MAX)]
    VersionOutOfRange { key: String, version: u32 },
    /// A graph file or folder could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A graph file does not parse or does not validate; every problem is listed.
    #[error("{}: {source}", path.display())]
    InvalidFile { path: PathBuf, source: InvalidGraph },
    /// The graphs topic does not exist.
    #[error("topic {0} does not exist; create it with `sortie topology apply`")]
    MissingTopic(String),
    #[error("kafka failed while {doing}: {source}")]
    Kafka { doing: String, source: KafkaError },
    #[error("cannot encode the graph definition: {0}")]
    Encode(#[from] EncodeError),
    /// The schema registry stayed unreachable; the record is kept and decoded again later.
    #[error("cannot decode graph definitions from {topic}: {source}")]
    RegistryUnavailable { topic: String, source: DecodeError },
    /// The signing key or keyring could not be used.
    #[error("signing: {0}")]
    Signing(String),
    #[error("timed out after {timeout:?} reading {topic} up to the offsets captured at the start")]
    Timeout { topic: String, timeout: Duration },
    /// The runtime shut down while the table was being read.
    #[error("reading {0} was cancelled")]
    Cancelled(String),
    /// An MCP server's tools could not be listed for pinning.
    #[error("{key}: listing the tools of MCP server {server} failed: {source}")]
    McpList {
        key: String,
        server: String,
        source: sortie_mcp::Error,
    },
    /// An MCP server's auth names a variable that is no secret (`SORTIE_SECRET_…`).
    #[error("{key}: MCP server {server}: auth.env {env} is not a secret variable (SORTIE_SECRET_<tenant>__<NAME>); it is not read")]
    McpSecretName {
        key: String,
        server: String,
        env: String,
    },
    /// The environment variable an MCP server's auth names is not set for the publisher.
    #[error("{key}: MCP server {server} needs the environment variable {env} (its auth) to list its tools")]
    McpSecret {
        key: String,
        server: String,
        env: String,
    },
    /// The pinned list does not make a valid graph (a tool the graph offers is missing,
    /// a name clashes with a node, a listing over the bounds).
    #[error("{key}: with the tools its MCP servers list: {source}")]
    McpPinned { key: String, source: InvalidGraph },
}

fn kafka_error(doing: impl Into<String>) -> impl FnOnce(KafkaError) -> Error {
    let doing = doing.into();
    move |source| Error::Kafka { doing, source }
}

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

/// Which graph records a table takes: those a publisher key of `keyring` signed; with
/// `require`, unsigned ones are refused too (a present but bad signature always is).
#[derive(Debug, Clone, Default)]
pub struct Trust {
    pub keyring: Keyring,
    pub require: bool,
}

impl Trust {
    /// The key that signed `message` (decoded as `record`), or why it is not trusted.
    fn check(
        &self,
        message: &OwnedMessage,
        record: &GraphDefinition,
    ) -> Result<Option<String>, String> {
        let headers = message.headers();
        let pairs = headers
            .into_iter()
            .flat_map(|h| h.iter().map(|header| (header.key, header.value)));
        match self.keyring.check_graph(
            pairs,
            message.payload().unwrap_or_default(),
            record.tenant.as_deref(),
            &record.published_by,
        ) {
            Ok(None) if self.require => {
                Err("it is not signed, and signed graphs are required".into())
            }
            Ok(signed) => Ok(signed),
            Err(reason) => Err(format!("its signature does not hold: {reason}")),
        }
    }
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

/// How long listing one MCP server's tools may take when pinning.
const MCP_LIST_TIMEOUT: Duration = Duration::from_secs(30);

/// `graph` with the tool list of every MCP server it offers pinned (see
/// `sortie_core::mcp`): `tools/list` is read now, bounded, and the offered tools'
/// names, descriptions and input schemas are written into the definition with their hash.
/// A graph with nothing to pin comes back as it is. The auth header's value is read from
/// the publisher's environment, as the executor reads it from its own.
pub async fn pin(graph: &Graph) -> Result<Graph, Error> {
    let key = graph.key();
    let mut pinned = graph.clone();
    for (server_name, wanted) in graph.mcp_tools_to_pin() {
        let Some(server) = graph
            .mcp_servers
            .iter()
            .find(|s| s.name == server_name && s.pinned.is_none())
        else {
            continue;
        };
        let mut headers = Vec::new();
        if let Some(auth) = &server.auth {
            // Only a secret variable is ever sent (`sortie_core::secret`): a graph file must
            // not make its publisher send `HOME` or a cloud key to the graph's own URL.
            if !auth.env.starts_with(sortie_core::secret::PREFIX) {
                return Err(Error::McpSecretName {
                    key: key.clone(),
                    server: server.name.clone(),
                    env: auth.env.clone(),
                });
            }
            let secret = std::env::var(&auth.env).map_err(|_| Error::McpSecret {
                key: key.clone(),
                server: server.name.clone(),
                env: auth.env.clone(),
            })?;
            let value = match &auth.scheme {
                Some(scheme) => format!("{scheme} {secret}"),
                None => secret,
            };
            headers.push((auth.header.clone(), value));
        }
        let endpoint = sortie_mcp::Endpoint {
            url: server.url.clone(),
            headers,
        };
        let listed = sortie_mcp::list_tools(
            &endpoint,
            sortie_core::mcp::MAX_PINNED_TOOLS,
            MCP_LIST_TIMEOUT,
        )
        .await
        .map_err(|source| Error::McpList {
            key: key.clone(),
            server: server.name.clone(),
            source,
        })?;
        // Only the offered tools are pinned, in the server's order.
        let tools: Vec<_> = listed
            .into_iter()
            .filter(|t| wanted.as_ref().is_none_or(|w| w.contains(&t.name)))
            .collect();
        if let Some(wanted) = &wanted {
            if let Some(missing) = wanted.iter().find(|w| !tools.iter().any(|t| &t.name == *w)) {
                return Err(Error::McpPinned {
                    key,
                    source: InvalidGraph(vec![sortie_core::GraphError {
                        node: None,
                        problem: format!(
                            "mcp server {:?} does not list the offered tool {missing:?}",
                            server.name
                        ),
                    }]),
                });
            }
        }
        tracing::info!(
            graph = %key,
            server = %server.name,
            tools = tools.len(),
            "Pinned an MCP server's tools into the graph version."
        );
        pinned = pinned
            .with_pinned(&server.name, sortie_core::mcp::Pinned::new(tools))
            .map_err(|source| Error::McpPinned {
                key: key.clone(),
                source,
            })?;
    }
    Ok(pinned)
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

/// Parses and validates one graph file (YAML or JSON).
pub fn load_file(path: impl AsRef<Path>) -> Result<Graph, Error> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_owned(),
        source,
    })?;
    Graph::parse(&text).map_err(|source| Error::InvalidFile {
        path: path.to_owned(),
        source,
    })
}

/// Parses every `*.yaml`, `*.yml` and `*.json` file in a folder (not recursive), in file
/// name order. The first invalid file fails the whole load, naming the file and its
/// problems.
pub fn load_dir(path: impl AsRef<Path>) -> Result<Vec<Graph>, Error> {
    let dir = path.as_ref();
    let io = |source| Error::Io {
        path: dir.to_owned(),
        source,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        let graph_file = path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"));
        if graph_file && path.is_file() {
            files.push(path);
        }
    }
    files.sort();
    files.iter().map(load_file).collect()
}

// ---------------------------------------------------------------- the table

/// The fold of graph records into published graphs, shared by [`publish`] and
/// [`GraphTable`].
#[derive(Debug, Default)]
struct Table {
    graphs: Graphs,
    publications: BTreeMap<String, Publication>,
    skipped: usize,
    /// Records skipped because their signature did not hold or was missing.
    untrusted: usize,
    /// Whose graphs are taken (`None`: signatures are not read).
    trust: Option<Trust>,
}

impl Table {
    /// Folds one record in; true when it added a graph version. A record that cannot be
    /// trusted is skipped with a warning and counted, never fatal.
    fn admit(
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

// ---------------------------------------------------------------- the reader

enum Polled {
    Message(OwnedMessage),
    /// An event (end of partition, a transient error) but no record.
    Other,
    Nothing,
}

/// An assigned, never-committing `read_committed` consumer over every partition of a topic,
/// tracking how far each partition has been read.
struct Reader {
    consumer: BaseConsumer<ReaderContext>,
    topic: String,
    /// Per partition: every offset below this has been read (or does not exist).
    next: BTreeMap<i32, i64>,
}

impl Reader {
    fn open(kafka: &KafkaConfig, topic: &str) -> Result<Self, Error> {
        let consumer: BaseConsumer<ReaderContext> = kafka
            .client()
            .set("group.id", THROWAWAY_GROUP)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "true")
            .set("isolation.level", "read_committed")
            .set("auto.offset.reset", "earliest")
            .create_with_context(ReaderContext)
            .map_err(kafka_error("creating a consumer"))?;
        let partitions = read::partition_ids(consumer.client(), topic, METADATA_TIMEOUT)
            .map_err(kafka_error(format!("fetching the metadata of {topic}")))?;
        if partitions.is_empty() {
            return Err(Error::MissingTopic(topic.to_owned()));
        }
        let mut assignment = TopicPartitionList::new();
        for &partition in &partitions {
            assignment
                .add_partition_offset(topic, partition, Offset::Beginning)
                .map_err(kafka_error(format!("assigning {topic}")))?;
        }
        consumer
            .assign(&assignment)
            .map_err(kafka_error(format!("assigning {topic}")))?;
        Ok(Self {
            consumer,
            topic: topic.to_owned(),
            next: partitions.into_iter().map(|p| (p, 0)).collect(),
        })
    }

    fn poll(&mut self, timeout: Duration) -> Polled {
        match self.consumer.poll(timeout) {
            None => Polled::Nothing,
            Some(Ok(message)) => {
                let next = self.next.entry(message.partition()).or_insert(0);
                *next = (*next).max(message.offset() + 1);
                Polled::Message(message.detach())
            }
            Some(Err(KafkaError::PartitionEOF(partition))) => {
                // At the end the position may be past the last record (transaction markers,
                // compacted gaps); it is where the next fetch starts.
                let position = self.consumer.position().ok().and_then(|list| {
                    match list.find_partition(&self.topic, partition)?.offset() {
                        Offset::Offset(offset) => Some(offset),
                        _ => None,
                    }
                });
                if let Some(offset) = position {
                    let next = self.next.entry(partition).or_insert(0);
                    *next = (*next).max(offset);
                }
                Polled::Other
            }
            Some(Err(error)) => {
                tracing::warn!(topic = %self.topic, %error, "Reading the graphs topic failed; reading on.");
                Polled::Other
            }
        }
    }

    /// Reads every record up to the ends of the moment (last stable offsets: graphs are
    /// published without transactions, so they are the high watermarks), handing each to `f`.
    fn read_to_end(
        &mut self,
        deadline: Instant,
        timeout: Duration,
        mut f: impl FnMut(OwnedMessage) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let marks = read::watermarks(
            &self.consumer,
            &self.topic,
            self.next.keys().copied(),
            deadline,
        )
        .map_err(kafka_error(format!(
            "fetching the offsets of {}",
            self.topic
        )))?;
        // Nothing below the log start offset exists any more.
        let spans = marks
            .iter()
            .map(|(&p, &(low, high))| (p, (self.next.get(&p).copied().unwrap_or(0).max(low), high)))
            .collect();
        let reached = read::to_end(&self.consumer, &self.topic, &spans, deadline, |message| {
            f(message.detach()).map(|()| read::Next::More)
        })
        .map_err(|e| match e {
            read::ReadError::Handler(e) => e,
            read::ReadError::Kafka(source) => Error::Kafka {
                doing: format!("reading {}", self.topic),
                source,
            },
            read::ReadError::Timeout { .. } => Error::Timeout {
                topic: self.topic.clone(),
                timeout,
            },
        })?;
        for (partition, next) in reached {
            let at = self.next.entry(partition).or_insert(0);
            *at = (*at).max(next);
        }
        Ok(())
    }
}
