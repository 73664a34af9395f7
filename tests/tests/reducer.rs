//! The reducer as its own process against the real broker: runs complete; a SIGKILL
//! mid-run loses nothing and dispatches nothing twice; a deleted cache is rebuilt from the
//! changelog; a restart is warm in every partition, the empty ones too; two reducers share
//! the partitions and a run survives one leaving; bad
//! records are dead-lettered while the partition keeps moving.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use sortie_core::{EventBody, RunState, RunStatus};
use sortie_tests::stack::{start_run, succeed, Stack, PARTITIONS};
use sortie_tests::GATED;
use sortie_tests::THREE_STEPS;
use sortie_wire::partition_for;
use sortie_wire::records as w;

const LONG: Duration = Duration::from_secs(90);

fn succeeded(state: &RunState) -> bool {
    state.status == RunStatus::Succeeded
}

/// Audit-style checks on one run's history: gap-free seq, an intact hash chain, folding it
/// gives the state in the changelog, and no step attempt was dispatched twice.
fn check_history(run_id: &str, events: &[sortie_core::Event], state: &RunState) {
    let mut folded = None;
    let mut prev = None;
    let mut dispatched = BTreeSet::new();
    for (i, event) in events.iter().enumerate() {
        assert_eq!(event.seq, i as i64 + 1, "{run_id}: seq gap");
        assert_eq!(event.prev_hash, prev, "{run_id}: hash chain");
        assert_eq!(
            event.hash.as_deref(),
            Some(event.compute_hash().as_str()),
            "{run_id}: hash"
        );
        prev = event.hash.clone();
        if let EventBody::StepDispatched {
            step_id, attempt, ..
        } = &event.body
        {
            assert!(
                dispatched.insert((step_id.clone(), *attempt)),
                "{run_id}: {step_id} attempt {attempt} dispatched twice"
            );
        }
        folded = sortie_core::evolve(folded, event);
    }
    assert_eq!(
        folded.as_ref(),
        Some(state),
        "{run_id}: folding the history does not give the changelog state"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_step_graph_completes_and_its_history_folds_to_its_state() {
    let stack = Stack::start("reducer-complete", &[THREE_STEPS]).await;
    let _reducer = stack.reducer("0");
    let executor = stack.executor("default", succeed);
    let runs: Vec<String> = (0..6).map(|i| format!("run-{i}")).collect();
    for run in &runs {
        stack
            .send(&start_run(run, "three", r#"{"order": 7}"#))
            .await;
    }
    let states = stack
        .wait_for_states("every run to succeed", &runs, LONG, succeeded)
        .await;
    let events = stack.events().await;
    for run in &runs {
        let state = &states[run];
        assert_eq!(state.steps.len(), 3, "{run}");
        assert_eq!(
            state.steps["price#1"].args["from"], "fetch#1",
            "outputs feed the next step's args"
        );
        check_history(run, &events[run], state);
    }
    let seen = executor.seen.lock().expect("seen").len();
    assert_eq!(
        seen, 18,
        "each of 3 steps of 6 runs reached the executor once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reducer_killed_mid_run_restarts_and_dispatches_nothing_twice() {
    let stack = Stack::start("reducer-kill", &[THREE_STEPS]).await;
    let mut reducer = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    let runs: Vec<String> = (0..30).map(|i| format!("run-{i}")).collect();
    for run in &runs {
        stack
            .send(&start_run(run, "three", r#"{"order": 1}"#))
            .await;
    }
    // Kill it once some runs have moved, while others are still in flight.
    sortie_tests::wait_until("some runs to make progress", LONG, || async {
        stack.states().await.values().any(|s| s.steps.len() >= 2)
    })
    .await;
    reducer.kill();
    let _restarted = stack.reducer("0");
    let states = stack
        .wait_for_states(
            "every run to succeed after the restart",
            &runs,
            LONG,
            succeeded,
        )
        .await;
    let events = stack.events().await;
    for run in &runs {
        check_history(run, &events[run], &states[run]);
        assert!(
            states[run].steps.values().all(|s| s.attempt == 1),
            "{run}: a restart must not create new attempts"
        );
    }
    // What executors can see: each operation once, attempt 1 only.
    let mut intents = HashMap::new();
    for intent in stack.intents("default").await {
        *intents
            .entry((intent.operation_id.clone(), intent.attempt))
            .or_insert(0) += 1;
    }
    assert_eq!(intents.len(), 90);
    assert!(
        intents
            .iter()
            .all(|((_, attempt), n)| *n == 1 && *attempt == 1),
        "duplicate or re-attempted intents: {intents:?}"
    );
}

/// The cold restore also counts the runs for the gauges as it reads them, each run once by
/// its last record, without reading the cache back afterwards. Red-proofed: with the
/// restore handing the gauges no earlier share (every record counted as a new run), the
/// gauges showed more runs than there are and this timed out. And with `Store::reopen`
/// leaving the store closed, the approved run never finished. And with a frame's
/// dictionary looked up by the wrong id, the other runs never finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_cache_is_rebuilt_from_the_changelog() {
    let stack = Stack::start("reducer-cold", &[GATED]).await;
    let mut reducer = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    let run = "run-refund".to_owned();
    let others: Vec<String> = (0..4).map(|i| format!("run-other-{i}")).collect();
    for id in std::iter::once(&run).chain(&others) {
        stack
            .send(&start_run(id, "gated", r#"{"amount": 30}"#))
            .await;
    }
    let all: Vec<String> = std::iter::once(run.clone()).chain(others).collect();
    let waiting = stack
        .wait_for_states("the runs to wait for approval", &all, LONG, |s| {
            s.status == RunStatus::WaitingApproval
        })
        .await;
    let before = waiting[&run].clone();

    reducer.stop();
    std::fs::remove_dir_all(stack.reducer_data("0")).expect("delete the cache");
    // A page cache smaller than the five states: the store is reopened after the restore
    // (sled is estimated to keep more than it holds), and the approval is folded by the
    // reopened store.
    // And a dictionary trained as soon as zstd can (8 states): the rest of the restored
    // states, and what the reducer writes after, are packed against it.
    let restarted = stack.reducer_with(
        "0",
        &[
            "--store-cache-bytes",
            "4096",
            "--store-dictionary-after",
            "1",
        ],
    );
    // The gauges were counted from the records the restore read (each run has several:
    // started, dispatched, waiting), each run once, by its last one.
    restarted
        .wait_for_run_gauges(&[("waiting_approval", 5.0), ("running", 0.0)], LONG)
        .await;

    let interrupt = before
        .interrupts
        .values()
        .next()
        .expect("an interrupt")
        .clone();
    let approve = sortie_tests::stack::approve(&run, "approve-1", &interrupt);
    stack.send(&approve).await;
    let states = stack
        .wait_for_states(
            "the approved run to finish",
            std::slice::from_ref(&run),
            LONG,
            succeeded,
        )
        .await;
    let after = &states[&run];
    assert!(after.version > before.version);
    assert_eq!(
        after.steps["refund#1"].args["amount"], 30,
        "the approved call ran with the proposed args"
    );
    check_history(&run, &stack.events().await[&run], after);
    let log = restarted.log_text();
    assert!(
        log.contains("warm=false"),
        "the restart restored cold from the changelog"
    );
    let counted = restarted.gauges_counted_by();
    assert!(
        counted.len() == PARTITIONS as usize && counted.iter().all(|how| how == "restore"),
        "every cold partition's runs were counted as they were restored, none by a scan: {counted:?}"
    );
    assert!(
        log.contains("Reopened the local store after the restore.")
            && log.contains("scanned_runs=0"),
        "the store was reopened after the cold restore's writes, with nothing scanned"
    );
    assert!(
        log.contains("Trained the store's zstd dictionary"),
        "the restored states trained the store's dictionary"
    );
    restarted
        .wait_for_run_gauges(
            &[
                ("waiting_approval", 4.0),
                ("succeeded", 1.0),
                ("running", 0.0),
            ],
            LONG,
        )
        .await;
    // The other runs' states are read back from sled, most of them packed against the
    // dictionary (restored after its eighth sample): every one is approved and finishes.
    let others: Vec<String> = all.iter().filter(|id| **id != run).cloned().collect();
    for id in &others {
        let interrupt = waiting[id]
            .interrupts
            .values()
            .next()
            .expect("an interrupt")
            .clone();
        let approve = sortie_tests::stack::approve(id, &format!("approve-{id}"), &interrupt);
        stack.send(&approve).await;
    }
    let states = stack
        .wait_for_states("every approved run to finish", &others, LONG, succeeded)
        .await;
    let events = stack.events().await;
    for id in &others {
        check_history(id, &events[id], &states[id]);
    }
}

/// A restart after a clean stop is warm in every partition, the ones that never held a
/// run included: a cold partition with nothing to read gets its cache marker at once
/// (before, an empty partition was cold at every start and made the gauges count every
/// cached run again). And an input in a partition the group never committed an offset for
/// is consumed from the partition's log start, which the assignment now asks for itself.
/// Red-proofed: without the marker for an empty cold partition, the restart logs
/// `warm=false` for partitions 1 and 2 and this fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_is_warm_in_every_partition_even_the_empty_ones() {
    let stack = Stack::start("reducer-warm-empty", &[THREE_STEPS]).await;
    let run_in = |partition: i32| {
        (0..)
            .map(|i| format!("run-{i}"))
            .find(|run| partition_for(run.as_bytes(), PARTITIONS) == partition)
            .expect("a run id for every partition")
    };
    let (first, later) = (run_in(0), run_in(1));
    let mut reducer = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    stack
        .send(&start_run(&first, "three", r#"{"order": 1}"#))
        .await;
    stack
        .wait_for_states(
            "the first run to succeed",
            std::slice::from_ref(&first),
            LONG,
            succeeded,
        )
        .await;
    reducer.stop();

    // Both incarnations write the same log file: read the restart's part.
    let before = reducer.log_text().len();
    let restarted = stack.reducer("0");
    let restart_log = || {
        restarted
            .log_text()
            .get(before..)
            .unwrap_or_default()
            .to_owned()
    };
    sortie_tests::wait_until("the restart to restore its assignment", LONG, || async {
        restart_log().contains("Assignment restored")
    })
    .await;
    let log = restart_log();
    let restored: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("Partition restored from the changelog"))
        .collect();
    assert_eq!(restored.len(), PARTITIONS as usize, "{log}");
    assert!(
        restored.iter().all(|line| line.contains("warm=true")),
        "every partition, the empty ones too, restarts warm: {restored:#?}"
    );

    // Partition 1 never had an input: nothing committed there, read from its start.
    stack
        .send(&start_run(&later, "three", r#"{"order": 2}"#))
        .await;
    let states = stack
        .wait_for_states(
            "a run in a partition with no committed offset to succeed",
            std::slice::from_ref(&later),
            LONG,
            succeeded,
        )
        .await;
    check_history(&later, &stack.events().await[&later], &states[&later]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_reducers_share_partitions_and_runs_survive_one_leaving() {
    let stack = Stack::start("reducer-pair", &[THREE_STEPS]).await;
    let mut first = stack.reducer("0");
    let second = stack.reducer("1");
    sortie_tests::wait_until("both reducers to own partitions", LONG, || async {
        first.log_text().contains("Partitions assigned")
            && second.log_text().contains("Partitions assigned")
    })
    .await;
    // Hold results back until the first reducer has left, so runs are mid-flight then.
    let gate = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let open = gate.clone();
    let _executor = stack.executor("default", move |intent| {
        if intent.step_id.starts_with("fetch") || open.load(std::sync::atomic::Ordering::Relaxed) {
            succeed(intent)
        } else {
            None
        }
    });
    let runs: Vec<String> = (0..12).map(|i| format!("run-{i}")).collect();
    for run in &runs {
        stack.send(&start_run(run, "three", "{}")).await;
    }
    let partitions: BTreeSet<i32> = runs
        .iter()
        .map(|r| partition_for(r.as_bytes(), PARTITIONS))
        .collect();
    assert!(partitions.len() > 1, "the runs span partitions");
    stack
        .wait_for_states("every run to reach its second step", &runs, LONG, |s| {
            s.steps.contains_key("price#1")
        })
        .await;
    first.stop();
    gate.store(true, std::sync::atomic::Ordering::Relaxed);
    // The held-back price intents were consumed already; answer them again by re-sending
    // results for every price intent seen (the executor dropped them while gated).
    let pending: Vec<w::StepIntent> = stack
        .intents("default")
        .await
        .into_iter()
        .filter(|i| i.step_id.starts_with("price"))
        .collect();
    for intent in &pending {
        if let Some(result) = succeed(intent) {
            let bytes = stack
                .codec
                .encode(&stack.topics.step_results(), &result)
                .await
                .expect("encode");
            let partition = partition_for(result.run_id.as_bytes(), PARTITIONS);
            stack
                .send_raw(
                    &stack.topics.step_results(),
                    Some(partition),
                    result.operation_id.as_bytes(),
                    &bytes,
                )
                .await;
        }
    }
    let states = stack
        .wait_for_states(
            "every run to finish on the remaining reducer",
            &runs,
            LONG,
            succeeded,
        )
        .await;
    let events = stack.events().await;
    for run in &runs {
        check_history(run, &events[run], &states[run]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_records_are_dead_lettered_and_misrouted_commands_forwarded_once() {
    let stack = Stack::start("reducer-bad", &[THREE_STEPS]).await;
    // A small payload cap, so an oversized record is one the broker still accepts.
    let _reducer = stack.reducer_with("0", &["--max-payload-bytes", "65536"]);
    let _executor = stack.executor("default", succeed);
    let commands = stack.topics.commands();
    let good = "run-good".to_owned();
    let target = partition_for(good.as_bytes(), PARTITIONS);
    // Garbage, then a valid record of the wrong type, on the good run's partition.
    stack
        .send_raw(&commands, Some(target), good.as_bytes(), b"not avro at all")
        .await;
    let wrong_type = w::DeadLetter {
        reason_code: "x".into(),
        reason: "x".into(),
        service: "x".into(),
        original_topic: "x".into(),
        original_partition: 0,
        original_offset: 0,
        original_timestamp: None,
        original_key: None,
        original_value: None,
        original_headers: vec![],
        failed_at: 0,
    };
    let bytes = stack
        .codec
        .encode(&stack.topics.dead_letters(), &wrong_type)
        .await
        .expect("encode");
    stack
        .send_raw(&commands, Some(target), good.as_bytes(), &bytes)
        .await;
    // An oversized command on the same partition: dead-lettered before it is decoded.
    let huge = format!(r#"{{"blob": "{}"}}"#, "x".repeat(100_000));
    stack
        .send_to(&start_run(&good, "three", &huge), target)
        .await;
    stack.send(&start_run(&good, "three", "{}")).await;
    // A command produced to the wrong partition (another client's partitioner).
    let misrouted = "run-misrouted".to_owned();
    let wrong = (partition_for(misrouted.as_bytes(), PARTITIONS) + 1) % PARTITIONS as i32;
    stack
        .send_to(&start_run(&misrouted, "three", "{}"), wrong)
        .await;

    let runs = vec![good.clone(), misrouted.clone()];
    stack
        .wait_for_states("both runs to finish", &runs, LONG, succeeded)
        .await;
    let letters = stack.dead_letters().await;
    let codes: BTreeSet<&str> = letters.iter().map(|l| l.reason_code.as_str()).collect();
    assert_eq!(letters.len(), 3, "{letters:?}");
    assert_eq!(
        codes,
        BTreeSet::from(["oversized", "undecodable", "wrong_schema"])
    );
    assert!(letters
        .iter()
        .all(|l| l.original_partition == target && l.original_value.is_some()));
    let events = stack.events().await;
    let accepted = events[&misrouted]
        .iter()
        .filter(|e| matches!(e.body, EventBody::CommandAccepted { .. }))
        .count();
    assert_eq!(
        accepted, 1,
        "the misrouted command was applied exactly once"
    );
}

const FLAKY: &str = r#"
id: flaky
version: 1
nodes:
  - id: call
    tool: echo
    side_effect: keyed
    retry: {max_attempts: 3, initial_backoff: 300ms, max_backoff: 1s, multiplier: 2, jitter: 0.1}
  - {id: after, tool: echo, side_effect: pure}
edges:
  - {from: call, to: after}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_failure_is_retried_by_a_timer_with_the_same_operation_id() {
    let stack = Stack::start("reducer-retry", &[FLAKY]).await;
    let _reducer = stack.reducer("0");
    let executor = stack.executor("default", |intent| {
        let mut result = succeed(intent)?;
        if intent.step_id == "call#1" && intent.attempt == 1 {
            result.status = w::StepStatus::Failed;
            result.retryable = true;
            result.output = None;
            result.error = Some(w::StepError {
                code: "http_503".into(),
                message: "try later".into(),
                retry_after_ms: None,
            });
        }
        Some(result)
    });
    let run = "run-flaky".to_owned();
    stack.send(&start_run(&run, "flaky", "{}")).await;
    let states = stack
        .wait_for_states(
            "the run to succeed after a retry",
            std::slice::from_ref(&run),
            LONG,
            succeeded,
        )
        .await;
    let call = &states[&run].steps["call#1"];
    assert_eq!(call.attempt, 2);
    let seen: Vec<(String, i32)> = executor
        .seen
        .lock()
        .expect("seen")
        .iter()
        .filter(|i| i.step_id == "call#1")
        .map(|i| (i.operation_id.clone(), i.attempt))
        .collect();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        seen[0].0, seen[1].0,
        "both attempts carry the same operation id (idempotency key)"
    );
    let events = stack.events().await;
    let failed_at = events[&run].iter().find_map(|e| match &e.body {
        EventBody::StepFailed { retry_at, .. } => {
            Some((e.at, retry_at.expect("a retry is scheduled")))
        }
        _ => None,
    });
    let redispatched = events[&run]
        .iter()
        .find(|e| matches!(&e.body, EventBody::StepDispatched { attempt: 2, .. }))
        .map(|e| e.at);
    let (failed, due) = failed_at.expect("a StepFailed event");
    assert!(due - failed >= 270, "backoff honoured: {failed} -> {due}");
    assert!(
        redispatched.expect("attempt 2 dispatched") >= due,
        "the retry fired at or after its due time"
    );
    check_history(&run, &events[&run], &states[&run]);
}

/// Four nodes whose arguments are each the whole input: a large input would make a run
/// state bigger than a Kafka record.
const FAN_OUT: &str = r#"
id: fan
version: 1
nodes:
  - {id: a, tool: echo, side_effect: pure, args: {data: $input.data}}
  - {id: b, tool: echo, side_effect: pure, args: {data: $input.data}}
  - {id: c, tool: echo, side_effect: pure, args: {data: $input.data}}
  - {id: d, tool: echo, side_effect: pure, args: {data: $input.data}}
edges: []
"#;

/// A 1 MB input and a run id with a NUL byte used to crash-loop the partition's owner (a
/// record over max.message.bytes aborted every transaction; sled refused the key). Now
/// the first is answered with a reason (`limit_exceeded`), the second is dead-lettered, and a run
/// on the same partition after them completes. Checked: with the id check in `convert`
/// disabled, the reducer dies on the poison run's timer ("run id ... contains a NUL byte
/// and cannot be indexed") and this test times out waiting for the run after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_input_and_a_poison_run_id_do_not_stop_their_partition() {
    let stack = Stack::start("reducer-poison", &[FAN_OUT, THREE_STEPS, GATED]).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    let good = "run-after-poison".to_owned();
    let target = partition_for(good.as_bytes(), PARTITIONS);
    // The big run on the good run's partition.
    let big = (0..1000)
        .map(|i| format!("run-big-{i}"))
        .find(|id| partition_for(id.as_bytes(), PARTITIONS) == target)
        .expect("a run id on the target partition");
    let input = format!(r#"{{"data": "{}"}}"#, "x".repeat(1_000_000));
    stack.send(&start_run(&big, "fan", &input)).await;
    let moderate = (0..1000)
        .map(|i| format!("run-fan-{i}"))
        .find(|id| partition_for(id.as_bytes(), PARTITIONS) == target)
        .expect("a run id on the target partition");
    let input = format!(r#"{{"data": "{}"}}"#, "x".repeat(200_000));
    stack.send(&start_run(&moderate, "fan", &input)).await;
    // A NUL in the run id, on the same partition, of a graph that arms a timer (the
    // timer index is where sled could not hold it).
    let poison = (0..1000)
        .map(|i| format!("run\0poison-{i}"))
        .find(|id| partition_for(id.as_bytes(), PARTITIONS) == target)
        .expect("a run id on the target partition");
    stack.send(&start_run(&poison, "gated", "{}")).await;
    stack.send(&start_run(&good, "three", "{}")).await;

    stack
        .wait_for_states(
            "the run after the poison to finish",
            std::slice::from_ref(&good),
            LONG,
            succeeded,
        )
        .await;
    let events = stack.events().await;
    // The 1 MB string breaks the payload shape (answered before the fold, by the same
    // words the gateway answers with); the 200 KiB one fits it, but four copies of it
    // outgrow a record (the fold's answer).
    for (run, code) in [(&big, "limit_exceeded"), (&moderate, "too_large")] {
        let rejected: Vec<(String, String)> = events
            .get(run.as_str())
            .into_iter()
            .flatten()
            .filter_map(|e| match &e.body {
                EventBody::CommandRejected { code, reason, .. } => {
                    Some((code.clone(), reason.clone()))
                }
                _ => None,
            })
            .collect();
        assert_eq!(rejected.len(), 1, "{run}: {rejected:?}");
        assert_eq!(rejected[0].0, code, "{run}: {rejected:?}");
    }
    let states = stack.states().await;
    assert!(!states.contains_key(&big) && !states.contains_key(&moderate));
    assert!(!states.contains_key(&poison));
    let letters = stack.dead_letters().await;
    assert!(
        letters.iter().any(|l| l.reason_code == "invalid"
            && l.original_topic == stack.topics.commands()
            && l.original_partition == target
            && l.reason.contains("control character")),
        "{letters:?}"
    );
}

/// A changelog record the reducer cannot decode is never skipped, and never stops the
/// partition for everyone: its run is quarantined. The run's inputs are dead-lettered
/// `quarantined` (so its history never starts over under the same id), the reducer counts
/// it, and every other run — on the same partition too — keeps going, with `/readyz`
/// green. Before this, the partition stopped (and before that, the restore skipped the
/// record and the run's next input started its history over). Checked red: with the
/// quarantine check in `Engine::apply_or_refuse` removed, the victim's StartRun was
/// applied as a new run over the unreadable one and no letter came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_changelog_record_quarantines_its_run_not_its_partition() {
    let stack = Stack::start("reducer-bad-changelog", &[THREE_STEPS]).await;
    let broken = 1;
    let victim = (0..1000)
        .map(|i| format!("run-victim-{i}"))
        .find(|id| partition_for(id.as_bytes(), PARTITIONS) == broken)
        .expect("a run id on the broken partition");
    stack
        .send_raw(
            &stack.topics.run_state(),
            Some(broken),
            victim.as_bytes(),
            b"not a run state",
        )
        .await;
    let reducer = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    let others: Vec<String> = (0..1000)
        .map(|i| format!("run-other-{i}"))
        .take(6)
        .collect();
    assert!(
        others
            .iter()
            .any(|id| partition_for(id.as_bytes(), PARTITIONS) == broken),
        "some of the others share the victim's partition"
    );
    for run in others.iter().chain([&victim]) {
        stack.send(&start_run(run, "three", "{}")).await;
    }
    stack
        .wait_succeeded_by_events("every other run to finish", &others, LONG)
        .await;
    let letter = sortie_tests::wait_for("the victim's start to be set aside", LONG, || async {
        stack
            .dead_letters()
            .await
            .into_iter()
            .find(|l| l.reason_code == "quarantined")
    })
    .await;
    assert!(letter.reason.contains(&victim), "{}", letter.reason);
    let url = reducer.metrics_url().await;
    let readyz = reqwest::get(format!("{url}/readyz"))
        .await
        .expect("GET /readyz");
    let status = readyz.status().as_u16();
    let body = readyz.text().await.unwrap_or_default();
    assert_eq!(status, 200, "{body}");
    let metrics = sortie_tests::stack::scrape(&url).await;
    assert_eq!(
        sortie_tests::stack::metric_sum(&metrics, "sortie_reducer_runs_quarantined", &[]),
        1.0
    );
    let log = reducer.log_text();
    assert!(
        log.contains("A changelog record does not decode: its run is quarantined"),
        "{log}"
    );
    let events = stack.events().await;
    assert!(
        !events.contains_key(&victim),
        "no history of the quarantined run was started over: {:?}",
        events.get(&victim)
    );
}

/// Issue 12.1, deterministically: a batch still open when the group rebalances is
/// committed inside the revoke callback, before its partitions move, so the new owner
/// continues from its offsets. Both reducers keep batches open for 6 s (`--batch-linger-ms`),
/// so a batch is certainly open at the revocation. Checked: with the commit in
/// `tasks::on_revoke` skipped (the batch outliving its partitions, as before), the old
/// owner commits the batch later with the new generation's metadata while the new owner
/// has already applied the same commands: every moved run starts twice (duplicate seq).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_open_at_a_revocation_is_committed_before_its_partitions_move() {
    let stack = Stack::start("reducer-revoke", &[THREE_STEPS]).await;
    let linger = ["--commit-interval-ms", "6000", "--batch-linger-ms", "6000"];
    let first = stack.reducer_with("0", &linger);
    let url = first.metrics_url().await;
    sortie_tests::wait_until("the first reducer to be ready", LONG, || async {
        reqwest::get(format!("{url}/readyz"))
            .await
            .is_ok_and(|r| r.status().is_success())
    })
    .await;
    let runs: Vec<String> = (0..PARTITIONS as i32)
        .flat_map(|p| {
            (0..1000)
                .map(|i| format!("run-revoke-{i}"))
                .filter(move |id| partition_for(id.as_bytes(), PARTITIONS) == p)
                .take(2)
        })
        .collect();
    for run in &runs {
        stack.send(&start_run(run, "three", "{}")).await;
    }
    // Give the first reducer a moment to read them into its open batch (if it has not,
    // the test proves nothing but cannot fail wrongly).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let _second = stack.reducer_with("1", &linger);
    let _executor = stack.executor("default", succeed);
    // Every run finishes (3 steps, each through a lingering batch): by then any batch of
    // the old owner that outlived its partitions would have been committed too.
    stack
        .wait_succeeded_by_events("every run to succeed", &runs, LONG)
        .await;
    let events = stack.events().await;
    for run in &runs {
        let history = &events[run];
        let started = history
            .iter()
            .filter(|e| matches!(e.body, EventBody::RunStarted { .. }))
            .count();
        let seqs: BTreeSet<i64> = history.iter().map(|e| e.seq).collect();
        assert_eq!(started, 1, "{run} started {started} times: {history:?}");
        assert_eq!(seqs.len(), history.len(), "{run} has a repeated seq");
    }
    assert!(
        first.own_log_text().contains("Partitions revoked"),
        "the first reducer gave partitions up"
    );
}

/// A restore reads the changelog to its *high watermark*, so a transaction still open on
/// the changelog when a partition is assigned is waited out, not read past. That is the
/// case after a previous owner's commit: its offsets are stable (KIP-447) while the
/// markers of a changelog partition can still be on their way, and a restore that ended
/// at the last stable offset consumed inputs past that transaction without its states —
/// the runs it had started were unknown to their new owner and never finished (seen in
/// `rebalance.rs`'s cluster leader kill, 1 run in 3 under load).
///
/// Here the open transaction is the test's own: a waiting run's state, copied under a
/// new run id, is written to the changelog in a transaction held open while a cold
/// reducer restores; the restore must still be waiting when the test commits, and the
/// copied run must then be the reducer's to approve. Checked: with the restore's end
/// asked through the `read_committed` input consumer again (`tasks.rs`, `marks` →
/// `consumer`), the restore ends below the open transaction and this test fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changelog_transaction_open_at_a_restore_is_waited_out() {
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

    let stack = Stack::start("reducer-open-txn", &[GATED]).await;
    let mut first = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    let model = "run-txn-model".to_owned();
    stack
        .send(&start_run(&model, "gated", r#"{"amount": 12}"#))
        .await;
    let waiting = stack
        .wait_for_states(
            "the model run to wait for approval",
            std::slice::from_ref(&model),
            LONG,
            |s| s.status == RunStatus::WaitingApproval,
        )
        .await;
    first.stop();

    // The model's last changelog record, as another run.
    let mut record: Option<w::RunState> = None;
    for message in sortie_tests::read_all(
        &stack.bootstrap,
        &stack.topics.run_state(),
        sortie_tests::Isolation::ReadCommitted,
    )
    .await
    {
        use rdkafka::Message;
        let state: w::RunState = stack
            .codec
            .decode(message.payload())
            .await
            .expect("decode run-state");
        if state.run_id == model {
            record = Some(state);
        }
    }
    let mut copy = record.expect("the model's changelog record");
    let run = "run-txn-copy".to_owned();
    copy.state = copy
        .state
        .replace(&format!("\"{model}\""), &format!("\"{run}\""));
    copy.run_id = run.clone();
    let bytes = stack
        .codec
        .encode(&stack.topics.run_state(), &copy)
        .await
        .expect("encode the copy");

    // Written in a transaction left open (longer than the reducer's 15 s timeout).
    let producer: BaseProducer = stack
        .kafka
        .transactional_producer(&format!("{}test-open", stack.prefix))
        .set("transaction.timeout.ms", "120000")
        .create()
        .expect("transactional producer");
    producer
        .init_transactions(Duration::from_secs(30))
        .expect("init transactions");
    producer.begin_transaction().expect("begin");
    producer
        .send(
            BaseRecord::to(&stack.topics.run_state())
                .partition(partition_for(run.as_bytes(), PARTITIONS))
                .key(run.as_bytes())
                .payload(&bytes),
        )
        .map_err(|(e, _)| e)
        .expect("send the copy");
    producer.flush(Duration::from_secs(30)).expect("flush");

    let second = stack.reducer("1");
    let waited = sortie_tests::wait_for("the cold restore to wait or end", LONG, || {
        let log = second.own_log_text();
        async move {
            if log.contains("Assignment restored") {
                Some(false)
            } else if log.contains("nothing read for a while") {
                Some(true)
            } else {
                None
            }
        }
    })
    .await;
    assert!(
        waited,
        "the restore ended while a changelog transaction was open: {}",
        second.own_log_text()
    );
    producer
        .commit_transaction(Duration::from_secs(30))
        .expect("commit");

    let interrupt = waiting[&model]
        .interrupts
        .values()
        .next()
        .expect("an interrupt")
        .clone();
    let approve = sortie_tests::stack::approve(&run, "approve-copy", &interrupt);
    stack.send(&approve).await;
    stack
        .wait_for_states(
            "the copied run, restored, to be approved and finish",
            std::slice::from_ref(&run),
            LONG,
            succeeded,
        )
        .await;
}

/// The fold's clock is the broker's (ADR 0003): a reducer refuses to start on a commands
/// topic that keeps producer time (`CreateTime`), exits non-zero and names the topic and
/// the fix. Seen red with the startup check skipped: the reducer went on to start (and
/// was still running at the deadline).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reducer_refuses_a_commands_topic_that_keeps_producer_time() {
    let bootstrap = sortie_tests::bootstrap().await;
    let prefix = sortie_tests::unique_prefix("create-time");
    let topic = sortie_wire::Topics::new(&prefix).commands();
    sortie_tests::create_topic(
        &bootstrap,
        &topic,
        PARTITIONS as i32,
        &[("message.timestamp.type", "CreateTime")],
    )
    .await;
    let data = tempfile::tempdir().expect("a data dir");
    let reducer = tokio::process::Command::new(sortie_tests::stack::sortie_bin())
        .args([
            "reducer",
            "--bootstrap-servers",
            &bootstrap,
            "--prefix",
            &prefix,
        ])
        // Never reached: the check comes before anything else is opened.
        .args(["--registry-url", "http://127.0.0.1:9"])
        .arg("--data-dir")
        .arg(data.path())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(LONG, reducer)
        .await
        .expect("the reducer exits")
        .expect("the reducer runs");
    let said = String::from_utf8_lossy(&output.stderr).into_owned()
        + &String::from_utf8_lossy(&output.stdout);
    assert!(!output.status.success(), "{said}");
    assert!(
        said.contains(&topic)
            && said.contains("message.timestamp.type: CreateTime")
            && said.contains("sortie topology apply"),
        "{said}"
    );
}
