//! Encoding and decoding in the Confluent wire format: magic byte `0`, the schema id as a
//! big-endian `u32`, then the Avro binary body. Schemas live in a registry under
//! TopicNameStrategy (`<topic>-value`).

use std::collections::HashMap;
use std::sync::{OnceLock, RwLock};
use std::time::Duration;

use apache_avro::{
    from_value, reader::datum::GenericDatumReader, types::Value, writer::datum::GenericDatumWriter,
    Schema,
};
use schema_registry_converter::{
    async_impl::{
        avro::{AvroDecoder, AvroEncoder},
        schema_registry::SrSettings,
    },
    error::SRCError,
    schema_registry_common::{SchemaType, SubjectNameStrategy, SuppliedSchema},
};

use crate::{records::Record, resolve::Resolver, RecordKind};

/// Where the registry is and whether this process may register schemas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodecConfig {
    /// Base URL of a Confluent-compatible schema registry, e.g. `http://127.0.0.1:8081`.
    pub registry_url: String,
    /// Register Sortie's schemas when missing (dev, tests). When false the subject's
    /// latest registered version is used, and it must be the schema this build knows.
    pub auto_register: bool,
}

/// Why a record could not be encoded.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    /// The registry could not be reached or answered 5xx; worth retrying.
    #[error("schema registry unavailable: {0}")]
    RegistryUnavailable(String),
    /// The registry refused the schema (incompatible, invalid) or the subject is missing.
    #[error("schema registry refused {subject}: {message}")]
    RegistryRefused { subject: String, message: String },
    /// The value does not fit its own schema: a defect in this crate.
    #[error("value does not fit schema {kind:?}: {message}")]
    Schema { kind: RecordKind, message: String },
}

impl EncodeError {
    pub fn is_retryable(&self) -> bool {
        matches!(self, EncodeError::RegistryUnavailable(_))
    }
}

/// Why bytes could not be turned into a record. Every variant but
/// [`DecodeError::RegistryUnavailable`] is final for those bytes: the caller dead-letters
/// the record with [`DecodeError::reason_code`] and moves on.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// No value at all (a tombstone) where a record was expected.
    #[error("record has no value")]
    Empty,
    /// Not magic byte 0 + 4-byte schema id + body.
    #[error("not in the Confluent wire format: {0}")]
    NotWireFormat(String),
    /// The schema id is unknown to the registry.
    #[error("unknown schema id: {0}")]
    UnknownSchema(String),
    /// Written with a schema of another record type.
    #[error("expected a {expected} record, found {found}")]
    WrongSchema { expected: String, found: String },
    /// The body does not decode with its writer schema, or cannot be read as this build's
    /// schema (an incompatible writer).
    #[error("malformed Avro body: {0}")]
    Malformed(String),
    /// The registry could not be reached; the bytes may be fine. Retry, do not dead-letter.
    #[error("schema registry unavailable: {0}")]
    RegistryUnavailable(String),
}

impl DecodeError {
    /// The `reason_code` of the dead letter for this error.
    pub fn reason_code(&self) -> &'static str {
        match self {
            DecodeError::Empty | DecodeError::NotWireFormat(_) | DecodeError::Malformed(_) => {
                "undecodable"
            }
            DecodeError::UnknownSchema(_) => "unknown_schema",
            DecodeError::WrongSchema { .. } => "wrong_schema",
            DecodeError::RegistryUnavailable(_) => "registry_unavailable",
        }
    }

    pub fn is_retryable(&self) -> bool {
        matches!(self, DecodeError::RegistryUnavailable(_))
    }
}

/// Encodes and decodes Sortie records through a schema registry.
///
/// `schema_registry_converter` caches failed look-ups and never retries them by itself, so
/// after a transient registry failure the codec clears those cached errors; callers
/// pre-register with [`Codec::prepare`] at start-up, which retries.
///
/// Encoding asks the registry once per topic and kind. When the subject's schema is this
/// build's (equal in Parsing Canonical Form, so the bytes are the same), later records are
/// written directly: the header with the cached id, then the datum through this build's
/// writer, whose names are resolved once per process. The converter's own path copied the
/// schema text, the subject and the resolved names on every record (7 % of the reducer's
/// CPU under load). A subject whose latest schema is another one (registration off, a
/// newer build registered first) keeps the converter's path, which writes with that schema.
pub struct Codec {
    encoder: AvroEncoder,
    decoder: AvroDecoder,
    auto_register: bool,
    routes: RwLock<HashMap<RecordKind, HashMap<String, Route>>>,
    /// Per schema id met while decoding: its writer schema, resolved once.
    writers: RwLock<HashMap<u32, &'static WriterSchema>>,
}

