//! `sortie reducer`: one reducer instance, until Ctrl-C or SIGTERM.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sortie_reducer::driver::{self, ReducerConfig};
use sortie_reducer::fault::FaultPoint;
use sortie_wire::Topics;

#[derive(Debug, clap::Args)]
pub struct Args {
    // --bootstrap-servers, --registry-url, --prefix, --kafka-properties.
    #[command(flatten)]
    connection: crate::connection::Connection,
    /// Where the sled cache lives (a cache: deleting it costs a cold restore, nothing else).
    #[arg(
        long,
        env = "SORTIE__REDUCER__DATA_DIR",
        default_value = "target/dev/reducer"
    )]
    data_dir: PathBuf,
    /// The sled cache's page cache, in bytes. After counting every cached run (a cold
    /// restore) the store is opened again when it held more than this.
    #[arg(
        long,
        env = "SORTIE__REDUCER__STORE_CACHE_BYTES",
        default_value_t = sortie_reducer::store::CACHE_CAPACITY,
        value_parser = clap::value_parser!(u64).range(sortie_reducer::store::MIN_CACHE_CAPACITY..)
    )]
    store_cache_bytes: u64,
    /// Bytes of run states the cache samples before it trains the zstd dictionary it packs
    /// states against (once, while it has none).
    #[arg(
        long,
        env = "SORTIE__REDUCER__STORE_DICTIONARY_AFTER",
        default_value_t = sortie_reducer::pack::TRAIN_AFTER as u64,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    store_dictionary_after: u64,
    /// Stable identity of this instance (its producers' transactional ids derive from it;
    /// no `#`).
    #[arg(long, env = "SORTIE__REDUCER__INSTANCE_ID", default_value = "0")]
    instance_id: String,
    /// Use static group membership (group.instance.id = instance id).
    #[arg(long, env = "SORTIE__REDUCER__STATIC_MEMBERSHIP")]
    static_membership: bool,
    #[arg(
        long,
        env = "SORTIE__REDUCER__COMMIT_INTERVAL_MS",
        default_value_t = 100
    )]
    commit_interval_ms: u64,
    /// Keep a batch open at least this long even when no input is waiting (0: commit as
    /// soon as no input waits). Larger transactions for more latency.
    #[arg(long, env = "SORTIE__REDUCER__BATCH_LINGER_MS", default_value_t = 0)]
    batch_linger_ms: u64,
    #[arg(long, env = "SORTIE__REDUCER__MAX_BATCH", default_value_t = 500)]
    max_batch: usize,
    #[arg(
        long,
        env = "SORTIE__REDUCER__SESSION_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    session_timeout_ms: u64,
    /// Largest record value accepted; larger ones are dead-lettered.
    #[arg(long, env = "SORTIE__REDUCER__MAX_PAYLOAD_BYTES", default_value_t = 1024 * 1024)]
    max_payload_bytes: usize,
    /// The keyring command and graph signatures are checked against (YAML `keys: [...]`,
    /// see `sortie keys new`); re-read when the file changes.
    #[arg(long, env = "SORTIE_KEYRING")]
    keyring: Option<PathBuf>,
    /// Refuse unsigned commands (`CommandRejected{code: unauthenticated}`) and unsigned
    /// graphs (not taken as published). Production sets it; without it unsigned ones are
    /// taken as before, signed ones are checked.
    #[arg(long, env = "SORTIE_REQUIRE_SIGNATURES")]
    require_signatures: bool,
    /// The reducer's own key (a file from `sortie keys new`): it signs the commands the
    /// reducer produces for other runs (a child run's start and cancel). Reducers that
    /// require signatures need it in their keyring as a delegate of the runs' tenants.
    #[arg(long, env = "SORTIE__REDUCER__SIGNING_KEY")]
    signing_key: Option<std::path::PathBuf>,
    /// A signed command is refused (`outside_window`) unless it was issued at most this
    /// long before the broker took it; its command id is remembered that long, and a copy
    /// is refused (`replayed`).
    #[arg(
        long,
        env = "SORTIE__REDUCER__COMMAND_WINDOW_MS",
        default_value_t = 300_000
    )]
    command_window_ms: u64,
    /// How far after the broker's time a signed command's `issued_at` may be (clocks).
    #[arg(
        long,
        env = "SORTIE__REDUCER__COMMAND_SKEW_MS",
        default_value_t = 30_000
    )]
    command_skew_ms: u64,
    /// Start even if the commands topic keeps producer time (`CreateTime`): anyone who
    /// produces a command then chooses its time. Only for tests that speak for a client
    /// hours later; without it the reducer refuses to start on such a topic.
    #[arg(long)]
    allow_create_time: bool,
    #[command(flatten)]
    seal: crate::seal::SealArgs,
    /// How long past its own timeout a Kafka transactional call may block before the
    /// reducer exits with status 75 for its supervisor to restart it with fresh clients
    /// (librdkafka#5456: a call that ignores its timeout when the group coordinator's
    /// broker dies).
    #[arg(
        long,
        env = "SORTIE__REDUCER__STALL_GRACE_MS",
        default_value_t = 30_000
    )]
    stall_grace_ms: u64,
    /// Crash tests only: die on purpose at this point (reducer.before_commit,
    /// reducer.after_commit, reducer.restore_before_marker), hang
    /// (reducer.hang_in_send_offsets), leave the group (reducer.leave_group), or fail once
    /// without dying (reducer.abort_in_flight, reducer.fail_mid_fold,
    /// reducer.unreadable_cache). Each is described in `sortie_reducer::fault`.
    #[arg(long, env = "SORTIE_FAULT")]
    fault: Option<FaultPoint>,
    /// With --fault: die on the Nth pass through the point (1: the first).
    #[arg(long, env = "SORTIE_FAULT_AFTER", default_value_t = 1)]
    fault_after: u32,
    /// Where to serve /metrics, /healthz and /readyz (port 0: any free port; the bound
    /// address is printed). Default 127.0.0.1:9464, best effort.
    #[arg(long, env = "SORTIE__REDUCER__METRICS_ADDR")]
    metrics_addr: Option<String>,
    /// Print the effective configuration and exit.
    #[arg(long)]
    print_config: bool,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let bootstrap = args.connection.brokers.bootstrap_servers.clone();
    let registry_url = args.connection.registry_url.clone();
    let mut config = ReducerConfig::new(
        args.connection.kafka_config()?,
        args.connection.registry_url,
        Topics::new(args.connection.prefix),
        args.data_dir,
    );
    config.instance_id = args.instance_id;
    config.store_cache_bytes = args.store_cache_bytes;
    config.store_dictionary_after = args.store_dictionary_after as usize;
    config.static_membership = args.static_membership;
    config.commit_interval = Duration::from_millis(args.commit_interval_ms);
    config.batch_linger = Duration::from_millis(args.batch_linger_ms);
    config.max_batch = args.max_batch;
    config.session_timeout = Duration::from_millis(args.session_timeout_ms);
    config.max_payload_bytes = args.max_payload_bytes;
    config.keyring = args.keyring;
    config.require_signatures = args.require_signatures;
    config.signing_key = args.signing_key;
    config.command_window = Duration::from_millis(args.command_window_ms);
    config.command_skew = Duration::from_millis(args.command_skew_ms);
    config.allow_create_time = args.allow_create_time;
    config.seal = args.seal.config();
    config.stall_grace = Duration::from_millis(args.stall_grace_ms);
    config.fault = args.fault;
    config.fault_after = args.fault_after;
    if args.print_config {
        println!("{config:#?}");
        return Ok(());
    }
    if let Some(point) = config.fault {
        tracing::warn!(%point, pass = config.fault_after, "Fault injection is ON: this reducer will die (or hang, abort a batch or leave its group, as the point says) there.");
    }
    let shutdown = Arc::new(AtomicBool::new(false));
    let flag = shutdown.clone();
    tokio::spawn(async move {
        crate::shutdown_signal().await;
        tracing::info!("Shutting down: finishing the current batch.");
        flag.store(true, Ordering::Relaxed);
    });
    let metrics = crate::telemetry::install_metrics(&[sortie_reducer::metrics::HISTOGRAM_BUCKETS])?;
    sortie_reducer::metrics::describe();
    let health = sortie_reducer::health::Health::default();
    let readiness = health.clone();
    crate::telemetry::serve_ops(
        args.metrics_addr.as_deref(),
        "127.0.0.1:9464",
        metrics,
        Arc::new(move || readiness.readiness()),
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e:#}; choose another address with --metrics-addr"))?;
    let runtime = tokio::runtime::Handle::current();
    let ran = tokio::task::spawn_blocking(move || {
        driver::run_with_health(config, runtime, shutdown, health)
    })
    .await?;
    // Given up on Kafka or the registry (a message about the commands topic's configs, a
    // timeout): if one of them does not answer now, that is said first, with its flag.
    match ran {
        Ok(()) => Ok(()),
        Err(error) => {
            Err(crate::reach::explain(error.into(), &bootstrap, Some(&registry_url)).await)
        }
    }
}
