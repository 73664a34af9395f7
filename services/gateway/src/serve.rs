//! Serving the router on a listener with the limits one client must not exceed:
//!
//! - a connection with no request in flight must begin one within `header_read_timeout`
//!   — its request's headers read whole, on a fresh connection and between the requests
//!   of a kept-alive one — or it is closed. hyper times HTTP/1 headers itself, but not
//!   the first bytes it reads to tell HTTP/1 from HTTP/2 (a socket that sends nothing,
//!   or the start of the HTTP/2 preface, waited there for good), nor an idle HTTP/2
//!   connection: [`Activity`] watches every connection for that, whatever its protocol;
//! - the gateway holds at most `max_connections` connections at once, and at most
//!   `max_connections_per_address` from one source address (an IPv6 client's whole /64):
//!   one more is closed as it is accepted, so memory and file descriptors stay bounded
//!   and one host cannot take every connection.
//!
//! The body's own deadline, and never reading the body of a request that is not
//! authenticated, are the router's (`crate::extract`). Without these limits a few
//! thousand slow sockets, no token needed, held every connection the gateway could serve.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::sync::{Notify, Semaphore};
use tokio::time::Instant;

/// What one client may hold of the gateway.
#[derive(Debug, Clone, Copy)]
pub struct ServeLimits {
    pub max_connections: usize,
    pub max_connections_per_address: usize,
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
    let addresses = Arc::new(Addresses::new(limits.max_connections_per_address.max(1)));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
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
        let Some(slot) = Addresses::take(&addresses, peer.ip()) else {
            crate::metrics::connection_refused();
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let activity = Activity::new();
        let service = Tracked {
            inner: TowerToHyperService::new(app.clone()),
            activity: activity.clone(),
        };
        let connection = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let watched = graceful.watch(connection);
        let idle = limits.header_read_timeout;
        tokio::spawn(async move {
            tokio::select! {
                // A connection ends with an error when its client goes away, or when its
                // headers did not come in time: nothing to tell anyone.
                _ = watched => {}
                // Nothing in flight and nothing begun in time: dropping the connection
                // closes its socket (no request is cut short: none is in flight).
                () = activity.idle_for(idle) => {}
            }
            drop((permit, slot));
        });
    }
    graceful.shutdown().await;
    Ok(())
}

/// Connections held per source address.
#[derive(Debug)]
struct Addresses {
    limit: usize,
    held: Mutex<HashMap<IpAddr, usize>>,
}

/// One connection counted against its address; gives its place back when dropped.
#[derive(Debug)]
struct AddressSlot {
    addresses: Arc<Addresses>,
    key: IpAddr,
}

impl Addresses {
    fn new(limit: usize) -> Self {
        Self {
            limit,
            held: Mutex::new(HashMap::new()),
        }
    }

    /// The address a connection counts against: an IPv4 address (an IPv4-mapped IPv6
    /// one read as IPv4), or an IPv6 address's /64, which one host typically holds whole.
    fn key(ip: IpAddr) -> IpAddr {
        match ip.to_canonical() {
            IpAddr::V6(v6) => {
                let prefix = u128::from(v6) & !((1u128 << 64) - 1);
                IpAddr::V6(prefix.into())
            }
            v4 => v4,
        }
    }

    /// A place for one more connection from `ip`, if its address holds fewer than the
    /// limit.
    fn take(addresses: &Arc<Self>, ip: IpAddr) -> Option<AddressSlot> {
        let key = Self::key(ip);
        let mut held = addresses
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let count = held.entry(key).or_insert(0);
        if *count >= addresses.limit {
            return None;
        }
        *count += 1;
        Some(AddressSlot {
            addresses: addresses.clone(),
            key,
        })
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut held = self
            .addresses
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = held.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.key);
            }
        }
    }
}

/// Whether a connection is doing anything: its requests in flight (from their headers to
/// the end of their answer's body, so a live event stream counts), and since when it has
/// had none.
#[derive(Debug)]
struct Activity {
    state: Mutex<(usize, Instant)>,
    changed: Notify,
}

