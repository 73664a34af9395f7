//! The Python package for outside services (`clients/python`, `sortie_client`) against the
//! real stack: its `Executor` serves the refund story's `refund` step and is killed in the
//! middle of the call, and its `Client` and `Follower` drive and read runs of a reducer
//! that requires signed commands.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use sortie_core::RunStatus;
use sortie_tests::stack::{LedgerProcess, Process, Stack};

const LONG: Duration = Duration::from_secs(90);

/// The refund story, its `refund` step a Python function on queue `py` (a Rust executor
/// serves the `echo` step after it, on `default`).
fn refund_graph(class: &str, ledger: &str) -> String {
    format!(
        r#"
id: refund_py
version: 1
nodes:
  - id: refund
    tool: refund
    queue: py
    side_effect: {class}
    args: {{order_id: $input.order_id, amount: $input.amount}}
    config: {{url: "{ledger}/effects/refund"}}
    timeout: 5s
    retry: {{max_attempts: 5, initial_backoff: 1s, max_backoff: 2s, multiplier: 2.0, jitter: 0.0}}
  - id: notify
    tool: echo
    side_effect: pure
    args: {{refund_id: $steps.refund.output.refund_id}}
edges:
  - {{from: refund, to: notify}}
"#
    )
}

fn script(name: &str) -> PathBuf {
    sortie_tests::workspace_root()
        .join("tests/python")
        .join(name)
}

async fn python() -> String {
    tokio::task::spawn_blocking(sortie_tests::python_venv)
        .await
        .expect("join")
        .expect("the client venv")
}

/// A Python process whose output is appended to a log file; killed (SIGKILL) when dropped.
struct PyProcess {
    child: Child,
    log: PathBuf,
}

