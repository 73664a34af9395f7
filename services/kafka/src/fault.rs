//! The one fault-point mechanism of the services, for crash tests: parse a point's name,
//! count passes, and die on purpose at the configured one. Each service keeps only its
//! list of points (an enum implementing [`FaultPoint`]) and the line it logs; what a point
//! means is the service's business, never this crate's.
//!
//! Off unless set explicitly (`--fault <point>` or `SORTIE_FAULT=<point>`). At the point,
//! the service logs one line ("Fault injection: ...") and calls [`std::process::abort`]:
//! no destructor runs, nothing buffered is flushed — as with SIGKILL.

use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};

/// A service's list of fault points.
pub trait FaultPoint: Copy + Eq + fmt::Display + Sized + 'static {
    /// Every point, in the order the "known" list of [`UnknownFaultPoint`] names them.
    const ALL: &'static [Self];

    /// The point's name: `<service>.<where>`, e.g. `reducer.before_commit`.
    fn as_str(self) -> &'static str;
}

/// A name that is none of the service's points.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown fault point {text:?}; known: {known}")]
pub struct UnknownFaultPoint {
    pub text: String,
    /// The service's points, comma-separated.
    pub known: String,
}

/// Parses a point by its exact name (surrounding whitespace ignored).
pub fn parse<P: FaultPoint>(text: &str) -> Result<P, UnknownFaultPoint> {
    P::ALL
        .iter()
        .copied()
        .find(|p| p.as_str() == text.trim())
        .ok_or_else(|| UnknownFaultPoint {
            text: text.to_owned(),
            known: P::ALL
                .iter()
                .map(|p| p.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// Declares a service's fault points: the enum, its `ALL` list, names, `Display`,
/// `FromStr` and [`FaultPoint`] — so a service writes only its points and what each means.
///
/// ```
/// sortie_kafka::fault_points! {
///     /// Where to die.
///     pub enum Point {
///         /// `demo.here`: before the write.
///         Here = "demo.here",
///     }
/// }
/// assert_eq!("demo.here".parse::<Point>(), Ok(Point::Here));
/// assert_eq!(Point::ALL, &[Point::Here]);
/// ```
#[macro_export]
macro_rules! fault_points {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $( $(#[$variant_meta:meta])* $variant:ident = $text:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        $vis enum $name {
            $( $(#[$variant_meta])* $variant ),+
        }

        impl $name {
            /// Every point, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The point's name, as `--fault` takes it.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl $crate::fault::FaultPoint for $name {
            const ALL: &'static [Self] = $name::ALL;

            fn as_str(self) -> &'static str {
                $name::as_str(self)
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl ::std::str::FromStr for $name {
            type Err = $crate::fault::UnknownFaultPoint;

            fn from_str(text: &str) -> Result<Self, Self::Err> {
                $crate::fault::parse(text)
            }
        }
    };
}

/// Times the configured point was reached in this process. Only the configured point
/// counts, and a process is configured with one point at most.
static REACHED: AtomicU32 = AtomicU32::new(0);

/// Dies at `point` if it is the `configured` one and this is its `after`-th pass (1 or 0:
/// the first): calls `log` with the pass number, then aborts the process.
pub fn check<P: FaultPoint>(configured: Option<P>, after: u32, point: P, log: impl FnOnce(u32)) {
    if let Some(pass) = reached(configured, after, point) {
        log(pass);
        std::process::abort();
    }
}

/// Blocks the calling thread for good at `point` if it is the `configured` one and this is
/// its `after`-th pass or later (counted as [`check`] counts): calls `log` with the pass
/// number first. A wedged librdkafka call, for the watchdog's tests: the process is ended
/// by its watchdog, not here.
pub fn hang<P: FaultPoint>(configured: Option<P>, after: u32, point: P, log: impl FnOnce(u32)) {
    if let Some(pass) = reached(configured, after, point) {
        log(pass);
        loop {
            std::thread::park();
        }
    }
}

/// Whether `point` fires on this pass and only this one: the `after`-th (a fault the
/// process survives, taken once).
pub fn fires_once<P: FaultPoint>(configured: Option<P>, after: u32, point: P) -> bool {
    reached(configured, after, point) == Some(after.max(1))
}

/// Whether `point` is the configured one and has not fired yet (its `after`-th pass is
/// still to come). Does not count as a pass.
pub fn armed<P: FaultPoint>(configured: Option<P>, after: u32, point: P) -> bool {
    configured == Some(point) && REACHED.load(Ordering::SeqCst) < after.max(1)
}

/// The pass through the configured `point`, once it is the `after`-th or later.
fn reached<P: FaultPoint>(configured: Option<P>, after: u32, point: P) -> Option<u32> {
    if configured != Some(point) {
        return None;
    }
    let pass = REACHED.fetch_add(1, Ordering::SeqCst) + 1;
    (pass >= after.max(1)).then_some(pass)
}

#[cfg(test)]
mod tests {
    use super::*;

    crate::fault_points! {
        enum Point {
            Here = "test.here",
            There = "test.there",
        }
    }

    #[test]
    fn points_parse_by_name_only() {
        assert_eq!(parse::<Point>(" test.here "), Ok(Point::Here));
        assert_eq!(parse::<Point>("test.there"), Ok(Point::There));
        let error = parse::<Point>("test.elsewhere").expect_err("unknown");
        assert_eq!(
            error.to_string(),
            "unknown fault point \"test.elsewhere\"; known: test.here, test.there"
        );
    }

    #[test]
    fn an_unconfigured_point_never_fires() {
        check(None, 1, Point::Here, |_| panic!("fired"));
        check(Some(Point::There), 1, Point::Here, |_| panic!("fired"));
    }
}
