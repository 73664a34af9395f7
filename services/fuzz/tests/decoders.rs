//! Every decoder target (`sortie_fuzz::decoders::TARGETS`) over its committed seed corpus
//! (`corpus/<target>/`) and seeded mutations of each seed: none panics, none hangs. The
//! seed is printed; `SORTIE_FUZZ_SEED=<seed>` replays a failure, `SORTIE_FUZZ_CASES`
//! sets how many mutations each target gets (default 2,000: a few seconds).
//!
//! The corpus is written by `write_corpus` (ignored; run it with `--ignored` after a
//! schema or model change, and commit what it writes). A coverage-guided run of the same
//! targets: `fuzz/README.md`.

use std::path::{Path, PathBuf};

use sortie_fuzz::decoders::TARGETS;
use sortie_fuzz::mutate::{mutate, Rng};

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("corpus")
        .join(target)
}

fn seeds(target: &str) -> Vec<Vec<u8>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir(target))
        .unwrap_or_else(|e| panic!("corpus/{target}: {e}"))
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .collect();
    files.sort();
    files
        .iter()
        .map(|f| std::fs::read(f).unwrap_or_else(|e| panic!("{}: {e}", f.display())))
        .collect()
}

fn seed() -> u64 {
    std::env::var("SORTIE_FUZZ_SEED")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        })
}

/// Checked: a target that panics on anything (e.g. `avro_command` with its shape check
/// on the accepted input turned into a panic on any input) fails here within the first
/// seeds, and the failing case's seed and bytes are printed.
#[test]
fn every_decoder_answers_every_input() {
    let seed = seed();
    let cases: usize = std::env::var("SORTIE_FUZZ_CASES")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(2_000);
    eprintln!("decoders: seed {seed} (SORTIE_FUZZ_SEED={seed} replays), {cases} cases a target");
    for (name, target) in TARGETS {
        let corpus = seeds(name);
        assert!(!corpus.is_empty(), "corpus/{name} has no seed");
        for entry in &corpus {
            target(entry);
        }
        let mut rng = Rng(seed ^ fnv(name));
        for case in 0..cases {
            let base = &corpus[rng.below(corpus.len())];
            let other = &corpus[rng.below(corpus.len())];
            let input = mutate(&mut rng, base, other);
            let started = std::time::Instant::now();
            let outcome = std::panic::catch_unwind(|| target(&input));
            if let Err(panic) = outcome {
                let message = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default();
                panic!(
                    "{name}, case {case} of seed {seed}: {message}\ninput ({} bytes): {:?}",
                    input.len(),
                    String::from_utf8_lossy(&input[..input.len().min(2048)])
                );
            }
            assert!(
                started.elapsed() < std::time::Duration::from_secs(2),
                "{name}, case {case} of seed {seed} took {:?}",
                started.elapsed()
            );
        }
    }
}