/// One request in flight on its connection, until dropped.
#[derive(Debug)]
struct InFlight(Arc<Activity>);

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new((0, Instant::now())),
            changed: Notify::new(),
        })
    }

    fn begin(self: &Arc<Self>) -> InFlight {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).0 += 1;
        self.changed.notify_waiters();
        InFlight(self.clone())
    }

    /// Resolves once the connection has had no request in flight for `limit`.
    async fn idle_for(&self, limit: Duration) {
        loop {
            // Created before the state is read, so a change after the read wakes it.
            let changed = self.changed.notified();
            let (in_flight, since) = *self.state.lock().unwrap_or_else(PoisonError::into_inner);
            if in_flight == 0 {
                tokio::select! {
                    () = tokio::time::sleep_until(since + limit) => return,
                    () = changed => {}
                }
            } else {
                changed.await;
            }
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        {
            let mut state = self.0.state.lock().unwrap_or_else(PoisonError::into_inner);
            state.0 -= 1;
            if state.0 == 0 {
                state.1 = Instant::now();
            }
        }
        self.0.changed.notify_waiters();
    }
}

/// The router as hyper calls it, counting each request in flight on its connection.
#[derive(Debug, Clone)]
struct Tracked<S> {
    inner: S,
    activity: Arc<Activity>,
}

impl<S> hyper::service::Service<hyper::Request<Incoming>> for Tracked<S>
where
    S: hyper::service::Service<
        hyper::Request<Incoming>,
        Response = hyper::Response<Body>,
        Error = Infallible,
    >,
    S::Future: Send + 'static,
{
    type Response = hyper::Response<Body>;
    type Error = Infallible;
    type Future =
        Pin<Box<dyn Future<Output = Result<hyper::Response<Body>, Infallible>> + Send + 'static>>;

    fn call(&self, request: hyper::Request<Incoming>) -> Self::Future {
        let in_flight = self.activity.begin();
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = answer.await?;
            Ok(response.map(|body| {
                Body::new(TrackedBody {
                    body,
                    _in_flight: in_flight,
                })
            }))
        })
    }
}

/// An answer's body, holding its request in flight until the body is done with.
#[derive(Debug)]
struct TrackedBody {
    body: Body,
    _in_flight: InFlight,
}

