//! The gateway as its own process (`sortie gateway`) over real HTTP, with a real reducer
//! process and the in-test executor: runs start, complete and stream; approvals need the
//! node's role and are decided once; cancel and reconcile are answered by the reducer;
//! tenants never see each other; bad requests are JSON errors and publish nothing; a
//! restarted or fresh gateway rebuilds its view from Kafka.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::{json, Value};
use sortie_core::EventBody;
use sortie_tests::stack::{succeed, Stack};
use sortie_tests::Isolation;
use sortie_tests::GATED;
use sortie_tests::THREE_STEPS;

/// A gate whose proposal carries the agent's rationale, and whose rejection skips to a
/// node of its own.
const GATED_WHY: &str = r#"
id: gated-why
version: 1
nodes:
  - {id: prepare, tool: echo, side_effect: pure}
  - id: refund
    tool: echo
    side_effect: keyed
    args: {amount: $input.amount, rationale: $input.why}
    interrupt_before: {reason: refunds need a human, required_role: approver, timeout: 24h}
    on_reject: {goto: apologise}
  - {id: apologise, tool: echo, side_effect: pure}
edges:
  - {from: prepare, to: refund}
"#;

const ALICE: &str = "acme:user:alice:approver:tok-alice";
const BOB: &str = "acme:user:bob::tok-bob";
const EVE: &str = "globex:user:eve:approver:tok-eve";
const OLGA: &str = "acme:user:olga:operator:tok-olga";
const OSCAR: &str = "globex:user:oscar:operator,approver:tok-oscar";
const TOKENS: &[&str] = &[ALICE, BOB, EVE, OLGA, OSCAR];

const LONG: Duration = Duration::from_secs(90);

/// The shared client, with this suite's helpers.
struct Api(sortie_tests::http::Api);

