//! The executor's readiness, shared with whatever serves `/readyz`.
//!
//! Ready means: every queue's consumer is running and has joined its group (received an
//! assignment, possibly empty: more executors than partitions is a standby, not a fault),
//! and the executor is not shutting down.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, Default)]
pub struct Health {
    inner: Arc<Mutex<State>>,
}

#[derive(Debug, Default)]
struct State {
    /// queue → consuming (joined and its thread running).
    queues: BTreeMap<String, bool>,
    started: bool,
    stopping: bool,
}

impl Health {
    /// `Ok` when ready, otherwise why not.
    pub fn readiness(&self) -> Result<(), String> {
        let state = self
            .inner
            .lock()
            .map_err(|_| "health state poisoned".to_owned())?;
        if state.stopping {
            return Err("shutting down".to_owned());
        }
        if !state.started {
            return Err("starting".to_owned());
        }
        let waiting: Vec<&String> = state
            .queues
            .iter()
            .filter(|(_, consuming)| !**consuming)
            .map(|(queue, _)| queue)
            .collect();
        if waiting.is_empty() {
            Ok(())
        } else {
            Err(format!("not consuming queues {waiting:?} yet"))
        }
    }

    fn update(&self, change: impl FnOnce(&mut State)) {
        if let Ok(mut state) = self.inner.lock() {
            change(&mut state);
        }
    }

    /// The process serves these queues (none consuming yet).
    pub(crate) fn serving(&self, queues: &[String]) {
        self.update(|s| {
            s.queues = queues.iter().map(|q| (q.clone(), false)).collect();
            s.started = true;
        });
    }

    pub(crate) fn consuming(&self, queue: &str, consuming: bool) {
        self.update(|s| {
            s.queues.insert(queue.to_owned(), consuming);
        });
    }

    pub(crate) fn stopping(&self) {
        self.update(|s| s.stopping = true);
    }
}
