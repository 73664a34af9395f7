//! A bound on librdkafka's blocking calls, for the reducer's transactions and the
//! executor's offset commits.
//!
//! Every such call takes a timeout, or has one librdkafka applies, and the loops rely on
//! it: a call that times out is retried or aborts the batch. librdkafka does not always
//! keep it:
//!
//! - `send_offsets_to_transaction` never checks its timeout while it looks for the group
//!   coordinator (confluentinc/librdkafka#5456), and a coordinator whose broker left the
//!   cluster stays cached with nothing to wake the lookup up (#5511): when the group
//!   coordinator's broker dies the call does not return until some other broker changes
//!   state — in the cluster leader-kill test, minutes later, while the other reducers
//!   waited for this one to rejoin the group.
//! - A synchronous `commit` waits for its answer with no timeout of its own
//!   (`RD_POLL_INFINITE`); librdkafka fails a commit it had to defer after
//!   `session.timeout.ms` and a sent one after `socket.timeout.ms`, and commits made
//!   during a cooperative rebalance have a history of stalling consumers (#2933, #4059).
//!   An executor whose consumer thread stops there serves nothing, silently.
//!
//! A wedged call cannot be interrupted, and the client it blocks cannot be used again
//! (the stuck call holds it). So a loop arms the watchdog around each such call, and a
//! call that outlives its own timeout by the grace period ends the process with
//! [`WEDGED_EXIT_CODE`], after one line that says which call and how long. Its supervisor
//! (Kubernetes, `sortie dev`, the test harness) starts it again with fresh clients —
//! exactly what a crash at that point is, and the crash suite proves a crash anywhere
//! loses and repeats nothing. A reducer's open transaction is fenced by its next
//! incarnation; an executor's uncommitted intents are delivered again.
//!
//! Why not rebuild the clients in the process: the stuck call holds its thread and its
//! client for as long as librdkafka keeps it, possibly forever; every occurrence would
//! leak both.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The exit status of a service that ended itself because a call wedged (sysexits'
/// `EX_TEMPFAIL`: try again). Supervisors restart on it.
pub const WEDGED_EXIT_CODE: i32 = 75;

/// What a membership watchdog ([`Watchdog::watch_membership`]) names when it ends the
/// process.
pub const REJOINING: &str = "rejoining the consumer group";

/// Arms a deadline around blocking calls; a thread ends the process when one passes.
///
/// It holds one armed call per thread: threads may bound calls side by side (a reducer
/// initialises its two producers while the graph table loads). A call bound inside
/// another's bound on the same thread (a commit inside a poll that runs a rebalance
/// callback) is watched on its own deadline, and the outer one is watched again once it
/// returns.
#[derive(Clone)]
pub struct Watchdog {
    inner: Arc<Inner>,
}

struct Inner {
    /// The armed call of each thread that has one, and the held condition (see
    /// [`Watchdog::hold`]).
    armed: Mutex<Vec<(Slot, Armed)>>,
    grace: Duration,
    /// Which service, for the last line (`reducer`, `executor`).
    role: &'static str,
}

/// Whose armed call: a thread's bound call, or the held condition.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Slot {
    Thread(std::thread::ThreadId),
    Held,
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
            .field("role", &self.inner.role)
            .field("grace", &self.inner.grace)
            .finish_non_exhaustive()
    }
}

