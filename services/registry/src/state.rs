//! The registry's in-memory state: a pure fold of the schemas topic. Writes are planned
//! here as records and applied here after Kafka confirms them, through the same
//! [`State::apply`] that replay uses, so a restart rebuilds exactly the same state.

use std::collections::{BTreeMap, HashMap};

use crate::compat::{self, Existing, Level};
use crate::record::{Canonical, Record, VersionValue};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VersionEntry {
    pub id: u32,
    pub deleted: bool,
}

#[derive(Debug, Default)]
pub struct State {
    global: Option<Level>,
    subject_levels: BTreeMap<String, Level>,
    /// Every schema ever registered, by global id. Soft deletes never remove one: an id
    /// found in old Kafka messages must always resolve.
    schemas: BTreeMap<u32, Canonical>,
    by_text: HashMap<std::sync::Arc<str>, u32>,
    subjects: BTreeMap<String, BTreeMap<u32, VersionEntry>>,
}

/// How a registration request ends.
#[derive(Debug)]
pub enum Registration {
    /// The subject already has this schema (a live version): nothing to write.
    Existing { id: u32, version: u32 },
    /// Write this record; the schema gets `id` as `version`.
    New {
        id: u32,
        version: u32,
        record: Record,
    },
    /// The compatibility level refuses it.
    Incompatible { level: Level, messages: Vec<String> },
}

impl State {
    pub fn apply(&mut self, record: Record) {
        match record {
            Record::Version {
                subject,
                version,
                schema:
                    Some(VersionValue {
                        id,
                        schema,
                        deleted,
                    }),
            } => {
                // With a single writer an id never changes meaning; if a foreign log ever
                // held two texts for one id, the first one stays.
                self.by_text.entry(schema.text.clone()).or_insert(id);
                self.schemas.entry(id).or_insert(schema);
                self.subjects
                    .entry(subject)
                    .or_default()
                    .insert(version, VersionEntry { id, deleted });
            }
            Record::Version {
                subject,
                version,
                schema: None,
            } => {
                if let Some(versions) = self.subjects.get_mut(&subject) {
                    versions.remove(&version);
                    if versions.is_empty() {
                        self.subjects.remove(&subject);
                    }
                }
            }
            Record::Config {
                subject: None,
                level,
            } => self.global = level,
            Record::Config {
                subject: Some(subject),
                level: Some(level),
            } => {
                self.subject_levels.insert(subject, level);
            }
            Record::Config {
                subject: Some(subject),
                level: None,
            } => {
                self.subject_levels.remove(&subject);
            }
        }
    }

    pub fn next_id(&self) -> u32 {
        self.schemas.keys().next_back().map_or(1, |max| max + 1)
    }

    /// The global level as configured (`None`: never set, or reset to the default).
    pub fn global_level_setting(&self) -> Option<Level> {
        self.global
    }

    pub fn global_level(&self) -> Level {
        self.global.unwrap_or_default()
    }

    pub fn subject_level(&self, subject: &str) -> Option<Level> {
        self.subject_levels.get(subject).copied()
    }

    pub fn effective_level(&self, subject: &str) -> Level {
        self.subject_level(subject)
            .unwrap_or_else(|| self.global_level())
    }

    pub fn schema(&self, id: u32) -> Option<&Canonical> {
        self.schemas.get(&id)
    }

    /// Subjects with at least one live version (or any version with `deleted`).
    pub fn subjects(&self, deleted: bool) -> Vec<String> {
        self.subjects
            .iter()
            .filter(|(_, versions)| deleted || versions.values().any(|v| !v.deleted))
            .map(|(subject, _)| subject.clone())
            .collect()
    }

    /// The subject's versions, oldest first; `None` when it has none to show.
    pub fn versions(&self, subject: &str, deleted: bool) -> Option<Vec<(u32, VersionEntry)>> {
        let versions: Vec<(u32, VersionEntry)> = self
            .subjects
            .get(subject)?
            .iter()
            .filter(|(_, entry)| deleted || !entry.deleted)
            .map(|(version, entry)| (*version, *entry))
            .collect();
        (!versions.is_empty()).then_some(versions)
    }

    /// Where a schema id is used: `(subject, version)` pairs of live versions.
    pub fn usages(&self, id: u32, deleted: bool) -> Vec<(String, u32)> {
        self.subjects
            .iter()
            .flat_map(|(subject, versions)| {
                versions
                    .iter()
                    .filter(move |(_, entry)| entry.id == id && (deleted || !entry.deleted))
                    .map(move |(version, _)| (subject.clone(), *version))
            })
            .collect()
    }

    /// The live version of `subject` holding exactly this schema.
    pub fn find(&self, subject: &str, schema: &Canonical) -> Option<(u32, u32)> {
        let id = *self.by_text.get(&schema.text)?;
        self.subjects
            .get(subject)?
            .iter()
            .find(|(_, entry)| entry.id == id && !entry.deleted)
            .map(|(version, _)| (*version, id))
    }

