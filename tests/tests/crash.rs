//! The crash matrix (SPEC §10), the rows not covered elsewhere: each test starts the real
//! services as processes on a real broker, drives runs, makes a process die at a named
//! fault point (or restarts the broker), restarts it, and asserts on three things: the
//! ledger (effects and calls per operation id), every run's final state and history, and
//! what `read_committed` readers see (no record of an aborted transaction, nothing twice).
//!
//! The executor rows live in `executor.rs`, SIGKILL under load and the cold cache in
//! `reducer.rs`; ARCHITECTURE.md's crash-matrix table names the test of every row.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use serde_json::{json, Value};
use sortie_core::{EventBody, RunState, RunStatus};
use sortie_tests::stack::{check_history, start_run, LedgerProcess, Process, Stack};
use sortie_tests::Isolation;

const LONG: Duration = Duration::from_secs(90);

/// Two keyed receiver calls and an echo. Timeouts long enough that no restart in these
/// tests makes the reducer re-dispatch: any second call in the ledger is a defect.
fn chain_graph(ledger: &str) -> String {
    format!(
        r#"
id: chain
version: 1
nodes:
  - id: reserve
    tool: http
    side_effect: keyed
    args: {{order: $input.order}}
    config: {{url: "{ledger}/effects/reserve"}}
    timeout: 60s
  - id: charge
    tool: http
    side_effect: keyed
    args: {{order: $input.order, reserved: $steps.reserve.output.ledger_seq}}
    config: {{url: "{ledger}/effects/charge"}}
    timeout: 60s
  - {{id: receipt, tool: echo, side_effect: pure, args: {{seq: $steps.charge.output.ledger_seq}}}}
edges:
  - {{from: reserve, to: charge}}
  - {{from: charge, to: receipt}}
"#
    )
}

fn succeeded(state: &RunState) -> bool {
    state.status == RunStatus::Succeeded
}

fn runs(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("run-{i}")).collect()
}

