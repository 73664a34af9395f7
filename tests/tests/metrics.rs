//! Observability end to end: a reducer, an executor and a gateway as their own processes;
//! one run through an approval gate, started and approved over HTTP with a caller's
//! `traceparent`, and one undecodable record. Then every service's `/metrics` has moved
//! (counters, gauges, histograms with buckets), `/healthz` and `/readyz` answer, and the
//! caller's trace id travelled on the command, the intents and the results.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::message::Headers as _;
use rdkafka::Message as _;
use serde_json::{json, Value};
use sortie_tests::stack::{metric_sum, scrape, Stack};
use sortie_tests::Isolation;
use sortie_tests::GATED;

const ALICE: &str = "acme:user:alice:approver:tok-alice";
const LONG: Duration = Duration::from_secs(90);
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

async fn get_json(url: &str) -> (u16, Value) {
    let response = reqwest::get(url).await.expect("answers");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// Waits until a scrape of `url` satisfies `done`; returns that scrape.
async fn scrape_until(
    what: &str,
    url: &str,
    done: impl Fn(&BTreeMap<String, f64>) -> bool,
) -> BTreeMap<String, f64> {
    sortie_tests::wait_for(what, LONG, || async {
        let metrics = scrape(url).await;
        done(&metrics).then_some(metrics)
    })
    .await
}

/// Every value of the `traceparent` header on a topic's records (read_committed).
async fn traceparents(stack: &Stack, topic: &str) -> Vec<String> {
    sortie_tests::read_all(&stack.bootstrap, topic, Isolation::ReadCommitted)
        .await
        .iter()
        .filter_map(|m| {
            let headers = m.headers()?;
            headers
                .iter()
                .find(|h| h.key == "traceparent")
                .and_then(|h| h.value)
                .map(|v| String::from_utf8_lossy(v).into_owned())
        })
        .collect()
}

/// Histograms are exported as histograms (buckets), never as summaries (quantiles).
fn assert_histogram(metrics: &BTreeMap<String, f64>, name: &str) {
    let bucket = format!("{name}_bucket");
    assert!(
        metrics
            .keys()
            .any(|k| k.starts_with(&format!("{bucket}{{"))),
        "{name} has no buckets"
    );
    assert!(
        !metrics
            .keys()
            .any(|k| k.starts_with(name) && k.contains("quantile=")),
        "{name} is exported as a summary"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_reports_metrics_health_and_the_callers_trace() {
    let stack = Stack::start("metrics", &[GATED]).await;
    let reducer = stack.reducer("0");
    let executor = stack.executor_process("executor", &["default"], &[]);
    let (_gateway, gateway) = stack
        .gateway_process(&stack.dir.join("gateway"), &[ALICE])
        .await;
    let reducer_url = reducer.metrics_url().await;
    let executor_url = executor.metrics_url().await;

    // Liveness at once; readiness once partitions are assigned and restored (reducer)
    // and every queue is consumed (executor).
    for url in [&reducer_url, &executor_url, &gateway] {
        assert_eq!(get_json(&format!("{url}/healthz")).await.0, 200, "{url}");
    }
    for url in [&reducer_url, &executor_url] {
        sortie_tests::wait_until("the service to be ready", LONG, || async {
            get_json(&format!("{url}/readyz")).await.0 == 200
        })
        .await;
    }

    // A run started and approved over HTTP, with the caller's trace.
    let client = reqwest::Client::new();
    let traceparent = format!("00-{TRACE_ID}-00f067aa0ba902b7-01");
    let started = client
        .post(format!("{gateway}/v1/runs"))
        .bearer_auth("tok-alice")
        .header("traceparent", &traceparent)
        .json(&json!({"graph_id": "gated", "input": {"amount": 7}, "run_id": "observed-1"}))
        .send()
        .await
        .expect("start");
    assert_eq!(started.status().as_u16(), 201);
    let echoed = started
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(
        echoed.contains(TRACE_ID),
        "the response carries the trace on: {echoed:?}"
    );
    let run = sortie_tests::wait_for("the run to wait for approval", LONG, || async {
        let (status, run) = {
            let response = client
                .get(format!("{gateway}/v1/runs/observed-1"))
                .bearer_auth("tok-alice")
                .send()
                .await
                .expect("get run");
            (
                response.status().as_u16(),
                response.json::<Value>().await.unwrap_or(Value::Null),
            )
        };
        (status == 200 && run["status"] == "waiting_approval").then_some(run)
    })
    .await;

    // While it waits: one open interrupt, and it ages.
    let waiting = scrape_until(
        "the reducer to count the open interrupt",
        &reducer_url,
        |m| {
            metric_sum(m, "sortie_interrupts_open", &[]) >= 1.0
                && metric_sum(m, "sortie_runs", &[("status", "waiting_approval")]) >= 1.0
                && metric_sum(m, "sortie_interrupts_oldest_open_age_seconds", &[]) > 0.0
        },
    )
    .await;
    assert_eq!(
        metric_sum(&waiting, "sortie_interrupts_opened_total", &[]),
        1.0
    );

    let interrupt_id = run["interrupt"]["interrupt_id"]
        .as_str()
        .expect("interrupt id")
        .to_owned();
    let resumed = client
        .post(format!("{gateway}/v1/runs/observed-1/resume"))
        .bearer_auth("tok-alice")
        .header("traceparent", &traceparent)
        .json(&json!({"decision": "approve", "interrupt_id": interrupt_id}))
        .send()
        .await
        .expect("resume");
    assert_eq!(resumed.status().as_u16(), 200);

    // And one record nobody can decode: a dead letter.
    stack
        .send_raw(&stack.topics.commands(), Some(0), b"junk", b"not avro")
        .await;

    let reducer_metrics = scrape_until("the reducer's series to move", &reducer_url, |m| {
        metric_sum(m, "sortie_runs", &[("status", "succeeded")]) >= 1.0
            && metric_sum(m, "sortie_dead_letters_total", &[]) >= 1.0
            && metric_sum(m, "sortie_interrupts_open", &[]) == 0.0
            && m.keys()
                .any(|k| k.starts_with("sortie_consumer_lag_records{"))
    })
    .await;
    let sum = |name: &str, labels: &[(&str, &str)]| metric_sum(&reducer_metrics, name, labels);
    assert_eq!(
        sum("sortie_run_transitions_total", &[("status", "succeeded")]),
        1.0
    );
    assert_eq!(
        sum(
            "sortie_run_transitions_total",
            &[("status", "waiting_approval")]
        ),
        1.0
    );
    assert_eq!(
        sum("sortie_steps_dispatched_total", &[("tool", "echo")]),
        2.0
    );
    assert_eq!(
        sum("sortie_steps_succeeded_total", &[("tool", "echo")]),
        2.0
    );
    assert_eq!(sum("sortie_steps_retried_total", &[]), 0.0);
    // What the ended run spent (no model steps here: one observation of 0 USD).
    assert_eq!(
        sum("sortie_run_cost_usd_count", &[("status", "succeeded")]),
        1.0
    );
    assert_eq!(
        sum("sortie_run_cost_usd_sum", &[("status", "succeeded")]),
        0.0
    );
    assert_eq!(
        sum("sortie_interrupts_closed_total", &[("outcome", "approved")]),
        1.0
    );
    assert_eq!(sum("sortie_operations_awaiting_operator", &[]), 0.0);
    assert_eq!(sum("sortie_interrupts_oldest_open_age_seconds", &[]), 0.0);
    assert_eq!(
        sum("sortie_dead_letters_total", &[("reason", "undecodable")]),
        1.0
    );
    assert!(
        sum(
            "sortie_reducer_inputs_applied_total",
            &[("kind", "command")]
        ) >= 2.0
    );
    assert!(
        sum(
            "sortie_reducer_inputs_applied_total",
            &[("kind", "step_result")]
        ) >= 2.0
    );
    assert!(sum("sortie_reducer_batches_total", &[]) >= 1.0);
    assert_eq!(sum("sortie_reducer_owned_partitions", &[]), 3.0);
    assert_histogram(
        &reducer_metrics,
        "sortie_reducer_transaction_commit_seconds",
    );
    assert_histogram(&reducer_metrics, "sortie_reducer_batch_inputs");
    assert_histogram(&reducer_metrics, "sortie_reducer_restore_seconds");
    assert!(sum("sortie_reducer_transaction_commit_seconds_count", &[]) >= 1.0);
    // One restore per assignment (all its partitions with one consumer).
    assert_eq!(sum("sortie_reducer_restore_seconds_count", &[]), 1.0);

    let executor_metrics = scrape(&executor_url).await;
    let sum = |name: &str, labels: &[(&str, &str)]| metric_sum(&executor_metrics, name, labels);
    assert_eq!(
        sum(
            "sortie_executor_results_total",
            &[("tool", "echo"), ("status", "succeeded")]
        ),
        2.0
    );
    assert_eq!(
        sum("sortie_executor_intents_total", &[("queue", "default")]),
        2.0
    );
    assert_histogram(&executor_metrics, "sortie_step_duration_seconds");
    assert_eq!(
        sum(
            "sortie_step_duration_seconds_count",
            &[("tool", "echo"), ("outcome", "succeeded")]
        ),
        2.0
    );

    let gateway_metrics = scrape(&gateway).await;
    let sum = |name: &str, labels: &[(&str, &str)]| metric_sum(&gateway_metrics, name, labels);
    assert_eq!(
        sum(
            "sortie_http_requests_total",
            &[("route", "/v1/runs"), ("method", "POST"), ("status", "201")]
        ),
        1.0
    );
    assert!(
        sum(
            "sortie_http_requests_total",
            &[("route", "/v1/runs/{run_id}"), ("status", "200")]
        ) >= 1.0
    );
    assert_eq!(
        sum(
            "sortie_http_requests_total",
            &[("route", "/v1/runs/{run_id}/resume"), ("status", "200")]
        ),
        1.0
    );
    assert!(
        sum(
            "sortie_gateway_commands_published_total",
            &[("command", "StartRun")]
        ) >= 1.0
    );
    assert_histogram(&gateway_metrics, "sortie_http_request_duration_seconds");

    // The caller's trace id is on the command, both intents and both results.
    for (topic, at_least) in [
        (stack.topics.commands(), 2),
        (stack.topics.intents("default"), 2),
        (stack.topics.step_results(), 2),
    ] {
        let values = traceparents(&stack, &topic).await;
        let ours = values.iter().filter(|v| v.contains(TRACE_ID)).count();
        assert!(
            ours >= at_least,
            "{topic}: {ours} records carry the caller's trace: {values:?}"
        );
    }
    // And the executor's log lines of the attempts carry it in their span.
    assert!(
        executor
            .log_text()
            .contains(&format!("trace_id={TRACE_ID}")),
        "the executor's log carries the trace id"
    );
}

/// The gateway's `/metrics` labels are bounded (issue #14, 6b): a method outside HTTP's
/// own is counted as `other` and a path as its route template (or `unmatched`), so no
/// client can mint one series per request.
///
/// Proved red once: with the method label taken verbatim (`request.method().as_str()`),
/// the scrape carried `method="BREW0"` … `method="BREW4"` ("verbatim labels").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_metric_labels_are_bounded() {
    let stack = Stack::start("metrics-labels", &[]).await;
    let (_gateway, gateway) = stack
        .gateway_process(&stack.dir.join("gateway"), &[ALICE])
        .await;
    let client = reqwest::Client::new();
    for n in 0..5 {
        for path in [
            format!("/v1/runs/run-secret-{n}"),
            format!("/no/such/route-{n}"),
        ] {
            for method in [format!("BREW{n}"), "GET".to_owned()] {
                let method = reqwest::Method::from_bytes(method.as_bytes()).expect("a token");
                client
                    .request(method, format!("{gateway}{path}"))
                    .bearer_auth("tok-alice")
                    .send()
                    .await
                    .expect("the gateway answers");
            }
        }
    }
    let metrics = scrape_until("the gateway to count the requests", &gateway, |m| {
        m.keys().any(|k| {
            k.starts_with("sortie_http_requests_total{")
                && k.contains(r#"route="/v1/runs/{run_id}""#)
        })
    })
    .await;
    let leaked: Vec<&String> = metrics
        .keys()
        .filter(|k| k.contains("BREW") || k.contains("run-secret") || k.contains("route-"))
        .collect();
    assert!(leaked.is_empty(), "verbatim labels: {leaked:#?}");
    assert!(
        metrics.keys().any(|k| {
            k.starts_with("sortie_http_requests_total{") && k.contains(r#"method="other""#)
        }),
        "odd methods are counted as other: {:#?}",
        metrics.keys().collect::<Vec<_>>()
    );
}
