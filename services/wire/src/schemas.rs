use std::sync::OnceLock;

use apache_avro::Schema;

/// The record kinds of Sortie's contract, one per topic value schema in `schemas/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecordKind {
    RunCommand,
    StepIntent,
    StepResult,
    RunEvent,
    RunState,
    GraphDefinition,
    DeadLetter,
    StepDelta,
}

impl RecordKind {
    pub const ALL: [RecordKind; 8] = [
        RecordKind::RunCommand,
        RecordKind::StepIntent,
        RecordKind::StepResult,
        RecordKind::RunEvent,
        RecordKind::RunState,
        RecordKind::GraphDefinition,
        RecordKind::DeadLetter,
        RecordKind::StepDelta,
    ];

    /// File name under `schemas/`.
    pub fn file(self) -> &'static str {
        match self {
            RecordKind::RunCommand => "run-command.avsc",
            RecordKind::StepIntent => "step-intent.avsc",
            RecordKind::StepResult => "step-result.avsc",
            RecordKind::RunEvent => "run-event.avsc",
            RecordKind::RunState => "run-state.avsc",
            RecordKind::GraphDefinition => "graph-definition.avsc",
            RecordKind::DeadLetter => "dead-letter.avsc",
            RecordKind::StepDelta => "step-delta.avsc",
        }
    }

    /// The Avro full name of the record.
    pub fn full_name(self) -> &'static str {
        match self {
            RecordKind::RunCommand => "dev.sortie.v1.RunCommand",
            RecordKind::StepIntent => "dev.sortie.v1.StepIntent",
            RecordKind::StepResult => "dev.sortie.v1.StepResult",
            RecordKind::RunEvent => "dev.sortie.v1.RunEvent",
            RecordKind::RunState => "dev.sortie.v1.RunState",
            RecordKind::GraphDefinition => "dev.sortie.v1.GraphDefinition",
            RecordKind::DeadLetter => "dev.sortie.v1.DeadLetter",
            RecordKind::StepDelta => "dev.sortie.v1.StepDelta",
        }
    }

    /// The schema text as committed in `schemas/`.
    pub fn schema_text(self) -> &'static str {
        match self {
            RecordKind::RunCommand => include_str!("../../../schemas/run-command.avsc"),
            RecordKind::StepIntent => include_str!("../../../schemas/step-intent.avsc"),
            RecordKind::StepResult => include_str!("../../../schemas/step-result.avsc"),
            RecordKind::RunEvent => include_str!("../../../schemas/run-event.avsc"),
            RecordKind::RunState => include_str!("../../../schemas/run-state.avsc"),
            RecordKind::GraphDefinition => include_str!("../../../schemas/graph-definition.avsc"),
            RecordKind::DeadLetter => include_str!("../../../schemas/dead-letter.avsc"),
            RecordKind::StepDelta => include_str!("../../../schemas/step-delta.avsc"),
        }
    }

    /// The parsed schema (parsed once per process).
    pub fn schema(self) -> &'static Schema {
        static PARSED: OnceLock<Vec<Schema>> = OnceLock::new();
        let parsed = PARSED.get_or_init(|| {
            RecordKind::ALL
                .iter()
                .map(|kind| {
                    Schema::parse_str(kind.schema_text()).unwrap_or_else(|e| {
                        // The files are compiled in and covered by tests: a parse failure
                        // is a build defect, not an input error.
                        panic!("schemas/{} does not parse: {e}", kind.file())
                    })
                })
                .collect()
        });
        &parsed[self as usize]
    }
}
