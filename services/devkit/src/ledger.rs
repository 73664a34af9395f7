//! The ledger: a small HTTP receiver that records every call it gets, durably, for tests
//! and the dev stack. Crash tests assert on the ledger, not on what a run says about
//! itself.
//!
//! Endpoints:
//!
//! - `POST /effects/{name}` — a side effect. The operation id is the `Idempotency-Key`
//!   header. Every call that reaches the ledger is appended to its file (one JSON line,
//!   fsynced before the answer) with `effect: true` if it took effect, `false` if the
//!   mode absorbed it as a repeat:
//!   - `plain` (an `unsafe` receiver) and `reconcilable`: every call takes effect;
//!   - `keyed`: the first call per key takes effect; a repeat gets the first answer and
//!     adds no effect (a call without the header is refused with 400);
//!   - `idempotent`: the first call per (name, body) takes effect; a repeat of the same
//!     request changes nothing and gets the same answer.
//! - `GET /status/{operation_id}` (`reconcilable` only) — 200
//!   `{"status": "succeeded", "output": <answer>}` or 404 `{"status": "not_found"}`.
//! - `GET /ledger` — every call, as a [`Snapshot`]; `GET /ledger/{operation_id}` — that
//!   operation's calls.
//! - `POST /faults` — a [`FaultSpec`] for the next `times` effect calls: answer 429 or 500
//!   without recording, delay the answer after recording, or drop the connection after
//!   recording (the receiver committed, the caller never hears). Specs queue up in the
//!   order they were posted, so "a 429, then a 500, then a drop" is three posts.
//!   `{"forget": true, "times": n}` instead makes the next `n` status lookups answer 404
//!   even for operations the ledger recorded.
//!
//! On start the file is read back, so a restarted ledger remembers every effect.

use sortie_kafka::clock::now_ms;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// How the ledger treats a repeated call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Every call takes effect (an `unsafe` receiver).
    Plain,
    /// Dedupes on the `Idempotency-Key`.
    Keyed,
    /// A repeat of the same request is harmless.
    Idempotent,
    /// Every call takes effect, and `GET /status/{operation_id}` says what happened.
    Reconcilable,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Plain => "plain",
            Mode::Keyed => "keyed",
            Mode::Idempotent => "idempotent",
            Mode::Reconcilable => "reconcilable",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown ledger mode {0:?}; known: plain, keyed, idempotent, reconcilable")]
pub struct UnknownMode(pub String);

impl FromStr for Mode {
    type Err = UnknownMode;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        [
            Mode::Plain,
            Mode::Keyed,
            Mode::Idempotent,
            Mode::Reconcilable,
        ]
        .into_iter()
        .find(|m| m.as_str() == text.trim())
        .ok_or_else(|| UnknownMode(text.to_owned()))
    }
}

/// One call the ledger received.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub seq: u64,
    /// The `Idempotency-Key` header.
    pub operation_id: Option<String>,
    pub name: String,
    pub body: Value,
    /// Milliseconds since the Unix epoch.
    pub at: i64,
    /// Whether the call took effect (false: a repeat its mode absorbed).
    pub effect: bool,
    /// What the ledger answered.
    pub answer: Value,
}

/// Everything the ledger has recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    pub mode: Mode,
    pub calls: Vec<Entry>,
}

impl Snapshot {
    /// Calls of `operation_id` that took effect.
    pub fn effects(&self, operation_id: &str) -> usize {
        self.of(operation_id).filter(|e| e.effect).count()
    }

    /// Calls of `operation_id` that reached the ledger, effect or not.
    pub fn calls(&self, operation_id: &str) -> usize {
        self.of(operation_id).count()
    }

    pub fn total_effects(&self) -> usize {
        self.calls.iter().filter(|e| e.effect).count()
    }

    fn of<'a>(&'a self, operation_id: &'a str) -> impl Iterator<Item = &'a Entry> + 'a {
        self.calls
            .iter()
            .filter(move |e| e.operation_id.as_deref() == Some(operation_id))
    }
}

