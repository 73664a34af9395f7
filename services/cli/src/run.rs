//! `sortie run start|approve|reject|cancel|get|watch`: runs through the HTTP gateway, as
//! any client would.

use anyhow::{bail, Context as _};
use serde_json::{json, Value};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The gateway's base URL.
    #[arg(
        long,
        global = true,
        env = "SORTIE__GATEWAY__URL",
        default_value = "http://127.0.0.1:8080"
    )]
    gateway: String,
    /// Bearer token (maps to a tenant and roles).
    #[arg(long, global = true, env = "SORTIE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    #[command(subcommand)]
    command: Sub,
}

#[derive(Debug, clap::Subcommand)]
enum Sub {
    /// Start a run of a published graph.
    Start {
        graph_id: String,
        /// The run input (JSON).
        #[arg(long, default_value = "{}")]
        input: String,
        /// Choose the run id (same id + same request = same run).
        #[arg(long)]
        run_id: Option<String>,
    },
    /// Approve the run's pending interrupt (or the one named).
    Approve(Decision),
    /// Reject the run's pending interrupt (or the one named).
    Reject(Decision),
    /// Cancel a run: no new dispatches; in-flight outcomes are recorded; compensations run.
    Cancel { run_id: String },
    /// Show a run: status, pending interrupt, steps done.
    Get { run_id: String },
    /// Follow a run's events live until it ends.
    Watch { run_id: String },
}

#[derive(Debug, clap::Args)]
struct Decision {
    run_id: String,
    /// The interrupt to decide (default: the run's only pending one).
    #[arg(long)]
    interrupt: Option<String>,
    /// An approver's payload (JSON), recorded with the decision.
    #[arg(long)]
    payload: Option<String>,
}

struct Client {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl Client {
    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let request = self
            .http
            .request(method, format!("{}{path}", self.base.trim_end_matches('/')));
        match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> anyhow::Result<Value> {
        let response = request
            .send()
            .await
            .with_context(|| format!("the gateway at {} did not answer", self.base))?;
        let status = response.status();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            let message = body["error"]["message"].as_str().unwrap_or("no message");
            let code = body["error"]["code"].as_str().unwrap_or("error");
            bail!("{status}: {code}: {message}");
        }
        Ok(body)
    }
}

fn parse_json(what: &str, text: &str) -> anyhow::Result<Value> {
    serde_json::from_str(text).with_context(|| format!("{what} is not JSON"))
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let client = Client {
        base: args.gateway,
        token: args.token,
        http: reqwest::Client::new(),
    };
    let answer = match args.command {
        Sub::Start {
            graph_id,
            input,
            run_id,
        } => {
            let mut body = json!({"graph_id": graph_id, "input": parse_json("--input", &input)?});
            if let Some(run_id) = run_id {
                body["run_id"] = run_id.into();
            }
            client
                .send(
                    client
                        .request(reqwest::Method::POST, "/v1/runs")
                        .json(&body),
                )
                .await?
        }
        Sub::Approve(d) => decide(&client, d, "approve").await?,
        Sub::Reject(d) => decide(&client, d, "reject").await?,
        Sub::Cancel { run_id } => {
            client
                .send(client.request(reqwest::Method::POST, &format!("/v1/runs/{run_id}/cancel")))
                .await?
        }
        Sub::Get { run_id } => {
            client
                .send(client.request(reqwest::Method::GET, &format!("/v1/runs/{run_id}")))
                .await?
        }
        Sub::Watch { run_id } => return watch(&client, &run_id).await,
    };
    println!("{}", serde_json::to_string_pretty(&answer)?);
    Ok(())
}

async fn decide(client: &Client, d: Decision, decision: &str) -> anyhow::Result<Value> {
    let interrupt = match d.interrupt {
        Some(id) => id,
        None => {
            let run = client
                .send(client.request(reqwest::Method::GET, &format!("/v1/runs/{}", d.run_id)))
                .await?;
            let open = run["interrupts"].as_array().cloned().unwrap_or_default();
            match open.as_slice() {
                [one] => one["interrupt_id"].as_str().unwrap_or_default().to_owned(),
                [] => bail!("run {} has no pending interrupt", d.run_id),
                _ => bail!(
                    "run {} has {} pending interrupts: name one with --interrupt",
                    d.run_id,
                    open.len()
                ),
            }
        }
    };
    let mut body = json!({"decision": decision, "interrupt_id": interrupt});
    if let Some(payload) = d.payload {
        body["payload"] = parse_json("--payload", &payload)?;
    }
    client
        .send(
            client
                .request(
                    reqwest::Method::POST,
                    &format!("/v1/runs/{}/resume", d.run_id),
                )
                .json(&body),
        )
        .await
}

/// Prints each event (one JSON line) from the SSE stream until the run ends.
async fn watch(client: &Client, run_id: &str) -> anyhow::Result<()> {
    let response = client
        .request(
            reqwest::Method::GET,
            &format!("/v1/runs/{run_id}/events/stream"),
        )
        .header("Accept", "text/event-stream")
        .send()
        .await?;
    if !response.status().is_success() {
        bail!(
            "{}: {}",
            response.status(),
            response.text().await.unwrap_or_default()
        );
    }
    let mut response = response;
    let mut buffer = String::new();
    while let Some(chunk) = response.chunk().await? {
        buffer.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buffer.find("\n\n") {
            let frame: String = buffer.drain(..end + 2).collect();
            for line in frame.lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let event: Value = serde_json::from_str(data.trim()).unwrap_or(Value::Null);
                println!("{}", serde_json::to_string(&event)?);
                let status = event["body"]["RunStatusChanged"]["status"]
                    .as_str()
                    .unwrap_or_default();
                if matches!(status, "SUCCEEDED" | "FAILED" | "CANCELLED") {
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}
