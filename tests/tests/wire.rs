//! sortie-wire's codec against the real registry and broker: records encoded in the
//! Confluent wire format travel through a Kafka topic and decode back; bytes that are not
//! a Sortie record of the expected kind give the typed error a service dead-letters.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::Message;
use schema_registry_converter::async_impl::{avro::AvroEncoder, schema_registry::SrSettings};
use schema_registry_converter::schema_registry_common::{
    SchemaType, SubjectNameStrategy, SuppliedSchema,
};
use sortie_kafka::KafkaConfig;
use sortie_tests::{Isolation, ServedRegistry};
use sortie_wire::records::*;
use sortie_wire::{partition_for, Codec, CodecConfig, DecodeError, Record, RecordKind, Topics};

fn start_run(run_id: &str) -> RunCommand {
    RunCommand {
        command_id: format!("cmd-{run_id}"),
        tenant: "acme".into(),
        run_id: run_id.into(),
        issuer: Issuer {
            principal: "svc:orders".into(),
            roles: vec![],
            groups: vec![],
        },
        issued_at: 1_764_400_000_000,
        body: CommandBody::StartRun(StartRun {
            graph_id: "refund".into(),
            graph_version: None,
            input: r#"{"order":42}"#.into(),
            labels: BTreeMap::new(),
            budget: None,
            fork: None,
            parent: None,
        }),
    }
}

#[tokio::test]
async fn records_round_trip_through_the_registry_and_a_topic() -> anyhow::Result<()> {
    let bootstrap = sortie_tests::bootstrap().await;
    let prefix = sortie_tests::unique_prefix("wire-roundtrip");
    let kafka = KafkaConfig::new(bootstrap.clone());
    let registry = ServedRegistry::start(&kafka, &format!("{prefix}_schemas")).await?;
    let codec = Codec::new(&CodecConfig {
        registry_url: registry.url.clone(),
        auto_register: true,
    });
    let topics = Topics::new(prefix.clone());
    let commands = topics.commands();
    sortie_tests::create_topic(&bootstrap, &commands, 3, &[]).await;

    let id = codec
        .prepare(&commands, RecordKind::RunCommand, Duration::from_secs(10))
        .await?;
    let originals: Vec<RunCommand> = (0..6).map(|i| start_run(&format!("run_{i}"))).collect();
    let mut encoded = Vec::new();
    for command in &originals {
        let bytes = codec.encode(&commands, command).await?;
        assert_eq!(bytes[0], 0, "magic byte");
        assert_eq!(
            u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]),
            id
        );
        encoded.push((command.run_id.clone(), bytes));
    }
    sortie_tests::produce(&bootstrap, &commands, &encoded).await;

    let mut decoded = Vec::new();
    for message in sortie_tests::read_all(&bootstrap, &commands, Isolation::ReadCommitted).await {
        let key = String::from_utf8(message.key().unwrap_or_default().to_vec())?;
        // The harness producer uses the Java-compatible partitioner: keys land where
        // sortie-wire says they should.
        assert_eq!(
            message.partition(),
            partition_for(key.as_bytes(), 3),
            "partition of {key}"
        );
        decoded.push(codec.decode::<RunCommand>(message.payload()).await?);
    }
    decoded.sort_by(|a, b| a.run_id.cmp(&b.run_id));
    assert_eq!(decoded, originals);
    registry.stop().await
}

