//! `sortie executor` as a library: its flags ([`Args`]) and what it does with them
//! ([`run`]), so an executor binary of your own, with your handlers beside the built-in
//! ones, takes the same flags and environment variables, reads the same Kafka properties
//! file and serves the same `/metrics`, `/healthz` and `/readyz` ([`main`]). It runs until
//! Ctrl-C or SIGTERM, then finishes or hands back its in-flight intents.

use std::time::Duration;

use sortie_process::{connection, seal, telemetry};
use sortie_wire::Topics;

use crate::{Egress, ExecutorConfig, FaultPoint, Handlers};

/// The flags of `sortie executor`, each with its `SORTIE__EXECUTOR__*` variable.
#[derive(Debug, clap::Args)]
pub struct Args {
    // --bootstrap-servers, --registry-url, --prefix, --kafka-properties.
    #[command(flatten)]
    connection: connection::Connection,
    /// Queues to serve (`sortie.intents.<queue>`); repeat the flag or separate by commas.
    #[arg(
        long = "queue",
        env = "SORTIE__EXECUTOR__QUEUES",
        value_delimiter = ',',
        default_value = "default"
    )]
    queues: Vec<String>,
    /// This process's name in results; with --static-membership, its group.instance.id.
    #[arg(long, env = "SORTIE__EXECUTOR__ID")]
    executor_id: Option<String>,
    /// Static group membership: a restart with the same --executor-id takes its
    /// partitions back at once instead of after the session timeout.
    #[arg(
        long,
        env = "SORTIE__EXECUTOR__STATIC_MEMBERSHIP",
        requires = "executor_id"
    )]
    static_membership: bool,
    /// Most intents running at once, per queue.
    #[arg(long, env = "SORTIE__EXECUTOR__MAX_IN_FLIGHT", default_value_t = 16)]
    max_in_flight: usize,
    /// Most intents of one tenant running at once, per queue (default: ¾ of
    /// --max-in-flight), so one tenant never holds every slot.
    #[arg(long, env = "SORTIE__EXECUTOR__TENANT_MAX_IN_FLIGHT")]
    tenant_max_in_flight: Option<usize>,
    /// A tenant's share of a queue's slots when several wait, as TENANT=WEIGHT (1 to
    /// 1000; unnamed tenants weigh 1). Repeatable; comma-separated in the variable.
    #[arg(
        long = "tenant-weight",
        env = "SORTIE__EXECUTOR__TENANT_WEIGHTS",
        value_delimiter = ',',
        value_parser = crate::fair::FairShareConfig::parse_weight
    )]
    tenant_weights: Vec<(String, u32)>,
    /// Most intents read ahead and held for their tenant's turn, per queue (default: 64
    /// per slot, 64 to 4,096).
    #[arg(long, env = "SORTIE__EXECUTOR__MAX_HELD")]
    max_held: Option<usize>,
    #[arg(
        long,
        env = "SORTIE__EXECUTOR__COMMIT_INTERVAL_MS",
        default_value_t = 100
    )]
    commit_interval_ms: u64,
    /// How long a rebalance or a shutdown waits for in-flight intents.
    #[arg(
        long,
        env = "SORTIE__EXECUTOR__DRAIN_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    drain_timeout_ms: u64,
    #[arg(
        long,
        env = "SORTIE__EXECUTOR__SESSION_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    session_timeout_ms: u64,
    /// An attempt's timeout when its node sets none.
    #[arg(
        long,
        env = "SORTIE__EXECUTOR__DEFAULT_TIMEOUT_MS",
        default_value_t = 30_000
    )]
    default_timeout_ms: u64,
    /// Where large values are stored: `file:///path` or `s3://bucket/prefix` (region and
    /// credentials from the AWS environment variables). Arguments referencing a blob are
    /// resolved from it before the handler runs; an output over --blob-threshold is
    /// stored there and reported by reference. Unset: outputs stay inline.
    #[arg(long, env = "SORTIE__EXECUTOR__BLOB_STORE")]
    blob_store: Option<String>,
    /// The endpoint of an S3-compatible server (MinIO, Ceph, ...) for an s3:// store.
    #[arg(
        long,
        env = "SORTIE__EXECUTOR__BLOB_S3_ENDPOINT",
        requires = "blob_store"
    )]
    blob_s3_endpoint: Option<String>,
    /// An output whose JSON is larger than this many bytes goes to the blob store.
    #[arg(long, env = "SORTIE__EXECUTOR__BLOB_THRESHOLD", default_value_t = sortie_blob::DEFAULT_THRESHOLD)]
    blob_threshold: usize,
    #[command(flatten)]
    seal: seal::SealArgs,
    /// How long past its own timeout an offset commit may block before the executor
    /// exits with status 75 for its supervisor to restart it with fresh clients (a
    /// wedged librdkafka call; see `sortie_kafka::watchdog`).
    #[arg(
        long,
        env = "SORTIE__EXECUTOR__STALL_GRACE_MS",
        default_value_t = 30_000
    )]
    stall_grace_ms: u64,
    /// Allow the built-in handlers (http, llm, mcp) to reach this destination for every
    /// tenant: a CIDR (10.0.0.0/8), an address, or a host name (*.name for its
    /// subdomains; allowed whatever it resolves to). By default loopback, private,
    /// link-local and other non-public addresses are refused. Repeat the flag or separate
    /// by commas.
    #[arg(
        long = "egress-allow",
        env = "SORTIE__EXECUTOR__EGRESS_ALLOW",
        value_delimiter = ',',
        value_name = "CIDR|HOST"
    )]
    egress_allow: Vec<String>,
    /// As --egress-allow, for one tenant's steps only: <tenant>=<CIDR|HOST>. Repeat the
    /// flag or separate by commas.
    #[arg(
        long = "egress-allow-tenant",
        env = "SORTIE__EXECUTOR__EGRESS_ALLOW_TENANT",
        value_delimiter = ',',
        value_name = "TENANT=CIDR|HOST"
    )]
    egress_allow_tenant: Vec<String>,
    /// A directory of tenants' secrets: a graph's secret variable
    /// SORTIE_SECRET_<tenant>__<NAME> not set in the environment is read from the file
    /// <dir>/<tenant>/<NAME> (a Kubernetes Secret per tenant mounted there).
    #[arg(long, env = "SORTIE__EXECUTOR__SECRETS_DIR")]
    secrets_dir: Option<std::path::PathBuf>,
    /// Crash tests only: die on purpose at this point (executor.before_call,
    /// executor.after_call, executor.after_result), hang in the first offset commit
    /// (executor.hang_in_commit), or leave the group (executor.leave_group).
    #[arg(long, env = "SORTIE_FAULT")]
    fault: Option<FaultPoint>,
    /// Where to serve /metrics, /healthz and /readyz (port 0: any free port; the bound
    /// address is printed). Default 127.0.0.1:9465, best effort.
    #[arg(long, env = "SORTIE__EXECUTOR__METRICS_ADDR")]
    metrics_addr: Option<String>,
    /// Print the effective configuration and exit.
    #[arg(long)]
    print_config: bool,
}

