//! The topology file's shape and its validation: queue templates expanded, defaults
//! merged, every problem named.

use super::*;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct File {
    #[serde(default = "default_prefix")]
    prefix: String,
    #[serde(default = "default_replication_factor")]
    replication_factor: u16,
    #[serde(default)]
    min_insync_replicas: Option<Value>,
    run_partitions: u32,
    #[serde(default)]
    co_partitioned: Vec<String>,
    #[serde(default)]
    queues: Vec<String>,
    #[serde(default)]
    configs: BTreeMap<String, Value>,
    topics: Vec<TopicEntry>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TopicEntry {
    name: String,
    key: String,
    value_schema: String,
    #[serde(default)]
    partitions: Option<u32>,
    cleanup_policy: String,
    #[serde(default)]
    retention: Option<Value>,
    #[serde(default)]
    configs: BTreeMap<String, Value>,
}

pub(super) fn default_prefix() -> String {
    "sortie.".to_owned()
}

pub(super) fn default_replication_factor() -> u16 {
    1
}

pub(super) fn resolve(file: File, overrides: &Overrides) -> Result<Topology, Error> {
    let invalid = Error::InvalidTopology;
    let prefix = overrides
        .prefix
        .clone()
        .unwrap_or_else(|| file.prefix.clone());
    check_name_chars(&prefix)
        .map_err(|reason| invalid(Problem::InvalidName(format!("prefix {prefix:?}: {reason}"))))?;
    let replication_factor = overrides
        .replication_factor
        .unwrap_or(file.replication_factor);
    if replication_factor == 0 {
        return Err(invalid(Problem::ZeroReplicationFactor));
    }
    let min_insync_replicas = match (overrides.min_insync_replicas, &file.min_insync_replicas) {
        (Some(n), _) => Some(n),
        (None, None) => None,
        (None, Some(Value::String(s))) if s == "auto" => None,
        (None, Some(value)) => Some(
            value
                .as_u64()
                .and_then(|n| u16::try_from(n).ok())
                .ok_or_else(|| {
                    invalid(Problem::InvalidMinInsyncReplicas {
                        value: yaml_scalar(value).unwrap_or_else(|| format!("{value:?}")),
                        replication_factor,
                    })
                })?,
        ),
    }
    .unwrap_or_else(|| replication_factor.saturating_sub(1).max(1));
    if min_insync_replicas == 0 || min_insync_replicas > replication_factor {
        return Err(invalid(Problem::InvalidMinInsyncReplicas {
            value: min_insync_replicas.to_string(),
            replication_factor,
        }));
    }
    if file.run_partitions == 0 || overrides.run_partitions == Some(0) {
        return Err(invalid(Problem::ZeroRunPartitions));
    }
    let run_partitions = overrides.run_partitions.unwrap_or(file.run_partitions);

    let mut queues: Vec<String> = Vec::new();
    for queue in &file.queues {
        check_name_chars(queue)
            .and_then(|()| {
                if queue.is_empty() {
                    Err("is empty".to_owned())
                } else {
                    Ok(())
                }
            })
            .map_err(|reason| {
                invalid(Problem::InvalidName(format!("queue {queue:?}: {reason}")))
            })?;
        if queues.contains(queue) {
            return Err(invalid(Problem::DuplicateQueue(queue.clone())));
        }
        queues.push(queue.clone());
    }
    let defaults = stringify_configs(&file.configs).map_err(invalid)?;

    let mut topics: Vec<TopicSpec> = Vec::new();
    for entry in &file.topics {
        let fail = |problem| Error::InvalidTopic {
            topic: entry.name.clone(),
            problem,
        };
        let cleanup_policy = CleanupPolicy::parse(&entry.cleanup_policy)
            .ok_or_else(|| fail(Problem::UnknownCleanupPolicy(entry.cleanup_policy.clone())))?;
        let retention_ms = match (&entry.retention, cleanup_policy.deletes()) {
            (None, true) => return Err(fail(Problem::MissingRetention)),
            (Some(_), false) => return Err(fail(Problem::RetentionWithoutDelete)),
            (None, false) => None,
            (Some(value), true) => Some(parse_retention(value).map_err(fail)?),
        };
        let co_partitioned = file.co_partitioned.contains(&entry.name);
        let partitions = match (entry.partitions, co_partitioned) {
            (Some(declared), true) if declared != file.run_partitions => {
                return Err(fail(Problem::CoPartitionMismatch {
                    declared,
                    run_partitions: file.run_partitions,
                }))
            }
            (_, true) => run_partitions,
            (None, false) => return Err(fail(Problem::MissingPartitions)),
            (Some(0), false) => return Err(fail(Problem::ZeroPartitions)),
            (Some(declared), false) => declared,
        };
        let partitions = match overrides.intent_partitions {
            Some(0) if entry.name.contains(QUEUE_PLACEHOLDER) => {
                return Err(fail(Problem::ZeroPartitions))
            }
            Some(intents) if entry.name.contains(QUEUE_PLACEHOLDER) => intents,
            _ => partitions,
        };
        let mut configs = defaults.clone();
        configs.extend(stringify_configs(&entry.configs).map_err(fail)?);
        configs.insert(
            CLEANUP_POLICY.to_owned(),
            cleanup_policy.as_str().to_owned(),
        );
        if let Some(ms) = retention_ms {
            configs.insert(RETENTION_MS.to_owned(), ms.to_string());
        }
        configs.insert(
            MIN_INSYNC_REPLICAS.to_owned(),
            min_insync_replicas.to_string(),
        );

        let instances: Vec<(String, Option<String>)> = if entry.name.contains(QUEUE_PLACEHOLDER) {
            if queues.is_empty() {
                return Err(fail(Problem::NoQueues));
            }
            queues
                .iter()
                .map(|q| (entry.name.replace(QUEUE_PLACEHOLDER, q), Some(q.clone())))
                .collect()
        } else {
            vec![(entry.name.clone(), None)]
        };
        for (name, queue) in instances {
            let full_name = format!("{prefix}{name}");
            let fail = |problem| Error::InvalidTopic {
                topic: name.clone(),
                problem,
            };
            if name.is_empty() {
                return Err(fail(Problem::InvalidName("the name is empty".to_owned())));
            }
            check_name_chars(&name).map_err(|reason| fail(Problem::InvalidName(reason)))?;
            if full_name.len() > MAX_TOPIC_NAME || full_name == "." || full_name == ".." {
                return Err(fail(Problem::InvalidName(format!(
                    "{full_name:?} is not a legal Kafka topic name (at most {MAX_TOPIC_NAME} characters, not . or ..)"
                ))));
            }
            if topics.iter().any(|t| t.name == name) {
                return Err(fail(Problem::Duplicate));
            }
            topics.push(TopicSpec {
                name,
                full_name,
                key: entry.key.clone(),
                value_schema: entry.value_schema.clone(),
                partitions,
                co_partitioned,
                queue,
                cleanup_policy,
                retention_ms,
                configs: configs.clone(),
            });
        }
    }
    for name in &file.co_partitioned {
        if !file.topics.iter().any(|t| &t.name == name) {
            return Err(Error::InvalidTopic {
                topic: name.clone(),
                problem: Problem::UnknownCoPartitioned,
            });
        }
    }

    Ok(Topology {
        file,
        prefix,
        replication_factor,
        min_insync_replicas,
        run_partitions,
        queues,
        topics,
    })
}

/// Kafka topic names use only ASCII letters, digits, `.`, `_` and `-`.
pub(super) fn check_name_chars(name: &str) -> Result<(), String> {
    match name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        Some(c) => Err(format!(
            "contains {c:?}; Kafka topic names use only ASCII letters, digits, '.', '_' and '-'"
        )),
        None => Ok(()),
    }
}

