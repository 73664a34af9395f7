//! A bound on librdkafka's blocking transactional calls.
//!
//! Every transactional call takes a timeout, and the loop relies on it: a call that
//! times out is retried or aborts the batch (`txn`). librdkafka does not always keep
//! it. `send_offsets_to_transaction` never checks its timeout while it looks for the
//! group coordinator (confluentinc/librdkafka#5456), and a coordinator whose broker
//! left the cluster stays cached with nothing to wake the lookup up (#5511): when the
//! group coordinator's broker dies the call does not return until some other broker
//! changes state — in the cluster leader-kill test, minutes later, while the other
//! reducers waited for this one to rejoin the group.
//!
//! The call cannot be interrupted, and the client it blocks cannot be used again (its
//! transactional API is taken by the stuck call). So the loop arms the watchdog around
//! each call, and a call that outlives its own timeout by the grace period ends the
//! process with [`WEDGED_EXIT_CODE`], after one line that says which call and how long.
//! Its supervisor (Kubernetes, `sortie dev`, the test harness) starts it again with fresh
//! clients: a warm restart from sled, which fences this incarnation's open transaction
//! (aborted, nothing of it visible) — exactly what a crash at that point is, and the
//! crash suite proves a crash anywhere loses and repeats nothing.
//!
//! Why not rebuild the clients in the process, as for a fenced producer: the stuck call
//! holds its thread and its client for as long as librdkafka keeps it, possibly forever;
//! every occurrence would leak both.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The exit status of a reducer that ended itself because a call wedged (sysexits'
/// `EX_TEMPFAIL`: try again). Supervisors restart on it.
pub const WEDGED_EXIT_CODE: i32 = 75;

/// Arms a deadline around blocking calls; a thread ends the process when one passes.
#[derive(Clone)]
pub struct Watchdog {
    inner: Arc<Inner>,
}

struct Inner {
    armed: Mutex<Option<Armed>>,
    grace: Duration,
}

#[derive(Clone, Copy)]
struct Armed {
    what: &'static str,
    timeout: Duration,
    since: Instant,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog")
            .field("grace", &self.inner.grace)
            .finish_non_exhaustive()
    }
}

impl Watchdog {
    /// A watchdog whose thread ends the process when an armed call outlives its timeout
    /// by `grace`.
    pub fn start(grace: Duration) -> Self {
        let watchdog = Self::unwatched(grace);
        let inner = watchdog.inner.clone();
        let spawned = std::thread::Builder::new()
            .name("reducer-watchdog".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(250));
                if let Some((armed, late)) = inner.overdue() {
                    wedged(armed, late);
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "The watchdog thread did not start: a wedged Kafka call would not be noticed.");
        }
        watchdog
    }

    /// A watchdog no thread watches (unit tests).
    fn unwatched(grace: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                armed: Mutex::new(None),
                grace,
            }),
        }
    }

    /// Runs `call`, which should return within `timeout`, under the watchdog.
    pub fn bound<T>(&self, what: &'static str, timeout: Duration, call: impl FnOnce() -> T) -> T {
        self.set(Some(Armed {
            what,
            timeout,
            since: Instant::now(),
        }));
        let result = call();
        self.set(None);
        result
    }

    fn set(&self, armed: Option<Armed>) {
        if let Ok(mut slot) = self.inner.armed.lock() {
            *slot = armed;
        }
    }
}

impl Inner {
    /// The armed call and how far past its timeout it is, once that is beyond the grace.
    fn overdue(&self) -> Option<(Armed, Duration)> {
        let armed = (*self.armed.lock().ok()?)?;
        let late = armed.since.elapsed().checked_sub(armed.timeout)?;
        (late > self.grace).then_some((armed, late))
    }
}

/// Says why, then ends the process without running destructors or exit handlers: the
/// stuck thread holds librdkafka's locks, and `exit`'s handlers (OpenSSL's cleanup among
/// them) would run under the client's live threads. One of the workspace's few `unsafe`
/// calls (each with its SAFETY note): `_exit` has no precondition to break, and nothing
/// runs after it.
#[allow(unsafe_code)]
fn wedged(armed: Armed, late: Duration) -> ! {
    tracing::error!(
        call = armed.what,
        timeout_ms = armed.timeout.as_millis() as u64,
        late_ms = late.as_millis() as u64,
        exit_code = WEDGED_EXIT_CODE,
        "A Kafka call outlived its timeout: its client is wedged (librdkafka#5456). Exiting for the supervisor to restart this reducer with fresh clients; its open transaction is aborted when the next incarnation starts."
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: `_exit` takes a plain int and never returns.
    unsafe { libc::_exit(WEDGED_EXIT_CODE) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_call_past_its_timeout_and_the_grace_is_overdue() {
        let watchdog = Watchdog::unwatched(Duration::from_millis(20));
        assert!(watchdog.inner.overdue().is_none(), "nothing armed");
        watchdog.bound("quick", Duration::from_secs(10), || {
            assert!(watchdog.inner.overdue().is_none(), "within its timeout");
        });
        assert!(
            watchdog.inner.overdue().is_none(),
            "disarmed after the call"
        );
        watchdog.bound("stuck", Duration::from_millis(10), || {
            let until = Instant::now() + Duration::from_secs(5);
            while watchdog.inner.overdue().is_none() {
                assert!(Instant::now() < until, "never overdue");
                std::thread::yield_now();
            }
            let (armed, late) = watchdog.inner.overdue().expect("overdue");
            assert_eq!(armed.what, "stuck");
            assert!(late > Duration::from_millis(20));
        });
    }
}
