//! Telemetry for every `sortie` command: logging (level and format from flags, the
//! environment or `RUST_LOG`), the process's Prometheus recorder, and the small
//! operations server (`/metrics`, `/healthz`, `/readyz`) of services without an HTTP API
//! of their own (reducer, executor). The gateway serves the same paths on its API port.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use serde_json::json;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines with span fields (`apply{run_id=..}: ...`).
    Text,
    /// One JSON object per line, with the current span's fields (run_id, operation_id,
    /// trace_id).
    Json,
}

/// Logging flags, accepted by every subcommand.
#[derive(Debug, clap::Args)]
pub struct LogArgs {
    /// Log filter: a level (`info`) or `tracing` directives (`info,sortie_reducer=debug`).
    /// Without it, RUST_LOG, then `info`.
    #[arg(long, global = true, env = "SORTIE__LOG__LEVEL")]
    log_level: Option<String>,
    /// Log line format.
    #[arg(
        long,
        global = true,
        env = "SORTIE__LOG__FORMAT",
        value_enum,
        default_value = "text"
    )]
    log_format: LogFormat,
}

/// Installs the global `tracing` subscriber (logs to stderr).
pub fn init_logging(args: &LogArgs) {
    use tracing_subscriber::EnvFilter;
    let filter = args
        .log_level
        .as_deref()
        .and_then(|level| EnvFilter::try_new(level).ok())
        .or_else(|| EnvFilter::try_from_default_env().ok())
        .unwrap_or_else(|| EnvFilter::new("info"));
    // The MCP SDK logs every session it opens at info, and executors open one per tool
    // call: warnings only, unless the filter names it.
    let named = args
        .log_level
        .clone()
        .or_else(|| std::env::var("RUST_LOG").ok())
        .is_some_and(|spec| spec.contains("rmcp"));
    let filter = match "rmcp=warn".parse() {
        Ok(directive) if !named => filter.add_directive(directive),
        _ => filter,
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match args.log_format {
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .init(),
    }
    if let Some(level) = &args.log_level {
        if EnvFilter::try_new(level).is_err() {
            tracing::warn!(
                level,
                "The log level is not a valid filter; using RUST_LOG or info."
            );
        }
    }
}

/// Installs the process's Prometheus recorder with explicit histogram buckets (without
/// them histograms render as summaries), and a task that keeps it tidy.
pub fn install_metrics(buckets: &[&[(&str, &[f64])]]) -> anyhow::Result<PrometheusHandle> {
    let mut builder = PrometheusBuilder::new();
    for (name, bounds) in buckets.iter().flat_map(|b| b.iter()) {
        builder = builder
            .set_buckets_for_metric(Matcher::Full((*name).to_owned()), bounds)
            .with_context(|| format!("histogram buckets of {name}"))?;
    }
    let handle = builder
        .install_recorder()
        .context("installing the Prometheus recorder")?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

/// Readiness as the service reports it: `Ok`, or why not.
pub type Readiness = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// Serves `/metrics`, `/healthz` and `/readyz` on `explicit` or else `default` (port 0:
/// any free port). Prints `metrics listening on http://<addr>` on stdout once bound. An
/// explicit address must bind; the dev default is best effort (a second reducer on the
/// same machine logs a warning and runs without one).
pub async fn serve_ops(
    explicit: Option<&str>,
    default: &str,
    metrics: PrometheusHandle,
    readiness: Readiness,
) -> anyhow::Result<Option<SocketAddr>> {
    let addr = explicit.unwrap_or(default);
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(listener) => listener,
        Err(e) if explicit.is_none() => {
            tracing::warn!(addr, error = %e, "The metrics and health server could not bind its default address; running without it (set --metrics-addr).");
            return Ok(None);
        }
        Err(e) => return Err(e).with_context(|| format!("binding the metrics address {addr}")),
    };
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                async move {
                    (
                        [(
                            header::CONTENT_TYPE,
                            "text/plain; version=0.0.4; charset=utf-8",
                        )],
                        metrics.render(),
                    )
                }
            }),
        )
        .route(
            "/healthz",
            get(|| async { axum::Json(json!({"status": "ok"})) }),
        )
        .route(
            "/readyz",
            get(move || {
                let readiness = readiness.clone();
                async move { ready_response(readiness()) }
            }),
        );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "The metrics and health server stopped.");
        }
    });
    println!("metrics listening on http://{bound}");
    tracing::info!(addr = %bound, "Serving /metrics, /healthz and /readyz.");
    Ok(Some(bound))
}

fn ready_response(readiness: Result<(), String>) -> Response {
    match readiness {
        Ok(()) => axum::Json(json!({"status": "ready"})).into_response(),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "not_ready", "reason": reason})),
        )
            .into_response(),
    }
}
