//! An executor of your own, built from `examples/rust-executor` — a project outside the
//! workspace, with its own `Cargo.toml` and lock file, depending on `sortie-executor` by
//! path as a user's would by git — takes `sortie executor`'s flags, reads the same Kafka
//! properties file, serves the same health and metrics endpoints, and runs its own
//! handlers beside the built-in ones against the real broker, reducer and ledger.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use sortie_core::RunStatus;
use sortie_tests::stack::{metric_sum, own_executor_bin, scrape, sortie_bin, start_run, Stack};

const LONG: Duration = Duration::from_secs(60);

/// The long flags a `--help` lists.
fn flags(program: &Path, args: &[&str]) -> BTreeSet<String> {
    let out = Command::new(program)
        .args(args)
        .arg("--help")
        .output()
        .expect("help runs");
    assert!(out.status.success(), "{} --help failed", program.display());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let line = line.trim_start();
            let option = line.split_once("--")?.1;
            (line.starts_with('-')).then(|| option.split([' ', '=', ',', '<']).next())?
        })
        .map(|flag| format!("--{flag}"))
        .collect()
}

/// Every flag of `sortie executor` (and its logging flags) is a flag of the executor of
/// your own, and no other: one definition serves both (`sortie_executor::command`).
///
/// Seen red: with the logging flags left out of the example's command line.
#[test]
fn an_executor_of_your_own_takes_the_flags_of_sortie_executor() {
    let mut ours = flags(&own_executor_bin(), &[]);
    // Its own version, not a subcommand's.
    assert!(ours.remove("--version"), "{ours:?}");
    let sorties = flags(&sortie_bin(), &["executor"]);
    for flag in [
        "--queue",
        "--kafka-properties",
        "--metrics-addr",
        "--seal-keyring",
    ] {
        assert!(ours.contains(flag), "{flag} missing: {ours:?}");
    }
    assert_eq!(ours, sorties);
}

fn graph(ledger: &str) -> String {
    format!(
        r#"
id: own
version: 1
nodes:
  - {{id: shout, tool: shout, queue: custom, side_effect: pure, args: {{text: $input.text}}}}
  - {{id: reserve, tool: inventory, queue: custom, side_effect: keyed, args: {{sku: $input.sku}}}}
  - id: pay
    tool: http
    queue: custom
    side_effect: keyed
    args: {{text: $steps.shout.output.text}}
    config: {{url: "{ledger}/effects/pay"}}
    timeout: 5s
edges:
  - {{from: shout, to: reserve}}
  - {{from: reserve, to: pay}}
"#
    )
}

/// The example's handlers (`shout`, `inventory`) and a built-in one (`http`, to the
/// ledger) serve a run on the example's queue; the process reads `--kafka-properties`
/// (a property librdkafka does not know stops it, naming the property), answers
/// `/healthz` and `/readyz`, and counts its intents on `/metrics`.
///
/// Seen red: with the properties file ignored (the typo did not stop it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_of_your_own_serves_its_queue_with_its_handlers_and_the_built_in_ones() {
    let stack = Stack::start("own-executor", &[]).await;
    sortie_tests::create_topic(&stack.bootstrap, &stack.topics.intents("custom"), 2, &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    stack.publish(&graph(&ledger.url)).await;
    let _reducer = stack.reducer("0");

    let bad = stack.dir.join("bad.properties");
    std::fs::write(&bad, "# a typo\nsocket.keepalive.enabel=true\n").expect("properties");
    let mut refused = stack.own_executor_process(
        "refused",
        &["custom"],
        &["--kafka-properties", bad.to_str().expect("utf-8 path")],
    );
    let status = refused
        .wait_exit(LONG)
        .await
        .expect("a bad property stops it");
    assert!(!status.success());
    assert!(
        refused.log_text().contains("socket.keepalive.enabel"),
        "the error names the property: {}",
        refused.log_text()
    );

    let good = stack.dir.join("good.properties");
    std::fs::write(&good, "socket.keepalive.enable=true\n").expect("properties");
    let executor = stack.own_executor_process(
        "mine",
        &["custom"],
        &["--kafka-properties", good.to_str().expect("utf-8 path")],
    );
    let url = executor.metrics_url().await;
    let health = reqwest::get(format!("{url}/healthz"))
        .await
        .expect("healthz");
    assert_eq!(health.status(), 200);
    sortie_tests::wait_until("the executor to be ready", LONG, || async {
        reqwest::get(format!("{url}/readyz"))
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;

    let run = "run-own".to_owned();
    stack
        .send(&start_run(
            &run,
            "own",
            r#"{"text": "hello", "sku": "A-1"}"#,
        ))
        .await;
    let states = stack
        .wait_for_states("the run to end", std::slice::from_ref(&run), LONG, |s| {
            s.status.is_terminal()
        })
        .await;
    let state = &states[&run];
    assert_eq!(state.status, RunStatus::Succeeded, "{state:#?}");
    let output = |step: &str| state.steps[step].output.clone().unwrap_or_default();
    assert_eq!(output("shout#1")["text"], "HELLO");
    assert_eq!(
        output("reserve#1")["reservation"],
        state.steps["reserve#1"].operation_id.as_str()
    );
    let calls = ledger.snapshot().await.calls;
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0].body["text"], "HELLO");

    let metrics = scrape(&url).await;
    let intents = metric_sum(
        &metrics,
        "sortie_executor_intents_total",
        &[("queue", "custom")],
    );
    assert_eq!(intents, 3.0, "{metrics:?}");
}