impl PyProcess {
    fn spawn(python: &str, log: &Path, args: &[String]) -> PyProcess {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .expect("log file");
        let child = Command::new(python)
            .args(args)
            .env("PYTHONUNBUFFERED", "1")
            .stdout(Stdio::from(file.try_clone().expect("log")))
            .stderr(Stdio::from(file))
            .spawn()
            .expect("python starts");
        PyProcess {
            child,
            log: log.to_owned(),
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PyProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The story's stack: the `py` queue's topic (the topology declares default, http and
/// llm only), a ledger in `mode`, the graph, a reducer and a Rust executor for `default`.
struct Story {
    stack: Stack,
    ledger: LedgerProcess,
    python: String,
    _reducer: Process,
    _rust_executor: Process,
}

impl Story {
    async fn start(name: &str, class: &str, mode: &str) -> Story {
        Story::start_graph(name, mode, |ledger| refund_graph(class, ledger)).await
    }

    /// [`Story::start`] with the graph `graph(ledger_url)`.
    async fn start_graph(name: &str, mode: &str, graph: impl Fn(&str) -> String) -> Story {
        let python = python().await;
        let stack = Stack::start(name, &[]).await;
        sortie_tests::create_topic(&stack.bootstrap, &stack.topics.intents("py"), 3, &[]).await;
        let ledger = stack.ledger_process("ledger", mode).await;
        stack.publish(&graph(&ledger.url)).await;
        let reducer = stack.reducer("0");
        let rust_executor = stack.executor_process("rust-executor", &["default"], &[]);
        Story {
            stack,
            ledger,
            python,
            _reducer: reducer,
            _rust_executor: rust_executor,
        }
    }

    /// The Python executor `py-1` for queue `py` (static membership, so a restart takes
    /// the partitions back at once), optionally hanging after the ledger answered.
    fn executor(&self, hang: bool) -> PyProcess {
        self.executor_with(hang, "refund")
    }

    /// [`Story::executor`], its log named for `what` it serves.
    fn executor_with(&self, hang: bool, what: &str) -> PyProcess {
        let s = &self.stack;
        let mut args = vec![script("refund_executor.py").display().to_string()];
        if hang {
            args.push("--hang-after-send".into());
        }
        for arg in [
            "--bootstrap-servers",
            &s.bootstrap,
            "--registry-url",
            &s.registry.url,
            "--prefix",
            &s.prefix,
            "--queue",
            "py",
            "--executor-id",
            "py-1",
            "--static-membership",
            "--commit-interval-ms",
            "50",
            "--session-timeout-ms",
            "6000",
            "--drain-timeout-ms",
            "3000",
            "--health-addr",
            "127.0.0.1:0",
        ] {
            args.push(arg.to_owned());
        }
        PyProcess::spawn(&self.python, &s.dir.join(format!("py-{what}.log")), &args)
    }

    async fn start_run(&self, run: &str) {
        self.stack
            .send(&sortie_tests::stack::start_run(
                run,
                "refund_py",
                r#"{"order_id": "ord-1001", "amount": 42}"#,
            ))
            .await;
    }

    /// Starts a run with an executor that hangs after the ledger answered, waits for the
    /// call to reach the ledger, kills the executor there and starts it again (no hang).
    /// Returns the new executor and the refund's operation id.
    async fn kill_mid_call(&self, run: &str) -> (PyProcess, String) {
        let mut hanging = self.executor(true);
        self.start_run(run).await;
        let op = sortie_tests::wait_for("the refund to be dispatched", LONG, || async {
            let states = self.stack.states().await;
            states
                .get(run)
                .and_then(|s| s.steps.get("refund#1"))
                .map(|s| s.operation_id.clone())
        })
        .await;
        sortie_tests::wait_until("the refund to reach the ledger", LONG, || async {
            !self.ledger.snapshot().await.calls.is_empty()
        })
        .await;
        sortie_tests::wait_until("the executor to hang after sending", LONG, || {
            let said = hanging.log_text().contains("refund sent");
            async move { said }
        })
        .await;
        hanging.kill();
        drop(hanging);
        (self.executor(false), op)
    }
}

/// The refund story as it ships (`keyed`: the receiver dedupes on the operation id), its
/// refund served by the Python executor, killed after the ledger took the refund and before
/// the result was reported. The intent's offset was not committed (a keyed intent commits
/// after its result), so the restarted executor runs it again with the same operation id
/// as the Idempotency-Key: the ledger absorbs the repeat, and the run succeeds with one
/// refund. Also checks the executor's `/healthz` and `/readyz`.
///
/// Seen red: with the handler sending a fresh key instead of `call.operation_id`, the
/// ledger recorded two refunds (`effects` 2) and the test failed at the ledger check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_executor_killed_mid_refund_refunds_once_keyed() {
    let story = Story::start("py-refund-keyed", "keyed", "keyed").await;
    let run = "run-refund-keyed";
    let (executor, op) = story.kill_mid_call(run).await;

    let states = story
        .stack
        .wait_for_states("the refund run to succeed", &[run.to_owned()], LONG, |s| {
            s.status == RunStatus::Succeeded
        })
        .await;
    let ledger = story.ledger.snapshot().await;
    assert_eq!(
        (ledger.total_effects(), ledger.effects(&op)),
        (1, 1),
        "one refund: {ledger:#?}"
    );
    assert!(
        ledger.calls(&op) >= 2,
        "the repeat reached the ledger: {ledger:#?}"
    );
    let state = &states[run];
    let refund = &state.steps["refund#1"];
    let receipt = ledger.calls.iter().find(|c| c.effect).expect("the refund");
    assert_eq!(
        refund.output.as_ref().map(|o| o["refund_id"].clone()),
        Some(Value::from(format!("rf-{}", receipt.answer["ledger_seq"]))),
        "the output is the first call's receipt"
    );
    assert_eq!(
        state.steps["notify#1"].args["refund_id"],
        refund.output.as_ref().expect("output")["refund_id"]
    );

    // Health: alive, and ready once it consumes.
    let url = sortie_tests::wait_for("the health address", LONG, || {
        let text = executor.log_text();
        async move {
            text.lines()
                .rev()
                .find_map(|l| l.strip_prefix("health listening on "))
                .map(|u| u.trim().to_owned())
        }
    })
    .await;
    let healthz = reqwest::get(format!("{url}/healthz"))
        .await
        .expect("healthz");
    assert_eq!(healthz.status(), 200);
    sortie_tests::wait_until("the executor to be ready", LONG, || async {
        reqwest::get(format!("{url}/readyz"))
            .await
            .map(|r| r.status() == 200)
            .unwrap_or(false)
    })
    .await;
}

/// The same refund declared `unsafe` against a receiver that takes every call (a plain
/// ledger): the Python executor reports STARTED and commits the intent's offset *before*
/// calling, so when it is killed after the call, its restart does not get the intent
/// again. The ledger shows exactly one refund, the attempt is never repeated, and the run
/// waits for an operator (`needs_reconciliation`), as the class dictates.
///
/// Seen red: with the executor treating `unsafe` like `keyed` (result, then commit; no
/// pre-call commit), the restarted executor got the intent again and called a second
/// time: the ledger recorded two refunds (and the run even succeeded), and the test
/// failed at the ledger check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_executor_killed_mid_refund_never_repeats_an_unsafe_call() {
    let story = Story::start("py-refund-unsafe", "unsafe", "plain").await;
    let run = "run-refund-unsafe";
    let (executor, op) = story.kill_mid_call(run).await;

    let states = story
        .stack
        .wait_for_states("the run to stop running", &[run.to_owned()], LONG, |s| {
            matches!(
                s.status,
                RunStatus::NeedsReconciliation | RunStatus::Succeeded | RunStatus::Failed
            )
        })
        .await;
    // Long enough for a redelivered intent to have been called again.
    sortie_tests::wait_until("the restarted executor to join", LONG, || {
        // Both processes log to one file: the second assignment is the restart's.
        let joined = executor.log_text().matches("Partitions assigned").count() >= 2;
        async move { joined }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let ledger = story.ledger.snapshot().await;
    assert_eq!(
        (
            ledger.total_effects(),
            ledger.calls.len(),
            ledger.effects(&op)
        ),
        (1, 1, 1),
        "one refund, one call: {ledger:#?}"
    );
    let state = &states[run];
    assert_eq!(
        state.status,
        RunStatus::NeedsReconciliation,
        "an unsafe call's unknown outcome waits for an operator"
    );
    assert_eq!(state.steps["refund#1"].attempt, 1, "never re-dispatched");
}

/// `sortie keys new` as an operator runs it (tenant `acme`).
fn new_key(dir: &Path, keyring: &Path, id: &str, principal: &str, roles: &[&str]) -> PathBuf {
    let secret = dir.join(format!("{id}.key"));
    let made = Command::new(sortie_tests::stack::sortie_bin())
        .args(["keys", "new", "--id", id, "--principal", principal])
        .args(["--tenant", "acme", "--secret"])
        .arg(&secret)
        .arg("--keyring")
        .arg(keyring)
        .args(roles.iter().flat_map(|r| ["--role", r]))
        .output()
        .expect("sortie keys new");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    secret
}

const CLIENT_GRAPH: &str = r#"
id: py_client
version: 1
nodes:
  - {id: greet, tool: echo, side_effect: pure, args: {name: $input.name}}
  - id: delivered
    wait:
      signal: laptop_delivered
      timeout: 1h
      schema: {type: object, required: [tracking], properties: {tracking: {type: string}}}
  - id: finish
    tool: echo
    side_effect: keyed
    args: {name: $input.name, tracking: $steps.delivered.output.payload.tracking}
    interrupt_before: {reason: ship it?, required_role: approver, timeout: 1h}
edges:
  - {from: greet, to: delivered}
  - {from: delivered, to: finish}
"#;

/// A Python service (`tests/python/client_story.py`) with the package's `Client`, signing
/// with a key from `sortie keys new`, against a reducer that requires signatures: each
/// command's answer is read back by the client itself (it positions its reader at the end
/// of the run's event partition before producing). A start, the same start again
/// (accepted as a duplicate), a signal, an approval naming a wrong proposal (rejected), the
/// right one, a cancel, and an unsigned start (rejected `unauthenticated`); its `Follower`
/// reads the runs' histories, chain checked, one run's and the whole tenant's. The run
/// ids land on the partitions the Rust partitioner gives them.
///
/// Seen red: with the client's signature headers left out, the first start was answered
/// `unauthenticated` and the test failed at the first answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_client_starts_signals_approves_and_cancels_runs() {
    let python = python().await;
    let stack = Stack::start("py-client", &[CLIENT_GRAPH]).await;
    let made = stack.dir.join("made-keys.yaml");
    let key = new_key(&stack.dir, &made, "shop-1", "svc:shop", &["approver"]);
    let entries =
        sortie_wire::signing::keyring_entries(&std::fs::read_to_string(&made).expect("keyring"))
            .expect("keyring entries");
    let keyring = stack.write_keyring(&entries);
    let _reducer = stack.reducer_with(
        "0",
        &[
            "--keyring",
            keyring.to_str().expect("path"),
            "--require-signatures",
        ],
    );
    let _executor = stack.executor_process("rust-executor", &["default"], &[]);
    let args: Vec<String> = vec![
        script("client_story.py").display().to_string(),
        "--bootstrap".into(),
        stack.bootstrap.clone(),
        "--registry".into(),
        stack.registry.url.clone(),
        "--prefix".into(),
        stack.prefix.clone(),
        "--key".into(),
        key.display().to_string(),
    ];
    let output = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .args(&args)
            .output()
            .expect("python runs")
    })
    .await
    .expect("join");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let step = |name: &str| -> Value {
        lines
            .iter()
            .find(|l| l["step"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no {name:?} line in {lines:#?}\n{stderr}"))
    };
    let partition = |run: &[u8]| sortie_wire::partition_for(run, stack.partitions);

    let start = step("start");
    assert_eq!(
        (&start["accepted"], &start["duplicate"]),
        (&Value::Bool(true), &Value::Bool(false)),
        "{start}"
    );
    assert_eq!(start["partition"], partition(b"run-a"), "murmur2");
    assert!(output.status.success(), "client_story.py failed:\n{stderr}");
    let again = step("start again");
    assert_eq!(
        (
            &again["accepted"],
            &again["duplicate"],
            &again["command_id"]
        ),
        (&Value::Bool(true), &Value::Bool(true), &start["command_id"]),
        "{again}"
    );
    assert_eq!(step("signal")["accepted"], true);
    let wrong = step("wrong proposal");
    assert_eq!(wrong["accepted"], false, "{wrong}");
    assert!(wrong["code"].is_string(), "{wrong}");
    assert_eq!(step("approve")["accepted"], true);
    let history = step("run-a history");
    let kinds: Vec<&str> = history["kinds"]
        .as_array()
        .expect("kinds")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for kind in [
        "RunStarted",
        "SignalReceived",
        "Interrupted",
        "InterruptDecided",
    ] {
        assert!(kinds.contains(&kind), "{kind} in {kinds:?}");
    }
    let seqs = history["seqs"].as_array().expect("seqs").len() as i64;
    assert_eq!(
        history["seqs"],
        Value::from((1..=seqs).collect::<Vec<_>>()),
        "in order, gap-free"
    );
    assert_eq!(step("start b")["accepted"], true);
    assert_eq!(step("cancel b")["accepted"], true);
    let unsigned = step("unsigned start");
    assert_eq!(
        (&unsigned["accepted"], &unsigned["code"]),
        (&Value::Bool(false), &Value::from("unauthenticated")),
        "{unsigned}"
    );
    assert_eq!(unsigned["partition"], partition(b"run-c"));
    let tenant = step("tenant");
    for run in ["run-a", "run-b"] {
        assert!(tenant["runs"][run].is_array(), "{run} in {tenant}");
    }

    let states = stack.states().await;
    assert_eq!(states["run-a"].status, RunStatus::Succeeded);
    assert_eq!(
        states["run-a"].steps["finish#1"].args["tracking"],
        Value::from("1Z999")
    );
    assert_eq!(states["run-b"].status, RunStatus::Cancelled);
    assert!(
        !states.contains_key("run-c"),
        "the unsigned start started nothing"
    );
}

/// The package's logic that needs no broker (`clients/python/tests`): murmur2 against the
/// Java client's vectors, the offset tracker, the reconcilable lookup rules of
/// `dispatch.rs`, the refusal of sealed and blob arguments, the chain's links, key and
/// properties files.
#[test]
fn the_packages_unit_tests_pass() {
    let python = sortie_tests::python_venv().expect("the venv");
    let root = sortie_tests::workspace_root();
    let output = Command::new(&python)
        .args(["-m", "unittest", "discover", "-s"])
        .arg(root.join("clients/python/tests"))
        .output()
        .expect("python runs");
    assert!(
        output.status.success(),
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The package ships copies of the schemas it writes and reads; they are the repository's.
#[test]
fn the_package_ships_the_current_schemas() {
    let root = sortie_tests::workspace_root();
    let shipped = root.join("clients/python/src/sortie_client/schemas");
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&shipped).expect("the package's schemas") {
        let path = entry.expect("entry").path();
        let name = path.file_name().expect("name").to_owned();
        let current = std::fs::read_to_string(root.join("schemas").join(&name))
            .unwrap_or_else(|e| panic!("schemas/{name:?}: {e}"));
        assert_eq!(
            std::fs::read_to_string(&path).expect("shipped schema"),
            current,
            "{} differs from schemas/: copy it again",
            path.display()
        );
        names.push(name);
    }
    assert_eq!(names.len(), 4, "{names:?}");
}

/// One conformance suite, two executors: the same graph (an `http` step on queue `py`
/// against the ledger, then an `echo`), the same scenarios and the same expectations, run
/// once with `sortie executor --queue py` (Rust, its built-in `http` handler) and once
/// with the Python package's `Executor` (`tests/python/refund_executor.py`, whose `http`
/// tool follows the built-in handler's contract). A crash is the Rust executor's
/// `--fault executor.after_call` and the Python one killed while it hangs after the
/// ledger answered: both after the receiver acted, before the result.
///
/// Seen red: with the Python executor's lookup skipped (a reconcilable attempt calls
/// without asking), the reconcilable case passed for Rust and failed for Python with two
/// calls in the ledger.
mod conformance {
    use super::*;
    use sortie_core::RunState;
    use sortie_devkit::ledger::Snapshot;

    #[derive(Debug, Clone, Copy)]
    pub(super) enum Impl {
        Rust,
        Python,
    }

    enum Running {
        Rust(Process),
        Python(PyProcess),
    }

    fn graph(class: &str, ledger: &str) -> String {
        format!(
            r#"
id: conformance
version: 1
nodes:
  - id: pay
    tool: http
    queue: py
    side_effect: {class}
    args: {{amount: $input.amount}}
    config: {{url: "{ledger}/effects/pay", status_url: "{ledger}/status"}}
    timeout: 4s
    retry: {{max_attempts: 4, initial_backoff: 1s, max_backoff: 2s, multiplier: 2.0, jitter: 0.0}}
  - {{id: receipt, tool: echo, side_effect: pure, args: {{seq: $steps.pay.output.ledger_seq}}}}
edges:
  - {{from: pay, to: receipt}}
"#
        )
    }

    pub(super) struct Case {
        pub class: &'static str,
        pub mode: &'static str,
        /// Crash the executor after the call, then start it again.
        pub crash: bool,
        /// A ledger fault armed before the run starts.
        pub fault: Option<Value>,
        /// Start the executor only once the run has given up on the step (its timeout
        /// passed with no executor): the intent reaches it late.
        pub late: bool,
    }

    /// The run's state once it stopped running, the ledger a moment later, and the
    /// `pay` step's operation id.
    pub(super) async fn run(imp: Impl, case: Case) -> (RunState, Snapshot, String) {
        let name = format!("py-conf-{}-{imp:?}", case.class).to_lowercase();
        let story = Story::start_graph(&name, case.mode, |ledger| graph(case.class, ledger)).await;
        if let Some(fault) = case.fault.clone() {
            story.ledger.fault(fault).await;
        }
        let start = |crash: bool| match imp {
            Impl::Rust => {
                let mut extra = vec!["--static-membership"];
                if crash {
                    extra.extend(["--fault", "executor.after_call"]);
                }
                Running::Rust(story.stack.executor_process("py-1", &["py"], &extra))
            }
            Impl::Python => Running::Python(story.executor_with(crash, "http")),
        };
        let mut executor = (!case.late).then(|| start(case.crash));
        let run = "run-conformance";
        story
            .stack
            .send(&sortie_tests::stack::start_run(
                run,
                "conformance",
                r#"{"amount": 42}"#,
            ))
            .await;
        if case.late {
            story
                .stack
                .wait_for_states("the step to time out", &[run.to_owned()], LONG, |s| {
                    s.status == RunStatus::NeedsReconciliation
                })
                .await;
            executor = Some(start(false));
            // It reports the attempt without a call, or calls it: the ledger tells which.
            sortie_tests::wait_until("the executor to take the late attempt", LONG, || async {
                let skipped = story.stack.results().await.iter().any(|r| {
                    r.run_id == run
                        && r.error
                            .as_ref()
                            .is_some_and(|e| e.code == "deadline_passed")
                });
                skipped || !story.ledger.snapshot().await.calls.is_empty()
            })
            .await;
        }
        if case.crash {
            sortie_tests::wait_until("the call to reach the ledger", LONG, || async {
                !story.ledger.snapshot().await.calls.is_empty()
            })
            .await;
            match executor.as_mut().expect("started before the run") {
                Running::Rust(process) => {
                    sortie_tests::wait_until("the executor to die after the call", LONG, || {
                        let exited = process.try_exit().is_some();
                        async move { exited }
                    })
                    .await;
                }
                Running::Python(process) => {
                    sortie_tests::wait_until("the executor to hang after the call", LONG, || {
                        let said = process.log_text().contains("refund sent");
                        async move { said }
                    })
                    .await;
                    process.kill();
                }
            }
            drop(executor);
            executor = Some(start(false));
        }
        let states = story
            .stack
            .wait_for_states("the run to stop running", &[run.to_owned()], LONG, |s| {
                matches!(s.status, RunStatus::Succeeded | RunStatus::Failed)
                    || (s.status == RunStatus::NeedsReconciliation && !case.late)
            })
            .await;
        // Time for a repeated call, if there were one, to reach the ledger.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let ledger = story.ledger.snapshot().await;
        drop(executor);
        let state = states[run].clone();
        let op = state.steps["pay#1"].operation_id.clone();
        (state, ledger, op)
    }

    /// Runs `case` against both executors at once and checks `expect` on each.
    pub(super) async fn both(
        case: impl Fn() -> Case,
        expect: impl Fn(Impl, &RunState, &Snapshot, &str),
    ) {
        let (rust, python) = tokio::join!(run(Impl::Rust, case()), run(Impl::Python, case()));
        for (imp, (state, ledger, op)) in [(Impl::Rust, rust), (Impl::Python, python)] {
            expect(imp, &state, &ledger, &op);
        }
    }
}

use conformance::{both, Case};

/// Conformance, `keyed` crashed after the call: redelivered, the receiver absorbs the
/// repeat, one effect, the run succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_keyed_crash_after_the_call_takes_effect_once() {
    both(
        || Case {
            class: "keyed",
            mode: "keyed",
            crash: true,
            fault: None,
            late: false,
        },
        |imp, state, ledger, op| {
            assert_eq!(state.status, RunStatus::Succeeded, "{imp:?}");
            assert_eq!(
                (ledger.total_effects(), ledger.effects(op)),
                (1, 1),
                "{imp:?}: {ledger:#?}"
            );
        },
    )
    .await;
}

/// Conformance, `unsafe` crashed after the call: committed before the call, so never
/// called again; the run waits for an operator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_unsafe_crash_after_the_call_is_never_repeated() {
    both(
        || Case {
            class: "unsafe",
            mode: "plain",
            crash: true,
            fault: None,
            late: false,
        },
        |imp, state, ledger, _| {
            assert_eq!(state.status, RunStatus::NeedsReconciliation, "{imp:?}");
            assert_eq!(state.steps["pay#1"].attempt, 1, "{imp:?}");
            assert_eq!(ledger.calls.len(), 1, "{imp:?}: {ledger:#?}");
        },
    )
    .await;
}

/// Conformance, `reconcilable` crashed after the call: the step times out, attempt 2
/// asks the receiver first, finds the effect and reports it without calling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_reconcilable_crash_after_the_call_asks_and_does_not_call_again() {
    both(
        || Case {
            class: "reconcilable",
            mode: "reconcilable",
            crash: true,
            fault: None,
            late: false,
        },
        |imp, state, ledger, _| {
            assert_eq!(state.status, RunStatus::Succeeded, "{imp:?}");
            assert_eq!(state.steps["pay#1"].attempt, 2, "{imp:?}");
            assert_eq!(ledger.calls.len(), 1, "{imp:?}: {ledger:#?}");
            assert_eq!(
                state.steps["receipt#1"].args["seq"], ledger.calls[0].answer["ledger_seq"],
                "{imp:?}: the looked-up output"
            );
        },
    )
    .await;
}

/// Conformance, a 503 from the receiver: retryable, attempt 2 succeeds, one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_a_retryable_failure_is_tried_again() {
    both(
        || Case {
            class: "keyed",
            mode: "keyed",
            crash: false,
            fault: Some(serde_json::json!({"status": 503, "times": 1})),
            late: false,
        },
        |imp, state, ledger, _| {
            assert_eq!(state.status, RunStatus::Succeeded, "{imp:?}");
            assert_eq!(state.steps["pay#1"].attempt, 2, "{imp:?}");
            assert_eq!(ledger.total_effects(), 1, "{imp:?}: {ledger:#?}");
        },
    )
    .await;
}

/// Conformance, a 400 from the receiver: permanent, the step and the run fail after one
/// attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_a_permanent_failure_fails_the_run() {
    both(
        || Case {
            class: "keyed",
            mode: "keyed",
            crash: false,
            fault: Some(serde_json::json!({"status": 400, "times": 1})),
            late: false,
        },
        |imp, state, ledger, _| {
            assert_eq!(state.status, RunStatus::Failed, "{imp:?}");
            assert_eq!(state.steps["pay#1"].attempt, 1, "{imp:?}");
            assert_eq!(ledger.total_effects(), 0, "{imp:?}: {ledger:#?}");
        },
    )
    .await;
}

/// Conformance, an `unsafe` attempt that reaches an executor after the reducer gave up on
/// it (no executor until its 4 s timeout passed; the run needs reconciliation): it is
/// reported `deadline_passed` without a call, a definite outcome the reducer takes, so the
/// run goes on with attempt 2 — the only call the receiver sees — and needs no operator.
///
/// Seen red: with the deadline check skipped in the Python executor, the Python run
/// succeeded on the late attempt 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_an_unsafe_attempt_given_up_on_is_never_called_late() {
    both(
        || Case {
            class: "unsafe",
            mode: "plain",
            crash: false,
            fault: None,
            late: true,
        },
        |imp, state, ledger, op| {
            assert_eq!(state.status, RunStatus::Succeeded, "{imp:?}");
            assert_eq!(
                state.steps["pay#1"].attempt, 2,
                "{imp:?}: the late attempt 1 was not the one called"
            );
            assert_eq!(ledger.calls(op), 1, "{imp:?}: {ledger:#?}");
        },
    )
    .await;
}
