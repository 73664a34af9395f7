//! Fault points for crash tests: where a reducer may be told to die on purpose.
//!
//! Off unless set explicitly (`sortie reducer --fault <point>` or `SORTIE_FAULT=<point>`,
//! optionally `--fault-after N` to let N - 1 passes through first). At the point, the
//! reducer logs one line and calls [`std::process::abort`]: no destructor runs, no
//! transaction is finished, sled is not written — as with SIGKILL.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU32, Ordering};

/// Where to die.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultPoint {
    /// `reducer.before_commit`: the batch's records are delivered to the broker and its
    /// offsets sent to the transaction; `commit_transaction` was not called. The open
    /// transaction is aborted when the restarted instance fences its predecessor.
    BeforeCommit,
    /// `reducer.after_commit`: the transaction is committed; sled was not written, so the
    /// cache is one batch behind the changelog.
    AfterCommit,
}

impl FaultPoint {
    pub const ALL: [FaultPoint; 2] = [FaultPoint::BeforeCommit, FaultPoint::AfterCommit];

    pub fn as_str(self) -> &'static str {
        match self {
            FaultPoint::BeforeCommit => "reducer.before_commit",
            FaultPoint::AfterCommit => "reducer.after_commit",
        }
    }
}

impl fmt::Display for FaultPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown fault point {0:?}; known: reducer.before_commit, reducer.after_commit")]
pub struct UnknownFaultPoint(pub String);

impl FromStr for FaultPoint {
    type Err = UnknownFaultPoint;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        FaultPoint::ALL
            .into_iter()
            .find(|p| p.as_str() == text.trim())
            .ok_or_else(|| UnknownFaultPoint(text.to_owned()))
    }
}

/// Times the configured point was reached in this process (one reducer per process).
static REACHED: AtomicU32 = AtomicU32::new(0);

/// Dies at `point` if it is the configured one and this is its `after`-th pass (1: the
/// first).
pub(crate) fn check(configured: Option<FaultPoint>, after: u32, point: FaultPoint) {
    if configured != Some(point) {
        return;
    }
    let pass = REACHED.fetch_add(1, Ordering::SeqCst) + 1;
    if pass >= after.max(1) {
        tracing::error!(
            fault = %point,
            pass,
            "Fault injection: the reducer dies here on purpose."
        );
        std::process::abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_parse_by_name_only() {
        for point in FaultPoint::ALL {
            assert_eq!(point.as_str().parse::<FaultPoint>(), Ok(point));
        }
        assert!("reducer.somewhere".parse::<FaultPoint>().is_err());
        assert!("executor.before_call".parse::<FaultPoint>().is_err());
    }

    #[test]
    fn an_unconfigured_point_never_fires() {
        check(None, 1, FaultPoint::BeforeCommit);
        check(Some(FaultPoint::AfterCommit), 1, FaultPoint::BeforeCommit);
    }
}