impl Watchdog {
    /// A watchdog whose thread ends the process when an armed call outlives its timeout
    /// by `grace`; `role` names the service in its last line and the thread's name.
    pub fn start(grace: Duration, role: &'static str) -> Self {
        let watchdog = Self::unwatched(grace, role);
        let inner = watchdog.inner.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("{role}-watchdog"))
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(250));
                if let Some((armed, late)) = inner.overdue() {
                    wedged(inner.role, armed, late);
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "The watchdog thread did not start: a wedged Kafka call would not be noticed.");
        }
        watchdog
    }

    /// A watchdog no thread watches (unit tests).
    fn unwatched(grace: Duration, role: &'static str) -> Self {
        Self {
            inner: Arc::new(Inner {
                armed: Mutex::new(Vec::new()),
                grace,
                role,
            }),
        }
    }

    /// Runs `call`, which should return within `timeout`, under the watchdog. The call is
    /// disarmed however it ends, a panic unwinding through it included: a thread that
    /// caught the panic and went on would otherwise be taken for wedged in it.
    pub fn bound<T>(&self, what: &'static str, timeout: Duration, call: impl FnOnce() -> T) -> T {
        struct Disarm<'w> {
            watchdog: &'w Watchdog,
            outer: Option<Armed>,
        }
        impl Drop for Disarm<'_> {
            fn drop(&mut self) {
                self.watchdog.replace(self.outer.take());
            }
        }
        let _disarm = Disarm {
            watchdog: self,
            outer: self.replace(Some(Armed {
                what,
                timeout,
                since: Instant::now(),
            })),
        };
        call()
    }

    /// Watches a condition rather than a call: `what` is armed from the first report
    /// with `on` set (keeping that start while it stays on) and disarmed by the first with
    /// `on` clear; past `timeout` and the grace the process ends as for a wedged call. For
    /// a state reported now and then (a consumer outside its group, from librdkafka's
    /// statistics, on whichever thread reports them), on a watchdog of its own.
    pub fn hold(&self, what: &'static str, timeout: Duration, on: bool) {
        // Looked at and changed under one lock: reports come from more than one thread.
        let Ok(mut slots) = self.inner.armed.lock() else {
            return;
        };
        let held = slots
            .iter()
            .any(|(slot, armed)| *slot == Slot::Held && armed.what == what);
        if on && !held {
            let armed = Armed {
                what,
                timeout,
                since: Instant::now(),
            };
            set(&mut slots, Slot::Held, Some(armed));
        } else if !on && held {
            set(&mut slots, Slot::Held, None);
        }
    }

    /// Feeds a membership watchdog from one statistics report of a group member: held
    /// while the coordinator answers (`up`) but the member is not in a settled group
    /// (`join_state` not `steady`) — a rebalance under way, or one it never gets out of:
    /// a member that polls on outside its group serves nothing and says nothing. Not
    /// while the coordinator is unreachable: a broker outage is waited out, not
    /// restarted through. `timeout`: [`crate::KafkaConfig::rejoin_timeout`].
    pub fn watch_membership(&self, statistics: &rdkafka::Statistics, timeout: Duration) {
        if let Some(group) = &statistics.cgrp {
            let outside = group.state == "up" && group.join_state != "steady";
            self.hold(REJOINING, timeout, outside);
        }
    }

    /// Arms (or with `None` disarms) this thread's slot; returns what it held.
    fn replace(&self, armed: Option<Armed>) -> Option<Armed> {
        self.arm(Slot::Thread(std::thread::current().id()), armed)
    }

    fn arm(&self, slot: Slot, armed: Option<Armed>) -> Option<Armed> {
        let Ok(mut slots) = self.inner.armed.lock() else {
            return None;
        };
        set(&mut slots, slot, armed)
    }

    /// What `slot` holds (the tests look).
    #[cfg(test)]
    fn armed(&self, slot: Slot) -> Option<Armed> {
        let slots = self.inner.armed.lock().ok()?;
        slots
            .iter()
            .find(|(s, _)| *s == slot)
            .map(|(_, armed)| *armed)
    }
}

/// Sets (or with `None` clears) `slot` among `slots`; returns what it held.
fn set(slots: &mut Vec<(Slot, Armed)>, slot: Slot, armed: Option<Armed>) -> Option<Armed> {
    let held = slots
        .iter()
        .position(|(s, _)| *s == slot)
        .map(|at| slots.swap_remove(at).1);
    if let Some(armed) = armed {
        slots.push((slot, armed));
    }
    held
}

impl Inner {
    /// The armed call and how far past its timeout it is, once that is beyond the grace.
    fn overdue(&self) -> Option<(Armed, Duration)> {
        let slots = self.armed.lock().ok()?;
        slots
            .iter()
            .filter_map(|(_, armed)| {
                let late = armed.since.elapsed().checked_sub(armed.timeout)?;
                (late > self.grace).then_some((*armed, late))
            })
            .max_by_key(|(_, late)| *late)
    }
}

