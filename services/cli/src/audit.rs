//! `sortie audit replay`: re-fold histories from Kafka and report any divergence from the
//! state table; print a run's state at any version.

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
    connection: crate::telemetry::Connection,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let Sub::Replay(replay) = args.command;
    let kafka = replay.connection.kafka_config()?;
    let topics = replay.connection.topics();
    let codec = replay.connection.reader_codec();
    let runtime = tokio::runtime::Handle::current();
    let verify = replay.verify;
    let keys = replay.seal.config().map(|c| c.open()).transpose()?;
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
    let outcome =
        crate::progress::during("audit replay: reading and re-folding histories", work).await??;
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
