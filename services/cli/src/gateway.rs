//! `sortie gateway`: the HTTP API and its read view, until Ctrl-C or SIGTERM. Prints the
//! bound address as the first line on stdout (so `--addr 127.0.0.1:0` is usable).

use std::path::PathBuf;
use std::time::Duration;

use sortie_gateway::fault::FaultPoint;
use sortie_gateway::{GatewayConfig, TokenEntry};

#[derive(Debug, clap::Args)]
pub struct Args {
    // --bootstrap-servers, --registry-url, --prefix, --kafka-properties.
    #[command(flatten)]
    connection: crate::telemetry::Connection,
    /// Address to listen on (port 0: any free port; the bound address is printed).
    #[arg(long, env = "SORTIE__GATEWAY__ADDR", default_value = "127.0.0.1:8080")]
    addr: String,
    /// Where the view's sled store lives (a cache of Kafka: deleting it costs a catch-up).
    #[arg(
        long,
        env = "SORTIE__GATEWAY__DATA_DIR",
        default_value = "target/dev/gateway"
    )]
    data_dir: PathBuf,
    /// A dev token, hashed at start: TENANT:PRINCIPAL:ROLE1,ROLE2:TOKEN (repeatable).
    #[arg(long = "token")]
    tokens: Vec<String>,
    /// YAML file of hashed tokens: `tokens: [{sha256, tenant, principal, roles}]`.
    #[arg(long, env = "SORTIE__GATEWAY__TOKENS_FILE")]
    tokens_file: Option<PathBuf>,
    /// How long a write waits for the reducer's answer (then 504 with the command id).
    #[arg(
        long,
        env = "SORTIE__GATEWAY__ANSWER_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    answer_timeout_ms: u64,
    /// How long a read with min_position waits for the view.
    #[arg(
        long,
        env = "SORTIE__GATEWAY__READ_WAIT_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    read_wait_timeout_ms: u64,
    /// Largest request body accepted.
    #[arg(long, env = "SORTIE__GATEWAY__MAX_BODY_BYTES", default_value_t = 256 * 1024)]
    max_body_bytes: usize,
    /// Live event streams one tenant may hold open at once (429 `too_many_streams` above).
    #[arg(
        long,
        env = "SORTIE__GATEWAY__MAX_STREAMS_PER_TENANT",
        default_value_t = 32
    )]
    max_streams_per_tenant: usize,
    /// YAML file of spend budgets: `default` and per-`tenants` limits (tokens, cost_usd,
    /// tool_calls, wall_time) and `prices` per model (input_per_1k, output_per_1k, USD).
    #[arg(long, env = "SORTIE__GATEWAY__BUDGETS_FILE")]
    budgets_file: Option<PathBuf>,
    /// Sign every published command with this key file (`sortie keys new --delegate`):
    /// reducers that require signatures take the gateway's commands only signed.
    #[arg(long, env = "SORTIE_SIGNING_KEY")]
    signing_key: Option<PathBuf>,
    /// Crash tests only: die on purpose at this point (gateway.after_publish).
    #[arg(long, env = "SORTIE_FAULT")]
    fault: Option<FaultPoint>,
    /// Print the effective configuration (token hashes only) and exit.
    #[arg(long)]
    print_config: bool,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let mut config = GatewayConfig::new(
        args.connection.kafka_config()?,
        args.connection.registry_url,
        args.data_dir,
    );
    config.prefix = args.connection.prefix;
    config.answer_timeout = Duration::from_millis(args.answer_timeout_ms);
    config.read_wait_timeout = Duration::from_millis(args.read_wait_timeout_ms);
    config.max_body_bytes = args.max_body_bytes;
    config.max_streams_per_tenant = args.max_streams_per_tenant;
    config.fault = args.fault;
    config.signing_key = args.signing_key;
    if let Some(path) = &args.budgets_file {
        config.budgets = sortie_gateway::config::Budgets::load(path)?;
    }
    if let Some(path) = &args.tokens_file {
        config
            .tokens
            .extend(sortie_gateway::config::load_tokens(path)?);
    }
    for spec in &args.tokens {
        config.tokens.push(TokenEntry::from_dev_spec(spec)?);
    }
    if args.print_config {
        println!("{config:#?}");
        return Ok(());
    }
    if let Some(point) = config.fault {
        tracing::warn!(%point, "Fault injection is ON: this gateway will die at that point.");
    }
    if config.tokens.is_empty() {
        tracing::warn!("No tokens are configured: every API request will be refused (401).");
    }
    let metrics = crate::telemetry::install_metrics(&[sortie_gateway::metrics::HISTOGRAM_BUCKETS])?;
    sortie_gateway::metrics::describe();
    sortie_gateway::metrics::expose(metrics);
    let listener = tokio::net::TcpListener::bind(&args.addr).await?;
    println!("{}", listener.local_addr()?);
    sortie_gateway::serve(config, listener, crate::shutdown_signal()).await?;
    Ok(())
}