impl Args {
    /// `--bootstrap-servers`.
    pub fn bootstrap_servers(&self) -> &str {
        &self.connection.brokers.bootstrap_servers
    }

    /// `--registry-url`.
    pub fn registry_url(&self) -> &str {
        &self.connection.registry_url
    }
}

/// `--queue`: at least one queue, each a legal part of a topic name
/// (`<prefix>intents.<queue>`), refused before anything starts.
fn queues(given: &[String]) -> anyhow::Result<Vec<String>> {
    let named: Vec<String> = given
        .iter()
        .map(|q| q.trim().to_owned())
        .filter(|q| !q.is_empty())
        .collect();
    if named.is_empty() {
        anyhow::bail!(
            "no queue to serve: name one with --queue NAME (repeat it, or separate by commas; env SORTIE__EXECUTOR__QUEUES)"
        );
    }
    if let Some(bad) = named.iter().find(|q| {
        !q.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    }) {
        anyhow::bail!(
            "--queue {bad:?} cannot be part of a topic name (intents.<queue>): use letters, digits, '.', '_' and '-'"
        );
    }
    Ok(named)
}

/// The command line of an executor binary of your own: [`Args`] and the logging flags.
#[derive(Debug, clap::Parser)]
#[command(version, about = "A Sortie executor: serves queues with its handlers")]
struct Standalone {
    #[command(flatten)]
    args: Args,
    #[command(flatten)]
    log: telemetry::LogArgs,
}