pub(super) fn yaml_scalar(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

pub(super) fn stringify_configs(
    configs: &BTreeMap<String, Value>,
) -> Result<BTreeMap<String, String>, Problem> {
    let mut out = BTreeMap::new();
    for (key, value) in configs {
        let field = match key.as_str() {
            CLEANUP_POLICY => Some("cleanup_policy"),
            RETENTION_MS => Some("retention"),
            MIN_INSYNC_REPLICAS => Some("min_insync_replicas"),
            _ => None,
        };
        if let Some(field) = field {
            return Err(Problem::ReservedConfig {
                key: key.clone(),
                field,
            });
        }
        let text =
            yaml_scalar(value).ok_or_else(|| Problem::InvalidConfigValue { key: key.clone() })?;
        out.insert(key.clone(), text);
    }
    Ok(out)
}

/// `30d`, `12h`, `90m`, `45s`, `500ms`, `1w`, a bare number of milliseconds, or
/// `infinite` (-1).
pub(super) fn parse_retention(value: &Value) -> Result<i64, Problem> {
    let text = yaml_scalar(value).unwrap_or_else(|| format!("{value:?}"));
    let bad = || Problem::InvalidRetention(text.clone());
    if text == "infinite" || text == "-1" {
        return Ok(-1);
    }
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let number: i64 = number.parse().map_err(|_| bad())?;
    let factor: i64 = match unit {
        "" | "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        "w" => 604_800_000,
        _ => return Err(bad()),
    };
    match number.checked_mul(factor) {
        Some(ms) if ms > 0 => Ok(ms),
        _ => Err(bad()),
    }
}

/// Compares a declared config with the broker's value. `cleanup.policy` is a list whose
/// order does not matter.
pub(super) fn same_config(key: &str, expected: &str, actual: Option<&str>) -> bool {
    match actual {
        None => false,
        Some(actual) if key == CLEANUP_POLICY => {
            CleanupPolicy::parse(expected).is_some()
                && CleanupPolicy::parse(expected) == CleanupPolicy::parse(actual)
        }
        Some(actual) => expected == actual,
    }
}