async fn start_runs(stack: &Stack, runs: &[String]) {
    for (i, run) in runs.iter().enumerate() {
        stack
            .send(&start_run(run, "chain", &format!(r#"{{"order": {i}}}"#)))
            .await;
    }
}

/// The three assertions every row makes once its runs have finished:
/// - state and history: every run succeeded, its committed history is gap-free, chained,
///   dispatches no attempt twice and folds to its state; no step needed a second attempt;
/// - read_committed: every intent an executor can see is there once, at attempt 1;
/// - the ledger: every receiver operation of every run took effect once (and, when
///   `one_call`, was called once: nothing reached an executor twice), and the run recorded
///   the receiver's answer.
async fn assert_exactly_once(
    stack: &Stack,
    ledger: &LedgerProcess,
    runs: &[String],
    one_call: bool,
) {
    let states = stack
        .wait_for_states("every run to succeed", runs, LONG, succeeded)
        .await;
    let events = stack.events().await;
    let snapshot = ledger.snapshot().await;
    let mut operations = BTreeSet::new();
    for run in runs {
        let state = &states[run];
        check_history(run, &events[run], state);
        assert_eq!(state.steps.len(), 3, "{run}");
        for step in state.steps.values() {
            assert_eq!(step.attempt, 1, "{run} {}: a new attempt", step.step_id);
            if step.tool == "http" {
                let op = &step.operation_id;
                operations.insert(op.clone());
                let (effects, calls) = (snapshot.effects(op), snapshot.calls(op));
                assert_eq!(effects, 1, "{run} {}: one effect", step.step_id);
                if one_call {
                    assert_eq!(calls, 1, "{run} {}: called again", step.step_id);
                }
                let first = snapshot
                    .calls
                    .iter()
                    .find(|c| c.operation_id.as_deref() == Some(op.as_str()))
                    .map(|c| &c.answer);
                assert_eq!(step.output.as_ref(), first, "{run} {}", step.step_id);
            }
        }
    }
    assert_eq!(
        snapshot.total_effects(),
        operations.len(),
        "the ledger holds no effect no run knows of"
    );
    let mut intents: HashMap<(String, i32), usize> = HashMap::new();
    for intent in stack.intents("default").await {
        *intents
            .entry((intent.operation_id, intent.attempt))
            .or_default() += 1;
    }
    assert_eq!(intents.len(), runs.len() * 3);
    assert!(
        intents
            .iter()
            .all(|((_, attempt), n)| *n == 1 && *attempt == 1),
        "an intent twice or re-attempted: {intents:?}"
    );
}

/// Ledger, graph, executor and a reducer that dies at `fault` on its `after`-th pass,
/// with `runs` started. Returns once the reducer has died there.
async fn reducer_dies_at(name: &str, fault: &str, after: u32, n: usize) -> ReducerCrash {
    let stack = Stack::start(name, &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    stack.publish(&chain_graph(&ledger.url)).await;
    let executor = stack.executor_process("executor", &["default"], &[]);
    let after = after.to_string();
    let mut reducer = stack.reducer_with("0", &["--fault", fault, "--fault-after", &after]);
    let runs = runs(n);
    start_runs(&stack, &runs).await;
    let status = reducer.wait_exit(LONG).await;
    assert!(
        status.is_some() && reducer.died_at_fault(),
        "the reducer died at {fault} ({status:?}):\n{}",
        reducer.log_text()
    );
    ReducerCrash {
        stack,
        ledger,
        _executor: executor,
        runs,
    }
}

/// The restarted reducer's gauges started from the tallies stored with its cache (no
/// partition scanned) and count all `runs` as succeeded, none as running.
async fn assert_gauges_from_tallies(restarted: &Process, runs: usize) {
    let counted = restarted.gauges_counted_by();
    assert!(
        !counted.is_empty() && counted.iter().all(|how| how == "snapshot"),
        "every partition's gauges came from its stored tally: {counted:?}"
    );
    restarted
        .wait_for_run_gauges(&[("succeeded", runs as f64), ("running", 0.0)], LONG)
        .await;
}

struct ReducerCrash {
    stack: Stack,
    ledger: LedgerProcess,
    _executor: Process,
    runs: Vec<String>,
}

/// SPEC §10 "reducer killed mid-transaction": it dies after its records were delivered
/// and its offsets sent, before the commit. The restarted instance fences the open
/// transaction (same transactional id), so it is aborted: its records are in the log
/// (read_uncommitted sees them) but no read_committed reader ever does; the inputs are
/// read again and the same records committed once; no executor sees an intent twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reducer_killed_mid_transaction_leaves_nothing_visible_and_nothing_twice() {
    let crash = reducer_dies_at("crash-mid-txn", "reducer.before_commit", 4, 16).await;
    let stack = &crash.stack;
    let restarted = stack.reducer("0");
    assert_exactly_once(stack, &crash.ledger, &crash.runs, true).await;
    // The gauges' tallies are stored with every commit's cache write, so even a restart
    // after a crash starts from them rather than reading every cached run back.
    // Red-proofed: with the tallies stored only at a clean stop, the partitions the
    // crashed reducer had committed to were counted by `scan`.
    assert_gauges_from_tallies(&restarted, crash.runs.len()).await;

    let committed = stack.event_keys(Isolation::ReadCommitted).await;
    let written = stack.event_keys(Isolation::ReadUncommitted).await;
    assert!(
        written.len() > committed.len(),
        "the aborted transaction's events are in the log ({} written, {} committed)",
        written.len(),
        committed.len()
    );
    let committed_set: BTreeSet<_> = committed.iter().cloned().collect();
    assert_eq!(
        committed_set.len(),
        committed.len(),
        "read_committed: nothing twice"
    );
    let written_set: BTreeSet<_> = written.into_iter().collect();
    assert_eq!(
        written_set, committed_set,
        "every aborted event was produced again, from the same inputs, and committed once"
    );
    let intents_written = sortie_tests::read_all(
        &stack.bootstrap,
        &stack.topics.intents("default"),
        Isolation::ReadUncommitted,
    )
    .await
    .len();
    assert!(
        intents_written >= crash.runs.len() * 3,
        "{intents_written} intents written"
    );
    drop(restarted);
}

/// SPEC §10 "reducer killed after commit, before sled write": Kafka has the batch, the
/// cache does not. The restart restores the partitions from the changelog past sled's
/// marker; nothing is lost (every run finishes from where the changelog says) and nothing
/// repeats (no event is written twice, even counting aborted records: the committed
/// batch's inputs are not applied again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reducer_killed_after_commit_before_its_cache_write_restores_from_the_changelog() {
    let crash = reducer_dies_at("crash-after-commit", "reducer.after_commit", 4, 16).await;
    let stack = &crash.stack;
    let restarted = stack.reducer("0");
    assert_exactly_once(stack, &crash.ledger, &crash.runs, true).await;

    let written = stack.event_keys(Isolation::ReadUncommitted).await;
    let unique: BTreeSet<_> = written.iter().collect();
    assert_eq!(unique.len(), written.len(), "no event was written twice");
    let restored: u64 = restarted
        .restored_partitions("records")
        .iter()
        .filter_map(|n| n.parse::<u64>().ok())
        .sum();
    assert!(
        restored > 0,
        "the restart read the batch the cache missed from the changelog:\n{}",
        restarted.own_log_text()
    );
    // The tallies stored with the cache's (older) markers, plus the changes the restore
    // read past them: every run counted once, where it ended. Red-proofed: with the
    // restore not taking a run's share from the cached state it replaces, the runs the
    // cache held as running stayed counted there and this timed out.
    assert_gauges_from_tallies(&restarted, crash.runs.len()).await;
}

/// A restore writes a chunk's states to sled before the chunk's timers and changelog
/// marker. One that dies in between (`reducer.restore_before_marker`, here in the warm
/// restore after a crash past a commit) leaves sled holding states newer than the marker
/// its gauge tally was stored with: counting on from that tally would take a run's share
/// from the newer state and miss its change. So the restore drops a partition's stored
/// tally before it writes, and the next restart counts those partitions' runs from the
/// cache (`scan`); every run ends counted once, where it ended, and nothing repeats.
/// Red-proofed: with the tally kept, the restart took every partition's gauges from its
/// `snapshot` and this failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_killed_between_its_states_and_its_marker_counts_the_runs_again() {
    let crash = reducer_dies_at("crash-mid-restore", "reducer.after_commit", 4, 16).await;
    let stack = &crash.stack;
    let mut restoring = stack.reducer_with("0", &["--fault", "reducer.restore_before_marker"]);
    let status = restoring.wait_exit(LONG).await;
    assert!(
        status.is_some() && restoring.died_at_fault(),
        "the restore died between its states and its marker ({status:?}):\n{}",
        restoring.log_text()
    );
    let restarted = stack.reducer("0");
    assert_exactly_once(stack, &crash.ledger, &crash.runs, true).await;
    let counted = restarted.gauges_counted_by();
    assert!(
        counted.iter().any(|how| how == "scan"),
        "the partitions whose restore died were counted from the cache, not from their \
         stored tally: {counted:?}"
    );
    restarted
        .wait_for_run_gauges(
            &[("succeeded", crash.runs.len() as f64), ("running", 0.0)],
            LONG,
        )
        .await;
}

/// Waits until `reducer`'s gauges show `waiting` runs waiting for approval (each with one
/// open interrupt) and `succeeded` runs succeeded.
async fn wait_for_open_interrupts(reducer: &Process, waiting: usize, succeeded: usize) {
    let url = reducer.metrics_url().await;
    let what = format!("{waiting} open interrupts and {succeeded} succeeded runs");
    sortie_tests::wait_until(&what, LONG, || async {
        let m = sortie_tests::stack::scrape(&url).await;
        let sum =
            |name: &str, labels: &[(&str, &str)]| sortie_tests::stack::metric_sum(&m, name, labels);
        sum("sortie_interrupts_open", &[]) == waiting as f64
            && sum("sortie_runs", &[("status", "waiting_approval")]) == waiting as f64
            && sum("sortie_runs", &[("status", "succeeded")]) == succeeded as f64
    })
    .await;
}

/// A crash with many runs waiting for approval in every partition (70 each: a tally once
/// carried its open interrupts, and was stored with a commit only up to 64 of them). Each
/// commit stores the counts and the changes to the partition's open-interrupt index in
/// sled, so a restart after SIGKILL starts every partition's gauges from them — no scan of
/// the cached runs — and counts every open interrupt; again after some are approved.
/// Red-proofed: before the index (the 64-interrupt limit), every partition of the first
/// restart was counted by `scan`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_after_a_crash_loads_many_open_interrupts_without_a_scan() {
    const PER_PARTITION: usize = 70;
    let stack = Stack::start("crash-open", &[sortie_tests::GATED]).await;
    let _executor = stack.executor_process("executor", &["default"], &[]);
    let mut reducer = stack.reducer("0");
    let partitions = stack.partitions;
    let mut runs = Vec::new();
    let mut per: BTreeMap<i32, usize> = BTreeMap::new();
    for i in 0.. {
        let run = format!("waits-{i}");
        let partition = sortie_wire::partition_for(run.as_bytes(), partitions);
        let n = per.entry(partition).or_default();
        if *n < PER_PARTITION {
            *n += 1;
            runs.push(run);
        }
        if per.len() == partitions as usize && per.values().all(|n| *n == PER_PARTITION) {
            break;
        }
    }
    let commands: Vec<_> = runs
        .iter()
        .map(|run| start_run(run, "gated", r#"{"amount": 3}"#))
        .collect();
    stack.send_many(&commands).await;
    wait_for_open_interrupts(&reducer, runs.len(), 0).await;

    reducer.kill();
    let mut restarted = stack.reducer("0");
    wait_for_open_interrupts(&restarted, runs.len(), 0).await;
    let counted = restarted.gauges_counted_by();
    assert!(
        counted.len() == partitions as usize && counted.iter().all(|how| how == "snapshot"),
        "every partition's gauges came from its stored tally: {counted:?}"
    );

    // Decisions after the restart move the index by changes; a second crash finds them.
    let states = stack.states().await;
    let approved: Vec<_> = runs
        .iter()
        .step_by(7)
        .map(|run| {
            let interrupt = states[run]
                .open_interrupts()
                .next()
                .unwrap_or_else(|| panic!("{run} waits for approval"));
            sortie_tests::stack::approve(run, &format!("approve-{run}"), interrupt)
        })
        .collect();
    stack.send_many(&approved).await;
    let waiting = runs.len() - approved.len();
    wait_for_open_interrupts(&restarted, waiting, approved.len()).await;
    restarted.kill();
    let again = stack.reducer("0");
    wait_for_open_interrupts(&again, waiting, approved.len()).await;
    let counted = again.gauges_counted_by();
    assert!(
        counted.len() == partitions as usize && counted.iter().all(|how| how == "snapshot"),
        "after the second crash too: {counted:?}"
    );
}

/// Waits for `process`, told by a fault point to hang inside a Kafka call, to end itself
/// as a wedged client: status 75 (`sortie_kafka::watchdog::WEDGED_EXIT_CODE`), after the
/// fault's line and the watchdog's, which names the call (`call` is found in the log).
async fn assert_ends_itself_wedged(process: &mut Process, who: &str, call: &str) {
    let status = process.wait_exit(LONG).await;
    let log = process.own_log_text();
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(75),
        "the wedged {who} ended itself with status 75 ({status:?}):\n{log}"
    );
    assert!(
        log.contains("Fault injection")
            && log.contains("on purpose")
            && log.contains("outlived its timeout")
            && log.contains(call),
        "it said which call wedged:\n{log}"
    );
}

/// Issue #17: librdkafka's `send_offsets_to_transaction` can block past its timeout for
/// good when the group coordinator's broker dies (librdkafka#5456, #5511). A reducer told
/// to hang there on its 4th batch (`reducer.hang_in_send_offsets`: the thread parks inside
/// the watchdog's bound, its transaction open) must end itself with status 75 once the
/// call is past its 10 s timeout and the grace (1 s here), instead of holding its
/// partitions forever; started again, as its supervisor would, it fences the open
/// transaction and every run finishes with each effect once.
///
/// Checked red: with the watchdog thread not started, the reducer never exits
/// ("the wedged reducer ended itself with status 75 … None").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reducer_wedged_in_a_kafka_call_ends_itself_and_its_restart_loses_nothing() {
    let stack = Stack::start("crash-wedged", &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    stack.publish(&chain_graph(&ledger.url)).await;
    let _executor = stack.executor_process("executor", &["default"], &[]);
    let mut reducer = stack.reducer_with(
        "0",
        &[
            "--fault",
            "reducer.hang_in_send_offsets",
            "--fault-after",
            "4",
            "--stall-grace-ms",
            "1000",
        ],
    );
    let runs = runs(16);
    start_runs(&stack, &runs).await;
    assert_ends_itself_wedged(&mut reducer, "reducer", "send_offsets_to_transaction").await;
    let _restarted = stack.reducer("0");
    assert_exactly_once(&stack, &ledger, &runs, true).await;
}

/// The executor's side of the watchdog (`sortie_kafka::watchdog`): a synchronous offset
/// commit waits for librdkafka with no timeout of its own, and an executor whose consumer
/// thread stops there serves its queue no more, silently (a broker-restart test once saw
/// an executor go quiet for good after a rebalance). Told to hang in its first commit
/// (`executor.hang_in_commit`: the thread parks inside the watchdog's bound), the
/// executor must end itself with status 75 once the commit is past its bound
/// (session timeout 6 s + `socket.timeout.ms` 10 s here) and the grace (1 s); started
/// again, as its supervisor would, it takes the uncommitted intents back and every run
/// finishes with each effect once (the receiver may be called twice: keyed).
///
/// Checked red: with the executor's commit outside the watchdog's bound, it never exits
/// ("the wedged executor ended itself with status 75 … None").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_wedged_in_an_offset_commit_ends_itself_and_its_restart_loses_nothing() {
    executor_ends_itself_and_its_restart_loses_nothing(
        "crash-wedged-executor",
        "executor.hang_in_commit",
        "socket.timeout.ms=10000\n",
        "call=\"commit\"",
    )
    .await;
}

