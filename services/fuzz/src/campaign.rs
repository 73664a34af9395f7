//! A hostile-input campaign against a running stack, with a canary tenant as the oracle.
//!
//! While the hostile records of [`crate::kafka`] are produced, a canary tenant keeps
//! starting small runs; the campaign checks, throughout and at the end:
//!
//! - every canary run completes, within [`Plan::canary_bound`];
//! - every hostile command is answered (accepted or rejected) or dead-lettered with a
//!   reason, and every record that must be dead-lettered is;
//! - the watched processes stay up (no exit at all: the documented status 75 is for
//!   wedged Kafka calls, which this campaign does not cause) and ready, and their memory
//!   stays under [`Plan::max_rss_bytes`].
//!
//! The HTTP side (`crate::http`, when a gateway is given) runs alongside. What the caller
//! checks after [`run`] returns: `sortie audit replay --verify` over the same topics.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Message, Offset, TopicPartitionList};
use serde::Serialize;
use sortie_core::{EventBody, RunStatus};
use sortie_wire::records as w;
use sortie_wire::{Codec, Topics};

use crate::kafka::{hostile, Context, Expect};
use crate::mutate::Rng;
use crate::produce::headers;

/// What to attack and what to watch.
#[derive(Debug, Clone)]
pub struct Target {
    pub bootstrap: String,
    pub topics: Topics,
    pub partitions: u32,
    pub codec: Arc<Codec>,
    /// A graph of the canary's: published, pinned by version, finishes on its own.
    pub canary_graph: (String, u32),
    pub canary_tenant: String,
    pub hostile_tenant: String,
    /// Services to watch: name, pid, readiness URL.
    pub processes: Vec<(String, u32, String)>,
    /// A gateway to send hostile HTTP requests to (`crate::http`) while the records go
    /// in, and to start every other canary run through.
    pub gateway: Option<Gateway>,
}

/// The gateway side of a campaign.
#[derive(Debug, Clone)]
pub struct Gateway {
    pub url: String,
    /// Bearer tokens of the hostile tenant (the HTTP cases use them).
    pub hostile_tokens: Vec<String>,
    /// A bearer token of the canary tenant, allowed to start runs.
    pub canary_token: String,
    /// HTTP cases; 0 leaves the HTTP side out.
    pub cases: usize,
}

/// How big a campaign is.
#[derive(Debug, Clone)]
pub struct Plan {
    pub seed: u64,
    /// Hostile Kafka records.
    pub cases: usize,
    /// Canary runs started, spread over the campaign.
    pub canaries: usize,
    /// How long a canary run may take from its start to its end.
    pub canary_bound: Duration,
    /// How long, after the last record, everything may take to be accounted for.
    pub settle: Duration,
    pub max_rss_bytes: u64,
}

/// What a campaign found. Clean when [`Report::problems`] is empty.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    pub seed: u64,
    pub cases: usize,
    pub by_kind: BTreeMap<String, usize>,
    /// Hostile records the broker itself refused (over `max.message.bytes`).
    pub refused_by_broker: usize,
    pub dead_lettered: usize,
    pub answered: usize,
    pub canaries_started: usize,
    pub canaries_succeeded: usize,
    /// Hostile HTTP requests sent, by route and answer status.
    pub http: Option<crate::http::Report>,
    pub canary_latency_ms_p50: u64,
    pub canary_latency_ms_max: u64,
    pub max_rss_mib: BTreeMap<String, u64>,
    pub seconds: f64,
    pub problems: Vec<String>,
}

/// What the accounting reader has seen on the run-events and dead-letter topics.
#[derive(Debug, Default)]
struct Seen {
    answered: HashSet<String>,
    letters: HashSet<(String, i32, i64)>,
    /// Canary runs that ended, with their status and when they were seen ending.
    ended: HashMap<String, (RunStatus, Instant)>,
}

