//! `sortie`: the command line for the local broker, the topology and the schema registry.

use clap::{Parser, Subcommand};

mod broker;
mod registry;
mod topology;

#[derive(Debug, Parser)]
#[command(
    name = "sortie",
    version,
    about = "Durable execution for long-running AI agent runs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the local single-node Apache Kafka broker (KRaft) for development.
    Broker(broker::Args),
    /// Create or check Sortie's topics as declared in topology/topics.yaml.
    Topology(topology::Args),
    /// Serve the Confluent-compatible schema registry subset, persisted in Kafka.
    Registry(registry::Args),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Broker(args) => broker::run(args).await,
        Command::Topology(args) => topology::run(args).await,
        Command::Registry(args) => registry::run(args).await,
    }
}