    /// Why `candidate` may not be added to `subject` under its level (empty: it may).
    /// `only` restricts the check to one existing version.
    pub fn check(&self, subject: &str, candidate: &Canonical, only: Option<u32>) -> Vec<String> {
        let level = self.effective_level(subject);
        let existing: Vec<Existing<'_>> = self
            .versions(subject, false)
            .unwrap_or_default()
            .into_iter()
            .filter(|(version, _)| only.is_none_or(|only| only == *version))
            .filter_map(|(version, entry)| {
                self.schemas.get(&entry.id).map(|schema| Existing {
                    version,
                    schema: &schema.parsed,
                })
            })
            .collect();
        compat::check(level, &candidate.parsed, &existing)
    }

    pub fn plan_registration(&self, subject: &str, schema: Canonical) -> Registration {
        if let Some((version, id)) = self.find(subject, &schema) {
            return Registration::Existing { id, version };
        }
        let messages = self.check(subject, &schema, None);
        if !messages.is_empty() {
            return Registration::Incompatible {
                level: self.effective_level(subject),
                messages,
            };
        }
        let id = self
            .by_text
            .get(&schema.text)
            .copied()
            .unwrap_or_else(|| self.next_id());
        // Versions continue after soft-deleted ones, as in the Confluent registry.
        let version = self
            .subjects
            .get(subject)
            .and_then(|versions| versions.keys().next_back())
            .map_or(1, |max| max + 1);
        Registration::New {
            id,
            version,
            record: Record::Version {
                subject: subject.to_owned(),
                version,
                schema: Some(VersionValue {
                    id,
                    schema,
                    deleted: false,
                }),
            },
        }
    }

    /// The records that soft-delete these versions of `subject`.
    pub fn soft_delete(&self, subject: &str, versions: &[u32]) -> Vec<Record> {
        let Some(existing) = self.subjects.get(subject) else {
            return Vec::new();
        };
        versions
            .iter()
            .filter_map(|version| {
                let entry = existing.get(version)?;
                let schema = self.schemas.get(&entry.id)?.clone();
                Some(Record::Version {
                    subject: subject.to_owned(),
                    version: *version,
                    schema: Some(VersionValue {
                        id: entry.id,
                        schema,
                        deleted: true,
                    }),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canonical(s: &str) -> Canonical {
        Canonical::parse(s).expect("test schema parses")
    }

    fn register(state: &mut State, subject: &str, schema: &str) -> Registration {
        let plan = state.plan_registration(subject, canonical(schema));
        if let Registration::New { record, .. } = &plan {
            state.apply(record.clone());
        }
        plan
    }

    const A: &str = r#"{"type":"record","name":"A","fields":[{"name":"x","type":"int"}]}"#;
    const A2: &str = r#"{"type":"record","name":"A","fields":[{"name":"x","type":"int"},{"name":"y","type":"int","default":1}]}"#;
    const A_BAD: &str = r#"{"type":"record","name":"A","fields":[{"name":"x","type":"int"},{"name":"z","type":"int"}]}"#;

    #[test]
    fn ids_are_global_and_versions_per_subject() {
        let mut state = State::default();
        assert!(matches!(
            register(&mut state, "s1", A),
            Registration::New {
                id: 1,
                version: 1,
                ..
            }
        ));
        assert!(matches!(
            register(&mut state, "s1", A),
            Registration::Existing { id: 1, version: 1 }
        ));
        assert!(matches!(
            register(&mut state, "s2", A),
            Registration::New {
                id: 1,
                version: 1,
                ..
            }
        ));
        assert!(matches!(
            register(&mut state, "s1", A2),
            Registration::New {
                id: 2,
                version: 2,
                ..
            }
        ));
        assert!(matches!(
            register(&mut state, "s1", A_BAD),
            Registration::Incompatible {
                level: Level::Backward,
                ..
            }
        ));
        assert_eq!(
            state.usages(1, false),
            vec![("s1".to_owned(), 1), ("s2".to_owned(), 1)]
        );
        assert_eq!(state.next_id(), 3);
    }

    #[test]
    fn soft_deleted_versions_hide_but_keep_their_ids() {
        let mut state = State::default();
        register(&mut state, "s", A);
        for record in state.soft_delete("s", &[1]) {
            state.apply(record);
        }
        assert!(state.subjects(false).is_empty());
        assert_eq!(state.subjects(true), vec!["s".to_owned()]);
        assert!(state.schema(1).is_some());
        // Registering again makes a new version with the same id.
        assert!(matches!(
            register(&mut state, "s", A),
            Registration::New {
                id: 1,
                version: 2,
                ..
            }
        ));
    }

    #[test]
    fn config_records_set_and_clear_levels() {
        let mut state = State::default();
        state.apply(Record::Config {
            subject: Some("s".into()),
            level: Some(Level::None),
        });
        assert_eq!(state.effective_level("s"), Level::None);
        register(&mut state, "s", A);
        assert!(matches!(
            register(&mut state, "s", A_BAD),
            Registration::New { version: 2, .. }
        ));
        state.apply(Record::Config {
            subject: Some("s".into()),
            level: None,
        });
        assert_eq!(state.subject_level("s"), None);
        assert_eq!(state.effective_level("s"), Level::Backward);
    }
}
