//! The Avro contract in `schemas/`: every schema parses and documents every field, every
//! record type round-trips through its schema, and the current schemas stay BACKWARD
//! compatible with every released version in `schemas/released/`.

use std::{collections::BTreeMap, path::PathBuf};

use apache_avro::{schema_compatibility::SchemaCompatibility, Schema};
use serde_json::Value as Json;
use sortie_wire::{from_datum, records::*, to_datum, RecordKind};

fn schemas_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../schemas")
}

fn undocumented(json: &Json, path: &str, out: &mut Vec<String>) {
    match json {
        Json::Object(map) => {
            if map.get("type").and_then(Json::as_str) == Some("record")
                || map.get("type").and_then(Json::as_str) == Some("enum")
            {
                let name = map.get("name").and_then(Json::as_str).unwrap_or("?");
                if map
                    .get("doc")
                    .and_then(Json::as_str)
                    .unwrap_or("")
                    .is_empty()
                {
                    out.push(format!("{path}{name}"));
                }
                if let Some(Json::Array(fields)) = map.get("fields") {
                    for field in fields {
                        let fname = field.get("name").and_then(Json::as_str).unwrap_or("?");
                        if field
                            .get("doc")
                            .and_then(Json::as_str)
                            .unwrap_or("")
                            .is_empty()
                        {
                            out.push(format!("{path}{name}.{fname}"));
                        }
                        if let Some(ty) = field.get("type") {
                            undocumented(ty, &format!("{path}{name}.{fname}/"), out);
                        }
                    }
                }
            }
            for key in ["items", "values"] {
                if let Some(inner) = map.get(key) {
                    undocumented(inner, path, out);
                }
            }
        }
        Json::Array(branches) => branches.iter().for_each(|b| undocumented(b, path, out)),
        _ => {}
    }
}

#[test]
fn every_schema_parses_is_namespaced_and_documents_every_field() {
    for kind in RecordKind::ALL {
        let text = std::fs::read_to_string(schemas_dir().join(kind.file())).expect("schema file");
        assert_eq!(
            text,
            kind.schema_text(),
            "{} is embedded as committed",
            kind.file()
        );
        let json: Json = serde_json::from_str(&text).expect("schema is JSON");
        assert_eq!(json["namespace"], "dev.sortie.v1", "{}", kind.file());
        let mut missing = Vec::new();
        undocumented(&json, "", &mut missing);
        assert!(
            missing.is_empty(),
            "{} lacks doc on {missing:?}",
            kind.file()
        );
        assert_eq!(
            kind.schema().name().map(|n| n.fullname(None)),
            Some(kind.full_name().to_owned())
        );
    }
}

#[test]
fn current_schemas_read_every_released_version() {
    let released = schemas_dir().join("released");
    let mut checked = 0;
    for version in std::fs::read_dir(&released).expect("schemas/released exists") {
        let version = version.expect("dir entry").path();
        for file in std::fs::read_dir(&version).expect("release dir") {
            let file = file.expect("dir entry").path();
            let name = file
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default()
                .to_owned();
            let kind = RecordKind::ALL
                .into_iter()
                .find(|k| k.file() == name)
                .unwrap_or_else(|| {
                    panic!("released schema {} has no current schema", file.display())
                });
            let old = Schema::parse_str(&std::fs::read_to_string(&file).expect("read"))
                .expect("released schema parses");
            if let Err(e) = SchemaCompatibility::can_read(&old, kind.schema()) {
                panic!(
                    "schemas/{} cannot read data written with {}: {e}. Changes must be BACKWARD compatible: add fields with defaults, never remove or retype one.",
                    kind.file(),
                    file.display()
                );
            }
            checked += 1;
        }
    }
    // Schemas added since the last release have no released version yet; cutting a
    // release copies them into `released/` too.
    const UNRELEASED: &[RecordKind] = &[RecordKind::StepDelta];
    assert!(
        checked >= RecordKind::ALL.len() - UNRELEASED.len(),
        "only {checked} released schemas checked"
    );
}

