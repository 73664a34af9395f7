//! A randomized soak: many concurrent runs of mixed graphs (keyed, reconcilable, unsafe
//! and idempotent receiver calls; approval gates that are approved, rejected, cancelled or
//! left waiting; runs cancelled in flight; duplicate commands), started through the gateway
//! and straight on Kafka, while the reducer, the executor and the gateway are killed at
//! random fault points (and by SIGKILL) on a schedule drawn from a seed, and a second
//! reducer instance joins the group and leaves it again (SIGTERM), so partitions move
//! between live reducers too.
//!
//! At the end every run is terminal or waits on a human or an operator, the ledgers match
//! every run's recorded effects, every committed history is gap-free and folds to its
//! state, no intent is visible twice, and `sortie audit replay --verify` finds no
//! divergence.
//!
//! The seed is printed first; `SORTIE_SOAK_SEED=<seed>` replays the same workload and fault
//! schedule (process timing still varies). The bounded variant runs in CI; the long one is
//! `dev/soak.sh` (`SORTIE_SOAK_RUNS`, `SORTIE_SOAK_FAULTS`, `SORTIE_SOAK_SEED`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sortie_core::state::StepStatus;
use sortie_core::{RunState, RunStatus};
use sortie_tests::stack::{check_history, command, start_run, LedgerProcess, Process, Rng, Stack};
use sortie_wire::records as w;

const ALICE: &str = "acme:user:alice:approver:tok-alice";

/// How big a soak is.
#[derive(Debug, Clone, Copy)]
struct Plan {
    seed: u64,
    runs: usize,
    faults: usize,
    /// Pause between two run starts.
    spacing: Duration,
    /// How long the runs may take to settle once the last fault is over.
    settle: Duration,
}

impl Plan {
    fn seed() -> u64 {
        sortie_tests::stack::seed_from_env("SORTIE_SOAK_SEED")
    }

    fn env(name: &str, default: usize) -> usize {
        sortie_tests::stack::env_number(name, default)
    }
}

// ---------------------------------------------------------------- graphs

/// The reconcilable step's timeout: `SORTIE_SOAK_RECON_TIMEOUT`, else drawn from the seed,
/// `3s` or `8s` as often.
///
/// `3s` is shorter than the executor outages this soak causes, so an attempt the down
/// executor never took is dispatched again and a restarted executor holds two attempts of
/// one operation: the case that found the executor running both at once (it now runs one
/// attempt of an operation at a time, and an attempt past its deadline not at all;
/// `crash.rs` `reconcilable_attempts_never_both_call_the_receiver` keeps it). `8s` soaks
/// the path where the first attempt is the one that calls.
fn recon_timeout(seed: u64) -> String {
    std::env::var("SORTIE_SOAK_RECON_TIMEOUT")
        .unwrap_or_else(|_| if seed % 2 == 0 { "3s" } else { "8s" }.to_owned())
}

