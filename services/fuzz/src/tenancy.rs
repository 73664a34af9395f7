//! The cross-tenant campaign: an attacker tenant that holds every role, its own publisher
//! key and its own receiver tries every escape from its tenant (issue #57's list) while a
//! victim tenant keeps running canary runs; the victim is the oracle.
//!
//! The attacker publishes its own graphs (signed by its publisher key, scoped to its
//! tenant) and starts runs of them over Kafka (signed by its service key, every role):
//!
//! | kind | what it tries |
//! |---|---|
//! | `graph_hijack` | the victim's graph id, signed by the attacker's key, as the attacker's own, as every tenant's and as the victim's |
//! | `secret_read` | an `llm` node whose `api_key_env` names the victim's secret (or the executor's `HOME`), sent to the attacker's receiver |
//! | `ssrf` | `http` nodes aimed at the victim's receiver (by every spelling of loopback), the cloud metadata address, and a redirect from the attacker's receiver to the victim's |
//! | `giant_answer`, `endless_answer` | the attacker's receiver answering 40 MiB, or without end |
//! | `id_squat` | starts under the ids the victim's starts will derive from their `Idempotency-Key`s |
//! | `cross_command` | cancel, approve with a budget raise, signal, reconcile, forget a victim's run; the same claiming the victim's tenant |
//! | `cross_http` | the attacker's tokens on every route of a victim's run |
//!
//! plus, once, slow sockets held open on the gateway from other source addresses.
//!
//! **The oracle**: every victim canary run (started through the gateway under an
//! `Idempotency-Key`) succeeds within its bound, on the victim's own graph version; nothing
//! of the victim's — its secret, its runs' payloads, its graph's body — is ever in a
//! request the attacker's receiver got or in an answer the attacker read; the victim's
//! receiver never sees an attacker's request; the watched processes stay up.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::producer::FutureProducer;
use serde::Serialize;
use serde_json::{json, Value};
use sortie_core::Graph;
use sortie_wire::signing::Signer;
use sortie_wire::{Codec, Topics};

use crate::mutate::Rng;

mod attacks;
mod gateway;
mod graphs;
mod receiver;

use attacks::{cross_command, cross_http, slow_sockets, start_signed};
use gateway::{get_run, start_canary};
use graphs::{attacker_graphs, publish};
use receiver::Receiver;

/// What the victim's data is marked with, so a leak is found wherever it lands.
pub const VICTIM_PAYLOAD: &str = "victim-payload-7f3a";
/// In the victim graph's description.
pub const VICTIM_GRAPH: &str = "victim-graph-91c2";
/// In every attacker request, so the victim's receiver can tell one apart.
pub const ATTACKER_MARK: &str = "attacker-mark-5e0d";

/// The victim tenant.
#[derive(Debug, Clone)]
pub struct Victim {
    pub tenant: String,
    /// A gateway token of the victim's that may start runs.
    pub token: String,
    /// Its graph: global, unpinned in the victim's starts.
    pub graph: (String, u32),
    /// The victim's receiver, e.g. `http://127.0.0.1:40123`.
    pub receiver_url: String,
    /// The file the victim's receiver records every call in.
    pub receiver_file: std::path::PathBuf,
    /// The variable the executor holds the victim's secret in, and its value.
    pub secret: (String, String),
}

/// The attacker tenant.
#[derive(Debug)]
pub struct Attacker {
    pub tenant: String,
    /// Gateway tokens of the attacker's (every role).
    pub tokens: Vec<String>,
    /// A service key for the attacker's tenant with every role, and its principal.
    pub signer: (Signer, String),
    /// A publisher key for the attacker's tenant, and its principal.
    pub publisher: (Signer, String),
    /// Where the attacker's receiver listens (a loopback address of its own, which the
    /// executor allows for the attacker's tenant only).
    pub receiver_addr: std::net::IpAddr,
}

