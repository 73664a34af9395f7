//! The records of the schemas topic, in the Confluent registry's own `_schemas` format:
//! JSON keys and values, so `kafka-console-consumer` shows them and a Confluent `_schemas`
//! topic replays here.
//!
//! Keys are serialised with a fixed field order: compaction compares key bytes, so the
//! same logical key must always produce the same bytes.

use std::sync::Arc;

use apache_avro::Schema;
use serde::{Deserialize, Serialize};

use crate::compat::Level;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "keytype")]
enum Key {
    #[serde(rename = "SCHEMA")]
    Schema {
        subject: String,
        version: u32,
        magic: u32,
    },
    #[serde(rename = "CONFIG")]
    Config {
        #[serde(default)]
        subject: Option<String>,
        magic: u32,
    },
    /// NOOP, DELETE_SUBJECT, MODE, ... written by a Confluent registry: nothing to apply.
    #[serde(other)]
    Other,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SchemaValue {
    subject: String,
    version: u32,
    id: u32,
    schema: String,
    #[serde(default)]
    deleted: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    schema_type: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ConfigValue {
    compatibility_level: Level,
}

/// A schema as the registry keeps it: the parsed form and its canonical text.
///
/// The canonical text is apache-avro's full JSON rendering of the parsed schema (not the
/// Parsing Canonical Form, which drops defaults and docs that compatibility needs). Two
/// submissions that differ only in whitespace or key order get the same text, hence the
/// same id.
#[derive(Debug, Clone)]
pub struct Canonical {
    pub text: Arc<str>,
    pub parsed: Arc<Schema>,
}

impl Canonical {
    pub fn parse(text: &str) -> Result<Canonical, String> {
        let parsed = Schema::parse_str(text).map_err(|e| with_sources(&e))?;
        let text = serde_json::to_string(&parsed).map_err(|e| e.to_string())?;
        Ok(Canonical {
            text: text.into(),
            parsed: Arc::new(parsed),
        })
    }
}

/// One change to the registry's state: what is written to the topic and what replay applies.
#[derive(Debug, Clone)]
pub enum Record {
    /// A subject version. `schema == None` is a tombstone (a permanent delete by a Confluent
    /// registry; this one never writes them).
    Version {
        subject: String,
        version: u32,
        schema: Option<VersionValue>,
    },
    /// A compatibility level; `subject == None` is the global one, `level == None` removes it.
    Config {
        subject: Option<String>,
        level: Option<Level>,
    },
}

#[derive(Debug, Clone)]
pub struct VersionValue {
    pub id: u32,
    pub schema: Canonical,
    pub deleted: bool,
}

impl Record {
    /// The key and value bytes (`None`: a tombstone).
    pub fn encode(&self) -> (Vec<u8>, Option<Vec<u8>>) {
        let (key, value) = match self {
            Record::Version {
                subject,
                version,
                schema,
            } => (
                Key::Schema {
                    subject: subject.clone(),
                    version: *version,
                    magic: 1,
                },
                schema.as_ref().map(|v| {
                    to_vec(&SchemaValue {
                        subject: subject.clone(),
                        version: *version,
                        id: v.id,
                        schema: v.schema.text.to_string(),
                        deleted: v.deleted,
                        schema_type: None,
                    })
                }),
            ),
            Record::Config { subject, level } => (
                Key::Config {
                    subject: subject.clone(),
                    magic: 0,
                },
                level.map(|level| {
                    to_vec(&ConfigValue {
                        compatibility_level: level,
                    })
                }),
            ),
        };
        (to_vec(&key), value)
    }

    /// Decodes a record read from the topic. `Ok(None)`: a record of a kind this registry
    /// does not keep (Confluent's NOOP, DELETE_SUBJECT, MODE keys, non-Avro schemas).
    pub fn decode(key: Option<&[u8]>, value: Option<&[u8]>) -> Result<Option<Record>, String> {
        let Some(key) = key else {
            return Ok(None);
        };
        let key: Key = match serde_json::from_slice(key) {
            Ok(key) => key,
            Err(e) => return Err(format!("the key is not a registry key: {e}")),
        };
        match key {
            Key::Other => Ok(None),
            Key::Schema {
                subject, version, ..
            } => {
                let Some(value) = value else {
                    return Ok(Some(Record::Version {
                        subject,
                        version,
                        schema: None,
                    }));
                };
                let value: SchemaValue = serde_json::from_slice(value)
                    .map_err(|e| format!("the schema value is not valid: {e}"))?;
                if value.schema_type.as_deref().is_some_and(|t| t != "AVRO") {
                    return Ok(None);
                }
                if value.subject != subject || value.version != version {
                    return Err(format!(
                        "the value ({}, version {}) does not match the key ({subject}, version {version})",
                        value.subject, value.version
                    ));
                }
                let schema = Canonical::parse(&value.schema)
                    .map_err(|e| format!("the schema of id {} does not parse: {e}", value.id))?;
                Ok(Some(Record::Version {
                    subject,
                    version,
                    schema: Some(VersionValue {
                        id: value.id,
                        schema,
                        deleted: value.deleted,
                    }),
                }))
            }
            Key::Config { subject, .. } => {
                let level = match value {
                    None => None,
                    Some(value) => {
                        let value: ConfigValue = serde_json::from_slice(value)
                            .map_err(|e| format!("the config value is not valid: {e}"))?;
                        Some(value.compatibility_level)
                    }
                };
                Ok(Some(Record::Config { subject, level }))
            }
        }
    }
}

/// An error and its causes, `: `-separated (apache-avro's messages alone are terse).
fn with_sources(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

fn to_vec<T: Serialize>(value: &T) -> Vec<u8> {
    // These types hold only strings, integers, booleans and enums: serialising cannot fail.
    serde_json::to_vec(value).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_have_confluents_exact_bytes() {
        let schema = Canonical::parse(r#"{"type": "string"}"#).expect("parses");
        let record = Record::Version {
            subject: "t-value".into(),
            version: 2,
            schema: Some(VersionValue {
                id: 7,
                schema,
                deleted: false,
            }),
        };
        let (key, value) = record.encode();
        assert_eq!(
            String::from_utf8_lossy(&key),
            r#"{"keytype":"SCHEMA","subject":"t-value","version":2,"magic":1}"#
        );
        assert_eq!(
            String::from_utf8_lossy(value.as_deref().expect("a value")),
            r#"{"subject":"t-value","version":2,"id":7,"schema":"\"string\"","deleted":false}"#
        );
        let (key, value) = Record::Config {
            subject: None,
            level: Some(Level::Full),
        }
        .encode();
        assert_eq!(
            String::from_utf8_lossy(&key),
            r#"{"keytype":"CONFIG","subject":null,"magic":0}"#
        );
        assert_eq!(
            String::from_utf8_lossy(value.as_deref().expect("a value")),
            r#"{"compatibilityLevel":"FULL"}"#
        );
    }

    #[test]
    fn records_round_trip_and_foreign_keys_are_skipped() {
        let (key, value) = Record::Config {
            subject: Some("s".into()),
            level: Some(Level::ForwardTransitive),
        }
        .encode();
        match Record::decode(Some(&key), value.as_deref()) {
            Ok(Some(Record::Config { subject, level })) => {
                assert_eq!(subject.as_deref(), Some("s"));
                assert_eq!(level, Some(Level::ForwardTransitive));
            }
            other => panic!("unexpected {other:?}"),
        }
        let noop = br#"{"keytype":"NOOP","magic":0}"#;
        assert!(matches!(Record::decode(Some(noop), None), Ok(None)));
        assert!(Record::decode(Some(b"not json"), None).is_err());
    }

    #[test]
    fn canonical_text_ignores_layout_but_keeps_defaults() {
        let a = Canonical::parse(
            r#"{"type":"record","name":"R","fields":[{"name":"a","type":"int","default":1}]}"#,
        )
        .expect("parses");
        let b = Canonical::parse(
            "{ \"fields\": [ {\"default\": 1, \"type\": \"int\", \"name\": \"a\"} ],\n \"name\": \"R\", \"type\": \"record\" }",
        )
        .expect("parses");
        assert_eq!(a.text, b.text);
        assert!(a.text.contains("\"default\":1"), "{}", a.text);
    }
}
