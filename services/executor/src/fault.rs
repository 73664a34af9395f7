//! Fault points for crash tests: where an executor may be told to die on purpose.
//!
//! Off unless set explicitly (`sortie executor --fault <point>` or `SORTIE_FAULT=<point>`).
//! At the point, the executor logs one line and calls [`std::process::abort`]: no
//! destructor runs, no buffered record is flushed, no offset is committed — as with
//! SIGKILL. The mechanism is [`sortie_kafka::fault`]'s; this module is the executor's list
//! of points.

pub use sortie_kafka::fault::UnknownFaultPoint;

sortie_kafka::fault_points! {
    /// Where to die.
    pub enum FaultPoint {
        /// `executor.before_call`: the intent is decoded (and, for `unsafe` / `reconcilable`,
        /// `STARTED` is recorded and the offset committed); the receiver was not called.
        BeforeCall = "executor.before_call",
        /// `executor.after_call`: the receiver answered; the result was not produced.
        AfterCall = "executor.after_call",
        /// `executor.after_result`: the result was delivered; the intent offset (for
        /// `pure` / `idempotent` / `keyed`) was not committed.
        AfterResult = "executor.after_result",
        /// `executor.hang_in_commit`: the consumer thread blocks for good inside its
        /// first offset commit (a wedged librdkafka call, for the watchdog's test). Not a
        /// death: the watchdog is what ends the process.
        HangInCommit = "executor.hang_in_commit",
        /// `executor.leave_group`: once its partitions are assigned, the consumer leaves
        /// its group (unsubscribes) and polls on, serving nothing: a member that never
        /// rejoins, for the membership watchdog's test. Not a death either.
        LeaveGroup = "executor.leave_group",
    }
}

/// Dies at `point` if it is the configured one.
pub(crate) fn check(configured: Option<FaultPoint>, point: FaultPoint, operation_id: &str) {
    sortie_kafka::fault::check(configured, 1, point, |_| {
        tracing::error!(
            fault = %point,
            operation_id,
            "Fault injection: the executor dies here on purpose."
        );
    });
}

/// Blocks this thread for good if `point` is the configured fault (once it is reached):
/// a wedged librdkafka call, for the watchdog's test.
pub(crate) fn hang_if(configured: Option<FaultPoint>, point: FaultPoint) {
    sortie_kafka::fault::hang(configured, 1, point, |_| {
        tracing::error!(fault = %point, "Fault injection: the executor's consumer thread hangs here on purpose.");
    });
}

/// Whether the consumer should leave its group now: `executor.leave_group` is the
/// configured fault and this is the first time it is reached.
pub(crate) fn leaves_group(configured: Option<FaultPoint>) -> bool {
    let point = FaultPoint::LeaveGroup;
    let fires = sortie_kafka::fault::fires_once(configured, 1, point);
    if fires {
        tracing::error!(fault = %point, "Fault injection: the executor's consumer leaves its group on purpose and polls on.");
    }
    fires
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_parse_by_name_only() {
        for &point in FaultPoint::ALL {
            assert_eq!(point.as_str().parse::<FaultPoint>(), Ok(point));
        }
        assert!("executor.somewhere".parse::<FaultPoint>().is_err());
    }
}
