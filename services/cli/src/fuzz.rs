//! `sortie fuzz`: the hostile-input campaign, long mode (`sortie_fuzz::campaign`). It
//! starts its own stack — a broker (or uses `--bootstrap`), the registry, the topology
//! under a fresh prefix, a canary graph, a reducer, an executor and a gateway as
//! processes — sends `--cases` hostile records drawn from `--seed`, and hostile HTTP
//! requests to every gateway route, while a canary tenant keeps starting runs, then
//! checks the stack with `sortie audit replay --verify`. Prints
//! one JSON report; exits 1 when it found a problem.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use serde_json::json;
use sortie_bench::stack::{self, Service};
use sortie_devkit::local::{BrokerConfig, LocalBroker};
use sortie_fuzz::campaign::{self, Plan, Target};
use sortie_kafka::KafkaConfig;
use sortie_wire::Topics;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Hostile Kafka records to send.
    #[arg(long, default_value_t = 20_000)]
    cases: usize,
    /// The seed the records are drawn from (default: a fresh one, printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Hostile HTTP requests sent to the gateway meanwhile [default: a fifth of --cases].
    #[arg(long)]
    http_cases: Option<usize>,
    /// Canary runs started while the records go in.
    #[arg(long, default_value_t = 200)]
    canaries: usize,
    /// How long one canary run may take, in seconds.
    #[arg(long, default_value_t = 30)]
    canary_bound_s: u64,
    /// Use this broker instead of starting the campaign's own.
    #[arg(long)]
    bootstrap: Option<String>,
    /// The campaign's broker data, service logs and caches.
    #[arg(long, default_value = "target/fuzz")]
    data_dir: PathBuf,
    /// The campaign broker's port (the controller takes the next one).
    #[arg(long, default_value_t = 19492)]
    kafka_port: u16,
    /// Leave the campaign's broker running afterwards.
    #[arg(long)]
    keep_broker: bool,
}

const CANARY: &str = "id: canary\nversion: 1\nnodes:\n  - {id: a, tool: echo, side_effect: pure, args: {c: $input.canary}}\n  - {id: b, tool: echo, side_effect: pure, args: {c: $steps.a.output.c}}\nedges:\n  - {from: a, to: b}\n";

/// The gateway's tokens: the canary tenant starts runs; the hostile one has every role
/// and none.
const TOKENS: &[&str] = &[
    "canary:canary-svc:operator:tok-canary",
    "hostile:mallory:operator,approver:tok-mallory",
    "hostile:eve::tok-eve",
];

/// Waits (up to two minutes) until `url` answers 200.
async fn wait_ready(url: &str) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(response) = client.get(url).send().await {
            if response.status().is_success() {
                return Ok(());
            }
        }
        if std::time::Instant::now() > deadline {
            anyhow::bail!("{url} did not become ready in two minutes");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A free port on loopback, for a service's metrics server.
fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    eprintln!(
        "sortie fuzz: seed {seed} (--seed {seed} replays), {} cases",
        args.cases
    );
    let data_dir = std::fs::create_dir_all(&args.data_dir)
        .and_then(|()| std::fs::canonicalize(&args.data_dir))
        .with_context(|| format!("cannot use --data-dir {}", args.data_dir.display()))?;
    let mut own = None;
    let bootstrap = match &args.bootstrap {
        Some(bootstrap) => {
            crate::reach::kafka_via(
                bootstrap,
                "--bootstrap",
                "Point --bootstrap at yours, or leave it out for the campaign's own broker",
                crate::reach::PATIENCE,
            )
            .await?;
            bootstrap.clone()
        }
        None => {
            let broker = LocalBroker::new(BrokerConfig::new(
                data_dir.join("kafka"),
                args.kafka_port,
                stack::repo_file("dev/kafka/pom.xml")?,
            ));
            let starting = broker.clone();
            let running = tokio::task::spawn_blocking(move || starting.ensure_running()).await??;
            own = Some((broker, running.reused));
            running.bootstrap
        }
    };
    let outcome = campaign_on(&args, seed, &bootstrap, &data_dir).await;
    if let Some((broker, reused)) = own {
        if !reused && !args.keep_broker {
            tokio::task::spawn_blocking(move || broker.stop()).await??;
        }
    }
    let (report, audit_clean) = outcome?;
    let clean = report.problems.is_empty() && audit_clean;
    println!(
        "{}",
        serde_json::to_string_pretty(&json!({
            "campaign": report,
            "audit_verify_clean": audit_clean,
            "clean": clean,
        }))?
    );
    if !clean {
        std::process::exit(1);
    }
    Ok(())
}

