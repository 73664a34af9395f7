//! Audit replay: re-fold every run's history from `sortie.run-events` with this build's
//! `evolve` and compare it with the state the reducer wrote to `sortie.run-state`.
//! With `verify`, also prove the history is the one that was written: gap-free sequence
//! numbers and an intact hash chain.
//!
//! Sealed runs (see `sortie_seal`): the hash chain is taken over the sealed events, so
//! `verify` needs no key — also after a run's key was destroyed. The fold comparison
//! opens events and state with the run's key when the auditor has the keys; without them
//! (or once the key is destroyed) it compares the sealed forms, which agree except for
//! what the fold derives from payloads (a run's spend, from its outputs' token usage; its
//! limits, from a budget approval's payload; a step's error, from its sealed message):
//! those are taken as written and the report says the run was compared sealed. A state
//! the reducer wrote after the run's key was destroyed (a deleted run: the gateway
//! destroys the key before the reducer folds the `ForgetRun`) holds every payload `null`
//! and every free text empty; it is the re-fold sealed under the destroyed key, and
//! agrees ([`refold`]).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Message, Offset, TopicPartitionList};
use serde::Serialize;
use sortie_core::{evolve, Event, RunState};
use sortie_kafka::{read, KafkaConfig};
use sortie_seal::RunSeal;
use sortie_wire::records as w;
use sortie_wire::{Codec, Record, Topics};
use tokio::runtime::Handle;

use crate::convert;
use crate::driver::Error;

/// What replaying one run found.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    pub run_id: String,
    pub events: usize,
    pub version: i64,
    pub status: Option<String>,
    /// Everything wrong with this run; empty when the history and the state agree.
    pub problems: Vec<String>,
    /// The run's payloads are sealed and were compared sealed (no key, or its key was
    /// destroyed): spend and limits were not re-derived.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub sealed: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub runs: usize,
    pub events: usize,
    pub diverged: usize,
    pub reports: Vec<RunReport>,
}

/// A topic's records as (key, decoded value); `None` values are tombstones.
pub type Records<R> = Vec<(Option<String>, Option<R>)>;

/// Reads every record of `topic` (all partitions, `read_committed`) from the beginning
/// to the high watermark captured at the start, decoded as `R`, in partition order.
pub fn read_topic<R: Record>(
    kafka: &KafkaConfig,
    topic: &str,
    codec: &Codec,
    runtime: &Handle,
) -> Result<Records<R>, Error> {
    let mut config = kafka.client();
    config
        .set("group.id", "sortie-audit")
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .set("allow.auto.create.topics", "false");
    let consumer: BaseConsumer = config.create()?;
    let partitions = read::partition_ids(consumer.client(), topic, Duration::from_secs(10))?;
    let marks = read::watermarks(
        &consumer,
        topic,
        partitions,
        Instant::now() + Duration::from_secs(30),
    )?;
    let mut assignment = TopicPartitionList::new();
    for &partition in marks.keys() {
        assignment.add_partition_offset(topic, partition, Offset::Beginning)?;
    }
    consumer.assign(&assignment)?;
    let spans = marks
        .iter()
        .map(|(&p, &(low, high))| (p, (low, high)))
        .collect();
    let mut records: Vec<(i32, i64, Option<String>, Option<R>)> = Vec::new();
    read::to_end(
        &consumer,
        topic,
        &spans,
        Instant::now() + Duration::from_secs(120),
        |message| {
            let key = message
                .key()
                .map(|k| String::from_utf8_lossy(k).into_owned());
            let value = match message.payload() {
                None => None,
                Some(_) => Some(
                    runtime
                        .block_on(codec.decode::<R>(message.payload()))
                        .map_err(|e| {
                            Error::Registry(format!(
                                "{topic}[{}]@{}: {e}",
                                message.partition(),
                                message.offset()
                            ))
                        })?,
                ),
            };
            records.push((message.partition(), message.offset(), key, value));
            Ok(read::Next::More)
        },
    )
    .map_err(|e| match e {
        read::ReadError::Handler(e) => e,
        read::ReadError::Kafka(e) => Error::Kafka(e),
        timeout => Error::Setup(timeout.to_string()),
    })?;
    // In partition order, as an auditor reads the topic partition by partition.
    records.sort_by_key(|(partition, offset, _, _)| (*partition, *offset));
    let out = records.into_iter().map(|(_, _, k, v)| (k, v)).collect();
    Ok(out)
}

