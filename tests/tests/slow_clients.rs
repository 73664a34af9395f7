//! The gateway keeps serving under slow clients (issue #57 item 4), on the real stack:
//!
//! - `a_real_client_is_served_while_slow_sockets_are_held`: `SORTIE_SLOW_SOCKETS` (500;
//!   5,000 for the figures in `docs/security.md`) sockets from 127.0.0.2, 127.0.0.3, …
//!   (100 per address, under the per-address cap, and `--max-connections` set above
//!   their number, so neither cap is what saves the gateway), half sending nothing, half
//!   trickling a request's headers a byte every 500 ms, each reconnecting once it is
//!   closed, so as many are held all along. A real client's start answers within twice
//!   its quiet p99 (plus 50 ms), and the gateway closes every slow socket within its
//!   header deadline (2 s here) plus 1 s. Seen red with the header deadline taken out
//!   (`--header-read-timeout-ms 3600000`): no slow socket was closed.
//! - `a_body_is_read_only_after_authentication_and_by_its_deadline`: a request without a
//!   token (or with a bad one) that declares an 8 MiB body and sends none is answered
//!   401 at once with `Connection: close` and its connection closed, nothing of its body
//!   read; an authenticated request whose body stops coming is answered 408
//!   `body_timeout` at its body deadline and closed. Seen red with the drain of
//!   `guard_body` run for every caller: the 401 came only at the body deadline; with
//!   `JsonBody` reading without its deadline, the stalled body was held past the test's
//!   wait.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sortie_tests::http::Api;
use sortie_tests::stack::Stack;
use sortie_tests::THREE_STEPS;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

const BOB: &str = "acme:user:bob::tok-bob";

/// The header deadline the gateway is started with.
const HEADER_DEADLINE: Duration = Duration::from_secs(2);
/// How much later than its header deadline a slow socket may be closed: the deadline
/// runs from the gateway's accept, which trails the client's connect while thousands of
/// connections wait in the listen queue, and timers fire late on two loaded cores.
const CLOSE_SLACK: Duration = Duration::from_secs(1);
/// Slow sockets per source address (the per-address cap is 256).
const PER_ADDRESS: usize = 100;
/// Starts measured quietly and under the slow sockets.
const STARTS: usize = 50;

/// The nearest-rank percentile `p` (0..=100) of `samples`.
fn percentile(samples: &[Duration], p: usize) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    let rank = (p * sorted.len()).div_ceil(100).max(1);
    sorted.get(rank - 1).copied().unwrap_or_default()
}

/// `count` starts, one after another, each timed from its request to its whole answer.
async fn timed_starts(api: &Api, count: usize) -> Vec<Duration> {
    let mut took = Vec::with_capacity(count);
    for i in 0..count {
        let started = Instant::now();
        let (status, answer) = api
            .post(
                "/v1/runs",
                "tok-bob",
                json!({"graph_id": "three", "input": {"order": i}}),
            )
            .await;
        took.push(started.elapsed());
        assert_eq!(status, 201, "{answer}");
    }
    took
}

/// What the slow sockets saw: how long each was held before the gateway closed it, or
/// why it was not.
#[derive(Default)]
struct Slow {
    open: AtomicUsize,
    /// Sockets that have connected at least once.
    started: AtomicUsize,
    closed_after: Mutex<Vec<Duration>>,
    failures: Mutex<Vec<String>>,
}

/// One slow client: connects from its source address, holds the socket (silent, or
/// trickling headers) until the gateway closes it, and again, until `stop`.
async fn slow_client(i: usize, gateway: SocketAddr, stop: Arc<AtomicBool>, slow: Arc<Slow>) {
    let source = 2 + i / PER_ADDRESS;
    let source = Ipv4Addr::new(127, 0, (source / 250) as u8, (source % 250) as u8);
    let trickle = i % 2 == 1;
    let mut first = true;
    while !stop.load(Ordering::Relaxed) {
        let fail = |what: String| {
            slow.failures
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(what);
        };
        let socket = match TcpSocket::new_v4().and_then(|s| {
            s.bind(SocketAddr::from((source, 0)))?;
            Ok(s)
        }) {
            Ok(socket) => socket,
            Err(e) => return fail(format!("socket from {source}: {e}")),
        };
        let mut stream =
            match tokio::time::timeout(Duration::from_secs(10), socket.connect(gateway)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => return fail(format!("connect from {source}: {e}")),
                Err(_) => return fail(format!("connect from {source}: no answer in 10 s")),
            };
        if first {
            slow.started.fetch_add(1, Ordering::Relaxed);
            first = false;
        }
        slow.open.fetch_add(1, Ordering::Relaxed);
        let held = hold(&mut stream, trickle).await;
        slow.open.fetch_sub(1, Ordering::Relaxed);
        match held {
            Some(after) => slow
                .closed_after
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(after),
            None => {
                return fail(format!(
                    "a socket from {source} ({}) was still held after {:?}",
                    if trickle { "trickling" } else { "silent" },
                    HEADER_DEADLINE + CLOSE_SLACK * 5
                ))
            }
        }
    }
}