/// What to attack.
#[derive(Debug)]
pub struct Target {
    pub bootstrap: String,
    pub topics: Topics,
    pub partitions: u32,
    pub codec: Arc<Codec>,
    pub gateway_url: String,
    pub victim: Victim,
    pub attacker: Attacker,
    /// Services to watch: name and pid.
    pub processes: Vec<(String, u32)>,
}

/// How big a campaign is.
#[derive(Debug, Clone)]
pub struct Plan {
    pub seed: u64,
    pub cases: usize,
    pub canaries: usize,
    pub canary_bound: Duration,
    pub settle: Duration,
    /// Slow sockets held on the gateway meanwhile (from 127.0.0.3 and up).
    pub slow_sockets: usize,
}

/// What a campaign found. Clean when `problems` is empty.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    pub seed: u64,
    pub cases: usize,
    pub by_kind: BTreeMap<String, usize>,
    /// How the attacker's runs and requests were refused: step error codes, command
    /// answers, HTTP statuses.
    pub refusals: BTreeMap<String, usize>,
    /// Requests the attacker's receiver got (none carries anything of the victim's).
    pub attacker_receiver_requests: usize,
    pub slow_sockets: usize,
    pub canaries_started: usize,
    pub canaries_succeeded: usize,
    pub canary_latency_ms_p50: u64,
    pub canary_latency_ms_max: u64,
    pub seconds: f64,
    pub problems: Vec<String>,
}

