//! Outside clients written with confluent-kafka (Python): a service publishes StartRun,
//! ResumeRun and SignalRun through the Avro serializer and the schema registry, and a
//! dashboard consumer prints the live run events — against the real stack (broker,
//! registry, reducer).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use sortie_core::{EventBody, RunStatus};
use sortie_tests::stack::{check_history, succeed, Stack};

const LONG: Duration = Duration::from_secs(60);

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

/// The onboarding story: an order, then a wait until the logistics service says the laptop
/// was delivered (a tracking number), then the welcome with that number.
const ONBOARDING: &str = r#"
id: onboarding
version: 1
nodes:
  - {id: order, tool: echo, side_effect: pure, args: {hire: $input.hire}}
  - id: delivered
    wait:
      signal: laptop_delivered
      roles: [logistics]
      timeout: 72h
      schema: {type: object, required: [tracking], properties: {tracking: {type: string}}}
  - id: welcome
    tool: echo
    side_effect: pure
    args: {hire: $input.hire, tracking: $steps.delivered.output.payload.tracking}
edges:
  - {from: order, to: delivered}
  - {from: delivered, to: welcome}
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

/// [`run_python`] off the async runtime's threads.
async fn python_says(python: &str, args: Vec<String>) -> (bool, Vec<Value>, String) {
    let python = python.to_owned();
    tokio::task::spawn_blocking(move || run_python(&python, &args))
        .await
        .expect("join")
}

/// `sortie keys new` as an operator runs it: the secret at `<dir>/<id>.key` for
/// `principal` in tenant `acme` with `roles`, its entry added to `keyring`.
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

