//! The schema registry subset against the real broker, driven by clients written by
//! others: `schema_registry_converter` (Rust) and `confluent_kafka.schema_registry`
//! (Python), plus raw HTTP for compatibility, restart and error answers. Each test has its
//! own schemas topic and serves on 127.0.0.1:0.

use anyhow::{ensure, Context as _};
use schema_registry_converter::async_impl::avro::{AvroDecoder, AvroEncoder};
use schema_registry_converter::async_impl::schema_registry::SrSettings;
use schema_registry_converter::schema_registry_common::{
    SchemaType, SubjectNameStrategy, SuppliedSchema,
};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sortie_kafka::KafkaConfig;
use sortie_registry::CONTENT_TYPE_V1;
use sortie_tests::{Isolation, ServedRegistry as Served};

/// A JSON answer: status, content type, body.
#[derive(Debug)]
struct Answer {
    status: u16,
    content_type: String,
    body: Value,
}

async fn call(method: &str, url: &str, body: Option<Value>) -> anyhow::Result<Answer> {
    let client = reqwest::Client::new();
    let mut request = client.request(method.parse()?, url);
    if let Some(body) = body {
        request = request
            .header("Content-Type", CONTENT_TYPE_V1)
            .body(body.to_string());
    }
    let response = request.send().await?;
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let text = response.text().await?;
    let body = serde_json::from_str(&text)
        .with_context(|| format!("{method} {url} answered {status} with non-JSON {text:?}"))?;
    Ok(Answer {
        status,
        content_type,
        body,
    })
}

async fn kafka() -> KafkaConfig {
    KafkaConfig::new(sortie_tests::bootstrap().await)
}

fn schema_body(schema: &str) -> Value {
    json!({ "schema": schema })
}

const ORDER_V1: &str = r#"{"type":"record","name":"Order","namespace":"sortie.test","fields":[{"name":"id","type":"string"},{"name":"amount","type":"long"}]}"#;
const ORDER_V2_NO_DEFAULT: &str = r#"{"type":"record","name":"Order","namespace":"sortie.test","fields":[{"name":"id","type":"string"},{"name":"amount","type":"long"},{"name":"note","type":"string"}]}"#;
const ORDER_V2_DEFAULT: &str = r#"{"type":"record","name":"Order","namespace":"sortie.test","fields":[{"name":"id","type":"string"},{"name":"amount","type":"long"},{"name":"note","type":"string","default":""}]}"#;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Greeting {
    name: String,
    count: i64,
}

const GREETING: &str = r#"{"type":"record","name":"Greeting","namespace":"sortie.test","fields":[{"name":"name","type":"string"},{"name":"count","type":"long"}]}"#;

#[tokio::test]
async fn converter_registers_encodes_and_decodes_through_kafka() -> anyhow::Result<()> {
    let kafka = kafka().await;
    let prefix = sortie_tests::unique_prefix("registry_converter");
    let served = Served::start(&kafka, &format!("{prefix}_schemas")).await?;
    let topic = format!("{prefix}greetings");
    sortie_tests::create_topic(&kafka.bootstrap_servers, &topic, 1, &[]).await;

    let settings = SrSettings::new(served.url.clone());
    let encoder = AvroEncoder::new(settings.clone());
    let strategy = SubjectNameStrategy::TopicNameStrategyWithSchema(
        topic.clone(),
        false,
        SuppliedSchema::new(
            Some("sortie.test.Greeting".to_owned()),
            SchemaType::Avro,
            GREETING.to_owned(),
        ),
    );
    let greeting = Greeting {
        name: "sortie".to_owned(),
        count: 42,
    };
    let bytes = encoder.encode_struct(&greeting, &strategy).await?;
    ensure!(bytes.len() > 5 && bytes[0] == 0, "no magic byte: {bytes:?}");
    let id = u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]);

    // The registry agrees on the subject, version and id.
    let latest = call(
        "GET",
        &format!("{}/subjects/{topic}-value/versions/latest", served.url),
        None,
    )
    .await?;
    assert_eq!(latest.status, 200, "{latest:?}");
    assert_eq!(latest.content_type, CONTENT_TYPE_V1);
    assert_eq!(latest.body["id"], json!(id));
    assert_eq!(latest.body["version"], json!(1));
    assert_eq!(latest.body["subject"], json!(format!("{topic}-value")));

    // Through Kafka and back, decoded by a fresh decoder that knows only the id.
    sortie_tests::produce(&kafka.bootstrap_servers, &topic, &[("k", bytes.clone())]).await;
    let messages =
        sortie_tests::read_all(&kafka.bootstrap_servers, &topic, Isolation::ReadUncommitted).await;
    ensure!(messages.len() == 1, "read {} messages", messages.len());
    let payload = rdkafka::Message::payload(&messages[0]).context("no payload")?;
    let decoded = AvroDecoder::new(settings.clone())
        .decode(Some(payload))
        .await?;
    let back: Greeting = apache_avro::from_value(&decoded.value)?;
    assert_eq!(back, greeting);

    // Another encoder registering the same schema gets the same id, and no new version.
    let again = AvroEncoder::new(settings)
        .encode_struct(&greeting, &strategy)
        .await?;
    assert_eq!(again, bytes);
    let versions = call(
        "GET",
        &format!("{}/subjects/{topic}-value/versions", served.url),
        None,
    )
    .await?;
    assert_eq!(versions.body, json!([1]));
    served.stop().await
}