async fn campaign_on(
    args: &Args,
    seed: u64,
    bootstrap: &str,
    data_dir: &Path,
) -> anyhow::Result<(campaign::Report, bool)> {
    let prefix = format!("fuzz.{}.", seed % 1_000_000_000);
    let dir = data_dir.join("runs").join(prefix.trim_end_matches('.'));
    std::fs::create_dir_all(&dir)?;
    let kafka = KafkaConfig::new(bootstrap.to_owned());
    let partitions = 6;
    stack::apply_topology(&kafka, &prefix, partitions, None, &["default".to_owned()]).await?;
    let registry = stack::ServedRegistry::start(&kafka, &format!("{prefix}_schemas")).await?;
    let codec = stack::codec(&registry.url);
    let topics = Topics::new(prefix.clone());
    let graph = sortie_core::Graph::parse(CANARY).map_err(|e| anyhow::anyhow!("{e}"))?;
    stack::publish_graph(&kafka, &codec, &topics, &graph).await?;

    let exe = std::env::current_exe()?;
    let common = |role: &str| -> Vec<String> {
        [
            role,
            "--bootstrap-servers",
            bootstrap,
            "--registry-url",
            &registry.url,
            "--prefix",
            &prefix,
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect()
    };
    let reducer_port = free_port()?;
    let mut reducer_args = common("reducer");
    reducer_args.extend(
        [
            "--data-dir",
            &dir.join("reducer").display().to_string(),
            "--metrics-addr",
            &format!("127.0.0.1:{reducer_port}"),
        ]
        .map(str::to_owned),
    );
    let mut executor_args = common("executor");
    executor_args
        .extend(["--queue", "default", "--executor-id", "fuzz-executor"].map(str::to_owned));
    let gateway_port = free_port()?;
    let mut gateway_args = common("gateway");
    gateway_args.extend(
        [
            "--addr",
            &format!("127.0.0.1:{gateway_port}"),
            "--data-dir",
            &dir.join("gateway").display().to_string(),
        ]
        .map(str::to_owned),
    );
    for token in TOKENS {
        gateway_args.extend(["--token".to_owned(), (*token).to_owned()]);
    }
    let mut services = vec![
        Service::spawn(&exe, &dir, "reducer", &reducer_args, "warn")?,
        Service::spawn(&exe, &dir, "executor", &executor_args, "warn")?,
        Service::spawn(&exe, &dir, "gateway", &gateway_args, "warn")?,
    ];
    let gateway_url = format!("http://127.0.0.1:{gateway_port}");
    wait_ready(&format!("{gateway_url}/readyz")).await?;
    let target = Target {
        bootstrap: bootstrap.to_owned(),
        topics,
        partitions,
        codec,
        canary_graph: ("canary".into(), 1),
        canary_tenant: "canary".into(),
        hostile_tenant: "hostile".into(),
        processes: vec![
            (
                "reducer".into(),
                services[0].pid(),
                format!("http://127.0.0.1:{reducer_port}/readyz"),
            ),
            ("executor".into(), services[1].pid(), String::new()),
            (
                "gateway".into(),
                services[2].pid(),
                format!("{gateway_url}/readyz"),
            ),
        ],
        gateway: Some(campaign::Gateway {
            url: gateway_url,
            hostile_tokens: vec!["tok-mallory".into(), "tok-eve".into()],
            canary_token: "tok-canary".into(),
            cases: args.http_cases.unwrap_or(args.cases / 5),
        }),
    };
    let plan = Plan {
        seed,
        cases: args.cases,
        canaries: args.canaries,
        canary_bound: Duration::from_secs(args.canary_bound_s),
        settle: Duration::from_secs(180),
        max_rss_bytes: 1024 * 1024 * 1024,
    };
    let report = campaign::run(&target, &plan).await;
    let audit = tokio::process::Command::new(&exe)
        .args([
            "audit",
            "replay",
            "--verify",
            "--bootstrap-servers",
            bootstrap,
            "--registry-url",
            &registry.url,
            "--prefix",
            &prefix,
        ])
        .env("RUST_LOG", "warn")
        .output()
        .await
        .context("running sortie audit replay --verify")?;
    for service in &mut services {
        service.stop();
    }
    registry.stop().await;
    if let Err(e) = stack::delete_topics(&kafka, &prefix).await {
        eprintln!("sortie fuzz: deleting the campaign's topics failed: {e}");
    }
    eprintln!("sortie fuzz: logs in {}", dir.display());
    Ok((report?, audit.status.success()))
}
