//! `sortie topology apply|check`: create Sortie's topics as declared in
//! `topology/topics.yaml`, or report how the broker differs from it.

use std::path::PathBuf;

use anyhow::Context as _;
use sortie_kafka::topology::{Difference, Overrides, Topology, DEFAULT_PATH};
use sortie_kafka::KafkaConfig;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    action: Action,
    #[command(flatten)]
    options: Options,
}

#[derive(Debug, clap::Subcommand)]
enum Action {
    /// Create missing topics and fix config drift; never changes partition counts.
    Apply,
    /// Report every difference between the broker and the topology; exits non-zero if any.
    Check,
}

#[derive(Debug, clap::Args)]
struct Options {
    /// The topology file.
    #[arg(long, global = true, default_value = DEFAULT_PATH)]
    file: PathBuf,
    /// Topic name prefix (overrides the file's).
    #[arg(long, global = true)]
    prefix: Option<String>,
    /// Partition count of the co-partitioned run topics (overrides run_partitions).
    #[arg(long, global = true)]
    partitions: Option<u32>,
    /// Partition count of every intents topic (overrides the file's).
    #[arg(long, global = true)]
    intent_partitions: Option<u32>,
    /// Replication factor of created topics (overrides the file's).
    #[arg(long, global = true)]
    replication_factor: Option<u16>,
    /// min.insync.replicas (overrides the file's; `auto` there is replication factor - 1).
    #[arg(long, global = true)]
    min_insync_replicas: Option<u16>,
    #[command(flatten)]
    brokers: crate::connection::Brokers,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let options = args.options;
    let topology = Topology::load(&options.file)
        .and_then(|t| {
            t.with_overrides(&Overrides {
                prefix: options.prefix,
                run_partitions: options.partitions,
                intent_partitions: options.intent_partitions,
                replication_factor: options.replication_factor,
                min_insync_replicas: options.min_insync_replicas,
            })
        })
        .with_context(|| {
            format!(
                "cannot use the topology in {} (--file; the checkout's is topology/topics.yaml)",
                options.file.display()
            )
        })?;
    let kafka = options.brokers.kafka_config()?;
    let bootstrap = &options.brokers.bootstrap_servers;
    crate::reach::kafka(bootstrap, crate::reach::PATIENCE).await?;
    match args.action {
        Action::Check => check(&topology, &kafka).await,
        Action::Apply => apply(&topology, &kafka).await,
    }
}

async fn check(topology: &Topology, kafka: &KafkaConfig) -> anyhow::Result<()> {
    let differences = topology.diff(kafka).await.with_context(|| {
        format!(
            "reading the topics at {} (--bootstrap-servers)",
            kafka.bootstrap_servers
        )
    })?;
    if differences.is_empty() {
        println!("topology matches");
        return Ok(());
    }
    for difference in &differences {
        println!("{difference}");
    }
    anyhow::bail!(
        "{} difference(s) between the broker and the topology",
        differences.len()
    )
}

async fn apply(topology: &Topology, kafka: &KafkaConfig) -> anyhow::Result<()> {
    let label = format!("topology apply: {} topics", topology.topics().len());
    let report = crate::progress::during(&label, topology.apply(kafka))
        .await
        .with_context(|| {
            format!(
                "applying the topology at {} (--bootstrap-servers)",
                kafka.bootstrap_servers
            )
        })?;
    for topic in &report.created {
        let partitions = topology
            .topics()
            .iter()
            .find(|t| &t.full_name == topic)
            .map_or(0, |t| t.partitions);
        println!("created {topic} ({partitions} partitions)");
    }
    for difference in &report.altered {
        println!("fixed {difference}");
    }
    if !report.unchanged.is_empty() {
        println!("{} topic(s) already matched", report.unchanged.len());
    }
    for failure in &report.failed {
        println!("could not fix {failure}");
    }
    for difference in &report.remaining {
        println!("could not fix {difference}{}", why_not(difference));
    }
    if report.is_complete() {
        println!("topology matches");
        Ok(())
    } else {
        anyhow::bail!(
            "the broker still differs from the topology in {} way(s)",
            report.remaining.len() + report.failed.len()
        )
    }
}

fn why_not(difference: &Difference) -> &'static str {
    match difference {
        Difference::Partitions { .. } => {
            " (apply never changes a partition count: that would move run keys to other partitions)"
        }
        Difference::ReplicationFactor { .. } => {
            " (changing a replication factor is a partition reassignment, done by hand)"
        }
        _ => "",
    }
}