#[test]
fn the_compatibility_check_catches_a_breaking_change() {
    // A new required field without a default cannot read old data: the guard above must say so.
    let mut json: Json = serde_json::from_str(RecordKind::StepResult.schema_text()).expect("json");
    json["fields"]
        .as_array_mut()
        .expect("fields")
        .push(serde_json::json!({"name": "cost_cents", "type": "long", "doc": "new"}));
    let broken = Schema::parse_str(&json.to_string()).expect("parses");
    assert!(SchemaCompatibility::can_read(RecordKind::StepResult.schema(), &broken).is_err());

    // The same field with a default is fine.
    json["fields"]
        .as_array_mut()
        .expect("fields")
        .last_mut()
        .expect("field")["default"] = serde_json::json!(0);
    let evolved = Schema::parse_str(&json.to_string()).expect("parses");
    assert!(SchemaCompatibility::can_read(RecordKind::StepResult.schema(), &evolved).is_ok());
}

fn round_trip<R: Record + PartialEq + std::fmt::Debug>(record: R) {
    let bytes = to_datum(&record).unwrap_or_else(|e| panic!("encode {record:?}: {e}"));
    let back: R =
        from_datum(R::KIND.schema(), &bytes).unwrap_or_else(|e| panic!("decode {record:?}: {e}"));
    assert_eq!(back, record);
}

fn command(body: CommandBody) -> RunCommand {
    RunCommand {
        command_id: "cmd-1".into(),
        tenant: "acme".into(),
        run_id: "run_01".into(),
        issuer: Issuer {
            principal: "svc:orders".into(),
            roles: vec!["approver".into()],
            groups: vec![],
        },
        issued_at: 1_764_400_000_000,
        body,
    }
}

fn event(body: EventBody) -> RunEvent {
    RunEvent {
        tenant: "acme".into(),
        run_id: "run_01".into(),
        seq: 7,
        state_version: 5,
        at: 1_764_400_000_123,
        command_id: Some("cmd-1".into()),
        operation_id: None,
        prev_hash: Some("ab".into()),
        hash: Some("cd".into()),
        body,
    }
}