/// Runs the campaign: hostile records and canary runs together, then the accounting.
pub async fn run(target: &Target, plan: &Plan) -> anyhow::Result<Report> {
    let started = Instant::now();
    let mut report = Report {
        seed: plan.seed,
        cases: plan.cases,
        ..Report::default()
    };
    let seen = Arc::new(Mutex::new(Seen::default()));
    let reader = tokio::spawn(account(target.clone(), seen.clone()));
    // The hostile client. A record it cannot deliver within a minute is reported, not
    // waited on for librdkafka's default five.
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &target.bootstrap)
        .set("partitioner", "murmur2_random")
        .set("message.max.bytes", "2000000")
        .set("linger.ms", "5")
        .set("message.timeout.ms", "60000")
        .create()?;
    // The canary tenant's own client, as another tenant's service has: its starts share
    // no batch, queue or retry with the hostile records (a batch the broker refuses fails
    // every record in it). A start not delivered within the canary's bound is a finding.
    let canary_producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &target.bootstrap)
        .set("enable.idempotence", "true")
        .set(
            "message.timeout.ms",
            plan.canary_bound.as_millis().max(1).to_string(),
        )
        .create()?;

    let ids = schema_ids(target).await?;
    let http = target
        .gateway
        .clone()
        .filter(|g| g.cases > 0)
        .map(|gateway| {
            let aim = crate::http::Aim {
                graph_ids: vec![target.canary_graph.0.clone()],
                run_ids: Vec::new(),
            };
            let seed = plan.seed;
            tokio::spawn(async move {
                crate::http::run_http_aimed(
                    &gateway.url,
                    &gateway.hostile_tokens,
                    &aim,
                    seed,
                    gateway.cases,
                )
                .await
            })
        });
    let canary_runs: Vec<String> = (0..plan.canaries)
        .map(|i| format!("canary-{}-{i}", plan.seed % 100_000))
        .collect();
    let mut context = Context {
        commands: target.topics.commands(),
        step_results: target.topics.step_results(),
        graphs: target.topics.graphs(),
        partitions: target.partitions,
        command_schema: ids.0,
        result_schema: ids.1,
        graph_schema: ids.2,
        tenant: target.hostile_tenant.clone(),
        graph_id: target.canary_graph.0.clone(),
        // Filled as canaries start: a hostile tenant's commands about runs another
        // tenant owns. (One that names a run id before its owner starts it takes that id:
        // run ids are global, first come first served — ARCHITECTURE's attacker table.)
        victims: Vec::new(),
    };

    let mut rng = Rng(plan.seed);
    let mut expected: Vec<((String, i32, i64), Expect, &'static str)> = Vec::new();
    let mut canary_started: HashMap<String, Instant> = HashMap::new();
    let every = (plan.cases / plan.canaries.max(1)).max(1);
    let mut rss = RssWatch::default();
    let mut deliveries = Vec::new();
    for case in 0..plan.cases {
        if case % every == 0 {
            if let Some(run) = canary_runs.get(case / every) {
                let asked = Instant::now();
                let started = match (&target.gateway, (case / every) % 2) {
                    (Some(gateway), 1) => start_canary_over_http(target, gateway, run).await,
                    _ => start_canary(target, &canary_producer, run).await,
                };
                note_start(run, asked, started, &mut canary_started, &mut report);
                context.victims.push(run.clone());
            }
            rss.sample(target);
            check_alive(target, &mut report);
        }
        let record = hostile(&mut rng, &context);
        *report.by_kind.entry(record.kind.to_owned()).or_default() += 1;
        let mut future = FutureRecord::to(&record.topic).headers(headers(
            record
                .headers
                .iter()
                .map(|(key, value)| (key.as_str(), value.as_slice())),
        ));
        if let Some(key) = &record.key {
            future = future.key(key);
        }
        if let Some(value) = &record.value {
            future = future.payload(value);
        }
        if let Some(partition) = record.partition {
            future = future.partition(partition);
        }
        if let Some(at) = record.timestamp {
            future = future.timestamp(at);
        }
        match producer.send_result(future) {
            Ok(delivery) => {
                deliveries.push((delivery, record.topic.clone(), record.expect, record.kind))
            }
            Err((e, _)) if is_too_large(&e) => report.refused_by_broker += 1,
            Err((e, _)) => report.problems.push(format!(
                "producing a hostile record ({}) failed: {e}",
                record.kind
            )),
        }
        if deliveries.len() >= 200 {
            settle_deliveries(&mut deliveries, &mut expected, &mut report).await;
        }
    }
    for run in canary_runs.iter().skip(context.victims.len()) {
        let asked = Instant::now();
        let started = start_canary(target, &canary_producer, run).await;
        note_start(run, asked, started, &mut canary_started, &mut report);
    }
    settle_deliveries(&mut deliveries, &mut expected, &mut report).await;

    // Everything accounted for, within the settle time.
    let deadline = Instant::now() + plan.settle;
    loop {
        rss.sample(target);
        let (missing, canaries_left) = {
            let seen = seen.lock().unwrap_or_else(|e| e.into_inner());
            let missing = expected
                .iter()
                .filter(|(at, expect, _)| !accounted(&seen, at, expect))
                .count();
            let left = canary_started
                .keys()
                .filter(|r| !seen.ended.contains_key(*r))
                .count();
            (missing, left)
        };
        if (missing == 0 && canaries_left == 0) || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    reader.abort();
    if let Some(http) = http {
        let http = http.await?;
        for finding in &http.findings {
            report.problems.push(format!(
                "HTTP case {} on {}: {} ({})",
                finding.case, finding.route, finding.problem, finding.request
            ));
        }
        report.http = Some(http);
    }
    check_alive(target, &mut report);
    check_ready(target, &mut report).await;

    let seen = seen.lock().unwrap_or_else(|e| e.into_inner());
    report.answered = seen.answered.len();
    report.dead_lettered = seen.letters.len();
    for (at, expect, kind) in &expected {
        if !accounted(&seen, at, expect) {
            report.problems.push(format!(
                "{kind} at {}[{}]@{} was neither answered nor dead-lettered ({expect:?})",
                at.0, at.1, at.2
            ));
        }
    }
    let mut latencies = Vec::new();
    report.canaries_started = canary_started.len();
    for run in &canary_runs {
        match (seen.ended.get(run), canary_started.get(run)) {
            (Some((RunStatus::Succeeded, at)), Some(started)) => {
                report.canaries_succeeded += 1;
                let took = at.saturating_duration_since(*started);
                latencies.push(took.as_millis() as u64);
                if took > plan.canary_bound {
                    report.problems.push(format!(
                        "canary {run} took {took:?}, over the {:?} bound",
                        plan.canary_bound
                    ));
                }
            }
            (Some((status, _)), _) => report
                .problems
                .push(format!("canary {run} ended {}", status.as_str())),
            (None, Some(_)) => report.problems.push(format!("canary {run} never ended")),
            // Reported where its start failed.
            (None, None) => {}
        }
    }
    latencies.sort_unstable();
    report.canary_latency_ms_p50 = latencies.get(latencies.len() / 2).copied().unwrap_or(0);
    report.canary_latency_ms_max = latencies.last().copied().unwrap_or(0);
    for (name, bytes) in rss.max {
        report
            .max_rss_mib
            .insert(name.clone(), bytes / (1024 * 1024));
        if bytes > plan.max_rss_bytes {
            report.problems.push(format!(
                "{name} grew to {} MiB, over the {} MiB bound",
                bytes / (1024 * 1024),
                plan.max_rss_bytes / (1024 * 1024)
            ));
        }
    }
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// Records a canary's start: when it was delivered, or, when it failed, a finding that
/// says how long it was tried.
fn note_start(
    run: &str,
    asked: Instant,
    started: anyhow::Result<()>,
    canary_started: &mut HashMap<String, Instant>,
    report: &mut Report,
) {
    match started {
        Ok(()) => {
            canary_started.insert(run.to_owned(), Instant::now());
        }
        Err(e) => report.problems.push(format!(
            "canary {run} not started, {:?} on: {e:#}",
            asked.elapsed()
        )),
    }
}

fn is_too_large(e: &rdkafka::error::KafkaError) -> bool {
    matches!(
        e,
        rdkafka::error::KafkaError::MessageProduction(
            rdkafka::types::RDKafkaErrorCode::MessageSizeTooLarge
        )
    )
}

fn accounted(seen: &Seen, at: &(String, i32, i64), expect: &Expect) -> bool {
    match expect {
        Expect::Anything => true,
        Expect::Letter => seen.letters.contains(at),
        Expect::AnswerOrLetter(command_id) => {
            seen.answered.contains(command_id) || seen.letters.contains(at)
        }
    }
}

type Delivery = (
    rdkafka::producer::DeliveryFuture,
    String,
    Expect,
    &'static str,
);

async fn settle_deliveries(
    deliveries: &mut Vec<Delivery>,
    expected: &mut Vec<((String, i32, i64), Expect, &'static str)>,
    report: &mut Report,
) {
    for (delivery, topic, expect, kind) in deliveries.drain(..) {
        match delivery.await {
            Ok(Ok(delivered)) => {
                expected.push(((topic, delivered.partition, delivered.offset), expect, kind));
            }
            // Too large for the broker itself (a 300 KiB input beside a 250 KiB
            // proposal hash): it never reaches Sortie.
            Ok(Err((e, _))) if is_too_large(&e) => report.refused_by_broker += 1,
            Ok(Err((e, _))) => report
                .problems
                .push(format!("the broker refused a hostile record ({kind}): {e}")),
            Err(_) => report
                .problems
                .push(format!("a hostile record ({kind}) was lost")),
        }
    }
}

/// The ids the registry gave this build's command, result and graph schemas (registered
/// by encoding one record of each).
async fn schema_ids(target: &Target) -> anyhow::Result<(u32, u32, u32)> {
    let id = |bytes: Vec<u8>| u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]);
    let codec = &target.codec;
    let topics = &target.topics;
    let command = codec
        .encode(&topics.commands(), &canary_start(target, "schema-probe"))
        .await?;
    let result = codec
        .encode(
            &topics.step_results(),
            &w::StepResult {
                spend: None,
                operation_id: "op".into(),
                attempt: 1,
                tenant: "t".into(),
                run_id: "r".into(),
                step_id: "s".into(),
                status: w::StepStatus::Started,
                retryable: false,
                output: None,
                error: None,
                executor: "e".into(),
                started_at: 0,
                finished_at: None,
            },
        )
        .await?;
    let graph = codec
        .encode(
            &topics.graphs(),
            &w::GraphDefinition {
                graph_id: "g".into(),
                version: 1,
                tenant: None,
                definition: String::new(),
                definition_hash: String::new(),
                published_by: String::new(),
                published_at: 0,
            },
        )
        .await?;
    Ok((id(command), id(result), id(graph)))
}

fn canary_start(target: &Target, run: &str) -> w::RunCommand {
    w::RunCommand {
        command_id: format!("start-{run}"),
        tenant: target.canary_tenant.clone(),
        run_id: run.to_owned(),
        issuer: w::Issuer {
            principal: "svc:canary".into(),
            roles: vec![],
            groups: vec![],
        },
        issued_at: sortie_kafka_now(),
        body: w::CommandBody::StartRun(w::StartRun {
            graph_id: target.canary_graph.0.clone(),
            graph_version: Some(target.canary_graph.1 as i32),
            input: r#"{"canary":true}"#.into(),
            labels: Default::default(),
            budget: None,
            fork: None,
            parent: None,
        }),
    }
}

fn sortie_kafka_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

async fn start_canary(target: &Target, producer: &FutureProducer, run: &str) -> anyhow::Result<()> {
    let value = target
        .codec
        .encode(&target.topics.commands(), &canary_start(target, run))
        .await?;
    producer
        .send(
            FutureRecord::to(&target.topics.commands())
                .key(run)
                .payload(&value),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| anyhow::anyhow!("producing its start: {e}"))?;
    Ok(())
}

/// Starts a canary run through the gateway: a 201 with its run id, or the campaign
/// fails (the gateway stopped serving the canary tenant).
async fn start_canary_over_http(
    target: &Target,
    gateway: &Gateway,
    run: &str,
) -> anyhow::Result<()> {
    let response = reqwest::Client::new()
        .post(format!("{}/v1/runs", gateway.url.trim_end_matches('/')))
        .bearer_auth(&gateway.canary_token)
        .timeout(Duration::from_secs(60))
        .json(&serde_json::json!({
            "graph_id": target.canary_graph.0,
            "graph_version": target.canary_graph.1,
            "run_id": run,
            "input": {"canary": true},
        }))
        .send()
        .await?;
    let status = response.status();
    if status.as_u16() != 201 {
        let body = response.text().await.unwrap_or_default();
        anyhow::bail!("the gateway answered its start {status} {body}");
    }
    Ok(())
}

/// Follows run-events and dead-letters from their beginning (read_committed): answers
/// by command id, letters by original position, canary runs' ends.
async fn account(target: Target, seen: Arc<Mutex<Seen>>) {
    let consumer: StreamConsumer = match ClientConfig::new()
        .set("bootstrap.servers", &target.bootstrap)
        .set("group.id", "sortie-fuzz-accounting")
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .create()
    {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "The campaign's accounting reader could not start.");
            return;
        }
    };
    let (events, letters) = (target.topics.run_events(), target.topics.dead_letters());
    let mut assignment = TopicPartitionList::new();
    for topic in [&events, &letters] {
        let partitions =
            sortie_kafka::read::partition_ids(consumer.client(), topic, Duration::from_secs(10))
                .unwrap_or_default();
        for p in partitions {
            let _ = assignment.add_partition_offset(topic, p, Offset::Beginning);
        }
    }
    if consumer.assign(&assignment).is_err() {
        return;
    }
    loop {
        let Ok(message) = consumer.recv().await else {
            continue;
        };
        if message.topic() == events {
            let Ok(event) = target.codec.decode::<w::RunEvent>(message.payload()).await else {
                continue;
            };
            let Ok(event) = sortie_model::event_from_wire(event) else {
                continue;
            };
            let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
            match &event.body {
                EventBody::CommandAccepted { command_id, .. }
                | EventBody::CommandRejected { command_id, .. } => {
                    seen.answered.insert(command_id.clone());
                }
                EventBody::RunStatusChanged { status, .. } if status.is_terminal() => {
                    seen.ended
                        .entry(event.run_id.clone())
                        .or_insert((*status, Instant::now()));
                }
                _ => {}
            }
        } else if let Ok(letter) = target
            .codec
            .decode::<w::DeadLetter>(message.payload())
            .await
        {
            let reasoned = !letter.reason.trim().is_empty() && !letter.reason_code.is_empty();
            let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
            if reasoned {
                seen.letters.insert((
                    letter.original_topic,
                    letter.original_partition,
                    letter.original_offset,
                ));
            }
        }
    }
}

