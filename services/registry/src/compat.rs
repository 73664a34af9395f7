//! Compatibility levels and the check behind them, as the Confluent registry defines them.

use std::fmt;
use std::str::FromStr;

use apache_avro::schema_compatibility::{Compatibility, SchemaCompatibility};
use apache_avro::Schema;
use serde::{Deserialize, Serialize};

/// A subject's (or the registry's) compatibility level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Level {
    None,
    #[default]
    Backward,
    BackwardTransitive,
    Forward,
    ForwardTransitive,
    Full,
    FullTransitive,
}

impl Level {
    pub const ALL: [Level; 7] = [
        Level::None,
        Level::Backward,
        Level::BackwardTransitive,
        Level::Forward,
        Level::ForwardTransitive,
        Level::Full,
        Level::FullTransitive,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Level::None => "NONE",
            Level::Backward => "BACKWARD",
            Level::BackwardTransitive => "BACKWARD_TRANSITIVE",
            Level::Forward => "FORWARD",
            Level::ForwardTransitive => "FORWARD_TRANSITIVE",
            Level::Full => "FULL",
            Level::FullTransitive => "FULL_TRANSITIVE",
        }
    }

    fn transitive(self) -> bool {
        matches!(
            self,
            Level::BackwardTransitive | Level::ForwardTransitive | Level::FullTransitive
        )
    }

    /// The new schema must read data written with the old ones.
    fn backward(self) -> bool {
        matches!(
            self,
            Level::Backward | Level::BackwardTransitive | Level::Full | Level::FullTransitive
        )
    }

    /// The old schemas must read data written with the new one.
    fn forward(self) -> bool {
        matches!(
            self,
            Level::Forward | Level::ForwardTransitive | Level::Full | Level::FullTransitive
        )
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Level {
    type Err = String;

    /// Case-insensitive, like the Confluent registry.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Level::ALL
            .into_iter()
            .find(|level| level.as_str().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| {
                format!(
                    "Invalid compatibility level {s:?}; valid values are {}",
                    Level::ALL.map(Level::as_str).join(", ")
                )
            })
    }
}

/// One existing version to check a candidate against.
#[derive(Debug, Clone, Copy)]
pub struct Existing<'a> {
    pub version: u32,
    pub schema: &'a Schema,
}

/// Checks `candidate` against `existing` (oldest first) under `level`, returning why it is
/// incompatible; an empty answer means compatible.
///
/// Non-transitive levels look at the newest existing version only. Only a full resolution
/// counts: apache-avro's `Partial` (some enum symbols or union branches missing) is a
/// failure, as it is for the Confluent registry, because some data could not be read.
pub fn check(level: Level, candidate: &Schema, existing: &[Existing<'_>]) -> Vec<String> {
    let against: &[Existing<'_>] = if level.transitive() {
        existing
    } else {
        match existing.split_last() {
            Some((last, _)) => std::slice::from_ref(last),
            None => &[],
        }
    };
    let mut messages = Vec::new();
    for old in against {
        if level.backward() {
            if let Some(reason) = can_read(old.schema, candidate) {
                messages.push(format!(
                    "the new schema cannot read data written with version {}: {reason}",
                    old.version
                ));
            }
        }
        if level.forward() {
            if let Some(reason) = can_read(candidate, old.schema) {
                messages.push(format!(
                    "version {} cannot read data written with the new schema: {reason}",
                    old.version
                ));
            }
        }
    }
    messages
}

/// `None` when `reader` can read everything `writer` wrote, else the reason.
fn can_read(writer: &Schema, reader: &Schema) -> Option<String> {
    match SchemaCompatibility::can_read(writer, reader) {
        Ok(Compatibility::Full) => None,
        Ok(Compatibility::Partial) => Some(
            "only partially compatible (some enum symbols or union branches are missing)"
                .to_owned(),
        ),
        Err(error) => Some(error.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Schema {
        Schema::parse_str(s).expect("test schema parses")
    }

    const V1: &str = r#"{"type":"record","name":"R","fields":[{"name":"a","type":"string"}]}"#;
    const V2_DEFAULT: &str = r#"{"type":"record","name":"R","fields":[{"name":"a","type":"string"},{"name":"b","type":"int","default":0}]}"#;
    const V2_NO_DEFAULT: &str = r#"{"type":"record","name":"R","fields":[{"name":"a","type":"string"},{"name":"b","type":"int"}]}"#;
    const V3_DROP_A: &str =
        r#"{"type":"record","name":"R","fields":[{"name":"b","type":"int","default":0}]}"#;

    #[test]
    fn levels_parse_case_insensitively_and_print_like_confluent() {
        for level in Level::ALL {
            assert_eq!(level.as_str().to_lowercase().parse::<Level>(), Ok(level));
            assert_eq!(
                serde_json::to_string(&level).expect("serialises"),
                format!("\"{level}\"")
            );
        }
        assert!("SIDEWAYS".parse::<Level>().is_err());
        assert_eq!(Level::default(), Level::Backward);
    }

    #[test]
    fn backward_needs_defaults_for_new_fields() {
        let v1 = parse(V1);
        let existing = [Existing {
            version: 1,
            schema: &v1,
        }];
        assert!(check(Level::Backward, &parse(V2_DEFAULT), &existing).is_empty());
        assert_eq!(
            check(Level::Backward, &parse(V2_NO_DEFAULT), &existing).len(),
            1
        );
        // Adding a field without a default is forward compatible: old readers ignore it.
        assert!(check(Level::Forward, &parse(V2_NO_DEFAULT), &existing).is_empty());
        assert!(check(Level::None, &parse(V2_NO_DEFAULT), &existing).is_empty());
        assert!(check(Level::Full, &parse(V2_DEFAULT), &existing).is_empty());
        assert!(!check(Level::Full, &parse(V2_NO_DEFAULT), &existing).is_empty());
    }

    #[test]
    fn transitive_levels_check_every_version() {
        let v1 = parse(V1);
        let v2 = parse(V2_DEFAULT);
        let existing = [
            Existing {
                version: 1,
                schema: &v1,
            },
            Existing {
                version: 2,
                schema: &v2,
            },
        ];
        // v3 drops the default of b: it reads v2 data (which has b) but not v1 data.
        let v3 = parse(V2_NO_DEFAULT);
        assert!(check(Level::Backward, &v3, &existing).is_empty());
        assert_eq!(check(Level::BackwardTransitive, &v3, &existing).len(), 1);
        // Dropping a (which has no default) breaks forward compatibility with both.
        let v4 = parse(V3_DROP_A);
        assert_eq!(check(Level::Forward, &v4, &existing).len(), 1);
        assert_eq!(check(Level::ForwardTransitive, &v4, &existing).len(), 2);
        assert_eq!(check(Level::FullTransitive, &v4, &existing).len(), 2);
    }
}
