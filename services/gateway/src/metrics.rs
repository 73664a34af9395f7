//! The gateway's metrics and request telemetry: every metric name is a constant here,
//! described by [`describe`] at startup. [`observe`] is the one middleware around every
//! route: it counts the request by route template and status, times it, and runs it in a
//! span carrying the request's trace id (from the caller's `traceparent`, or a new trace)
//! and, once a handler knows it, the `run_id`. Commands published while handling the
//! request carry that trace on to the reducer (see [`current_trace`]).
//!
//! `/metrics` renders the process's Prometheus recorder, which the binary installs and
//! hands over with [`expose`]; without one it answers 404.

use std::sync::OnceLock;
use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Unit,
};
use metrics_exporter_prometheus::PrometheusHandle;
use sortie_wire::trace::{TraceContext, TRACEPARENT};
use tracing::Instrument as _;
use ulid::Ulid;

/// HTTP requests answered, by `route` (template), `method` and `status`.
pub const HTTP_REQUESTS: &str = "sortie_http_requests_total";
/// Time to the response's head, by `route` and `method` (an event stream's lifetime is
/// not included).
pub const HTTP_SECONDS: &str = "sortie_http_request_duration_seconds";
/// Commands published, by `command` kind.
pub const COMMANDS_PUBLISHED: &str = "sortie_gateway_commands_published_total";
/// Runs the view has quarantined: it could not read, fold or store them (see
/// `crate::view`). Every other run is served; these answer `run_unreadable`.
pub const QUARANTINED_RUNS: &str = "sortie_gateway_view_quarantined_runs";
/// Graph records refused for their signature since the process started (gauge).
pub const GRAPHS_UNTRUSTED: &str = "sortie_gateway_graph_records_untrusted";
/// Connections closed as they were accepted: the gateway held `--max-connections`, or
/// `--max-connections-per-address` from the connection's address.
pub const CONNECTIONS_REFUSED: &str = "sortie_gateway_connections_refused_total";

/// Explicit buckets: without them the exporter renders histograms as summaries.
pub const HISTOGRAM_BUCKETS: &[(&str, &[f64])] = &[(
    HTTP_SECONDS,
    &[
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ],
)];

/// Describes every metric (call once, after the recorder is installed).
pub fn describe() {
    sortie_kafka::metrics::describe();
    describe_counter!(
        HTTP_REQUESTS,
        "HTTP requests answered, by route template, method and status."
    );
    describe_histogram!(
        HTTP_SECONDS,
        Unit::Seconds,
        "Time from request to response head, by route template and method (event streams: until the stream opens)."
    );
    describe_counter!(
        COMMANDS_PUBLISHED,
        "RunCommands published to sortie.commands, by command kind."
    );
    describe_gauge!(
        QUARANTINED_RUNS,
        "Runs the gateway's view could not read, fold or store and set aside (their reads answer run_unreadable); every other run is served."
    );
    describe_counter!(
        CONNECTIONS_REFUSED,
        "Connections closed as they were accepted because the gateway held --max-connections, or --max-connections-per-address from the connection's address."
    );
    describe_gauge!(
        GRAPHS_UNTRUSTED,
        "Graph records refused for their signature (unsigned where signatures are required, or one that does not hold) since the process started."
    );
}

pub(crate) fn connection_refused() {
    counter!(CONNECTIONS_REFUSED).increment(1);
}

pub(crate) fn graphs_untrusted(count: usize) {
    metrics::gauge!(GRAPHS_UNTRUSTED).set(count as f64);
}

static EXPORTER: OnceLock<PrometheusHandle> = OnceLock::new();

/// Serves `handle` at `/metrics` (the recorder is global to the process, so is this).
pub fn expose(handle: PrometheusHandle) {
    let _ = EXPORTER.set(handle);
}

/// `GET /metrics`: the Prometheus text format.
pub(crate) async fn render() -> Response {
    match EXPORTER.get() {
        Some(handle) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            )],
            handle.render(),
        )
            .into_response(),
        None => (StatusCode::NOT_FOUND, "no metrics recorder installed\n").into_response(),
    }
}

tokio::task_local! {
    static TRACE: TraceContext;
}

/// The trace of the request being handled (on its task), if any.
pub(crate) fn current_trace() -> Option<TraceContext> {
    TRACE.try_with(Clone::clone).ok()
}

pub(crate) fn quarantined_runs(count: usize) {
    gauge!(QUARANTINED_RUNS).set(count as f64);
}

pub(crate) fn published(command: &'static str) {
    counter!(COMMANDS_PUBLISHED, "command" => command).increment(1);
}

/// The `method` label: one of the methods HTTP defines, or `other`. A client may send any
/// token as a method (`FOO` is valid HTTP), and a label taken verbatim would let it mint
/// a new series per request; the route label is the matched template (or `unmatched`),
/// never the raw path, for the same reason.
fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::OPTIONS => "OPTIONS",
        Method::CONNECT => "CONNECT",
        Method::TRACE => "TRACE",
        _ => "other",
    }
}

/// The middleware around every route: trace, span, count, time.
pub(crate) async fn observe(request: Request, next: Next) -> Response {
    let started = Instant::now();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let method = method_label(request.method());
    let trace = request
        .headers()
        .get(TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(TraceContext::parse)
        .map(|caller| caller.child(&Ulid::generate().to_string()))
        .unwrap_or_else(|| TraceContext::new(Ulid::generate().0, Ulid::generate().0 as u64));
    let span = tracing::info_span!(
        "http",
        method = %method,
        route = %route,
        trace_id = %trace.trace_id,
        run_id = tracing::field::Empty,
    );
    let traceparent = HeaderValue::from_str(&trace.header_value()).ok();
    let mut response = TRACE.scope(trace, next.run(request).instrument(span)).await;
    if let Some(value) = traceparent {
        response.headers_mut().insert(TRACEPARENT, value);
    }
    let status = response.status().as_u16().to_string();
    counter!(HTTP_REQUESTS, "route" => route.clone(), "method" => method, "status" => status)
        .increment(1);
    histogram!(HTTP_SECONDS, "route" => route, "method" => method)
        .record(started.elapsed().as_secs_f64());
    response
}
