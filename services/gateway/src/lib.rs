//! Sortie's HTTP gateway (SPEC §4.3): the run API, auth and tenancy, and the read views.
//!
//! Writes become `RunCommand`s on `sortie.commands` (the run's canonical partition); the
//! gateway waits, bounded, for the reducer's `CommandAccepted` / `CommandRejected` with that
//! command id on `sortie.run-events` and answers with its status and log position. Reads
//! come from the gateway's own sled view of `sortie.run-state` and `sortie.run-events`, so
//! gateways scale out, each with its own view, and a read can wait until the view has
//! reached a write's position (read-your-writes).
//!
//! The gateway never decides anything about a run and never asks the reducer: it checks
//! who is calling and what they may see, publishes, and reports what the log says.

pub mod admission;
mod api;
mod app;
pub mod auth;
pub mod config;
pub mod deltas;
pub mod error;
mod extract;
pub mod fault;
mod graphs;
mod inbox;
mod limits;
pub mod metrics;
mod openapi;
mod render;
pub mod serve;
pub mod store;
mod ui;
pub mod view;
mod why;

/// Epoch milliseconds as the API's RFC 3339 timestamps (`ts`, a checkpoint's `created_at`).
pub use render::rfc3339;
use std::future::Future;

pub use api::{router, IDEMPOTENCY_HEADER, MIN_POSITION_HEADER, ROUTES};
pub use app::{AppState, Error};
pub use config::{GatewayConfig, JwksSource, JwtConfig, TokenEntry};
pub use openapi::document as openapi_document;

/// Serves the API on `listener` until `shutdown` resolves, then stops the view (flushing
/// its store) and ends open event streams.
pub async fn serve(
    config: GatewayConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let state = AppState::start(config).await?;
    let app = router(state.clone());
    let stopping = state.clone();
    tracing::info!(addr = ?listener.local_addr().ok(), "The gateway is serving.");
    let limits = serve::ServeLimits {
        max_connections: state.config().max_connections,
        max_connections_per_address: state.config().max_connections_per_address,
        header_read_timeout: state.config().header_read_timeout,
    };
    let served = serve::serve(listener, app, limits, async move {
        shutdown.await;
        tracing::info!("Shutting down: closing event streams and the view.");
        // Live streams end when the view stops, so the graceful shutdown can finish.
        stopping.stop().await;
    })
    .await;
    state.stop().await;
    served.map_err(Error::Serve)
}