/// An executor whose consumer leaves its group and polls on — serving nothing and saying
/// nothing, as one did after a rebalance in a CI run — ends itself once it has stayed
/// outside a settled group, its coordinator answering, past its rejoin bound
/// (`max.poll.interval.ms` + session timeout, here 10 + 10 s, from librdkafka's
/// statistics every 5 s), and its restart serves the queue: nothing lost, nothing twice.
/// Red-proofed: with the membership watchdog not fed, the executor never exited and this
/// failed at its 90 s deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_that_never_rejoins_its_group_ends_itself_and_its_restart_loses_nothing() {
    executor_ends_itself_and_its_restart_loses_nothing(
        "crash-rejoin",
        "executor.leave_group",
        "max.poll.interval.ms=10000\n",
        "call=\"rejoining the consumer group\"",
    )
    .await;
}

/// A reducer whose consumer leaves its group and polls on (reducing nothing, saying
/// nothing) ends itself the same way once it has stayed outside a settled group past
/// `max.poll.interval.ms` + session timeout (10 + 10 s here) and the grace; its restart
/// finishes every run, each receiver operation called once.
/// Red-proofed: with the reducer's statistics not feeding its membership watchdog, it
/// never exited and this failed at its 90 s deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reducer_that_never_rejoins_its_group_ends_itself_and_its_restart_loses_nothing() {
    let stack = Stack::start("crash-reducer-rejoin", &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    stack.publish(&chain_graph(&ledger.url)).await;
    let _executor = stack.executor_process("executor", &["default"], &[]);
    // The reducer's other consumers (graph table, restore) take librdkafka's session
    // timeout (45 s), which may not exceed their poll interval.
    let properties = "session.timeout.ms=10000\nmax.poll.interval.ms=10000\n";
    let file = properties_file(&stack, "reducer.properties", properties);
    let mut reducer = stack.reducer_with(
        "0",
        &[
            "--fault",
            "reducer.leave_group",
            "--stall-grace-ms",
            "1000",
            "--kafka-properties",
            &file,
        ],
    );
    let runs = runs(8);
    start_runs(&stack, &runs).await;
    assert_ends_itself_wedged(
        &mut reducer,
        "reducer",
        "call=\"rejoining the consumer group\"",
    )
    .await;
    let _restarted = stack.reducer("0");
    assert_exactly_once(&stack, &ledger, &runs, true).await;
}

