//! Outside clients written with confluent-kafka (Python): a service publishes StartRun and
//! ResumeRun through the Avro serializer and the schema registry, and a dashboard consumer
//! prints the live run events — against the real stack (broker, registry, reducer).

use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use sortie_core::RunStatus;
use sortie_tests::stack::{succeed, Stack};

const DEMO: &str = r#"
id: demo
version: 1
nodes:
  - {id: greet, tool: echo, side_effect: pure, args: {name: $input.name}}
  - id: finish
    tool: echo
    side_effect: keyed
    args: {greeting: $steps.greet.output.step}
    interrupt_before: {reason: say it out loud?, required_role: approver, timeout: 1h}
edges:
  - {from: greet, to: finish}
"#;

fn script(name: &str) -> String {
    sortie_tests::workspace_root()
        .join("examples/python")
        .join(name)
        .display()
        .to_string()
}

fn run_python(python: &str, args: &[String]) -> (bool, Vec<Value>, String) {
    let output = Command::new(python)
        .args(args)
        .output()
        .expect("python runs");
    let lines = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    (
        output.status.success(),
        lines,
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_service_starts_and_approves_a_run_and_a_python_dashboard_follows_it() {
    let python = tokio::task::spawn_blocking(sortie_tests::python_venv)
        .await
        .expect("join")
        .expect("venv");
    let stack = Stack::start("outside-python", &[DEMO]).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    let common = |extra: &[&str]| -> Vec<String> {
        let mut args = vec![
            "--bootstrap".to_owned(),
            stack.bootstrap.clone(),
            "--registry".to_owned(),
            stack.registry.url.clone(),
            "--prefix".to_owned(),
            stack.prefix.clone(),
        ];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        args
    };

    let mut start = vec![script("publish_commands.py")];
    start.extend(common(&[
        "--tenant",
        "acme",
        "start",
        "--run-id",
        "run-py",
        "--graph",
        "demo",
        "--input",
        r#"{"name": "Ada"}"#,
    ]));
    let (ok, out, err) = tokio::task::spawn_blocking({
        let p = python.clone();
        move || run_python(&p, &start)
    })
    .await
    .expect("join");
    assert!(ok, "publisher failed: {err}");
    assert_eq!(
        out[0]["partition"],
        sortie_wire::partition_for(b"run-py", sortie_tests::stack::PARTITIONS),
        "murmur2: the canonical partition"
    );

    let mut watch = vec![script("dashboard.py")];
    watch.extend(common(&[
        "--run",
        "run-py",
        "--until",
        "WAITING_APPROVAL",
        "--timeout",
        "60",
    ]));
    let (ok, events, err) = tokio::task::spawn_blocking({
        let p = python.clone();
        move || run_python(&p, &watch)
    })
    .await
    .expect("join");
    assert!(ok, "dashboard did not see the run wait for approval: {err}");
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["event"].as_str()).collect();
    assert_eq!(
        &kinds[..3],
        &["RunStarted", "CommandAccepted", "StepDispatched"],
        "{kinds:?}"
    );
    let interrupted = events
        .iter()
        .find(|e| e["event"] == "Interrupted")
        .expect("an Interrupted event");

    let mut approve = vec![script("publish_commands.py")];
    approve.extend(common(&[
        "--tenant",
        "acme",
        "--principal",
        "user:ada",
        "--role",
        "approver",
        "approve",
        "--run-id",
        "run-py",
        "--interrupt-id",
        interrupted["interrupt_id"].as_str().expect("id"),
        "--proposal-hash",
        interrupted["proposal_hash"].as_str().expect("hash"),
    ]));
    let (ok, _, err) = tokio::task::spawn_blocking({
        let p = python.clone();
        move || run_python(&p, &approve)
    })
    .await
    .expect("join");
    assert!(ok, "approval failed: {err}");

    let states = stack
        .wait_for_states(
            "the approved run to finish",
            &["run-py".to_owned()],
            Duration::from_secs(60),
            |s| s.status == RunStatus::Succeeded,
        )
        .await;
    assert_eq!(
        states["run-py"]
            .interrupts
            .values()
            .next()
            .map(|i| i.approvals.clone()),
        Some(vec!["user:ada".to_owned()])
    );

    let mut watch = vec![script("dashboard.py")];
    watch.extend(common(&[
        "--run",
        "run-py",
        "--until",
        "SUCCEEDED",
        "--timeout",
        "60",
    ]));
    let (ok, events, err) = tokio::task::spawn_blocking(move || run_python(&python, &watch))
        .await
        .expect("join");
    assert!(ok, "dashboard did not see the run succeed: {err}");
    let decided = events
        .iter()
        .find(|e| e["event"] == "InterruptDecided")
        .expect("the decision is in the history");
    assert_eq!(decided["decided_by"], "user:ada");
    let seqs: Vec<i64> = events.iter().filter_map(|e| e["seq"].as_i64()).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as i64).collect::<Vec<_>>(),
        "events arrive in order"
    );
}