/// A writer's schema as decoding needs it. Leaked so that its datum reader can borrow it
/// for the life of the process: one per distinct schema (by Parsing Canonical Form) the
/// process ever reads, shared by all its codecs, so the leak is bounded by the schemas in
/// the registry.
struct WriterSchema {
    reader: GenericDatumReader<'static>,
    schema: &'static Schema,
    /// The full name of its type ("a non-record schema" when it has none).
    name: String,
    /// The record kind of that name, if it is one of Sortie's.
    kind: Option<RecordKind>,
    /// It is this build's schema of `kind`: the bytes deserialise straight into the
    /// record, with no `Value` in between and nothing to resolve.
    current: bool,
}

impl WriterSchema {
    fn of(schema: &Schema) -> Result<&'static WriterSchema, DecodeError> {
        static SEEN: OnceLock<std::sync::Mutex<HashMap<String, &'static WriterSchema>>> =
            OnceLock::new();
        let form = schema.canonical_form();
        let mut seen = SEEN
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(known) = seen.get(&form) {
            return Ok(known);
        }
        let schema: &'static Schema = Box::leak(Box::new(schema.clone()));
        let reader = GenericDatumReader::builder(schema)
            .build()
            .map_err(|e| DecodeError::UnknownSchema(format!("the writer's schema: {e}")))?;
        let name = schema
            .name()
            .map(|name| name.fullname(None))
            .unwrap_or_else(|| "a non-record schema".to_owned());
        let kind = RecordKind::ALL
            .into_iter()
            .find(|kind| kind.full_name() == name);
        let current = kind.is_some_and(|kind| schema == kind.schema());
        let writer: &'static WriterSchema = Box::leak(Box::new(WriterSchema {
            reader,
            schema,
            name,
            kind,
            current,
        }));
        seen.insert(form, writer);
        Ok(writer)
    }

    fn read<R: Record>(&self, mut body: &[u8]) -> Result<R, DecodeError> {
        if self.current && self.kind == Some(R::KIND) {
            return self
                .reader
                .read_deser(&mut body)
                .map_err(|e| DecodeError::Malformed(e.to_string()));
        }
        let value = self
            .reader
            .read_value(&mut body)
            .map_err(|e| DecodeError::Malformed(e.to_string()))?;
        value_to_record(value, self.schema)
    }
}

/// How records of a kind are encoded for a topic, once the registry has answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// The subject's schema is this build's: the header with this id, then the datum.
    Direct(u32),
    /// The subject's schema is another one: the converter writes with it.
    Registry,
}

impl std::fmt::Debug for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Codec")
            .field("auto_register", &self.auto_register)
            .finish_non_exhaustive()
    }
}

/// The most one Avro length or count may make the decoder allocate. No record is over
/// 1 MiB (`max.message.bytes`), so a length past this is a lie told to make the reader
/// allocate: refused as malformed (apache-avro's own default is 512 MiB a field).
pub const MAX_DECODE_ALLOCATION: usize = 8 * 1024 * 1024;

/// Sets [`MAX_DECODE_ALLOCATION`] for the process, before anything decodes (apache-avro
/// keeps the first value it is given).
fn bound_allocations() {
    apache_avro::util::max_allocation_bytes(MAX_DECODE_ALLOCATION);
}

impl Codec {
    pub fn new(config: &CodecConfig) -> Self {
        bound_allocations();
        let settings = || SrSettings::new(config.registry_url.trim_end_matches('/').to_owned());
        Self {
            encoder: AvroEncoder::new(settings()),
            decoder: AvroDecoder::new(settings()),
            auto_register: config.auto_register,
            routes: RwLock::new(HashMap::new()),
            writers: RwLock::new(HashMap::new()),
        }
    }

    fn strategy(&self, topic: &str, kind: RecordKind) -> SubjectNameStrategy {
        if self.auto_register {
            SubjectNameStrategy::TopicNameStrategyWithSchema(
                topic.to_owned(),
                false,
                SuppliedSchema::new(
                    Some(kind.full_name().to_owned()),
                    SchemaType::Avro,
                    kind.schema_text().to_owned(),
                ),
            )
        } else {
            SubjectNameStrategy::TopicNameStrategy(topic.to_owned(), false)
        }
    }

