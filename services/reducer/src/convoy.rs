//! Holding a small batch for the results a transaction just sent out for.
//!
//! Under a light load a closed loop of runs splits into cohorts: the results of one
//! transaction's intents come back over a few milliseconds, some of them (a slower
//! executor pass, a later fetch) arrive while another transaction is in flight, and as
//! soon as it commits they go out without the rest. Once split the loop stays split,
//! and every step waits for two transactions instead of one: the other cohort's, then
//! its own (the performance log, 2026-12-06 midday: batches of 2, 18, 2, 18, ... at one
//! partition; two even cohorts of ten at three and twelve).
//!
//! So after a commit that dispatched at most [`LIGHT`] intents, an open batch waits
//! while any of those intents' results are still out, at most [`MAX_HOLD`] from the
//! commit (about an executor's round trip on this broker); the results join it and the
//! loop moves as one cohort: a transaction a step, with more records and, over many
//! partitions, more partitions in it, instead of two (the performance log, 2026-12-06
//! evening). A result counts as back by its key, the operation id its intent was
//! dispatched with, so the inputs already waiting do not end the wait. Nothing waits
//! under load (the driver holds only small batches, and only after a light commit), a
//! lone run never waits (its own result is the only one out), and a slow tool costs at
//! most [`MAX_HOLD`] to an input that arrives just after the commit that dispatched it.

use std::time::{Duration, Instant};

/// Longest a batch waits, counted from the commit whose results it waits for.
pub(crate) const MAX_HOLD: Duration = Duration::from_millis(6);

/// Most intents a commit may have dispatched for a batch to wait for their results: a
/// light load's. Under load nothing waits: held there too, the reducer did ~12 % fewer
/// steps a second in four alternated pairs (the performance log, 2026-12-06 afternoon).
pub(crate) const LIGHT: usize = 64;

/// What a batch dispatched, as the convoy needs it: how many intents and, while at most
/// [`LIGHT`], their operation ids.
#[derive(Debug, Default)]
pub(crate) struct Dispatched {
    count: usize,
    light: Vec<Box<[u8]>>,
}

impl Dispatched {
    /// The batch dispatched the intent `operation_id`.
    pub fn push(&mut self, operation_id: &str) {
        self.count += 1;
        if self.count <= LIGHT {
            self.light.push(operation_id.as_bytes().into());
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct Convoy {
    /// Of a light commit, the intents whose results have not come back, by operation id
    /// (the result's key).
    out: Vec<Box<[u8]>>,
    /// When its commit was answered.
    committed_at: Option<Instant>,
}

impl Convoy {
    /// A transaction that dispatched `dispatched` committed: if it was light, its
    /// intents' results are now out.
    pub fn committed(&mut self, dispatched: Dispatched) {
        self.committed_at = Some(Instant::now());
        self.out = match dispatched.count <= LIGHT {
            true => dispatched.light,
            false => Vec::new(),
        };
    }

    /// An input keyed `key` was taken into the open batch: if it is the result of one of
    /// the last commit's intents, that one is back.
    pub fn arrived(&mut self, key: Option<&[u8]>) {
        let Some(key) = key else { return };
        if let Some(at) = self.out.iter().position(|op| **op == *key) {
            self.out.swap_remove(at);
        }
    }

    /// How much longer an open batch should wait for the last commit's results, if at
    /// all: while a light commit's results are still out, at most [`MAX_HOLD`] from it.
    pub fn hold(&self) -> Option<Duration> {
        if self.out.is_empty() {
            return None;
        }
        MAX_HOLD
            .checked_sub(self.committed_at?.elapsed())
            .filter(|left| !left.is_zero())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A commit's intents as a batch records them: operation ids `op-0`, `op-1`, ...
    fn intents(count: usize) -> Dispatched {
        let mut dispatched = Dispatched::default();
        for i in 0..count {
            dispatched.push(&format!("op-{i}"));
        }
        dispatched
    }

    fn back(convoy: &mut Convoy, from: usize, to: usize) {
        for i in from..to {
            convoy.arrived(Some(format!("op-{i}").as_bytes()));
        }
    }

    /// Checked red with the hold ended at half the results back (the rule before two
    /// even cohorts were merged).
    #[test]
    fn a_batch_waits_until_the_last_commits_results_are_back() {
        let mut convoy = Convoy::default();
        assert_eq!(convoy.hold(), None, "nothing was dispatched yet");
        convoy.committed(intents(18));
        let left = convoy.hold().expect("held");
        assert!(left <= MAX_HOLD && left > Duration::ZERO, "{left:?}");
        back(&mut convoy, 0, 9);
        assert!(convoy.hold().is_some(), "half of them still out");
        back(&mut convoy, 9, 17);
        assert!(convoy.hold().is_some(), "one still out");
        back(&mut convoy, 17, 18);
        assert_eq!(convoy.hold(), None, "all back: it goes");
    }

    /// Checked red with `arrived` counting every input (as before results were told
    /// apart by their keys): the other cohort's own inputs ended the hold.
    #[test]
    fn only_the_commits_own_results_count_as_back() {
        let mut convoy = Convoy::default();
        convoy.committed(intents(10));
        for i in 0..10 {
            convoy.arrived(Some(format!("other-{i}").as_bytes()));
        }
        convoy.arrived(None);
        back(&mut convoy, 0, 9);
        back(&mut convoy, 0, 9);
        assert!(convoy.hold().is_some(), "a result counts once");
    }

    /// Checked red with the bound of [`LIGHT`] dropped.
    #[test]
    fn a_lone_run_and_a_batch_under_load_never_wait() {
        let mut convoy = Convoy::default();
        convoy.committed(intents(1));
        back(&mut convoy, 0, 1);
        assert_eq!(convoy.hold(), None, "its own result is back");
        // Under load nothing waits: the commit before sent out too many.
        convoy.committed(intents(500));
        assert_eq!(convoy.hold(), None);
        convoy.committed(intents(LIGHT));
        assert!(convoy.hold().is_some());
        convoy.committed(intents(0));
        assert_eq!(convoy.hold(), None);
    }

    /// Checked red with the bound dropped (a hold of `MAX_HOLD` whenever one is due).
    #[test]
    fn the_hold_ends_with_its_bound() {
        let mut convoy = Convoy::default();
        convoy.committed(intents(18));
        convoy.committed_at = Some(Instant::now() - MAX_HOLD);
        assert_eq!(convoy.hold(), None);
    }
}