/// Runs the campaign.
pub async fn run(target: &Target, plan: &Plan) -> anyhow::Result<Report> {
    let started = Instant::now();
    let mut report = Report {
        seed: plan.seed,
        cases: plan.cases,
        ..Report::default()
    };
    let receiver = Receiver::start(target.attacker.receiver_addr).await?;
    let receiver_url = format!("http://{}", receiver.addr);
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &target.bootstrap)
        .set("enable.idempotence", "true")
        .create()?;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    let answers = Arc::new(Mutex::new(Vec::<String>::new()));

    // The attacker's own graphs, and the hijacks of the victim's id.
    let mut graphs = Vec::new();
    for (id, yaml) in attacker_graphs(&target.victim, &receiver_url) {
        match Graph::parse(&yaml) {
            Ok(graph) => {
                publish(target, &producer, graph, Some(&target.attacker.tenant)).await?;
                graphs.push(id);
            }
            // Naming a variable that is no secret (`HOME`) is refused before publication.
            Err(_) => *report.refusals.entry("graph:invalid".into()).or_default() += 1,
        }
    }
    let hijack = format!(
        "id: {}\nversion: 1\nnodes:\n  - {{id: a, tool: echo, side_effect: pure, args: {{mark: {ATTACKER_MARK}}}}}\n",
        target.victim.graph.0
    );
    for version in 1..=4u32 {
        let mut graph = Graph::parse(&hijack.replace("version: 1", &format!("version: {version}")))
            .map_err(|e| anyhow::anyhow!("hijack graph: {e}"))?;
        let owners = [
            Some(target.attacker.tenant.as_str()),
            None,
            Some(target.victim.tenant.as_str()),
        ];
        for owner in owners {
            graph.owner = owner.map(str::to_owned);
            publish(target, &producer, graph.clone(), owner).await?;
            *report.by_kind.entry("graph_hijack".into()).or_default() += 1;
        }
    }

    let slow = slow_sockets(&target.gateway_url, plan.slow_sockets).await;
    report.slow_sockets = slow.len();

    let mut rng = Rng(plan.seed);
    let canary_key = |i: usize| format!("canary-{}-{i}", plan.seed % 100_000);
    let every = (plan.cases / plan.canaries.max(1)).max(1);
    // Canaries are watched while the attack goes on, so each one's latency is its own:
    // from its start to the first poll that sees it ended (every 200 ms).
    let canaries: Mutex<Vec<(String, Instant)>> = Mutex::new(Vec::new());
    let ended: Mutex<BTreeMap<String, (String, Instant, Value)>> = Mutex::new(BTreeMap::new());
    let attacking = std::sync::atomic::AtomicBool::new(true);
    let canary_count = || canaries.lock().unwrap_or_else(|e| e.into_inner()).len();
    let some_canary = |n: usize| {
        let canaries = canaries.lock().unwrap_or_else(|e| e.into_inner());
        canaries
            .get(n % canaries.len().max(1))
            .map(|(run, _)| run.clone())
    };
    let mut attacker_runs: Vec<String> = Vec::new();
    let attack = async {
        let outcome: anyhow::Result<()> = async {
            for case in 0..plan.cases {
                if case % every == 0 && canary_count() < plan.canaries {
                    let i = canary_count();
                    match start_canary(target, &http, &canary_key(i)).await {
                        Ok(run) => canaries
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push((run, Instant::now())),
                        Err(e) => report
                            .problems
                            .push(format!("canary {i} did not start: {e}")),
                    }
                }
                let kind = match rng.below(6) {
                    0 => "id_squat",
                    1 => "cross_command",
                    2 => "cross_http",
                    _ => "attacker_run",
                };
                let kind = match kind {
                    "attacker_run" => {
                        let id = &graphs[rng.below(graphs.len())];
                        let run = format!("atk-{}-{case}", plan.seed % 100_000);
                        let input = json!({"n": rng.below(1_000_000)});
                        start_signed(target, &producer, &run, id, &input).await?;
                        attacker_runs.push(run);
                        if id.starts_with("steal") {
                            "secret_read"
                        } else if id.starts_with("ssrf") {
                            "ssrf"
                        } else if id == "giant" {
                            "giant_answer"
                        } else {
                            "endless_answer"
                        }
                    }
                    "id_squat" => {
                        // The id a victim's start under a coming key derives.
                        let ahead = canary_count() + rng.below(4);
                        let run = sortie_core::ids::keyed_run_id(
                            &target.victim.tenant,
                            &canary_key(ahead),
                        );
                        start_signed(target, &producer, &run, &graphs[0], &json!({"n": 0})).await?;
                        "id_squat"
                    }
                    "cross_command" => {
                        if let Some(run) = some_canary(rng.below(usize::MAX)) {
                            let forged = rng.below(3) == 0;
                            cross_command(target, &producer, &run, rng.below(5), forged).await?;
                        }
                        "cross_command"
                    }
                    _ => {
                        if let Some(run) = some_canary(rng.below(usize::MAX)) {
                            let token =
                                &target.attacker.tokens[rng.below(target.attacker.tokens.len())];
                            cross_http(target, &http, token, &run, &answers, &mut report).await;
                        }
                        "cross_http"
                    }
                };
                *report.by_kind.entry(kind.into()).or_default() += 1;
            }
            while canary_count() < plan.canaries {
                let i = canary_count();
                match start_canary(target, &http, &canary_key(i)).await {
                    Ok(run) => canaries
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((run, Instant::now())),
                    Err(e) => {
                        report
                            .problems
                            .push(format!("canary {i} did not start: {e}"));
                        break;
                    }
                }
            }
            Ok(())
        }
        .await;
        attacking.store(false, std::sync::atomic::Ordering::SeqCst);
        outcome
    };
    // The canaries end within their bound, on the victim's own graph.
    let watch = async {
        let mut deadline = None;
        loop {
            if !attacking.load(std::sync::atomic::Ordering::SeqCst) {
                let deadline = *deadline.get_or_insert_with(|| Instant::now() + plan.settle);
                let done = ended.lock().unwrap_or_else(|e| e.into_inner()).len();
                if done >= canary_count() || Instant::now() >= deadline {
                    break;
                }
            }
            let pending: Vec<String> = {
                let ended = ended.lock().unwrap_or_else(|e| e.into_inner());
                let canaries = canaries.lock().unwrap_or_else(|e| e.into_inner());
                canaries
                    .iter()
                    .map(|(run, _)| run.clone())
                    .filter(|run| !ended.contains_key(run))
                    .collect()
            };
            for run in pending {
                if let Ok(state) =
                    get_run(&target.gateway_url, &http, &target.victim.token, &run).await
                {
                    let status = state["status"].as_str().unwrap_or_default().to_owned();
                    if ["succeeded", "failed", "cancelled"].contains(&status.as_str()) {
                        ended
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(run, (status, Instant::now(), state));
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    let (attacked, ()) = tokio::join!(attack, watch);
    attacked?;
    let canaries = canaries.into_inner().unwrap_or_else(|e| e.into_inner());
    let ended = ended.into_inner().unwrap_or_else(|e| e.into_inner());
    report.canaries_started = canaries.len();
    let mut latencies = Vec::new();
    for (run, started) in &canaries {
        match ended.get(run) {
            Some((status, at, state)) if status == "succeeded" => {
                report.canaries_succeeded += 1;
                let took = at.saturating_duration_since(*started);
                latencies.push(took.as_millis() as u64);
                if took > plan.canary_bound {
                    report.problems.push(format!(
                        "canary {run} took {took:?}, over the {:?} bound",
                        plan.canary_bound
                    ));
                }
                let pinned = (
                    state["graph_id"].as_str().unwrap_or_default(),
                    state["graph_version"].as_u64().unwrap_or_default(),
                );
                let own = (
                    target.victim.graph.0.as_str(),
                    u64::from(target.victim.graph.1),
                );
                if pinned != own {
                    report.problems.push(format!(
                        "canary {run} ran {}@{} instead of the victim's own {}@{}",
                        pinned.0, pinned.1, own.0, own.1
                    ));
                }
            }
            Some((status, _, _)) => report.problems.push(format!("canary {run} ended {status}")),
            None => report.problems.push(format!("canary {run} never ended")),
        }
    }
    latencies.sort_unstable();
    report.canary_latency_ms_p50 = latencies.get(latencies.len() / 2).copied().unwrap_or(0);
    report.canary_latency_ms_max = latencies.last().copied().unwrap_or(0);

    // How the attacker's runs ended: every escape refused, and by what.
    for run in &attacker_runs {
        let token = &target.attacker.tokens[0];
        if let Ok(state) = get_run(&target.gateway_url, &http, token, run).await {
            remember(&answers, &state.to_string());
            for step in state["steps"].as_array().into_iter().flatten() {
                // A step's error reads `code: message`.
                if let Some(code) = step["error"].as_str().and_then(|e| e.split(':').next()) {
                    *report.refusals.entry(format!("step:{code}")).or_default() += 1;
                }
            }
        }
    }
    drop(slow);

    // Nothing of the victim's reached the attacker; nothing of the attacker's the victim.
    let secrets = [
        target.victim.secret.1.as_str(),
        VICTIM_PAYLOAD,
        VICTIM_GRAPH,
    ];
    let requests = receiver.requests();
    report.attacker_receiver_requests = requests.len();
    for request in &requests {
        for secret in secrets {
            if request.contains(secret) {
                report.problems.push(format!(
                    "the attacker's receiver got {secret:?}: {}",
                    clip(request)
                ));
            }
        }
        if let Ok(home) = std::env::var("HOME") {
            if !home.is_empty() && request.contains(&format!("Bearer {home}")) {
                report
                    .problems
                    .push("the attacker's receiver got the executor's HOME".into());
            }
        }
    }
    for answer in answers.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        for secret in secrets {
            if answer.contains(secret) {
                report.problems.push(format!(
                    "an answer to the attacker held {secret:?}: {}",
                    clip(answer)
                ));
            }
        }
    }
    let victims_receiver =
        std::fs::read_to_string(&target.victim.receiver_file).unwrap_or_default();
    if victims_receiver.contains(ATTACKER_MARK) {
        report
            .problems
            .push("the victim's receiver recorded an attacker's request".into());
    }
    for (name, pid) in &target.processes {
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            report.problems.push(format!("{name} (pid {pid}) exited"));
        }
    }
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

fn clip(text: &str) -> String {
    text.chars().take(300).collect()
}

fn remember(answers: &Mutex<Vec<String>>, text: &str) {
    answers
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(text.to_owned());
}
