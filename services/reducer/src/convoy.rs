//! Holding a small batch for the results a transaction just sent out for.
//!
//! Under a light load a closed loop of runs splits into cohorts: the results of one
//! transaction's intents come back over a few milliseconds, a few of them (a slower
//! executor pass, a later fetch) arrive while another transaction is in flight, and as
//! soon as it commits they go out alone — a transaction of two inputs that begins a
//! millisecond before the other eighteen results arrive, which then wait the whole of it.
//! Once split the loop stays split, and every step waits for two transactions instead of
//! one (the performance log, 2026-12-06 midday: batches of 2, 18, 2, 18, ... at one
//! partition).
//!
//! So after a commit that dispatched intents, an open batch with fewer than half as many
//! inputs as that commit still has results to come waits for them — at most
//! [`MAX_HOLD`] from the commit, about what an executor's round trip takes on this
//! broker. The results then join it and the cohorts merge. A batch at least half as
//! large as what is still expected goes at once, as before: merging two even cohorts
//! doubles the partitions one transaction writes, which at 3 and 12 partitions measured
//! no faster. So does every batch under load (the driver holds only small batches, and
//! only after a commit of at most [`LIGHT`] intents), and a lone run (one intent out,
//! nothing else waiting) never waits. Slow tools cost at
//! most [`MAX_HOLD`] on an input that arrives just after a commit.

use std::time::{Duration, Instant};

/// Longest a small batch waits, counted from the commit whose results it waits for.
pub(crate) const MAX_HOLD: Duration = Duration::from_millis(6);

/// Most intents a commit may have dispatched for a batch to wait for their results: a
/// light load's. Under load nothing waits: held there too, the reducer did ~12 % fewer
/// steps a second in four alternated pairs (the performance log, 2026-12-06 afternoon).
pub(crate) const LIGHT: usize = 64;

#[derive(Debug, Default)]
pub(crate) struct Convoy {
    /// Intents the last committed transaction dispatched.
    dispatched: usize,
    /// When its commit was answered.
    committed_at: Option<Instant>,
    /// Inputs taken since then.
    arrived: usize,
}

impl Convoy {
    /// A transaction that dispatched `dispatched` intents committed.
    pub fn committed(&mut self, dispatched: usize) {
        *self = Convoy {
            dispatched,
            committed_at: Some(Instant::now()),
            arrived: 0,
        };
    }

    /// An input was taken into the open batch.
    pub fn arrived(&mut self) {
        self.arrived += 1;
    }

    /// How much longer an open batch of `inputs` should wait for the last commit's
    /// results, if at all.
    pub fn hold(&self, inputs: usize) -> Option<Duration> {
        if self.dispatched > LIGHT {
            return None;
        }
        let expected = self.dispatched.saturating_sub(self.arrived);
        if inputs.saturating_mul(2) >= expected {
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

    /// This and the next checked red with the rule at "fewer inputs than results out"
    /// (no half): both fail.
    #[test]
    fn a_small_batch_waits_for_the_larger_cohort_then_goes_with_it() {
        let mut convoy = Convoy::default();
        assert_eq!(convoy.hold(2), None, "nothing was dispatched yet");
        convoy.committed(18);
        // Two inputs carried over from before the commit: eighteen results still to come.
        let left = convoy.hold(2).expect("held");
        assert!(left <= MAX_HOLD && left > Duration::ZERO, "{left:?}");
        for _ in 0..4 {
            convoy.arrived();
        }
        assert!(
            convoy.hold(6).is_some(),
            "six waiting, fourteen still to come"
        );
        convoy.arrived();
        assert_eq!(
            convoy.hold(7),
            None,
            "half as many waiting as still to come"
        );
    }

    #[test]
    fn an_even_split_is_not_held() {
        // Two cohorts of ten (the usual split over many partitions): merging them would
        // make one transaction write twice the partitions, and measured no faster.
        let mut convoy = Convoy::default();
        convoy.committed(10);
        assert_eq!(convoy.hold(10), None);
        assert_eq!(convoy.hold(5), None);
        assert!(convoy.hold(4).is_some());
    }

    /// Checked red with the bound of [`LIGHT`] dropped.
    #[test]
    fn a_lone_run_and_a_batch_under_load_never_wait() {
        let mut convoy = Convoy::default();
        convoy.committed(1);
        assert_eq!(convoy.hold(1), None);
        convoy.committed(500);
        assert_eq!(convoy.hold(500), None);
        // Under load, even a small batch goes: the commit before sent out too many.
        assert_eq!(convoy.hold(2), None);
        convoy.committed(LIGHT);
        assert!(convoy.hold(2).is_some());
        convoy.committed(0);
        assert_eq!(convoy.hold(1), None);
    }

    /// Checked red with the bound dropped (a hold of `MAX_HOLD` whenever one is due).
    #[test]
    fn the_hold_ends_with_its_bound() {
        let mut convoy = Convoy::default();
        convoy.committed(18);
        convoy.committed_at = Some(Instant::now() - MAX_HOLD);
        assert_eq!(convoy.hold(2), None);
    }
}
