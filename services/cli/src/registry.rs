//! `sortie registry serve`: the Confluent-compatible schema registry subset, persisted in
//! a compacted Kafka topic (see the `sortie-registry` crate).

use std::net::SocketAddr;
use std::sync::Arc;

use sortie_registry::Registry;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Serve the registry's REST API until Ctrl-C (or SIGTERM).
    Serve(ServeArgs),
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    #[command(flatten)]
    brokers: crate::connection::Brokers,
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:8081")]
    addr: SocketAddr,
    /// The compacted topic holding the registry's state; one registry instance per topic.
    #[arg(long, default_value = sortie_registry::DEFAULT_TOPIC)]
    topic: String,
    /// The token every write (register, delete, config) must present, as
    /// `Authorization: Bearer <token>` or as a Basic password. Without it, writes are open
    /// on a loopback address and refused on any other; reads are always open.
    #[arg(long, env = "SORTIE_REGISTRY_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        Command::Serve(args) => serve(args).await,
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let kafka = args.brokers.kafka_config()?;
    // The address first: a taken one is said at once, not after Kafka has been waited for.
    let listener = crate::listen(&args.addr.to_string(), "schema registry", "--addr").await?;
    let bootstrap = &args.brokers.bootstrap_servers;
    tracing::info!(topic = %args.topic, bootstrap_servers = %bootstrap, "Opening the registry's topic.");
    let registry = match Registry::open(&kafka, &args.topic).await {
        Ok(registry) => registry,
        Err(error) => {
            let error = anyhow::Error::new(error).context(format!(
                "opening the registry on topic {} at {bootstrap} (--bootstrap-servers)",
                args.topic
            ));
            return Err(crate::reach::explain(error, bootstrap, None).await);
        }
    };
    let addr = listener.local_addr()?;
    tracing::info!(
        url = %format!("http://{addr}"),
        topic = %args.topic,
        bootstrap_servers = %args.brokers.bootstrap_servers,
        "The schema registry is serving."
    );
    sortie_registry::serve_with_token(listener, Arc::new(registry), args.token, shutdown_signal())
        .await?;
    tracing::info!("The schema registry stopped.");
    Ok(())
}

/// Completes on Ctrl-C or, on Unix, SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::warn!(%error, "Cannot listen for Ctrl-C.");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::warn!(%error, "Cannot listen for SIGTERM.");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
    tracing::info!("Shutting down the schema registry.");
}