#[tokio::test]
async fn undecodable_bytes_give_typed_dead_letter_reasons() -> anyhow::Result<()> {
    let bootstrap = sortie_tests::bootstrap().await;
    let prefix = sortie_tests::unique_prefix("wire-bad");
    let kafka = KafkaConfig::new(bootstrap);
    let registry = ServedRegistry::start(&kafka, &format!("{prefix}_schemas")).await?;
    let codec = Codec::new(&CodecConfig {
        registry_url: registry.url.clone(),
        auto_register: true,
    });
    let topics = Topics::new(prefix);

    let not_wire = codec.decode::<RunCommand>(Some(b"{\"json\": true}")).await;
    assert!(
        matches!(not_wire, Err(DecodeError::NotWireFormat(_))),
        "{not_wire:?}"
    );
    assert_eq!(
        not_wire.expect_err("decoding must fail").reason_code(),
        "undecodable"
    );

    let unknown_id = codec
        .decode::<RunCommand>(Some(&[0, 0, 0, 0x7f, 0x11, 2, 3]))
        .await;
    assert!(
        matches!(unknown_id, Err(DecodeError::UnknownSchema(_))),
        "{unknown_id:?}"
    );
    assert_eq!(
        unknown_id.expect_err("decoding must fail").reason_code(),
        "unknown_schema"
    );

    // A valid StepResult read where a RunCommand is expected.
    let result = StepResult {
        spend: None,
        operation_id: "op_1".into(),
        attempt: 1,
        tenant: "acme".into(),
        run_id: "run_1".into(),
        step_id: "a#1".into(),
        status: StepStatus::Succeeded,
        retryable: false,
        output: Some("{}".into()),
        error: None,
        executor: "x".into(),
        started_at: 1,
        finished_at: Some(2),
    };
    let bytes = codec.encode(&topics.step_results(), &result).await?;
    let wrong = codec.decode::<RunCommand>(Some(&bytes)).await;
    assert!(
        matches!(wrong, Err(DecodeError::WrongSchema { .. })),
        "{wrong:?}"
    );
    assert_eq!(
        wrong.expect_err("decoding must fail").reason_code(),
        "wrong_schema"
    );

    // A truncated body with a valid schema id.
    let good = codec
        .encode(&topics.commands(), &start_run("run_9"))
        .await?;
    let truncated = codec
        .decode::<RunCommand>(Some(&good[..good.len() / 2]))
        .await;
    assert!(
        matches!(truncated, Err(DecodeError::Malformed(_))),
        "{truncated:?}"
    );

    // Forged bodies under a valid schema id (a producer that is not Sortie's) give an
    // error or a record, never a panic: these bytes reach the reducer's loop, and the
    // body is read straight into the record. Every byte of a real record, changed one
    // at a time to each of a few values, and the same with the tail cut off.
    for at in 5..good.len() {
        for forged in [0x00, 0x01, 0x7f, 0x80, 0xfe, 0xff] {
            let mut bytes = good.clone();
            bytes[at] = forged;
            let _ = codec.decode::<RunCommand>(Some(&bytes)).await;
            let _ = codec.decode::<RunCommand>(Some(&bytes[..=at])).await;
        }
    }

    let tombstone = codec.decode::<RunCommand>(None).await;
    assert!(
        matches!(tombstone, Err(DecodeError::Empty)),
        "{tombstone:?}"
    );
    registry.stop().await
}

#[tokio::test]
async fn an_unreachable_registry_is_retryable_not_a_dead_letter() {
    // Port 9 (discard) on loopback: nothing listens there.
    let codec = Codec::new(&CodecConfig {
        registry_url: "http://127.0.0.1:9".into(),
        auto_register: true,
    });
    let error = codec
        .decode::<RunCommand>(Some(&[0, 0, 0, 0, 1, 2]))
        .await
        .expect_err("no registry");
    assert!(error.is_retryable(), "{error:?}");
    let error = codec
        .prepare(
            "t.commands",
            RecordKind::RunCommand,
            Duration::from_millis(300),
        )
        .await
        .expect_err("no registry");
    assert!(error.is_retryable(), "{error:?}");
}

/// The converter's bytes for `record` on `topic`: what the codec wrote before it wrote
/// directly, and what any Confluent client writes with the same schema.
async fn converter_bytes<R: Record>(
    encoder: &AvroEncoder,
    topic: &str,
    record: &R,
) -> anyhow::Result<Vec<u8>> {
    let strategy = SubjectNameStrategy::TopicNameStrategyWithSchema(
        topic.to_owned(),
        false,
        SuppliedSchema::new(
            Some(R::KIND.full_name().to_owned()),
            SchemaType::Avro,
            R::KIND.schema_text().to_owned(),
        ),
    );
    Ok(encoder.encode_struct(record, &strategy).await?)
}