/// Every run's history, decoded, in order.
pub fn histories(
    kafka: &KafkaConfig,
    topics: &Topics,
    codec: &Codec,
    runtime: &Handle,
) -> Result<BTreeMap<String, Vec<Event>>, Error> {
    let mut out: BTreeMap<String, Vec<Event>> = BTreeMap::new();
    for (_, value) in read_topic::<w::RunEvent>(kafka, &topics.run_events(), codec, runtime)? {
        let Some(record) = value else { continue };
        let event = convert::event_from_wire(record).map_err(|e| Error::Setup(e.0))?;
        if event.seq > 0 {
            out.entry(event.run_id.clone()).or_default().push(event);
        }
    }
    Ok(out)
}

/// The state a run had after `version` (every version is recoverable from history).
pub fn state_at(history: &[Event], version: i64) -> Option<RunState> {
    history
        .iter()
        .filter(|e| e.state_version <= version)
        .fold(None, evolve)
}

/// Re-folds every history (or one run's) and compares it with the changelog.
pub fn replay(
    kafka: &KafkaConfig,
    topics: &Topics,
    codec: &Codec,
    runtime: &Handle,
    only: Option<&str>,
    verify: bool,
    keys: Option<&sortie_seal::RunKeys>,
) -> Result<Report, Error> {
    let histories = histories(kafka, topics, codec, runtime)?;
    let mut table: BTreeMap<String, RunState> = BTreeMap::new();
    for (key, value) in read_topic::<w::RunState>(kafka, &topics.run_state(), codec, runtime)? {
        match (key, value) {
            (Some(key), Some(record)) => {
                let state = convert::state_from_wire(&record).map_err(|e| Error::Setup(e.0))?;
                table.insert(key, state);
            }
            (Some(key), None) => {
                table.remove(&key);
            }
            _ => {}
        }
    }
    let mut reports = Vec::new();
    let mut events_total = 0;
    let run_ids: Vec<&String> = histories
        .keys()
        .chain(table.keys())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    for run_id in run_ids {
        if only.is_some_and(|o| o != run_id) {
            continue;
        }
        let history = histories.get(run_id).map(Vec::as_slice).unwrap_or_default();
        events_total += history.len();
        let mut problems = Vec::new();
        if verify {
            let mut prev: Option<String> = None;
            for (i, event) in history.iter().enumerate() {
                if event.seq != i as i64 + 1 {
                    problems.push(format!(
                        "event {} has seq {}: the history has a gap or a duplicate",
                        i + 1,
                        event.seq
                    ));
                    break;
                }
                if event.prev_hash != prev {
                    problems.push(format!(
                        "seq {}: prev_hash does not match the previous event's hash",
                        event.seq
                    ));
                    break;
                }
                if event.hash.as_deref() != Some(event.compute_hash().as_str()) {
                    problems.push(format!(
                        "seq {}: hash does not match its content (altered history)",
                        event.seq
                    ));
                    break;
                }
                prev = event.hash.clone();
            }
        }
        let seal = run_seal(history, table.get(run_id), keys, runtime)?;
        let (history, written, sealed) =
            open_run(history, table.get(run_id), seal.as_ref(), &mut problems);
        let history = history.as_slice();
        let folded = refold(history, written.as_ref(), sealed, &mut problems);
        reports.push(RunReport {
            run_id: run_id.clone(),
            events: history.len(),
            version: folded.as_ref().map_or(0, |s| s.version),
            status: folded.as_ref().map(|s| s.status.as_str().to_owned()),
            problems,
            sealed,
        });
    }
    let diverged = reports.iter().filter(|r| !r.problems.is_empty()).count();
    Ok(Report {
        runs: reports.len(),
        events: events_total,
        diverged,
        reports,
    })
}

/// Whether anything of the run, in its history or its written state, is sealed (`map_payloads`
/// hands each payload over mutably; nothing is changed).
fn any_sealed(history: &mut [Event], written: Option<&mut RunState>) -> bool {
    let mut any = false;
    for event in history {
        event.map_payloads(&mut |v| any |= sortie_seal::is_sealed(v));
    }
    if let Some(state) = written {
        state.map_payloads(&mut |v| any |= sortie_seal::is_sealed(v));
    }
    any
}