/// Issue #14 item 1 from the outside: a Python service with a key made by `sortie keys
/// new` signs its commands (`--signing-key`, Ed25519 from `cryptography` on PyPI) for a
/// reducer that requires signatures; the same command unsigned is refused
/// `unauthenticated` and starts nothing. (Red when the example's headers are left out:
/// the signed start is refused too.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_service_signs_its_commands_for_a_reducer_that_requires_them() {
    let python = tokio::task::spawn_blocking(sortie_tests::python_venv)
        .await
        .expect("join")
        .expect("venv");
    let stack = Stack::start("outside-signed", &[DEMO]).await;
    let (secret, keyring) = (stack.dir.join("py.key"), stack.dir.join("keyring.yaml"));
    let made = Command::new(sortie_tests::stack::sortie_bin())
        .args([
            "keys",
            "new",
            "--id",
            "py-1",
            "--principal",
            "svc:python-example",
        ])
        .args(["--tenant", "acme", "--role", "approver", "--secret"])
        .arg(&secret)
        .arg("--keyring")
        .arg(&keyring)
        .output()
        .expect("sortie keys new");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    // The harness's graphs are signed by its publisher key.
    let mut entries =
        sortie_wire::signing::keyring_entries(&std::fs::read_to_string(&keyring).expect("keyring"))
            .expect("keyring entries");
    entries.push(sortie_tests::stack::publisher_entry());
    std::fs::write(&keyring, sortie_wire::signing::keyring_text(&entries)).expect("keyring");
    let _reducer = stack.reducer_with(
        "0",
        &[
            "--keyring",
            keyring.to_str().expect("path"),
            "--require-signatures",
        ],
    );
    let _executor = stack.executor("default", succeed);
    let publish = |extra: &[&str]| -> Vec<String> {
        let mut args = vec![
            script("publish_commands.py"),
            "--bootstrap".to_owned(),
            stack.bootstrap.clone(),
            "--registry".to_owned(),
            stack.registry.url.clone(),
            "--prefix".to_owned(),
            stack.prefix.clone(),
            "--tenant".to_owned(),
            "acme".to_owned(),
            "--role".to_owned(),
            "approver".to_owned(),
        ];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        args
    };
    let start = |run: &str, signed: bool| {
        let mut extra = vec![];
        if signed {
            extra.extend(["--signing-key", secret.to_str().expect("path")]);
        }
        extra.extend(["start", "--run-id", run, "--graph", "demo", "--input"]);
        extra.push(r#"{"name": "Grace"}"#);
        publish(&extra)
    };
    for (run, signed) in [("run-py-unsigned", false), ("run-py-signed", true)] {
        let args = start(run, signed);
        let p = python.clone();
        let (ok, _, err) = tokio::task::spawn_blocking(move || run_python(&p, &args))
            .await
            .expect("join");
        assert!(ok, "publisher failed: {err}");
    }
    let states = stack
        .wait_for_states(
            "the signed run to wait for approval",
            &["run-py-signed".to_owned()],
            Duration::from_secs(60),
            |s| s.status == RunStatus::WaitingApproval,
        )
        .await;
    let refused = sortie_tests::wait_for(
        "the unsigned start's answer",
        Duration::from_secs(60),
        || async {
            stack.events().await.get("run-py-unsigned").and_then(|h| {
                h.iter().find_map(|e| match &e.body {
                    sortie_core::EventBody::CommandRejected { code, .. } => Some(code.clone()),
                    _ => None,
                })
            })
        },
    )
    .await;
    assert_eq!(refused, "unauthenticated");
    assert!(!stack.states().await.contains_key("run-py-unsigned"));

    let interrupt = states["run-py-signed"]
        .interrupts
        .values()
        .next()
        .expect("an interrupt")
        .clone();
    let signing_key = secret.to_str().expect("path").to_owned();
    let args = publish(&[
        "--signing-key",
        &signing_key,
        "approve",
        "--run-id",
        "run-py-signed",
        "--interrupt-id",
        &interrupt.interrupt_id,
        "--proposal-hash",
        &interrupt.proposal_hash,
    ]);
    let (ok, _, err) = tokio::task::spawn_blocking(move || run_python(&python, &args))
        .await
        .expect("join");
    assert!(ok, "approval failed: {err}");
    stack
        .wait_for_states(
            "the signed approval to finish the run",
            &["run-py-signed".to_owned()],
            Duration::from_secs(60),
            |s| s.status == RunStatus::Succeeded,
        )
        .await;
}