fn graphs(keyed: &str, recon: &str, plain: &str, recon_timeout: String) -> Vec<String> {
    let http = |class: &str, url: String, extra: &str| {
        let timeout = if class == "reconcilable" {
            recon_timeout.as_str()
        } else {
            "3s"
        };
        format!(
            "tool: http\n    side_effect: {class}\n    config: {{url: \"{url}\"{extra}}}\n    timeout: {timeout}\n    retry: {{max_attempts: 8, initial_backoff: 200ms, max_backoff: 1s, multiplier: 2.0, jitter: 0.1}}"
        )
    };
    vec![
        // A keyed reservation, a reconcilable booking, an echo.
        format!(
            "id: order\nversion: 1\nnodes:\n  - id: reserve\n    args: {{n: $input.n}}\n    {}\n  - id: book\n    args: {{n: $input.n, seq: $steps.reserve.output.ledger_seq}}\n    {}\n  - {{id: receipt, tool: echo, side_effect: pure, args: {{seq: $steps.book.output.ledger_seq}}}}\nedges:\n  - {{from: reserve, to: book}}\n  - {{from: book, to: receipt}}\n",
            http("keyed", format!("{keyed}/effects/reserve"), ""),
            http(
                "reconcilable",
                format!("{recon}/effects/book"),
                // The ledger's lookup is authoritative (it reads the records its calls wrote).
                &format!(", status_url: \"{recon}/status\", lookup_authoritative: true"),
            ),
        ),
        // An unsafe notification between a pure step and a sleep.
        format!(
            "id: notify\nversion: 1\nnodes:\n  - {{id: draft, tool: echo, side_effect: pure, args: {{n: $input.n}}}}\n  - id: send\n    args: {{n: $input.n}}\n    {}\n  - {{id: nap, tool: sleep, side_effect: pure, args: {{ms: 20}}}}\nedges:\n  - {{from: draft, to: send}}\n  - {{from: send, to: nap}}\n",
            http("unsafe", format!("{plain}/effects/send"), ""),
        ),
        // An approval gate before an idempotent refund.
        format!(
            "id: refund\nversion: 1\nnodes:\n  - {{id: prepare, tool: echo, side_effect: pure, args: {{n: $input.n}}}}\n  - id: pay\n    args: {{n: $input.n}}\n    interrupt_before: {{reason: refunds need a human, required_role: approver, timeout: 24h}}\n    {}\nedges:\n  - {{from: prepare, to: pay}}\n",
            http("idempotent", format!("{keyed}/effects/refund"), ""),
        ),
    ]
}

/// Which ledger a node's calls go to.
fn ledger_of(node: &str) -> &'static str {
    match node {
        "book" => "recon",
        "send" => "plain",
        _ => "keyed",
    }
}

// ---------------------------------------------------------------- the services

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Service {
    Reducer,
    Executor,
    Gateway,
    /// A second reducer instance (dynamic membership) that joins the group and later
    /// leaves it (SIGTERM): partitions move away from reducer 0 and back, with batches
    /// open and intents out.
    SecondReducer,
}

/// One scheduled fault: at `at` (from the start), replace `service`'s process by one that
/// dies at `point` (the reducer: on its `after`-th pass), or (no point) just SIGKILL it.
/// For [`Service::SecondReducer`] the point is `"join"` or `"leave"`.
#[derive(Debug, Clone)]
struct Fault {
    at: Duration,
    service: Service,
    point: Option<&'static str>,
    after: u32,
}

fn schedule(rng: &mut Rng, plan: &Plan, window: Duration) -> Vec<Fault> {
    let mut faults: Vec<Fault> = Vec::new();
    for i in 0..plan.faults {
        // Every service at least once (and a membership change), then mostly the reducer
        // and the executor.
        let service = *rng.pick(&[
            Service::Reducer,
            Service::Reducer,
            Service::Executor,
            Service::Executor,
            Service::Gateway,
            Service::SecondReducer,
        ]);
        let service = [
            Service::Reducer,
            Service::Executor,
            Service::Gateway,
            Service::SecondReducer,
        ]
        .get(i)
        .copied()
        .unwrap_or(service);
        let point = match service {
            Service::Reducer => *rng.pick(&[
                Some("reducer.before_commit"),
                Some("reducer.after_commit"),
                None,
            ]),
            Service::Executor => *rng.pick(&[
                Some("executor.before_call"),
                Some("executor.after_call"),
                Some("executor.after_result"),
                None,
            ]),
            Service::Gateway => *rng.pick(&[Some("gateway.after_publish"), None]),
            Service::SecondReducer => Some("join"),
        };
        let at = window.mul_f64(rng.below(1000) as f64 / 1000.0);
        let after = 1 + rng.below(6) as u32;
        if service == Service::SecondReducer {
            // It joins in the first two thirds of the window and leaves 2-5 s later,
            // within the window, so the soak takes no longer than it did.
            let at = at.mul_f64(0.66);
            let stay = Duration::from_millis(2000 + rng.below(3000));
            faults.push(Fault {
                at,
                service,
                point,
                after,
            });
            faults.push(Fault {
                at: at + stay,
                service,
                point: Some("leave"),
                after,
            });
            continue;
        }
        faults.push(Fault {
            at,
            service,
            point,
            after,
        });
    }
    faults.sort_by_key(|f| f.at);
    faults
}

