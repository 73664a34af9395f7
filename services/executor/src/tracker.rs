//! Which offsets of one partition may be committed.
//!
//! Intents of a partition run concurrently and finish in any order, but a Kafka commit is
//! one position per partition: "everything below this is done". The tracker holds the
//! offsets handed out and not yet done; the committable position is the lowest of them
//! (or, when none is pending, one past the highest handed out). An offset that is still
//! in flight is therefore never skipped by a commit, whatever finished after it.
//!
//! Offsets that are done *before* their work (`unsafe` / `reconcilable`: committed before
//! the receiver is called) carry a waiter, resolved once a commit covers them, so the
//! task calls the receiver only when its intent can no longer be redelivered.

use std::collections::{BTreeMap, BTreeSet};

#[derive(Debug)]
pub(crate) struct PartitionTracker<W> {
    pending: BTreeSet<i64>,
    /// One past the highest offset handed out.
    next: Option<i64>,
    /// The last position known committed.
    committed: Option<i64>,
    /// Done-before-work offsets waiting for a commit to cover them.
    waiters: BTreeMap<i64, W>,
}

impl<W> Default for PartitionTracker<W> {
    fn default() -> Self {
        Self {
            pending: BTreeSet::new(),
            next: None,
            committed: None,
            waiters: BTreeMap::new(),
        }
    }
}

impl<W> PartitionTracker<W> {
    /// An offset handed to a task.
    pub fn track(&mut self, offset: i64) {
        self.pending.insert(offset);
        self.next = Some(self.next.map_or(offset + 1, |n| n.max(offset + 1)));
    }

    /// The offset's work is done (its result delivered): it may be committed.
    pub fn done(&mut self, offset: i64) {
        self.pending.remove(&offset);
    }

    /// The offset may be committed now, before its work; `waiter` is returned by
    /// [`PartitionTracker::committed`] once a commit covers it.
    pub fn done_and_wait(&mut self, offset: i64, waiter: W) {
        self.pending.remove(&offset);
        self.waiters.insert(offset, waiter);
    }

    /// The position to commit now, if it moved since the last commit.
    pub fn to_commit(&self) -> Option<i64> {
        let position = self.pending.first().copied().or(self.next)?;
        match self.committed {
            Some(committed) if committed >= position => None,
            _ => Some(position),
        }
    }

    /// Whether a waiter needs a commit to go on.
    pub fn has_waiters(&self) -> bool {
        !self.waiters.is_empty()
    }

    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// `position` was committed: the waiters it covers, to be told "go on".
    pub fn committed(&mut self, position: i64) -> Vec<W> {
        self.committed = Some(self.committed.map_or(position, |c| c.max(position)));
        let rest = self.waiters.split_off(&position);
        std::mem::replace(&mut self.waiters, rest)
            .into_values()
            .collect()
    }

    /// Takes back the offsets of waiters not yet covered by a commit: they are pending
    /// again (so no later commit passes them) and their waiters are returned, to be told
    /// "do not call": the intent will be delivered again.
    pub fn hand_back(&mut self) -> Vec<W> {
        let waiters = std::mem::take(&mut self.waiters);
        self.pending.extend(waiters.keys().copied());
        waiters.into_values().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_commit_never_passes_an_offset_in_flight() {
        let mut t = PartitionTracker::<()>::default();
        assert_eq!(t.to_commit(), None, "nothing handed out yet");
        for offset in [10, 11, 13] {
            t.track(offset); // 12: a transaction marker, never delivered
        }
        t.done(11);
        t.done(13);
        assert_eq!(t.to_commit(), Some(10), "10 is still in flight");
        t.done(10);
        assert_eq!(t.to_commit(), Some(14), "all done: one past the last");
        t.committed(14);
        assert_eq!(t.to_commit(), None, "already committed");
        t.track(14);
        assert_eq!(
            t.to_commit(),
            None,
            "14 in flight; 14 is the committed position"
        );
    }

    #[test]
    fn waiters_go_on_only_once_a_commit_covers_them() {
        let mut t = PartitionTracker::default();
        t.track(5);
        t.track(6);
        t.track(7);
        t.done_and_wait(6, "six");
        assert!(t.has_waiters());
        assert_eq!(
            t.to_commit(),
            Some(5),
            "5 still runs: 6 may not be committed yet"
        );
        assert!(t.committed(5).is_empty());
        t.done(5);
        assert_eq!(t.to_commit(), Some(7));
        assert_eq!(t.committed(7), vec!["six"]);
        assert!(!t.has_waiters());
    }

    #[test]
    fn handed_back_waiters_are_pending_again() {
        let mut t = PartitionTracker::default();
        t.track(1);
        t.track(2);
        t.done_and_wait(2, "two");
        t.committed(1);
        assert_eq!(t.hand_back(), vec!["two"]);
        t.done(1);
        assert_eq!(
            t.to_commit(),
            Some(2),
            "2 was handed back: it will be delivered again"
        );
        assert_eq!(t.pending(), 1);
    }
}