#[test]
fn every_command_round_trips() {
    round_trip(command(CommandBody::StartRun(StartRun {
        graph_id: "refund".into(),
        graph_version: Some(3),
        input: r#"{"order":42}"#.into(),
        labels: BTreeMap::from([("team".to_owned(), "support".to_owned())]),
        budget: None,
        fork: None,
        parent: None,
    })));
    round_trip(command(CommandBody::StartRun(StartRun {
        graph_id: "refund".into(),
        graph_version: None,
        input: "{}".into(),
        labels: BTreeMap::new(),
        budget: None,
        fork: None,
        parent: None,
    })));
    round_trip(command(CommandBody::ResumeRun(ResumeRun {
        interrupt_id: "int-1".into(),
        proposal_hash: "h".into(),
        decision: Decision::Reject,
        payload: Some("{}".into()),
        comment: None,
        edited_args: None,
        payload_is_input: false,
    })));
    round_trip(command(CommandBody::CancelRun(CancelRun {
        reason: Some("customer asked".into()),
    })));
    round_trip(command(CommandBody::ForgetRun(
        sortie_wire::records::ForgetRun {
            reason: Some("erasure request".into()),
        },
    )));
    round_trip(command(CommandBody::SignalRun(
        sortie_wire::records::SignalRun {
            name: "laptop_delivered".into(),
            signal_id: Some("dlv-1".into()),
            payload: Some(r#"{"tracking":"1Z9"}"#.into()),
        },
    )));
    round_trip(command(CommandBody::SignalRun(
        sortie_wire::records::SignalRun {
            name: "laptop_delivered".into(),
            signal_id: None,
            payload: None,
        },
    )));
    round_trip(command(CommandBody::ReconcileOperation(
        ReconcileOperation {
            operation_id: "op-1".into(),
            outcome: ReconcileOutcome::Succeeded,
            output: Some("{}".into()),
            error: None,
        },
    )));
}

#[test]
fn intents_results_states_graphs_and_dead_letters_round_trip() {
    round_trip(StepIntent {
        operation_id: "op-1".into(),
        attempt: 2,
        tenant: "acme".into(),
        run_id: "run_01".into(),
        step_id: "refund#0".into(),
        node: "refund".into(),
        graph_id: "refund".into(),
        graph_version: 1,
        tool: "http".into(),
        queue: "http".into(),
        side_effect: SideEffectClass::Keyed,
        args: r#"{"amount":10}"#.into(),
        config: "{}".into(),
        timeout_ms: Some(30_000),
        issued_at: 1,
        lookup_only: true,
    });
    for status in [
        StepStatus::Started,
        StepStatus::Succeeded,
        StepStatus::Failed,
        StepStatus::Unknown,
    ] {
        round_trip(StepResult {
            spend: None,
            operation_id: "op-1".into(),
            attempt: 1,
            tenant: "acme".into(),
            run_id: "run_01".into(),
            step_id: "s".into(),
            status,
            retryable: true,
            output: None,
            error: Some(StepError {
                code: "http_429".into(),
                message: "slow down".into(),
                retry_after_ms: Some(500),
            }),
            executor: "exec-1".into(),
            started_at: 10,
            finished_at: Some(20),
        });
    }
    round_trip(RunState {
        tenant: "acme".into(),
        run_id: "run_01".into(),
        graph_id: "refund".into(),
        graph_version: 1,
        status: RunStatus::WaitingApproval,
        version: 4,
        last_event_seq: 9,
        created_at: 1,
        updated_at: 2,
        labels: BTreeMap::new(),
        state: "{}".into(),
    });
    round_trip(GraphDefinition {
        graph_id: "refund".into(),
        version: 1,
        tenant: None,
        definition: "{}".into(),
        definition_hash: "00".into(),
        published_by: "ci".into(),
        published_at: 3,
    });
    round_trip(DeadLetter {
        reason_code: "undecodable".into(),
        reason: "not in the Confluent wire format".into(),
        service: "reducer-0".into(),
        original_topic: "sortie.commands".into(),
        original_partition: 3,
        original_offset: 42,
        original_timestamp: Some(5),
        original_key: Some(b"run_01".to_vec()),
        original_value: Some(vec![0xff, 0x00, 0x13]),
        original_headers: vec![
            Header {
                key: "trace".into(),
                value: Some(vec![1, 2]),
            },
            Header {
                key: "empty".into(),
                value: None,
            },
        ],
        failed_at: 6,
    });
}

#[test]
fn every_event_kind_round_trips() {
    let bodies = vec![
        EventBody::CommandAccepted(CommandAccepted {
            command_id: "c".into(),
            command: "StartRun".into(),
            duplicate: true,
        }),
        EventBody::CommandRejected(CommandRejected {
            command_id: "c".into(),
            command: "ResumeRun".into(),
            code: "stale_proposal".into(),
            reason: "proposal changed".into(),
        }),
        EventBody::RunStarted(RunStarted {
            graph_id: "g".into(),
            graph_version: 2,
            input: "{}".into(),
            started_by: "svc".into(),
            labels: BTreeMap::new(),
            budget: None,
            deadline_at: Some(5),
            forked_from: None,
            rules: 1,
            parent: None,
        }),
        EventBody::StepDispatched(StepDispatched {
            step_id: "s".into(),
            node: "n".into(),
            attempt: 1,
            tool: "echo".into(),
            queue: "default".into(),
            args: "{}".into(),
            compensates: Some("t".into()),
            side_effect: Some(SideEffectClass::Keyed),
            timeout_at: Some(9),
            requested_by: None,
            substitute_for: None,
            precheck_for: None,
            lookup_only: true,
        }),
        EventBody::StepStarted(StepStarted {
            step_id: "s".into(),
            attempt: 1,
        }),
        EventBody::StepSucceeded(StepSucceeded {
            step_id: "s".into(),
            attempt: 1,
            output: "{}".into(),
        }),
        EventBody::StepFailed(StepFailed {
            step_id: "s".into(),
            attempt: 1,
            code: "http_500".into(),
            message: "boom".into(),
            retryable: true,
            retry_at: Some(99),
        }),
        EventBody::StepOutcomeUnknown(StepOutcomeUnknown {
            step_id: "s".into(),
            attempt: 1,
            message: "timeout".into(),
            needs_operator: true,
        }),
        EventBody::OperationReconciled(OperationReconciled {
            step_id: "s".into(),
            outcome: ReconcileOutcome::Failed,
            by: "ops".into(),
            output: None,
            error: Some("declined".into()),
        }),
        EventBody::Interrupted(Interrupted {
            interrupt_id: "i".into(),
            step_id: "s".into(),
            node: "n".into(),
            proposal: "{}".into(),
            proposal_hash: "h".into(),
            reason: "refund over limit".into(),
            required_role: Some("approver".into()),
            approver_group: None,
            quorum: 2,
            expires_at: Some(1000),
            requested_by: Some("agent#1".into()),
            substitute_for: None,
            context: None,
            members_only: false,
        }),
        EventBody::InterruptDecided(InterruptDecided {
            interrupt_id: "i".into(),
            proposal_hash: "h".into(),
            decision: Decision::Approve,
            decided_by: "alice".into(),
            payload: None,
            comment: Some("ok".into()),
            is_final: false,
            edited_args: None,
        }),
        EventBody::InterruptEscalated(InterruptEscalated {
            interrupt_id: "i".into(),
            approver_group: "managers".into(),
            expires_at: 2000,
        }),
        EventBody::InterruptExpired(InterruptExpired {
            interrupt_id: "i".into(),
            on_timeout: "fail".into(),
        }),
        EventBody::CancelRequested(CancelRequested {
            requested_by: "bob".into(),
            reason: None,
        }),
        EventBody::RunStatusChanged(RunStatusChanged {
            status: RunStatus::Succeeded,
            reason: None,
            output: Some("{}".into()),
            forget_at: Some(3000),
        }),
        EventBody::DecisionBuffered(DecisionBuffered {
            interrupt_id: "i".into(),
            proposal_hash: "h".into(),
            decision: Decision::Approve,
            decided_by: "alice".into(),
            roles: vec!["approver".into()],
            payload: None,
            comment: None,
            groups: vec![],
            edited_args: None,
        }),
        EventBody::RunForgotten(RunForgotten {
            reason: "retention".into(),
        }),
        EventBody::SignalWaitOpened(sortie_wire::records::SignalWaitOpened {
            step_id: "delivered#1".into(),
            node: "delivered".into(),
            signal: "laptop_delivered".into(),
            many: false,
            wanted: 1,
            expires_at: Some(7_000),
        }),
        EventBody::SignalReceived(sortie_wire::records::SignalReceived {
            step_id: "delivered#1".into(),
            signal: "laptop_delivered".into(),
            signal_id: "dlv-1".into(),
            payload: r#"{"tracking":"1Z9"}"#.into(),
            sent_by: "svc:logistics".into(),
        }),
        EventBody::SignalBuffered(sortie_wire::records::SignalBuffered {
            signal: "laptop_delivered".into(),
            signal_id: "dlv-1".into(),
            payload: "null".into(),
            sent_by: "svc:logistics".into(),
        }),
        EventBody::SignalWaitExpired(sortie_wire::records::SignalWaitExpired {
            step_id: "delivered#1".into(),
            on_timeout: "goto".into(),
        }),
        EventBody::BudgetReserved(sortie_wire::records::BudgetReserved {
            step_id: "research#1".into(),
            child_run_id: "sub_0123".into(),
            limits: r#"{"tokens":1000}"#.into(),
        }),
        EventBody::BudgetSettled(sortie_wire::records::BudgetSettled {
            step_id: "research#1".into(),
            spent: r#"{"prompt_tokens":400,"completion_tokens":100,"cost_usd":0.05,"llm_calls":1,"tool_calls":0}"#.into(),
        }),
    ];
    let schema: Json = serde_json::from_str(RecordKind::RunEvent.schema_text()).expect("json");
    let Json::Array(branches) = &schema["fields"]
        .as_array()
        .expect("fields")
        .iter()
        .find(|f| f["name"] == "body")
        .expect("body field")["type"]
    else {
        panic!("body is a union")
    };
    assert_eq!(
        bodies.len(),
        branches.len(),
        "every event kind in the schema is covered here"
    );
    for body in bodies {
        round_trip(event(body));
    }
}

#[test]
fn a_record_written_with_an_older_schema_reads_with_defaults() {
    // Simulate a released writer that lacked an optional field: drop `comment` from ResumeRun.
    let mut json: Json = serde_json::from_str(RecordKind::RunCommand.schema_text()).expect("json");
    let body = json["fields"]
        .as_array_mut()
        .expect("fields")
        .iter_mut()
        .find(|f| f["name"] == "body")
        .expect("body");
    let resume = body["type"]
        .as_array_mut()
        .expect("union")
        .iter_mut()
        .find(|b| b["name"] == "ResumeRun")
        .expect("ResumeRun");
    resume["fields"]
        .as_array_mut()
        .expect("fields")
        .retain(|f| f["name"] != "comment");
    let old = Schema::parse_str(&json.to_string()).expect("parses");

    let record = command(CommandBody::ResumeRun(ResumeRun {
        interrupt_id: "i".into(),
        proposal_hash: "h".into(),
        decision: Decision::Approve,
        payload: None,
        comment: None,
        edited_args: None,
        payload_is_input: false,
    }));
    // Encode with the old writer schema: the serializer skips nothing, so encode through a
    // struct shaped like the old schema.
    #[derive(serde::Serialize)]
    struct OldResume<'a> {
        interrupt_id: &'a str,
        proposal_hash: &'a str,
        decision: Decision,
        payload: Option<String>,
    }
    #[derive(serde::Serialize)]
    enum OldBody<'a> {
        #[allow(dead_code)]
        StartRun(()),
        ResumeRun(OldResume<'a>),
    }
    #[derive(serde::Serialize)]
    struct OldCommand<'a> {
        command_id: &'a str,
        tenant: &'a str,
        run_id: &'a str,
        issuer: &'a Issuer,
        issued_at: i64,
        body: OldBody<'a>,
    }
    let old_record = OldCommand {
        command_id: &record.command_id,
        tenant: &record.tenant,
        run_id: &record.run_id,
        issuer: &record.issuer,
        issued_at: record.issued_at,
        body: OldBody::ResumeRun(OldResume {
            interrupt_id: "i",
            proposal_hash: "h",
            decision: Decision::Approve,
            payload: None,
        }),
    };
    let bytes = apache_avro::writer::datum::GenericDatumWriter::builder(&old)
        .build()
        .and_then(|w| w.write_ser_to_vec(&old_record))
        .expect("old encode");
    let back: RunCommand = from_datum(&old, &bytes).expect("current build reads old data");
    assert_eq!(back, record);
}

