//! `sortie replay shadow`: the deploy gate. Re-decides the recorded runs (read from
//! `sortie.run-events`, as `sortie audit replay` reads them) with this build, against
//! their pinned graph versions or against a candidate graph version, and reports per run
//! the first decision that differs (`sortie_core::shadow`). Exits non-zero on divergence.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use serde_json::json;
use sortie_catalog::GraphTable;
use sortie_core::{shadow, EventBody, Graph, Graphs};
use sortie_reducer::audit;

const PATIENCE: Duration = Duration::from_secs(30);

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Sub,
}

#[derive(Debug, clap::Subcommand)]
enum Sub {
    /// Re-decide recorded runs with this build and report, per run, the first decision
    /// that differs. With --graph (or --graph-file), the runs of that graph are re-decided
    /// against that definition instead of the version they pinned; without, every run
    /// against its own version (a gate for a new engine build).
    Shadow(Shadow),
}

#[derive(Debug, clap::Args)]
struct Shadow {
    /// A published graph version, `id@version`, e.g. `refund@2` (`tenant/id@version`
    /// for a tenant's own graph).
    #[arg(long, conflicts_with = "graph_file")]
    graph: Option<String>,
    /// A graph file not yet published.
    #[arg(long)]
    graph_file: Option<PathBuf>,
    /// The tenant whose graph the --graph-file is (as `graph publish --tenant` would
    /// publish it); without, it stands for the graph of every tenant.
    #[arg(long, requires = "graph_file")]
    tenant: Option<String>,
    /// Only this run.
    #[arg(long)]
    run: Option<String>,
    /// With the run keys, a sealed run's payloads are opened before it is re-decided (a
    /// condition or template reads what the run read); without, they are re-decided
    /// sealed. What does not open (a shredded run's) stays sealed.
    #[command(flatten)]
    seal: crate::seal::SealArgs,
    #[command(flatten)]
    connection: crate::connection::Connection,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let Sub::Shadow(shadow_args) = args.command;
    let kafka = shadow_args.connection.kafka_config()?;
    let topics = shadow_args.connection.topics();
    let (events_codec, graphs_codec) = (
        shadow_args.connection.reader_codec(),
        shadow_args.connection.reader_codec(),
    );
    let runtime = tokio::runtime::Handle::current();
    if let Some(key) = &shadow_args.graph {
        graph_version(key)?;
    }
    let candidate_file = match &shadow_args.graph_file {
        Some(path) => {
            let mut graph =
                sortie_catalog::load_file(path).with_context(|| path.display().to_string())?;
            graph.owner = shadow_args.tenant.clone();
            // A candidate offering MCP tools is judged with the tools its servers list now,
            // pinned as publishing it would pin them.
            Some(
                sortie_catalog::pin(&graph)
                    .await
                    .with_context(|| path.display().to_string())?,
            )
        }
        None => None,
    };
    let keys = shadow_args.seal.config().map(|c| c.open()).transpose()?;
    crate::reach::both(&shadow_args.connection).await?;
    let wanted = shadow_args.graph.clone();
    let only = shadow_args.run.clone();
    let work = tokio::task::spawn_blocking(move || -> anyhow::Result<serde_json::Value> {
        let mut table = GraphTable::open(&kafka, &topics, Arc::new(graphs_codec), runtime.clone())?;
        table.catch_up(PATIENCE)?;
        let published = table.graphs().clone();
        let candidate: Option<Graph> = match (&wanted, candidate_file) {
            (Some(key), _) => {
                let (id, version) = graph_version(key)?;
                Some(
                    published
                        .get(id, Some(version))
                        .cloned()
                        .with_context(|| format!("graph {key} is not published"))?,
                )
            }
            (None, file) => file,
        };
        let histories = audit::histories(&kafka, &topics, &events_codec, &runtime)?;
        let mut results = Vec::new();
        let mut diverged = 0;
        for (run_id, history) in &histories {
            if only.as_ref().is_some_and(|r| r != run_id) {
                continue;
            }
            let Some((graph_id, pinned)) = history.iter().find_map(|e| match &e.body {
                EventBody::RunStarted {
                    graph_id,
                    graph_version,
                    ..
                } => Some((graph_id.clone(), *graph_version)),
                _ => None,
            }) else {
                continue;
            };
            let graphs = match &candidate {
                Some(c) if c.pinned_id() != graph_id => continue, // not affected by the candidate
                Some(c) => with_candidate(&published, c, pinned),
                None => published.clone(),
            };
            let opened;
            let history = match (&keys, history.first()) {
                (Some(keys), Some(first)) => {
                    let seal = runtime.block_on(keys.seal(&first.tenant, run_id))?;
                    let mut copy = history.clone();
                    for event in &mut copy {
                        let _ = seal.open_all(|f| event.map_payloads(f));
                    }
                    opened = copy;
                    &opened
                }
                _ => history,
            };
            let outcome = shadow::replay(history, &graphs);
            if outcome.divergence.is_some() {
                diverged += 1;
            }
            results.push(json!({
                "run_id": run_id,
                "graph": format!("{graph_id}@{pinned}"),
                "against": candidate.as_ref().map_or_else(|| format!("{graph_id}@{pinned}"), |c| c.key()),
                "same_decisions": outcome.divergence.is_none(),
                "versions": outcome.versions,
                "taken_as_recorded": outcome.taken_as_recorded,
                "first_divergence": outcome.divergence,
            }));
        }
        Ok(json!({"runs": results.len(), "diverged": diverged, "results": results}))
    });
    let report = crate::progress::during("replay shadow: re-deciding recorded runs", work)
        .await?
        .map_err(|e| crate::reach::name_the_cause(e, &shadow_args.connection))?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    let diverged = report["diverged"].as_u64().unwrap_or(0);
    if diverged > 0 {
        bail!("{diverged} of {} runs decide differently", report["runs"]);
    }
    eprintln!("{} runs decide the same", report["runs"]);
    Ok(())
}

/// `--graph`'s `id@version` (`tenant/id@version`), read before anything is connected to.
fn graph_version(key: &str) -> anyhow::Result<(&str, u32)> {
    key.split_once('@')
        .and_then(|(id, v)| Some((id, v.parse::<u32>().ok()?)))
        .with_context(|| format!("--graph {key} is not id@version (like refund@2)"))
}

/// The published graphs, with `candidate` standing in for `candidate.id@pinned`.
fn with_candidate(published: &Graphs, candidate: &Graph, pinned: u32) -> Graphs {
    let mut graphs = Graphs::new();
    for graph in published.all() {
        if graph.pinned_id() != candidate.pinned_id() || graph.version != pinned {
            let _ = graphs.insert(graph.clone());
        }
    }
    let mut stand_in = candidate.clone();
    stand_in.version = pinned;
    let _ = graphs.insert(stand_in);
    graphs
}
