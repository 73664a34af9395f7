//! `sortie audit replay`: re-fold histories from Kafka and report any divergence from the
//! state table; print a run's state at any version. `sortie audit why`: the verified
//! authorization chain of one side effect (`sortie_why`).

use anyhow::{bail, Context as _};
use sortie_reducer::audit;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Sub,
}

#[derive(Debug, clap::Subcommand)]
enum Sub {
    /// Re-fold every run's history (or one run's) with this build and compare it with
    /// sortie.run-state. Exits non-zero when anything diverges.
    Replay(Replay),
    /// Why did this side effect happen? The authorization chain of one operation, each
    /// link verified: the effect, its step and arguments, the signed approvals that
    /// released it, the proposal, the model's tool call, the signed graph version; the
    /// child run a `$run` operation started, and for an operation of a child run the
    /// parent's step that started it (with the command that follows it upward). Exits
    /// non-zero when a link is broken or cannot be checked.
    Why(WhyArgs),
}

#[derive(Debug, clap::Args)]
struct WhyArgs {
    /// The operation id (what the receiver got as Idempotency-Key); or name it by its run
    /// and node (`--run R --node N`).
    #[arg(required_unless_present = "node")]
    operation_id: Option<String>,
    /// The run that dispatched it (otherwise every history is searched).
    #[arg(long)]
    run: Option<String>,
    /// The node whose operation it is, in `--run` (a tool a model called is a node too);
    /// refused, with their ids, when the node dispatched several operations.
    #[arg(long, requires = "run", conflicts_with = "operation_id")]
    node: Option<String>,
    /// The keyring signed commands and graphs are checked against (the reducers').
    #[arg(long, env = "SORTIE_KEYRING")]
    keyring: Option<std::path::PathBuf>,
    /// Print the chain as JSON.
    #[arg(long)]
    json: bool,
    /// With the run keys, sealed arguments, proposals and answers are opened and checked.
    #[command(flatten)]
    seal: crate::seal::SealArgs,
    #[command(flatten)]
    connection: crate::connection::Connection,
}

#[derive(Debug, clap::Args)]
struct Replay {
    /// Only this run.
    #[arg(long)]
    run: Option<String>,
    /// Also prove the history is the one written: gap-free seq and an intact hash chain.
    #[arg(long)]
    verify: bool,
    /// Print the run's state after this version (needs --run) instead of a report.
    #[arg(long, requires = "run")]
    at_version: Option<i64>,
    /// With the run keys, sealed payloads are opened and the fold compared in full;
    /// without them (or for a run whose key was destroyed) the chain still verifies and
    /// the fold is compared over the sealed payloads.
    #[command(flatten)]
    seal: crate::seal::SealArgs,
    #[command(flatten)]
    connection: crate::connection::Connection,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let replay = match args.command {
        Sub::Replay(replay) => replay,
        Sub::Why(why_args) => return why(why_args).await,
    };
    let kafka = replay.connection.kafka_config()?;
    let topics = replay.connection.topics();
    let codec = replay.connection.reader_codec();
    let runtime = tokio::runtime::Handle::current();
    let verify = replay.verify;
    let keys = replay.seal.config().map(|c| c.open()).transpose()?;
    crate::reach::both(&replay.connection).await?;
    let connection = replay.connection;
    // The work runs on the blocking pool while a progress line (terminal only) ticks; what
    // it found is printed afterwards, so the two never share a line.
    let work = tokio::task::spawn_blocking(move || -> anyhow::Result<Outcome> {
        if let (Some(run), Some(version)) = (&replay.run, replay.at_version) {
            let histories = audit::histories(&kafka, &topics, &codec, &runtime)?;
            let history = histories
                .get(run)
                .with_context(|| format!("run {run} has no history"))?;
            let mut history = history.clone();
            if let (Some(keys), Some(first)) = (&keys, history.first()) {
                // With the run keys, the state is shown opened (a deleted run's: without
                // its payloads).
                let seal = runtime.block_on(keys.seal(&first.tenant, run))?;
                for event in &mut history {
                    // What does not open stays sealed in the printed state.
                    let _ = seal.open_all(|f| event.map_payloads(f));
                }
            }
            let state = audit::state_at(&history, version)
                .with_context(|| format!("run {run} did not exist at version {version}"))?;
            return Ok(Outcome::State(serde_json::to_string_pretty(&state)?));
        }
        let report = audit::replay(
            &kafka,
            &topics,
            &codec,
            &runtime,
            replay.run.as_deref(),
            replay.verify,
            keys.as_ref(),
        )?;
        Ok(Outcome::Report {
            json: serde_json::to_string_pretty(&report)?,
            runs: report.runs,
            events: report.events,
            diverged: report.diverged,
        })
    });
    let outcome = crate::progress::during("audit replay: reading and re-folding histories", work)
        .await?
        .map_err(|e| crate::reach::name_the_cause(e, &connection))?;
    match outcome {
        Outcome::State(json) => println!("{json}"),
        Outcome::Report {
            json,
            runs,
            events,
            diverged,
        } => {
            println!("{json}");
            if diverged > 0 {
                bail!("{diverged} of {runs} runs diverge from their history");
            }
            eprintln!(
                "{runs} runs, {events} events: every history folds to its state{}",
                if verify {
                    " and every hash chain holds"
                } else {
                    ""
                }
            );
        }
    }
    Ok(())
}

