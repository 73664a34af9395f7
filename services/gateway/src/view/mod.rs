//! The read view: one task follows every partition of `sortie.run-state` and
//! `sortie.run-events` (`read_committed`, assigned, never a group member, from the offsets
//! in the store) and writes them into the gateway's own [`Store`]. It also hands the
//! reducer's answers (`CommandAccepted` / `CommandRejected`) to the writes waiting for them.
//!
//! Invariants:
//! - a record's effect and the offset after it are one atomic store write, so a restart
//!   reads on from where the store is, never skipping a record;
//! - progress (the next offset per partition) is published only after the store write, so
//!   a read that waited for a position sees the record at that position;
//! - a run's state only moves forward: an event is folded when it is the next one
//!   (`seq == last_event_seq + 1`), a changelog record is taken when it is further along;
//! - one run never stops the view: a run whose stored state or events cannot be read,
//!   folded or stored is quarantined (kept in the store with the reason, counted, logged
//!   once) and the view goes on, answering waiters about it too. Only an error of the
//!   store as a whole stops the view, and `/readyz` then says so.

mod apply;
mod follow;
mod position;

pub use follow::{partitions, start};
pub use position::{parse_positions, Position, Progress};

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use rdkafka::error::KafkaError;
use tokio::sync::{oneshot, watch};

use crate::store::{self, Source, Store};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kafka: {doing}: {source}")]
    Kafka { doing: String, source: KafkaError },
    #[error("topic {0} does not exist (run `sortie topology apply`)")]
    MissingTopic(String),
    #[error(transparent)]
    Store(#[from] store::Error),
}

fn kafka_error(doing: impl Into<String>) -> impl FnOnce(KafkaError) -> Error {
    move |source| Error::Kafka {
        doing: doing.into(),
        source,
    }
}

/// The code of an [`Answer`] that says the reducer kept a decision for an interrupt not
/// registered yet (`DecisionBuffered`).
pub const BUFFERED: &str = "decision_buffered";

/// The reducer's answer to one command.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// The tenant of the command answered (the answering event's).
    pub tenant: String,
    pub run_id: String,
    pub accepted: bool,
    pub duplicate: bool,
    pub code: String,
    pub reason: String,
    pub state_version: i64,
    pub position: Position,
}

/// A write waiting for its answer: the tenant and run it is about, and where to send the
/// answer.
struct Waiter {
    tenant: String,
    run_id: String,
    tx: oneshot::Sender<Answer>,
}

/// The view: its store, its progress, and the writes waiting for answers.
pub struct View {
    pub store: Store,
    progress: watch::Sender<Progress>,
    /// command id → waiting writes. Ids and run ids come from clients (`Idempotency-Key`,
    /// `run_id`), so two tenants may race the same pair: an answer goes only to writes of
    /// its own tenant about its own run.
    waiters: Mutex<HashMap<String, Vec<Waiter>>>,
    /// End offsets of (run-state, run-events) at start: ready once both are reached.
    targets: (BTreeMap<i32, i64>, BTreeMap<i32, i64>),
    /// Runs set aside (see [`Quarantine`](store::Quarantine)), in the store.
    quarantined: AtomicUsize,
}

impl fmt::Debug for View {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("View")
            .field("store", &self.store)
            .field("progress", &*self.progress.borrow())
            .finish_non_exhaustive()
    }
}

impl View {
    pub fn progress(&self) -> watch::Receiver<Progress> {
        self.progress.subscribe()
    }

    /// How many runs the view has set aside.
    pub fn quarantined(&self) -> usize {
        self.quarantined.load(Ordering::Relaxed)
    }

    /// Registers a write of `tenant` waiting for the answer to `command_id` about `run_id`.
    /// Register before publishing, so the answer cannot slip past.
    pub fn expect(
        &self,
        command_id: &str,
        tenant: &str,
        run_id: &str,
    ) -> oneshot::Receiver<Answer> {
        let (tx, rx) = oneshot::channel();
        self.waiters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(command_id.to_owned())
            .or_default()
            .push(Waiter {
                tenant: tenant.to_owned(),
                run_id: run_id.to_owned(),
                tx,
            });
        rx
    }

    /// Drops waiters for `command_id` that gave up.
    pub fn forget(&self, command_id: &str) {
        let mut waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(list) = waiters.get_mut(command_id) {
            list.retain(|w| !w.tx.is_closed());
            if list.is_empty() {
                waiters.remove(command_id);
            }
        }
    }

    /// Waits until `done` holds for the view (checked after every applied record), at most
    /// `timeout`. True when it held.
    pub async fn wait_until(&self, timeout: Duration, mut done: impl FnMut(&Self) -> bool) -> bool {
        let mut progress = self.progress();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            progress.borrow_and_update();
            if done(self) {
                return true;
            }
            match tokio::time::timeout_at(deadline, progress.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return done(self),
            }
        }
    }

    /// Waits until the view has applied every position, at most `timeout`.
    pub async fn reach(&self, positions: &[Position], timeout: Duration) -> bool {
        if positions.is_empty() {
            return true;
        }
        let mut progress = self.progress();
        let deadline = tokio::time::Instant::now() + timeout;
        let reached = |p: &Progress| positions.iter().all(|pos| p.reached(pos));
        tokio::time::timeout_at(deadline, progress.wait_for(reached))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    fn publish(&self, source: Source, partition: i32, next: i64, applied: bool) {
        let mut caught_up_now = None;
        self.progress.send_if_modified(|p| {
            let map = match source {
                Source::RunState => &mut p.states,
                Source::RunEvents => &mut p.events,
            };
            let entry = map.entry(partition).or_insert(0);
            let moved = next > *entry;
            *entry = (*entry).max(next);
            if applied {
                p.applied += 1;
            }
            let was_ready = p.ready;
            p.ready = p.ready
                || caught_up(&p.states, &self.targets.0) && caught_up(&p.events, &self.targets.1);
            if p.ready && !was_ready {
                caught_up_now = Some(p.applied);
            }
            moved || applied || p.ready != was_ready
        });
        if let Some(applied) = caught_up_now {
            tracing::info!(
                applied,
                "The view caught up with run-state and run-events; ready."
            );
        }
    }

    fn answer(&self, answer: Answer, command_id: &str) {
        let mut waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        let Some(list) = waiters.get_mut(command_id) else {
            return;
        };
        let (mine, others): (Vec<_>, Vec<_>) = list
            .drain(..)
            .partition(|w| w.run_id == answer.run_id && w.tenant == answer.tenant);
        *list = others;
        if list.is_empty() {
            waiters.remove(command_id);
        }
        drop(waiters);
        for waiter in mine {
            let _ = waiter.tx.send(answer.clone());
        }
    }
}

fn caught_up(next: &BTreeMap<i32, i64>, targets: &BTreeMap<i32, i64>) -> bool {
    targets
        .iter()
        .all(|(p, end)| next.get(p).copied().unwrap_or(0) >= *end)
}
