//! The graph registry against the real broker and schema registry: publishing is
//! idempotent and versions are immutable; the global table catches up, follows new
//! versions and skips records it cannot trust; the shipped example graphs load; and
//! `sortie graph publish|list` does the same from the command line.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{ensure, Context as _};
use sortie_catalog::{self as graphs, GraphTable, Published};
use sortie_core::Graph;
use sortie_kafka::KafkaConfig;
use sortie_tests::{Isolation, ServedRegistry};
use sortie_wire::{Codec, CodecConfig, RecordKind, Topics};

const NOW: i64 = 1_764_400_000_000;

struct Setup {
    bootstrap: String,
    kafka: KafkaConfig,
    topics: Topics,
    codec: Arc<Codec>,
    registry: ServedRegistry,
}

/// A unique prefix, a compacted graphs topic, a served registry and a codec with the
/// graph definition schema registered.
async fn setup(name: &str, partitions: i32) -> anyhow::Result<Setup> {
    let bootstrap = sortie_tests::bootstrap().await;
    let prefix = sortie_tests::unique_prefix(name);
    let kafka = KafkaConfig::new(bootstrap.clone());
    let topics = Topics::new(prefix.clone());
    sortie_tests::create_topic(
        &bootstrap,
        &topics.graphs(),
        partitions,
        &[("cleanup.policy", "compact")],
    )
    .await;
    let registry = ServedRegistry::start(&kafka, &format!("{prefix}_schemas")).await?;
    let codec = Codec::new(&CodecConfig {
        registry_url: registry.url.clone(),
        auto_register: true,
    });
    codec
        .prepare(
            &topics.graphs(),
            RecordKind::GraphDefinition,
            Duration::from_secs(10),
        )
        .await?;
    Ok(Setup {
        bootstrap,
        kafka,
        topics,
        codec: Arc::new(codec),
        registry,
    })
}

fn graph(id: &str, version: u32, tool: &str) -> Graph {
    Graph::parse(&format!(
        "id: {id}\nversion: {version}\nnodes:\n  - {{id: a, tool: {tool}, side_effect: pure}}\n  - {{id: b, tool: echo, side_effect: pure, args: {{x: $steps.a.output}}}}\nedges:\n  - {{from: a, to: b}}\n"
    ))
    .expect("a valid test graph")
}

impl Setup {
    async fn publish(&self, graph: &Graph) -> Result<Published, graphs::Error> {
        graphs::publish(&self.kafka, &self.codec, &self.topics, graph, "test", NOW).await
    }

    async fn records(&self) -> usize {
        sortie_tests::read_all(
            &self.bootstrap,
            &self.topics.graphs(),
            Isolation::ReadCommitted,
        )
        .await
        .len()
    }

    /// Produces raw values (bypassing `publish`) keyed as given.
    async fn produce_raw(&self, records: &[(String, Vec<u8>)]) {
        sortie_tests::produce(&self.bootstrap, &self.topics.graphs(), records).await;
    }

    /// Opens a table on a blocking thread (the table blocks; decoding runs on this runtime).
    async fn open_table(&self) -> anyhow::Result<Arc<Mutex<GraphTable>>> {
        let (kafka, topics, codec) = (self.kafka.clone(), self.topics.clone(), self.codec.clone());
        let runtime = tokio::runtime::Handle::current();
        let table =
            tokio::task::spawn_blocking(move || GraphTable::open(&kafka, &topics, codec, runtime))
                .await??;
        Ok(Arc::new(Mutex::new(table)))
    }
}

/// Runs `f` on the table on a blocking thread.
async fn with_table<T: Send + 'static>(
    table: &Arc<Mutex<GraphTable>>,
    f: impl FnOnce(&mut GraphTable) -> T + Send + 'static,
) -> T {
    let table = table.clone();
    tokio::task::spawn_blocking(move || f(&mut table.lock().expect("table lock")))
        .await
        .expect("the table task panicked")
}