/// An executor told to stop serving at `fault` (with librdkafka `properties` and a 1 s
/// grace) ends itself with status 75, naming `call`; started again, as its supervisor
/// would, it takes the uncommitted intents back and every run finishes with each effect
/// once (the receiver may be called twice: keyed).
async fn executor_ends_itself_and_its_restart_loses_nothing(
    name: &str,
    fault: &str,
    properties: &str,
    call: &str,
) {
    let stack = Stack::start(name, &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    stack.publish(&chain_graph(&ledger.url)).await;
    let file = properties_file(&stack, "executor.properties", properties);
    let args = [
        "--fault",
        fault,
        "--stall-grace-ms",
        "1000",
        "--kafka-properties",
        &file,
    ];
    let mut executor = stack.executor_process("executor", &["default"], &args);
    let _reducer = stack.reducer("0");
    let runs = runs(8);
    start_runs(&stack, &runs).await;
    assert_ends_itself_wedged(&mut executor, "executor", call).await;
    let _restarted = stack.executor_process("executor", &["default"], &[]);
    assert_exactly_once(&stack, &ledger, &runs, false).await;
}

/// Issue #13, the commit pipeline: the loop folds batch N+1 while batch N's transaction
/// is in flight, on N's after-states. If N then aborts, N+1 must go with it and the
/// consumer must seek back to the first offset *either* batch read: N+1 kept would apply
/// N's inputs a second time on top of their own effects; a seek to N's offsets only would
/// skip what N+1 read of other partitions. `reducer.abort_in_flight` aborts a batch
/// in flight once, at the moment its deliveries are in and the next batch holds inputs;
/// the reducer carries on with the same clients. Every run must finish with each effect
/// and each intent once, and read_committed readers see each event once.
///
/// The fault holds a batch in flight (up to half a second) until the next one has read a
/// run from it, so the duplicate starts below make the case certain, not lucky.
///
/// Checked red: with `Engine::failed` keeping the open batch, runs never finish (the
/// re-read original StartRun meets the kept duplicate's state and is taken as a
/// duplicate: the run's start is lost). That the rewind covers partitions only the later
/// batch read is `sortie-reducer`'s `batch::tests::an_abort_rewinds_every_partition_…`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_batch_in_flight_takes_the_batch_folded_on_it_along() {
    let stack = Stack::start("crash-abort-in-flight", &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    stack.publish(&chain_graph(&ledger.url)).await;
    let _executor = stack.executor_process("executor", &["default"], &[]);
    // A batch of one input is full: it goes in flight (a small batch that commits on idle
    // is committed at once, with nothing folded meanwhile).
    let mut reducer = stack.reducer_with(
        "0",
        &["--fault", "reducer.abort_in_flight", "--max-batch", "1"],
    );
    let runs = runs(48);
    let start = |i: usize| start_run(&runs[i], "chain", &format!(r#"{{"order": {i}}}"#));
    // The first run alone: the reducer is in its group and consuming.
    stack.send(&start(0)).await;
    stack
        .wait_for_states("the first run", &runs[..1], LONG, succeeded)
        .await;
    // Then a client that sends every start twice: a duplicate that lands in the batch
    // after its original's reads the run from the batch in flight (the fault waits for
    // that).
    for i in 1..runs.len() {
        stack.send(&start(i)).await;
        stack.send(&start(i)).await;
    }
    assert_exactly_once(&stack, &ledger, &runs, true).await;
    assert!(
        reducer.is_running(),
        "the reducer survives an aborted batch"
    );
    let log = reducer.own_log_text();
    assert!(
        log.contains("takes this fault on purpose")
            && log.contains("folded on an aborted one; it is read again too"),
        "a batch in flight was aborted with the next one folded on it:\n{log}"
    );
    let committed = stack.event_keys(Isolation::ReadCommitted).await;
    let unique: BTreeSet<_> = committed.iter().collect();
    assert_eq!(
        unique.len(),
        committed.len(),
        "read_committed: nothing twice"
    );
    let written = stack.event_keys(Isolation::ReadUncommitted).await;
    assert!(
        written.len() > committed.len(),
        "the aborted transaction's events are in the log, never committed"
    );
}

/// "Errors never commit": an input that fails halfway through the fold — after the fold
/// took its run's state out of the open batch, as an unreachable key store, registry or
/// graph table fails it (`reducer.fail_mid_fold`) — leaves that batch broken. The reducer
/// drops it (never commits it), seeks back to its first offsets only and goes on with
/// the same clients; the batch in flight, which was whole, still commits. Every run
/// finishes with each effect and each intent once, histories gap-free with no `seq` used
/// twice, and read_committed readers see each event once.
///
/// Checked red: with `Engine::start_sending` taking a broken batch like any other (the
/// old path: the error returned, and the consumer's revocation committed the open
/// batch), the failing StartRun's offset was committed without its run: that run never
/// started and the test timed out waiting for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_mid_fold_commits_nothing_and_loses_nothing() {
    let stack = Stack::start("crash-mid-fold", &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    stack.publish(&chain_graph(&ledger.url)).await;
    let _executor = stack.executor_process("executor", &["default"], &[]);
    // Batches of several inputs: the failing one is met with others before it.
    let mut reducer = stack.reducer_with(
        "0",
        &[
            "--fault",
            "reducer.fail_mid_fold",
            "--fault-after",
            "7",
            "--batch-linger-ms",
            "200",
        ],
    );
    let runs = runs(24);
    start_runs(&stack, &runs).await;
    assert_exactly_once(&stack, &ledger, &runs, true).await;
    assert!(reducer.is_running(), "the reducer goes on after the error");
    let log = reducer.own_log_text();
    assert!(
        log.contains("takes this fault on purpose")
            && log.contains("could not be applied whole; the open batch is dropped"),
        "the error met the fold and its batch was dropped:\n{log}"
    );
    let committed = stack.event_keys(Isolation::ReadCommitted).await;
    let unique: BTreeSet<_> = committed.iter().collect();
    assert_eq!(
        unique.len(),
        committed.len(),
        "read_committed: nothing twice"
    );
}

/// "One unreadable thing never stops a partition for everyone", the reducer's cache: a
/// cached run state that does not read back (`reducer.unreadable_cache`) is not taken
/// for "no such run" and does not end the process. Its entry goes, its partition is
/// restored from the changelog (the clients are rebuilt for the assignment), and every
/// run goes on from there: the approvals sent after the restart all take effect, once.
///
/// Checked red: with the unreadable entry returned as the store's corruption (the old
/// path), the reducer invalidated the whole cache and exited, and no run finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_cache_entry_restores_its_partition_and_the_runs_go_on() {
    let stack = Stack::start("crash-unreadable-cache", &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    stack.publish(&gated_graph(&ledger.url)).await;
    let _executor = stack.executor_process("executor", &["default"], &[]);
    let runs = runs(8);
    let mut first = stack.reducer("0");
    for (i, run) in runs.iter().enumerate() {
        stack
            .send(&start_run(run, "gated", &format!(r#"{{"amount": {i}}}"#)))
            .await;
    }
    let waiting = stack
        .wait_for_states("every run to wait for approval", &runs, LONG, |s| {
            s.status == RunStatus::WaitingApproval
        })
        .await;
    first.stop();
    // A new incarnation on the same cache: nothing is hot, so the first approval reads
    // its run from sled, and that read fails.
    let mut reducer = stack.reducer_with("0", &["--fault", "reducer.unreadable_cache"]);
    for run in &runs {
        let interrupt = waiting[run]
            .open_interrupts()
            .next()
            .expect("an open interrupt")
            .clone();
        stack
            .send(&sortie_tests::stack::approve(
                run,
                &format!("approve-{run}"),
                &interrupt,
            ))
            .await;
    }
    let states = stack
        .wait_for_states("every approved run to succeed", &runs, LONG, succeeded)
        .await;
    let events = stack.events().await;
    let snapshot = ledger.snapshot().await;
    for run in &runs {
        check_history(run, &events[run], &states[run]);
        let refund = states[run]
            .steps
            .values()
            .find(|step| step.node == "refund")
            .expect("a refund step");
        assert_eq!(
            snapshot.effects(&refund.operation_id),
            1,
            "{run}: one refund"
        );
    }
    assert!(reducer.is_running(), "the reducer goes on");
    let log = reducer.own_log_text();
    assert!(
        log.contains("cannot be read; its partition is restored from the changelog"),
        "the unreadable entry's partition was restored again:\n{log}"
    );
}

/// A `--kafka-properties` file with `socket.timeout.ms=10000` (librdkafka's default is
/// 60 s): the executor's commit bound (session + socket timeout) then fits a test's wait.
fn short_socket_timeout(stack: &Stack) -> String {
    properties_file(stack, "executor.properties", "socket.timeout.ms=10000\n")
}

/// Writes `contents` to the `--kafka-properties` file `name` in the stack's directory;
/// returns its path.
fn properties_file(stack: &Stack, name: &str, contents: &str) -> String {
    let file = stack.dir.join(name);
    std::fs::write(&file, contents).expect("properties file");
    file.display().to_string()
}

/// SPEC §10 "broker restarted mid-run": a broker of this test's own (the shared one
/// serves the suites running beside it) is stopped with runs in flight and started again
/// on its data; every service rides it out. The runs started before and after all finish,
/// each receiver operation took effect once, and read_committed readers see each event
/// and intent once.
///
/// Reducer and executor run supervised, as in production: a librdkafka call wedged by the
/// broker's restart (seen once in CI: the executor silent for good after its revocation)
/// ends the service with status 75 within its bound — for the executor here session
/// 6 s + `socket.timeout.ms` 10 s, the poll's 3 + 2 × 16 + 10 s, plus 5 s of grace — and
/// the supervisor starts it again, as `sortie dev` and the kubelet do. Checked once with
/// the executor's `executor.hang_in_commit` fault added (and dropped from the restart's
/// arguments): it ended itself 21 s after hanging, was started again, and the test passed
/// in 37 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restarted_mid_run_loses_nothing() {
    let broker = sortie_tests::stack::PrivateBroker::start("crash-broker").await;
    let stack = Stack::builder("crash-broker")
        .on(broker.bootstrap())
        .start()
        .await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    stack.publish(&chain_graph(&ledger.url)).await;
    let properties = short_socket_timeout(&stack);
    let executor = stack
        .executor_process(
            "executor",
            &["default"],
            &[
                "--stall-grace-ms",
                "5000",
                "--kafka-properties",
                &properties,
            ],
        )
        .supervised();
    let reducer = stack.reducer("0").supervised();
    // Slow receiver calls, so runs are mid-flight when the broker goes.
    ledger.fault(json!({"delay_ms": 1000, "times": 1000})).await;
    let all = runs(16);
    let (before, after) = all.split_at(8);
    start_runs(&stack, before).await;
    sortie_tests::wait_until("the first receiver call", LONG, || async {
        ledger.snapshot().await.total_effects() >= 1
    })
    .await;
    let effects = ledger.snapshot().await.total_effects();
    assert!(
        effects < 2 * before.len(),
        "runs were in flight at the restart"
    );
    broker.stop().await;
    tokio::time::sleep(Duration::from_secs(2)).await; // down for a moment, not just a blip
    broker.ensure_running().await;
    for (i, run) in after.iter().enumerate() {
        stack
            .send(&start_run(
                run,
                "chain",
                &format!(r#"{{"order": {}}}"#, 100 + i),
            ))
            .await;
    }
    // Room for one wedged service's bound and restart before the usual wait.
    stack
        .wait_for_states("every run to succeed", &all, 2 * LONG, succeeded)
        .await;
    // A call whose result could not be delivered while the broker was away is made again
    // with the same key (the keyed contract): one effect, perhaps two calls.
    assert_exactly_once(&stack, &ledger, &all, false).await;
    if executor.restarts() + reducer.restarts() > 0 {
        eprintln!(
            "restarted after a wedge: executor {} time(s), reducer {}",
            executor.restarts(),
            reducer.restarts()
        );
    }
}

// ---------------------------------------------------------------- the gateway

const ALICE: &str = "acme:user:alice:approver:tok-alice";

fn gated_graph(ledger: &str) -> String {
    format!(
        r#"
id: gated
version: 1
nodes:
  - {{id: prepare, tool: echo, side_effect: pure}}
  - id: refund
    tool: http
    side_effect: keyed
    args: {{amount: $input.amount}}
    config: {{url: "{ledger}/effects/refund"}}
    interrupt_before: {{reason: refunds need a human, required_role: approver, timeout: 24h}}
edges:
  - {{from: prepare, to: refund}}
"#
    )
}

/// POSTs `body` with an Idempotency-Key; `None` when the connection failed (the gateway
/// died before answering).
async fn post(url: &str, path: &str, key: &str, body: &Value) -> Option<(u16, Value)> {
    let response = reqwest::Client::new()
        .post(format!("{url}{path}"))
        .bearer_auth("tok-alice")
        .header(sortie_gateway::IDEMPOTENCY_HEADER, key)
        .json(body)
        .send()
        .await
        .ok()?;
    let status = response.status().as_u16();
    Some((status, response.json().await.unwrap_or(Value::Null)))
}

/// A gateway that dies at `gateway.after_publish` on the request; checks it did, then
/// answers the identical retry from a healthy gateway.
async fn dies_then_retried(stack: &Stack, path: &str, key: &str, body: Value) -> (u16, Value) {
    let data = stack.dir.join("gateway");
    let (mut faulty, url) = stack
        .gateway_process_with(&data, &[ALICE], &["--fault", "gateway.after_publish"])
        .await;
    let lost = post(&url, path, key, &body).await;
    assert!(
        lost.is_none(),
        "no answer from a gateway that died: {lost:?}"
    );
    assert!(
        faulty.wait_exit(LONG).await.is_some() && faulty.died_at_fault(),
        "the gateway died after publishing:\n{}",
        faulty.log_text()
    );
    // The client retries once the first copy was applied (it never got the answer); a
    // retry racing the first copy into one batch is applied once too, but is then
    // answered with the first copy's answer (`duplicate: false`).
    sortie_tests::wait_until("the reducer to answer the first copy", LONG, || async {
        stack
            .events()
            .await
            .values()
            .flatten()
            .any(|e| e.command_id.as_deref() == Some(key))
    })
    .await;
    let (_healthy, url) = stack.gateway_process(&data, &[ALICE]).await;
    post(&url, path, key, &body)
        .await
        .expect("the healthy gateway answers")
}

/// SPEC §10 "duplicate StartRun / ResumeRun / CancelRun", through the gateway dying after
/// it published each command and before it answered: the client's identical retry (same
/// Idempotency-Key, so the same command id) is answered as a duplicate and applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_after_publishing_applies_each_retried_command_once() {
    let stack = Stack::start("crash-gateway", &[]).await;
    let ledger = stack.ledger_process("ledger", "keyed").await;
    stack.publish(&gated_graph(&ledger.url)).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor_process("executor", &["default"], &[]);

    let start = |run: &str| json!({"graph_id": "gated", "run_id": run, "input": {"amount": 30}});
    let (status, answer) = dies_then_retried(&stack, "/v1/runs", "start-a", start("run-a")).await;
    assert_eq!(
        (status, &answer["duplicate"]),
        (201, &json!(true)),
        "{answer}"
    );
    stack
        .send(&start_run("run-b", "gated", r#"{"amount": 5}"#))
        .await;
    let runs = ["run-a".to_owned(), "run-b".to_owned()];
    let waiting = stack
        .wait_for_states("both runs to wait for approval", &runs, LONG, |s| {
            s.status == RunStatus::WaitingApproval
        })
        .await;
    let interrupt = |run: &str| {
        waiting[run]
            .interrupts
            .keys()
            .next()
            .expect("an interrupt")
            .clone()
    };

    let approve = json!({"decision": "approve", "interrupt_id": interrupt("run-a")});
    let (status, answer) =
        dies_then_retried(&stack, "/v1/runs/run-a/resume", "approve-a", approve).await;
    assert_eq!(
        (status, &answer["duplicate"]),
        (200, &json!(true)),
        "{answer}"
    );
    let cancel = json!({"reason": "changed my mind"});
    let (status, answer) =
        dies_then_retried(&stack, "/v1/runs/run-b/cancel", "cancel-b", cancel).await;
    assert_eq!(
        (status, &answer["duplicate"]),
        (200, &json!(true)),
        "{answer}"
    );

    let states = stack
        .wait_for_states("both runs to end", &runs, LONG, |s| s.status.is_terminal())
        .await;
    assert_eq!(states["run-a"].status, RunStatus::Succeeded);
    assert_eq!(states["run-b"].status, RunStatus::Cancelled);
    let events = stack.events().await;
    let mut applied: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for run in &runs {
        check_history(run, &events[run], &states[run]);
        for event in &events[run] {
            if let EventBody::CommandAccepted {
                command_id,
                duplicate,
                ..
            } = &event.body
            {
                let entry = applied.entry(command_id.clone()).or_default();
                if *duplicate {
                    entry.1 += 1;
                } else {
                    entry.0 += 1;
                }
            }
        }
    }
    for key in ["start-a", "approve-a", "cancel-b"] {
        assert_eq!(
            applied.get(key),
            Some(&(1, 1)),
            "{key}: applied once, its retry answered as a duplicate: {applied:?}"
        );
    }
    let decided = events["run-a"]
        .iter()
        .filter(|e| matches!(e.body, EventBody::InterruptDecided { .. }))
        .count();
    assert_eq!(decided, 1, "one decision recorded");
    let refund = &states["run-a"].steps["refund#1"].operation_id;
    let snapshot = ledger.snapshot().await;
    assert_eq!(
        (
            snapshot.effects(refund),
            snapshot.calls(refund),
            snapshot.total_effects()
        ),
        (1, 1, 1),
        "the approved refund ran once; the cancelled one never: {snapshot:#?}"
    );
}

// ---------------------------------------------------------------- found by the soak

/// A reconcilable attempt that times out before any executor took it is re-dispatched as
/// attempt 2; an executor that then starts gets both attempts. It runs one attempt of an
/// operation at a time (its intents share a partition), so the later attempt's lookup
/// sees the earlier one's effect: one effect, as SPEC §10 promises. Found by the soak
/// (seed 1795947140307420890 with `SORTIE_SOAK_RECON_TIMEOUT=3s`), when both attempts
/// ran at once, both heard "not found" and both called.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcilable_attempts_never_both_call_the_receiver() {
    let stack = Stack::start("crash-recon-race", &[]).await;
    let ledger = stack.ledger_process("ledger", "reconcilable").await;
    let graph = format!(
        r#"
id: book
version: 1
nodes:
  - id: book
    tool: http
    side_effect: reconcilable
    args: {{n: 1}}
    config: {{url: "{l}/effects/book", status_url: "{l}/status", lookup_authoritative: true}}
    timeout: 1s
    retry: {{max_attempts: 5, initial_backoff: 100ms, max_backoff: 200ms, multiplier: 2.0, jitter: 0.1}}
edges: []
"#,
        l = ledger.url
    );
    stack.publish(&graph).await;
    let _reducer = stack.reducer("0");
    let run = "run-race".to_owned();
    stack.send(&start_run(&run, "book", "{}")).await;
    // No executor yet: attempt 1 times out and attempt 2 is dispatched.
    stack
        .wait_for_states("attempt 2", std::slice::from_ref(&run), LONG, |s| {
            s.steps.get("book#1").is_some_and(|b| b.attempt >= 2)
        })
        .await;
    let _executor = stack.executor_process("executor", &["default"], &[]);
    let states = stack
        .wait_for_states(
            "the run to succeed",
            std::slice::from_ref(&run),
            LONG,
            succeeded,
        )
        .await;
    let op = &states[&run].steps["book#1"].operation_id;
    let snapshot = ledger.snapshot().await;
    assert_eq!(snapshot.effects(op), 1, "{snapshot:#?}");
}