#[derive(Default)]
struct RssWatch {
    max: BTreeMap<String, u64>,
}

impl RssWatch {
    fn sample(&mut self, target: &Target) {
        for (name, pid, _) in &target.processes {
            if let Some(bytes) = rss_bytes(*pid) {
                let max = self.max.entry(name.clone()).or_default();
                *max = (*max).max(bytes);
            }
        }
    }
}

fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn check_alive(target: &Target, report: &mut Report) {
    for (name, pid, _) in &target.processes {
        let alive = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|stat| !stat.contains(") Z "))
            .unwrap_or(false);
        let problem = format!("{name} (pid {pid}) exited");
        if !alive && !report.problems.contains(&problem) {
            report.problems.push(problem);
        }
    }
}

async fn check_ready(target: &Target, report: &mut Report) {
    let client = reqwest::Client::new();
    for (name, _, url) in &target.processes {
        if url.is_empty() {
            continue;
        }
        match client.get(url).timeout(Duration::from_secs(5)).send().await {
            Ok(response) if response.status().is_success() => {}
            Ok(response) => {
                let status = response.status();
                let body = response.text().await.unwrap_or_default();
                // A stopped partition, named, is the honest answer to a poison record.
                if !body.contains("stopped") {
                    report
                        .problems
                        .push(format!("{name} is not ready ({status}): {body}"));
                }
            }
            Err(e) => report
                .problems
                .push(format!("{name}'s readiness did not answer: {e}")),
        }
    }
}
