//! Hostile records for the reducer's input topics and the graph table, drawn from a seed:
//! what a careless or hostile client with produce rights on `sortie.commands`,
//! `sortie.step-results` or `sortie.graphs` can write. Values that do not decode (random
//! bytes, another magic byte, unknown or wrong schema ids, truncated Avro), valid Avro
//! with hostile fields (payloads past and at the shape limits, ids with control and
//! invisible characters or past their length, free text past its limit, negative and
//! huge numbers), keys of 600 KiB, hundreds of headers, forged and duplicated signatures,
//! tombstones, timestamps far in the past or the future, records on another partition
//! than their run's, and commands of one tenant about another's runs.
//!
//! Each record says what it expects of the reducer ([`Expect`]), so a campaign can check
//! that every refused input was answered or dead-lettered with a reason.

use sortie_wire::records as w;
use sortie_wire::Record;

use crate::mutate::Rng;
use crate::values::{id, nested, payload, text};

/// What a campaign writes on, and as whom.
#[derive(Debug, Clone)]
pub struct Context {
    pub commands: String,
    pub step_results: String,
    pub graphs: String,
    pub partitions: u32,
    /// Schema ids the registry gave this build's schemas (wire format headers).
    pub command_schema: u32,
    pub result_schema: u32,
    pub graph_schema: u32,
    /// The tenant the hostile records claim.
    pub tenant: String,
    /// A published graph the hostile tenant's starts name.
    pub graph_id: String,
    /// Runs of another tenant (the canary's) that hostile commands name.
    pub victims: Vec<String>,
}

/// One record to produce.
#[derive(Debug, Clone)]
pub struct Hostile {
    pub topic: String,
    /// `None`: the producer's partitioner (murmur2 of the key) decides.
    pub partition: Option<i32>,
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    pub headers: Vec<(String, Vec<u8>)>,
    /// CreateTime to stamp the record with (`None`: now).
    pub timestamp: Option<i64>,
    /// What kind of hostility, for the report.
    pub kind: &'static str,
    pub expect: Expect,
}

/// What the reducer must do with a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expect {
    /// Answer this command id (accepted or rejected, in or outside a history), or
    /// dead-letter the record with a reason.
    AnswerOrLetter(String),
    /// Dead-letter the record with a reason.
    Letter,
    /// Nothing checkable: applied or ignored (a step result, a graph record).
    Anything,
}

fn wire(schema: u32, datum: Vec<u8>) -> Vec<u8> {
    let mut bytes = vec![0];
    bytes.extend_from_slice(&schema.to_be_bytes());
    bytes.extend(datum);
    bytes
}

fn encode<R: Record>(schema: u32, record: &R) -> Vec<u8> {
    wire(schema, sortie_wire::to_datum(record).unwrap_or_default())
}

/// One hostile record, drawn with `rng`.
pub fn hostile(rng: &mut Rng, ctx: &Context) -> Hostile {
    match rng.below(20) {
        0..=2 => undecodable(rng, ctx),
        3..=10 => command(rng, ctx),
        11..=13 => envelope(rng, ctx),
        14..=17 => result(rng, ctx),
        _ => graph(rng, ctx),
    }
}

fn record(
    topic: &str,
    key: Vec<u8>,
    value: Option<Vec<u8>>,
    kind: &'static str,
    expect: Expect,
) -> Hostile {
    Hostile {
        topic: topic.to_owned(),
        partition: None,
        key: Some(key),
        value,
        headers: Vec::new(),
        timestamp: None,
        kind,
        expect,
    }
}

