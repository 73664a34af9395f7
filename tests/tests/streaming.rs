//! An `llm` step's text reaches a client while the model writes it: the fake model streams
//! slowly (`fake-agent-slow`), the executor sends what it has so far to
//! `sortie.step-deltas` (sealed with the run's key), and the gateway's event stream
//! carries it as `delta` events beside the history — before the step's result is
//! committed, outside the history, resumable with `Last-Event-ID`.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use sortie_core::seal::Seal as _;
use sortie_devkit::model::FakeModel;
use sortie_tests::http::Api;
use sortie_tests::stack::Stack;
use sortie_tests::Isolation;
use sortie_wire::records as w;

const LONG: Duration = Duration::from_secs(90);
const TOKEN: &str = "acme:user:alice:approver:tok-alice";

fn graph(model: &str) -> String {
    format!(
        r#"
id: writer
version: 1
nodes:
  - id: write
    tool: llm
    side_effect: pure
    args:
      messages: [{{role: user, content: $input.request}}]
    config: {{base_url: "{model}/v1", model: fake-agent-slow}}
    timeout: 30s
"#
    )
}

/// One server-sent event.
#[derive(Debug, Clone)]
struct Sse {
    id: String,
    event: String,
    data: Value,
}

/// A server-sent event stream being read.
struct Reader {
    response: reqwest::Response,
    buffer: String,
    pending: (String, String, String),
    seen: Vec<Sse>,
}

impl Reader {
    fn new(response: reqwest::Response) -> Reader {
        Reader {
            response,
            buffer: String::new(),
            pending: Default::default(),
            seen: Vec::new(),
        }
    }

    /// Reads until `enough` holds for what was read, or panics at the deadline.
    async fn until(&mut self, enough: impl Fn(&[Sse]) -> bool) {
        let deadline = tokio::time::Instant::now() + LONG;
        while !enough(&self.seen) {
            let chunk = tokio::time::timeout_at(deadline, self.response.chunk())
                .await
                .unwrap_or_else(|_| panic!("the stream delivers in time; seen: {:#?}", self.seen))
                .expect("the stream stays open")
                .expect("the stream does not end");
            self.buffer.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = self.buffer.find('\n') {
                let line: String = self.buffer.drain(..=end).collect();
                let line = line.trim_end_matches(['\r', '\n']);
                let (id, event, data) = &mut self.pending;
                if line.is_empty() {
                    if !data.is_empty() {
                        self.seen.push(Sse {
                            id: std::mem::take(id),
                            event: std::mem::take(event),
                            data: serde_json::from_str(data).expect("data is JSON"),
                        });
                    }
                    data.clear();
                } else if let Some(v) = line.strip_prefix("id:") {
                    *id = v.trim().to_owned();
                } else if let Some(v) = line.strip_prefix("event:") {
                    *event = v.trim().to_owned();
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push_str(v.trim());
                }
            }
        }
    }
}

/// The text of the last execution whose deltas were seen.
fn last_text(seen: &[Sse]) -> String {
    let deltas = deltas(seen);
    let Some(last) = deltas.last().map(|d| d.data["execution_id"].clone()) else {
        return String::new();
    };
    deltas
        .iter()
        .filter(|d| d.data["execution_id"] == last)
        .map(|d| d.data["text"].as_str().unwrap_or_default())
        .collect()
}

fn deltas(seen: &[Sse]) -> Vec<&Sse> {
    seen.iter().filter(|e| e.event == "delta").collect()
}

fn step_succeeded(seen: &[Sse]) -> Option<usize> {
    seen.iter().position(|e| e.event == "StepSucceeded")
}

/// The fake model (streaming slowly), a stack whose services seal, a reducer, an
/// executor (`executor_args` appended) and a gateway.
struct Streaming {
    stack: Stack,
    api: Api,
    seal: Vec<String>,
    _reducer: sortie_tests::stack::Process,
    executor: sortie_tests::stack::Process,
    _gateway: sortie_tests::stack::Process,
    _fake: Arc<FakeModel>,
}

impl Streaming {
    async fn start(name: &str, executor_args: &[&str]) -> Streaming {
        let (fake, model_url) = sortie_tests::stack::serve_fake_model().await;
        let stack = Stack::start(name, &[]).await;
        stack.publish(&graph(&model_url)).await;
        let kek = stack.dir.join("kek.yaml");
        std::fs::write(
            &kek,
            sortie_seal::kek::Keyring::generate("*", "test-kek").expect("KEK"),
        )
        .expect("keyring");
        let store = format!("file://{}", stack.dir.join("run-keys").display());
        let seal: Vec<String> = vec![
            "--seal-keyring".into(),
            kek.to_str().expect("path").into(),
            "--seal-key-store".into(),
            store,
        ];
        let flags: Vec<&str> = seal.iter().map(String::as_str).collect();
        let reducer = stack.reducer_with("0", &flags);
        let mut extra = flags.clone();
        extra.extend_from_slice(executor_args);
        let executor = stack.executor_process("executor", &["default"], &extra);
        let (gateway, url) = stack
            .gateway_process_with(&stack.dir.join("gateway"), &[TOKEN], &flags)
            .await;
        Streaming {
            api: Api::new(&url),
            stack,
            seal,
            _reducer: reducer,
            executor,
            _gateway: gateway,
            _fake: fake,
        }
    }