/// Says why, then ends the process without running destructors or exit handlers: the
/// stuck thread holds librdkafka's locks, and `exit`'s handlers (OpenSSL's cleanup among
/// them) would run under the client's live threads. One of the workspace's few `unsafe`
/// calls (each with its SAFETY note): `_exit` has no precondition to break, and nothing
/// runs after it.
#[allow(unsafe_code)]
fn wedged(role: &'static str, armed: Armed, late: Duration) -> ! {
    tracing::error!(
        role,
        call = armed.what,
        timeout_ms = armed.timeout.as_millis() as u64,
        late_ms = late.as_millis() as u64,
        exit_code = WEDGED_EXIT_CODE,
        "A Kafka call outlived its timeout: its client is wedged. Exiting for the supervisor to restart this {role} with fresh clients (a restart is what a crash here is: nothing is lost or repeated)."
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
        let watchdog = Watchdog::unwatched(Duration::from_millis(20), "test");
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

    #[test]
    fn a_held_condition_is_overdue_from_when_it_was_first_seen_until_it_clears() {
        let watchdog = Watchdog::unwatched(Duration::from_millis(20), "test");
        watchdog.hold("rejoining", Duration::from_millis(30), false);
        assert!(watchdog.inner.overdue().is_none(), "never on");
        watchdog.hold("rejoining", Duration::from_millis(30), true);
        let since = || watchdog.armed(Slot::Held).expect("armed").since;
        let first = since();
        std::thread::sleep(Duration::from_millis(10));
        watchdog.hold("rejoining", Duration::from_millis(30), true);
        assert_eq!(
            since(),
            first,
            "still on: it keeps the time it was first seen"
        );
        std::thread::sleep(Duration::from_millis(60));
        let (armed, _) = watchdog.inner.overdue().expect("on past timeout and grace");
        assert_eq!(armed.what, "rejoining");
        watchdog.hold("rejoining", Duration::from_millis(30), false);
        assert!(watchdog.inner.overdue().is_none(), "cleared");
    }

    #[test]
    fn a_nested_call_is_watched_on_its_own_deadline_and_the_outer_one_again_after() {
        let watchdog = Watchdog::unwatched(Duration::from_millis(20), "test");
        watchdog.bound("poll", Duration::from_millis(10), || {
            watchdog.bound("commit", Duration::from_secs(60), || {
                std::thread::sleep(Duration::from_millis(50));
                assert!(
                    watchdog.inner.overdue().is_none(),
                    "the inner call is within its own timeout"
                );
            });
            let (armed, _) = watchdog.inner.overdue().expect("the outer call is overdue");
            assert_eq!(armed.what, "poll");
        });
        assert!(watchdog.inner.overdue().is_none(), "disarmed after both");
    }

    /// Red-proofed: with the slot restored after `call` returned (not on unwinding), the
    /// panicking call stayed armed and the thread, gone on, was taken for wedged in it.
    #[test]
    fn a_call_that_panics_is_disarmed_as_it_unwinds() {
        let watchdog = Watchdog::unwatched(Duration::from_millis(20), "test");
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            watchdog.bound("flush", Duration::from_millis(10), || {
                panic!("inside the call")
            })
        }));
        assert!(caught.is_err(), "the panic reaches the caller");
        std::thread::sleep(Duration::from_millis(30));
        assert!(
            watchdog.inner.overdue().is_none(),
            "nothing is left armed past its timeout"
        );
        assert!(watchdog.inner.armed.lock().expect("slots").is_empty());
    }

    /// Red-proofed: with one slot for every thread, the first call to return restored
    /// "nothing armed" over the second's, and the second then restored the first's —
    /// a call long returned stayed armed and, past its timeout, ended the process (a
    /// reducer initialising its two producers side by side, 60 s after every start).
    #[test]
    fn calls_bound_on_two_threads_side_by_side_are_each_watched_and_each_disarmed() {
        let watchdog = Watchdog::unwatched(Duration::from_millis(20), "test");
        let (armed_tx, armed_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let other = {
            let watchdog = watchdog.clone();
            std::thread::spawn(move || {
                watchdog.bound("init second", Duration::from_secs(60), || {
                    armed_tx.send(()).expect("armed");
                    let _ = release_rx.recv();
                });
            })
        };
        armed_rx.recv().expect("the other thread armed its call");
        watchdog.bound("init first", Duration::from_millis(10), || {
            std::thread::sleep(Duration::from_millis(50));
            let (armed, _) = watchdog
                .inner
                .overdue()
                .expect("this thread's call is overdue");
            assert_eq!(armed.what, "init first");
        });
        // This thread's call returned first; the other's is still watched, on its own
        // deadline.
        assert!(
            watchdog.inner.overdue().is_none(),
            "the other call is within its timeout"
        );
        assert_eq!(
            watchdog
                .armed(Slot::Thread(other.thread().id()))
                .map(|a| a.what),
            Some("init second")
        );
        release_tx.send(()).expect("release");
        other.join().expect("the other thread");
        assert!(
            watchdog.inner.armed.lock().expect("slots").is_empty(),
            "nothing stays armed once both calls returned"
        );
        // The same order with the calls' deadlines past: nothing left to end the process.
        std::thread::sleep(Duration::from_millis(50));
        assert!(watchdog.inner.overdue().is_none());
    }
}