fn undecodable(rng: &mut Rng, ctx: &Context) -> Hostile {
    let valid = encode(ctx.command_schema, &cancel(ctx, "run-x", "cmd-x"));
    let (kind, value): (&'static str, Option<Vec<u8>>) = match rng.below(6) {
        0 => (
            "random bytes",
            Some((0..rng.below(64)).map(|_| rng.next_u64() as u8).collect()),
        ),
        1 => (
            "another magic byte",
            Some({
                let mut v = valid.clone();
                v[0] = 1;
                v
            }),
        ),
        2 => (
            "an unknown schema id",
            Some(wire(999_999, valid[5..].to_vec())),
        ),
        3 => (
            "the result schema on commands",
            Some(wire(ctx.result_schema, valid[5..].to_vec())),
        ),
        4 => ("truncated Avro", Some(valid[..valid.len() / 2].to_vec())),
        _ => ("a tombstone", None),
    };
    let mut record = record(
        &ctx.commands,
        b"run-x".to_vec(),
        value,
        kind,
        Expect::Letter,
    );
    if rng.below(4) == 0 {
        record.topic = ctx.step_results.clone();
        record.kind = "undecodable step result";
        if record.value.is_none() {
            // A tombstone on step-results is the reducer's own forget: ignored.
            record.expect = Expect::Anything;
        }
    }
    record
}

fn cancel(ctx: &Context, run: &str, command_id: &str) -> w::RunCommand {
    w::RunCommand {
        command_id: command_id.to_owned(),
        tenant: ctx.tenant.clone(),
        run_id: run.to_owned(),
        issuer: w::Issuer {
            principal: "svc:hostile".into(),
            roles: vec!["approver".into(), "operator".into()],
            groups: vec![],
        },
        issued_at: 0,
        body: w::CommandBody::CancelRun(w::CancelRun { reason: None }),
    }
}