/// Publishing the same definition again writes nothing; the topic holds one record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishing_twice_writes_one_record() -> anyhow::Result<()> {
    let setup = setup("graphs-twice", 1).await?;
    let refund = graph("refund", 1, "http");
    assert_eq!(
        setup.publish(&refund).await?,
        Published::Published { version: 1 }
    );
    assert_eq!(setup.publish(&refund).await?, Published::AlreadyPublished);
    assert_eq!(setup.records().await, 1);
    setup.registry.stop().await
}

/// A different definition for a published version is refused, naming the version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_definition_for_a_published_version_is_refused() -> anyhow::Result<()> {
    let setup = setup("graphs-immutable", 1).await?;
    setup.publish(&graph("refund", 1, "http")).await?;
    let error = setup
        .publish(&graph("refund", 1, "echo"))
        .await
        .expect_err("a redefinition");
    assert!(
        matches!(&error, graphs::Error::VersionExists { key } if key == "refund@1"),
        "{error:?}"
    );
    assert!(error.to_string().contains("refund@1"), "{error}");
    assert_eq!(
        setup.publish(&graph("refund", 2, "echo")).await?,
        Published::Published { version: 2 }
    );
    assert_eq!(setup.records().await, 2);
    setup.registry.stop().await
}

/// The table catches up on both published versions, then `poll` picks up one published
/// after it opened; older versions stay available for the runs pinned to them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_catches_up_and_follows_new_versions() -> anyhow::Result<()> {
    let setup = setup("graphs-table", 2).await?;
    setup.publish(&graph("refund", 1, "http")).await?;
    setup.publish(&graph("refund", 2, "echo")).await?;
    setup.publish(&graph("other", 1, "echo")).await?;

    let table = setup.open_table().await?;
    let added = with_table(&table, |t| t.catch_up(Duration::from_secs(30))).await?;
    assert_eq!(added, 3);
    let (v1, v2, latest, publisher) = with_table(&table, |t| {
        let g = t.graphs();
        (
            g.get("refund", Some(1)).map(|g| g.nodes[0].tool.clone()),
            g.get("refund", Some(2)).map(|g| g.nodes[0].tool.clone()),
            g.get("refund", None).map(|g| g.version),
            t.publication("refund@2")
                .map(|p| (p.published_by.clone(), p.published_at)),
        )
    })
    .await;
    assert_eq!(v1.as_deref(), Some("http"));
    assert_eq!(v2.as_deref(), Some("echo"));
    assert_eq!(latest, Some(2));
    assert_eq!(publisher, Some(("test".to_owned(), NOW)));
    assert_eq!(
        with_table(&table, |t| t.catch_up(Duration::from_secs(30))).await?,
        0
    );

    setup.publish(&graph("refund", 3, "echo")).await?;
    let watched = table.clone();
    sortie_tests::wait_until("the table to see refund@3", Duration::from_secs(30), || {
        let table = watched.clone();
        async move {
            with_table(&table, |t| {
                t.poll();
                t.graphs().get("refund", None).map(|g| g.version) == Some(3)
            })
            .await
        }
    })
    .await;
    let (v1_still, skipped) = with_table(&table, |t| {
        (t.graphs().get("refund", Some(1)).is_some(), t.skipped())
    })
    .await;
    assert!(v1_still, "refund@1 must stay for runs pinned to it");
    assert_eq!(skipped, 0);
    setup.registry.stop().await
}

