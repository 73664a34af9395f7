//! Trace context carried in Kafka record headers, in the W3C `traceparent` format
//! (`00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`), so the logs of every service
//! that touched a run can be joined on one trace id.
//!
//! The gateway takes the caller's `traceparent` (or starts a trace) and sets it on the
//! command; the reducer carries the input's trace onto the intents and run events it
//! produces; the executor carries the intent's trace onto its results. A record without
//! one (a client that sets none, a timer) gets a trace derived from its run id, so the
//! reducer's outputs stay a pure function of its inputs: a re-applied batch produces the
//! same headers.

/// The header name (W3C Trace Context).
pub const TRACEPARENT: &str = "traceparent";

/// One position in a trace: the trace id and the id of the span that produced the record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    /// 32 lowercase hex digits, never all zero.
    pub trace_id: String,
    /// 16 lowercase hex digits, never all zero.
    pub span_id: String,
    pub sampled: bool,
}

impl TraceContext {
    /// A context from raw ids (zero ids are replaced by 1: W3C forbids all-zero ids).
    pub fn new(trace_id: u128, span_id: u64) -> TraceContext {
        TraceContext {
            trace_id: format!("{:032x}", trace_id.max(1)),
            span_id: format!("{:016x}", span_id.max(1)),
            sampled: true,
        }
    }

    /// Parses a `traceparent` value; `None` for anything malformed (version ff, wrong
    /// lengths, non-hex, all-zero ids).
    pub fn parse(value: &str) -> Option<TraceContext> {
        let mut parts = value.trim().split('-');
        let (version, trace_id, span_id, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        // Version 00 has exactly four fields; later versions may append more.
        if version.len() != 2 || version.eq_ignore_ascii_case("ff") || !is_hex(version) {
            return None;
        }
        if version == "00" && parts.next().is_some() {
            return None;
        }
        if trace_id.len() != 32 || span_id.len() != 16 || flags.len() != 2 {
            return None;
        }
        if !is_hex(trace_id) || !is_hex(span_id) || !is_hex(flags) {
            return None;
        }
        if trace_id.bytes().all(|b| b == b'0') || span_id.bytes().all(|b| b == b'0') {
            return None;
        }
        let flags = u8::from_str_radix(flags, 16).ok()?;
        Some(TraceContext {
            trace_id: trace_id.to_ascii_lowercase(),
            span_id: span_id.to_ascii_lowercase(),
            sampled: flags & 1 == 1,
        })
    }

    /// The header value.
    pub fn header_value(&self) -> String {
        format!(
            "00-{}-{}-{:02x}",
            self.trace_id,
            self.span_id,
            u8::from(self.sampled)
        )
    }

    /// The context in a record's headers, if one is there and valid.
    pub fn from_headers<'a>(
        headers: impl IntoIterator<Item = (&'a str, Option<&'a [u8]>)>,
    ) -> Option<TraceContext> {
        headers
            .into_iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(TRACEPARENT))
            .and_then(|(_, value)| std::str::from_utf8(value?).ok())
            .and_then(TraceContext::parse)
    }

    /// The trace of a run whose input carried none: derived from the run id, so every
    /// such record of the run shares one trace.
    pub fn for_run(run_id: &str) -> TraceContext {
        let high = fnv1a(0xcbf2_9ce4_8422_2325, run_id.as_bytes());
        let low = fnv1a(high ^ 0x9e37_79b9_7f4a_7c15, run_id.as_bytes());
        TraceContext::new((u128::from(high) << 64) | u128::from(low), low)
    }

    /// A child of this context: same trace, a span id derived from `name` (e.g. an
    /// operation id and attempt), so the same input always yields the same child.
    pub fn child(&self, name: &str) -> TraceContext {
        let seed = fnv1a(0xcbf2_9ce4_8422_2325, self.span_id.as_bytes());
        TraceContext {
            trace_id: self.trace_id.clone(),
            span_id: format!("{:016x}", fnv1a(seed, name.as_bytes()).max(1)),
            sampled: self.sampled,
        }
    }

    /// The header as the (key, value) pair a producer sets.
    pub fn header(&self) -> (String, Option<Vec<u8>>) {
        (
            TRACEPARENT.to_owned(),
            Some(self.header_value().into_bytes()),
        )
    }
}

fn is_hex(text: &str) -> bool {
    text.bytes().all(|b| b.is_ascii_hexdigit())
}

/// 64-bit FNV-1a from `seed`: ids, not security.
fn fnv1a(seed: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(seed, |hash, b| {
        (hash ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_formats_traceparent() {
        let value = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let context = TraceContext::parse(value).expect("valid");
        assert_eq!(context.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(context.span_id, "00f067aa0ba902b7");
        assert!(context.sampled);
        assert_eq!(context.header_value(), value);
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473x-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn derived_contexts_are_stable_and_keep_the_trace() {
        let run = TraceContext::for_run("run-1");
        assert_eq!(run, TraceContext::for_run("run-1"));
        assert_ne!(run.trace_id, TraceContext::for_run("run-2").trace_id);
        let child = run.child("op-1/1");
        assert_eq!(child.trace_id, run.trace_id);
        assert_eq!(child, run.child("op-1/1"));
        assert_ne!(child.span_id, run.child("op-1/2").span_id);
        let header = child.header();
        let found = TraceContext::from_headers([(header.0.as_str(), header.1.as_deref())]);
        assert_eq!(found, Some(child));
    }
}