/// Faults for the next `times` calls of `POST /effects/{name}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    /// Answer this status (429 or 5xx) without recording anything.
    #[serde(default)]
    pub status: Option<u16>,
    /// Record, then wait this long before answering.
    #[serde(default)]
    pub delay_ms: Option<u64>,
    /// Record, then drop the connection without answering.
    #[serde(default)]
    pub drop_after_commit: bool,
    /// Not an effect fault: the next `times` status lookups answer 404 `not_found` even
    /// for operations the ledger recorded (a receiver that lost its record, or a lookup
    /// that lags the call). Effect calls are untouched.
    #[serde(default)]
    pub forget: bool,
    #[serde(default = "one")]
    pub times: u32,
}

fn one() -> u32 {
    1
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("ledger file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The ledger's state: its file and what it has recorded.
#[derive(Debug)]
pub struct Ledger {
    mode: Mode,
    path: PathBuf,
    file: Arc<std::sync::Mutex<std::fs::File>>,
    /// Held across the append and its fsync, so the file's order is the seq order.
    state: tokio::sync::Mutex<Records>,
    faults: std::sync::Mutex<VecDeque<FaultSpec>>,
    /// How many more status lookups answer 404 whatever was recorded (`forget` faults).
    forgetting: std::sync::atomic::AtomicU32,
}

#[derive(Debug, Default)]
struct Records {
    calls: Vec<Entry>,
    /// Operation id → index of its first effect.
    by_key: HashMap<String, usize>,
    /// (name, body) → index of its first effect (`idempotent`).
    by_content: HashMap<String, usize>,
}

impl Records {
    fn index(&mut self, entry: &Entry, at: usize) {
        if !entry.effect {
            return;
        }
        if let Some(key) = &entry.operation_id {
            self.by_key.entry(key.clone()).or_insert(at);
        }
        self.by_content
            .entry(content_key(&entry.name, &entry.body))
            .or_insert(at);
    }
}

fn content_key(name: &str, body: &Value) -> String {
    // serde_json's maps are ordered, so equal bodies print equally.
    format!("{name}\n{body}")
}

impl Ledger {
    /// Opens (or creates) the ledger file and reads back what it holds. A torn last line
    /// (a crash mid-append, before the fsync answered anyone) is ignored.
    pub fn open(path: impl AsRef<Path>, mode: Mode) -> Result<Ledger, Error> {
        let path = path.as_ref().to_path_buf();
        let io = |source| Error::Io {
            path: path.clone(),
            source,
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(io)?;
        }
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(io(e)),
        };
        let mut records = Records::default();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            match serde_json::from_str::<Entry>(line) {
                Ok(entry) => {
                    let at = records.calls.len();
                    records.index(&entry, at);
                    records.calls.push(entry);
                }
                Err(e) => tracing::warn!(error = %e, "Ignoring an unreadable ledger line."),
            }
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io)?;
        if !records.calls.is_empty() {
            tracing::info!(calls = records.calls.len(), path = %path.display(), "Ledger reloaded.");
        }
        Ok(Ledger {
            mode,
            path,
            file: Arc::new(std::sync::Mutex::new(file)),
            state: tokio::sync::Mutex::new(records),
            faults: std::sync::Mutex::new(VecDeque::new()),
            forgetting: std::sync::atomic::AtomicU32::new(0),
        })
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub async fn snapshot(&self) -> Snapshot {
        Snapshot {
            mode: self.mode,
            calls: self.state.lock().await.calls.clone(),
        }
    }

    /// Queues `spec` for the next `spec.times` effect calls (after the specs already
    /// queued).
    pub fn add_fault(&self, spec: FaultSpec) {
        if spec.forget {
            self.forgetting
                .fetch_add(spec.times, std::sync::atomic::Ordering::SeqCst);
        } else if spec.times > 0 {
            self.faults
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push_back(spec);
        }
    }

    /// Takes one armed `forget` fault, if any.
    fn take_forget(&self) -> bool {
        self.forgetting
            .fetch_update(
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
                |n| n.checked_sub(1),
            )
            .is_ok()
    }

    fn take_fault(&self) -> Option<FaultSpec> {
        let mut faults = self.faults.lock().unwrap_or_else(|e| e.into_inner());
        let front = faults.front_mut()?;
        let spec = front.clone();
        front.times -= 1;
        if front.times == 0 {
            faults.pop_front();
        }
        Some(spec)
    }

    /// Records one call durably and returns it, with the answer its mode gives.
    pub async fn record(
        &self,
        operation_id: Option<String>,
        name: &str,
        body: Value,
    ) -> Result<Entry, Error> {
        self.record_as(self.mode, operation_id, name, body, |seq, operation_id| {
            serde_json::json!({
                "ledger_seq": seq,
                "operation_id": operation_id,
                "name": name,
            })
        })
        .await
    }

    /// Records one call durably under `mode` (not necessarily the ledger's own: the dev
    /// receiver dedupes payments by key and notifications by content). A repeat that
    /// `mode` absorbs gets the first call's answer and adds no effect; otherwise `answer`
    /// (given the call's seq and key) is the answer, stored with the call.
    pub async fn record_as(
        &self,
        mode: Mode,
        operation_id: Option<String>,
        name: &str,
        body: Value,
        answer: impl FnOnce(u64, Option<&str>) -> Value,
    ) -> Result<Entry, Error> {
        let mut records = self.state.lock().await;
        let first = match mode {
            Mode::Keyed => operation_id
                .as_ref()
                .and_then(|key| records.by_key.get(key).copied()),
            Mode::Idempotent => records.by_content.get(&content_key(name, &body)).copied(),
            Mode::Plain | Mode::Reconcilable => None,
        };
        let seq = records.calls.last().map_or(1, |e| e.seq + 1);
        let answer = match first {
            Some(i) => records.calls[i].answer.clone(),
            None => answer(seq, operation_id.as_deref()),
        };
        let entry = Entry {
            seq,
            operation_id,
            name: name.to_owned(),
            body,
            at: now_ms(),
            effect: first.is_none(),
            answer,
        };
        let mut line = serde_json::to_vec(&entry).unwrap_or_default();
        line.push(b'\n');
        let file = self.file.clone();
        let written = tokio::task::spawn_blocking(move || {
            let mut file = file.lock().unwrap_or_else(|e| e.into_inner());
            file.write_all(&line)?;
            file.sync_data()
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        written.map_err(|source| Error::Io {
            path: self.path.clone(),
            source,
        })?;
        let at = records.calls.len();
        records.index(&entry, at);
        records.calls.push(entry.clone());
        Ok(entry)
    }

    /// The first effect of `operation_id`, if any.
    pub async fn status(&self, operation_id: &str) -> Option<Entry> {
        let records = self.state.lock().await;
        records
            .by_key
            .get(operation_id)
            .map(|&i| records.calls[i].clone())
    }
}

/// The ledger's HTTP routes.
pub fn router(ledger: Arc<Ledger>) -> Router {
    routes()
        .route("/status/{operation_id}", get(status))
        .with_state(ledger)
}

/// Every route but the status lookup (the dev receiver answers that one for any mode).
pub(crate) fn routes() -> Router<Arc<Ledger>> {
    Router::new()
        .route("/effects/{name}", post(effect))
        .route("/ledger", get(all))
        .route("/ledger/{operation_id}", get(one_operation))
        .route("/faults", post(faults))
}

/// Serves the ledger on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    ledger: Arc<Ledger>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(ledger))
        .with_graceful_shutdown(shutdown)
        .await
}

/// The payload of the unwind that drops a connection (see `drop_after_commit`).
struct DropConnection;

async fn effect(
    State(ledger): State<Arc<Ledger>>,
    UrlPath(name): UrlPath<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let operation_id = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body: Value = if body.is_empty() {
        Value::Null
    } else {
        match serde_json::from_slice(&body) {
            Ok(body) => body,
            Err(e) => {
                return (StatusCode::BAD_REQUEST, format!("body is not JSON: {e}")).into_response()
            }
        }
    };
    let fault = ledger.take_fault();
    if let Some(status) = fault.as_ref().and_then(|f| f.status) {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        tracing::info!(%name, ?operation_id, %status, "Injected fault: answering without recording.");
        return (status, [("retry-after", "1")], "injected fault").into_response();
    }
    if ledger.mode == Mode::Keyed && operation_id.is_none() {
        return (
            StatusCode::BAD_REQUEST,
            "a keyed receiver needs an Idempotency-Key header",
        )
            .into_response();
    }
    let entry = match ledger.record(operation_id, &name, body).await {
        Ok(entry) => entry,
        Err(e) => {
            tracing::error!(error = %e, "Recording a call failed.");
            return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response();
        }
    };
    tracing::info!(
        seq = entry.seq,
        %name,
        operation_id = entry.operation_id.as_deref().unwrap_or(""),
        effect = entry.effect,
        "Call recorded."
    );
    if let Some(fault) = fault {
        if let Some(ms) = fault.delay_ms {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        if fault.drop_after_commit {
            tracing::info!(
                seq = entry.seq,
                "Injected fault: dropping the connection after recording."
            );
            // Unwinding out of the handler ends the connection's task, which closes the
            // socket without an answer. `resume_unwind` skips the panic hook: no noise.
            std::panic::resume_unwind(Box::new(DropConnection));
        }
    }
    (StatusCode::OK, Json(entry.answer)).into_response()
}

async fn status(
    State(ledger): State<Arc<Ledger>>,
    UrlPath(operation_id): UrlPath<String>,
) -> Response {
    if ledger.mode != Mode::Reconcilable {
        return (
            StatusCode::NOT_IMPLEMENTED,
            Json(serde_json::json!({"error": "status lookups need --mode reconcilable"})),
        )
            .into_response();
    }
    let known = if ledger.take_forget() {
        tracing::info!(%operation_id, "Injected fault: answering the lookup as not found.");
        None
    } else {
        ledger.status(&operation_id).await
    };
    match known {
        Some(entry) => Json(serde_json::json!({
            "status": "succeeded",
            "output": entry.answer,
            "seq": entry.seq,
        }))
        .into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(serde_json::json!({"status": "not_found"})),
        )
            .into_response(),
    }
}

async fn all(State(ledger): State<Arc<Ledger>>) -> Json<Snapshot> {
    Json(ledger.snapshot().await)
}

async fn one_operation(
    State(ledger): State<Arc<Ledger>>,
    UrlPath(operation_id): UrlPath<String>,
) -> Json<Snapshot> {
    let mut snapshot = ledger.snapshot().await;
    snapshot
        .calls
        .retain(|e| e.operation_id.as_deref() == Some(operation_id.as_str()));
    Json(snapshot)
}

async fn faults(State(ledger): State<Arc<Ledger>>, Json(spec): Json<FaultSpec>) -> Json<Value> {
    tracing::info!(?spec, "Fault armed.");
    ledger.add_fault(spec.clone());
    Json(serde_json::json!({ "armed": spec }))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Served {
        url: String,
        client: reqwest::Client,
    }

    impl Served {
        async fn start(path: &Path, mode: Mode) -> Served {
            let ledger = Arc::new(Ledger::open(path, mode).expect("open"));
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let url = format!("http://{}", listener.local_addr().expect("addr"));
            tokio::spawn(serve(listener, ledger, std::future::pending()));
            Served {
                url,
                client: reqwest::Client::new(),
            }
        }

        async fn post(
            &self,
            key: Option<&str>,
            body: Value,
        ) -> Result<(u16, Value), reqwest::Error> {
            let mut request = self
                .client
                .post(format!("{}/effects/pay", self.url))
                .json(&body);
            if let Some(key) = key {
                request = request.header("Idempotency-Key", key);
            }
            let response = request.send().await?;
            let status = response.status().as_u16();
            let text = response.text().await?;
            Ok((
                status,
                serde_json::from_str(&text).unwrap_or(Value::String(text)),
            ))
        }

        async fn snapshot(&self) -> Snapshot {
            self.client
                .get(format!("{}/ledger", self.url))
                .send()
                .await
                .expect("get")
                .json()
                .await
                .expect("snapshot")
        }

        async fn fault(&self, spec: Value) {
            self.client
                .post(format!("{}/faults", self.url))
                .json(&spec)
                .send()
                .await
                .expect("fault")
                .error_for_status()
                .expect("fault accepted");
        }
    }

    #[tokio::test]
    async fn keyed_dedupes_on_the_key_and_survives_a_restart() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("ledger.jsonl");
        let ledger = Served::start(&path, Mode::Keyed).await;
        let (status, first) = ledger
            .post(Some("op-1"), serde_json::json!({"n": 1}))
            .await
            .expect("post");
        assert_eq!(status, 200);
        let (_, again) = ledger
            .post(Some("op-1"), serde_json::json!({"n": 1}))
            .await
            .expect("post");
        assert_eq!(first, again, "a repeat gets the first answer");
        let (status, _) = ledger
            .post(None, serde_json::json!({}))
            .await
            .expect("post");
        assert_eq!(status, 400, "keyed needs a key");
        let snapshot = ledger.snapshot().await;
        assert_eq!((snapshot.effects("op-1"), snapshot.calls("op-1")), (1, 2));

        // A new ledger on the same file remembers the key.
        let restarted = Served::start(&path, Mode::Keyed).await;
        let (_, third) = restarted
            .post(Some("op-1"), serde_json::json!({"n": 1}))
            .await
            .expect("post");
        assert_eq!(third, first);
        let snapshot = restarted.snapshot().await;
        assert_eq!((snapshot.effects("op-1"), snapshot.calls("op-1")), (1, 3));
    }

    #[tokio::test]
    async fn idempotent_absorbs_the_same_request_and_plain_absorbs_nothing() {
        let dir = tempfile::tempdir().expect("dir");
        let idempotent = Served::start(&dir.path().join("i.jsonl"), Mode::Idempotent).await;
        for _ in 0..2 {
            idempotent
                .post(Some("op"), serde_json::json!({"set": 3}))
                .await
                .expect("post");
        }
        idempotent
            .post(Some("op2"), serde_json::json!({"set": 4}))
            .await
            .expect("post");
        let snapshot = idempotent.snapshot().await;
        assert_eq!((snapshot.effects("op"), snapshot.calls("op")), (1, 2));
        assert_eq!(snapshot.total_effects(), 2);

        let plain = Served::start(&dir.path().join("p.jsonl"), Mode::Plain).await;
        for _ in 0..2 {
            plain
                .post(Some("op"), serde_json::json!({"set": 3}))
                .await
                .expect("post");
        }
        assert_eq!(plain.snapshot().await.effects("op"), 2);
    }

    #[tokio::test]
    async fn reconcilable_answers_status_lookups() {
        let dir = tempfile::tempdir().expect("dir");
        let ledger = Served::start(&dir.path().join("r.jsonl"), Mode::Reconcilable).await;
        let status = |op: &str| {
            let url = format!("{}/status/{op}", ledger.url);
            let client = ledger.client.clone();
            async move {
                let response = client.get(url).send().await.expect("get");
                (
                    response.status().as_u16(),
                    response.json::<Value>().await.expect("json"),
                )
            }
        };
        assert_eq!(status("op-9").await.0, 404);
        let (_, answer) = ledger
            .post(Some("op-9"), serde_json::json!({}))
            .await
            .expect("post");
        let (code, body) = status("op-9").await;
        assert_eq!(code, 200);
        assert_eq!(body["status"], "succeeded");
        assert_eq!(body["output"], answer);
        // `forget`: the next two lookups deny a recorded operation; effects are untouched.
        ledger
            .fault(serde_json::json!({"forget": true, "times": 2}))
            .await;
        for _ in 0..2 {
            assert_eq!(
                status("op-9").await,
                (404, serde_json::json!({"status": "not_found"}))
            );
        }
        ledger
            .post(Some("op-10"), serde_json::json!({}))
            .await
            .expect("a forget fault leaves effect calls alone");
        assert_eq!(status("op-9").await.0, 200);
        assert_eq!(ledger.snapshot().await.calls("op-9"), 1);
    }

    #[tokio::test]
    async fn faults_answer_errors_delay_or_drop_after_recording() {
        let dir = tempfile::tempdir().expect("dir");
        let ledger = Served::start(&dir.path().join("f.jsonl"), Mode::Plain).await;
        ledger
            .fault(serde_json::json!({"status": 429, "times": 2}))
            .await;
        for _ in 0..2 {
            assert_eq!(
                ledger
                    .post(Some("a"), serde_json::json!({}))
                    .await
                    .expect("post")
                    .0,
                429
            );
        }
        assert_eq!(
            ledger
                .post(Some("a"), serde_json::json!({}))
                .await
                .expect("post")
                .0,
            200
        );
        assert_eq!(
            ledger.snapshot().await.effects("a"),
            1,
            "429s record nothing"
        );

        ledger
            .fault(serde_json::json!({"drop_after_commit": true}))
            .await;
        let dropped = ledger.post(Some("b"), serde_json::json!({})).await;
        let error = dropped.expect_err("the connection is dropped");
        assert!(!error.is_connect(), "the request was sent: {error:?}");
        assert_eq!(
            ledger.snapshot().await.effects("b"),
            1,
            "recorded before the drop"
        );

        ledger.fault(serde_json::json!({"delay_ms": 300})).await;
        let started = std::time::Instant::now();
        assert_eq!(
            ledger
                .post(Some("c"), serde_json::json!({}))
                .await
                .expect("post")
                .0,
            200
        );
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert_eq!(
            ledger
                .post(Some("d"), serde_json::json!({}))
                .await
                .expect("post")
                .0,
            200
        );
    }

    #[tokio::test]
    async fn the_http_handler_reads_a_drop_after_commit_as_unknown_and_a_429_as_retryable() {
        use sortie_executor::{Call, StepHandler as _};
        use sortie_wire::records::SideEffectClass;

        let dir = tempfile::tempdir().expect("dir");
        let ledger = Served::start(&dir.path().join("h.jsonl"), Mode::Keyed).await;
        let http = sortie_executor::handlers::Http::new(sortie_executor::handlers::http_client());
        let call = Call {
            operation_id: "op-h".into(),
            attempt: 1,
            tenant: "t".into(),
            run_id: "r".into(),
            step_id: "pay#1".into(),
            node: "pay".into(),
            tool: "http".into(),
            side_effect: SideEffectClass::Keyed,
            args: serde_json::json!({"amount": 1}),
            config: serde_json::json!({"url": format!("{}/effects/pay", ledger.url)}),
            timeout: Duration::from_secs(2),
            progress: Default::default(),
        };
        ledger.fault(serde_json::json!({"status": 429})).await;
        ledger
            .fault(serde_json::json!({"drop_after_commit": true}))
            .await;
        let error = http.call(&call).await.expect_err("429");
        assert!(error.is_retryable());
        assert_eq!(error.retry_after(), Some(Duration::from_secs(1)));
        let error = http.call(&call).await.expect_err("dropped");
        assert!(error.is_unknown(), "{error:?}");
        assert_eq!(error.code(), "connection_lost");
        let answer = http
            .call(&call)
            .await
            .expect("the repeat gets the stored answer");
        let snapshot = ledger.snapshot().await;
        assert_eq!((snapshot.effects("op-h"), snapshot.calls("op-h")), (1, 2));
        assert_eq!(answer, snapshot.calls[0].answer);
    }

    #[test]
    fn modes_parse() {
        assert_eq!("keyed".parse::<Mode>(), Ok(Mode::Keyed));
        assert!("fuzzy".parse::<Mode>().is_err());
    }
}