/// The seal a run's payloads open with, when the auditor has the keys and the run has
/// something sealed (`Destroyed` once its key is gone).
fn run_seal(
    history: &[Event],
    written: Option<&RunState>,
    keys: Option<&sortie_seal::RunKeys>,
    runtime: &Handle,
) -> Result<Option<RunSeal>, Error> {
    let Some(keys) = keys else { return Ok(None) };
    if !any_sealed(&mut history.to_vec(), written.cloned().as_mut()) {
        return Ok(None);
    }
    let Some((tenant, run_id)) = history
        .first()
        .map(|e| (e.tenant.clone(), e.run_id.clone()))
        .or_else(|| written.map(|s| (s.tenant.clone(), s.run_id.clone())))
    else {
        return Ok(None);
    };
    runtime
        .block_on(keys.seal(&tenant, &run_id))
        .map(Some)
        .map_err(|e| Error::Setup(format!("the data key of run {run_id}: {e}")))
}

/// A run's history and written state as the fold comparison takes them: opened with the
/// run's `seal` (see [`run_seal`]) when there is one and it opens; else as written.
/// `true`: compared sealed. Pure: a property test drives it as the audit does.
pub fn open_run(
    history: &[Event],
    written: Option<&RunState>,
    seal: Option<&RunSeal>,
    problems: &mut Vec<String>,
) -> (Vec<Event>, Option<RunState>, bool) {
    let mut history = history.to_vec();
    let mut written = written.cloned();
    let any_sealed = any_sealed(&mut history, written.as_mut());
    let (Some(seal), true) = (seal, any_sealed) else {
        return (history, written, any_sealed);
    };
    if seal.is_destroyed() {
        return (history, written, true);
    }
    let failures: usize = history
        .iter_mut()
        .map(|event| seal.open_all(|f| event.map_payloads(f)))
        .chain(
            written
                .iter_mut()
                .map(|state| seal.open_all(|f| state.map_payloads(f))),
        )
        .filter_map(Result::err)
        .map(|unopened| unopened.count)
        .sum();
    if failures > 0 {
        problems.push(format!(
            "{failures} sealed payloads do not open with the run's data key (tampered, or sealed under another key)"
        ));
    }
    (history, written, false)
}

/// Re-folds a run's `history` (as [`open_run`] gave it) with this build's `evolve` and
/// compares it with the state the reducer wrote, pushing what differs to `problems`.
/// Pure: the property test `tests/audit_agrees.rs` folds through it.
///
/// Compared `sealed`, the written state is the re-fold sealed under the seal the reducer
/// held when it wrote it: the run's key (deterministic, so the same ciphertext as the
/// history's), or — once the key is destroyed, as `DELETE /v1/runs/{id}` does before the
/// reducer folds its `ForgetRun` — the destroyed key, which writes every payload `null`
/// and every free text empty. Both are the history's state; the second keeps, for
/// instance, no trace of a cancel's reason, which the history holds sealed.
pub fn refold(
    history: &[Event],
    written: Option<&RunState>,
    sealed: bool,
    problems: &mut Vec<String>,
) -> Option<RunState> {
    let mut folded = history.iter().fold(None, evolve);
    if let (true, Some(f), Some(t)) = (sealed, folded.as_mut(), written) {
        // Derived from payloads the fold could not read: taken as written. A step's
        // error is `<code>: <message>` (or `outcome unknown: <message>`), one text
        // built from a sealed one, and sealed again as a whole.
        f.spend = t.spend.clone();
        f.budget = t.budget.clone();
        for (id, step) in &mut f.steps {
            if let Some(written) = t.steps.get(id) {
                if step.error.is_some() && written.error.is_some() {
                    std::sync::Arc::make_mut(step)
                        .error
                        .clone_from(&written.error);
                }
            }
        }
    }
    let shredded = |f: &RunState| {
        f.sealed(&RunSeal::Destroyed {
            run_id: f.run_id.clone(),
        })
    };
    match (&folded, written) {
        (Some(f), Some(t)) if f != t && !(sealed && shredded(f) == *t) => {
            let f_json = serde_json::to_value(f).unwrap_or_default();
            let t_json = serde_json::to_value(t).unwrap_or_default();
            let fields: Vec<String> = f_json
                .as_object()
                .map(|o| {
                    o.keys()
                        .filter(|k| f_json[k.as_str()] != t_json[k.as_str()])
                        .cloned()
                        .collect()
                })
                .unwrap_or_default();
            problems.push(format!(
                "the re-folded state differs from sortie.run-state in: {}",
                fields.join(", ")
            ));
        }
        (Some(_), None) => problems.push("the history has no state in sortie.run-state".into()),
        (None, Some(_)) => problems.push("sortie.run-state has a state with no history".into()),
        _ => {}
    }
    folded
}

