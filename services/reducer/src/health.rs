//! The reducer's readiness, shared with whatever serves `/readyz`.
//!
//! Ready means: this instance is a member of the group with its assignment in hand,
//! every assigned partition has been restored from the changelog, and the loop has
//! polled since. An instance that owns no partition (more reducers than partitions) is
//! ready once it has joined: it is a standby, not a fault.

use std::sync::{Arc, Mutex};

#[derive(Debug, Clone)]
pub struct Health {
    inner: Arc<Mutex<Result<(), String>>>,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            inner: Arc::new(Mutex::new(Err("starting".to_owned()))),
        }
    }
}

impl Health {
    /// `Ok` when ready, otherwise why not.
    pub fn readiness(&self) -> Result<(), String> {
        self.inner
            .lock()
            .map(|r| r.clone())
            .unwrap_or_else(|_| Err("health state poisoned".to_owned()))
    }

    pub(crate) fn set(&self, readiness: Result<(), String>) {
        if let Ok(mut current) = self.inner.lock() {
            if *current != readiness {
                match &readiness {
                    Ok(()) => tracing::info!("The reducer is ready."),
                    Err(reason) => tracing::info!(reason, "The reducer is not ready."),
                }
                *current = readiness;
            }
        }
    }
}