#[tokio::test]
async fn direct_encoding_writes_the_converters_bytes() -> anyhow::Result<()> {
    let bootstrap = sortie_tests::bootstrap().await;
    let prefix = sortie_tests::unique_prefix("wire-direct");
    let kafka = KafkaConfig::new(bootstrap);
    let registry = ServedRegistry::start(&kafka, &format!("{prefix}_schemas")).await?;
    let codec = Codec::new(&CodecConfig {
        registry_url: registry.url.clone(),
        auto_register: true,
    });
    let encoder = AvroEncoder::new(SrSettings::new(registry.url.clone()));
    let topics = Topics::new(prefix);

    // Twice each: the first record asks the registry, the second is written from memory.
    for _ in 0..2 {
        let mut approve = start_run("run_a");
        approve.body = CommandBody::ResumeRun(ResumeRun {
            interrupt_id: "refund#0".into(),
            proposal_hash: "ab".into(),
            decision: Decision::Approve,
            payload: None,
            comment: Some("ok ✓".into()),
            edited_args: Some(r#"{"amount":5}"#.into()),
            payload_is_input: false,
        });
        for command in [start_run("run_s"), approve] {
            let topic = topics.commands();
            let direct = codec.encode(&topic, &command).await?;
            assert_eq!(direct, converter_bytes(&encoder, &topic, &command).await?);
            assert_eq!(codec.decode::<RunCommand>(Some(&direct)).await?, command);
        }
        let state = RunState {
            tenant: "acme".into(),
            run_id: "run_01".into(),
            graph_id: "refund".into(),
            graph_version: 1,
            status: RunStatus::WaitingApproval,
            version: 4,
            last_event_seq: 9,
            created_at: 1,
            updated_at: 2,
            labels: BTreeMap::from([("team".to_owned(), "billing".to_owned())]),
            state: r#"{"steps":{}}"#.into(),
        };
        let topic = topics.run_state();
        let direct = codec.encode(&topic, &state).await?;
        assert_eq!(direct, converter_bytes(&encoder, &topic, &state).await?);
        let event = RunEvent {
            tenant: "acme".into(),
            run_id: "run_01".into(),
            seq: 1,
            state_version: 1,
            at: 5,
            command_id: Some("cmd-run_01".into()),
            operation_id: None,
            prev_hash: None,
            hash: Some("ab".into()),
            body: EventBody::RunStarted(RunStarted {
                graph_id: "refund".into(),
                graph_version: 1,
                input: "{}".into(),
                started_by: "svc:orders".into(),
                labels: BTreeMap::new(),
                deadline_at: Some(9),
                budget: None,
                forked_from: None,
                rules: 1,
                parent: None,
            }),
        };
        let topic = topics.run_events();
        let direct = codec.encode(&topic, &event).await?;
        assert_eq!(direct, converter_bytes(&encoder, &topic, &event).await?);
        assert_eq!(codec.decode::<RunEvent>(Some(&direct)).await?, event);
    }
    registry.stop().await
}

#[tokio::test]
async fn a_subject_registered_with_another_schema_is_written_with_that_schema() -> anyhow::Result<()>
{
    // A newer build registered RunCommand with one more field (with a default) first, and
    // this process may not register: the latest version is used, so the bytes must be
    // written with it. Red-proofed: with the codec's schema comparison skipped (every
    // subject written directly with this build's schema) the record came back undecodable.
    let bootstrap = sortie_tests::bootstrap().await;
    let prefix = sortie_tests::unique_prefix("wire-newer");
    let kafka = KafkaConfig::new(bootstrap);
    let registry = ServedRegistry::start(&kafka, &format!("{prefix}_schemas")).await?;
    let topics = Topics::new(prefix);
    let topic = topics.commands();
    let mut newer: serde_json::Value = serde_json::from_str(RecordKind::RunCommand.schema_text())?;
    newer["fields"]
        .as_array_mut()
        .expect("a record schema has fields")
        .push(serde_json::json!({
            "name": "priority", "type": "string", "default": "normal",
            "doc": "Added by a newer build."
        }));
    let answer = reqwest::Client::new()
        .post(format!("{}/subjects/{topic}-value/versions", registry.url))
        .header("Content-Type", "application/vnd.schemaregistry.v1+json")
        .body(serde_json::json!({ "schema": newer.to_string() }).to_string())
        .send()
        .await?;
    anyhow::ensure!(
        answer.status().is_success(),
        "register: {}",
        answer.text().await?
    );

    let codec = Codec::new(&CodecConfig {
        registry_url: registry.url.clone(),
        auto_register: false,
    });
    let command = start_run("run_n");
    for _ in 0..2 {
        let bytes = codec.encode(&topic, &command).await?;
        assert_ne!(
            &bytes[5..],
            sortie_wire::to_datum(&command)?.as_slice(),
            "written with this build's schema under the newer schema's id"
        );
        assert_eq!(codec.decode::<RunCommand>(Some(&bytes)).await?, command);
    }
    registry.stop().await
}
