//! The CLI's output for people, read the way a person reads it: `sortie run watch` inside
//! a real terminal (`tmux`, whose screen `capture-pane` prints) shows a timeline with node
//! names and `succeeded`, in colour unless `NO_COLOR` is set, and `sortie audit replay`
//! draws a progress line there and erases it; the same commands into a pipe print no
//! escape sequence and no progress at all, and `--json` still prints one JSON event per
//! line, as scripts expect.
//!
//! Seen red: with `Style::for_stdout` ignoring whether stdout is a terminal (colour
//! always on), the pipe test fails ("printed escapes into a pipe"); with `watch` printing
//! JSON whatever `--json` says, the tmux test fails (no `run started` line on the screen);
//! with `progress::line` writing whether or not stderr is a terminal, the pipe test fails
//! ("progress went into a pipe").

use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use sortie_tests::stack::{sortie_bin, Process, Stack};

const GRAPH: &str = r#"
id: human
version: 1
nodes:
  - id: greet
    tool: echo
    side_effect: pure
    args: {message: $input.message}
  - id: finish
    tool: echo
    side_effect: keyed
    args: {done: true}
    interrupt_before: {reason: a person looks first, required_role: approver, timeout: 1h}
edges:
  - {from: greet, to: finish}
"#;

const TOKEN: &str = "tok-alice";
const ALICE: &str = "acme:user:alice:approver:tok-alice";
/// Same tenant, no roles: may see approvals, may not decide them.
const BOB: &str = "acme:user:bob::tok-bob";
const LONG: Duration = Duration::from_secs(90);

/// A stack (reducer, executor, gateway) and one run of [`GRAPH`] that went through its
/// approval to `succeeded`. Returns the processes (kept alive), the gateway and the run.
async fn finished_run(name: &str) -> (Stack, Vec<Process>, String, String) {
    let stack = Stack::start(name, &[GRAPH]).await;
    let reducer = stack.reducer("0");
    let executor = stack.executor_process("executor", &["default"], &[]);
    let (gateway, url) = stack
        .gateway_process(&stack.dir.join("gateway"), &[ALICE, BOB])
        .await;
    let client = reqwest::Client::new();
    let started: Value = client
        .post(format!("{url}/v1/runs"))
        .bearer_auth(TOKEN)
        .json(&json!({"graph_id": "human", "input": {"message": "hello"}}))
        .send()
        .await
        .expect("start")
        .json()
        .await
        .expect("json");
    let run_id = started["run_id"].as_str().expect("run id").to_owned();
    let run_url = format!("{url}/v1/runs/{run_id}");
    let interrupt = sortie_tests::wait_for("the approval", LONG, || {
        let request = client.get(&run_url).bearer_auth(TOKEN).send();
        async move {
            let run: Value = request.await.ok()?.json().await.ok()?;
            run["interrupt"]["interrupt_id"].as_str().map(str::to_owned)
        }
    })
    .await;
    let approved = client
        .post(format!("{run_url}/resume"))
        .bearer_auth(TOKEN)
        .json(&json!({"decision": "approve", "interrupt_id": interrupt}))
        .send()
        .await
        .expect("resume");
    assert!(approved.status().is_success(), "{approved:?}");
    sortie_tests::wait_until("the run to succeed", LONG, || {
        let request = client.get(&run_url).bearer_auth(TOKEN).send();
        async move {
            let Ok(response) = request.await else {
                return false;
            };
            let run: Value = response.json().await.unwrap_or(Value::Null);
            run["status"] == "succeeded"
        }
    })
    .await;
    (stack, vec![reducer, executor, gateway], url, run_id)
}

fn sortie(gateway: &str, args: &[&str]) -> std::process::Output {
    sortie_as(TOKEN, gateway, args)
}

fn sortie_as(token: &str, gateway: &str, args: &[&str]) -> std::process::Output {
    Command::new(sortie_bin())
        .args(["run", "--gateway", gateway, "--token", token])
        .args(args)
        .env_remove("NO_COLOR")
        .output()
        .expect("sortie runs")
}

/// A tmux server of this test's own (its socket in the test's dir), killed when dropped.
struct Tmux {
    socket: std::path::PathBuf,
}

