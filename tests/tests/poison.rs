//! One input never takes the others down (the reducer's side). Each test puts one hostile
//! or unproducible record where a careless or hostile producer could, with canary runs on
//! the same partition, and asserts the canaries finish, the record is answered or
//! dead-lettered with a reason, and readiness tells the truth:
//!
//! - a 600 KiB key on `sortie.commands`: dead-lettered (its letter bounded), the partition
//!   goes on, no transaction aborts;
//! - a record Kafka refuses to take from the reducer (an intent over its topic's
//!   `max.message.bytes`): its input is dead-lettered by reference after two tries,
//!   never replayed for ever;
//! - an input flood that never stops: timers still fire and a rotated key takes effect
//!   within the housekeeping bound.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, AlterConfig, ConfigSource, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::{FutureProducer, FutureRecord};
use sortie_core::{RunState, RunStatus};
use sortie_tests::stack::{metric_sum, scrape, start_run, Process, Stack};
use sortie_wire::records as w;

const LONG: Duration = Duration::from_secs(90);

const ECHO: &str = r#"
id: echo
version: 1
nodes:
  - {id: a, tool: echo, side_effect: pure, args: {n: $input.n}}
  - {id: b, tool: echo, side_effect: pure, args: {n: $steps.a.output.n}}
edges:
  - {from: a, to: b}
"#;

fn succeeded(state: &RunState) -> bool {
    state.status == RunStatus::Succeeded
}

/// `count` run ids whose canonical partition is `partition` (of the stack's).
fn runs_on(stack: &Stack, partition: i32, prefix: &str, count: usize) -> Vec<String> {
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .filter(|run| sortie_wire::partition_for(run.as_bytes(), stack.partitions) == partition)
        .take(count)
        .collect()
}

