//! Serving the router on a listener with the limits one client must not exceed: a client
//! that opens a connection must send its request's headers within `header_read_timeout`
//! (a socket that dribbles them, or sends nothing, is closed), and the gateway holds at
//! most `max_connections` connections at once (one more is closed as it is accepted, so
//! memory and file descriptors stay bounded). Without them a few thousand slow sockets,
//! no token needed, held every connection the gateway could serve.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::sync::Semaphore;

/// What one client may hold of the gateway.
#[derive(Debug, Clone, Copy)]
pub struct ServeLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
}

/// Serves `app` on `listener` until `shutdown` resolves, then waits for the connections
/// in flight to finish (graceful: an HTTP/1 connection closes after its request, an
/// HTTP/2 one after a GOAWAY).
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    limits: ServeLimits,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    // Out of descriptors, say: wait a little rather than spin.
                    tracing::warn!(%error, "A connection could not be accepted.");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            crate::metrics::connection_refused();
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let connection = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let watched = graceful.watch(connection);
        tokio::spawn(async move {
            // A connection ends with an error when its client goes away, or when its
            // headers did not come in time: nothing to tell anyone.
            let _ = watched.await;
            drop(permit);
        });
    }
    graceful.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::Instant;

    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::*;

    /// Slowloris: more sockets than the gateway holds, each sending half a request line
    /// and then nothing. The ones over the cap are closed at once, the others when their
    /// headers do not come in time, and a real client is served meanwhile (retrying a
    /// refused connection, as clients do). Seen red: with no header read timeout the slow
    /// sockets held every connection for good and the real client was never served.
    #[tokio::test]
    async fn slow_sockets_neither_hold_a_connection_nor_starve_real_clients() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = axum::Router::new().route("/ok", get(|| async { "ok" }));
        let limits = ServeLimits {
            max_connections: 8,
            header_read_timeout: Duration::from_millis(300),
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(serve(listener, app, limits, async {
            let _ = stopped.await;
        }));

        let mut slow = Vec::new();
        for _ in 0..20 {
            let mut socket = TcpStream::connect(addr).await.unwrap();
            let _ = socket.write_all(b"GET /ok HTTP/1.1\r\nHo").await;
            slow.push(socket);
        }
        let started = Instant::now();
        let served_at = loop {
            assert!(started.elapsed() < Duration::from_secs(10), "never served");
            if let Ok(mut socket) = TcpStream::connect(addr).await {
                let request = b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
                if socket.write_all(request).await.is_ok() {
                    let mut answer = String::new();
                    let _ = socket.read_to_string(&mut answer).await;
                    if answer.starts_with("HTTP/1.1 200") {
                        break started.elapsed();
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(served_at < Duration::from_secs(5), "{served_at:?}");
        // Every slow socket was closed by the gateway (end of stream, or a 408 then end).
        for mut socket in slow {
            let mut rest = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(5), socket.read_to_end(&mut rest));
            assert!(read.await.is_ok(), "a slow socket is still held");
        }
        stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), served)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}
