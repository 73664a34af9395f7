//! Fault points for crash tests: where a reducer may be told to die on purpose.
//!
//! Off unless set explicitly (`sortie reducer --fault <point>` or `SORTIE_FAULT=<point>`,
//! optionally `--fault-after N` to let N - 1 passes through first). At the point, the
//! reducer logs one line and calls [`std::process::abort`]: no destructor runs, no
//! transaction is finished, sled is not written — as with SIGKILL. The mechanism is
//! [`sortie_kafka::fault`]'s; this module is the reducer's list of points.

pub use sortie_kafka::fault::UnknownFaultPoint;

sortie_kafka::fault_points! {
    /// Where to die.
    pub enum FaultPoint {
        /// `reducer.before_commit`: the batch's records are delivered to the broker and its
        /// offsets sent to the transaction; `commit_transaction` was not called. The open
        /// transaction is aborted when the restarted instance fences its predecessor.
        BeforeCommit = "reducer.before_commit",
        /// `reducer.after_commit`: the transaction is committed; sled was not written, so the
        /// cache is one batch behind the changelog.
        AfterCommit = "reducer.after_commit",
        /// `reducer.restore_before_marker`: a restore wrote a chunk's states to sled and
        /// dies before the chunk's timers and changelog marker: sled holds states past its
        /// marker.
        RestoreBeforeMarker = "reducer.restore_before_marker",
        /// `reducer.hang_in_send_offsets`: the thread blocks for good where it sends the
        /// batch's offsets to the transaction, as librdkafka's call does when the group
        /// coordinator's broker dies (librdkafka#5456); the watchdog ends the process.
        HangInSendOffsets = "reducer.hang_in_send_offsets",
        /// `reducer.abort_in_flight`: once, when a batch in flight is to be committed and
        /// the next batch already read a run from its after-states, the batch in flight is
        /// aborted instead of committed (as a refused delivery would abort it). The
        /// reducer goes on: both batches are dropped and their inputs read again.
        AbortInFlight = "reducer.abort_in_flight",
        /// `reducer.leave_group`: once its partitions are assigned, the consumer leaves its
        /// group (unsubscribes) and polls on, reducing nothing: a member that never
        /// rejoins, for the membership watchdog's test. Not a death: the watchdog ends
        /// the process.
        LeaveGroup = "reducer.leave_group",
        /// `reducer.fail_mid_fold`: once, on its pass, applying an input fails after the
        /// fold has taken the run's state out of the open batch — as an unreachable key
        /// store, registry or graph table fails it. The reducer goes on: the open batch
        /// is dropped (never committed) and read again, the batch in flight commits.
        FailMidFold = "reducer.fail_mid_fold",
        /// `reducer.unreadable_cache`: once, on its pass, a run state read from the cache
        /// does not read back. The entry goes and its partition is restored from the
        /// changelog; the reducer goes on.
        UnreadableCache = "reducer.unreadable_cache",
    }
}

/// Blocks this thread for good at `point` if it is the configured fault (the same passes
/// as [`check`]), after one line: a wedged librdkafka call, for the watchdog's test.
pub(crate) fn hang(configured: Option<FaultPoint>, after: u32, point: FaultPoint) {
    sortie_kafka::fault::hang(configured, after, point, |_| {
        tracing::error!(fault = %point, "Fault injection: the reducer hangs here on purpose.");
    });
}

/// Whether `point` fires now, on its `after`-th pass only (a fault the reducer
/// survives); logged when it does.
pub(crate) fn fires_once(configured: Option<FaultPoint>, after: u32, point: FaultPoint) -> bool {
    let fires = sortie_kafka::fault::fires_once(configured, after, point);
    if fires {
        tracing::error!(fault = %point, "Fault injection: the reducer takes this fault on purpose.");
    }
    fires
}

/// Dies at `point` if it is the configured one and this is its `after`-th pass (1: the
/// first).
pub(crate) fn check(configured: Option<FaultPoint>, after: u32, point: FaultPoint) {
    sortie_kafka::fault::check(configured, after, point, |pass| {
        tracing::error!(
            fault = %point,
            pass,
            "Fault injection: the reducer dies here on purpose."
        );
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_parse_by_name_only() {
        for &point in FaultPoint::ALL {
            assert_eq!(point.as_str().parse::<FaultPoint>(), Ok(point));
        }
        assert!("reducer.somewhere".parse::<FaultPoint>().is_err());
        assert!("executor.before_call".parse::<FaultPoint>().is_err());
        assert_eq!(
            "x".parse::<FaultPoint>().map_err(|e| e.to_string()),
            Err(
                "unknown fault point \"x\"; known: reducer.before_commit, reducer.after_commit, reducer.restore_before_marker, reducer.hang_in_send_offsets, reducer.abort_in_flight, reducer.leave_group, reducer.fail_mid_fold, reducer.unreadable_cache"
                    .to_owned()
            )
        );
    }

    #[test]
    fn an_unconfigured_point_never_fires() {
        check(None, 1, FaultPoint::BeforeCommit);
        check(Some(FaultPoint::AfterCommit), 1, FaultPoint::BeforeCommit);
    }
}