/// The reducer's answer (CommandAccepted or CommandRejected) to command `command_id`.
async fn answer(stack: &Stack, run: &str, command_id: &str) -> EventBody {
    sortie_tests::wait_for(
        &format!("the answer to {command_id}"),
        Duration::from_secs(60),
        || async {
            stack.events().await.get(run).and_then(|history| {
                history.iter().find_map(|e| match &e.body {
                    EventBody::CommandAccepted { command_id: id, .. }
                    | EventBody::CommandRejected { command_id: id, .. }
                        if id == command_id =>
                    {
                        Some(e.body.clone())
                    }
                    _ => None,
                })
            })
        },
    )
    .await
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
    let made = stack.dir.join("made-keys.yaml");
    let secret = new_key(
        &stack.dir,
        &made,
        "py-1",
        "svc:python-example",
        &["approver"],
    );
    // The harness's graphs are signed by its publisher key: the keyring lists it too.
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

/// Issue 53 item 1 from the outside (the onboarding story): a Python shop service starts a
/// run that waits for `laptop_delivered`, and the logistics service — its own key, made by
/// `sortie keys new` with the `logistics` role, for a reducer that requires signatures —
/// tells the run with `publish_commands.py signal`. A payload the wait's schema refuses
/// (`tracking` a number) is answered `invalid_payload` and changes nothing; the good one
/// is accepted and taken (`SignalReceived`), and the welcome after the wait gets the
/// tracking number. A Python dashboard reads the new events too. Seen red: with the
/// good signal sent as `laptop_shipped` (a name the graph does not wait for), its answer
/// was `CommandRejected unknown_signal` and the test failed at the accepted check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_logistics_service_signals_a_waiting_run() {
    let python = tokio::task::spawn_blocking(sortie_tests::python_venv)
        .await
        .expect("join")
        .expect("venv");
    let stack = Stack::start("outside-signal", &[ONBOARDING]).await;
    let made = stack.dir.join("made-keys.yaml");
    let shop = new_key(&stack.dir, &made, "shop-1", "svc:shop", &[]);
    let logistics = new_key(
        &stack.dir,
        &made,
        "logistics-1",
        "svc:logistics",
        &["logistics"],
    );
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
    let _executor = stack.executor("default", succeed);
    let publish = |key: &Path, principal: &str, extra: &[&str]| -> Vec<String> {
        let mut args = vec![script("publish_commands.py")];
        for arg in [
            "--bootstrap",
            &stack.bootstrap,
            "--registry",
            &stack.registry.url,
            "--prefix",
            &stack.prefix,
            "--tenant",
            "acme",
            "--signing-key",
            key.to_str().expect("path"),
            "--principal",
            principal,
        ] {
            args.push(arg.to_owned());
        }
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        args
    };
    let run = "hire-ada".to_owned();

    let start = publish(
        &shop,
        "svc:shop",
        &[
            "start",
            "--run-id",
            &run,
            "--graph",
            "onboarding",
            "--input",
            r#"{"hire": "ada"}"#,
        ],
    );
    let (ok, _, err) = python_says(&python, start).await;
    assert!(ok, "start failed: {err}");
    stack
        .wait_for_states(
            "ada waits for her laptop",
            std::slice::from_ref(&run),
            LONG,
            |s| s.status == RunStatus::WaitingSignal,
        )
        .await;

    let signal = |command_id: &str, name: &str, payload: &str| {
        publish(
            &logistics,
            "svc:logistics",
            &[
                "--role",
                "logistics",
                "--command-id",
                command_id,
                "signal",
                "--run-id",
                &run,
                "--name",
                name,
                "--payload",
                payload,
                "--signal-id",
                "dlv-1Z999",
            ],
        )
    };
    let (ok, out, err) = python_says(
        &python,
        signal("sig-bad", "laptop_delivered", r#"{"tracking": 1999}"#),
    )
    .await;
    assert!(ok, "signal failed: {err}");
    assert_eq!(out[0]["command_id"], "sig-bad");
    match answer(&stack, &run, "sig-bad").await {
        EventBody::CommandRejected { code, command, .. } => {
            assert_eq!(
                (code.as_str(), command.as_str()),
                ("invalid_payload", "SignalRun")
            );
        }
        other => panic!("the bad payload: {other:?}"),
    }
    let (ok, _, err) = python_says(
        &python,
        signal("sig-good", "laptop_delivered", r#"{"tracking": "1Z999"}"#),
    )
    .await;
    assert!(ok, "signal failed: {err}");
    match answer(&stack, &run, "sig-good").await {
        EventBody::CommandAccepted { duplicate, .. } => assert!(!duplicate),
        other => panic!("the good signal: {other:?}"),
    }

    let states = stack
        .wait_for_states("ada is welcomed", std::slice::from_ref(&run), LONG, |s| {
            s.status == RunStatus::Succeeded
        })
        .await;
    let state = &states[&run];
    let welcome = state
        .steps
        .values()
        .find(|s| s.node == "welcome")
        .expect("the welcome step");
    assert_eq!(welcome.args, json!({"hire": "ada", "tracking": "1Z999"}));
    let wait = state.waits.values().next().expect("the wait");
    assert_eq!(wait.received.len(), 1, "taken once: {:?}", wait.received);
    assert_eq!(wait.received[0].signal_id, "dlv-1Z999");
    assert_eq!(wait.received[0].sent_by, "svc:logistics");
    let events = stack.events().await;
    check_history(&run, &events[&run], state);

    // The dashboard, a Python consumer, reads the signal's events like any other.
    let mut watch = vec![script("dashboard.py")];
    for arg in [
        "--bootstrap",
        &stack.bootstrap,
        "--registry",
        &stack.registry.url,
        "--prefix",
        &stack.prefix,
        "--run",
        &run,
        "--until",
        "SUCCEEDED",
        "--timeout",
        "60",
    ] {
        watch.push(arg.to_owned());
    }
    let (ok, events, err) = python_says(&python, watch).await;
    assert!(ok, "dashboard did not see the run succeed: {err}");
    let refused = events
        .iter()
        .find(|e| e["event"] == "CommandRejected")
        .expect("the refusal is in the history");
    assert_eq!(
        (&refused["command_id"], &refused["code"]),
        (&json!("sig-bad"), &json!("invalid_payload"))
    );
    let received = events
        .iter()
        .find(|e| e["event"] == "SignalReceived")
        .expect("a SignalReceived event");
    assert_eq!(received["signal"], "laptop_delivered");
    let payload: Value =
        serde_json::from_str(received["payload"].as_str().expect("JSON text")).expect("JSON");
    assert_eq!(payload, json!({"tracking": "1Z999"}));
}
