//! `sortie broker start|stop|status`: the local single-node Kafka broker for development.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use sortie_devkit::local::{self, BrokerConfig, LocalBroker, Status};

const DEFAULT_PORT: u16 = 9092;
const POM: &str = "dev/kafka/pom.xml";

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Start the broker (or reuse the one already running on this data dir) and print its
    /// bootstrap address.
    Start(StartArgs),
    /// Stop the broker of this data dir: SIGTERM, then SIGKILL after 30 s. Data is kept.
    Stop(Target),
    /// Exit 0 if the broker of this data dir runs and answers, 1 otherwise.
    Status(Target),
}

#[derive(Debug, clap::Args)]
struct Target {
    /// The broker's data dir (jars, logs, pid file).
    #[arg(long, default_value = "target/dev/kafka")]
    data_dir: PathBuf,
    /// PLAINTEXT port on 127.0.0.1 (the controller uses port + 1). Default: the port this
    /// data dir was last configured with, else 9092.
    #[arg(long)]
    port: Option<u16>,
}

#[derive(Debug, clap::Args)]
struct StartArgs {
    #[command(flatten)]
    target: Target,
    /// The pom that resolves the Kafka jars (needed only when they are not yet in
    /// <data-dir>/libs). Default: dev/kafka/pom.xml found from the current dir upwards.
    #[arg(long)]
    pom: Option<PathBuf>,
    /// JVM maximum heap.
    #[arg(long, default_value = "768m")]
    heap: String,
    /// Stay attached; stop the broker on Ctrl-C or SIGTERM.
    #[arg(long)]
    foreground: bool,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        Command::Start(start) => run_start(start).await,
        Command::Stop(target) => {
            let broker = target.broker(PathBuf::from(POM));
            let data_dir = broker.data_dir().display().to_string();
            match blocking(move || broker.stop()).await? {
                Some(pid) => println!("stopped the broker (pid {pid}) in {data_dir}"),
                None => println!("no broker was running in {data_dir}"),
            }
            Ok(())
        }
        Command::Status(target) => {
            let broker = target.broker(PathBuf::from(POM));
            let bootstrap = broker.bootstrap();
            let data_dir = broker.data_dir().display().to_string();
            match tokio::task::spawn_blocking(move || broker.status()).await? {
                Status::Running { pid } => {
                    println!("running: pid {pid}, bootstrap {bootstrap}, data {data_dir}");
                    Ok(())
                }
                Status::Unresponsive { pid } => {
                    println!("unresponsive: pid {pid} is alive but {bootstrap} does not answer");
                    std::process::exit(1)
                }
                Status::Stopped => {
                    println!("stopped: no broker is running in {data_dir}");
                    std::process::exit(1)
                }
            }
        }
    }
}

async fn run_start(args: StartArgs) -> anyhow::Result<()> {
    let pom = match args.pom {
        Some(pom) => pom,
        None => find_pom()?,
    };
    let mut broker = args.target.broker(pom);
    if args.heap != broker.config().heap {
        let mut config = broker.config().clone();
        config.heap = args.heap;
        broker = LocalBroker::new(config);
    }
    let started = Instant::now();
    let running = {
        let broker = broker.clone();
        blocking(move || broker.ensure_running()).await?
    };
    tracing::info!(
        pid = running.pid,
        reused = running.reused,
        elapsed_ms = started.elapsed().as_millis() as u64,
        data_dir = %broker.data_dir().display(),
        "The local Kafka broker is up."
    );
    println!("{}", running.bootstrap);
    if !args.foreground {
        return Ok(());
    }

    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut check = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = sigterm.recv() => break,
            _ = check.tick() => {
                if broker.pid().is_none() {
                    anyhow::bail!(
                        "the broker exited on its own; last log lines:\n{}",
                        broker.log_tail()
                    );
                }
            }
        }
    }
    tracing::info!("Stopping the local Kafka broker.");
    blocking(move || broker.stop()).await?;
    Ok(())
}

impl Target {
    fn broker(&self, pom: PathBuf) -> LocalBroker {
        let port = self
            .port
            .or_else(|| local::configured_port(&self.data_dir))
            .unwrap_or(DEFAULT_PORT);
        LocalBroker::new(BrokerConfig::new(&self.data_dir, port, pom))
    }
}

/// `dev/kafka/pom.xml` in the current dir or an ancestor, else the one of the workspace
/// this binary was built from.
fn find_pom() -> anyhow::Result<PathBuf> {
    let cwd = std::env::current_dir().context("reading the current dir")?;
    if let Some(pom) = cwd.ancestors().map(|d| d.join(POM)).find(|p| p.is_file()) {
        return Ok(pom);
    }
    let built_from = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(POM);
    Ok(built_from)
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> local::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    Ok(tokio::task::spawn_blocking(f).await??)
}
