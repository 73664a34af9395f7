//! Issue #14, item 1: signed commands. A reducer started with `--keyring` and
//! `--require-signatures` takes a command only when an Ed25519 signature over its exact
//! value bytes, by a key of its keyring, vouches for the tenant, principal, roles and
//! groups it claims. Everything else — a raw producer's forged approval, a tampered
//! value, an unknown key, a key claiming another principal or more roles — is answered
//! `CommandRejected{code: unauthenticated}` outside the run's history and changes
//! nothing. Keys rotate by editing the keyring file, without a restart; the gateway signs
//! for the principals its bearer tokens authenticate with a delegate key.

use std::time::Duration;

use serde_json::json;
use sortie_core::{EventBody, RunState, RunStatus};
use sortie_tests::stack::{start_run, succeed, Stack};
use sortie_tests::GATED;
use sortie_wire::records as w;
use sortie_wire::signing::{KeyEntry, Signer};

const LONG: Duration = Duration::from_secs(90);

fn roles(r: &[&str]) -> Vec<String> {
    r.iter().map(|s| s.to_string()).collect()
}

/// The harness's commands are issued by `svc:test` with roles approver and operator.
fn service_entry(signer: &Signer) -> KeyEntry {
    signer.entry(
        "svc:test",
        &roles(&["acme"]),
        &roles(&["approver", "operator"]),
        false,
    )
}

fn approve(run: &str, command_id: &str, state: &RunState) -> w::RunCommand {
    let interrupt = state.interrupts.values().next().expect("an interrupt");
    sortie_tests::stack::approve(run, command_id, interrupt)
}

/// The `unauthenticated` answer to `command_id`, once it is on the events topic: it must
/// be outside the run's history (seq 0).
async fn refused(stack: &Stack, run: &str, command_id: &str) -> String {
    sortie_tests::wait_for(&format!("the answer to {command_id}"), LONG, || async {
        let events = stack.events().await;
        events.get(run).and_then(|history| {
            history.iter().find_map(|e| match &e.body {
                EventBody::CommandRejected {
                    command_id: id,
                    code,
                    reason,
                    ..
                } if id == command_id => {
                    assert_eq!(code, "unauthenticated", "{command_id}: {reason}");
                    assert_eq!(e.seq, 0, "{command_id} is answered outside the history");
                    Some(reason.clone())
                }
                EventBody::CommandAccepted { command_id: id, .. } if id == command_id => {
                    panic!("{command_id} was accepted: {history:?}")
                }
                _ => None,
            })
        })
    })
    .await
}

