//! `sortie gateway`: the HTTP API and its read view, until Ctrl-C or SIGTERM. Prints the
//! bound address as the first line on stdout (so `--addr 127.0.0.1:0` is usable).

use std::path::PathBuf;
use std::time::Duration;

use sortie_gateway::config::ClaimNames;
use sortie_gateway::fault::FaultPoint;
use sortie_gateway::{GatewayConfig, JwksSource, JwtConfig, TokenEntry};

#[derive(Debug, clap::Args)]
pub struct Args {
    // --bootstrap-servers, --registry-url, --prefix, --kafka-properties.
    #[command(flatten)]
    connection: crate::connection::Connection,
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
    /// A dev token, hashed at start: TENANT:PRINCIPAL:ROLE1,ROLE2,@GROUP:TOKEN (repeatable;
    /// entries starting `@` are approver groups).
    #[arg(long = "token")]
    tokens: Vec<String>,
    /// YAML file of hashed tokens: `tokens: [{sha256, tenant, principal, roles, groups}]`;
    /// re-read when it changes (see --auth-reload-ms) and on SIGHUP.
    #[arg(long, env = "SORTIE__GATEWAY__TOKENS_FILE")]
    tokens_file: Option<PathBuf>,
    /// Accept JWT bearer tokens whose `iss` is this (needs --jwt-audience and a JWKS).
    #[arg(long, env = "SORTIE__GATEWAY__JWT_ISSUER", requires_all = ["jwt_audience"])]
    jwt_issuer: Option<String>,
    /// The audience a JWT's `aud` must hold.
    #[arg(long, env = "SORTIE__GATEWAY__JWT_AUDIENCE", requires = "jwt_issuer")]
    jwt_audience: Option<String>,
    /// A JWKS file with the issuer's public keys; re-read when it changes and on SIGHUP.
    #[arg(
        long,
        env = "SORTIE__GATEWAY__JWKS_FILE",
        requires = "jwt_issuer",
        conflicts_with = "jwks_url"
    )]
    jwks_file: Option<PathBuf>,
    /// A JWKS URL; fetched every --jwks-refresh-secs, on SIGHUP, and when a token names
    /// a key id the set lacks (at most every --jwks-refetch-min-ms).
    #[arg(long, env = "SORTIE__GATEWAY__JWKS_URL", requires = "jwt_issuer")]
    jwks_url: Option<String>,
    /// The claim holding the tenant (a token without it is refused).
    #[arg(
        long,
        env = "SORTIE__GATEWAY__JWT_TENANT_CLAIM",
        default_value = "tenant"
    )]
    jwt_tenant_claim: String,
    /// The claim holding the principal.
    #[arg(
        long,
        env = "SORTIE__GATEWAY__JWT_PRINCIPAL_CLAIM",
        default_value = "sub"
    )]
    jwt_principal_claim: String,
    /// The claim holding the roles (an array, or one space-separated string).
    #[arg(
        long,
        env = "SORTIE__GATEWAY__JWT_ROLES_CLAIM",
        default_value = "roles"
    )]
    jwt_roles_claim: String,
    /// The claim holding the approver groups (an array, or one space-separated string).
    #[arg(
        long,
        env = "SORTIE__GATEWAY__JWT_GROUPS_CLAIM",
        default_value = "groups"
    )]
    jwt_groups_claim: String,
    /// Clock skew allowed on a JWT's `exp` and `nbf`.
    #[arg(long, env = "SORTIE__GATEWAY__JWT_LEEWAY_SECS", default_value_t = 30)]
    jwt_leeway_secs: u64,
    /// How often a JWKS URL is fetched again.
    #[arg(
        long,
        env = "SORTIE__GATEWAY__JWKS_REFRESH_SECS",
        default_value_t = 300
    )]
    jwks_refresh_secs: u64,
    /// A token with an unknown key id fetches the JWKS URL again at most this often.
    #[arg(
        long,
        env = "SORTIE__GATEWAY__JWKS_REFETCH_MIN_MS",
        default_value_t = 10_000
    )]
    jwks_refetch_min_ms: u64,
    /// How often the tokens file and the JWKS file are checked for changes.
    #[arg(long, env = "SORTIE__GATEWAY__AUTH_RELOAD_MS", default_value_t = 2_000)]
    auth_reload_ms: u64,
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
    /// Largest request body accepted. Default: 256 KiB, or 16 MiB with --blob-store
    /// (large inputs are then stored by reference instead of travelling in the command).
    #[arg(long, env = "SORTIE__GATEWAY__MAX_BODY_BYTES")]
    max_body_bytes: Option<usize>,
    /// Where large run inputs and decision payloads are stored: `file:///path` or
    /// `s3://bucket/prefix` (region and credentials from the AWS environment variables).
    /// A value over --blob-threshold is stored there before the command is published and
    /// the command carries a reference; `GET /v1/runs/{id}/blobs/{sha256}` serves it.
    #[arg(long, env = "SORTIE__GATEWAY__BLOB_STORE")]
    blob_store: Option<String>,
    /// The endpoint of an S3-compatible server (MinIO, Ceph, ...) for an s3:// store.
    #[arg(
        long,
        env = "SORTIE__GATEWAY__BLOB_S3_ENDPOINT",
        requires = "blob_store"
    )]
    blob_s3_endpoint: Option<String>,
    /// A value whose JSON is larger than this many bytes goes to the blob store.
    #[arg(long, env = "SORTIE__GATEWAY__BLOB_THRESHOLD", default_value_t = sortie_blob::DEFAULT_THRESHOLD)]
    blob_threshold: usize,
    #[command(flatten)]
    seal: crate::seal::SealArgs,
    /// Starts (and forks) one tenant may make a second through this gateway; past it a
    /// start is answered 429 `start_rate_exceeded` with `Retry-After`, publishing
    /// nothing. Unset: unbounded.
    #[arg(long, env = "SORTIE__GATEWAY__TENANT_START_RATE")]
    tenant_start_rate: Option<f64>,
    /// Starts one tenant may make at once after a quiet spell (with --tenant-start-rate;
    /// default: the rate rounded up).
    #[arg(
        long,
        env = "SORTIE__GATEWAY__TENANT_START_BURST",
        requires = "tenant_start_rate"
    )]
    tenant_start_burst: Option<u32>,
    /// Live event streams one tenant may hold open at once (429 `too_many_streams` above).
    #[arg(
        long,
        env = "SORTIE__GATEWAY__MAX_STREAMS_PER_TENANT",
        default_value_t = 32
    )]
    max_streams_per_tenant: usize,
    /// Connections held at once; one more is closed as it is accepted.
    #[arg(long, env = "SORTIE__GATEWAY__MAX_CONNECTIONS", default_value_t = 4096)]
    max_connections: usize,
    /// Connections held at once from one source address (an IPv6 client's /64); one more
    /// from it is closed as it is accepted.
    #[arg(
        long,
        env = "SORTIE__GATEWAY__MAX_CONNECTIONS_PER_ADDRESS",
        default_value_t = 256
    )]
    max_connections_per_address: usize,
    /// How long a client may take to send a request's headers before its connection is
    /// closed (slow or silent sockets).
    #[arg(
        long,
        env = "SORTIE__GATEWAY__HEADER_READ_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    header_read_timeout_ms: u64,
    /// How long after its headers a request's body may take to arrive before the request
    /// is answered 408 `body_timeout` and its connection closed.
    #[arg(
        long,
        env = "SORTIE__GATEWAY__BODY_READ_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    body_read_timeout_ms: u64,
    /// YAML file of spend budgets: `default` and per-`tenants` limits (tokens, cost_usd,
    /// tool_calls, wall_time) and `prices` per model (input_per_1k, output_per_1k, USD).
    #[arg(long, env = "SORTIE__GATEWAY__BUDGETS_FILE")]
    budgets_file: Option<PathBuf>,
    /// Sign every published command with this key file (`sortie keys new --delegate`):
    /// reducers that require signatures take the gateway's commands only signed.
    #[arg(long, env = "SORTIE_SIGNING_KEY")]
    signing_key: Option<PathBuf>,
    /// The keyring graph publications are checked against (the reducers' `--keyring`):
    /// graphs whose signature does not hold are not served as published.
    #[arg(long, env = "SORTIE_KEYRING")]
    keyring: Option<PathBuf>,
    /// Refuse unsigned graphs too (with --keyring), like the reducers.
    #[arg(long, env = "SORTIE_REQUIRE_SIGNATURES")]
    require_signatures: bool,
    /// Crash tests only: die on purpose at this point (gateway.after_publish).
    #[arg(long, env = "SORTIE_FAULT")]
    fault: Option<FaultPoint>,
    /// Print the effective configuration (token hashes only) and exit.
    #[arg(long)]
    print_config: bool,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let bootstrap = args.connection.brokers.bootstrap_servers.clone();
    let registry_url = args.connection.registry_url.clone();
    let mut config = GatewayConfig::new(
        args.connection.kafka_config()?,
        args.connection.registry_url,
        args.data_dir,
    );
    config.prefix = args.connection.prefix;
    config.answer_timeout = Duration::from_millis(args.answer_timeout_ms);
    config.read_wait_timeout = Duration::from_millis(args.read_wait_timeout_ms);
    config.max_body_bytes = args.max_body_bytes.unwrap_or(if args.blob_store.is_some() {
        16 * 1024 * 1024
    } else {
        256 * 1024
    });
    config.seal = args.seal.config();
    config.blobs = args.blob_store.map(|store| sortie_blob::BlobConfig {
        store,
        s3_endpoint: args.blob_s3_endpoint,
        threshold: args.blob_threshold,
    });
    config.max_streams_per_tenant = args.max_streams_per_tenant;
    if let Some(rate) = args.tenant_start_rate {
        let burst = args.tenant_start_burst.unwrap_or(rate.ceil() as u32);
        config.start_rate = Some(
            sortie_gateway::admission::StartRate::new(rate, burst)
                .map_err(|e| anyhow::anyhow!("--tenant-start-rate: {e}"))?,
        );
    }
    config.max_connections = args.max_connections;
    config.max_connections_per_address = args.max_connections_per_address;
    config.header_read_timeout = std::time::Duration::from_millis(args.header_read_timeout_ms);
    config.body_read_timeout = std::time::Duration::from_millis(args.body_read_timeout_ms);
    config.fault = args.fault;
    config.signing_key = args.signing_key;
    config.keyring = args.keyring;
    config.require_signatures = args.require_signatures;
    if let Some(path) = &args.budgets_file {
        config.budgets = sortie_gateway::config::Budgets::load(path)?;
    }
    if let Some(path) = &args.tokens_file {
        // Read once here so a broken file stops the start with its error.
        sortie_gateway::config::load_tokens(path)?;
        config.tokens_file = Some(path.clone());
    }
    config.auth_reload_interval = Duration::from_millis(args.auth_reload_ms);
    if let (Some(issuer), Some(audience)) = (args.jwt_issuer, args.jwt_audience) {
        let jwks = match (args.jwks_file, args.jwks_url) {
            (Some(file), None) => JwksSource::File(file),
            (None, Some(url)) => JwksSource::Url(url),
            _ => anyhow::bail!("--jwt-issuer needs exactly one of --jwks-file and --jwks-url"),
        };
        let mut jwt = JwtConfig::new(issuer, audience, jwks);
        jwt.claims = ClaimNames {
            tenant: args.jwt_tenant_claim,
            principal: args.jwt_principal_claim,
            roles: args.jwt_roles_claim,
            groups: args.jwt_groups_claim,
        };
        jwt.leeway = Duration::from_secs(args.jwt_leeway_secs);
        jwt.jwks_refresh = Duration::from_secs(args.jwks_refresh_secs);
        jwt.unknown_kid_refetch = Duration::from_millis(args.jwks_refetch_min_ms);
        config.jwt = Some(jwt);
    }
    for spec in &args.tokens {
        config
            .tokens
            .push(TokenEntry::from_dev_spec(spec).map_err(|e| anyhow::anyhow!("--token: {e}"))?);
    }
    if args.print_config {
        println!("{config:#?}");
        return Ok(());
    }
    if let Some(point) = config.fault {
        tracing::warn!(%point, "Fault injection is ON: this gateway will die at that point.");
    }
    if config.tokens.is_empty() && config.tokens_file.is_none() && config.jwt.is_none() {
        tracing::warn!("No tokens are configured: every API request will be refused (401).");
    }
    let metrics = crate::telemetry::install_metrics(&[sortie_gateway::metrics::HISTOGRAM_BUCKETS])?;
    sortie_gateway::metrics::describe();
    sortie_gateway::metrics::expose(metrics);
    let listener = crate::listen(&args.addr, "gateway", "--addr").await?;
    println!("{}", listener.local_addr()?);
    if let Err(error) = sortie_gateway::serve(config, listener, crate::shutdown_signal()).await {
        // Given up on Kafka or the registry: if one does not answer now, that is said first.
        return Err(crate::reach::explain(error.into(), &bootstrap, Some(&registry_url)).await);
    }
    Ok(())
}
