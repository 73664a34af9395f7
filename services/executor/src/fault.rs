//! Fault points for crash tests: where an executor may be told to die on purpose.
//!
//! Off unless set explicitly (`sortie executor --fault <point>` or `SORTIE_FAULT=<point>`).
//! At the point, the executor logs one line and calls [`std::process::abort`]: no
//! destructor runs, no buffered record is flushed, no offset is committed — as with
//! SIGKILL.

use std::fmt;
use std::str::FromStr;

/// Where to die.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultPoint {
    /// `executor.before_call`: the intent is decoded (and, for `unsafe` / `reconcilable`,
    /// `STARTED` is recorded and the offset committed); the receiver was not called.
    BeforeCall,
    /// `executor.after_call`: the receiver answered; the result was not produced.
    AfterCall,
    /// `executor.after_result`: the result was delivered; the intent offset (for
    /// `pure` / `idempotent` / `keyed`) was not committed.
    AfterResult,
}

impl FaultPoint {
    pub const ALL: [FaultPoint; 3] = [
        FaultPoint::BeforeCall,
        FaultPoint::AfterCall,
        FaultPoint::AfterResult,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FaultPoint::BeforeCall => "executor.before_call",
            FaultPoint::AfterCall => "executor.after_call",
            FaultPoint::AfterResult => "executor.after_result",
        }
    }
}

impl fmt::Display for FaultPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown fault point {0:?}; known: executor.before_call, executor.after_call, executor.after_result")]
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

/// Dies at `point` if it is the configured one.
pub(crate) fn check(configured: Option<FaultPoint>, point: FaultPoint, operation_id: &str) {
    if configured == Some(point) {
        tracing::error!(
            fault = %point,
            operation_id,
            "Fault injection: the executor dies here on purpose."
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
        assert!("executor.somewhere".parse::<FaultPoint>().is_err());
    }
}