impl hyper::body::Body for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::net::SocketAddr;
    use std::time::Instant;

    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpSocket, TcpStream};

    use super::*;

    /// A server for `app` with `limits`; dropping the sender stops it.
    async fn server(
        app: axum::Router,
        limits: ServeLimits,
    ) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve(listener, app, limits, async {
            let _ = stopped.await;
        }));
        (addr, stop)
    }

    fn ok_app() -> axum::Router {
        axum::Router::new().route("/ok", get(|| async { "ok" }))
    }

    /// How long until the server closes `socket` (end of stream or reset), if it does
    /// within `within`.
    async fn closed_within(socket: &mut TcpStream, within: Duration) -> Option<Duration> {
        let started = Instant::now();
        let mut rest = Vec::new();
        tokio::time::timeout(within, socket.read_to_end(&mut rest))
            .await
            .ok()
            .map(|_| started.elapsed())
    }

    /// A connection from `source` (any 127/8 address: Linux routes them all to lo).
    async fn connect_from(source: [u8; 4], addr: SocketAddr) -> TcpStream {
        let socket = TcpSocket::new_v4().unwrap();
        socket.bind(SocketAddr::from((source, 0))).unwrap();
        socket.connect(addr).await.unwrap()
    }

    /// Slowloris: more sockets than the gateway holds, each sending half a request line
    /// and then nothing. The ones over the cap are closed at once, the others when their
    /// headers do not come in time, and a real client is served meanwhile (retrying a
    /// refused connection, as clients do). Seen red: with no header read timeout the slow
    /// sockets held every connection for good and the real client was never served.
    #[tokio::test]
    async fn slow_sockets_neither_hold_a_connection_nor_starve_real_clients() {
        let limits = ServeLimits {
            max_connections: 8,
            max_connections_per_address: 1000,
            header_read_timeout: Duration::from_millis(300),
        };
        let (addr, stop) = server(ok_app(), limits).await;

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
            let closed = closed_within(&mut socket, Duration::from_secs(5)).await;
            assert!(closed.is_some(), "a slow socket is still held");
        }
        drop(stop);
    }

    /// A socket that sends nothing, and one that sends the start of the HTTP/2 preface,
    /// are closed at the header deadline too. Seen red: with hyper's own header timeout
    /// alone (no idle watch) both were held for good — hyper waits for the bytes that
    /// tell HTTP/1 from HTTP/2 with no deadline.
    #[tokio::test]
    async fn silent_sockets_and_half_a_preface_are_closed_at_the_header_deadline() {
        let limits = ServeLimits {
            max_connections: 100,
            max_connections_per_address: 100,
            header_read_timeout: Duration::from_millis(300),
        };
        let (addr, stop) = server(ok_app(), limits).await;
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let mut preface = TcpStream::connect(addr).await.unwrap();
        preface.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
        for socket in [&mut silent, &mut preface] {
            let closed = closed_within(socket, Duration::from_secs(5)).await;
            assert!(
                closed.is_some_and(|t| t < Duration::from_secs(2)),
                "{closed:?}"
            );
        }
        drop(stop);
    }

    /// One address gets at most its share: past it a connection is closed as it is
    /// accepted, while another address is served, and a place given back is taken again.
    /// Seen red with the per-address count skipped: the third connection was held.
    #[tokio::test]
    async fn one_address_holds_at_most_its_share_of_connections() {
        let limits = ServeLimits {
            max_connections: 100,
            max_connections_per_address: 2,
            header_read_timeout: Duration::from_secs(30),
        };
        let (addr, stop) = server(ok_app(), limits).await;
        let first = connect_from([127, 0, 0, 2], addr).await;
        let _second = connect_from([127, 0, 0, 2], addr).await;
        let mut third = connect_from([127, 0, 0, 2], addr).await;
        let closed = closed_within(&mut third, Duration::from_secs(5)).await;
        assert!(
            closed.is_some(),
            "the third connection from one address is held"
        );

        let get = async |mut socket: TcpStream| {
            let request = b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
            socket.write_all(request).await.unwrap();
            let mut answer = String::new();
            let _ = socket.read_to_string(&mut answer).await;
            answer
        };
        let other = connect_from([127, 0, 0, 3], addr).await;
        assert!(get(other).await.starts_with("HTTP/1.1 200"));
        // The first gives its place back once the server has closed it.
        assert!(get(first).await.starts_with("HTTP/1.1 200"));
        let again = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                let socket = connect_from([127, 0, 0, 2], addr).await;
                let answer = get(socket).await;
                if answer.starts_with("HTTP/1.1 200") {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        assert!(again.await.is_ok(), "the place given back is never taken");
        drop(stop);
    }

    /// An answer that streams for longer than the header deadline (a live event stream)
    /// is not cut: its request is in flight until its body ends. Seen red with the
    /// request counted only until its answer's headers: the stream was cut after "a".
    #[tokio::test]
    async fn a_long_answer_is_not_taken_for_an_idle_connection() {
        let app = axum::Router::new().route(
            "/stream",
            get(|| async {
                let ticks = futures::stream::unfold(0u8, |n| async move {
                    if n == 6 {
                        return None;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    Some((Ok::<_, Infallible>(Bytes::from(vec![b'a' + n])), n + 1))
                });
                Body::from_stream(ticks)
            }),
        );
        let limits = ServeLimits {
            max_connections: 10,
            max_connections_per_address: 10,
            header_read_timeout: Duration::from_millis(200),
        };
        let (addr, stop) = server(app, limits).await;
        let mut socket = TcpStream::connect(addr).await.unwrap();
        socket
            .write_all(b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = String::new();
        let _ = socket.read_to_string(&mut answer).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        let body: String = answer
            .split("\r\n\r\n")
            .nth(1)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.len() == 1 && l.bytes().all(|b| b.is_ascii_lowercase()))
            .collect();
        assert_eq!(body, "abcdef", "{answer}");
        drop(stop);
    }
}