async fn start_echo_runs(stack: &Stack, runs: &[String]) {
    for (i, run) in runs.iter().enumerate() {
        stack
            .send(&start_run(run, "echo", &format!(r#"{{"n": {i}}}"#)))
            .await;
    }
}

/// The reducer's `/readyz` answer: its status and body.
async fn readiness(process: &Process) -> (u16, String) {
    let url = format!("{}/readyz", process.metrics_url().await);
    let response = reqwest::get(url).await.expect("readyz answers");
    let status = response.status().as_u16();
    (status, response.text().await.unwrap_or_default())
}

/// Sets `key` to `value` on `topic`, keeping its other per-topic configs (AlterConfigs is
/// not incremental), and waits until the broker shows it.
async fn set_topic_config(stack: &Stack, topic: &str, key: &str, value: &str) {
    let admin: AdminClient<DefaultClientContext> =
        stack.kafka.client().create().expect("admin client");
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let describe = || async {
        admin
            .describe_configs(&[ResourceSpecifier::Topic(topic)], &options)
            .await
            .expect("describe configs")
            .into_iter()
            .next()
            .expect("one resource")
            .expect("the topic's configs")
    };
    let kept: Vec<(String, String)> = describe()
        .await
        .entries
        .into_iter()
        .filter(|e| e.source == ConfigSource::DynamicTopic && e.name != key)
        .filter_map(|e| Some((e.name, e.value?)))
        .collect();
    let alter = kept.iter().fold(
        AlterConfig::new(ResourceSpecifier::Topic(topic)).set(key, value),
        |alter, (k, v)| alter.set(k, v),
    );
    let results = admin
        .alter_configs(&[alter], &options)
        .await
        .expect("alter configs");
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    sortie_tests::wait_until("the broker to apply the topic config", LONG, || async {
        describe()
            .await
            .get(key)
            .and_then(|e| e.value.clone())
            .is_some_and(|v| v == value)
    })
    .await;
}

/// The 600 KiB key of issue #40: before, the reducer built a dead letter that carried
/// the whole key, the broker refused it, and the batch aborted and re-read the same
/// record about 20 times a second, for ever, with `/readyz` green. Now the record is
/// dead-lettered as `oversized` (no input is keyed by more than an id), the letter
/// carries a bounded key, and the runs on its partition finish with no aborted
/// transaction.
///
/// Checked red: with the key check off and the letter copying the key whole (and
/// refusals not traced to their input), the canaries never finished and
/// `sortie_reducer_transactions_failed_total` climbed without end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_600_kib_key_is_dead_lettered_and_its_partition_goes_on() {
    let stack = Stack::start("poison-key", &[ECHO]).await;
    let _executor = stack.executor_process("executor", &["default"], &[]);
    let reducer = stack.reducer("0");
    let canaries = runs_on(&stack, 0, "canary", 6);
    start_echo_runs(&stack, &canaries[..3]).await;
    let key = vec![b'k'; 600 * 1024];
    stack
        .send_raw(&stack.topics.commands(), Some(0), &key, b"not avro at all")
        .await;
    start_echo_runs(&stack, &canaries[3..]).await;
    stack
        .wait_for_states("the canaries to succeed", &canaries, LONG, succeeded)
        .await;
    let letters = stack.dead_letters().await;
    let letter = letters
        .iter()
        .find(|l| l.original_partition == 0 && l.reason.contains("614400"))
        .unwrap_or_else(|| panic!("a letter for the hostile record: {letters:?}"));
    assert_eq!(letter.reason_code, "oversized", "{letter:?}");
    assert_eq!(
        letter.original_key.as_ref().map(Vec::len),
        Some(sortie_wire::dead_letter::KEY_CAP)
    );
    let metrics = scrape(&reducer.metrics_url().await).await;
    assert_eq!(
        metric_sum(&metrics, "sortie_reducer_transactions_failed_total", &[]),
        0.0,
        "no transaction aborted"
    );
    let (status, body) = readiness(&reducer).await;
    assert_eq!(status, 200, "ready: {body}");
}

/// A record the reducer makes that Kafka will not take (an intent over its topic's
/// `max.message.bytes`): the transaction aborts, the refusal is traced to the input that
/// made the record, and after a second try the input is dead-lettered by reference
/// (`unproducible`) — the partition goes on and the canaries on it finish, and the
/// reducer is ready again.
///
/// Checked red: with refusals not traced to their input, the batch was replayed and
/// refused for as long as the test waited, and no canary behind it finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_input_whose_records_kafka_refuses_is_set_aside_by_reference() {
    const BIG: &str = r#"
id: big
version: 1
nodes:
  - {id: a, tool: echo, side_effect: pure, queue: llm, args: {blob: $input.blob}}
edges: []
"#;
    let stack = Stack::start("poison-refused", &[ECHO, BIG]).await;
    // The llm queue's intents topic takes records of at most 2 KiB.
    set_topic_config(
        &stack,
        &stack.topics.intents("llm"),
        "max.message.bytes",
        "2048",
    )
    .await;
    let _executor = stack.executor_process("executor", &["default"], &[]);
    let reducer = stack.reducer("0");
    let canaries = runs_on(&stack, 1, "canary", 4);
    let hostile = runs_on(&stack, 1, "big", 1).remove(0);
    start_echo_runs(&stack, &canaries[..2]).await;
    // Incompressible, so the compressed batch is over the topic's limit too.
    let mut rng = sortie_tests::stack::Rng(7);
    let blob: String = (0..8 * 1024)
        .map(|_| char::from(b'!' + rng.below(90) as u8))
        .collect();
    stack
        .send(&start_run(
            &hostile,
            "big",
            &serde_json::json!({ "blob": blob }).to_string(),
        ))
        .await;
    start_echo_runs(&stack, &canaries[2..]).await;
    stack
        .wait_for_states("the canaries to succeed", &canaries, LONG, succeeded)
        .await;
    let letter = sortie_tests::wait_for("the refused input's letter", LONG, || async {
        stack
            .dead_letters()
            .await
            .into_iter()
            .find(|l| l.reason_code == "unproducible")
    })
    .await;
    assert_eq!(letter.original_topic, stack.topics.commands());
    assert_eq!(letter.original_partition, 1);
    assert_eq!(
        (letter.original_key, letter.original_value),
        (None, None),
        "by reference only"
    );
    assert!(
        letter.reason.contains("refused") && letter.reason.to_lowercase().contains("size"),
        "{}",
        letter.reason
    );
    assert!(
        !stack.states().await.contains_key(&hostile),
        "nothing of the refused input was committed"
    );
    let metrics = scrape(&reducer.metrics_url().await).await;
    assert!(
        metric_sum(
            &metrics,
            "sortie_reducer_records_refused_total",
            &[("kind", "record")]
        ) >= 2.0
    );
    sortie_tests::wait_until("the reducer to be ready again", LONG, || async {
        readiness(&reducer).await.0 == 200
    })
    .await;
}

/// Under input that never stops, the loop still fires timers and reloads the keyring at
/// least every 200 ms (`driver::HOUSEKEEPING_EVERY`). A run waits on an approval that
/// expires; then a flood of commands keeps the reducer busy (no idle pass, batches of
/// hundreds) past the expiry. The expiry must fail the run within a few seconds of its
/// deadline, while the flood is still being read, and a keyring changed during the flood
/// must be reloaded within a second.
///
/// Checked red: with housekeeping only on an idle pass (as before), neither happened
/// until the flood stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timers_fire_and_keys_rotate_while_input_never_stops() {
    const EXPIRING: &str = r#"
id: expiring
version: 1
nodes:
  - id: wait
    tool: echo
    side_effect: pure
    interrupt_before: {reason: nobody will come, timeout: 6s, on_timeout: fail}
edges: []
"#;
    use sortie_wire::signing::Signer;
    let stack = Stack::start("poison-flood", &[ECHO, EXPIRING]).await;
    let first = Signer::generate("svc-1").expect("key");
    let entry = |signer: &Signer| {
        signer.entry(
            "svc:test",
            &["acme".to_owned()],
            &["approver".to_owned(), "operator".to_owned()],
            false,
        )
    };
    let keyring = stack.write_keyring(&[entry(&first)]);
    let _executor = stack.executor_process("executor", &["default"], &[]);
    let reducer = stack.reducer_with("0", &["--keyring", keyring.to_str().unwrap_or_default()]);
    let expiring = runs_on(&stack, 1, "expiring", 1);
    let started = Instant::now();
    stack.send(&start_run(&expiring[0], "expiring", "{}")).await;
    stack
        .wait_for_states("the run to wait for its approval", &expiring, LONG, |s| {
            s.status == RunStatus::WaitingApproval
        })
        .await;

    // The flood: cancels of a run that does not exist (answered outside any history), as
    // fast as one producer sends them, until the test is done.
    let flood_run = runs_on(&stack, 0, "nobody", 1).remove(0);
    let flooding = Arc::new(AtomicBool::new(true));
    let flood = {
        let flooding = flooding.clone();
        let producer: FutureProducer = stack.kafka.producer().create().expect("producer");
        let topic = stack.topics.commands();
        let cancel = sortie_tests::stack::command(
            &flood_run,
            "flood",
            w::CommandBody::CancelRun(w::CancelRun { reason: None }),
        );
        let value = stack.encode_command(&cancel).await;
        tokio::spawn(async move {
            let mut sent = 0u64;
            while flooding.load(Ordering::Relaxed) {
                let mut batch = Vec::with_capacity(500);
                for _ in 0..500 {
                    let record = FutureRecord::to(&topic).key(&flood_run).payload(&value);
                    batch.push(producer.send_result(record).expect("queued"));
                }
                for delivery in batch {
                    let _ = delivery.await;
                }
                sent += 500;
            }
            sent
        })
    };
    // The keyring changes while the reducer is busy.
    sortie_tests::wait_until("the flood to reach the reducer", LONG, || async {
        reducer.own_log_text().contains("inputs=") && {
            let metrics = scrape(&reducer.metrics_url().await).await;
            metric_sum(&metrics, "sortie_reducer_inputs_applied_total", &[]) > 2_000.0
        }
    })
    .await;
    let second = Signer::generate("svc-2").expect("key");
    stack.write_keyring(&[entry(&first), entry(&second)]);
    let rotated = Instant::now();
    sortie_tests::wait_until("the keyring to be reloaded", LONG, || async {
        reducer.own_log_text().contains("keyring changed; reloaded")
    })
    .await;
    let reloaded = rotated.elapsed();

    let states = stack
        .wait_for_states("the expiry to fail its run", &expiring, LONG, |s| {
            s.status.is_terminal()
        })
        .await;
    let expired = started.elapsed();
    let applied_then = metric_sum(
        &scrape(&reducer.metrics_url().await).await,
        "sortie_reducer_inputs_applied_total",
        &[],
    );
    flooding.store(false, Ordering::Relaxed);
    let sent = flood.await.expect("the flood ends");
    assert_eq!(states[&expiring[0]].status, RunStatus::Failed);
    assert!(
        (applied_then as u64) < sent,
        "the flood was still being read when the expiry fired ({applied_then} of {sent})"
    );
    // Due six seconds after the start; the bound is the housekeeping interval, a batch
    // and the test's polling: 12 s is generous on a loaded 2-core machine.
    assert!(
        expired < Duration::from_secs(12),
        "the expiry fired {expired:?} after the start"
    );
    // The file is looked at every 2 s (`keys::RECHECK`), from housekeeping, and this test
    // polls the log: 6 s leaves room for a loaded machine. A housekeeping starved by the
    // flood would not reload before the flood stops, which the wait above never allows.
    assert!(
        reloaded < Duration::from_secs(6),
        "the keyring was reloaded {reloaded:?} after it changed"
    );
}
