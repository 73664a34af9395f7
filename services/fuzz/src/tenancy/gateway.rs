//! The gateway as the victim and the oracle use it: a canary run started under an
//! `Idempotency-Key`, and a run's state as a token sees it.

use serde_json::{json, Value};

use super::{Target, VICTIM_PAYLOAD};

pub(super) async fn start_canary(
    target: &Target,
    http: &reqwest::Client,
    key: &str,
) -> anyhow::Result<String> {
    let answer = http
        .post(format!("{}/v1/runs", target.gateway_url))
        .bearer_auth(&target.victim.token)
        .header("Idempotency-Key", key)
        .json(&json!({"graph_id": target.victim.graph.0, "input": {"canary": VICTIM_PAYLOAD, "key": key}}))
        .send()
        .await?;
    let status = answer.status();
    let body: Value = answer.json().await.unwrap_or(Value::Null);
    if !status.is_success() {
        anyhow::bail!("{status}: {body}");
    }
    let run = body["run_id"].as_str().unwrap_or_default().to_owned();
    let derived = sortie_core::ids::keyed_run_id(&target.victim.tenant, key);
    if run != derived {
        anyhow::bail!("the start under key {key} is run {run}, not {derived}");
    }
    Ok(run)
}

pub(super) async fn get_run(
    gateway: &str,
    http: &reqwest::Client,
    token: &str,
    run: &str,
) -> anyhow::Result<Value> {
    let answer = http
        .get(format!("{gateway}/v1/runs/{run}"))
        .bearer_auth(token)
        .send()
        .await?;
    if !answer.status().is_success() {
        anyhow::bail!("{}", answer.status());
    }
    Ok(answer.json().await?)
}