/// What `sortie audit why` found for one operation.
#[derive(Debug)]
pub struct Why {
    pub chain: sortie_why::Chain,
}

/// The authorization chain of `operation_id` (`sortie_why`): the run that dispatched it
/// (`run` when given, else found in every history), its history (opened with the run's
/// key when `keys` are given), its graph version as a table trusting `keyring` reads it,
/// and the commands that carried its approvals, looked up on `sortie.commands`.
#[allow(clippy::too_many_arguments)]
pub fn why(
    kafka: &KafkaConfig,
    topics: &Topics,
    codec: std::sync::Arc<Codec>,
    runtime: &Handle,
    operation_id: &str,
    run: Option<&str>,
    keyring: Option<&sortie_wire::signing::Keyring>,
    keys: Option<&sortie_seal::RunKeys>,
) -> Result<Option<Why>, Error> {
    let histories = histories(kafka, topics, &codec, runtime)?;
    let dispatched = |history: &Vec<Event>| {
        history.iter().any(|e| {
            e.operation_id.as_deref() == Some(operation_id)
                && matches!(e.body, sortie_core::EventBody::StepDispatched { .. })
        })
    };
    let found = match run {
        Some(run) => histories.get(run).map(|h| (run.to_owned(), h.clone())),
        None => histories
            .iter()
            .find(|(_, h)| dispatched(h))
            .map(|(run, h)| (run.clone(), h.clone())),
    };
    let Some((run_id, mut history)) = found else {
        return Ok(None);
    };
    let tenant = history
        .first()
        .map(|e| e.tenant.clone())
        .unwrap_or_default();
    let mut any_sealed = false;
    for event in &mut history {
        event.map_payloads(&mut |v| any_sealed |= sortie_seal::is_sealed(v));
    }
    // Opened with the run's key, each event is sealed again to check its hash; without
    // it, the hashes are checked as written and the payloads stay unread.
    let (seal, readable) = match (keys, any_sealed) {
        (_, false) => (sortie_seal::RunSeal::Plain, true),
        (None, true) => (sortie_seal::RunSeal::Plain, false),
        (Some(keys), true) => {
            let seal = runtime
                .block_on(keys.seal(&tenant, &run_id))
                .map_err(|e| Error::Setup(format!("the data key of run {run_id}: {e}")))?;
            let opened = !seal.is_destroyed()
                && history
                    .iter_mut()
                    .all(|event| seal.open_all(|f| event.map_payloads(f)).is_ok());
            if opened {
                (seal, true)
            } else {
                // Read the history again as written: what opened is not what was hashed.
                let written = histories.get(&run_id).cloned().unwrap_or_default();
                history = written;
                (sortie_seal::RunSeal::Plain, false)
            }
        }
    };
    let state = history.iter().fold(None, evolve);
    let mut table = crate::graphs::GraphTable::open(kafka, topics, codec.clone(), runtime.clone())?;
    table.set_trust(keyring.map(|ring| crate::graphs::Trust {
        keyring: ring.clone(),
        require: true,
    }));
    table.catch_up(Duration::from_secs(60))?;
    let (graph, publication) = match &state {
        Some(state) => (
            table
                .graphs()
                .get(&state.graph_id, Some(state.graph_version))
                .cloned(),
            table
                .publication(&format!("{}@{}", state.graph_id, state.graph_version))
                .cloned(),
        ),
        None => (None, None),
    };
    let consumer: BaseConsumer = kafka.client().create()?;
    let partitions = read::partition_ids(
        consumer.client(),
        &topics.commands(),
        Duration::from_secs(10),
    )?;
    let mut commands = sortie_why::KafkaCommands::open(
        kafka,
        topics.commands(),
        partitions.len() as u32,
        codec.clone(),
        runtime.clone(),
    )
    .map_err(Error::Setup)?;
    let chain = sortie_why::why(sortie_why::Inputs {
        operation_id,
        history: &history,
        seal: &seal,
        readable,
        graph: graph.as_ref(),
        publication: publication.as_ref(),
        keyring,
        commands: &mut commands,
    });
    Ok(Some(Why { chain }))
}
