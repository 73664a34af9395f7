//! What every Sortie service process shares, so `sortie reducer`, `sortie executor`,
//! `sortie gateway` and an executor binary of your own take the same flags and serve the
//! same operations endpoints: how to reach the cluster ([`connection`]), payload sealing
//! ([`seal`]), logging and the `/metrics`, `/healthz`, `/readyz` server ([`telemetry`]),
//! and the shutdown signal.

pub mod connection;
pub mod seal;
pub mod telemetry;

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => return std::future::pending().await,
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
