use super::model::parse_retention;
use super::*;

const MINIMAL: &str = r#"
run_partitions: 4
co_partitioned: [commands, run-state]
queues: [default, http]
configs:
  compression.type: zstd
topics:
  - name: commands
    key: run_id
    value_schema: schemas/run-command.avsc
    cleanup_policy: delete
    retention: 30d
  - name: run-state
    key: run_id
    value_schema: schemas/run-state.avsc
    cleanup_policy: compact
  - name: "intents.{queue}"
    key: operation_id
    value_schema: schemas/step-intent.avsc
    partitions: 2
    cleanup_policy: delete
    retention: infinite
"#;

fn invalid(yaml: &str) -> (Option<String>, Problem) {
    match Topology::from_yaml(yaml) {
        Err(Error::InvalidTopic { topic, problem }) => (Some(topic), problem),
        Err(Error::InvalidTopology(problem)) => (None, problem),
        other => panic!("expected a validation error, got {other:?}"),
    }
}

#[test]
fn minimal_topology_resolves() {
    let topology = Topology::from_yaml(MINIMAL).expect("valid");
    assert_eq!(topology.prefix(), "sortie.");
    assert_eq!(topology.replication_factor(), 1);
    assert_eq!(topology.min_insync_replicas(), 1);
    let names: Vec<&str> = topology
        .topics()
        .iter()
        .map(|t| t.full_name.as_str())
        .collect();
    assert_eq!(
        names,
        [
            "sortie.commands",
            "sortie.run-state",
            "sortie.intents.default",
            "sortie.intents.http"
        ]
    );
    let commands = topology.topic("commands").expect("declared");
    assert_eq!(commands.partitions, 4);
    assert!(commands.co_partitioned);
    assert_eq!(commands.configs["retention.ms"], "2592000000");
    assert_eq!(commands.configs["cleanup.policy"], "delete");
    assert_eq!(commands.configs["compression.type"], "zstd");
    assert_eq!(commands.configs["min.insync.replicas"], "1");
    let state = topology.topic("run-state").expect("declared");
    assert_eq!(state.retention_ms, None);
    assert!(!state.configs.contains_key("retention.ms"));
    let http = topology.topic("intents.http").expect("declared");
    assert_eq!(http.queue.as_deref(), Some("http"));
    assert_eq!(http.partitions, 2);
    assert_eq!(http.configs["retention.ms"], "-1");
}

#[test]
fn overrides_apply_to_the_whole_group() {
    let topology = Topology::from_yaml(MINIMAL)
        .and_then(|t| {
            t.with_overrides(&Overrides {
                prefix: Some("t1.".into()),
                run_partitions: Some(2),
                intent_partitions: None,
                replication_factor: Some(3),
                min_insync_replicas: None,
            })
        })
        .expect("valid");
    assert_eq!(topology.run_partitions(), 2);
    assert_eq!(topology.topic("commands").map(|t| t.partitions), Some(2));
    assert_eq!(topology.topic("run-state").map(|t| t.partitions), Some(2));
    assert_eq!(
        topology.topic("intents.default").map(|t| t.partitions),
        Some(2)
    );
    assert_eq!(
        topology.topic("commands").map(|t| t.full_name.as_str()),
        Some("t1.commands")
    );
    // auto: replication factor - 1.
    assert_eq!(topology.min_insync_replicas(), 2);
    assert_eq!(topology.topics()[0].configs["min.insync.replicas"], "2");
}

#[test]
fn unknown_cleanup_policy_names_the_topic() {
    let yaml = MINIMAL.replace("cleanup_policy: compact", "cleanup_policy: compacted");
    assert_eq!(
        invalid(&yaml),
        (
            Some("run-state".into()),
            Problem::UnknownCleanupPolicy("compacted".into())
        )
    );
    let message = Topology::from_yaml(&yaml).expect_err("invalid").to_string();
    assert!(
        message.contains("run-state") && message.contains("compacted"),
        "{message}"
    );
}

