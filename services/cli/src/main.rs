//! `sortie`: the command line for the local broker, the topology, the schema registry,
//! graphs, and the services themselves (`sortie reducer`).

use clap::{Parser, Subcommand};
use sortie_process::{connection, seal, telemetry};

mod audit;
mod bench;
mod broker;
mod dev;
mod fuzz;
mod gateway;
mod graph;
mod human;
mod keys;
mod ledger;
mod progress;
mod reach;
mod reducer;
mod registry;
mod replay;
mod run;
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
    #[command(flatten)]
    log: telemetry::LogArgs,
}

// Parsed once at start and matched once: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// The whole local stack in one command: Kafka, registry, topics, graphs, ledger,
    /// reducer, executor, gateway, and a demo mission waiting for your approval.
    Dev(dev::Args),
    /// Run the local single-node Apache Kafka broker (KRaft) for development.
    Broker(broker::Args),
    /// Create or check Sortie's topics as declared in topology/topics.yaml.
    Topology(topology::Args),
    /// Serve the Confluent-compatible schema registry subset, persisted in Kafka.
    Registry(registry::Args),
    /// Publish and list mission graphs.
    Graph(graph::Args),
    /// Run a reducer instance: folds commands and step results into run state, exactly once.
    Reducer(reducer::Args),
    /// Run a stateless executor for one or more queues.
    Executor(sortie_executor::command::Args),
    /// Run the HTTP gateway (the run API and read views).
    Gateway(gateway::Args),
    /// Command-signing keys: make one and add it to a keyring.
    Keys(keys::Args),
    /// Run the ledger: an HTTP receiver that records every side effect (tests, demos).
    Ledger(ledger::Args),
    /// Replay histories from Kafka and verify them against the state table.
    Audit(audit::Args),
    /// Shadow replay, the deploy gate: re-decide recorded runs with this build (and a graph version).
    Replay(replay::Args),
    /// Start, approve, reject, cancel, inspect and follow runs through the gateway.
    Run(run::Args),
    /// Measure throughput, round trip, restart and restore against a bare transactional loop and the Kafka pipeline; prints JSON.
    Bench(bench::Args),
    /// The hostile-input campaign against a stack of its own, with a canary tenant as the
    /// oracle; prints JSON, exits 1 on a finding.
    Fuzz(fuzz::Args),
}

/// Every service allocates per record (decoded inputs, run states, encoded outputs);
/// glibc's allocator spent ~30 % of the reducer's CPU under load in a profile
/// (`perf record` during `sortie bench`, README "Performance"). mimalloc's thread-local
/// free lists cost a fraction of that.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    telemetry::init_logging(&cli.log);
    match cli.command {
        Command::Dev(args) => dev::run(args).await,
        Command::Broker(args) => broker::run(args).await,
        Command::Topology(args) => topology::run(args).await,
        Command::Registry(args) => registry::run(args).await,
        Command::Reducer(args) => reducer::run(args).await,
        Command::Executor(args) => {
            let bootstrap = args.bootstrap_servers().to_owned();
            let registry = args.registry_url().to_owned();
            let ran =
                sortie_executor::command::run(args, sortie_executor::Handlers::builtin_with).await;
            match ran {
                // Given up on Kafka or the registry: if one does not answer now, said first.
                Err(error) => Err(reach::explain(error, &bootstrap, Some(&registry)).await),
                ran => ran,
            }
        }
        Command::Gateway(args) => gateway::run(args).await,
        Command::Keys(args) => keys::run(args).await,
        Command::Ledger(args) => ledger::run(args).await,
        Command::Audit(args) => audit::run(args).await,
        Command::Replay(args) => replay::run(args).await,
        Command::Run(args) => run::run(args).await,
        Command::Graph(args) => graph::run(args).await,
        Command::Bench(args) => bench::run(args).await,
        Command::Fuzz(args) => fuzz::run(args).await,
    }
}

pub(crate) use sortie_process::shutdown_signal;

/// Binds `addr` for `what`; an address already taken (or not ours to take) fails with the
/// address and the flag that changes it, not the bare OS error.
pub(crate) async fn listen(
    addr: &str,
    what: &str,
    flag: &str,
) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| cannot_listen(what, addr, &e, flag))
}

/// Why `what` cannot listen on `addr`, and `how` to move it (a flag, or a command line).
pub(crate) fn cannot_listen(
    what: &str,
    addr: &str,
    e: &std::io::Error,
    how: &str,
) -> anyhow::Error {
    anyhow::anyhow!("the {what} cannot listen on {addr}: {e}; choose another address with {how}")
}
