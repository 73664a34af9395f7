//! `topology/topics.yaml` against the real broker: apply, check, and the `sortie topology`
//! command. Each test has its own prefix and small partition counts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{ensure, Context as _};
use rdkafka::admin::{AdminClient, AdminOptions, ConfigSource, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use sortie_kafka::topology::{CleanupPolicy, Difference, Overrides, Topology, DEFAULT_PATH};
use sortie_kafka::KafkaConfig;
use sortie_wire::Topics;

const RUN_PARTITIONS: u32 = 2;
const TIMEOUT: Duration = Duration::from_secs(30);

async fn kafka() -> KafkaConfig {
    KafkaConfig::new(sortie_tests::bootstrap().await)
}

fn shipped() -> anyhow::Result<Topology> {
    Ok(Topology::load(
        sortie_tests::workspace_root().join(DEFAULT_PATH),
    )?)
}

/// The shipped topology under a test's own prefix, with small run partitions.
fn topology(prefix: &str) -> anyhow::Result<Topology> {
    Ok(shipped()?.with_overrides(&Overrides {
        prefix: Some(prefix.to_owned()),
        run_partitions: Some(RUN_PARTITIONS),
        ..Overrides::default()
    })?)
}

fn admin(kafka: &KafkaConfig) -> anyhow::Result<AdminClient<DefaultClientContext>> {
    Ok(kafka.client().create()?)
}

fn options() -> AdminOptions {
    AdminOptions::new().operation_timeout(Some(TIMEOUT))
}

/// Partition counts of the topics under `prefix`, read from the broker's metadata.
fn partition_counts(
    admin: &AdminClient<DefaultClientContext>,
    prefix: &str,
) -> anyhow::Result<BTreeMap<String, usize>> {
    let metadata = admin.inner().fetch_metadata(None, TIMEOUT)?;
    Ok(metadata
        .topics()
        .iter()
        .filter(|t| t.name().starts_with(prefix))
        .map(|t| (t.name().to_owned(), t.partitions().len()))
        .collect())
}

/// One topic's configs as the broker describes them: value and whether set on the topic.
async fn describe(
    admin: &AdminClient<DefaultClientContext>,
    topic: &str,
) -> anyhow::Result<BTreeMap<String, (String, bool)>> {
    let results = admin
        .describe_configs(&[ResourceSpecifier::Topic(topic)], &options())
        .await?;
    let resource = results
        .into_iter()
        .next()
        .context("no describe result")?
        .map_err(|code| anyhow::anyhow!("describe {topic}: {code}"))?;
    Ok(resource
        .entries
        .into_iter()
        .map(|e| {
            let per_topic = e.source == ConfigSource::DynamicTopic;
            (e.name, (e.value.unwrap_or_default(), per_topic))
        })
        .collect())
}

/// Creates a topic by hand, bypassing the topology.
async fn create_by_hand(
    bootstrap: &str,
    name: &str,
    partitions: i32,
    configs: &BTreeMap<String, String>,
) {
    let configs: Vec<(&str, &str)> = configs
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    sortie_tests::create_topic(bootstrap, name, partitions, &configs).await;
}

async fn delete_prefix(admin: &AdminClient<DefaultClientContext>, prefix: &str) {
    let Ok(names) = partition_counts(admin, prefix) else {
        return;
    };
    let names: Vec<&str> = names.keys().map(String::as_str).collect();
    if !names.is_empty() {
        let _ = admin.delete_topics(&names, &options()).await;
    }
}

/// Apply on an empty prefix creates every topic with its partitions and cleanup policy;
/// a second apply creates nothing, and check is clean.
#[tokio::test]
async fn apply_creates_every_topic_and_is_idempotent() -> anyhow::Result<()> {
    let kafka = kafka().await;
    let admin = admin(&kafka)?;
    let prefix = sortie_tests::unique_prefix("topology-apply");
    let topology = topology(&prefix)?;

    let report = topology.apply(&kafka).await?;
    ensure!(report.is_complete(), "first apply left {report:?}");
    let mut created = report.created.clone();
    created.sort();
    let mut declared: Vec<String> = topology
        .topics()
        .iter()
        .map(|t| t.full_name.clone())
        .collect();
    declared.sort();
    assert_eq!(created, declared);

    // Verified through the broker's own metadata and configs, not through diff.
    let counts = partition_counts(&admin, &prefix)?;
    assert_eq!(counts.len(), topology.topics().len(), "{counts:?}");
    for spec in topology.topics() {
        assert_eq!(
            counts.get(&spec.full_name),
            Some(&usize::try_from(spec.partitions)?),
            "{}",
            spec.full_name
        );
        let configs = describe(&admin, &spec.full_name).await?;
        assert_eq!(
            configs["cleanup.policy"].0,
            spec.cleanup_policy.as_str(),
            "{}",
            spec.full_name
        );
        for (key, value) in &spec.configs {
            assert_eq!(&configs[key].0, value, "{}: {key}", spec.full_name);
        }
    }
    let runs = Topics::new(prefix.as_str());
    for topic in [
        runs.commands(),
        runs.step_results(),
        runs.run_state(),
        runs.run_events(),
    ] {
        assert_eq!(counts[&topic], usize::try_from(RUN_PARTITIONS)?, "{topic}");
    }
    assert_eq!(
        describe(&admin, &runs.run_events()).await?["retention.ms"].0,
        "-1"
    );
    assert_eq!(
        describe(&admin, &runs.step_results()).await?["cleanup.policy"].0,
        "compact"
    );

    let again = topology.apply(&kafka).await?;
    assert!(again.created.is_empty(), "{again:?}");
    assert!(again.altered.is_empty(), "{again:?}");
    assert!(again.is_complete(), "{again:?}");
    assert_eq!(again.unchanged.len(), topology.topics().len());
    assert_eq!(topology.diff(&kafka).await?, []);

    delete_prefix(&admin, &prefix).await;
    Ok(())
}

/// Check names each difference; apply fixes configs and reports the partition count it
/// must not change.
#[tokio::test]
async fn check_names_each_difference() -> anyhow::Result<()> {
    let bootstrap = sortie_tests::bootstrap().await;
    let kafka = KafkaConfig::new(bootstrap.clone());
    let admin = admin(&kafka)?;
    let prefix = sortie_tests::unique_prefix("topology-check");
    let topology = topology(&prefix)?;
    let run_state = topology.topic("run-state").context("run-state")?.clone();
    let step_results = topology
        .topic("step-results")
        .context("step-results")?
        .clone();

    // run-state with the wrong partition count; step-results deleting instead of
    // compacting, and with a config the topology does not declare.
    create_by_hand(&bootstrap, &run_state.full_name, 3, &run_state.configs).await;
    let mut wrong = step_results.configs.clone();
    wrong.insert("cleanup.policy".into(), "delete".into());
    wrong.insert("segment.ms".into(), "3600000".into());
    create_by_hand(&bootstrap, &step_results.full_name, 2, &wrong).await;

    let partitions = Difference::Partitions {
        topic: run_state.full_name.clone(),
        expected: RUN_PARTITIONS,
        actual: 3,
    };
    let configs = vec![
        Difference::Config {
            topic: step_results.full_name.clone(),
            key: "cleanup.policy".into(),
            expected: "compact".into(),
            actual: Some("delete".into()),
        },
        Difference::Undeclared {
            topic: step_results.full_name.clone(),
            key: "segment.ms".into(),
            actual: "3600000".into(),
        },
    ];
    let mut expected = Vec::new();
    for spec in topology.topics() {
        match spec.name.as_str() {
            "run-state" => expected.push(partitions.clone()),
            "step-results" => expected.extend(configs.iter().cloned()),
            _ => expected.push(Difference::Missing {
                topic: spec.full_name.clone(),
            }),
        }
    }
    let differences = topology.diff(&kafka).await?;
    assert_eq!(differences, expected);
    let sentences: Vec<String> = differences.iter().map(ToString::to_string).collect();
    assert!(
        sentences.contains(&format!("{prefix}commands: missing")),
        "{sentences:?}"
    );
    assert!(sentences.contains(&format!("{prefix}run-state: 3 partitions, expected 2")));
    assert!(sentences.contains(&format!(
        r#"{prefix}step-results: cleanup.policy is "delete", expected "compact""#
    )));

    let report = topology.apply(&kafka).await?;
    assert_eq!(
        report.created.len(),
        topology.topics().len() - 2,
        "{report:?}"
    );
    assert_eq!(report.altered, configs, "{report:?}");
    assert_eq!(
        report.remaining,
        std::slice::from_ref(&partitions),
        "{report:?}"
    );
    assert!(report.failed.is_empty(), "{report:?}");
    let configs = describe(&admin, &step_results.full_name).await?;
    assert_eq!(configs["cleanup.policy"].0, "compact");
    assert!(
        !configs["segment.ms"].1,
        "segment.ms is still set on the topic"
    );
    assert_eq!(
        partition_counts(&admin, &run_state.full_name)?[&run_state.full_name],
        3
    );
    assert_eq!(topology.diff(&kafka).await?, [partitions]);

    delete_prefix(&admin, &prefix).await;
    Ok(())
}

/// Two applies at once both succeed and leave a matching topology.
#[tokio::test]
async fn concurrent_applies_both_succeed() -> anyhow::Result<()> {
    let kafka = kafka().await;
    let admin = admin(&kafka)?;
    let prefix = sortie_tests::unique_prefix("topology-race");
    let topology = topology(&prefix)?;
    let (a, b) = tokio::join!(topology.apply(&kafka), topology.apply(&kafka));
    let (a, b) = (a?, b?);
    assert!(a.is_complete() && b.is_complete(), "{a:?} {b:?}");
    assert_eq!(topology.diff(&kafka).await?, []);
    delete_prefix(&admin, &prefix).await;
    Ok(())
}

/// The built `sortie` binary, built first if needed (same profile as this test).
fn sortie_binary() -> anyhow::Result<PathBuf> {
    // <target>/<profile>/deps/topology-<hash>
    let exe = std::env::current_exe()?;
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .context("test binary outside a target dir")?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .current_dir(sortie_tests::workspace_root())
        .args(["build", "-q", "-p", "sortie"]);
    if profile_dir.file_name().is_some_and(|n| n == "release") {
        build.arg("--release");
    }
    if let Some(target) = profile_dir.parent() {
        build.env("CARGO_TARGET_DIR", target);
    }
    let status = build.status()?;
    ensure!(status.success(), "cargo build -p sortie failed");
    Ok(profile_dir.join(format!("sortie{}", std::env::consts::EXE_SUFFIX)))
}

fn sortie(binary: &Path, action: &str, prefix: &str, bootstrap: &str) -> anyhow::Result<Output> {
    let output = Command::new(binary)
        .args(["topology", action, "--file"])
        .arg(sortie_tests::workspace_root().join(DEFAULT_PATH))
        .args([
            "--prefix",
            prefix,
            "--partitions",
            &RUN_PARTITIONS.to_string(),
        ])
        .args(["--bootstrap-servers", bootstrap])
        .env_remove("SORTIE__KAFKA__BOOTSTRAP_SERVERS")
        .output()?;
    Ok(output)
}

/// `sortie topology check` exits non-zero with one sentence per difference; `apply`
/// reports what it cannot fix, and once that is gone, `apply` then `check` exit zero.
#[tokio::test]
async fn cli_check_and_apply() -> anyhow::Result<()> {
    let bootstrap = sortie_tests::bootstrap().await;
    let kafka = KafkaConfig::new(bootstrap.clone());
    let admin = admin(&kafka)?;
    let prefix = sortie_tests::unique_prefix("topology-cli");
    let topology = topology(&prefix)?;
    let run_state = topology.topic("run-state").context("run-state")?.clone();
    let step_results = topology
        .topic("step-results")
        .context("step-results")?
        .clone();
    create_by_hand(&bootstrap, &run_state.full_name, 3, &run_state.configs).await;
    let mut wrong = step_results.configs.clone();
    wrong.insert("cleanup.policy".into(), "delete".into());
    create_by_hand(&bootstrap, &step_results.full_name, 2, &wrong).await;

    let binary = tokio::task::spawn_blocking(sortie_binary).await??;
    let stdout = |o: &Output| String::from_utf8_lossy(&o.stdout).into_owned();

    let check = sortie(&binary, "check", &prefix, &bootstrap)?;
    assert!(!check.status.success(), "check passed:\n{}", stdout(&check));
    let lines: Vec<String> = stdout(&check).lines().map(str::to_owned).collect();
    for sentence in [
        format!("{prefix}commands: missing"),
        format!("{prefix}run-state: 3 partitions, expected 2"),
        format!(r#"{prefix}step-results: cleanup.policy is "delete", expected "compact""#),
    ] {
        assert!(lines.contains(&sentence), "no {sentence:?} in {lines:#?}");
    }
    assert_eq!(lines.len(), topology.topics().len(), "{lines:#?}");

    let apply = sortie(&binary, "apply", &prefix, &bootstrap)?;
    assert!(
        !apply.status.success(),
        "apply cannot fix run-state:\n{}",
        stdout(&apply)
    );
    assert!(
        stdout(&apply).contains(&format!(
            "could not fix {prefix}run-state: 3 partitions, expected 2"
        )),
        "{}",
        stdout(&apply)
    );

    // Remove the topic apply must not fix; then the topology can be met.
    admin
        .delete_topics(&[run_state.full_name.as_str()], &options())
        .await?;
    sortie_tests::wait_until("run-state deleted", TIMEOUT, || async {
        partition_counts(&admin, &run_state.full_name)
            .is_ok_and(|counts| !counts.contains_key(&run_state.full_name))
    })
    .await;
    let apply = sortie(&binary, "apply", &prefix, &bootstrap)?;
    assert!(
        apply.status.success(),
        "{}{}",
        stdout(&apply),
        String::from_utf8_lossy(&apply.stderr)
    );
    assert!(stdout(&apply).contains(&format!("created {prefix}run-state")));
    let check = sortie(&binary, "check", &prefix, &bootstrap)?;
    assert!(check.status.success(), "{}", stdout(&check));
    assert_eq!(stdout(&check).trim(), "topology matches");

    delete_prefix(&admin, &prefix).await;
    Ok(())
}

/// The shipped topology names the same topics as `sortie_wire::Topics`, points at schema
/// files that exist, and keeps the co-partitioned group of SPEC §3.
#[test]
fn shipped_topology_agrees_with_wire_names() -> anyhow::Result<()> {
    let root = sortie_tests::workspace_root();
    let topology = shipped()?;
    assert_eq!(topology.prefix(), Topics::DEFAULT_PREFIX);
    let topics = Topics::default();
    let mut expected = vec![
        (topics.commands(), "run_id", CleanupPolicy::Delete, true),
        (
            topics.step_results(),
            "operation_id",
            CleanupPolicy::Compact,
            true,
        ),
        (topics.run_state(), "run_id", CleanupPolicy::Compact, true),
        (topics.run_events(), "run_id", CleanupPolicy::Delete, true),
        (
            topics.graphs(),
            "graph_id@version",
            CleanupPolicy::Compact,
            false,
        ),
        (
            topics.dead_letters(),
            "original key",
            CleanupPolicy::Delete,
            false,
        ),
        (topics.step_deltas(), "run_id", CleanupPolicy::Delete, true),
    ];
    for queue in topology.queues() {
        expected.push((
            topics.intents(queue),
            "operation_id",
            CleanupPolicy::Delete,
            false,
        ));
    }
    assert!(topology.queues().iter().any(|q| q == "default"));
    let mut actual: Vec<_> = topology
        .topics()
        .iter()
        .map(|t| {
            (
                t.full_name.clone(),
                t.key.as_str(),
                t.cleanup_policy,
                t.co_partitioned,
            )
        })
        .collect();
    expected.sort();
    actual.sort();
    assert_eq!(actual, expected);

    for spec in topology.topics() {
        ensure!(
            root.join(&spec.value_schema).is_file(),
            "{}: {} does not exist",
            spec.full_name,
            spec.value_schema
        );
        if spec.co_partitioned {
            assert_eq!(spec.partitions, topology.run_partitions());
        }
    }
    assert_eq!(
        topology.topic("run-events").and_then(|t| t.retention_ms),
        Some(-1),
        "run-events keeps history forever by default"
    );
    Ok(())
}