    /// Starts `run` and opens its event stream.
    async fn start_run(&self, run: &str) -> Reader {
        self.api
            .start(
                "tok-alice",
                json!({"graph_id": "writer", "run_id": run, "input": {"request": "Write it."}}),
            )
            .await;
        let stream = self
            .api
            .request(
                "GET",
                &format!("/v1/runs/{run}/events/stream"),
                Some("tok-alice"),
            )
            .send()
            .await
            .expect("stream");
        assert_eq!(stream.status().as_u16(), 200);
        Reader::new(stream)
    }

    /// The `write#1` step of the finished run.
    async fn step(&self, run: &str) -> Value {
        let state = self
            .api
            .wait_run("the run to succeed", run, "tok-alice", LONG, |r| {
                r["status"] == "succeeded"
            })
            .await;
        state["steps"]
            .as_array()
            .and_then(|steps| steps.iter().find(|s| s["step_id"] == "write#1"))
            .cloned()
            .expect("the step")
    }
}

fn run_succeeded(seen: &[Sse]) -> bool {
    step_succeeded(seen).is_some()
        && seen.iter().any(|e| {
            e.event == "RunStatusChanged" && e.data.to_string().to_lowercase().contains("succeeded")
        })
}

/// Seen red with the text sent unsealed (the raw-topic check: plaintext on the topic), and
/// with the gateway's check for sealed text skipped (the forged plaintext delta shown).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_models_text_reaches_the_stream_as_it_is_written_sealed_and_outside_the_history() {
    let streaming = Streaming::start("streaming", &[]).await;
    let (stack, api) = (&streaming.stack, &streaming.api);
    let run = "run-writer";
    let mut stream = streaming.start_run(run).await;
    stream.until(run_succeeded).await;
    let step = streaming.step(run).await;
    let content = step["output"]["content"].as_str().expect("text").to_owned();
    // Deltas are hints on a topic of their own: the last may come just after the result.
    stream.until(|seen| last_text(seen) == content).await;
    let seen = &stream.seen;

    // Text arrived before the step's result was committed, in order, from one execution.
    let succeeded = step_succeeded(seen).expect("the step succeeded");
    let before = seen[..succeeded]
        .iter()
        .filter(|e| e.event == "delta")
        .count();
    assert!(
        before >= 2,
        "deltas before the result: {before}; stream: {seen:#?}"
    );
    let deltas = deltas(seen);
    let execution = deltas[0].data["execution_id"]
        .as_str()
        .expect("execution id");
    assert!(execution.starts_with("exe_"));
    for (n, delta) in deltas.iter().enumerate() {
        assert_eq!(delta.data["execution_id"], execution, "{delta:?}");
        assert_eq!(delta.data["seq"], n as i64 + 1, "{delta:?}");
        assert_eq!(delta.data["kind"], "text");
        assert_eq!(delta.data["step_id"], "write#1");
        assert_eq!(delta.data["attempt"], 1);
        assert!(
            delta.id.contains(".d"),
            "a delta's id is N.dOFFSET: {}",
            delta.id
        );
    }
    let written: String = deltas
        .iter()
        .map(|d| d.data["text"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        Value::String(written.clone()),
        step["output"]["content"],
        "{step}"
    );

    // Outside the history: no event of the run is a delta; on the topic, sealed.
    let (_, events) = api
        .get(&format!("/v1/runs/{run}/events"), "tok-alice")
        .await;
    let history = events["events"].as_array().expect("events");
    assert!(history
        .iter()
        .all(|e| !e.to_string().contains("execution_id")));
    let raw = sortie_tests::read_all(
        &stack.bootstrap,
        &stack.topics.step_deltas(),
        Isolation::ReadUncommitted,
    )
    .await;
    assert_eq!(raw.len(), deltas.len(), "one record per delta sent");
    let word = written
        .split_whitespace()
        .last()
        .expect("a word")
        .trim_matches(|c: char| !c.is_alphanumeric());
    for record in &raw {
        let bytes = rdkafka::Message::payload(record).unwrap_or_default();
        assert!(
            !String::from_utf8_lossy(bytes).contains(word),
            "plaintext on the deltas topic"
        );
    }

    // A client that reconnects after the first delta gets the rest, not the first again.
    let first = deltas[0].id.clone();
    let again = api
        .request(
            "GET",
            &format!("/v1/runs/{run}/events/stream"),
            Some("tok-alice"),
        )
        .header("last-event-id", &first)
        .send()
        .await
        .expect("stream");
    let mut again = Reader::new(again);
    let rest = deltas.len() - 1;
    again
        .until(|seen| seen.iter().filter(|e| e.event == "delta").count() >= rest)
        .await;
    let offsets: Vec<i64> = again
        .seen
        .iter()
        .filter(|e| e.event == "delta")
        .map(|e| e.data["offset"].as_i64().expect("offset"))
        .collect();
    let first_offset = deltas[0].data["offset"].as_i64().expect("offset");
    assert!(
        offsets.iter().all(|o| *o > first_offset),
        "{offsets:?} after {first_offset}"
    );
    assert_eq!(offsets.len(), rest);

    // A sealed run's delta in plaintext is not the executor's: a forged one, then one
    // sealed with the run's key, on the run's partition; the stream shows the second only.
    let keys = sortie_seal::SealConfig::new(&streaming.seal[1], streaming.seal[3].clone())
        .open()
        .expect("the run keys");
    let seal = keys.seal("acme", run).await.expect("the run's seal");
    let topic = stack.topics.step_deltas();
    let forged = |text: Value, seq: i64| w::StepDelta {
        tenant: "acme".into(),
        run_id: run.into(),
        step_id: "write#1".into(),
        node: "write".into(),
        operation_id: "op_forged".into(),
        attempt: 1,
        execution_id: "exe_forged".into(),
        seq,
        kind: w::DeltaKind::Text,
        text: text.to_string(),
        at: 0,
    };
    let plain = stack
        .codec
        .encode(&topic, &forged(json!("FORGED"), 1))
        .await
        .expect("encode");
    let sealed = stack
        .codec
        .encode(&topic, &forged(seal.seal(&json!("SEALED")), 2))
        .await
        .expect("encode");
    sortie_tests::produce(&stack.bootstrap, &topic, &[(run, plain), (run, sealed)]).await;
    again
        .until(|seen| seen.iter().any(|e| e.data["text"] == "SEALED"))
        .await;
    assert!(
        again.seen.iter().all(|e| e.data["text"] != "FORGED"),
        "a plaintext delta shown for a sealed run"
    );
}