#[tokio::test]
async fn compatibility_refuses_a_field_without_default_and_accepts_one_with() -> anyhow::Result<()>
{
    let kafka = kafka().await;
    let prefix = sortie_tests::unique_prefix("registry_compat");
    let served = Served::start(&kafka, &format!("{prefix}_schemas")).await?;
    let subject = format!("{prefix}orders-value");
    let versions_url = format!("{}/subjects/{subject}/versions", served.url);
    let check_url = format!(
        "{}/compatibility/subjects/{subject}/versions/latest?verbose=true",
        served.url
    );

    let v1 = call("POST", &versions_url, Some(schema_body(ORDER_V1))).await?;
    assert_eq!(v1.status, 200, "{v1:?}");
    let v1_id = v1.body["id"].clone();

    let check = call("POST", &check_url, Some(schema_body(ORDER_V2_NO_DEFAULT))).await?;
    assert_eq!(check.status, 200, "{check:?}");
    assert_eq!(check.body["is_compatible"], json!(false), "{check:?}");
    let messages = check.body["messages"].as_array().context("no messages")?;
    assert!(!messages.is_empty(), "{check:?}");

    let refused = call(
        "POST",
        &versions_url,
        Some(schema_body(ORDER_V2_NO_DEFAULT)),
    )
    .await?;
    assert_eq!(refused.status, 409, "{refused:?}");
    assert_eq!(refused.body["error_code"], json!(409));
    assert_eq!(refused.content_type, CONTENT_TYPE_V1);

    let check = call("POST", &check_url, Some(schema_body(ORDER_V2_DEFAULT))).await?;
    assert_eq!(check.body["is_compatible"], json!(true), "{check:?}");
    let v2 = call("POST", &versions_url, Some(schema_body(ORDER_V2_DEFAULT))).await?;
    assert_eq!(v2.status, 200, "{v2:?}");
    assert_ne!(v2.body["id"], v1_id);
    let latest = call("GET", &format!("{versions_url}/latest"), None).await?;
    assert_eq!(latest.body["version"], json!(2));
    assert_eq!(latest.body["id"], v2.body["id"]);
    assert_eq!(call("GET", &versions_url, None).await?.body, json!([1, 2]));

    // With the subject at NONE the refused schema goes in as version 3.
    let none = call(
        "PUT",
        &format!("{}/config/{subject}", served.url),
        Some(json!({"compatibility": "NONE"})),
    )
    .await?;
    assert_eq!(none.body, json!({"compatibility": "NONE"}));
    let v3 = call(
        "POST",
        &versions_url,
        Some(schema_body(ORDER_V2_NO_DEFAULT)),
    )
    .await?;
    assert_eq!(v3.status, 200, "{v3:?}");
    assert_eq!(
        call("GET", &versions_url, None).await?.body,
        json!([1, 2, 3])
    );
    served.stop().await
}

