//! `sortie graph publish|list`: publish mission graphs to the graphs topic and list the
//! published versions (see `sortie_catalog`).

use sortie_kafka::clock::now_ms;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use sortie_catalog::{self as graphs, GraphTable, Published};
use sortie_core::graph::InvalidGraph;
use sortie_core::Graph;
use sortie_kafka::KafkaConfig;
use sortie_wire::{Codec, CodecConfig, RecordKind, Topics};

/// How long to wait for the schema registry and for the graphs topic to be read.
const PATIENCE: Duration = Duration::from_secs(30);

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    action: Action,
    #[command(flatten)]
    options: crate::connection::Connection,
}

#[derive(Debug, clap::Subcommand)]
enum Action {
    /// Validate graph files (YAML or JSON) and publish each version not yet published.
    Publish {
        /// Graph files to publish.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// The principal recorded as the publisher (with --signing-key: the key's
        /// principal).
        #[arg(long, default_value = "cli")]
        by: String,
        /// Sign each publication with this key file (a keyring entry with
        /// `publisher: true`, `sortie keys new --publisher`): reducers and gateways that
        /// require signatures take only signed graphs.
        #[arg(long, env = "SORTIE_SIGNING_KEY")]
        signing_key: Option<PathBuf>,
        /// Check the versions already published against this keyring (the reducers'):
        /// an unsigned or forged record neither counts as published nor blocks the real
        /// one. Without it, only the signing key's own signatures are trusted (read only
        /// when signing).
        #[arg(long, env = "SORTIE_KEYRING")]
        keyring: Option<PathBuf>,
        /// Publish unsigned even where the dev stack's publisher key is at hand
        /// (reducers that require signatures, as `sortie dev` does, refuse such graphs).
        #[arg(long, conflicts_with = "signing_key")]
        unsigned: bool,
        /// Publish the graphs as this tenant's own: only its runs start them, and no other
        /// tenant's graph of the same id is touched (the signing key must be a publisher
        /// for the tenant). Without it, the graphs are every tenant's (a key for `*`).
        #[arg(long)]
        tenant: Option<String>,
    },
    /// List every published graph version.
    List {
        /// List only the versions a publisher key of this keyring signed, with the key.
        #[arg(long, env = "SORTIE_KEYRING")]
        keyring: Option<PathBuf>,
    },
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let options = args.options;
    let kafka = options.kafka_config()?;
    let topics = Topics::new(options.prefix.clone());
    match args.action {
        Action::Publish {
            files,
            mut by,
            mut signing_key,
            mut keyring,
            unsigned,
            tenant,
        } => {
            // Every file is validated before anything is published.
            let mut loaded = load(&files)?;
            if let Some(tenant) = &tenant {
                sortie_core::limits::check_id("--tenant", tenant).map_err(anyhow::Error::msg)?;
                for graph in &mut loaded {
                    graph.owner = Some(tenant.clone());
                }
            }
            if signing_key.is_none() && !unsigned {
                // `sortie dev` requires signed graphs: next to its data (or where its env
                // file says it is), sign as it does.
                let dev = match std::env::var_os("SORTIE_DEV_DIR") {
                    Some(dir) => PathBuf::from(dir).join("keys"),
                    None => PathBuf::from(DEV_KEYS),
                };
                let (key, ring) = (dev.join("publisher.key"), dev.join("keyring.yaml"));
                if key.exists() && ring.exists() {
                    eprintln!(
                        "signing with the dev stack's publisher key ({}); --signing-key to sign with another, --unsigned for none",
                        key.display()
                    );
                    signing_key = Some(key);
                    keyring = keyring.or(Some(ring));
                    by = DEV_PUBLISHER.to_owned();
                } else {
                    eprintln!(
                        "publishing unsigned: reducers and gateways that require signatures (sortie dev, production) refuse unsigned graphs; sign with --signing-key"
                    );
                }
            }
            let signer = signing_key
                .as_deref()
                .map(sortie_wire::signing::Signer::load)
                .transpose()?;
            // A keyring checks what is already published against signers of this one;
            // unsigned, there is nothing to check.
            let keyring = keyring.filter(|_| signer.is_some());
            let trust = trust(keyring.as_deref())?;
            crate::reach::both(&options).await?;
            let codec = codec(&options.registry_url, &topics).await?;
            let signing = Signing {
                signer: signer.as_ref(),
                trust: trust.as_ref(),
            };
            publish(&kafka, &codec, &topics, &loaded, &by, signing).await
        }
        Action::List { keyring } => {
            let trust = trust(keyring.as_deref())?;
            crate::reach::both(&options).await?;
            let codec = codec(&options.registry_url, &topics).await?;
            list(&kafka, codec, &topics, trust).await.with_context(|| {
                format!(
                    "reading the graphs from Kafka at {} (--bootstrap-servers)",
                    options.brokers.bootstrap_servers
                )
            })
        }
    }
}

/// Where `sortie dev` keeps its keys (its default data dir, from the workspace root).
const DEV_KEYS: &str = "target/dev/keys";
use crate::dev::DEV_PUBLISHER;

/// A codec that may register schemas, with the graph definition schema registered.
async fn codec(registry_url: &str, topics: &Topics) -> anyhow::Result<Codec> {
    let codec = Codec::new(&CodecConfig {
        registry_url: registry_url.to_owned(),
        auto_register: true,
    });
    codec
        .prepare(&topics.graphs(), RecordKind::GraphDefinition, PATIENCE)
        .await
        .with_context(|| format!("registering the graph definition schema at {registry_url}"))?;
    Ok(codec)
}