fn fnv(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Writes the seed corpus from Sortie's own records (run with `--ignored`).
#[test]
#[ignore = "writes the committed corpus; run after a schema or model change"]
fn write_corpus() {
    for (target, entries) in corpus::all() {
        let dir = corpus_dir(target);
        std::fs::create_dir_all(&dir).expect("corpus dir");
        for (name, bytes) in entries {
            std::fs::write(dir.join(name), bytes).expect("corpus file");
        }
    }
}

mod corpus {
    use serde_json::json;
    use sortie_core::{apply, input::Command, CommandBody, Graph, Graphs, Input};
    use sortie_wire::records as w;
    use sortie_wire::to_datum;

    type Entries = Vec<(String, Vec<u8>)>;

    const GRAPH: &str = "id: g\nversion: 1\nnodes:\n  - {id: a, tool: echo, side_effect: pure, args: {x: $input.x}}\n  - id: b\n    tool: http\n    side_effect: keyed\n    args: {y: $steps.a.output.x}\n    interrupt_before: {reason: check, required_role: approver, timeout: 1h}\nedges:\n  - {from: a, to: b}\n";

    fn issuer() -> w::Issuer {
        w::Issuer {
            principal: "svc:fuzz".into(),
            roles: vec!["approver".into()],
            groups: vec![],
        }
    }

    fn command(body: w::CommandBody) -> w::RunCommand {
        w::RunCommand {
            command_id: "cmd-1".into(),
            tenant: "acme".into(),
            run_id: "run-1".into(),
            issuer: issuer(),
            issued_at: 1,
            body,
        }
    }

    fn nested(depth: usize) -> serde_json::Value {
        (0..depth).fold(json!(1), |v, _| json!({ "a": v }))
    }

    fn commands() -> Entries {
        let bodies = [
            (
                "start",
                w::CommandBody::StartRun(w::StartRun {
                    graph_id: "g".into(),
                    graph_version: Some(1),
                    input: json!({"x": "hello", "n": [1, 2.5, null, true]}).to_string(),
                    labels: [("team".to_owned(), "payments".to_owned())].into(),
                    budget: Some(r#"{"limits":{"tokens":1000}}"#.into()),
                    fork: None,
                    parent: None,
                }),
            ),
            (
                "start_deep",
                w::CommandBody::StartRun(w::StartRun {
                    graph_id: "g".into(),
                    graph_version: None,
                    input: nested(sortie_core::limits::MAX_DEPTH).to_string(),
                    labels: Default::default(),
                    budget: None,
                    fork: None,
                    parent: None,
                }),
            ),
            (
                "resume",
                w::CommandBody::ResumeRun(w::ResumeRun {
                    interrupt_id: "int-1".into(),
                    proposal_hash: "ab".repeat(32),
                    decision: w::Decision::Approve,
                    payload: Some(r#"{"note":"ok"}"#.into()),
                    comment: Some("looks right".into()),
                    edited_args: Some(r#"{"y":2}"#.into()),
                    payload_is_input: false,
                }),
            ),
            (
                "cancel",
                w::CommandBody::CancelRun(w::CancelRun {
                    reason: Some("no longer needed".into()),
                }),
            ),
            (
                "forget",
                w::CommandBody::ForgetRun(w::ForgetRun { reason: None }),
            ),
            (
                "reconcile",
                w::CommandBody::ReconcileOperation(w::ReconcileOperation {
                    operation_id: "op_1".into(),
                    outcome: w::ReconcileOutcome::Succeeded,
                    output: Some(r#"{"ok":true}"#.into()),
                    error: None,
                }),
            ),
        ];
        bodies
            .into_iter()
            .map(|(name, body)| (name.to_owned(), to_datum(&command(body)).expect("datum")))
            .collect()
    }

    fn results() -> Entries {
        let result = |status, output: Option<&str>, error: Option<w::StepError>| w::StepResult {
            spend: None,
            operation_id: "op_1".into(),
            attempt: 1,
            tenant: "acme".into(),
            run_id: "run-1".into(),
            step_id: "a#1".into(),
            status,
            retryable: false,
            output: output.map(str::to_owned),
            error,
            executor: "e".into(),
            started_at: 1,
            finished_at: Some(2),
        };
        let error = || w::StepError {
            code: "http_503".into(),
            message: "unavailable".into(),
            retry_after_ms: Some(100),
        };
        vec![
            (
                "succeeded".to_owned(),
                to_datum(&result(w::StepStatus::Succeeded, Some(r#"{"x":1}"#), None)),
            ),
            (
                "failed".to_owned(),
                to_datum(&result(w::StepStatus::Failed, None, Some(error()))),
            ),
            (
                "unknown".to_owned(),
                to_datum(&result(w::StepStatus::Unknown, None, Some(error()))),
            ),
            (
                "started".to_owned(),
                to_datum(&result(w::StepStatus::Started, None, None)),
            ),
        ]
        .into_iter()
        .map(|(name, datum)| (name, datum.expect("datum")))
        .collect()
    }

    /// A run's state and events, from the fold itself.
    fn states_and_events() -> (Entries, Entries) {
        let mut graphs = Graphs::new();
        graphs
            .insert(Graph::parse(GRAPH).expect("graph"))
            .expect("insert");
        let start = Input::Command(Command {
            command_id: "cmd-1".into(),
            tenant: "acme".into(),
            run_id: "run-1".into(),
            principal: "svc:fuzz".into(),
            roles: vec![],
            groups: vec![],
            at: 1,
            body: CommandBody::StartRun {
                graph_id: "g".into(),
                graph_version: None,
                input: json!({"x": "hello"}),
                labels: Default::default(),
                budget: None,
                fork: None,
                parent: None,
            },
        });
        let applied = apply(None, &start, &graphs);
        let state = applied.state.expect("a state");
        let states = vec![(
            "started".to_owned(),
            to_datum(&sortie_model::state_to_wire(&state)).expect("datum"),
        )];
        let events = applied
            .effects
            .iter()
            .filter_map(|e| match e {
                sortie_core::Effect::Emit(event) => Some(event),
                _ => None,
            })
            .enumerate()
            .map(|(i, event)| {
                (
                    format!("event-{i}"),
                    to_datum(&sortie_model::event_to_wire(event)).expect("datum"),
                )
            })
            .collect();
        (states, events)
    }

    fn graph_files() -> Entries {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../topology/graphs");
        let mut entries: Entries = std::fs::read_dir(dir)
            .expect("topology/graphs")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
            .map(|p| {
                let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
                (
                    name.unwrap_or_default(),
                    std::fs::read(&p).expect("graph file"),
                )
            })
            .collect();
        entries.push(("small.yaml".to_owned(), GRAPH.as_bytes().to_vec()));
        entries
    }

    fn graph_records() -> Entries {
        vec![(
            "small".to_owned(),
            to_datum(&w::GraphDefinition {
                graph_id: "g".into(),
                version: 1,
                tenant: None,
                definition: GRAPH.into(),
                definition_hash: sortie_core::json::sha256_hex(&[GRAPH]),
                published_by: "fuzz".into(),
                published_at: 1,
            })
            .expect("datum"),
        )]
    }

    fn signatures() -> Entries {
        let signer = sortie_wire::signing::Signer::from_seed("fuzz-key", [7; 32]);
        let value = to_datum(&command(w::CommandBody::CancelRun(w::CancelRun {
            reason: None,
        })))
        .expect("datum");
        let [(_, key), (_, signature)] = signer.headers(&value);
        let mut good = vec![key.len() as u8];
        good.extend_from_slice(&key);
        good.extend_from_slice(&signature);
        good.extend_from_slice(&value);
        let mut unknown = vec![3u8];
        unknown.extend_from_slice(b"who");
        unknown.extend_from_slice(&signature);
        unknown.extend_from_slice(&value);
        vec![
            ("signed".to_owned(), good),
            ("unknown_key".to_owned(), unknown),
        ]
    }

    fn json_documents() -> Entries {
        [
            (
                "object",
                r#"{"b": [1, 2.5e10, -0, null], "a": {"ü": "\u0000\n"}}"#.to_owned(),
            ),
            (
                "numbers",
                "[18446744073709551615, -9223372036854775808, 1e308, 5e-324]".to_owned(),
            ),
            ("deep", nested(100).to_string()),
            ("string", r#""\ud83d\ude00 and \"quotes\"""#.to_owned()),
        ]
        .into_iter()
        .map(|(n, t)| (n.to_owned(), t.into_bytes()))
        .collect()
    }

    pub fn all() -> Vec<(&'static str, Entries)> {
        let (states, events) = states_and_events();
        vec![
            ("avro_command", commands()),
            ("avro_result", results()),
            ("avro_state", states),
            ("avro_event", events),
            ("avro_graph", graph_records()),
            ("graph_yaml", graph_files()),
            ("signature", signatures()),
            ("canonical_json", json_documents()),
        ]
    }
}