#[test]
fn zero_partitions_is_rejected() {
    let yaml = MINIMAL.replace("partitions: 2", "partitions: 0");
    assert_eq!(
        invalid(&yaml),
        (Some("intents.{queue}".into()), Problem::ZeroPartitions)
    );
    let yaml = MINIMAL.replace("run_partitions: 4", "run_partitions: 0");
    assert_eq!(invalid(&yaml), (None, Problem::ZeroRunPartitions));
    let topology = Topology::from_yaml(MINIMAL).expect("valid");
    let overridden = topology.with_overrides(&Overrides {
        run_partitions: Some(0),
        ..Overrides::default()
    });
    assert!(matches!(
        overridden,
        Err(Error::InvalidTopology(Problem::ZeroRunPartitions))
    ));
}

#[test]
fn intent_partitions_override_every_intents_topic_and_nothing_else() {
    let topology = Topology::from_yaml(MINIMAL).expect("valid");
    let overridden = topology
        .with_overrides(&Overrides {
            intent_partitions: Some(3),
            ..Overrides::default()
        })
        .expect("valid");
    for topic in overridden.topics() {
        let declared = topology.topic(&topic.name).expect("same topics").partitions;
        match topic.queue {
            Some(_) => assert_eq!(topic.partitions, 3, "{}", topic.name),
            None => assert_eq!(topic.partitions, declared, "{}", topic.name),
        }
    }
    assert!(overridden.topics().iter().any(|t| t.queue.is_some()));
    let zero = topology.with_overrides(&Overrides {
        intent_partitions: Some(0),
        ..Overrides::default()
    });
    assert!(matches!(
        zero,
        Err(Error::InvalidTopic {
            problem: Problem::ZeroPartitions,
            ..
        })
    ));
}

#[test]
fn co_partitioned_topic_may_not_declare_another_count() {
    let yaml = MINIMAL.replace(
        "    cleanup_policy: compact",
        "    partitions: 6\n    cleanup_policy: compact",
    );
    assert_eq!(
        invalid(&yaml),
        (
            Some("run-state".into()),
            Problem::CoPartitionMismatch {
                declared: 6,
                run_partitions: 4
            }
        )
    );
    // Declaring the same count is allowed.
    let yaml = MINIMAL.replace(
        "    cleanup_policy: compact",
        "    partitions: 4\n    cleanup_policy: compact",
    );
    assert!(Topology::from_yaml(&yaml).is_ok());
}

#[test]
fn duplicates_are_rejected() {
    let yaml = MINIMAL.replace("name: run-state", "name: commands");
    assert_eq!(
        invalid(&yaml),
        (Some("commands".into()), Problem::Duplicate)
    );
    // A hand-written topic that collides with an expanded queue topic.
    let yaml = format!(
        "{MINIMAL}  - name: intents.http\n    key: k\n    value_schema: s\n    partitions: 1\n    cleanup_policy: compact\n"
    );
    assert_eq!(
        invalid(&yaml),
        (Some("intents.http".into()), Problem::Duplicate)
    );
    let yaml = MINIMAL.replace("[default, http]", "[default, default]");
    assert_eq!(
        invalid(&yaml),
        (None, Problem::DuplicateQueue("default".into()))
    );
}