/// Everything `main` of an executor binary of your own does: parses the command line
/// (the flags of `sortie executor`, and `--log-level`/`--log-format`), starts logging and
/// [`run`]s with the handlers `handlers` makes (given the egress policy the flags set, for
/// [`Handlers::builtin_with`]).
///
/// ```no_run
/// # use sortie_executor::Handlers;
/// #[tokio::main]
/// async fn main() -> anyhow::Result<()> {
///     sortie_executor::command::main(|egress| {
///         let handlers = Handlers::builtin_with(egress);
///         // handlers.register("inventory", Inventory::default());
///         handlers
///     })
///     .await
/// }
/// ```
pub async fn main(handlers: impl FnOnce(&Egress) -> Handlers) -> anyhow::Result<()> {
    let cli = <Standalone as clap::Parser>::parse();
    telemetry::init_logging(&cli.log);
    run(cli.args, handlers).await
}

/// Serves the queues `args` names with the handlers `handlers` makes, with the metrics
/// and health server, until Ctrl-C or SIGTERM: `sortie executor` is
/// `run(args, Handlers::builtin_with)`.
pub async fn run(args: Args, handlers: impl FnOnce(&Egress) -> Handlers) -> anyhow::Result<()> {
    let queues = queues(&args.queues)?;
    let mut config = ExecutorConfig::new(
        args.connection.kafka_config()?,
        args.connection.registry_url,
        Topics::new(args.connection.prefix),
        queues,
    );
    if let Some(id) = args.executor_id {
        config.executor_id = id;
    }
    config.static_membership = args.static_membership;
    config.max_in_flight = args.max_in_flight;
    config.fair_share = crate::fair::FairShareConfig {
        tenant_max_in_flight: args.tenant_max_in_flight,
        weights: args.tenant_weights.into_iter().collect(),
        max_held: args.max_held,
    };
    config.commit_interval = Duration::from_millis(args.commit_interval_ms);
    config.drain_timeout = Duration::from_millis(args.drain_timeout_ms);
    config.session_timeout = Duration::from_millis(args.session_timeout_ms);
    config.default_timeout = Duration::from_millis(args.default_timeout_ms);
    config.stall_grace = Duration::from_millis(args.stall_grace_ms);
    config.fault = args.fault;
    config.seal = args.seal.config();
    config.blobs = args.blob_store.map(|store| sortie_blob::BlobConfig {
        store,
        s3_endpoint: args.blob_s3_endpoint,
        threshold: args.blob_threshold,
    });
    if let Some(dir) = args.secrets_dir {
        crate::secrets::set_dir(dir);
    }
    let mut egress = Egress::default();
    for rule in args.egress_allow.iter().filter(|r| !r.trim().is_empty()) {
        egress.allow(rule)?;
    }
    for spec in args
        .egress_allow_tenant
        .iter()
        .filter(|r| !r.trim().is_empty())
    {
        egress.allow_tenant_spec(spec)?;
    }
    if args.print_config {
        println!("{config:#?}");
        println!("{egress:#?}");
        return Ok(());
    }
    if let Some(point) = config.fault {
        tracing::warn!(%point, "Fault injection is ON: this executor will die (or hang, or leave its group, as the point says) there.");
    }
    let metrics = telemetry::install_metrics(&[crate::metrics::HISTOGRAM_BUCKETS])?;
    crate::metrics::describe();
    let health = crate::health::Health::default();
    let readiness = health.clone();
    telemetry::serve_ops(
        args.metrics_addr.as_deref(),
        "127.0.0.1:9465",
        metrics,
        std::sync::Arc::new(move || readiness.readiness()),
    )
    .await?;
    crate::run_with_health(
        config,
        handlers(&egress),
        sortie_process::shutdown_signal(),
        health,
    )
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn queues_are_named_and_fit_a_topic_name() {
        let given = |list: &[&str]| {
            super::queues(&list.iter().map(|q| (*q).to_owned()).collect::<Vec<_>>())
        };
        assert_eq!(given(&[" a ", "b.c-d_e"]).expect("fine"), ["a", "b.c-d_e"]);
        assert!(given(&[""]).is_err());
        assert!(given(&[]).is_err());
        assert!(given(&["a b"]).is_err());
        assert!(given(&["a/b"]).is_err());
    }
}