fn command(rng: &mut Rng, ctx: &Context) -> Hostile {
    let command_id = format!("hostile-{}", rng.next_u64());
    let mut run = format!("hostile-run-{}", rng.next_u64() % 1_000);
    let mut kind = "a command";
    if !ctx.victims.is_empty() && rng.below(4) == 0 {
        run = ctx.victims[rng.below(ctx.victims.len())].clone();
        kind = "a command about another tenant's run";
    }
    let body = match rng.below(8) {
        0 | 1 => w::CommandBody::StartRun(w::StartRun {
            graph_id: match rng.below(4) {
                0 => id(rng, "graph"),
                _ => ctx.graph_id.clone(),
            },
            graph_version: [None, Some(-1), Some(i32::MAX), Some(1)][rng.below(4)],
            input: match rng.below(5) {
                0 => "{not json".to_owned(),
                _ => payload(rng).to_string(),
            },
            labels: (0..[0, 1, 70][rng.below(3)])
                .map(|i| (format!("l{i}"), text(rng)))
                .collect(),
            budget: [
                None,
                Some(r#"{"limits":{"tokens":18446744073709551615,"cost_usd":-1}}"#.to_owned()),
                Some("not a budget".to_owned()),
            ][rng.below(3)]
            .clone(),
            fork: None,
            parent: None,
        }),
        2 => w::CommandBody::ResumeRun(w::ResumeRun {
            interrupt_id: id(rng, "int"),
            proposal_hash: ["", "00", &"f".repeat(250 * 1024)][rng.below(3)].to_owned(),
            decision: w::Decision::Approve,
            payload: Some(payload(rng).to_string()),
            comment: Some(text(rng)),
            edited_args: Some(payload(rng).to_string()),
            payload_is_input: rng.below(2) == 0,
        }),
        3 => w::CommandBody::CancelRun(w::CancelRun {
            reason: Some(text(rng)),
        }),
        4 => w::CommandBody::ForgetRun(w::ForgetRun {
            reason: Some(text(rng)),
        }),
        5 => w::CommandBody::SignalRun(w::SignalRun {
            name: [id(rng, "signal"), String::new(), "x".repeat(300)][rng.below(3)].clone(),
            signal_id: [None, Some(id(rng, "sig")), Some("\u{0}".to_owned())][rng.below(3)].clone(),
            payload: match rng.below(4) {
                0 => Some("{not json".to_owned()),
                1 => None,
                _ => Some(payload(rng).to_string()),
            },
        }),
        _ => w::CommandBody::ReconcileOperation(w::ReconcileOperation {
            operation_id: id(rng, "op"),
            outcome: w::ReconcileOutcome::Succeeded,
            output: Some(payload(rng).to_string()),
            error: Some(text(rng)),
        }),
    };
    let mut command = w::RunCommand {
        command_id: command_id.clone(),
        body,
        ..cancel(ctx, &run, &command_id)
    };
    if rng.below(6) == 0 {
        command.tenant = id(rng, "tenant");
        kind = "a command with a hostile tenant";
    }
    if rng.below(8) == 0 {
        command.issuer.roles = (0..100).map(|i| format!("role-{i}")).collect();
    }
    let value = encode(ctx.command_schema, &command);
    let key = match rng.below(8) {
        0 => b"not-the-run-id".to_vec(),
        _ => run.clone().into_bytes(),
    };
    let mut record = record(
        &ctx.commands,
        key,
        Some(value),
        kind,
        Expect::AnswerOrLetter(command_id),
    );
    if rng.below(6) == 0 {
        // Another partition than the run's: forwarded, then answered.
        let canonical = sortie_wire::partition_for(run.as_bytes(), ctx.partitions);
        record.partition = Some((canonical + 1) % ctx.partitions as i32);
    }
    if rng.below(5) == 0 {
        record.timestamp = Some([0, 32_503_680_000_000, -1][rng.below(3)]);
    }
    record
}

/// Keys, headers and signatures: the envelope around a valid command.
fn envelope(rng: &mut Rng, ctx: &Context) -> Hostile {
    let command_id = format!("hostile-{}", rng.next_u64());
    let run = format!("hostile-run-{}", rng.next_u64() % 1_000);
    let value = encode(ctx.command_schema, &cancel(ctx, &run, &command_id));
    let mut record = record(
        &ctx.commands,
        run.clone().into_bytes(),
        Some(value),
        "an envelope",
        Expect::AnswerOrLetter(command_id),
    );
    match rng.below(6) {
        0 => {
            record.key = Some(vec![b'k'; 600 * 1024]);
            record.kind = "a 600 KiB key";
            record.expect = Expect::Letter;
        }
        1 => {
            record.headers = (0..200)
                .map(|i| (format!("h{i}"), vec![b'v'; 512]))
                .collect();
            record.kind = "200 headers";
            record.expect = Expect::Letter;
        }
        2 => {
            record.headers = vec![
                (
                    sortie_wire::signing::KEY_HEADER.to_owned(),
                    b"svc-key".to_vec(),
                ),
                (
                    sortie_wire::signing::SIGNATURE_HEADER.to_owned(),
                    (0..64).map(|_| rng.next_u64() as u8).collect(),
                ),
            ];
            record.kind = "a forged signature";
        }
        3 => {
            let signature: Vec<u8> = (0..64).map(|_| rng.next_u64() as u8).collect();
            record.headers = vec![
                (sortie_wire::signing::KEY_HEADER.to_owned(), b"a".to_vec()),
                (sortie_wire::signing::KEY_HEADER.to_owned(), b"b".to_vec()),
                (
                    sortie_wire::signing::SIGNATURE_HEADER.to_owned(),
                    signature.clone(),
                ),
                (sortie_wire::signing::SIGNATURE_HEADER.to_owned(), signature),
            ];
            record.kind = "duplicated signature headers";
        }
        4 => {
            record.headers = vec![(
                sortie_wire::signing::KEY_HEADER.to_owned(),
                vec![b'x'; 60 * 1024],
            )];
            record.kind = "a 60 KiB key id";
        }
        _ => {
            record.key = None;
            record.kind = "no key";
        }
    }
    record
}

fn result(rng: &mut Rng, ctx: &Context) -> Hostile {
    let error = w::StepError {
        code: id(rng, "code"),
        message: text(rng),
        retry_after_ms: [None, Some(-5), Some(i64::MAX)][rng.below(3)],
    };
    let result = w::StepResult {
        spend: None,
        operation_id: id(rng, "op"),
        attempt: [1, 0, -1, i32::MAX][rng.below(4)],
        tenant: ctx.tenant.clone(),
        run_id: format!("hostile-run-{}", rng.next_u64() % 1_000),
        step_id: id(rng, "step"),
        status: [
            w::StepStatus::Succeeded,
            w::StepStatus::Failed,
            w::StepStatus::Unknown,
            w::StepStatus::Started,
        ][rng.below(4)],
        retryable: rng.below(2) == 0,
        output: Some(payload(rng).to_string()),
        error: Some(error),
        executor: "hostile".into(),
        started_at: -1,
        finished_at: Some(i64::MAX),
    };
    let key = result.operation_id.clone().into_bytes();
    record(
        &ctx.step_results,
        key,
        Some(encode(ctx.result_schema, &result)),
        "a step result",
        Expect::Anything,
    )
}

fn graph(rng: &mut Rng, ctx: &Context) -> Hostile {
    let graph_id = format!("hostile-graph-{}", rng.next_u64() % 100);
    let definition = match rng.below(5) {
        0 => "{not: [yaml".to_owned(),
        1 => {
            let mut args = String::from("      x0: &x0 [lol, lol, lol, lol, lol, lol, lol, lol]\n");
            for i in 1..9 {
                let refs = vec![format!("*x{}", i - 1); 8].join(", ");
                args.push_str(&format!("      x{i}: &x{i} [{refs}]\n"));
            }
            format!("id: {graph_id}\nversion: 1\nnodes:\n  - id: a\n    tool: echo\n    side_effect: pure\n    args:\n{args}edges: []\n")
        }
        2 => format!(
            "id: {graph_id}\nversion: 1\nnodes:\n  - {{id: a, tool: echo, side_effect: pure, args: {}}}\nedges: []\n",
            nested(80)
        ),
        3 => format!(
            "id: {graph_id}\nversion: 1\nnodes:\n  - {{id: a, tool: echo, side_effect: pure, may_request: [nowhere]}}\nedges: []\n"
        ),
        _ => format!("id: {graph_id}\nversion: 1\nnodes: []\nedges: []\n"),
    };
    let record_value = w::GraphDefinition {
        graph_id: graph_id.clone(),
        version: 1,
        tenant: Some(ctx.tenant.clone()),
        definition_hash: match rng.below(3) {
            0 => "0".repeat(64),
            _ => sortie_core::json::sha256_hex(&[&definition]),
        },
        definition,
        published_by: "hostile".into(),
        published_at: 0,
    };
    let key = match rng.below(4) {
        0 => b"another@1".to_vec(),
        _ => format!("{graph_id}@1").into_bytes(),
    };
    let value = match rng.below(6) {
        0 => None,
        1 => Some((0..rng.below(64)).map(|_| rng.next_u64() as u8).collect()),
        _ => Some(encode(ctx.graph_schema, &record_value)),
    };
    record(
        &ctx.graphs,
        key,
        value,
        "a graph publication",
        Expect::Anything,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn context() -> Context {
        Context {
            commands: "t.commands".into(),
            step_results: "t.step-results".into(),
            graphs: "t.graphs".into(),
            partitions: 3,
            command_schema: 1,
            result_schema: 2,
            graph_schema: 3,
            tenant: "hostile".into(),
            graph_id: "canary".into(),
            victims: vec!["canary-run".into()],
        }
    }

    #[test]
    fn the_same_seed_draws_the_same_records_and_every_kind_is_drawn() {
        let draw = |seed| {
            let mut rng = Rng(seed);
            (0..400)
                .map(|_| hostile(&mut rng, &context()))
                .map(|h| (h.topic, h.kind, h.value))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        let kinds: std::collections::BTreeSet<&str> = draw(7).iter().map(|(_, k, _)| *k).collect();
        for kind in [
            "a 600 KiB key",
            "a forged signature",
            "truncated Avro",
            "a graph publication",
            "a step result",
        ] {
            assert!(kinds.contains(kind), "{kind} never drawn: {kinds:?}");
        }
    }
}
