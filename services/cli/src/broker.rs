//! `sortie broker start|stop|status`: the local Kafka broker for development — one node,
//! or with `--nodes 3` a KRaft cluster of three on this machine.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use sortie_devkit::local::{self, BrokerConfig, LocalBroker, LocalCluster, Status};

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
    /// data dir was last configured with, else 9092. In a cluster, node i uses
    /// port + 10 (i - 1).
    #[arg(long)]
    port: Option<u16>,
    /// Nodes of the cluster (each broker and controller, in `<data-dir>/node-<i>`; internal
    /// topics and the default for new topics replicated min(nodes, 3) times). Default: as
    /// this data dir was configured, else 1.
    #[arg(long)]
    nodes: Option<u16>,
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
    let target = match &args.command {
        Command::Start(start) => &start.target,
        Command::Stop(target) | Command::Status(target) => target,
    };
    if let Command::Stop(target) = &args.command {
        // A data dir that was never made holds no broker: most likely a mistyped
        // --data-dir, while the broker meant keeps running.
        anyhow::ensure!(
            target.data_dir.is_dir(),
            "no broker data dir at {}: nothing to stop (--data-dir names it; `sortie dev` keeps its broker in target/dev/kafka)",
            target.data_dir.display()
        );
    }
    if target.node_count() > 1 {
        return run_cluster(args).await;
    }
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
                    if !Path::new(&data_dir).is_dir() {
                        eprintln!("{data_dir} does not exist: is --data-dir the broker's data dir? (`sortie dev` keeps its broker in target/dev/kafka)");
                    }
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
    needs_pom(&broker)?;
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
    fn node_count(&self) -> u16 {
        self.nodes
            .unwrap_or_else(|| (LocalCluster::configured_ports(&self.data_dir).len() as u16).max(1))
    }

    fn cluster(&self, pom: PathBuf) -> anyhow::Result<LocalCluster> {
        let configured = LocalCluster::configured_ports(&self.data_dir);
        let base = self
            .port
            .or_else(|| configured.first().map(|p| p.0))
            .unwrap_or(DEFAULT_PORT);
        let ports: Vec<(u16, u16)> = (0..self.node_count())
            .map(|i| (base + 10 * i, base + 10 * i + 1))
            .collect();
        Ok(LocalCluster::new(&self.data_dir, &ports, pom, None)?)
    }

    fn broker(&self, pom: PathBuf) -> LocalBroker {
        let port = self
            .port
            .or_else(|| local::configured_port(&self.data_dir))
            .unwrap_or(DEFAULT_PORT);
        LocalBroker::new(BrokerConfig::new(&self.data_dir, port, pom))
    }
}

async fn run_cluster(args: Args) -> anyhow::Result<()> {
    match args.command {
        Command::Start(start) => {
            let pom = match start.pom {
                Some(pom) => pom,
                None => find_pom()?,
            };
            let cluster = start.target.cluster(pom)?;
            let started = Instant::now();
            let running = {
                let cluster = cluster.clone();
                blocking(move || cluster.ensure_running()).await?
            };
            tracing::info!(
                nodes = running.len(),
                elapsed_ms = started.elapsed().as_millis() as u64,
                data_dir = %cluster.data_dir().display(),
                "The local Kafka cluster is up."
            );
            println!("{}", cluster.bootstrap());
            if !start.foreground {
                return Ok(());
            }
            let mut sigterm =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = sigterm.recv() => {}
            }
            blocking(move || cluster.stop()).await?;
            Ok(())
        }
        Command::Stop(target) => {
            let cluster = target.cluster(PathBuf::from(POM))?;
            let pids = blocking(move || cluster.stop()).await?;
            println!(
                "stopped {} node(s) in {}",
                pids.len(),
                target.data_dir.display()
            );
            Ok(())
        }
        Command::Status(target) => {
            let cluster = target.cluster(PathBuf::from(POM))?;
            let mut all = true;
            for node in cluster.nodes().to_vec() {
                let bootstrap = node.bootstrap();
                let status = tokio::task::spawn_blocking(move || node.status()).await?;
                all &= matches!(status, Status::Running { .. });
                println!("{bootstrap}: {status:?}");
            }
            if !all {
                std::process::exit(1)
            }
            Ok(())
        }
    }
}

/// The Kafka jars are in the broker's libs dir, or the pom that fetches them exists: not
/// Maven's page of errors about a missing file.
fn needs_pom(broker: &LocalBroker) -> anyhow::Result<()> {
    let pom = &broker.config().pom;
    let has_jars = std::fs::read_dir(broker.libs_dir())
        .map(|mut entries| {
            entries.any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().starts_with("kafka_")))
        })
        .unwrap_or(false);
    anyhow::ensure!(
        has_jars || pom.is_file(),
        "no pom at {} to fetch the Kafka jars with: give --pom (the checkout's dev/kafka/pom.xml), or run from the checkout",
        pom.display()
    );
    Ok(())
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