/// The executor is SIGKILLed while the model streams: the attempt is delivered again, its
/// new execution's deltas carry another execution id (a client never joins the two
/// texts), and the history holds the one committed result, without any delta.
///
/// Seen red with one execution id per attempt instead of per call: the two executions'
/// texts ran together and never matched the result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_killed_mid_stream_leaves_one_result_and_tells_its_executions_apart() {
    let mut streaming = Streaming::start("streaming-kill", &["--static-membership"]).await;
    let run = "run-killed";
    let mut stream = streaming.start_run(run).await;
    stream.until(|seen| !deltas(seen).is_empty()).await;
    streaming.executor.kill();
    let mut extra: Vec<&str> = streaming.seal.iter().map(String::as_str).collect();
    extra.push("--static-membership");
    let _again = streaming
        .stack
        .executor_process("executor", &["default"], &extra);
    stream.until(run_succeeded).await;
    let step = streaming.step(run).await;
    let content = step["output"]["content"].as_str().expect("text").to_owned();
    stream.until(|seen| last_text(seen) == content).await;

    let deltas = deltas(&stream.seen);
    let mut executions: Vec<&str> = Vec::new();
    for delta in &deltas {
        let id = delta.data["execution_id"].as_str().expect("execution id");
        if executions.last() != Some(&id) {
            executions.push(id);
        }
    }
    assert!(
        executions.len() >= 2 && executions[0] != executions[executions.len() - 1],
        "two executions told apart: {executions:?}"
    );
    let last = executions[executions.len() - 1];
    let theirs: Vec<&&Sse> = deltas
        .iter()
        .filter(|d| d.data["execution_id"] == last)
        .collect();
    for (n, delta) in theirs.iter().enumerate() {
        assert_eq!(
            delta.data["seq"],
            n as i64 + 1,
            "each execution counts from 1"
        );
    }
    let written: String = theirs
        .iter()
        .map(|d| d.data["text"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(Value::String(written), step["output"]["content"], "{step}");
    let (_, events) = streaming
        .api
        .get(&format!("/v1/runs/{run}/events"), "tok-alice")
        .await;
    let history = events["events"].as_array().expect("events");
    let results = history
        .iter()
        .filter(|e| e["body"].get("StepSucceeded").is_some())
        .count();
    assert_eq!(results, 1, "one result in the history");
    assert!(history
        .iter()
        .all(|e| !e.to_string().contains("execution_id")));
}