/// What a replay found, printed once the progress line is gone.
enum Outcome {
    State(String),
    Report {
        json: String,
        runs: usize,
        events: usize,
        diverged: usize,
    },
}

async fn why(args: WhyArgs) -> anyhow::Result<()> {
    let kafka = args.connection.kafka_config()?;
    let topics = args.connection.topics();
    let codec = std::sync::Arc::new(args.connection.reader_codec());
    let runtime = tokio::runtime::Handle::current();
    let keys = args.seal.config().map(|c| c.open()).transpose()?;
    let keyring = args
        .keyring
        .as_deref()
        .map(sortie_wire::signing::Keyring::load)
        .transpose()?;
    crate::reach::both(&args.connection).await?;
    let (run, node) = (args.run.clone(), args.node.clone());
    let given = args.operation_id.clone();
    let work = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let operation = match (given, run, node) {
            (Some(operation), _, _) => operation,
            (None, Some(run), Some(node)) => {
                let histories = audit::histories(&kafka, &topics, &codec, &runtime)?;
                operation_of(
                    histories.get(&run).map_or(&[][..], Vec::as_slice),
                    &run,
                    &node,
                )?
            }
            _ => bail!("name the operation: its id, or --run and --node"),
        };
        let found = audit::why(
            &kafka,
            &topics,
            codec.clone(),
            &runtime,
            &operation,
            args.run.as_deref(),
            keyring.as_ref(),
            keys.as_ref(),
        )?;
        let Some(mut found) = found else {
            return Ok(None);
        };
        // An operation of a child run: the parent's history (none: no such run) completes
        // the `parent` link.
        if let Some(parent) = found.chain.parent().map(|p| p.run_id.clone()) {
            let histories = audit::histories(&kafka, &topics, &codec, &runtime)?;
            found
                .chain
                .check_parent(histories.get(&parent).map_or(&[][..], Vec::as_slice));
        }
        Ok(Some(found))
    });
    let found =
        crate::progress::during("audit why: reading the history, graphs and commands", work)
            .await?
            .map_err(|e| crate::reach::name_the_cause(e, &args.connection))?;
    let Some(found) = found else {
        bail!(
            "no run dispatched operation {} (or the named run has no history)",
            args.operation_id.as_deref().unwrap_or_default()
        );
    };
    let chain = found.chain;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&chain)?);
    } else {
        print!("{}", sortie_why::render(&chain));
    }
    if !chain.verified {
        let weak: Vec<&str> = chain
            .links
            .iter()
            .filter(|l| l.status != sortie_why::Status::Verified)
            .map(|l| l.link)
            .collect();
        bail!(
            "the chain of {} does not hold at: {}",
            chain.operation_id,
            weak.join(", ")
        );
    }
    Ok(())
}

/// The one operation `node` dispatched in `run`'s history.
fn operation_of(history: &[sortie_core::Event], run: &str, node: &str) -> anyhow::Result<String> {
    if history.is_empty() {
        bail!("run {run} has no history");
    }
    let mut operations: Vec<&str> = history
        .iter()
        .filter(|e| matches!(&e.body, sortie_core::EventBody::StepDispatched { node: n, .. } if n == node))
        .filter_map(|e| e.operation_id.as_deref())
        .collect();
    operations.sort_unstable();
    operations.dedup();
    match operations.as_slice() {
        [one] => Ok((*one).to_owned()),
        [] => bail!("node {node} of run {run} dispatched no operation"),
        several => bail!(
            "node {node} of run {run} dispatched {} operations; name one: {}",
            several.len(),
            several.join(" ")
        ),
    }
}