/// Garbage, a definition whose hash does not match, and a redefinition of a published
/// version are skipped and counted; the table keeps reading past them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrustworthy_records_are_skipped_and_counted() -> anyhow::Result<()> {
    let setup = setup("graphs-skip", 1).await?;
    let topic = setup.topics.graphs();
    setup.publish(&graph("refund", 1, "http")).await?;

    let mut mismatched = graphs::definition_record(&graph("refund", 2, "http"), "mallory", NOW)?;
    mismatched.definition = graph("refund", 2, "echo").canonical_json();
    let redefined = graphs::definition_record(&graph("refund", 1, "echo"), "mallory", NOW)?;
    setup
        .produce_raw(&[
            ("junk@1".to_owned(), b"not avro at all".to_vec()),
            (
                "refund@2".to_owned(),
                setup.codec.encode(&topic, &mismatched).await?,
            ),
            (
                "refund@1".to_owned(),
                setup.codec.encode(&topic, &redefined).await?,
            ),
        ])
        .await;
    setup.publish(&graph("refund", 3, "echo")).await?;

    let table = setup.open_table().await?;
    let added = with_table(&table, |t| t.catch_up(Duration::from_secs(30))).await?;
    assert_eq!(added, 2, "refund@1 and refund@3");
    let (skipped, v1_tool, v2) = with_table(&table, |t| {
        (
            t.skipped(),
            t.graphs()
                .get("refund", Some(1))
                .map(|g| g.nodes[0].tool.clone()),
            t.graphs().get("refund", Some(2)).is_some(),
        )
    })
    .await;
    assert_eq!(skipped, 3);
    assert_eq!(
        v1_tool.as_deref(),
        Some("http"),
        "the first definition stays"
    );
    assert!(!v2, "a record whose hash does not match is not trusted");

    setup
        .produce_raw(&[("junk@2".to_owned(), vec![0, 0, 0, 0, 1, 2, 3])])
        .await;
    setup.publish(&graph("refund", 4, "echo")).await?;
    let watched = table.clone();
    sortie_tests::wait_until(
        "the table to read past more garbage to refund@4",
        Duration::from_secs(30),
        || {
            let table = watched.clone();
            async move {
                with_table(&table, |t| {
                    t.poll();
                    t.graphs().get("refund", Some(4)).is_some()
                })
                .await
            }
        },
    )
    .await;
    assert_eq!(with_table(&table, |t| t.skipped()).await, 4);
    setup.registry.stop().await
}

/// Every example in topology/graphs parses and validates; the refund story has its shape.
#[test]
fn every_shipped_example_graph_loads() -> anyhow::Result<()> {
    let dir = sortie_tests::workspace_root()
        .join("topology")
        .join("graphs");
    let loaded = graphs::load_dir(&dir)?;
    let files = std::fs::read_dir(&dir)?
        .filter(|e| {
            e.as_ref().is_ok_and(|e| {
                e.path()
                    .extension()
                    .is_some_and(|x| x == "yaml" || x == "yml" || x == "json")
            })
        })
        .count();
    assert_eq!(loaded.len(), files);
    for graph in &loaded {
        for node in &graph.nodes {
            let problem = sortie_executor::handlers::config_problem(&node.tool, &node.config);
            assert_eq!(problem, None, "{} node {}", graph.key(), node.id);
        }
    }
    let keys: Vec<String> = loaded.iter().map(Graph::key).collect();
    for key in ["demo@1", "refund@1"] {
        assert!(keys.iter().any(|k| k == key), "{key} missing from {keys:?}");
    }

    let refund = loaded.iter().find(|g| g.id == "refund").context("refund")?;
    let order: Vec<&str> = refund.topological().iter().map(|n| n.id.as_str()).collect();
    assert_eq!(
        order,
        ["read_order", "check_policy", "refund", "notify_customer"]
    );
    let step = refund.node("refund").context("refund node")?;
    let approval = step.interrupt_before.as_ref().context("approval")?;
    assert_eq!(approval.required_role.as_deref(), Some("approver"));
    assert_eq!(approval.timeout.0, 24 * 3_600_000);
    assert_eq!(step.compensate_with.as_deref(), Some("reverse_refund"));
    assert!(refund.detached().contains("reverse_refund"));

    let demo = loaded.iter().find(|g| g.id == "demo").context("demo")?;
    assert!(demo.nodes.iter().all(|n| n.tool == "echo"));
    assert_eq!(
        demo.nodes
            .iter()
            .filter(|n| n.interrupt_before.is_some())
            .count(),
        1
    );
    Ok(())
}

