//! The decoders' targets: each takes arbitrary bytes and must answer with a value or a
//! refusal — never a panic, never a hang, never an allocation the bytes do not pay for —
//! and whatever it accepts must hold Sortie's own rules, so it can be stored and read
//! back (`sortie_core::limits`). A target that finds otherwise panics: that is the
//! finding.
//!
//! The same functions serve the suite (`tests/decoders.rs` runs every seed of
//! `corpus/<target>/` and seeded mutations of them) and a coverage-guided fuzzer
//! (`fuzz/fuzz_targets/<target>.rs`, cargo-fuzz on nightly).

use serde_json::Value;
use sortie_core::limits;
use sortie_wire::records as w;
use sortie_wire::{from_datum, Record};

/// A decoder target: arbitrary bytes in, a panic only for a finding.
pub type Target = fn(&[u8]);

/// Every target, by the name of its corpus folder and fuzz target.
pub const TARGETS: &[(&str, Target)] = &[
    ("avro_command", avro_command),
    ("avro_result", avro_result),
    ("avro_state", avro_state),
    ("avro_event", avro_event),
    ("avro_graph", avro_graph),
    ("graph_yaml", graph_yaml),
    ("signature", signature),
    ("canonical_json", canonical_json),
];

/// A bare datum of `R` (this build's schema), as the codec reads the body of a record.
fn datum<R: Record>(bytes: &[u8]) -> Option<R> {
    from_datum::<R>(R::KIND.schema(), bytes).ok()
}

/// What must hold of every payload the model layer accepts.
fn shaped(field: &str, value: &Value) {
    if let Err(e) = limits::check_shape(field, value) {
        panic!("the model accepted a {field} past the limits: {e}");
    }
    let measured = limits::measure(value);
    assert!(measured.depth <= limits::MAX_DEPTH, "{field}: {measured:?}");
}

fn identified(field: &str, id: &str) {
    if let Err(e) = limits::check_id(field, id) {
        panic!("the model accepted {field} {id:?}: {e}");
    }
}

/// A `sortie.commands` value body through the model layer (`command_from_wire`): what
/// it accepts has ids that fit everywhere and payloads of the shape every store reads
/// back.
pub fn avro_command(bytes: &[u8]) {
    let Some(record) = datum::<w::RunCommand>(bytes) else {
        return;
    };
    let Ok(command) = sortie_model::command_from_wire(record) else {
        return;
    };
    identified("run_id", &command.run_id);
    identified("command_id", &command.command_id);
    identified("tenant", &command.tenant);
    use sortie_core::CommandBody as B;
    match &command.body {
        B::StartRun {
            graph_id,
            input,
            labels,
            ..
        } => {
            identified("graph_id", graph_id);
            shaped("input", input);
            assert!(labels.len() <= limits::MAX_LABELS);
        }
        B::ResumeRun {
            payload,
            edited_args,
            comment,
            ..
        } => {
            for (field, value) in [("payload", payload), ("edited_args", edited_args)] {
                if let Some(value) = value {
                    shaped(field, value);
                }
            }
            assert!(comment
                .as_ref()
                .is_none_or(|c| c.len() <= limits::MAX_TEXT_BYTES));
        }
        B::ReconcileOperation { output, .. } => {
            if let Some(output) = output {
                shaped("output", output);
            }
        }
        B::SignalRun {
            name,
            signal_id,
            payload,
        } => {
            identified("signal name", name);
            identified("signal_id", signal_id);
            shaped("payload", payload);
        }
        B::CancelRun { reason } | B::ForgetRun { reason } => {
            assert!(reason
                .as_ref()
                .is_none_or(|r| r.len() <= limits::MAX_TEXT_BYTES));
        }
    }
}

/// A `sortie.step-results` value body through the model layer (`report_from_wire`).
pub fn avro_result(bytes: &[u8]) {
    let Some(record) = datum::<w::StepResult>(bytes) else {
        return;
    };
    let Ok(report) = sortie_model::report_from_wire(record, 0) else {
        return;
    };
    identified("run_id", &report.run_id);
    identified("operation_id", &report.operation_id);
    match &report.outcome {
        sortie_core::StepOutcome::Succeeded { output } => shaped("output", output),
        sortie_core::StepOutcome::Failed { message, .. }
        | sortie_core::StepOutcome::Unknown { message, .. } => {
            assert!(message.len() <= limits::MAX_TEXT_BYTES);
        }
        sortie_core::StepOutcome::Started => {}
    }
}