impl Tmux {
    fn run(&self, args: &[&str]) -> String {
        let output = Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("tmux runs (dev/prerequisites.sh installs it)");
        assert!(
            output.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Runs `command` in a new 200x50 window named `name`; the shell stays open after it
    /// so its screen can be read.
    fn window(&self, name: &str, command: &str) {
        self.run(&[
            "new-session",
            "-d",
            "-s",
            name,
            "-x",
            "200",
            "-y",
            "50",
            &format!("{command}; echo '[exited]'; sleep 600"),
        ]);
    }

    /// The screen of window `name`; `escapes` keeps the colour sequences.
    fn screen(&self, name: &str, escapes: bool) -> String {
        let mut args = vec!["capture-pane", "-p", "-t", name];
        if escapes {
            args.push("-e");
        }
        self.run(&args)
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .arg("kill-server")
            .output();
        let _ = std::fs::remove_file(&self.socket);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn run_watch_in_a_terminal_shows_a_coloured_timeline() {
    let (stack, _processes, gateway, run_id) = finished_run("human-tty").await;
    let tmux = Tmux {
        socket: stack.dir.join("tmux"),
    };
    let watch = format!(
        "{} run --gateway {gateway} --token {TOKEN} watch {run_id}",
        sortie_bin().display()
    );
    tmux.window(
        "colour",
        &format!("env -u NO_COLOR TERM=xterm-256color {watch}"),
    );
    tmux.window("plain", &format!("env NO_COLOR=1 {watch}"));
    // A long operation draws a progress line while it works and erases it when done:
    // every byte the pane received is logged by `pipe-pane`; the screen keeps the result.
    let audit = format!(
        "sleep 1; RUST_LOG=warn {} {}",
        sortie_bin().display(),
        audit_args(&stack).join(" ")
    );
    tmux.window("audit", &audit);
    let pane_log = stack.dir.join("audit-pane.log");
    tmux.run(&[
        "pipe-pane",
        "-t",
        "audit",
        "-o",
        &format!("cat > {}", pane_log.display()),
    ]);
    for name in ["colour", "plain", "audit"] {
        sortie_tests::wait_until(
            &format!("sortie run watch to end in tmux window {name}"),
            LONG,
            || {
                let done = tmux.screen(name, false).contains("[exited]");
                async move { done }
            },
        )
        .await;
    }

    let screen = tmux.screen("colour", false);
    let lines: Vec<&str> = screen.lines().collect();
    let has = |node: &str, event: &str| {
        lines.iter().any(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            words.get(1) == Some(&node) && words.get(2) == Some(&event)
        })
    };
    for (node, event) in [
        ("run", "started"),
        ("greet", "dispatched"),
        ("greet", "succeeded"),
        ("finish", "waiting"),
        ("finish", "approved"),
        ("finish", "succeeded"),
        ("run", "succeeded"),
    ] {
        assert!(
            has(node, event),
            "no `{node} {event}` line on the screen:\n{screen}"
        );
    }
    assert!(
        !lines.iter().any(|l| l.starts_with('{')),
        "the timeline should not be JSON lines:\n{screen}"
    );
    let dispatched = lines
        .iter()
        .find(|l| l.contains("greet") && l.contains("dispatched"))
        .expect("dispatched line");
    assert!(dispatched.contains("attempt 1, pure, echo"), "{dispatched}");
    let approved = lines
        .iter()
        .find(|l| l.contains("approved"))
        .expect("approved line");
    assert!(approved.contains("by "), "who approved: {approved}");

    assert!(
        tmux.screen("colour", true).contains("\x1b["),
        "a terminal gets colour"
    );
    let received = std::fs::read_to_string(&pane_log).unwrap_or_default();
    assert!(
        received.contains("audit replay: reading and re-folding histories"),
        "no progress line was drawn:\n{received:?}"
    );
    let audit_screen = tmux.screen("audit", false);
    assert!(
        audit_screen.contains("every history folds to its state"),
        "{audit_screen}"
    );
    assert!(
        !audit_screen.contains("audit replay: reading"),
        "the progress line was left on the screen:\n{audit_screen}"
    );

    let plain = tmux.screen("plain", true);
    assert!(plain.contains("succeeded"), "{plain}");
    assert!(
        !plain.contains("\x1b["),
        "NO_COLOR turns colour off:\n{plain:?}"
    );
}

fn audit_args(stack: &Stack) -> Vec<String> {
    [
        "audit",
        "replay",
        "--verify",
        "--bootstrap-servers",
        &stack.bootstrap,
        "--registry-url",
        &stack.registry.url,
        "--prefix",
        &stack.prefix,
    ]
    .map(str::to_owned)
    .to_vec()
}

#[tokio::test(flavor = "multi_thread")]
async fn piped_output_has_no_escapes_and_json_still_parses() {
    let (stack, _processes, gateway, run_id) = finished_run("human-pipe").await;

    // No progress line into a pipe: stderr carries only the closing sentence.
    let audit = Command::new(sortie_bin())
        .args(audit_args(&stack))
        .env("RUST_LOG", "warn")
        .output()
        .expect("sortie audit runs");
    assert!(audit.status.success(), "{audit:?}");
    let stderr = String::from_utf8_lossy(&audit.stderr);
    assert!(
        !stderr.contains('\x1b') && !stderr.contains('\r'),
        "progress went into a pipe: {stderr:?}"
    );
    let report: Value = serde_json::from_slice(&audit.stdout).expect("the report is JSON");
    assert_eq!(report["diverged"], 0, "{report}");

    for args in [
        vec!["watch", run_id.as_str()],
        vec!["get", run_id.as_str()],
        vec!["list"],
    ] {
        let output = sortie(&gateway, &args);
        assert!(output.status.success(), "{args:?}: {output:?}");
        let text = String::from_utf8(output.stdout).expect("utf-8");
        assert!(
            !text.contains('\x1b'),
            "{args:?} printed escapes into a pipe:\n{text:?}"
        );
        assert!(text.contains("succeeded"), "{args:?}:\n{text}");
    }
    let listed = String::from_utf8(sortie(&gateway, &["list", "--status", "succeeded"]).stdout)
        .expect("utf-8");
    assert!(listed.starts_with("RUN "), "{listed}");
    assert!(listed.contains(&run_id), "{listed}");
    let none = String::from_utf8(sortie(&gateway, &["list", "--label", "team=nobody"]).stdout)
        .expect("utf-8");
    assert_eq!(none.trim(), "no runs");

    // Scripts: `--json` is the old output, one event per line, ending with SUCCEEDED.
    let output = sortie(&gateway, &["watch", &run_id, "--json"]);
    let text = String::from_utf8(output.stdout).expect("utf-8");
    let events: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    assert!(events.len() >= 8, "{text}");
    assert_eq!(
        events.last().expect("events")["body"]["RunStatusChanged"]["status"],
        "SUCCEEDED"
    );
    let run: Value = serde_json::from_slice(&sortie(&gateway, &["get", &run_id, "--json"]).stdout)
        .expect("get --json is JSON");
    assert_eq!(run["status"], "succeeded");
}

fn stdout(output: std::process::Output) -> String {
    assert!(output.status.success(), "{output:?}");
    String::from_utf8(output.stdout).expect("utf-8")
}

/// `run inbox` shows the approvals the caller may decide: alice (approver) sees the
/// waiting run, bob (no role) sees nothing unless he asks for `--all`, which says why not;
/// once decided it is gone.
///
/// Seen red: with the `may_decide` filter dropped, bob's inbox lists alice's approval.
#[tokio::test(flavor = "multi_thread")]
async fn run_inbox_lists_what_the_caller_may_decide() {
    let (_stack, _processes, gateway, _done) = finished_run("human-inbox").await;
    let client = reqwest::Client::new();
    let started: Value = client
        .post(format!("{gateway}/v1/runs"))
        .bearer_auth(TOKEN)
        .json(&json!({"graph_id": "human", "input": {"message": "again"}}))
        .send()
        .await
        .expect("start")
        .json()
        .await
        .expect("json");
    let run_id = started["run_id"].as_str().expect("run id").to_owned();
    let run_url = format!("{gateway}/v1/runs/{run_id}");
    sortie_tests::wait_until("the second run's approval", LONG, || {
        let request = client.get(&run_url).bearer_auth(TOKEN).send();
        async move {
            let Ok(response) = request.await else {
                return false;
            };
            let run: Value = response.json().await.unwrap_or(Value::Null);
            run["interrupt"]["interrupt_id"].is_string()
        }
    })
    .await;

    let alice = stdout(sortie(&gateway, &["inbox"]));
    let row = alice
        .lines()
        .find(|l| l.starts_with(&run_id))
        .unwrap_or_else(|| panic!("alice's inbox lacks {run_id}:\n{alice}"));
    assert!(
        row.contains(" finish ") && row.contains("a person looks first"),
        "{row}"
    );
    assert!(
        alice.contains(&format!(
            "sortie run approve|reject {run_id} --interrupt int_"
        )),
        "{alice}"
    );

    let bob = stdout(sortie_as("tok-bob", &gateway, &["inbox"]));
    assert_eq!(bob.trim(), "nothing waits for you");
    let bob_all = stdout(sortie_as("tok-bob", &gateway, &["inbox", "--all"]));
    let row = bob_all
        .lines()
        .find(|l| l.starts_with(&run_id))
        .unwrap_or_else(|| panic!("bob's --all lacks {run_id}:\n{bob_all}"));
    assert!(row.contains("approver"), "why not names the role: {row}");
    let json: Value = serde_json::from_str(&stdout(sortie(&gateway, &["inbox", "--json"])))
        .expect("inbox --json is JSON");
    assert_eq!(json["items"][0]["run_id"], run_id.as_str());
    assert_eq!(json["items"][0]["may_decide"], true);

    stdout(sortie(&gateway, &["approve", &run_id]));
    sortie_tests::wait_until("the approval to leave the inbox", LONG, || {
        let text = stdout(sortie(&gateway, &["inbox"]));
        async move { text.trim() == "nothing waits for you" }
    })
    .await;
}