impl std::ops::Deref for Api {
    type Target = sortie_tests::http::Api;

    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl Api {
    fn new(base: &str) -> Api {
        Api(sortie_tests::http::Api::new(base))
    }

    /// Polls the run until `done` holds for it.
    async fn wait_run(&self, what: &str, run_id: &str, done: impl Fn(&Value) -> bool) -> Value {
        self.0.wait_run(what, run_id, "tok-alice", LONG, done).await
    }
}

fn token(spec: &str) -> &str {
    spec.rsplit(':').next().unwrap_or_default()
}

use sortie_tests::http::code;

fn event_kind(event: &Value) -> String {
    event["body"]
        .as_object()
        .and_then(|o| o.keys().next().cloned())
        .unwrap_or_default()
}

/// Reads an SSE response until `enough` holds for the events seen (as JSON), or panics.
async fn read_sse(
    response: &mut reqwest::Response,
    seen: &mut Vec<Value>,
    buffer: &mut String,
    enough: impl Fn(&[Value]) -> bool,
) {
    let deadline = tokio::time::Instant::now() + LONG;
    while !enough(seen) {
        let chunk = tokio::time::timeout_at(deadline, response.chunk())
            .await
            .expect("the stream delivers in time")
            .expect("the stream stays open")
            .expect("the stream does not end");
        buffer.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buffer.find('\n') {
            let line: String = buffer.drain(..=end).collect();
            if let Some(data) = line.trim_end().strip_prefix("data:") {
                seen.push(serde_json::from_str(data.trim()).expect("data is event JSON"));
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_starts_completes_and_its_history_reads_back_in_pages() {
    let stack = Stack::start("gateway-run", &[THREE_STEPS]).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    let (_gateway, url) = stack
        .gateway_process(&stack.dir.join("gateway"), TOKENS)
        .await;
    let api = Api::new(&url);

    let answer = api
        .start(
            "tok-bob",
            json!({"graph_id": "three", "input": {"order": 7}}),
        )
        .await;
    let run_id = answer["run_id"].as_str().expect("run_id").to_owned();
    let position = answer["position"].as_str().expect("position").to_owned();
    assert!(run_id.starts_with("run_") && run_id.len() == 30, "{run_id}");
    assert!(answer["command_id"].as_str().is_some_and(|c| !c.is_empty()));
    assert!(
        position.starts_with('p') && position.contains(":o"),
        "{position}"
    );

    // Read-your-writes: a read at the answer's position sees the run.
    let (status, run) = api
        .get(
            &format!("/v1/runs/{run_id}?min_position={position}"),
            "tok-bob",
        )
        .await;
    assert_eq!(status, 200, "{run}");
    assert_eq!(run["graph_id"], "three");
    assert_eq!(run["checkpoint_ns"], "acme");

    let done = api
        .wait_run("the run to succeed", &run_id, |r| {
            r["status"] == "succeeded"
        })
        .await;
    assert_eq!(done["steps_done"], 3);
    assert_eq!(done["nodes_completed"], json!(["fetch", "price", "notify"]));
    let version = done["version"].as_i64().expect("version");
    assert_eq!(
        done["last_checkpoint_id"],
        format!("ckpt_{run_id}_{version}")
    );

    // Events in pages of 3: ordered, complete, the same history as the topic's.
    let mut events = Vec::new();
    let mut after = 0;
    loop {
        let (status, page) = api
            .get(
                &format!("/v1/runs/{run_id}/events?after={after}&limit=3"),
                "tok-bob",
            )
            .await;
        assert_eq!(status, 200, "{page}");
        let batch = page["events"].as_array().expect("events").clone();
        assert!(batch.len() <= 3);
        events.extend(batch);
        after = page["next_after"].as_i64().expect("next_after");
        if !page["has_more"].as_bool().expect("has_more") {
            break;
        }
    }
    let seqs: Vec<i64> = events
        .iter()
        .map(|e| e["seq"].as_i64().unwrap_or(-1))
        .collect();
    assert_eq!(seqs, (1..=events.len() as i64).collect::<Vec<_>>());
    let topic = stack.events().await;
    assert_eq!(
        events
            .iter()
            .map(|e| serde_json::from_value::<sortie_core::Event>(e.clone()).expect("an event"))
            .collect::<Vec<_>>(),
        topic[&run_id],
        "the API shows the run's history exactly"
    );
    assert_eq!(
        event_kind(events.last().expect("events")),
        "RunStatusChanged"
    );
    // The seed API's fields beside the raw event (additive: it still parses above).
    for (shown, recorded) in events.iter().zip(&topic[&run_id]) {
        assert_eq!(shown["ts"], sortie_gateway::rfc3339(recorded.at), "{shown}");
        assert_eq!(shown["type"], snake(recorded.body.name()), "{shown}");
    }
    let ts = events[0]["ts"].as_str().expect("ts");
    assert!(
        ts.len() == 24 && ts.ends_with('Z') && ts.as_bytes()[10] == b'T',
        "{ts}"
    );
    let succeeded = events
        .iter()
        .find(|e| e["type"] == "step_succeeded")
        .expect("a step_succeeded event");
    assert_eq!(succeeded["node"], "fetch", "{succeeded}");
    assert_eq!(events[0]["node"], Value::Null, "{}", events[0]);

    // A checkpoint at an earlier version is the state at that version.
    let early = topic[&run_id]
        .iter()
        .find(|e| matches!(e.body, EventBody::StepSucceeded { .. }))
        .expect("a step succeeded")
        .state_version;
    let (status, checkpoint) = api
        .get(
            &format!("/v1/runs/{run_id}/checkpoints/ckpt_{run_id}_{early}"),
            "tok-bob",
        )
        .await;
    assert_eq!(status, 200, "{checkpoint}");
    assert_eq!(checkpoint["version"], early);
    assert_eq!(checkpoint["status"], "running");
    assert_eq!(checkpoint["nodes_completed"], json!(["fetch"]));
    assert_eq!(checkpoint["state"]["version"], early);
    let made = topic[&run_id]
        .iter()
        .filter(|e| e.state_version == early)
        .map(|e| e.at)
        .max()
        .expect("the version's events");
    assert_eq!(
        checkpoint["created_at"],
        sortie_gateway::rfc3339(made),
        "{checkpoint}"
    );
    let (status, last) = api
        .get(
            &format!("/v1/runs/{run_id}/checkpoints/ckpt_{run_id}_{version}"),
            "tok-bob",
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(last["status"], "succeeded");
    let (status, missing) = api
        .get(
            &format!(
                "/v1/runs/{run_id}/checkpoints/ckpt_{run_id}_{}",
                version + 1
            ),
            "tok-bob",
        )
        .await;
    assert_eq!((status, code(&missing)), (404, "unknown_checkpoint"));

    // Listing, by status and graph.
    let (status, list) = api
        .get("/v1/runs?status=succeeded&graph_id=three", "tok-bob")
        .await;
    assert_eq!(status, 200, "{list}");
    assert!(list["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .any(|r| r["run_id"] == run_id.as_str()));
    let (_, running) = api.get("/v1/runs?status=running", "tok-bob").await;
    assert!(!running["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .any(|r| r["run_id"] == run_id.as_str()));

    // An Idempotency-Key makes a retried start the same run, answered as a duplicate.
    let retry = || {
        api.request("POST", "/v1/runs", Some("tok-bob"))
            .header("Idempotency-Key", "order-7-start")
            .json(&json!({"graph_id": "three", "input": {"order": 8}}))
    };
    let (first_status, first) = api.send(retry()).await;
    let (second_status, second) = api.send(retry()).await;
    assert_eq!(
        (first_status, second_status),
        (201, 201),
        "{first} {second}"
    );
    assert_eq!(first["run_id"], second["run_id"]);
    // Derived from the key in the form the reducer checks: no other tenant takes it first.
    assert!(
        first["run_id"]
            .as_str()
            .is_some_and(|id| id.starts_with("key_")),
        "{first}"
    );
    assert_eq!(first["command_id"], "order-7-start");
    assert_eq!(second["duplicate"], true);

    // The description lists every path.
    let (status, doc) = api.get("/openapi.json", "").await;
    assert_eq!(status, 200);
    let paths: BTreeSet<&str> = doc["paths"]
        .as_object()
        .expect("paths")
        .keys()
        .map(String::as_str)
        .collect();
    for path in [
        "/v1/runs",
        "/v1/runs/{run_id}",
        "/v1/runs/{run_id}/resume",
        "/v1/runs/{run_id}/cancel",
        "/v1/runs/{run_id}/events",
        "/v1/runs/{run_id}/events/stream",
        "/v1/runs/{run_id}/checkpoints/{checkpoint_id}",
        "/v1/runs/{run_id}/operations/{operation_id}/reconcile",
        "/v1/runs/{run_id}/operations/{operation_id}/why",
        "/healthz",
        "/readyz",
        "/openapi.json",
    ] {
        assert!(paths.contains(path), "{path} missing from {paths:?}");
    }
    assert!(doc["paths"]["/v1/runs"]["post"].is_object());
    assert!(doc["paths"]["/v1/runs"]["get"].is_object());
    assert_eq!(api.get("/healthz", "").await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_needs_the_role_streams_live_and_is_decided_once() {
    let stack = Stack::start("gateway-approve", &[GATED]).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    let (_gateway, url) = stack
        .gateway_process(&stack.dir.join("gateway"), TOKENS)
        .await;
    let api = Api::new(&url);

    let answer = api
        .start(
            token(BOB),
            json!({"graph_id": "gated", "input": {"amount": 30}, "checkpoint_ns": "acme", "run_id": "refund-30"}),
        )
        .await;
    assert_eq!(answer["run_id"], "refund-30");
    let run = api
        .wait_run("the run to wait for approval", "refund-30", |r| {
            r["status"] == "waiting_approval"
        })
        .await;
    let interrupt = run["interrupt"].clone();
    assert_eq!(interrupt["required_role"], "approver");
    assert_eq!(interrupt["node"], "refund");
    assert_eq!(interrupt["proposal"]["args"]["amount"], 30);
    let interrupt_id = interrupt["interrupt_id"].as_str().expect("id").to_owned();

    // The live stream: the history so far, then what happens next.
    let mut stream = api
        .request("GET", "/v1/runs/refund-30/events/stream", Some("tok-alice"))
        .send()
        .await
        .expect("stream");
    assert_eq!(stream.status().as_u16(), 200);
    assert!(stream
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream")));
    let (mut seen, mut buffer) = (Vec::new(), String::new());
    read_sse(&mut stream, &mut seen, &mut buffer, |events| {
        events.iter().any(|e| event_kind(e) == "Interrupted")
    })
    .await;
    let replayed = seen.len();

    // A changed proposal is refused; a principal without the role is refused.
    let resume = "/v1/runs/refund-30/resume".to_owned();
    let (status, stale) = api
        .post(
            &resume,
            "tok-alice",
            json!({"decision": "approve", "interrupt_id": interrupt_id, "proposal_hash": "not-it"}),
        )
        .await;
    assert_eq!((status, code(&stale)), (409, "stale_proposal"), "{stale}");
    let (status, forbidden) = api
        .post(
            &resume,
            "tok-bob",
            json!({"decision": "approve", "interrupt_id": interrupt_id}),
        )
        .await;
    assert_eq!(
        (status, code(&forbidden)),
        (403, "forbidden"),
        "{forbidden}"
    );
    assert!(forbidden["error"]["command_id"].is_string());

    let (status, approved) = api
        .post(
            &resume,
            "tok-alice",
            json!({"decision": "approve", "interrupt_id": interrupt_id, "comment": "fine"}),
        )
        .await;
    assert_eq!(status, 200, "{approved}");
    assert_eq!(approved["decision"], "approve");
    let (status, again) = api
        .post(
            &resume,
            "tok-alice",
            json!({"decision": "approve", "interrupt_id": interrupt_id}),
        )
        .await;
    assert_eq!(status, 409, "{again}");
    assert!(
        ["already_decided", "bad_state"].contains(&code(&again)),
        "{again}"
    );

    // The stream delivers what happened after it opened, live.
    read_sse(&mut stream, &mut seen, &mut buffer, |events| {
        events
            .iter()
            .any(|e| e["body"]["RunStatusChanged"]["status"] == "SUCCEEDED")
    })
    .await;
    let live: Vec<String> = seen[replayed..].iter().map(event_kind).collect();
    assert!(live.contains(&"InterruptDecided".to_owned()), "{live:?}");
    let seqs: Vec<i64> = seen
        .iter()
        .map(|e| e["seq"].as_i64().unwrap_or(-1))
        .collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");

    let done = api
        .wait_run("the approved run to finish", "refund-30", |r| {
            r["status"] == "succeeded"
        })
        .await;
    assert!(done["interrupt"].is_null());
    let decided = stack.events().await["refund-30"]
        .iter()
        .find_map(|e| match &e.body {
            EventBody::InterruptDecided { decided_by, .. } => Some(decided_by.clone()),
            _ => None,
        });
    assert_eq!(
        decided.as_deref(),
        Some("user:alice"),
        "the issuer is the caller"
    );

    // `Accept: text/event-stream` on the events path streams too.
    let mut accept = api
        .request(
            "GET",
            "/v1/runs/refund-30/events?after=1",
            Some("tok-alice"),
        )
        .header("accept", "text/event-stream")
        .send()
        .await
        .expect("stream");
    let (mut more, mut buffer) = (Vec::new(), String::new());
    read_sse(&mut accept, &mut more, &mut buffer, |events| {
        !events.is_empty()
    })
    .await;
    assert_eq!(more[0]["seq"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbox_lists_open_approvals_and_says_who_may_decide() {
    let stack = Stack::start("gateway-inbox", &[GATED, GATED_WHY]).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    let (_gateway, url) = stack
        .gateway_process(&stack.dir.join("gateway"), TOKENS)
        .await;
    let api = Api::new(&url);

    api.start(
        "tok-bob",
        json!({"graph_id": "gated", "input": {"amount": 5}, "run_id": "plain", "labels": {"queue": "eu"}}),
    )
    .await;
    api.start(
        "tok-bob",
        json!({"graph_id": "gated-why", "input": {"amount": 7, "why": "the parcel arrived broken"}, "run_id": "explained"}),
    )
    .await;
    for run in ["plain", "explained"] {
        api.wait_run("the run to wait for approval", run, |r| {
            r["status"] == "waiting_approval"
        })
        .await;
    }

    let (status, inbox) = api.get("/v1/inbox", "tok-alice").await;
    assert_eq!(status, 200, "{inbox}");
    let items = inbox["items"].as_array().expect("items");
    assert_eq!(items.len(), 2, "{inbox}");
    let by_run = |run: &str| {
        items
            .iter()
            .find(|i| i["run_id"] == run)
            .unwrap_or_else(|| panic!("{run} is in the inbox: {inbox}"))
            .clone()
    };
    let plain = by_run("plain");
    assert_eq!(plain["graph_id"], "gated");
    assert_eq!(plain["tenant"], "acme");
    assert_eq!(plain["node"], "refund");
    assert_eq!(plain["proposal"]["args"]["amount"], 5);
    assert!(plain["rationale"].is_null(), "no rationale given: {plain}");
    assert_eq!(
        plain["on_reject"],
        "The run fails; completed steps that declare a compensation are undone."
    );
    assert!(plain["opened_at"].as_i64().is_some_and(|t| t > 0));
    assert!(
        plain["expires_at"].as_i64() > plain["opened_at"].as_i64(),
        "{plain}"
    );
    assert_eq!(plain["may_decide"], true);
    assert!(plain["why_not"].is_null());
    let explained = by_run("explained");
    assert_eq!(explained["rationale"], "the parcel arrived broken");
    assert_eq!(
        explained["on_reject"],
        "The step is skipped and the run continues at apologise."
    );

    // Bob lacks the role: the same rule the reducer applies, with the reason.
    let (status, bobs) = api.get("/v1/inbox", "tok-bob").await;
    assert_eq!(status, 200, "{bobs}");
    let refused = &bobs["items"][0];
    assert_eq!(refused["may_decide"], false, "{bobs}");
    assert_eq!(
        refused["why_not"],
        "deciding needs role \"approver\"; user:bob has no roles"
    );
    let (status, forbidden) = api
        .post(
            &format!("/v1/runs/{}/resume", refused["run_id"].as_str().unwrap_or("")),
            "tok-bob",
            json!({"decision": "approve", "interrupt_id": refused["interrupt_id"], "proposal_hash": refused["proposal_hash"]}),
        )
        .await;
    assert_eq!(
        (status, code(&forbidden)),
        (403, "forbidden"),
        "{forbidden}"
    );

    // Another tenant sees none of them; no token is a JSON 401; bad queries are JSON 400s.
    let (status, theirs) = api.get("/v1/inbox", "tok-eve").await;
    assert_eq!((status, theirs["items"].clone()), (200, json!([])));
    let (status, anonymous) = api.send(api.request("GET", "/v1/inbox", None)).await;
    assert_eq!((status, code(&anonymous)), (401, "unauthenticated"));
    let (status, bad) = api.get("/v1/inbox?limit=lots", "tok-alice").await;
    assert_eq!((status, code(&bad)), (400, "invalid_query"), "{bad}");

    // Deciding with the inbox's hash takes the item out of everyone's inbox.
    let (status, approved) = api
        .post(
            "/v1/runs/plain/resume",
            "tok-alice",
            json!({"decision": "approve", "interrupt_id": plain["interrupt_id"], "proposal_hash": plain["proposal_hash"]}),
        )
        .await;
    assert_eq!(status, 200, "{approved}");
    let position = approved["position"].as_str().expect("position");
    let (status, after) = api
        .get(&format!("/v1/inbox?min_position={position}"), "tok-alice")
        .await;
    assert_eq!(status, 200, "{after}");
    let left: Vec<&Value> = after["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|i| &i["run_id"])
        .collect();
    assert_eq!(left, vec!["explained"], "{after}");

    let (_, doc) = api.get("/openapi.json", "tok-alice").await;
    assert!(doc["paths"]["/v1/inbox"]["get"].is_object());

    // Who a token speaks for (the console's sign-in), and the runs list's filters.
    let (status, me) = api.get("/v1/me", "tok-bob").await;
    assert_eq!(status, 200);
    assert_eq!(
        me,
        json!({"tenant": "acme", "principal": "user:bob", "roles": [], "groups": []})
    );
    let ids = |list: &Value| -> Vec<String> {
        list["runs"]
            .as_array()
            .map(|r| {
                r.iter()
                    .filter_map(|r| r["run_id"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let (_, labelled) = api.get("/v1/runs?label=queue=eu", "tok-bob").await;
    assert_eq!(ids(&labelled), ["plain"], "{labelled}");
    let (_, recent) = api.get("/v1/runs?created_after=1", "tok-bob").await;
    assert_eq!(ids(&recent), ["explained", "plain"], "{recent}");
    let (_, none) = api.get("/v1/runs?created_before=1", "tok-bob").await;
    assert!(ids(&none).is_empty(), "{none}");
    let (status, bad) = api.get("/v1/runs?label=queue", "tok-bob").await;
    assert_eq!((status, code(&bad)), (400, "invalid_query"), "{bad}");

    // API answers are never cached and never sniffed.
    let response = api
        .request("GET", "/v1/inbox", Some("tok-bob"))
        .send()
        .await
        .expect("answer");
    let headers = response.headers();
    assert_eq!(headers["cache-control"], "no-store");
    assert_eq!(headers["x-content-type-options"], "nosniff");
    assert!(headers.get("content-security-policy").is_none());
}

/// The inbox is served from the view's index (issue #40, item 7: it used to read every
/// event of every waiting run on each request): items come oldest first, a page reads its
/// size, `opened_at` is still the time of the interrupt's `Interrupted` event, a decision
/// takes its item out, and a restarted and a fresh view serve the same inbox.
///
/// Seen red: with the index entries of a run left in place when it was written again, the
/// approved interrupt stayed in the inbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbox_is_served_from_the_views_index_in_the_order_interrupts_opened() {
    let stack = Stack::start("gateway-inbox-index", &[GATED]).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    let data = stack.dir.join("gateway-a");
    let (mut first, url) = stack.gateway_process(&data, TOKENS).await;
    let api = Api::new(&url);
    let runs = ["gated-1", "gated-2", "gated-3"];
    for (n, run) in runs.iter().enumerate() {
        api.start(
            "tok-bob",
            json!({"graph_id": "gated", "input": {"amount": n}, "run_id": run}),
        )
        .await;
        // One at a time, so they open in this order.
        api.wait_run("the run to wait for approval", run, |r| {
            r["status"] == "waiting_approval"
        })
        .await;
    }

    // What the inbox said before it had an index: each open interrupt, opened at its
    // Interrupted event, with the proposal the run shows.
    let mut expected = Vec::new();
    for run in runs {
        let (_, shown) = api.get(&format!("/v1/runs/{run}"), "tok-alice").await;
        let (_, history) = api
            .get(&format!("/v1/runs/{run}/events?limit=1000"), "tok-alice")
            .await;
        let opened = history["events"]
            .as_array()
            .expect("events")
            .iter()
            .find(|e| e["type"] == "interrupted")
            .map(|e| e["at"].clone())
            .expect("an Interrupted event");
        let interrupt = &shown["interrupt"];
        expected.push(json!({
            "run_id": run,
            "interrupt_id": interrupt["interrupt_id"],
            "proposal_hash": interrupt["proposal_hash"],
            "proposal": interrupt["proposal"],
            "opened_at": opened,
        }));
    }
    let essentials = |inbox: &Value| -> Vec<Value> {
        inbox["items"]
            .as_array()
            .expect("items")
            .iter()
            .map(|i| {
                json!({
                    "run_id": i["run_id"],
                    "interrupt_id": i["interrupt_id"],
                    "proposal_hash": i["proposal_hash"],
                    "proposal": i["proposal"],
                    "opened_at": i["opened_at"],
                })
            })
            .collect()
    };
    let (status, inbox) = api.get("/v1/inbox", "tok-alice").await;
    assert_eq!(status, 200, "{inbox}");
    assert_eq!(essentials(&inbox), expected, "{inbox}");
    assert_eq!(inbox["truncated"], false);
    let (_, page) = api.get("/v1/inbox?limit=1", "tok-alice").await;
    assert_eq!(essentials(&page), expected[..1], "{page}");
    assert_eq!(page["truncated"], true);

    // Approving the oldest takes it out.
    let oldest = &inbox["items"][0];
    let (status, approved) = api
        .post(
            "/v1/runs/gated-1/resume",
            "tok-alice",
            json!({"decision": "approve", "interrupt_id": oldest["interrupt_id"], "proposal_hash": oldest["proposal_hash"]}),
        )
        .await;
    assert_eq!(status, 200, "{approved}");
    let position = approved["position"].as_str().expect("position");
    let (_, after) = api
        .get(&format!("/v1/inbox?min_position={position}"), "tok-alice")
        .await;
    assert_eq!(essentials(&after), expected[1..], "{after}");

    // The same inbox from the restarted view and from a fresh one (built from Kafka).
    first.stop();
    let (_restarted, url) = stack.gateway_process(&data, TOKENS).await;
    let (_, again) = Api::new(&url).get("/v1/inbox", "tok-alice").await;
    let (_fresh, url) = stack
        .gateway_process(&stack.dir.join("gateway-b"), TOKENS)
        .await;
    let fresh = Api::new(&url);
    let (_, rebuilt) = fresh
        .get(&format!("/v1/inbox?min_position={position}"), "tok-alice")
        .await;
    for inbox in [&again, &rebuilt] {
        assert_eq!(essentials(inbox), expected[1..], "{inbox}");
        assert_eq!(inbox["items"], after["items"], "the same items, whole");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_and_reconcile_are_answered_by_the_reducer() {
    let stack = Stack::start("gateway-cancel", &[GATED]).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    let (_gateway, url) = stack
        .gateway_process(&stack.dir.join("gateway"), TOKENS)
        .await;
    let api = Api::new(&url);

    for run in ["to-cancel", "to-reconcile"] {
        api.start(
            "tok-bob",
            json!({"graph_id": "gated", "input": {"amount": 1}, "run_id": run}),
        )
        .await;
        api.wait_run("the run to wait", run, |r| {
            r["status"] == "waiting_approval"
        })
        .await;
    }
    let (status, cancelled) = api
        .post(
            "/v1/runs/to-cancel/cancel",
            "tok-bob",
            json!({"reason": "changed my mind"}),
        )
        .await;
    assert_eq!(status, 200, "{cancelled}");
    assert!(
        ["cancelling", "cancelled"].contains(&cancelled["status"].as_str().unwrap_or_default()),
        "{cancelled}"
    );
    api.wait_run("the run to be cancelled", "to-cancel", |r| {
        r["status"] == "cancelled"
    })
    .await;
    // An empty body is a cancel without a reason; a cancelled run refuses it.
    let (status, again) = api
        .send(api.request("POST", "/v1/runs/to-cancel/cancel", Some("tok-bob")))
        .await;
    assert_eq!((status, code(&again)), (409, "bad_state"), "{again}");

    // Recording an outcome is an operator's: Bob (no roles) is refused by the gateway
    // (and, for a raw command, by the fold: services/core/tests/reconcile_rights.rs).
    let (status, refused) = api
        .post(
            "/v1/runs/to-reconcile/operations/op_nope/reconcile",
            "tok-bob",
            json!({"outcome": "succeeded", "result": {"refund_id": "r1"}}),
        )
        .await;
    assert_eq!((status, code(&refused)), (403, "forbidden"), "{refused}");
    let (status, unknown) = api
        .post(
            "/v1/runs/to-reconcile/operations/op_nope/reconcile",
            "tok-olga",
            json!({"outcome": "succeeded", "result": {"refund_id": "r1"}}),
        )
        .await;
    assert_eq!(
        (status, code(&unknown)),
        (409, "unknown_operation"),
        "{unknown}"
    );
    let (status, missing) = api
        .post(
            "/v1/runs/no-such-run/operations/op_nope/reconcile",
            "tok-olga",
            json!({"outcome": "failed"}),
        )
        .await;
    assert_eq!((status, code(&missing)), (404, "unknown_run"), "{missing}");
    let (status, missing) = api
        .post("/v1/runs/no-such-run/cancel", "tok-bob", json!({}))
        .await;
    assert_eq!((status, code(&missing)), (404, "unknown_run"), "{missing}");
    let (status, bad) = api
        .post(
            "/v1/runs/to-reconcile/operations/op_nope/reconcile",
            "tok-bob",
            json!({"outcome": "maybe"}),
        )
        .await;
    assert_eq!((status, code(&bad)), (400, "invalid_request"), "{bad}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_isolated_and_bad_requests_publish_nothing() {
    let stack = Stack::start("gateway-tenancy", &[THREE_STEPS]).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    let (_gateway, url) = stack
        .gateway_process(&stack.dir.join("gateway"), TOKENS)
        .await;
    let api = Api::new(&url);

    let answer = api
        .start("tok-bob", json!({"graph_id": "three", "input": {}}))
        .await;
    let run_id = answer["run_id"].as_str().expect("run_id").to_owned();
    let position = answer["position"].as_str().expect("position").to_owned();
    let with_position = |path: &str| format!("{path}?min_position={position}");

    // Another tenant: 404 for everything about the run, and it is not listed.
    for path in [
        format!("/v1/runs/{run_id}"),
        format!("/v1/runs/{run_id}/events"),
        format!("/v1/runs/{run_id}/checkpoints/ckpt_{run_id}_1"),
    ] {
        let (status, body) = api.get(&with_position(&path), "tok-eve").await;
        assert_eq!(
            (status, code(&body)),
            (404, "unknown_run"),
            "{path}: {body}"
        );
    }
    let (status, body) = api
        .post(&format!("/v1/runs/{run_id}/cancel"), "tok-eve", json!({}))
        .await;
    assert_eq!((status, code(&body)), (404, "unknown_run"), "{body}");
    let (status, body) = api
        .post(
            &format!("/v1/runs/{run_id}/resume"),
            "tok-eve",
            json!({"decision": "approve", "interrupt_id": "x"}),
        )
        .await;
    assert_eq!(status, 404, "{body}");
    // Every other route that names the run, with the other tenant's operator (so no role
    // check answers first): the live stream, a fork, a reconciliation.
    let (status, body) = api
        .get(
            &with_position(&format!("/v1/runs/{run_id}/events/stream")),
            "tok-oscar",
        )
        .await;
    assert_eq!(
        (status, code(&body)),
        (404, "unknown_run"),
        "stream: {body}"
    );
    let (status, body) = api
        .get(
            &format!("/v1/runs/{run_id}/operations/op_x/why"),
            "tok-oscar",
        )
        .await;
    assert_eq!((status, code(&body)), (404, "unknown_run"), "why: {body}");
    for (path, payload) in [
        (format!("/v1/runs/{run_id}/fork"), json!({"at_version": 1})),
        (
            format!("/v1/runs/{run_id}/operations/op_x/reconcile"),
            json!({"outcome": "failed"}),
        ),
        (format!("/v1/runs/{run_id}/cancel"), json!({})),
    ] {
        let (status, body) = api.post(&path, "tok-oscar", payload).await;
        assert_eq!(
            (status, code(&body)),
            (404, "unknown_run"),
            "{path}: {body}"
        );
    }
    let (status, inbox) = api.get("/v1/inbox", "tok-oscar").await;
    assert_eq!(status, 200, "{inbox}");
    assert!(
        !inbox.to_string().contains(&run_id),
        "another tenant's inbox shows the run: {inbox}"
    );
    // Another tenant starting a run under the taken id: refused without a word about the
    // run. None of the other tenant's commands (the cancel and resume above, this start)
    // left anything in the run's history: they were answered outside it (issue #14, item
    // 3; the fold's side is services/core/tests/tenancy.rs, red with the answers written
    // into the history).
    let (status, body) = api
        .post(
            "/v1/runs",
            "tok-eve",
            json!({"graph_id": "three", "run_id": run_id, "input": {}}),
        )
        .await;
    assert_eq!((status, code(&body)), (409, "run_id_unavailable"), "{body}");
    let (_, history) = api
        .get(
            &with_position(&format!("/v1/runs/{run_id}/events")),
            "tok-bob",
        )
        .await;
    let rejected: Vec<&Value> = history["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e.to_string().contains("CommandRejected"))
        .collect();
    assert!(rejected.is_empty(), "{rejected:?}");
    let (_, theirs) = api.get(&with_position("/v1/runs"), "tok-eve").await;
    assert_eq!(theirs["runs"], json!([]));
    let (_, ours) = api.get(&with_position("/v1/runs"), "tok-alice").await;
    assert_eq!(ours["runs"][0]["run_id"], run_id.as_str());
    let (status, body) = api
        .post(
            "/v1/runs",
            "tok-bob",
            json!({"graph_id": "three", "checkpoint_ns": "globex"}),
        )
        .await;
    assert_eq!((status, code(&body)), (403, "tenant_mismatch"), "{body}");

    // Bad requests: clear JSON errors.
    let raw = |body: &'static str| {
        api.request("POST", "/v1/runs", Some("tok-bob"))
            .header("content-type", "application/json")
            .body(body)
    };
    let (status, body) = api.send(raw("{\"graph_id\": ")).await;
    assert_eq!((status, code(&body)), (400, "bad_json"), "{body}");
    let (status, body) = api.send(raw("{\"input\": {}}")).await;
    assert_eq!((status, code(&body)), (400, "invalid_request"), "{body}");
    let (status, body) = api
        .post("/v1/runs", "tok-bob", json!({"graph_id": "nope"}))
        .await;
    assert_eq!((status, code(&body)), (422, "unknown_graph"), "{body}");
    // Oversized, then another request on the same keep-alive connection, again and
    // again: the gateway reads the rest of an oversized body before it answers, so the
    // connection stays usable. Answering at once left the body unread and hyper closed
    // the connection without saying so: the client's next request on it failed with
    // IncompleteMessage (a flake of this test in CI). Checked: with the drain undone this
    // loop fails.
    let big = "x".repeat(300 * 1024);
    for _ in 0..30 {
        let (status, body) = api
            .post(
                "/v1/runs",
                "tok-bob",
                json!({"graph_id": "three", "input": {"blob": &big}}),
            )
            .await;
        assert_eq!((status, code(&body)), (413, "payload_too_large"), "{body}");
        let (status, body) = api.get("/v1/me", "tok-bob").await;
        assert_eq!(status, 200, "{body}");
    }
    let (status, body) = api.send(api.request("GET", "/v1/runs", None)).await;
    assert_eq!((status, code(&body)), (401, "unauthenticated"), "{body}");
    let (status, body) = api.get("/v1/runs", "not-a-token").await;
    assert_eq!((status, code(&body)), (401, "invalid_token"), "{body}");
    let (status, body) = api.get("/v1/nothing/here", "tok-bob").await;
    assert_eq!((status, code(&body)), (404, "not_found"), "{body}");
    let (status, body) = api
        .send(api.request("DELETE", "/v1/runs", Some("tok-bob")))
        .await;
    assert_eq!((status, code(&body)), (405, "method_not_allowed"), "{body}");
    let (status, body) = api
        .get(
            &format!("/v1/runs/{run_id}?min_position=garbage"),
            "tok-bob",
        )
        .await;
    assert_eq!((status, code(&body)), (400, "invalid_position"), "{body}");

    // Only the good start and the other tenant's start under a taken id (which only the
    // reducer can refuse: the gateway's view may not have the run yet) reached the
    // commands topic; no request the gateway refused did.
    let commands = sortie_tests::read_all(
        &stack.bootstrap,
        &stack.topics.commands(),
        Isolation::ReadCommitted,
    )
    .await;
    assert_eq!(commands.len(), 2, "refused requests published nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_and_fresh_gateways_rebuild_their_views_from_kafka() {
    let stack = Stack::start("gateway-restart", &[THREE_STEPS]).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    let data = stack.dir.join("gateway-a");
    let (mut first, url) = stack.gateway_process(&data, TOKENS).await;
    let api = Api::new(&url);
    let mut runs = Vec::new();
    for order in 0..3 {
        let answer = api
            .start(
                "tok-bob",
                json!({"graph_id": "three", "input": {"order": order}}),
            )
            .await;
        runs.push(answer["run_id"].as_str().expect("run_id").to_owned());
    }
    for run in &runs {
        api.wait_run("the run to succeed", run, |r| r["status"] == "succeeded")
            .await;
    }
    let (_, before) = api
        .get(
            &format!("/v1/runs/{}/events?limit=1000", runs[0]),
            "tok-bob",
        )
        .await;

    // A second gateway with an empty view, running next to the first: it catches up
    // from Kafka and serves a write made through the first at that write's position.
    let (second_process, second_url) = stack
        .gateway_process(&stack.dir.join("gateway-b"), TOKENS)
        .await;
    let second = Api::new(&second_url);
    let answer = api
        .start(
            "tok-bob",
            json!({"graph_id": "three", "input": {"order": 9}}),
        )
        .await;
    let late = answer["run_id"].as_str().expect("run_id").to_owned();
    let (status, seen) = second
        .get(
            &format!(
                "/v1/runs/{late}?min_position={}",
                answer["position"].as_str().expect("position")
            ),
            "tok-bob",
        )
        .await;
    assert_eq!(status, 200, "{seen}");
    for run in &runs {
        let (status, run) = second.get(&format!("/v1/runs/{run}"), "tok-bob").await;
        assert_eq!((status, run["status"].as_str()), (200, Some("succeeded")));
    }
    let (_, events) = second
        .get(
            &format!("/v1/runs/{}/events?limit=1000", runs[0]),
            "tok-bob",
        )
        .await;
    assert_eq!(events["events"], before["events"]);

    // The first gateway, restarted on the same data dir, serves what it had at once:
    // it reads on from its stored offsets (nothing new happened, so it applies nothing).
    api.wait_run("the late run to succeed", &late, |r| {
        r["status"] == "succeeded"
    })
    .await;
    first.stop();
    assert!(
        first.log_text().contains("The view stopped."),
        "a clean stop"
    );
    let (restarted_process, url) = stack.gateway_process(&data, TOKENS).await;
    assert!(
        restarted_process.log_text().contains("applied=0"),
        "a warm restart re-reads nothing: {}",
        restarted_process.log_text()
    );
    assert!(
        !second_process.log_text().contains("applied=0"),
        "the fresh view read the topics"
    );
    let restarted = Api::new(&url);
    for run in &runs {
        let (status, run) = restarted.get(&format!("/v1/runs/{run}"), "tok-bob").await;
        assert_eq!((status, run["status"].as_str()), (200, Some("succeeded")));
    }
    let (_, listed) = restarted.get("/v1/runs?limit=100", "tok-bob").await;
    assert_eq!(
        listed["runs"].as_array().expect("runs").len(),
        runs.len() + 1,
        "{listed}"
    );
}

/// `StepSucceeded` → `step_succeeded`, written out independently of the gateway's helper.
fn snake(name: &str) -> String {
    name.chars()
        .enumerate()
        .flat_map(|(i, c)| {
            let under = (i > 0 && c.is_ascii_uppercase()).then_some('_');
            under
                .into_iter()
                .chain(std::iter::once(c.to_ascii_lowercase()))
        })
        .collect()
}

/// Live event streams are bounded per tenant (issue #14, 6c): with
/// `--max-streams-per-tenant 2`, a third stream is refused 429 `too_many_streams`, and a
/// stream whose client leaves gives its slot back.
///
/// Proved red once each way: with the limit check left out of `stream_slot`, the third
/// stream answered 200; with the slot never given back on drop, the wait for a freed slot
/// timed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_streams_are_bounded_per_tenant_and_a_closed_one_frees_its_slot() {
    let stack = Stack::start("gateway-streams", &[GATED]).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    let (_gateway, url) = stack
        .gateway_process_with(
            &stack.dir.join("gateway"),
            TOKENS,
            &["--max-streams-per-tenant", "2"],
        )
        .await;
    let api = Api::new(&url);
    api.start(
        token(BOB),
        json!({"graph_id": "gated", "input": {"amount": 30}, "checkpoint_ns": "acme", "run_id": "streamed"}),
    )
    .await;
    api.wait_run("the run to wait for approval", "streamed", |r| {
        r["status"] == "waiting_approval"
    })
    .await;
    let open = || async {
        api.request("GET", "/v1/runs/streamed/events/stream", Some("tok-alice"))
            .send()
            .await
            .expect("the gateway answers")
    };
    let refused = |response: reqwest::Response| async move {
        assert_eq!(response.status().as_u16(), 429);
        let body: Value = response.json().await.expect("a JSON error");
        assert_eq!(code(&body), "too_many_streams", "{body}");
    };

    let first = open().await;
    assert_eq!(first.status().as_u16(), 200);
    let second = open().await;
    assert_eq!(second.status().as_u16(), 200);
    refused(open().await).await;

    // The client of the first stream leaves; the gateway notices and frees its slot.
    drop(first);
    let third = sortie_tests::wait_for("a closed stream to free its slot", LONG, || async {
        let response = open().await;
        (response.status().as_u16() == 200).then_some(response)
    })
    .await;
    refused(open().await).await;
    drop((second, third));
}

/// A graph that says who may start and cancel its runs (issue #14, item 2).
const GUARDED: &str = r#"
id: guarded
version: 1
access: {start: [approver, operator], cancel: [operator]}
nodes:
  - {id: prepare, tool: echo, side_effect: pure}
  - id: refund
    tool: echo
    side_effect: keyed
    interrupt_before: {reason: refunds need a human, required_role: approver, timeout: 24h}
edges:
  - {from: prepare, to: refund}
"#;

/// Issue #14, item 2 over HTTP: a graph's `access` is checked by the gateway before it
/// publishes (403, nothing on the commands topic) and again by the fold (for raw
/// producers: `services/core/tests/access.rs`). Bob (no roles) can neither start nor
/// cancel a guarded run; Alice (approver) can start but not cancel; Olga (operator) can
/// cancel. Checked: with the gateway's check removed the fold still refuses (403
/// `forbidden` too, but a `CommandRejected` lands in the run's history — which this test
/// looks for, so it goes red).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graphs_access_decides_who_starts_and_cancels_its_runs() {
    let stack = Stack::start("gateway-access", &[GUARDED]).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    let (_gateway, url) = stack
        .gateway_process(&stack.dir.join("gateway"), TOKENS)
        .await;
    let api = Api::new(&url);

    let (status, refused) = api
        .post(
            "/v1/runs",
            "tok-bob",
            json!({"graph_id": "guarded", "input": {}, "run_id": "by-bob"}),
        )
        .await;
    assert_eq!((status, code(&refused)), (403, "forbidden"), "{refused}");
    api.start(
        "tok-alice",
        json!({"graph_id": "guarded", "input": {}, "run_id": "guarded-1"}),
    )
    .await;
    api.wait_run("the guarded run to wait", "guarded-1", |r| {
        r["status"] == "waiting_approval"
    })
    .await;
    for token in ["tok-bob", "tok-alice"] {
        let (status, refused) = api
            .post("/v1/runs/guarded-1/cancel", token, json!({}))
            .await;
        assert_eq!(
            (status, code(&refused)),
            (403, "forbidden"),
            "{token}: {refused}"
        );
    }
    let (status, cancelled) = api
        .post(
            "/v1/runs/guarded-1/cancel",
            "tok-olga",
            json!({"reason": "ops"}),
        )
        .await;
    assert_eq!(status, 200, "{cancelled}");
    api.wait_run("the run to be cancelled", "guarded-1", |r| {
        r["status"] == "cancelled"
    })
    .await;
    // The refusals never reached Kafka: no start for Bob's run, no rejected command in
    // the run's history.
    let events = stack.events().await;
    assert!(!events.contains_key("by-bob"), "{:?}", events.get("by-bob"));
    let history = &events["guarded-1"];
    assert!(
        !history
            .iter()
            .any(|e| matches!(e.body, EventBody::CommandRejected { .. })),
        "{history:?}"
    );
}

/// A tenant's starts are admitted at a bounded rate before anything is published (issue
/// #54): past its burst a start is answered 429 `start_rate_exceeded` with `Retry-After`
/// and publishes nothing; another tenant is not held back; after the wait it starts.
///
/// Seen red: with the admission check left out of `start_run`, the third start was 201.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_starts_past_its_rate_are_refused_with_retry_after() {
    let stack = Stack::start("gateway-start-rate", &[GATED]).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    let (_gateway, url) = stack
        .gateway_process_with(
            &stack.dir.join("gateway"),
            TOKENS,
            &["--tenant-start-rate", "0.25", "--tenant-start-burst", "2"],
        )
        .await;
    let api = Api::new(&url);
    let start = |run: &str, ns: &str| json!({"graph_id": "gated", "input": {"amount": 30}, "checkpoint_ns": ns, "run_id": run});
    api.start(token(BOB), start("rate-1", "acme")).await;
    api.start(token(BOB), start("rate-2", "acme")).await;

    let response = api
        .request("POST", "/v1/runs", Some(token(BOB)))
        .json(&start("refused-1", "acme"))
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(response.status().as_u16(), 429);
    let retry_after: u64 = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("a Retry-After in seconds");
    assert!(
        (1..=4).contains(&retry_after),
        "one token every 4 s: {retry_after}"
    );
    let body: Value = response.json().await.expect("a JSON error");
    assert_eq!(code(&body), "start_rate_exceeded", "{body}");

    // Acme's burst is acme's: globex starts at once.
    api.start(token(EVE), start("rate-globex", "globex")).await;
    // After the wait, acme starts again.
    sortie_tests::wait_until("acme to start again after Retry-After", LONG, || async {
        let (status, _) = api
            .post("/v1/runs", token(BOB), start("rate-3", "acme"))
            .await;
        status == 201
    })
    .await;
    api.wait_run("the later start to be visible", "rate-3", |r| {
        r["status"] == "waiting_approval"
    })
    .await;
    let (status, _) = api.get("/v1/runs/refused-1", token(BOB)).await;
    assert_eq!(status, 404, "the refused start published nothing");
}