#[tokio::test]
async fn a_restarted_registry_has_the_same_subjects_versions_and_ids() -> anyhow::Result<()> {
    let kafka = kafka().await;
    let prefix = sortie_tests::unique_prefix("registry_restart");
    let topic = format!("{prefix}_schemas");
    let first = Served::start(&kafka, &topic).await?;
    let a = format!("{prefix}a-value");
    let b = format!("{prefix}b-value");
    let gone = format!("{prefix}gone-value");
    let post = |url: &str, subject: &str, schema: &str| {
        let url = format!("{url}/subjects/{subject}/versions");
        let body = schema_body(schema);
        async move { call("POST", &url, Some(body)).await }
    };
    let a1 = post(&first.url, &a, ORDER_V1).await?.body["id"].clone();
    let a2 = post(&first.url, &a, ORDER_V2_DEFAULT).await?.body["id"].clone();
    let b1 = post(&first.url, &b, ORDER_V2_DEFAULT).await?.body["id"].clone();
    assert_eq!(
        b1, a2,
        "the same schema under another subject reuses the id"
    );
    let g1 = post(&first.url, &gone, GREETING).await?.body["id"].clone();
    let deleted = call("DELETE", &format!("{}/subjects/{gone}", first.url), None).await?;
    assert_eq!(deleted.body, json!([1]), "{deleted:?}");
    call(
        "PUT",
        &format!("{}/config/{b}", first.url),
        Some(json!({"compatibility": "FULL_TRANSITIVE"})),
    )
    .await?;
    let paths = [
        "/subjects".to_owned(),
        format!("/subjects/{a}/versions"),
        format!("/subjects/{a}/versions/1"),
        format!("/subjects/{a}/versions/2"),
        format!("/subjects/{b}/versions/latest"),
        format!("/config/{b}"),
        format!("/subjects/{gone}/versions"),
        "/subjects?deleted=true".to_owned(),
        format!("/schemas/ids/{g1}"),
    ];
    let before = snapshot(&first.url, &paths).await?;
    first.stop().await?;

    // The topic holds Confluent-format records.
    let records =
        sortie_tests::read_all(&kafka.bootstrap_servers, &topic, Isolation::ReadUncommitted).await;
    let (key, value) = sortie_tests::key_value(&records[0]);
    assert_eq!(
        key,
        format!(r#"{{"keytype":"SCHEMA","subject":"{a}","version":1,"magic":1}}"#)
    );
    let value: Value = serde_json::from_str(&value)?;
    assert_eq!(value["id"], a1);
    assert_eq!(value["deleted"], json!(false));

    let second = Served::start(&kafka, &topic).await?;
    let after = snapshot(&second.url, &paths).await?;
    assert_eq!(before, after);
    assert_eq!(after[2].1["id"], a1);
    assert_eq!(after[3].1["id"], a2);
    assert_eq!(after[6].0, 404, "the soft delete survived: {:?}", after[6]);

    // Registering known schemas again returns the old ids and adds no version.
    assert_eq!(post(&second.url, &a, ORDER_V1).await?.body["id"], a1);
    assert_eq!(
        call(
            "GET",
            &format!("{}/subjects/{a}/versions", second.url),
            None
        )
        .await?
        .body,
        json!([1, 2])
    );
    // A new schema gets the next id after the largest one.
    let next = post(&second.url, &format!("{prefix}c-value"), r#""string""#).await?;
    let largest = [&a1, &a2, &g1]
        .iter()
        .filter_map(|id| id.as_u64())
        .max()
        .context("no ids")?;
    assert_eq!(next.body["id"], json!(largest + 1));
    second.stop().await
}

/// Status and body of GET `url` + each path.
async fn snapshot(url: &str, paths: &[String]) -> anyhow::Result<Vec<(u16, Value)>> {
    let mut seen = Vec::new();
    for path in paths {
        let answer = call("GET", &format!("{url}{path}"), None).await?;
        seen.push((answer.status, answer.body));
    }
    Ok(seen)
}

#[tokio::test]
async fn http_errors_have_confluents_shape() -> anyhow::Result<()> {
    let kafka = kafka().await;
    let prefix = sortie_tests::unique_prefix("registry_errors");
    let served = Served::start(&kafka, &format!("{prefix}_schemas")).await?;
    let url = &served.url;
    let subject = format!("{prefix}s-value");
    let cases: Vec<(&str, String, Option<Value>, u16, u64)> = vec![
        (
            "GET",
            format!("{url}/subjects/{subject}/versions"),
            None,
            404,
            40401,
        ),
        (
            "GET",
            format!("{url}/subjects/{subject}/versions/latest"),
            None,
            404,
            40401,
        ),
        ("GET", format!("{url}/schemas/ids/999999"), None, 404, 40403),
        (
            "POST",
            format!("{url}/subjects/{subject}/versions"),
            Some(schema_body(
                r#"{"type":"record","name":"R","fields":[{"name":"a","type":"nope"}]}"#,
            )),
            422,
            42201,
        ),
        (
            "POST",
            format!("{url}/subjects/{subject}/versions"),
            Some(json!({"schema": "{not json"})),
            422,
            42201,
        ),
        (
            "PUT",
            format!("{url}/config"),
            Some(json!({"compatibility": "SIDEWAYS"})),
            422,
            42203,
        ),
        (
            "PUT",
            format!("{url}/config/{subject}"),
            Some(json!({"compatibility": "ALMOST"})),
            422,
            42203,
        ),
        ("GET", format!("{url}/config/{subject}"), None, 404, 40408),
        ("GET", format!("{url}/no/such/route"), None, 404, 404),
    ];
    for (method, target, body, status, code) in cases {
        let answer = call(method, &target, body).await?;
        assert_eq!(answer.status, status, "{method} {target}: {answer:?}");
        assert_eq!(
            answer.body["error_code"],
            json!(code),
            "{method} {target}: {answer:?}"
        );
        assert!(answer.body["message"].is_string(), "{answer:?}");
        assert_eq!(answer.content_type, CONTENT_TYPE_V1, "{method} {target}");
    }

    // Once the subject exists: a missing version, and an invalid one.
    let created = call(
        "POST",
        &format!("{url}/subjects/{subject}/versions"),
        Some(schema_body(ORDER_V1)),
    )
    .await?;
    assert_eq!(created.status, 200, "{created:?}");
    let missing = call("GET", &format!("{url}/subjects/{subject}/versions/7"), None).await?;
    assert_eq!(
        (missing.status, missing.body["error_code"].clone()),
        (404, json!(40402))
    );
    let invalid = call("GET", &format!("{url}/subjects/{subject}/versions/x"), None).await?;
    assert_eq!(invalid.body["error_code"], json!(42202));

    // Malformed JSON is a JSON error too, whatever the content type.
    let response = reqwest::Client::new()
        .post(format!("{url}/subjects/{subject}/versions"))
        .header("Content-Type", "application/octet-stream")
        .body("{nope")
        .send()
        .await?;
    assert_eq!(response.status().as_u16(), 400);
    let body: Value = response.json().await?;
    assert_eq!(body["error_code"], json!(400));

    // The global level defaults to BACKWARD and a subject can fall back to it.
    let global = call("GET", &format!("{url}/config"), None).await?;
    assert_eq!(global.body, json!({"compatibilityLevel": "BACKWARD"}));
    let fallback = call(
        "GET",
        &format!("{url}/config/{subject}?defaultToGlobal=true"),
        None,
    )
    .await?;
    assert_eq!(fallback.body, json!({"compatibilityLevel": "BACKWARD"}));
    let types = call("GET", &format!("{url}/schemas/types"), None).await?;
    assert_eq!(types.body, json!(["AVRO"]));
    served.stop().await
}

/// The Python venv of the tests (`<workspace>/target/py`), created once and reused.
#[tokio::test]
async fn confluents_python_client_works_against_the_registry() -> anyhow::Result<()> {
    let python = tokio::task::spawn_blocking(sortie_tests::python_venv).await??;
    let kafka = kafka().await;
    let prefix = sortie_tests::unique_prefix("registry_python");
    let served = Served::start(&kafka, &format!("{prefix}_schemas")).await?;
    let script = sortie_tests::workspace_root().join("tests/python/registry_client.py");
    let output = tokio::process::Command::new(&python)
        .arg(&script)
        .arg(&served.url)
        .arg(&prefix)
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(
        output.status.success(),
        "registry_client.py failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let out: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .with_context(|| format!("registry_client.py printed {stdout}"))?;
    let id = out["registered_id"].clone();
    assert!(id.as_u64().is_some(), "{out}");
    assert_eq!(out["registered_again_id"], id, "{out}");
    assert_eq!(out["by_id_type"], json!("AVRO"));
    assert_eq!(out["by_id_fields"], json!(["id", "amount"]));
    assert_eq!(out["latest"]["id"], id);
    assert_eq!(out["latest"]["version"], json!(1));
    assert_eq!(out["latest"]["subject"], out["subject"]);
    assert_eq!(out["version_1_id"], id);
    assert_eq!(out["lookup"], json!({"id": id, "version": 1}));
    assert_eq!(out["subjects_contains"], json!(true));
    assert_eq!(out["versions"], json!([1]));
    assert_eq!(out["compatible_v2"], json!(true), "{out}");
    assert_eq!(out["incompatible_v2"], json!(false), "{out}");
    assert_eq!(out["register_incompatible_code"], json!(409));
    assert_eq!(out["get_compatibility"], json!("FULL"));
    assert_eq!(out["global_compatibility"], json!("BACKWARD"));
    assert_eq!(out["missing_version_code"], json!(40402));
    assert_eq!(out["missing_subject_code"], json!(40401));
    assert_eq!(out["wire_magic"], json!(0));
    assert_eq!(out["wire_id"], out["serializer_subject_latest_id"]);
    assert_ne!(
        out["wire_id"], id,
        "Payment is another schema, so another id"
    );
    assert_eq!(out["decoded"], out["record"]);
    served.stop().await
}

/// Serves `topic` on all interfaces (beyond loopback) with `token`; returns the loopback
/// URL of that listener and the sender that stops it.
async fn serve_beyond_loopback(
    kafka: &KafkaConfig,
    topic: &str,
    token: Option<&str>,
) -> anyhow::Result<(String, tokio::sync::oneshot::Sender<()>)> {
    let registry = std::sync::Arc::new(sortie_registry::Registry::open(kafka, topic).await?);
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await?;
    let url = format!("http://127.0.0.1:{}", listener.local_addr()?.port());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(sortie_registry::serve_with_token(
        listener,
        registry,
        token.map(str::to_owned),
        async {
            let _ = stopped.await;
        },
    ));
    Ok((url, stop))
}

async fn call_as(
    method: &str,
    url: &str,
    body: Option<Value>,
    auth: Option<&str>,
) -> anyhow::Result<(u16, Value)> {
    let mut request = reqwest::Client::new().request(method.parse()?, url);
    if let Some(body) = body {
        request = request
            .header("Content-Type", CONTENT_TYPE_V1)
            .body(body.to_string());
    }
    if let Some(auth) = auth {
        request = request.header("Authorization", auth);
    }
    let response = request.send().await?;
    let status = response.status().as_u16();
    let text = response.text().await?;
    let body = serde_json::from_str(&text)
        .with_context(|| format!("{method} {url} answered {status} with non-JSON {text:?}"))?;
    Ok((status, body))
}

/// A registry bound beyond loopback refuses writes without its token, in Confluent's
/// error shape, while reads (and lookups) stay open; without a configured token it
/// refuses every write. Loopback without a token stays open (every other test here).
///
/// Proved red once: with the guard layer left out of `serve_with_token`, the tokenless
/// register answered 200.
#[tokio::test]
async fn writes_beyond_loopback_need_the_token() -> anyhow::Result<()> {
    let kafka = kafka().await;
    let prefix = sortie_tests::unique_prefix("registry_token");
    let (url, _stop) =
        serve_beyond_loopback(&kafka, &format!("{prefix}_schemas"), Some("s3cret")).await?;
    let subject = format!("{url}/subjects/orders-value");
    let register = format!("{subject}/versions");
    let body = || Some(schema_body(ORDER_V1));

    let (status, answer) = call_as("POST", &register, body(), None).await?;
    ensure!(status == 401, "tokenless register: {status} {answer}");
    ensure!(answer["error_code"] == 40101, "{answer}");
    ensure!(answer["message"].is_string(), "{answer}");
    let (status, answer) = call_as("POST", &register, body(), Some("Bearer wrong")).await?;
    ensure!(
        status == 401 && answer["error_code"] == 40101,
        "{status} {answer}"
    );

    let (status, answer) = call_as("POST", &register, body(), Some("Bearer s3cret")).await?;
    ensure!(status == 200, "register with the token: {status} {answer}");
    let id = answer["id"].clone();
    let basic = format!(
        "Basic {}",
        base64::Engine::encode(&base64::engine::general_purpose::STANDARD, "ci:s3cret")
    );
    let (status, answer) = call_as("POST", &register, body(), Some(&basic)).await?;
    ensure!(status == 200 && answer["id"] == id, "{status} {answer}");

    // Reads and lookups need nothing.
    let (status, answer) = call_as("GET", &format!("{url}/subjects"), None, None).await?;
    ensure!(
        status == 200 && answer == json!(["orders-value"]),
        "{answer}"
    );
    let (status, answer) = call_as("POST", &subject, body(), None).await?;
    ensure!(
        status == 200 && answer["id"] == id,
        "lookup: {status} {answer}"
    );
    let (status, answer) = call_as(
        "PUT",
        &format!("{url}/config"),
        Some(json!({"compatibility": "NONE"})),
        None,
    )
    .await?;
    ensure!(
        status == 401 && answer["error_code"] == 40101,
        "{status} {answer}"
    );
    let (status, answer) = call_as("DELETE", &subject, None, None).await?;
    ensure!(
        status == 401 && answer["error_code"] == 40101,
        "{status} {answer}"
    );

    let (url, _stop) =
        serve_beyond_loopback(&kafka, &format!("{prefix}_closed_schemas"), None).await?;
    let (status, answer) = call_as(
        "POST",
        &format!("{url}/subjects/orders-value/versions"),
        body(),
        Some("Bearer anything"),
    )
    .await?;
    ensure!(
        status == 403 && answer["error_code"] == 40301,
        "{status} {answer}"
    );
    let (status, _) = call_as("GET", &format!("{url}/subjects"), None, None).await?;
    ensure!(status == 200, "reads stay open: {status}");
    Ok(())
}