/// Holds `stream` until the gateway closes it (end of stream, a reset, or a refused
/// write): how long that took, or `None` if it was still held well past the deadline.
async fn hold(stream: &mut TcpStream, trickle: bool) -> Option<Duration> {
    let started = Instant::now();
    let give_up = tokio::time::Instant::now() + HEADER_DEADLINE + CLOSE_SLACK * 5;
    if trickle
        && stream
            .write_all(b"POST /v1/runs HTTP/1.1\r\nHost: gateway\r\nX-Slow: ")
            .await
            .is_err()
    {
        return Some(started.elapsed());
    }
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    let mut buffer = [0u8; 1024];
    loop {
        tokio::select! {
            read = stream.read(&mut buffer) => match read {
                Ok(0) | Err(_) => return Some(started.elapsed()),
                Ok(_) => {} // an answer (a 408), then the end
            },
            _ = tick.tick(), if trickle => {
                if stream.write_all(b"a").await.is_err() {
                    return Some(started.elapsed());
                }
            }
            () = tokio::time::sleep_until(give_up) => return None,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_client_is_served_while_slow_sockets_are_held() {
    let sockets: usize = std::env::var("SORTIE_SLOW_SOCKETS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(500);
    let stack = Stack::start("slow-clients", &[THREE_STEPS]).await;
    let _reducer = stack.reducer("0");
    let deadline_ms = HEADER_DEADLINE.as_millis().to_string();
    // The total cap above the slow sockets' number: what keeps the gateway serving must
    // be the deadline, not a cap that turns the slow sockets away.
    let max_connections = (sockets + 1000).to_string();
    let (gateway, url) = stack
        .gateway_process_with(
            &stack.dir.join("gateway"),
            &[BOB],
            &[
                "--header-read-timeout-ms",
                &deadline_ms,
                "--max-connections",
                &max_connections,
            ],
        )
        .await;
    let api = Api::new(&url);
    let addr: SocketAddr = url
        .trim_start_matches("http://")
        .parse()
        .expect("the gateway's address");

    timed_starts(&api, 10).await; // warm: connections, the producer, the view
    let quiet = timed_starts(&api, STARTS).await;

    let stop = Arc::new(AtomicBool::new(false));
    let slow = Arc::new(Slow::default());
    let mut clients = Vec::with_capacity(sockets);
    for i in 0..sockets {
        let (stop, slow) = (stop.clone(), slow.clone());
        // Spread over the header deadline, so the sockets are not closed in waves.
        let offset = HEADER_DEADLINE * (i as u32) / (sockets as u32);
        clients.push(tokio::spawn(async move {
            tokio::time::sleep(offset).await;
            slow_client(i, addr, stop, slow).await;
        }));
    }
    let ramp = Instant::now();
    sortie_tests::wait_until(
        "every slow socket to be open",
        Duration::from_secs(120),
        || {
            let slow = slow.clone();
            async move {
                slow.started.load(Ordering::Relaxed) == sockets
                    || !slow
                        .failures
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .is_empty()
            }
        },
    )
    .await;
    let open_at_start = slow.open.load(Ordering::Relaxed);
    let loaded = timed_starts(&api, STARTS).await;
    let open_at_end = slow.open.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.await.expect("a slow client");
    }

    let failures = slow
        .failures
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let closed = slow
        .closed_after
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let (quiet_p99, loaded_p99) = (percentile(&quiet, 99), percentile(&loaded, 99));
    let latest_close = closed.iter().max().copied().unwrap_or_default();
    println!(
        "slow sockets: {sockets} ({} per source address), open when the loaded starts began {open_at_start}, at their end {open_at_end}, ramp {:?}",
        PER_ADDRESS,
        ramp.elapsed()
    );
    println!(
        "start latency, {STARTS} each: quiet p50 {:?} p99 {quiet_p99:?}; loaded p50 {:?} p99 {loaded_p99:?}",
        percentile(&quiet, 50),
        percentile(&loaded, 50)
    );
    println!(
        "slow sockets closed by the gateway: {} closes, p50 {:?}, p99 {:?}, latest {latest_close:?} after connecting (header deadline {HEADER_DEADLINE:?})",
        closed.len(),
        percentile(&closed, 50),
        percentile(&closed, 99)
    );
    assert!(
        failures.is_empty(),
        "{} slow sockets failed, e.g. {:?}\n{}",
        failures.len(),
        &failures[..failures.len().min(5)],
        gateway.own_log_text()
    );
    // Twice the quiet p99, plus 50 ms: a start is a few milliseconds of work around a
    // Kafka round trip (publish, the reducer's transaction, the answer on run-events), so
    // at tiny latencies one scheduling hiccup on two shared cores would double it with
    // the gateway doing nothing wrong; 50 ms stays far below the seconds a starved
    // gateway takes (the slow sockets are held for 2 s each).
    assert!(
        loaded_p99 <= quiet_p99 * 2 + Duration::from_millis(50),
        "under {sockets} slow sockets a start's p99 was {loaded_p99:?} (quiet {quiet_p99:?})"
    );
    assert!(
        latest_close <= HEADER_DEADLINE + CLOSE_SLACK,
        "a slow socket was held {latest_close:?} (header deadline {HEADER_DEADLINE:?})"
    );
    assert!(closed.len() >= sockets, "{} closes", closed.len());
}

/// Sends `head` (a request's headers) on a fresh connection to `addr` and reads until
/// the gateway closes it, at most `within`: the answer, and how long it took.
async fn answer_to(addr: SocketAddr, head: &str, within: Duration) -> (String, Duration) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(head.as_bytes()).await.expect("send");
    let started = Instant::now();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(within, stream.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    assert!(
        read.is_ok(),
        "the connection was still open after {within:?}: {answer}"
    );
    (answer, started.elapsed())
}

fn body_of(answer: &str) -> Value {
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {answer}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_is_read_only_after_authentication_and_by_its_deadline() {
    let stack = Stack::start("slow-bodies", &[THREE_STEPS]).await;
    let (_gateway, url) = stack
        .gateway_process_with(
            &stack.dir.join("gateway"),
            &[BOB],
            &["--body-read-timeout-ms", "1000"],
        )
        .await;
    let addr: SocketAddr = url
        .trim_start_matches("http://")
        .parse()
        .expect("the gateway's address");

    // No token, a bad token: 401 at once, the connection closed, no body read (none is
    // ever sent: reading it would wait for the body deadline).
    for authorization in ["", "Authorization: Bearer not-a-token\r\n"] {
        let head = format!(
            "POST /v1/runs HTTP/1.1\r\nHost: gateway\r\n{authorization}Content-Type: application/json\r\nContent-Length: 8388608\r\n\r\n"
        );
        let (answer, took) = answer_to(addr, &head, Duration::from_secs(10)).await;
        assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
        assert!(
            answer.to_ascii_lowercase().contains("connection: close"),
            "{answer}"
        );
        assert!(took < Duration::from_millis(900), "{took:?}: {answer}");
    }

    // Authenticated, and the body stops coming: 408 at the body deadline, closed.
    let head = "POST /v1/runs HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer tok-bob\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"graph_id\": ";
    let (answer, took) = answer_to(addr, head, Duration::from_secs(10)).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert_eq!(
        body_of(&answer)["error"]["code"],
        "body_timeout",
        "{answer}"
    );
    assert!(
        answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "{took:?}"
    );

    // A body that comes whole is read as before.
    let api = Api::new(&url);
    let (status, refused) = api.post("/v1/runs", "tok-bob", json!({"input": {}})).await;
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (400, Some("invalid_request")),
        "{refused}"
    );
}
