//! Fault points for crash tests: where a gateway may be told to die on purpose.
//!
//! Off unless set explicitly (`sortie gateway --fault <point>` or `SORTIE_FAULT=<point>`).
//! At the point, the gateway logs one line and calls [`std::process::abort`]: the caller's
//! connection drops without an answer — as with SIGKILL. The mechanism is
//! [`sortie_kafka::fault`]'s; this module is the gateway's list of points.

pub use sortie_kafka::fault::UnknownFaultPoint;

use serde::{Deserialize, Serialize};

sortie_kafka::fault_points! {
    /// Where to die.
    #[derive(Serialize, Deserialize)]
    pub enum FaultPoint {
        /// `gateway.after_publish`: a write's command is delivered to `sortie.commands`; the
        /// caller has not been answered.
        #[serde(rename = "gateway.after_publish")]
        AfterPublish = "gateway.after_publish",
    }
}

/// Dies at `point` if it is the configured one.
pub(crate) fn check(configured: Option<FaultPoint>, point: FaultPoint, command_id: &str) {
    sortie_kafka::fault::check(configured, 1, point, |_| {
        tracing::error!(
            fault = %point,
            command_id,
            "Fault injection: the gateway dies here on purpose."
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
            let json = serde_json::to_string(&point).unwrap_or_default();
            assert_eq!(json, format!("\"{point}\""));
        }
        assert!("gateway.somewhere".parse::<FaultPoint>().is_err());
    }
}