    /// Registers (or looks up) the value schema of `kind` for `topic` and returns its id,
    /// retrying transient registry failures until `patience` runs out.
    pub async fn prepare(
        &self,
        topic: &str,
        kind: RecordKind,
        patience: Duration,
    ) -> Result<u32, EncodeError> {
        let strategy = self.strategy(topic, kind);
        let deadline = tokio::time::Instant::now() + patience;
        let mut backoff = Duration::from_millis(100);
        loop {
            let subject = strategy
                .get_subject()
                .map_err(|e| encode_error(topic, kind, e))?;
            match self
                .encoder
                .get_schema_and_id(&subject, strategy.clone())
                .await
            {
                Ok(schema) => return Ok(schema.id),
                Err(e) => {
                    let error = encode_error(topic, kind, e);
                    self.encoder.remove_errors_from_cache();
                    if !error.is_retryable() || tokio::time::Instant::now() + backoff > deadline {
                        return Err(error);
                    }
                    tracing::warn!(topic, error = %error, "Schema registry not ready; retrying.");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    /// Encodes `record` for `topic` in the Confluent wire format.
    pub async fn encode<R: Record>(&self, topic: &str, record: &R) -> Result<Vec<u8>, EncodeError> {
        match self.route(topic, R::KIND).await? {
            Route::Direct(id) => {
                let mut bytes = Vec::with_capacity(256);
                bytes.push(0);
                bytes.extend_from_slice(&id.to_be_bytes());
                write_datum(&mut bytes, record)?;
                Ok(bytes)
            }
            Route::Registry => {
                let strategy = self.strategy(topic, R::KIND);
                let result = self.encoder.encode_struct(record, &strategy).await;
                result.map_err(|e| self.encode_failed(topic, R::KIND, e))
            }
        }
    }

    /// How `kind` is encoded for `topic`: asks the registry the first time (registering
    /// when allowed), then answers from memory. Errors are not remembered.
    async fn route(&self, topic: &str, kind: RecordKind) -> Result<Route, EncodeError> {
        let known = self
            .routes
            .read()
            .ok()
            .and_then(|routes| routes.get(&kind)?.get(topic).copied());
        if let Some(route) = known {
            return Ok(route);
        }
        let strategy = self.strategy(topic, kind);
        let subject = strategy
            .get_subject()
            .map_err(|e| encode_error(topic, kind, e))?;
        let registered = self
            .encoder
            .get_schema_and_id(&subject, strategy)
            .await
            .map_err(|e| self.encode_failed(topic, kind, e))?;
        let route = if registered.parsed == *kind.schema() {
            Route::Direct(registered.id)
        } else {
            tracing::info!(
                subject,
                id = registered.id,
                "The subject's schema is not this build's; encoding with the registered one."
            );
            Route::Registry
        };
        if let Ok(mut routes) = self.routes.write() {
            routes
                .entry(kind)
                .or_default()
                .insert(topic.to_owned(), route);
        }
        Ok(route)
    }

    /// Maps a converter error, clearing the converter's cached failure when it was
    /// transient so that the next record asks the registry again.
    fn encode_failed(&self, topic: &str, kind: RecordKind, e: SRCError) -> EncodeError {
        let error = encode_error(topic, kind, e);
        if error.is_retryable() {
            self.encoder.remove_errors_from_cache();
        }
        error
    }

    /// [`Codec::decode`], waiting out a registry outage: the bytes may be fine, and
    /// dead-lettering them because the registry is down would lose them. Retries with a
    /// backoff from 100 ms doubling to 5 s, until `until` (for ever when `None`); bytes
    /// that do not decode are answered at once. Past `until` the outage is returned
    /// ([`DecodeError::is_retryable`]) for the caller to keep the record pending.
    pub async fn decode_patiently<R: Record>(
        &self,
        bytes: Option<&[u8]>,
        until: Option<std::time::Instant>,
    ) -> Result<R, DecodeError> {
        let mut backoff = std::time::Duration::from_millis(100);
        loop {
            match self.decode::<R>(bytes).await {
                Err(error)
                    if error.is_retryable()
                        && until.is_none_or(|u| std::time::Instant::now() + backoff <= u) =>
                {
                    tracing::warn!(%error, ?backoff, kind = ?R::KIND, "The schema registry is unreachable; decoding again.");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(std::time::Duration::from_secs(5));
                }
                decoded => return decoded,
            }
        }
    }

    /// Decodes a Confluent wire-format value into `R`, resolving the writer's schema against
    /// this build's (so records written with an older compatible schema read fine).
    pub async fn decode<R: Record>(&self, bytes: Option<&[u8]>) -> Result<R, DecodeError> {
        let bytes = bytes.ok_or(DecodeError::Empty)?;
        if bytes.len() < 5 || bytes[0] != 0 {
            return Err(DecodeError::NotWireFormat(format!(
                "{} bytes, first byte {:?}",
                bytes.len(),
                bytes.first()
            )));
        }
        let id = u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]);
        let writer = self.writer_schema(id).await?;
        if writer.kind != Some(R::KIND) {
            return Err(DecodeError::WrongSchema {
                expected: R::KIND.full_name().to_owned(),
                found: writer.name.clone(),
            });
        }
        writer.read(&bytes[5..])
    }

    /// The writer schema of `id`: asked from the registry the first time, then from
    /// memory. Errors are not remembered.
    async fn writer_schema(&self, id: u32) -> Result<&'static WriterSchema, DecodeError> {
        let known = self
            .writers
            .read()
            .ok()
            .and_then(|writers| writers.get(&id).copied());
        if let Some(writer) = known {
            return Ok(writer);
        }
        let registered = self.decoder.get_schema(id).await.map_err(|e| {
            let error = decode_error(e);
            if error.is_retryable() {
                self.decoder.remove_errors_from_cache();
            }
            error
        })?;
        let writer = WriterSchema::of(&registered.parsed)?;
        if let Ok(mut writers) = self.writers.write() {
            writers.insert(id, writer);
        }
        Ok(writer)
    }
}

/// Resolves a value decoded with its writer's schema against this build's schema of `R`.
fn value_to_record<R: Record>(value: Value, writer: &Schema) -> Result<R, DecodeError> {
    let reader = R::KIND.schema();
    let value = if writer == reader {
        value
    } else {
        Resolver::new(writer, reader)
            .and_then(|resolver| resolver.resolve(value, writer, reader))
            .map_err(|e| {
                DecodeError::Malformed(format!("cannot read as this build's schema: {e}"))
            })?
    };
    from_value(&value).map_err(|e| DecodeError::Malformed(e.to_string()))
}

/// Encodes `record` as a bare Avro datum (no wire-format header) with this build's schema.
/// Used where the schema is known out of band: golden files, hashes, tests.
pub fn to_datum<R: Record>(record: &R) -> Result<Vec<u8>, EncodeError> {
    let mut bytes = Vec::new();
    write_datum(&mut bytes, record)?;
    Ok(bytes)
}

/// Appends `record`'s datum, written with this build's schema, to `bytes`.
fn write_datum<R: Record>(bytes: &mut Vec<u8>, record: &R) -> Result<(), EncodeError> {
    datum_writer(R::KIND)
        .write_ser(bytes, record)
        .map(drop)
        .map_err(|e| EncodeError::Schema {
            kind: R::KIND,
            message: e.to_string(),
        })
}

/// This build's writer for `kind`, its named types resolved once per process.
fn datum_writer(kind: RecordKind) -> &'static GenericDatumWriter<'static> {
    static WRITERS: OnceLock<Vec<GenericDatumWriter<'static>>> = OnceLock::new();
    let writers = WRITERS.get_or_init(|| {
        RecordKind::ALL
            .iter()
            .map(|kind| {
                GenericDatumWriter::builder(kind.schema())
                    .build()
                    .unwrap_or_else(|e| {
                        // The schemas are compiled in and parse (see `RecordKind::schema`);
                        // one whose names do not resolve is a build defect, not input.
                        panic!("schemas/{} does not resolve: {e}", kind.file())
                    })
            })
            .collect()
    });
    &writers[kind as usize]
}

/// Decodes a bare Avro datum written with `writer` into `R` (this build's schema).
pub fn from_datum<R: Record>(writer: &Schema, bytes: &[u8]) -> Result<R, DecodeError> {
    bound_allocations();
    WriterSchema::of(writer)?.read(bytes)
}

fn encode_error(topic: &str, kind: RecordKind, e: SRCError) -> EncodeError {
    let message = describe(&e);
    if e.retriable {
        EncodeError::RegistryUnavailable(message)
    } else if message.contains("Could not get Avro bytes") {
        EncodeError::Schema { kind, message }
    } else {
        EncodeError::RegistryRefused {
            subject: format!("{topic}-value"),
            message,
        }
    }
}

fn decode_error(e: SRCError) -> DecodeError {
    let message = describe(&e);
    if e.retriable {
        DecodeError::RegistryUnavailable(message)
    } else if message.contains("Could not transform bytes") {
        DecodeError::Malformed(message)
    } else {
        DecodeError::UnknownSchema(message)
    }
}

fn describe(e: &SRCError) -> String {
    match &e.cause {
        Some(cause) => format!("{}: {cause}", e.error),
        None => e.error.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records as w;

    /// A 14-byte body that claims its first string is 100 MiB long is refused, without
    /// the reader allocating what it claims (apache-avro's default would allow 512 MiB).
    #[test]
    fn a_length_past_the_allocation_bound_is_refused() {
        // Zig-zag varint of 100 MiB, then a few bytes.
        let claimed: u64 = 100 * 1024 * 1024;
        let mut zigzag = claimed << 1;
        let mut body = Vec::new();
        while zigzag >= 0x80 {
            body.push((zigzag as u8) | 0x80);
            zigzag >>= 7;
        }
        body.push(zigzag as u8);
        body.extend_from_slice(b"abcdefgh");
        let refused = from_datum::<w::RunCommand>(RecordKind::RunCommand.schema(), &body);
        let message = format!("{refused:?}");
        assert!(refused.is_err(), "{message}");
        assert_eq!(
            apache_avro::util::max_allocation_bytes(0),
            MAX_DECODE_ALLOCATION,
            "the bound is in force"
        );
    }
}