#[test]
fn other_problems_are_named() {
    let cases: [(&str, &str, Problem); 7] = [
        (
            "retention: 30d",
            "retention: 30 days",
            Problem::InvalidRetention("30 days".into()),
        ),
        ("    retention: 30d\n", "", Problem::MissingRetention),
        (
            "    cleanup_policy: compact\n",
            "    cleanup_policy: compact\n    retention: 1d\n",
            Problem::RetentionWithoutDelete,
        ),
        ("    partitions: 2\n", "", Problem::MissingPartitions),
        (
            "[commands, run-state]",
            "[commands, run-state, graphs]",
            Problem::UnknownCoPartitioned,
        ),
        (
            "  compression.type: zstd",
            "  cleanup.policy: compact",
            Problem::ReservedConfig {
                key: "cleanup.policy".into(),
                field: "cleanup_policy",
            },
        ),
        ("queues: [default, http]", "queues: []", Problem::NoQueues),
    ];
    for (from, to, expected) in cases {
        let yaml = MINIMAL.replacen(from, to, 1);
        assert_eq!(invalid(&yaml).1, expected, "replacing {from:?} with {to:?}");
    }
    let yaml = MINIMAL.replace(
        "run_partitions: 4",
        "run_partitions: 4\nreplication_factor: 0",
    );
    assert_eq!(invalid(&yaml), (None, Problem::ZeroReplicationFactor));
    let yaml = MINIMAL.replace(
        "run_partitions: 4",
        "run_partitions: 4\nmin_insync_replicas: 2",
    );
    assert!(matches!(
        invalid(&yaml),
        (None, Problem::InvalidMinInsyncReplicas { .. })
    ));
    let yaml = MINIMAL.replace("queues: [default, http]", "queues: [default, \"h/ttp\"]");
    assert!(matches!(invalid(&yaml), (None, Problem::InvalidName(_))));
    assert!(matches!(
        Topology::from_yaml("run_partitions: 1\ntopics: []\nextra: 1\n"),
        Err(Error::Yaml(_))
    ));
}

#[test]
fn retention_parses_units() {
    let ms = |s: &str| parse_retention(&Value::String(s.into()));
    assert_eq!(ms("14d"), Ok(14 * 86_400_000));
    assert_eq!(ms("12h"), Ok(43_200_000));
    assert_eq!(ms("500ms"), Ok(500));
    assert_eq!(ms("infinite"), Ok(-1));
    assert!(ms("0d").is_err());
    assert!(ms("d").is_err());
    assert_eq!(parse_retention(&Value::Number(60_000.into())), Ok(60_000));
}

#[test]
fn cleanup_policy_compares_as_a_set() {
    assert!(same_config(
        "cleanup.policy",
        "compact,delete",
        Some("delete,compact")
    ));
    assert!(!same_config("cleanup.policy", "compact", Some("delete")));
    assert!(same_config("retention.ms", "-1", Some("-1")));
    assert!(!same_config("retention.ms", "-1", None));
}

#[test]
fn difference_sentences() {
    let sentences = [
        Difference::Missing {
            topic: "sortie.commands".into(),
        },
        Difference::Partitions {
            topic: "sortie.run-state".into(),
            expected: 12,
            actual: 3,
        },
        Difference::Config {
            topic: "sortie.step-results".into(),
            key: "cleanup.policy".into(),
            expected: "compact".into(),
            actual: Some("delete".into()),
        },
    ]
    .map(|d| d.to_string());
    assert_eq!(
        sentences,
        [
            "sortie.commands: missing",
            "sortie.run-state: 3 partitions, expected 12",
            r#"sortie.step-results: cleanup.policy is "delete", expected "compact""#,
        ]
    );
}

/// The shipped file loads and names schema files that exist.
#[test]
fn shipped_topology_loads() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let topology = Topology::load(root.join(DEFAULT_PATH)).expect("topology/topics.yaml is valid");
    assert_eq!(topology.prefix(), "sortie.");
    assert_eq!(topology.replication_factor(), 1);
    for topic in topology.topics() {
        assert!(
            root.join(&topic.value_schema).is_file(),
            "{}: value schema {} does not exist",
            topic.name,
            topic.value_schema
        );
    }
    let group: Vec<&str> = topology
        .topics()
        .iter()
        .filter(|t| t.co_partitioned)
        .map(|t| t.name.as_str())
        .collect();
    assert_eq!(
        group,
        [
            "commands",
            "step-results",
            "run-state",
            "run-events",
            "step-deltas"
        ]
    );
    assert_eq!(topology.queues(), ["default", "http", "llm"]);
}