/// Issue #55: a built-in tool's config the executor would refuse (`bad_config`) at the
/// first run is refused by `sortie graph publish`, naming the file, the node and the
/// field, before anything is published (no broker needed: it never connects). Seen red
/// with the CLI's config check left out: the file was taken and the CLI went on to the
/// registry.
#[test]
fn a_typo_in_a_tools_config_is_refused_at_publication() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("typo.yaml");
    std::fs::write(
        &file,
        "id: typo\nversion: 1\nnodes:\n  - {id: a, tool: http, side_effect: keyed, config: {urll: \"http://x\"}}\n",
    )?;
    let out = std::process::Command::new(sortie_binary()?)
        .args([
            "graph",
            "publish",
            "--unsigned",
            "--registry-url",
            "http://127.0.0.1:9",
        ])
        .arg(&file)
        .output()?;
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(r#"node "a": http config: unknown field `urll`"#),
        "{stderr}"
    );
    assert!(stderr.contains("nothing was published"), "{stderr}");
    Ok(())
}

/// A folder with an invalid file fails to load, naming the file and the node.
#[test]
fn an_invalid_graph_file_is_named_with_its_node() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    std::fs::write(
        dir.path().join("good.yaml"),
        "id: good\nversion: 1\nnodes:\n  - {id: a, tool: echo, side_effect: pure}\n",
    )?;
    std::fs::write(dir.path().join("broken.yml"), INVALID)?;
    std::fs::write(dir.path().join("notes.txt"), "not a graph")?;
    let error = graphs::load_dir(dir.path()).expect_err("an invalid file");
    let text = error.to_string();
    assert!(text.contains("broken.yml"), "{text}");
    assert!(text.contains(r#"node "ghost""#), "{text}");
    Ok(())
}

const INVALID: &str = "id: broken\nversion: 1\nnodes:\n  - {id: a, tool: echo, side_effect: pure}\nedges:\n  - {from: a, to: ghost}\n";

// ---------------------------------------------------------------- the CLI

/// The built `sortie` binary, built first if needed (same profile as this test).
fn sortie_binary() -> anyhow::Result<PathBuf> {
    // <target>/<profile>/deps/graphs-<hash>
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

struct Cli {
    binary: PathBuf,
    bootstrap: String,
    prefix: String,
    registry_url: String,
}

impl Cli {
    async fn run(&self, args: &[&str]) -> anyhow::Result<Output> {
        let mut command = tokio::process::Command::new(&self.binary);
        command
            .arg("graph")
            .args(args)
            .args(["--bootstrap-servers", &self.bootstrap])
            .args(["--prefix", &self.prefix])
            .args(["--registry-url", &self.registry_url])
            .env_remove("SORTIE__KAFKA__BOOTSTRAP_SERVERS")
            .env_remove("SORTIE__REGISTRY__URL")
            .env("RUST_LOG", "warn");
        Ok(command.output().await?)
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `sortie graph publish` publishes the examples once, `list` shows them, and an invalid
/// file or a changed definition of a published version exits non-zero with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_publishes_and_lists_graphs() -> anyhow::Result<()> {
    let setup = setup("graphs-cli", 1).await?;
    let binary = tokio::task::spawn_blocking(sortie_binary).await??;
    let cli = Cli {
        binary,
        bootstrap: setup.bootstrap.clone(),
        prefix: setup.topics.prefix().to_owned(),
        registry_url: setup.registry.url.clone(),
    };
    let examples = sortie_tests::workspace_root()
        .join("topology")
        .join("graphs");
    let refund = examples.join("refund.yaml");
    let demo = examples.join("demo.yaml");
    let (refund, demo) = (
        refund.to_str().context("path")?,
        demo.to_str().context("path")?,
    );

    let first = cli.run(&["publish", refund, demo]).await?;
    assert!(first.status.success(), "{}", text(&first.stderr));
    let lines: Vec<String> = text(&first.stdout).lines().map(str::to_owned).collect();
    assert_eq!(lines, ["published refund@1", "published demo@1"]);

    let again = cli.run(&["publish", refund, "--by", "ops"]).await?;
    assert!(again.status.success(), "{}", text(&again.stderr));
    assert_eq!(
        text(&again.stdout).trim(),
        "refund@1 already published (same definition)"
    );

    let list = cli.run(&["list"]).await?;
    assert!(list.status.success(), "{}", text(&list.stderr));
    let listed = text(&list.stdout);
    let lines: Vec<&str> = listed.lines().collect();
    assert_eq!(lines.len(), 2, "{listed}");
    assert!(
        lines[0].starts_with("demo@1  2 nodes  published by cli at 20"),
        "{listed}"
    );
    assert!(
        lines[1].starts_with("refund@1  5 nodes  published by cli at 20"),
        "{listed}"
    );

    let dir = tempfile::tempdir()?;
    let broken = dir.path().join("broken.yaml");
    std::fs::write(&broken, INVALID)?;
    let invalid = cli
        .run(&["publish", broken.to_str().context("path")?, demo])
        .await?;
    assert!(!invalid.status.success(), "an invalid file was accepted");
    let stderr = text(&invalid.stderr);
    assert!(
        stderr.contains(r#"broken.yaml: node "ghost": edge a -> ghost names an unknown node"#),
        "{stderr}"
    );

    let changed = dir.path().join("refund-changed.yaml");
    std::fs::write(
        &changed,
        std::fs::read_to_string(refund)?.replace(
            "description: Refund an order",
            "description: Quietly refund an order",
        ),
    )?;
    let refused = cli
        .run(&["publish", changed.to_str().context("path")?])
        .await?;
    assert!(!refused.status.success(), "a changed version was accepted");
    let stderr = text(&refused.stderr);
    assert!(
        stderr.contains("refund@1 is already published with a different definition"),
        "{stderr}"
    );
    assert_eq!(setup.records().await, 2, "nothing but the two examples");
    setup.registry.stop().await
}

/// Produces a graph record for `graph` straight to the graphs topic, as any writer of
/// that topic can, with the signature headers `signer` makes (none without one).
async fn forge(
    stack: &sortie_tests::stack::Stack,
    graph: &Graph,
    published_by: &str,
    signer: Option<&sortie_wire::signing::Signer>,
) {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let record = graphs::definition_record(graph, published_by, NOW).expect("record");
    let value = stack
        .codec
        .encode(&stack.topics.graphs(), &record)
        .await
        .expect("encode");
    let mut headers = OwnedHeaders::new();
    for (name, bytes) in signer.map(|s| s.headers(&value)).into_iter().flatten() {
        headers = headers.insert(Header {
            key: name,
            value: Some(&bytes),
        });
    }
    let producer: FutureProducer = stack.kafka.producer().create().expect("producer");
    let key = graph.key();
    let topic = stack.topics.graphs();
    producer
        .send(
            FutureRecord::to(&topic)
                .key(&key)
                .payload(&value)
                .headers(headers),
            Duration::from_secs(10),
        )
        .await
        .expect("delivered");
}

/// Issue #36 item 2: any writer of `sortie.graphs` publishes `gated@2..4` — the refund
/// without its gate — unsigned, signed by a key the keyring does not know, and signed by
/// a key it knows that is no publisher. A reducer and a gateway that require signatures
/// skip all three (logged, counted): a start pinned to `@4` is refused `unknown_graph`,
/// the gateway answers 422 for it, and the signed `@5` published after them is taken.
/// Seen red: with the table reading no signatures (`GraphTable::set_trust` ignoring its
/// trust), the reducer started the run on `gated@4` and the refund ran unapproved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_graph_is_ignored_by_reducer_and_gateway() {
    use sortie_core::{EventBody, RunStatus};
    use sortie_tests::stack::{scrape, start_run, succeed, Stack};
    use sortie_wire::signing::Signer;
    const LONG: Duration = Duration::from_secs(90);
    let stack = Stack::start("graphs-forged", &[sortie_tests::GATED]).await;
    let service = Signer::generate("svc-1").expect("key");
    let keyring = stack.write_keyring(&[service.entry(
        "svc:test",
        &["acme".to_owned()],
        &["approver".to_owned(), "operator".to_owned()],
        false,
    )]);
    let ring = keyring.to_str().expect("path");
    let reducer = stack.reducer_with("0", &["--keyring", ring, "--require-signatures"]);
    let executor = stack.executor("default", succeed);
    let (_gateway, url) = stack
        .gateway_process_with(
            &stack.dir.join("gateway"),
            &["acme:user:alice:approver:tok-alice"],
            &["--keyring", ring, "--require-signatures"],
        )
        .await;

    let version = |version: u32, gated: bool| {
        let text = sortie_tests::GATED.replace("version: 1", &format!("version: {version}"));
        let text = match gated {
            true => text,
            false => text.replace(
                "    interrupt_before: {reason: refunds need a human, required_role: approver, timeout: 24h}\n",
                "",
            ),
        };
        Graph::parse(&text).expect("a valid graph")
    };
    assert!(version(2, false)
        .nodes
        .iter()
        .all(|n| n.interrupt_before.is_none()));
    let stranger = Signer::generate("stranger").expect("key");
    forge(&stack, &version(2, false), "test", None).await;
    forge(&stack, &version(3, false), "test", Some(&stranger)).await;
    forge(&stack, &version(4, false), "svc:test", Some(&service)).await;
    // After them, a version signed by the publisher key.
    stack
        .publish(&sortie_tests::GATED.replace("version: 1", "version: 5"))
        .await;

    let start = |run: &str, graph_version: u32| {
        let mut command = start_run(run, "gated", r#"{"amount": 5}"#);
        if let sortie_wire::records::CommandBody::StartRun(start) = &mut command.body {
            start.graph_version = Some(graph_version as i32);
        }
        command
    };
    // The signed version is taken (the reducer has read past the forged ones)...
    stack.send_signed(&start("run-v5", 5), &service).await;
    let waiting = stack
        .wait_for_states("the run on @5", &["run-v5".to_owned()], LONG, |s| {
            s.status != RunStatus::Running
        })
        .await;
    assert_eq!(waiting["run-v5"].status, RunStatus::WaitingApproval);
    // ...the forged one is not.
    stack.send_signed(&start("run-v4", 4), &service).await;
    let code = sortie_tests::wait_for("the answer to the start on @4", LONG, || async {
        stack.events().await.get("run-v4").and_then(|history| {
            history.iter().find_map(|e| match &e.body {
                EventBody::CommandRejected { code, .. } => Some(code.clone()),
                EventBody::CommandAccepted { .. } => Some("accepted".to_owned()),
                _ => None,
            })
        })
    })
    .await;
    assert_eq!(
        code, "unknown_graph",
        "a start on the forged version is refused"
    );
    let refunds = executor
        .seen
        .lock()
        .expect("seen")
        .iter()
        .filter(|i| i.node == "refund")
        .count();
    assert_eq!(refunds, 0, "no refund ran unapproved");
    let metrics = scrape(&reducer.metrics_url().await).await;
    assert_eq!(
        metrics.get("sortie_reducer_graph_records_untrusted"),
        Some(&3.0)
    );
    let log = reducer.own_log_text();
    for reason in [
        "it is not signed, and signed graphs are required",
        "unknown signing key",
        "may not publish graphs",
    ] {
        assert!(log.contains(reason), "the reducer says why: {reason}");
    }

    // The gateway does not serve the forged versions either.
    sortie_tests::wait_until(
        "the gateway to refuse the three forged graphs",
        LONG,
        || {
            let url = url.clone();
            async move {
                scrape(&url)
                    .await
                    .get("sortie_gateway_graph_records_untrusted")
                    .copied()
                    == Some(3.0)
            }
        },
    )
    .await;
    let started = reqwest::Client::new()
        .post(format!("{url}/v1/runs"))
        .bearer_auth("tok-alice")
        .json(&serde_json::json!({"graph_id": "gated", "graph_version": 4, "input": {"amount": 5}}))
        .send()
        .await
        .expect("POST /v1/runs");
    let status = started.status().as_u16();
    let body = started.text().await.unwrap_or_default();
    assert_eq!(status, 422, "{body}");
}

/// Issue #57 item 1: graphs belong to a tenant. A publisher key scoped to tenant `globex`
/// signs `gated@2` without its gate as globex's own graph (as any writer of the topic
/// could produce it), and the same ungated `gated@2` as every tenant's. The reducer and
/// gateway take the first into globex's namespace only and refuse the second (a global
/// graph needs a key for `*`): `acme`'s unpinned start still runs the gated `gated@1` and
/// waits for approval, `acme` cannot pin `@2` (422 at the gateway, `unknown_graph` at the
/// fold), and `globex`'s start runs its own version, pinned as `globex/gated`. Publishing
/// through the library with a key the keyring does not allow for the graph's tenant is
/// refused before anything is written. Seen red with `Graphs::resolve` taking the latest
/// version of the id in any namespace (the flat table of before): acme's run succeeded
/// on the ungated version, its refund unapproved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_graph_never_reaches_another_tenant() {
    use sortie_core::{EventBody, RunStatus};
    use sortie_tests::stack::{start_run, succeed, Stack};
    use sortie_wire::signing::{Keyring, Signer};
    const LONG: Duration = Duration::from_secs(90);
    let stack = Stack::start("graphs-tenants", &[sortie_tests::GATED]).await;
    let service = Signer::generate("svc-1").expect("key");
    let globex = Signer::generate("globex-pub").expect("key");
    let mut publisher = globex.entry("svc:globex", &["globex".to_owned()], &[], false);
    publisher.publisher = true;
    let keyring = stack.write_keyring(&[
        service.entry(
            "svc:test",
            &["acme".to_owned(), "globex".to_owned()],
            &["approver".to_owned(), "operator".to_owned()],
            false,
        ),
        publisher.clone(),
    ]);
    let ring = keyring.to_str().expect("path");
    let _reducer = stack.reducer_with("0", &["--keyring", ring, "--require-signatures"]);
    let executor = stack.executor("default", succeed);
    let (_gateway, url) = stack
        .gateway_process_with(
            &stack.dir.join("gateway"),
            &["acme:user:alice:approver:tok-alice"],
            &["--keyring", ring, "--require-signatures"],
        )
        .await;

    let ungated = || {
        let text = sortie_tests::GATED.replace("version: 1", "version: 2").replace(
            "    interrupt_before: {reason: refunds need a human, required_role: approver, timeout: 24h}\n",
            "",
        );
        Graph::parse(&text).expect("a valid graph")
    };
    let mut owned = ungated();
    owned.owner = Some("globex".into());
    assert_eq!(owned.key(), "globex/gated@2");
    forge(&stack, &owned, "svc:globex", Some(&globex)).await;
    forge(&stack, &ungated(), "svc:globex", Some(&globex)).await;
    // The library refuses to write what readers with this keyring would refuse.
    let trust = graphs::Trust {
        keyring: Keyring::parse(&std::fs::read_to_string(&keyring).expect("keyring"))
            .expect("keyring parses"),
        require: true,
    };
    let mut global_v3 = ungated();
    global_v3.version = 3;
    let refused = graphs::publish_signed(
        &stack.kafka,
        &stack.codec,
        &stack.topics,
        &global_v3,
        "svc:globex",
        NOW,
        Some(&globex),
        Some(&trust),
    )
    .await;
    assert!(
        matches!(&refused, Err(graphs::Error::Signing(why)) if why.contains("every tenant")),
        "{refused:?}"
    );

    let mut acme = start_run("run-acme", "gated", r#"{"amount": 5}"#);
    acme.tenant = "acme".into();
    stack.send_signed(&acme, &service).await;
    let mut theirs = start_run("run-globex", "gated", r#"{"amount": 5}"#);
    theirs.tenant = "globex".into();
    stack.send_signed(&theirs, &service).await;
    let states = stack
        .wait_for_states(
            "both starts",
            &["run-acme".to_owned(), "run-globex".to_owned()],
            LONG,
            |s| s.status == RunStatus::WaitingApproval || s.status == RunStatus::Succeeded,
        )
        .await;
    let (acme_run, globex_run) = (&states["run-acme"], &states["run-globex"]);
    assert_eq!(
        acme_run.status,
        RunStatus::WaitingApproval,
        "acme's gate held"
    );
    assert_eq!(
        (acme_run.graph_id.as_str(), acme_run.graph_version),
        ("gated", 1)
    );
    assert_eq!(
        (globex_run.graph_id.as_str(), globex_run.graph_version),
        ("globex/gated", 2)
    );
    let refunds: Vec<String> = executor
        .seen
        .lock()
        .expect("seen")
        .iter()
        .filter(|i| i.node == "refund")
        .map(|i| i.run_id.clone())
        .collect();
    assert_eq!(
        refunds,
        ["run-globex"],
        "only globex's own ungated run refunded"
    );

    // acme cannot pin globex's version, at the fold...
    let mut pinned = start_run("run-acme-2", "gated", r#"{"amount": 5}"#);
    pinned.tenant = "acme".into();
    if let sortie_wire::records::CommandBody::StartRun(start) = &mut pinned.body {
        start.graph_version = Some(2);
    }
    stack.send_signed(&pinned, &service).await;
    let code = sortie_tests::wait_for("the answer to acme's start on @2", LONG, || async {
        stack.events().await.get("run-acme-2").and_then(|history| {
            history.iter().find_map(|e| match &e.body {
                EventBody::CommandRejected { code, .. } => Some(code.clone()),
                EventBody::CommandAccepted { .. } => Some("accepted".to_owned()),
                _ => None,
            })
        })
    })
    .await;
    assert_eq!(code, "unknown_graph");
    // ...and at the gateway.
    for graph_id in ["gated", "globex/gated"] {
        let started = reqwest::Client::new()
            .post(format!("{url}/v1/runs"))
            .bearer_auth("tok-alice")
            .json(&serde_json::json!({"graph_id": graph_id, "graph_version": 2, "input": {"amount": 5}}))
            .send()
            .await
            .expect("POST /v1/runs");
        let status = started.status().as_u16();
        let body = started.text().await.unwrap_or_default();
        assert_eq!(status, 422, "{graph_id}: {body}");
    }
}

/// A node whose `queue` has no topic (a typo any tenant can publish) fails its own step,
/// `unknown_queue`, naming the topic — it does not stop its partition: a run behind it on
/// the same partition (one partition here) still finishes. Seen red with the reducer's
/// topic check skipped (`KnownTopics::exists` always true): Kafka refused the intent for
/// its destination, the partition stopped, and the second run never ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_without_a_topic_fails_its_step_not_the_partition() {
    use sortie_core::RunStatus;
    use sortie_tests::stack::{start_run, succeed, Stack};
    const LONG: Duration = Duration::from_secs(90);
    let typo = "id: typo\nversion: 1\nnodes:\n  - {id: a, tool: echo, side_effect: pure, queue: no-such-queue, retry: {max_attempts: 2, initial_backoff: 100ms}}\n";
    let fine = "id: fine\nversion: 1\nnodes:\n  - {id: a, tool: echo, side_effect: pure}\n";
    let stack = Stack::builder("graphs-typo-queue")
        .partitions(1)
        .graphs(&[typo, fine])
        .start()
        .await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    stack.send(&start_run("run-typo", "typo", "{}")).await;
    stack.send(&start_run("run-fine", "fine", "{}")).await;
    let states = stack
        .wait_for_states(
            "both runs to end",
            &["run-typo".to_owned(), "run-fine".to_owned()],
            LONG,
            |s| s.status.is_terminal(),
        )
        .await;
    assert_eq!(states["run-fine"].status, RunStatus::Succeeded);
    let typo = &states["run-typo"];
    assert_eq!(typo.status, RunStatus::Failed);
    let error = typo.steps["a#1"].error.clone().unwrap_or_default();
    assert!(error.starts_with("unknown_queue:"), "{error}");
    assert!(error.contains("no-such-queue"), "{error}");
    assert_eq!(typo.steps["a#1"].attempt, 2, "retried by its policy");
}