/// Checked: with `Keys::refusal` answering `None` for every command (no check), the
/// forged approval is accepted and the refund runs — this test fails at the first
/// `refused`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_commands_signed_by_a_key_that_may_sign_them_are_taken() {
    let stack = Stack::start("signed", &[GATED]).await;
    let service = Signer::generate("svc-test-1").expect("key");
    let stranger = Signer::generate("stranger").expect("key");
    let keyring = stack.write_keyring(&[service_entry(&service)]);
    let reducer = stack.reducer_with(
        "0",
        &[
            "--keyring",
            keyring.to_str().expect("path"),
            "--require-signatures",
        ],
    );
    let _executor = stack.executor("default", succeed);

    let run = "run-signed".to_owned();
    // Unsigned start: refused, the run never exists.
    let unsigned = start_run(&run, "gated", r#"{"amount": 5}"#);
    let unsigned = w::RunCommand {
        command_id: "start-unsigned".into(),
        ..unsigned
    };
    stack.send(&unsigned).await;
    let reason = refused(&stack, &run, "start-unsigned").await;
    assert!(reason.contains("not signed"), "{reason}");

    // Signed start: taken.
    stack
        .send_signed(&start_run(&run, "gated", r#"{"amount": 5}"#), &service)
        .await;
    let waiting = stack
        .wait_for_states(
            "the signed run to wait",
            std::slice::from_ref(&run),
            LONG,
            |s| s.status == RunStatus::WaitingApproval,
        )
        .await;
    let state = waiting[&run].clone();

    // A raw producer's forged approval (unsigned, claiming approver).
    stack.send(&approve(&run, "forged", &state)).await;
    // A signed approval whose value was changed after signing.
    let signed_for = stack
        .encode_command(&approve(&run, "tampered-original", &state))
        .await;
    let headers = service.headers(&signed_for);
    let tampered = stack
        .encode_command(&approve(&run, "tampered", &state))
        .await;
    stack.send_command_bytes(&run, &tampered, &headers).await;
    // A key the keyring does not know.
    stack
        .send_signed(&approve(&run, "stranger", &state), &stranger)
        .await;
    // The service's key claiming another principal.
    let mut mallory = approve(&run, "other-principal", &state);
    mallory.issuer.principal = "user:mallory".into();
    stack.send_signed(&mallory, &service).await;
    // The service's key claiming a role it does not have.
    let mut admin = approve(&run, "more-roles", &state);
    admin.issuer.roles.push("admin".into());
    stack.send_signed(&admin, &service).await;

    for (id, says) in [
        ("forged", "not signed"),
        ("tampered", "does not match"),
        ("stranger", "unknown signing key"),
        ("other-principal", "signs as"),
        ("more-roles", "may not claim role"),
    ] {
        let reason = refused(&stack, &run, id).await;
        assert!(reason.contains(says), "{id}: {reason}");
    }
    // None of them changed the run: it still waits, at the same version.
    let now = stack.states().await[&run].clone();
    assert_eq!(now.status, RunStatus::WaitingApproval);
    assert_eq!(
        now.version, state.version,
        "refusals wrote nothing to the run"
    );

    // The real approval goes through.
    stack
        .send_signed(&approve(&run, "approve", &state), &service)
        .await;
    stack
        .wait_for_states(
            "the approved run to finish",
            std::slice::from_ref(&run),
            LONG,
            |s| s.status == RunStatus::Succeeded,
        )
        .await;

    // Rotation without a restart: the keyring now has a new key and not the old one.
    let rotated = Signer::generate("svc-test-2").expect("key");
    stack.write_keyring(&[service_entry(&rotated)]);
    let reloaded = reducer.own_log_text().matches("keyring changed").count() + 1;
    sortie_tests::wait_until("the reducer to reload its keyring", LONG, || {
        let seen = reducer.own_log_text().matches("keyring changed").count();
        async move { seen >= reloaded }
    })
    .await;
    let old_key = "run-old-key".to_owned();
    stack
        .send_signed(&start_run(&old_key, "gated", r#"{"amount": 1}"#), &service)
        .await;
    let reason = refused(&stack, &old_key, &format!("start-{old_key}")).await;
    assert!(reason.contains("unknown signing key"), "{reason}");
    let new_key = "run-new-key".to_owned();
    stack
        .send_signed(&start_run(&new_key, "gated", r#"{"amount": 1}"#), &rotated)
        .await;
    stack
        .wait_for_states(
            "the run signed by the new key",
            std::slice::from_ref(&new_key),
            LONG,
            |s| s.status == RunStatus::WaitingApproval,
        )
        .await;
    assert!(!stack.states().await.contains_key(&old_key));
}

/// The gateway signs for the principal behind the bearer token with its delegate key,
/// so runs started and approved over HTTP go through a reducer that requires signatures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_signs_for_the_principals_it_authenticates() {
    let stack = Stack::start("signed-gateway", &[GATED]).await;
    let gateway_key = Signer::generate("gateway-1").expect("key");
    let keyring =
        stack.write_keyring(&[gateway_key.entry("gateway", &roles(&["acme"]), &[], true)]);
    let secret = stack.dir.join("gateway.key");
    std::fs::write(&secret, gateway_key.to_file()).expect("secret");
    let _reducer = stack.reducer_with(
        "0",
        &[
            "--keyring",
            keyring.to_str().expect("path"),
            "--require-signatures",
        ],
    );
    let _executor = stack.executor("default", succeed);
    let (_gateway, url) = stack
        .gateway_process_with(
            &stack.dir.join("gateway"),
            &["acme:user:alice:approver:alice-token"],
            &["--signing-key", secret.to_str().expect("path")],
        )
        .await;
    let http = reqwest::Client::new();
    let started = http
        .post(format!("{url}/v1/runs"))
        .bearer_auth("alice-token")
        .json(&json!({"run_id": "run-http", "graph_id": "gated", "input": {"amount": 3}}))
        .send()
        .await
        .expect("POST /v1/runs");
    let status = started.status().as_u16();
    let body = started.text().await.unwrap_or_default();
    assert!(
        status == 201 || status == 202 || status == 200,
        "{status}: {body}"
    );
    let waiting = stack
        .wait_for_states(
            "the run started over HTTP to wait",
            &["run-http".to_owned()],
            LONG,
            |s| s.status == RunStatus::WaitingApproval,
        )
        .await;
    let interrupt = waiting["run-http"]
        .interrupts
        .values()
        .next()
        .expect("an interrupt")
        .clone();
    let approved = http
        .post(format!("{url}/v1/runs/run-http/resume"))
        .bearer_auth("alice-token")
        .json(&json!({
            "decision": "approve",
            "interrupt_id": interrupt.interrupt_id,
            "proposal_hash": interrupt.proposal_hash,
        }))
        .send()
        .await
        .expect("approve");
    let status = approved.status().as_u16();
    let body = approved.text().await.unwrap_or_default();
    assert!(status < 300, "{status}: {body}");
    stack
        .wait_for_states(
            "the run approved over HTTP to finish",
            &["run-http".to_owned()],
            LONG,
            |s| s.status == RunStatus::Succeeded,
        )
        .await;
}

/// The answer to `command_id` once it is on the events topic: (code, reason, seq);
/// `None` for code means accepted.
async fn answer(stack: &Stack, run: &str, command_id: &str) -> (Option<String>, String, i64) {
    sortie_tests::wait_for(&format!("the answer to {command_id}"), LONG, || async {
        let events = stack.events().await;
        events.get(run).and_then(|history| {
            history.iter().find_map(|e| match &e.body {
                EventBody::CommandRejected {
                    command_id: id,
                    code,
                    reason,
                    ..
                } if id == command_id => Some((Some(code.clone()), reason.clone(), e.seq)),
                EventBody::CommandAccepted { command_id: id, .. } if id == command_id => {
                    Some((None, String::new(), e.seq))
                }
                _ => None,
            })
        })
    })
    .await
}

/// A `StartRun{fork}` of `source` at `version` carrying `fork` fields (`state`,
/// `history`), issued by the starter service.
fn fork_command(
    run: &str,
    source: &str,
    version: i64,
    carried: serde_json::Value,
) -> w::RunCommand {
    let mut fork = json!({"run_id": source, "version": version});
    if let (Some(fork), Some(carried)) = (fork.as_object_mut(), carried.as_object()) {
        fork.extend(carried.clone());
    }
    let mut command = sortie_tests::stack::command(
        run,
        &format!("start-{run}"),
        w::CommandBody::StartRun(w::StartRun {
            graph_id: "gated".into(),
            graph_version: Some(1),
            input: r#"{"amount": 5}"#.into(),
            labels: Default::default(),
            budget: None,
            fork: Some(fork.to_string()),
            parent: None,
        }),
    );
    command.issuer = starter_issuer();
    command
}

fn starter_issuer() -> w::Issuer {
    w::Issuer {
        principal: "svc:starter".into(),
        roles: vec![],
        groups: vec![],
    }
}

/// Issue #36 item 1: a key that may only start runs signs a `StartRun{fork}` whose
/// carried state claims the gated refund is a `pure` step in flight with the amount it
/// likes. Seen red: before the reducer read the source itself, the fold took the carried
/// state and dispatched that refund at once (an intent for `refund` with amount 10000) —
/// the right to start was the right to approve. Now the claimed state is never read: a
/// fork of the source's latest version starts from the reducer's own state of it (the
/// refund waits for a fresh approval), one of an older version without the source's
/// history, or from another partition, is refused `bad_fork`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_fork_cannot_carry_a_forged_source_state() {
    let stack = Stack::start("signed-fork", &[GATED]).await;
    let starter = Signer::generate("starter-1").expect("key");
    let keyring =
        stack.write_keyring(&[starter.entry("svc:starter", &roles(&["acme"]), &[], false)]);
    let _reducer = stack.reducer_with(
        "0",
        &[
            "--keyring",
            keyring.to_str().expect("path"),
            "--require-signatures",
        ],
    );
    let _executor = stack.executor("default", succeed);

    let source = "run-fork-source".to_owned();
    let mut start = start_run(&source, "gated", r#"{"amount": 5}"#);
    start.issuer = starter_issuer();
    stack.send_signed(&start, &starter).await;
    let waiting = stack
        .wait_for_states(
            "the source to wait for its approval",
            std::slice::from_ref(&source),
            LONG,
            |s| s.status == RunStatus::WaitingApproval,
        )
        .await;
    let head = waiting[&source].clone();

    // The forged state: the gated refund as a pure step in flight, no approval anywhere.
    let mut forged = head.clone();
    let mut refund = sortie_core::state::Step::clone(&forged.steps["prepare#1"]);
    refund.step_id = "refund#1".into();
    refund.node = "refund".into();
    refund.side_effect = sortie_core::SideEffect::Pure;
    refund.status = sortie_core::state::StepStatus::InFlight;
    refund.args = json!({"amount": 10000});
    refund.output = None;
    forged.steps.insert("refund#1".into(), refund.into());
    forged.interrupts.clear();
    let forged = json!({"state": forged});

    let partitions = stack.partitions;
    let current = sortie_tests::stack::fork_id("fork-current", &source, partitions);
    let old = sortie_tests::stack::fork_id("fork-old", &source, partitions);
    let away = (0..)
        .map(|n| format!("fork-away-{n}"))
        .find(|id| {
            sortie_wire::partition_for(id.as_bytes(), partitions)
                != sortie_wire::partition_for(source.as_bytes(), partitions)
        })
        .expect("an id on another partition");
    for command in [
        fork_command(&current, &source, head.version, forged.clone()),
        fork_command(&old, &source, 1, forged.clone()),
        fork_command(&away, &source, head.version, forged.clone()),
    ] {
        stack.send_signed(&command, &starter).await;
    }
    let (code, reason, _) = answer(&stack, &old, &format!("start-{old}")).await;
    assert_eq!(code.as_deref(), Some("bad_fork"), "{reason}");
    assert!(reason.contains("must carry the run's history"), "{reason}");
    let (code, reason, seq) = answer(&stack, &away, &format!("start-{away}")).await;
    assert_eq!(code.as_deref(), Some("bad_fork"), "{reason}");
    assert!(reason.contains("partition"), "{reason}");
    assert_eq!(seq, 0, "a refused fork leaves no history");
    let (code, reason, _) = answer(&stack, &current, &format!("start-{current}")).await;
    assert_eq!(code, None, "{reason}");

    // The fork started from the reducer's own state of the source: the refund waits for
    // an approval given in the fork.
    let forked = stack
        .wait_for_states(
            "the fork to wait for a fresh approval",
            std::slice::from_ref(&current),
            LONG,
            |s| s.status == RunStatus::WaitingApproval,
        )
        .await;
    let fork = &forked[&current];
    assert!(!fork.steps.contains_key("refund#1"), "{:?}", fork.steps);
    assert_eq!(fork.open_interrupts().count(), 1);
    let refunds: Vec<_> = stack
        .intents("default")
        .await
        .into_iter()
        .filter(|i| i.node == "refund")
        .collect();
    assert!(refunds.is_empty(), "no refund was sent: {refunds:?}");
    let states = stack.states().await;
    assert!(!states.contains_key(&old) && !states.contains_key(&away));
}

/// Every answer to `command_id` on `run`'s events so far, in order: its code
/// (`accepted` for an acceptance) and seq.
async fn answers(stack: &Stack, run: &str, command_id: &str) -> Vec<(String, i64)> {
    let events = stack.events().await;
    events
        .get(run)
        .map(|history| {
            history
                .iter()
                .filter_map(|e| match &e.body {
                    EventBody::CommandRejected {
                        command_id: id,
                        code,
                        ..
                    } if id == command_id => Some((code.clone(), e.seq)),
                    EventBody::CommandAccepted {
                        command_id: id,
                        duplicate,
                        ..
                    } if id == command_id => Some((
                        if *duplicate { "duplicate" } else { "accepted" }.to_owned(),
                        e.seq,
                    )),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default()
}

async fn wait_answers(stack: &Stack, run: &str, command_id: &str, n: usize) -> Vec<String> {
    sortie_tests::wait_for(&format!("{n} answers to {command_id}"), LONG, || async {
        let found = answers(stack, run, command_id).await;
        (found.len() >= n).then(|| found.into_iter().map(|(code, _)| code).collect())
    })
    .await
}

const LATER: &str = r#"
id: later
version: 1
nodes:
  - {id: pay, tool: echo, side_effect: pure, args: {amount: $input.amount}}
edges: []
"#;

/// Issue #36 item 3: a signed StartRun refused because its graph was not published yet
/// leaves nothing in any run. Seen red: produced again verbatim once the graph existed,
/// the same signed bytes started the run under the signer's name. Now the command id is
/// remembered (refused ones included) for the command's validity window, read back from
/// the commands topic by a reducer that restarts with no cache, so the copy is refused
/// `replayed`; a command issued outside [broker time − window, broker time + skew] is
/// refused `outside_window`; `issued_at` is inside the signed bytes; and a retry of an
/// accepted command still gets the fold's one answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_command_is_taken_once_and_only_within_its_window() {
    let stack = Stack::start("signed-replay", &[GATED]).await;
    let service = Signer::generate("svc-test-1").expect("key");
    let keyring = stack.write_keyring(&[service_entry(&service)]);
    let ring = keyring.to_str().expect("path").to_owned();
    let flags = |ring: &str| -> Vec<String> {
        [
            "--keyring",
            ring,
            "--require-signatures",
            "--command-window-ms",
            "120000",
            "--command-skew-ms",
            "5000",
        ]
        .map(str::to_owned)
        .to_vec()
    };
    let args = flags(&ring);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut reducer = stack.reducer_with("0", &args);
    let _executor = stack.executor("default", succeed);

    // Refused: its graph is not published yet. Kept: its exact bytes and signature.
    let run = "run-replayed".to_owned();
    let early = start_run(&run, "later", r#"{"amount": 5}"#);
    let bytes = stack.encode_command(&early).await;
    let headers = service.headers(&bytes);
    stack.send_command_bytes(&run, &bytes, &headers).await;
    let first = wait_answers(&stack, &run, "start-run-replayed", 1).await;
    assert_eq!(first, ["unknown_graph"]);

    // The graph is published; the same bytes again are a replay.
    stack.publish(LATER).await;
    stack.send_command_bytes(&run, &bytes, &headers).await;
    let codes = wait_answers(&stack, &run, "start-run-replayed", 2).await;
    assert_eq!(codes[1], "replayed", "{codes:?}");

    // issued_at is inside what the signature covers.
    let mut moved = early.clone();
    moved.issued_at += 1;
    let moved = stack.encode_command(&moved).await;
    stack.send_command_bytes(&run, &moved, &headers).await;
    let codes = wait_answers(&stack, &run, "start-run-replayed", 3).await;
    assert_eq!(codes[2], "unauthenticated", "{codes:?}");

    // Outside the window, either way.
    for (id, shift) in [("stale", -600_000), ("future", 600_000)] {
        let mut command = start_run(&format!("run-{id}"), "later", r#"{"amount": 5}"#);
        command.issued_at += shift;
        stack.send_signed(&command, &service).await;
        let codes = wait_answers(&stack, &format!("run-{id}"), &format!("start-run-{id}"), 1).await;
        assert_eq!(codes, ["outside_window"], "{id}");
    }

    // An accepted command produced again is the fold's: the same answer, applied once.
    let ok = "run-ok".to_owned();
    let start = start_run(&ok, "later", r#"{"amount": 5}"#);
    let ok_bytes = stack.encode_command(&start).await;
    let ok_headers = service.headers(&ok_bytes);
    stack.send_command_bytes(&ok, &ok_bytes, &ok_headers).await;
    assert_eq!(
        wait_answers(&stack, &ok, "start-run-ok", 1).await,
        ["accepted"]
    );
    stack.send_command_bytes(&ok, &ok_bytes, &ok_headers).await;
    assert_eq!(
        wait_answers(&stack, &ok, "start-run-ok", 2).await[1],
        "duplicate"
    );

    // A reducer with no cache at all remembers: the window is read back from the topic.
    reducer.kill();
    let _reducer = stack.reducer_with("1", &args);
    stack.send_command_bytes(&run, &bytes, &headers).await;
    let codes = wait_answers(&stack, &run, "start-run-replayed", 4).await;
    assert_eq!(codes[3], "replayed", "{codes:?}");
    assert!(
        !stack.states().await.contains_key(&run),
        "the replayed start never started the run"
    );
    stack.send_command_bytes(&ok, &ok_bytes, &ok_headers).await;
    assert_eq!(
        wait_answers(&stack, &ok, "start-run-ok", 3).await[2],
        "duplicate"
    );
}