/// A `sortie.run-state` value body as the restore and the views read it: a state that
/// reads writes back to a document that reads again.
pub fn avro_state(bytes: &[u8]) {
    let Some(record) = datum::<w::RunState>(bytes) else {
        return;
    };
    let Ok(state) = sortie_model::state_from_wire(&record) else {
        return;
    };
    let again = sortie_model::state_to_wire(&state);
    let reread = sortie_model::state_from_wire(&again);
    assert!(
        reread.is_ok(),
        "a state that read does not read back: {reread:?}"
    );
}

/// A `sortie.run-events` value body as the views and the audit read it: an event that
/// maps to the core maps back to the wire and reads again, the same.
pub fn avro_event(bytes: &[u8]) {
    let Some(record) = datum::<w::RunEvent>(bytes) else {
        return;
    };
    let Ok(event) = sortie_model::event_from_wire(record) else {
        return;
    };
    let again = sortie_model::event_from_wire(sortie_model::event_to_wire(&event));
    assert_eq!(
        again.as_ref().ok(),
        Some(&event),
        "an event does not map back"
    );
}

/// A `sortie.graphs` value body: its definition parsed as the catalog parses it.
pub fn avro_graph(bytes: &[u8]) {
    if let Some(record) = datum::<w::GraphDefinition>(bytes) {
        graph_yaml(record.definition.as_bytes());
    }
}

/// A graph definition's YAML (or JSON): a graph that parses holds the limits.
pub fn graph_yaml(bytes: &[u8]) {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return;
    };
    let Ok(graph) = sortie_core::Graph::parse(text) else {
        return;
    };
    assert!(graph.nodes.len() <= sortie_core::graph::MAX_NODES);
    for node in &graph.nodes {
        shaped("args", &node.args);
        shaped("config", &node.config);
    }
}

/// Command signature headers and the value they sign, against a keyring: the first byte
/// says how many of the bytes are the key id header, the next 64 are the signature, the
/// rest the value. Whatever they hold, the check answers; it accepts only what the
/// keyring's key signed.
pub fn signature(bytes: &[u8]) {
    let Some((&split, rest)) = bytes.split_first() else {
        return;
    };
    let at = usize::from(split).min(rest.len());
    let (key_id, rest) = rest.split_at(at);
    let (signature, value) = rest.split_at(rest.len().min(64));
    let keyring = fixed_keyring();
    let claim = sortie_wire::signing::Claim {
        tenant: "acme",
        principal: "svc:fuzz",
        roles: &[],
        groups: &[],
    };
    let headers = [
        (sortie_wire::signing::KEY_HEADER, Some(key_id)),
        (sortie_wire::signing::SIGNATURE_HEADER, Some(signature)),
    ];
    if let Ok(Some(_)) = keyring.check(headers, value, claim) {
        // Only the one key signs, and only the fuzzer's input could have: a forgery.
        let signer = fixed_signer();
        let expected = signer.headers(value);
        assert_eq!(
            signature,
            &expected[1].1[..],
            "a signature the key did not make was taken"
        );
    }
}

fn fixed_signer() -> &'static sortie_wire::signing::Signer {
    static SIGNER: std::sync::OnceLock<sortie_wire::signing::Signer> = std::sync::OnceLock::new();
    SIGNER.get_or_init(|| sortie_wire::signing::Signer::from_seed("fuzz-key", [7; 32]))
}

fn fixed_keyring() -> &'static sortie_wire::signing::Keyring {
    static KEYRING: std::sync::OnceLock<sortie_wire::signing::Keyring> = std::sync::OnceLock::new();
    KEYRING.get_or_init(|| {
        let entry = fixed_signer().entry("svc:fuzz", &["acme".to_owned()], &[], false);
        sortie_wire::signing::Keyring::parse(&sortie_wire::signing::keyring_text(&[entry]))
            .unwrap_or_default()
    })
}

/// JSON as the fold hashes it: canonical text is a fixed point (it parses back to the
/// same value and prints the same text), and the streamed hash is the hash of that text.
pub fn canonical_json(bytes: &[u8]) {
    let Ok(value) = serde_json::from_slice::<Value>(bytes) else {
        return;
    };
    let text = sortie_core::json::canonical(&value);
    let reparsed: Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => panic!("canonical text does not parse back: {e}"),
    };
    assert_eq!(
        sortie_core::json::canonical(&reparsed),
        text,
        "not a fixed point"
    );
    assert_eq!(
        sortie_core::json::sha256_hex_of("fuzz", &value),
        sortie_core::json::sha256_hex(&["fuzz", &text]),
        "the streamed hash is not the text's"
    );
}
