//! `sortie ledger`: the receiver that records every side effect (tests, demos). Prints
//! `ledger listening on http://<addr>` on stdout once it accepts connections, so
//! `--addr 127.0.0.1:0` works for callers that read the address back. With
//! `--dev-routes` it is also the dev receiver (`sortie_devkit::receiver`): it answers the
//! example graphs' URLs (orders, payments, notifications, status lookups) and records
//! every call it answers.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;

use sortie_devkit::ledger::{self, Ledger, Mode};
use sortie_devkit::receiver;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Address to listen on (port 0: any free port).
    #[arg(long, env = "SORTIE__LEDGER__ADDR", default_value = "127.0.0.1:8090")]
    addr: String,
    /// The ledger's file: one JSON line per call, fsynced before answering.
    #[arg(
        long,
        env = "SORTIE__LEDGER__FILE",
        default_value = "target/dev/ledger.jsonl"
    )]
    file: PathBuf,
    /// plain | keyed | idempotent | reconcilable.
    #[arg(long, env = "SORTIE__LEDGER__MODE", default_value = "keyed")]
    mode: Mode,
    /// Also answer the example graphs' URLs (`topology/graphs/`): `POST /orders/read`,
    /// `/payments/refund` and `/payments/reverse` (deduped by `Idempotency-Key`),
    /// `/notifications/refund`, and `GET /status/{operation_id}` for any call.
    #[arg(long, env = "SORTIE__LEDGER__DEV_ROUTES")]
    dev_routes: bool,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let ledger = Arc::new(
        Ledger::open(&args.file, args.mode)
            .with_context(|| format!("cannot use --file {}", args.file.display()))?,
    );
    let listener = crate::listen(&args.addr, "ledger", "--addr").await?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, mode = %args.mode, file = %args.file.display(), "Ledger listening.");
    {
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "ledger listening on http://{addr}")?;
        stdout.flush()?;
    }
    if args.dev_routes {
        receiver::serve(listener, ledger, crate::shutdown_signal()).await?;
    } else {
        ledger::serve(listener, ledger, crate::shutdown_signal()).await?;
    }
    Ok(())
}