/// The reducer, the executor and the gateway as processes, each restarted when it dies;
/// the gateway's current URL is shared with the clients.
struct Services<'s> {
    stack: &'s Stack,
    reducer: Process,
    executor: Process,
    gateway: Process,
    /// The second reducer while it is a member.
    second: Option<Process>,
    url: Arc<Mutex<String>>,
    /// Deaths seen: (service, how).
    deaths: Vec<(Service, String)>,
    /// Membership changes applied: "join" / "leave".
    membership: Vec<String>,
    armed: BTreeMap<Service, String>,
}

impl<'s> Services<'s> {
    async fn start(stack: &'s Stack) -> Services<'s> {
        let (gateway, url) = Self::gateway(stack, &[]).await;
        Services {
            stack,
            reducer: Self::reducer(stack, &[]),
            executor: Self::executor(stack, &[]),
            gateway,
            second: None,
            url: Arc::new(Mutex::new(url)),
            deaths: Vec::new(),
            membership: Vec::new(),
            armed: BTreeMap::new(),
        }
    }

    fn reducer(stack: &Stack, fault: &[&str]) -> Process {
        let mut args = vec!["--static-membership"];
        args.extend_from_slice(fault);
        stack.reducer_with("0", &args)
    }

    fn executor(stack: &Stack, fault: &[&str]) -> Process {
        let mut args = vec!["--static-membership"];
        args.extend_from_slice(fault);
        stack.executor_process("executor", &["default"], &args)
    }

    async fn gateway(stack: &Stack, fault: &[&str]) -> (Process, String) {
        stack
            .gateway_process_with(&stack.dir.join("gateway"), &[ALICE], fault)
            .await
    }

    fn process(&mut self, service: Service) -> &mut Process {
        match service {
            Service::Reducer | Service::SecondReducer => &mut self.reducer,
            Service::Executor => &mut self.executor,
            Service::Gateway => &mut self.gateway,
        }
    }

    /// The second reducer joins (`"join"`) or leaves with a clean SIGTERM (`"leave"`).
    fn membership(&mut self, what: &str) {
        match (what, self.second.take()) {
            ("join", None) => {
                self.second = Some(self.stack.reducer("1"));
                self.membership.push("join".to_owned());
            }
            ("leave", Some(mut second)) => {
                tokio::task::block_in_place(|| second.stop());
                self.membership.push("leave".to_owned());
            }
            (_, second) => self.second = second,
        }
    }

    /// Replaces `service`'s process by a new one (armed with `fault` if given).
    async fn restart(&mut self, service: Service, fault: Option<(&str, u32)>) {
        self.process(service).kill();
        let after = fault.map(|(_, n)| n.to_string()).unwrap_or_default();
        let args: Vec<&str> = match fault {
            Some((point, _)) if service == Service::Reducer => {
                vec!["--fault", point, "--fault-after", &after]
            }
            Some((point, _)) => vec!["--fault", point],
            None => vec![],
        };
        match fault {
            Some((point, _)) => self.armed.insert(service, point.to_owned()),
            None => self.armed.remove(&service),
        };
        match service {
            Service::Reducer => self.reducer = Self::reducer(self.stack, &args),
            Service::Executor => self.executor = Self::executor(self.stack, &args),
            Service::Gateway => {
                let (process, url) = Self::gateway(self.stack, &args).await;
                self.gateway = process;
                *self.url.lock().expect("url") = url;
            }
            Service::SecondReducer => {}
        }
    }

    /// Restarts (clean) every service that has died since the last look.
    async fn supervise(&mut self) {
        for service in [Service::Reducer, Service::Executor, Service::Gateway] {
            let process = self.process(service);
            if process.try_exit().is_some() {
                let how = if process.died_at_fault() {
                    self.armed.get(&service).cloned().unwrap_or_default()
                } else {
                    "exit".to_owned()
                };
                self.deaths.push((service, how));
                self.restart(service, None).await;
            }
        }
        if let Some(second) = self.second.as_mut() {
            if second.try_exit().is_some() {
                self.deaths
                    .push((Service::SecondReducer, "exit".to_owned()));
                self.second = None;
            }
        }
    }

    async fn apply(&mut self, fault: &Fault) {
        if fault.service == Service::SecondReducer {
            self.membership(fault.point.unwrap_or("join"));
            return;
        }
        match fault.point {
            Some(point) => {
                self.restart(fault.service, Some((point, fault.after)))
                    .await
            }
            None => {
                self.deaths.push((fault.service, "SIGKILL".to_owned()));
                self.restart(fault.service, None).await;
            }
        }
    }

    /// Ends the chaos: every still-armed process is replaced by a clean one.
    async fn disarm(&mut self) {
        let armed: Vec<Service> = self.armed.keys().copied().collect();
        for service in armed {
            self.restart(service, None).await;
        }
    }
}

// ---------------------------------------------------------------- clients

/// What the soak asked of one run, decided by the seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gate {
    Approve,
    Reject,
    Cancel,
    Leave,
}