/// Parses and validates every file, printing each problem on its own line.
fn load(files: &[PathBuf]) -> anyhow::Result<Vec<Graph>> {
    let mut loaded = Vec::new();
    let mut invalid = 0;
    for file in files {
        match graphs::load_file(file) {
            Ok(graph) => {
                // A built-in tool's config the executor would refuse at the first run is
                // refused now (`bad_config`), not when a run reaches the node.
                let problems: Vec<String> = graph
                    .nodes
                    .iter()
                    .filter_map(|node| {
                        sortie_executor::handlers::config_problem(&node.tool, &node.config)
                            .map(|why| format!("node {:?}: {why}", node.id))
                    })
                    .collect();
                if problems.is_empty() {
                    loaded.push(graph);
                } else {
                    invalid += 1;
                    for problem in problems {
                        eprintln!("{}: {problem}", file.display());
                    }
                }
            }
            Err(graphs::Error::InvalidFile {
                path,
                source: InvalidGraph(problems),
            }) => {
                invalid += 1;
                for problem in problems {
                    eprintln!("{}: {problem}", path.display());
                }
            }
            Err(error) => {
                invalid += 1;
                eprintln!("{error}");
            }
        }
    }
    if invalid > 0 {
        anyhow::bail!("{invalid} graph file(s) are invalid; nothing was published");
    }
    Ok(loaded)
}

/// The graphs a keyring's publisher keys signed, and no unsigned one.
fn trust(keyring: Option<&std::path::Path>) -> anyhow::Result<Option<graphs::Trust>> {
    keyring
        .map(|path| {
            Ok(graphs::Trust {
                keyring: sortie_wire::signing::Keyring::load(path)?,
                require: true,
            })
        })
        .transpose()
}

/// How publications are signed and the table read before publishing.
#[derive(Clone, Copy)]
struct Signing<'a> {
    signer: Option<&'a sortie_wire::signing::Signer>,
    trust: Option<&'a graphs::Trust>,
}

async fn publish(
    kafka: &KafkaConfig,
    codec: &Codec,
    topics: &Topics,
    loaded: &[Graph],
    by: &str,
    signing: Signing<'_>,
) -> anyhow::Result<()> {
    let mut refused = 0;
    for graph in loaded {
        // The MCP servers it offers are listed now and their tools pinned into the version.
        let graph = &graphs::pin(graph)
            .await
            .with_context(|| format!("publishing {}", graph.key()))?;
        let published = graphs::publish_signed(
            kafka,
            codec,
            topics,
            graph,
            by,
            now_ms(),
            signing.signer,
            signing.trust,
        )
        .await;
        match published {
            Ok(Published::Published { .. }) => {
                println!("published {}", graph.key());
                for server in &graph.mcp_servers {
                    if let Some(pinned) = &server.pinned {
                        let names: Vec<&str> =
                            pinned.tools.iter().map(|t| t.name.as_str()).collect();
                        println!(
                            "  mcp server {}: pinned {} (tools hash {})",
                            server.name,
                            names.join(", "),
                            &pinned.hash[..16.min(pinned.hash.len())]
                        );
                    }
                }
            }
            Ok(Published::AlreadyPublished) => {
                println!("{} already published (same definition)", graph.key());
            }
            Err(error @ graphs::Error::VersionExists { .. }) => {
                refused += 1;
                eprintln!("{error}");
            }
            Err(error) => {
                return Err(error).with_context(|| format!("publishing {}", graph.key()));
            }
        }
    }
    if refused > 0 {
        anyhow::bail!("{refused} graph version(s) were refused");
    }
    Ok(())
}

async fn list(
    kafka: &KafkaConfig,
    codec: Codec,
    topics: &Topics,
    trust: Option<graphs::Trust>,
) -> anyhow::Result<()> {
    let kafka = kafka.clone();
    let topics = topics.clone();
    let runtime = tokio::runtime::Handle::current();
    let lines = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<String>> {
        let mut table = GraphTable::open(&kafka, &topics, Arc::new(codec), runtime)?;
        table.set_trust(trust);
        table.catch_up(PATIENCE)?;
        Ok(table
            .graphs()
            .all()
            .map(|graph| {
                let key = graph.key();
                let origin = table
                    .publication(&key)
                    .map(|p| {
                        let signed = p
                            .signed_by
                            .as_ref()
                            .map(|key| format!(", signed by key {key}"))
                            .unwrap_or_default();
                        format!(
                            "  published by {} at {}{signed}",
                            p.published_by,
                            rfc3339(p.published_at)
                        )
                    })
                    .unwrap_or_default();
                format!("{key}  {} nodes{origin}", graph.nodes.len())
            })
            .collect())
    })
    .await??;
    if lines.is_empty() {
        println!("no graphs published");
    }
    for line in lines {
        println!("{line}");
    }
    Ok(())
}

/// `2026-01-31T12:34:56.789Z` from Unix milliseconds (proleptic Gregorian, UTC).
fn rfc3339(millis: i64) -> String {
    let (days, in_day) = (millis.div_euclid(86_400_000), millis.rem_euclid(86_400_000));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (secs, ms) = (in_day / 1_000, in_day % 1_000);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        secs / 3_600,
        secs / 60 % 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::rfc3339;

    #[test]
    fn formats_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339(1_764_400_000_000), "2025-11-29T07:06:40.000Z");
    }
}