#[test]
fn union_branches_resolve_by_name_not_by_shape() {
    // A writer whose union lists the command kinds in another order: the Avro spec resolves
    // branches by name, so a ReconcileOperation must not turn into the first branch it fits.
    let mut json: Json = serde_json::from_str(RecordKind::RunCommand.schema_text()).expect("json");
    let body = json["fields"]
        .as_array_mut()
        .expect("fields")
        .iter_mut()
        .find(|f| f["name"] == "body")
        .expect("body");
    body["type"].as_array_mut().expect("union").reverse();
    let reordered = Schema::parse_str(&json.to_string()).expect("parses");

    // Variant index = branch index in the reversed union: SignalRun is now first.
    #[derive(serde::Serialize)]
    #[allow(dead_code)]
    enum Reversed {
        SignalRun(sortie_wire::records::SignalRun),
        ForgetRun(sortie_wire::records::ForgetRun),
        ReconcileOperation(ReconcileOperation),
    }
    #[derive(serde::Serialize)]
    struct Writer<'a> {
        command_id: &'a str,
        tenant: &'a str,
        run_id: &'a str,
        issuer: Issuer,
        issued_at: i64,
        body: Reversed,
    }
    let op = ReconcileOperation {
        operation_id: "op-9".into(),
        outcome: ReconcileOutcome::Failed,
        output: None,
        error: Some("declined".into()),
    };
    let written = Writer {
        command_id: "c",
        tenant: "t",
        run_id: "r",
        issuer: Issuer {
            principal: "ops".into(),
            roles: vec![],
            groups: vec![],
        },
        issued_at: 5,
        body: Reversed::ReconcileOperation(op.clone()),
    };
    let bytes = apache_avro::writer::datum::GenericDatumWriter::builder(&reordered)
        .build()
        .and_then(|w| w.write_ser_to_vec(&written))
        .expect("encode with reordered writer");
    let back: RunCommand = from_datum(&reordered, &bytes).expect("decode");
    assert_eq!(back.body, CommandBody::ReconcileOperation(op));
}