#[derive(Debug, Clone)]
struct RunPlan {
    run_id: String,
    graph: &'static str,
    via_gateway: bool,
    /// Send the StartRun twice on Kafka.
    duplicate: bool,
    /// Cancel right after starting.
    cancel: bool,
    gate: Gate,
}

/// POSTs through whichever gateway is current, retrying (same Idempotency-Key, so the
/// same command) until a gateway answers with something other than a 5xx.
async fn post(url: &Arc<Mutex<String>>, path: &str, key: &str, body: &Value) -> (u16, Value) {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(45))
        .build()
        .expect("client");
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let base = url.lock().expect("url").clone();
        let sent = client
            .post(format!("{base}{path}"))
            .bearer_auth("tok-alice")
            .header(sortie_gateway::IDEMPOTENCY_HEADER, key)
            .json(body)
            .send()
            .await;
        if let Ok(response) = sent {
            let status = response.status().as_u16();
            if status < 500 {
                return (status, response.json().await.unwrap_or(Value::Null));
            }
        }
        assert!(
            Instant::now() < deadline,
            "{path} ({key}): no gateway answered"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn start(stack: &Stack, url: &Arc<Mutex<String>>, plan: &RunPlan, n: usize) -> Vec<String> {
    let mut problems = Vec::new();
    let input = json!({"n": n});
    if plan.via_gateway {
        let body = json!({"graph_id": plan.graph, "run_id": plan.run_id, "input": input});
        let key = format!("start-{}", plan.run_id);
        let (status, answer) = post(url, "/v1/runs", &key, &body).await;
        if status != 201 {
            problems.push(format!(
                "{}: start answered {status}: {answer}",
                plan.run_id
            ));
        }
    } else {
        let command = start_run(&plan.run_id, plan.graph, &input.to_string());
        stack.send(&command).await;
        if plan.duplicate {
            stack.send(&command).await;
        }
    }
    if plan.cancel {
        stack
            .send(&command(
                &plan.run_id,
                &format!("cancel-{}", plan.run_id),
                w::CommandBody::CancelRun(w::CancelRun {
                    reason: Some("soak".into()),
                }),
            ))
            .await;
    }
    problems
}

/// Decides one waiting approval gate as planned (through the gateway).
async fn decide(url: &Arc<Mutex<String>>, plan: &RunPlan, state: &RunState) -> Vec<String> {
    let Some(interrupt) = state.interrupts.values().next() else {
        return vec![format!("{}: waiting without an interrupt", plan.run_id)];
    };
    let run = &plan.run_id;
    let (path, body) = match plan.gate {
        Gate::Approve | Gate::Reject => (
            format!("/v1/runs/{run}/resume"),
            json!({
                "decision": if plan.gate == Gate::Approve { "approve" } else { "reject" },
                "interrupt_id": interrupt.interrupt_id,
                "proposal_hash": interrupt.proposal_hash,
            }),
        ),
        Gate::Cancel => (format!("/v1/runs/{run}/cancel"), json!({"reason": "soak"})),
        Gate::Leave => return vec![],
    };
    let (status, answer) = post(url, &path, &format!("decide-{run}"), &body).await;
    if status != 200 {
        return vec![format!("{run}: {path} answered {status}: {answer}")];
    }
    vec![]
}

fn settled(state: &RunState) -> bool {
    state.status.is_terminal()
        || matches!(
            state.status,
            RunStatus::WaitingApproval | RunStatus::NeedsReconciliation
        )
}

// ---------------------------------------------------------------- the soak

/// Runs one soak; `replay` is the command that replays it, given the seed.
async fn soak(plan: Plan, replay: impl Fn(u64) -> String) {
    let replay = replay(plan.seed);
    sortie_tests::say(&format!(
        "soak: seed {} ({} runs, {} faults); replay: {replay}",
        plan.seed, plan.runs, plan.faults
    ));
    let _replay = ReplayHint(replay);
    let began = Instant::now();
    let mut rng = Rng(plan.seed);

    let stack = Arc::new(Stack::start("soak", &[]).await);
    let mut ledgers: HashMap<&str, LedgerProcess> = HashMap::new();
    for (name, mode) in [
        ("keyed", "keyed"),
        ("recon", "reconcilable"),
        ("plain", "plain"),
    ] {
        ledgers.insert(name, stack.ledger_process(name, mode).await);
    }
    let recon_timeout = recon_timeout(plan.seed);
    sortie_tests::say(&format!(
        "soak: reconcilable steps time out after {recon_timeout}"
    ));
    for graph in graphs(
        &ledgers["keyed"].url,
        &ledgers["recon"].url,
        &ledgers["plain"].url,
        recon_timeout,
    ) {
        stack.publish(&graph).await;
    }
    let mut services = Services::start(&stack).await;

    let runs: Vec<RunPlan> = (0..plan.runs)
        .map(|i| {
            let graph = *rng.pick(&["order", "order", "notify", "refund", "refund"]);
            RunPlan {
                run_id: format!("run-{i}"),
                graph,
                via_gateway: rng.chance(40),
                duplicate: rng.chance(15),
                cancel: graph == "order" && rng.chance(15),
                gate: *rng.pick(&[
                    Gate::Approve,
                    Gate::Approve,
                    Gate::Reject,
                    Gate::Cancel,
                    Gate::Leave,
                ]),
            }
        })
        .collect();
    let window = plan.spacing * plan.runs as u32 + Duration::from_secs(4);
    let faults = schedule(&mut rng, &plan, window);
    println!("soak: schedule {faults:?}");

    // Clients: start every run, then decide approval gates as they come up.
    let problems = Arc::new(Mutex::new(Vec::<String>::new()));
    let clients = {
        let (stack, url, runs, problems) = (
            stack.clone(),
            services.url.clone(),
            runs.clone(),
            problems.clone(),
        );
        tokio::spawn(async move {
            let mut starts = Vec::new();
            for (n, run) in runs.iter().enumerate() {
                let (stack, url, run, problems) =
                    (stack.clone(), url.clone(), run.clone(), problems.clone());
                starts.push(tokio::spawn(async move {
                    let found = start(&stack, &url, &run, n).await;
                    problems.lock().expect("problems").extend(found);
                }));
                tokio::time::sleep(plan.spacing).await;
            }
            for started in starts {
                started.await.expect("a start task panicked");
            }
            let mut open: Vec<&RunPlan> = runs.iter().filter(|r| r.graph == "refund").collect();
            let deadline = Instant::now() + Duration::from_secs(240);
            while !open.is_empty() && Instant::now() < deadline {
                let states = stack.states().await;
                let mut still = Vec::new();
                for run in open {
                    match states.get(&run.run_id) {
                        Some(s) if s.status == RunStatus::WaitingApproval => {
                            let found = decide(&url, run, s).await;
                            problems.lock().expect("problems").extend(found);
                        }
                        Some(s) if settled(s) => {} // cancelled or failed before its gate
                        _ => still.push(run),
                    }
                }
                open = still;
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        })
    };

    // The chaos: apply the schedule, restarting whatever dies.
    let chaos = Instant::now();
    for fault in &faults {
        while chaos.elapsed() < fault.at {
            services.supervise().await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        services.apply(fault).await;
    }
    // Give the last armed processes a moment to reach their points, then disarm.
    let grace = Instant::now() + Duration::from_secs(3);
    while Instant::now() < grace {
        services.supervise().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    services.disarm().await;
    while !clients.is_finished() {
        services.supervise().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    clients.await.expect("the clients panicked");
    let chaos_took = chaos.elapsed();

    // Settle: every run terminal or waiting on a human or an operator.
    let ids: Vec<String> = runs.iter().map(|r| r.run_id.clone()).collect();
    let deadline = Instant::now() + plan.settle;
    let states = loop {
        services.supervise().await;
        let states = stack.states().await;
        if ids.iter().all(|r| states.get(r).is_some_and(settled)) {
            break states;
        }
        if Instant::now() > deadline {
            let stuck: Vec<String> = ids
                .iter()
                .filter(|r| !states.get(*r).is_some_and(settled))
                .map(|r| format!("{r}: {:?}", states.get(r).map(|s| s.status)))
                .collect();
            panic!("runs did not settle within {:?}: {stuck:?}", plan.settle);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };

    let mut problems = std::mem::take(&mut *problems.lock().expect("problems"));
    for (service, how) in &services.deaths {
        if how == "exit" {
            problems.push(format!("the {service:?} exited on its own (see its log)"));
        }
    }
    problems.extend(check(&stack, &ledgers, &runs, &states).await);
    let (clean, report) = stack.audit_verify().await;
    if !clean || report["diverged"] != json!(0) {
        problems.push(format!("audit replay --verify: {report}"));
    }

    let mut by_status: BTreeMap<&str, usize> = BTreeMap::new();
    for state in states.values() {
        *by_status.entry(state.status.as_str()).or_default() += 1;
    }
    let mut deaths: BTreeMap<String, usize> = BTreeMap::new();
    for (service, how) in &services.deaths {
        *deaths.entry(format!("{service:?} {how}")).or_default() += 1;
    }
    println!(
        "soak: seed {} — {} runs {by_status:?}; deaths {deaths:?}; second reducer {:?}; chaos {:.1}s, total {:.1}s",
        plan.seed,
        runs.len(),
        services.membership,
        chaos_took.as_secs_f64(),
        began.elapsed().as_secs_f64()
    );
    assert!(problems.is_empty(), "seed {}: {problems:#?}", plan.seed);
    assert!(
        !services.deaths.is_empty() || plan.faults == 0,
        "seed {}: nothing died",
        plan.seed
    );
}

/// Whether a run's final status is one its plan allows.
fn expected(plan: &RunPlan, status: RunStatus) -> bool {
    use RunStatus::*;
    match (plan.graph, plan.gate) {
        ("order", _) if plan.cancel => matches!(status, Cancelled | Succeeded),
        ("order", _) => status == Succeeded,
        // An unsafe call whose outcome a crash hid waits for an operator.
        ("notify", _) => matches!(status, Succeeded | NeedsReconciliation),
        (_, Gate::Approve) => status == Succeeded,
        (_, Gate::Reject) => status.is_terminal(),
        (_, Gate::Cancel) => status == Cancelled,
        (_, Gate::Leave) => status == WaitingApproval,
    }
}

/// The end-of-soak checks; returns what is wrong.
async fn check(
    stack: &Stack,
    ledgers: &HashMap<&str, LedgerProcess>,
    runs: &[RunPlan],
    states: &HashMap<String, RunState>,
) -> Vec<String> {
    let mut problems = Vec::new();
    let events = stack.events().await;
    let mut snapshots = HashMap::new();
    for (name, ledger) in ledgers {
        snapshots.insert(*name, ledger.snapshot().await);
    }
    let mut known: HashMap<&str, BTreeSet<String>> = HashMap::new();
    for plan in runs {
        let run = &plan.run_id;
        let state = &states[run];
        // History: gap-free, chained, folds to the state (panics name the run).
        check_history(run, events.get(run).map_or(&[][..], Vec::as_slice), state);
        if !expected(plan, state.status) {
            problems.push(format!("{run}: {plan:?} ended {:?}", state.status));
        }
        for step in state.steps.values().filter(|s| s.tool == "http") {
            let ledger = ledger_of(&step.node);
            let snapshot = &snapshots[ledger];
            let op = &step.operation_id;
            known.entry(ledger).or_default().insert(op.clone());
            let (effects, calls) = (snapshot.effects(op), snapshot.calls(op));
            let first = snapshot
                .calls
                .iter()
                .find(|c| c.operation_id.as_deref() == Some(op.as_str()))
                .map(|c| &c.answer);
            match step.status {
                StepStatus::Succeeded if effects != 1 || step.output.as_ref() != first => {
                    problems.push(format!(
                        "{run} {}: succeeded with {effects} effects, output {:?}, ledger {first:?}",
                        step.step_id, step.output
                    ));
                }
                _ if effects > 1 => {
                    problems.push(format!("{run} {}: {effects} effects", step.step_id));
                }
                _ => {}
            }
            if step.side_effect == sortie_core::SideEffect::Unsafe && calls > 1 {
                problems.push(format!(
                    "{run} {}: unsafe called {calls} times",
                    step.step_id
                ));
            }
        }
    }
    for (name, snapshot) in &snapshots {
        let known = known.get(name).cloned().unwrap_or_default();
        problems.extend(sortie_tests::stack::unknown_effects(name, snapshot, &known));
    }
    let mut intents: HashMap<(String, i32), usize> = HashMap::new();
    for intent in stack.intents("default").await {
        *intents
            .entry((intent.operation_id, intent.attempt))
            .or_default() += 1;
    }
    for ((op, attempt), n) in intents {
        if n > 1 {
            problems.push(format!("intent {op} attempt {attempt} visible {n} times"));
        }
    }
    problems
}

/// Prints how to replay the soak if it panics.
struct ReplayHint(String);

impl Drop for ReplayHint {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "soak FAILED; replay: {} (logs under target/test-runs/t.soak.*)",
                self.0
            );
        }
    }
}

/// The bounded soak CI runs, with a fresh seed each time, printed (`SORTIE_SOAK_SEED`
/// replays one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bounded_soak_under_seeded_faults_keeps_every_promise() {
    soak(
        Plan {
            seed: Plan::seed(),
            runs: 120,
            faults: 24,
            spacing: Duration::from_millis(250),
            settle: Duration::from_secs(90),
        },
        |seed| format!("SORTIE_SOAK_SEED={seed} cargo test -p sortie-tests --test soak"),
    )
    .await;
}

/// The long soak: `dev/soak.sh` (`SORTIE_SOAK_RUNS`, default 500; `SORTIE_SOAK_FAULTS`,
/// default one per 10 runs; `SORTIE_SOAK_SEED`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "long: run with dev/soak.sh"]
async fn a_long_soak_under_seeded_faults_keeps_every_promise() {
    let runs = Plan::env("SORTIE_SOAK_RUNS", 500);
    let faults = Plan::env("SORTIE_SOAK_FAULTS", runs / 10);
    soak(Plan {
        seed: Plan::seed(),
        runs,
        faults,
        spacing: Duration::from_millis(100),
        settle: Duration::from_secs(300),
    }, |seed| {
        format!("SORTIE_SOAK_SEED={seed} SORTIE_SOAK_RUNS={runs} SORTIE_SOAK_FAULTS={faults} dev/soak.sh")
    })
    .await;
}
