//! Fault points for crash tests: where a gateway may be told to die on purpose.
//!
//! Off unless set explicitly (`sortie gateway --fault <point>` or `SORTIE_FAULT=<point>`).
//! At the point, the gateway logs one line and calls [`std::process::abort`]: the caller's
//! connection drops without an answer — as with SIGKILL.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Where to die.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FaultPoint {
    /// `gateway.after_publish`: a write's command is delivered to `sortie.commands`; the
    /// caller has not been answered.
    #[serde(rename = "gateway.after_publish")]
    AfterPublish,
}

impl FaultPoint {
    pub const ALL: [FaultPoint; 1] = [FaultPoint::AfterPublish];

    pub fn as_str(self) -> &'static str {
        match self {
            FaultPoint::AfterPublish => "gateway.after_publish",
        }
    }
}

impl fmt::Display for FaultPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown fault point {0:?}; known: gateway.after_publish")]
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
pub(crate) fn check(configured: Option<FaultPoint>, point: FaultPoint, command_id: &str) {
    if configured == Some(point) {
        tracing::error!(
            fault = %point,
            command_id,
            "Fault injection: the gateway dies here on purpose."
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
            let json = serde_json::to_string(&point).unwrap_or_default();
            assert_eq!(json, format!("\"{point}\""));
        }
        assert!("gateway.somewhere".parse::<FaultPoint>().is_err());
    }
}
