//! `sortie run start|approve|reject|cancel|signal|forget|fork|get|watch|list|inbox`: runs
//! through the HTTP gateway, as any client would. `get`, `watch` and `list` print for people (a timeline, a table;
//! colour on a terminal only); `--json` prints what the gateway answered, as before, for
//! scripts.

mod client;
mod tables;
mod timeline;
mod wait;

use anyhow::Context as _;
use serde_json::{json, Value};

use client::Client;

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
        /// A start label `key=value` (repeat for several); a graph with a correlation
        /// label names the run by it.
        #[arg(long)]
        label: Vec<String>,
        /// Print only the run's id (for `RUN=$(sortie run start ... -q)`).
        #[arg(short, long)]
        quiet: bool,
    },
    /// Approve the run's pending interrupt (or the one named).
    Approve(Decision),
    /// Reject the run's pending interrupt (or the one named).
    Reject(Decision),
    /// Cancel a run: no new dispatches; in-flight outcomes are recorded; compensations run.
    Cancel { run_id: String },
    /// Send a signal a node of the run waits for (`wait: {signal: NAME}`): taken by the
    /// open wait, or kept until the wait opens.
    Signal {
        run_id: String,
        /// The signal's name.
        name: String,
        /// The signal's payload (JSON), held to the wait's schema.
        #[arg(long, default_value = "null")]
        payload: String,
        /// Your id of this event: a signal id is taken once per run, however often it is
        /// sent (default: a new one each time).
        #[arg(long)]
        signal_id: Option<String>,
    },
    /// Delete a finished run (`DELETE /v1/runs/{id}`, operator role): its data key is
    /// destroyed (crypto-shredding: its payloads no longer open anywhere), its state
    /// keeps only its shape, its step results are tombstoned. Cancel a running run first.
    Forget {
        run_id: String,
        /// Why (recorded in the run's history).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Start a new run from one of this run's checkpoints (time travel): steps completed
    /// by then keep their outputs and are never run again.
    Fork {
        run_id: String,
        /// The state version to start from (`ckpt_<run>_<version>`).
        #[arg(long)]
        at_version: i64,
        /// A JSON merge patch applied to the source's input.
        #[arg(long)]
        input_patch: Option<String>,
        /// Choose the new run's id.
        #[arg(long)]
        new_run_id: Option<String>,
        /// Print only the new run's id.
        #[arg(short, long)]
        quiet: bool,
    },
    /// Show a run: status, pending interrupt, and its timeline (one line per event).
    Get {
        run_id: String,
        /// Print the gateway's JSON for the run instead (for scripts).
        #[arg(long)]
        json: bool,
        /// Print the run's agent conversation instead of its timeline: the opening
        /// messages, each model answer and the tools it called, approvals, tool results.
        #[arg(long, conflicts_with = "json")]
        conversation: bool,
    },
    /// Follow a run's events live until it ends, one timeline line per event.
    Watch {
        run_id: String,
        /// Print each event as one JSON line instead (for scripts).
        #[arg(long)]
        json: bool,
        /// Follow the run's agent conversation instead of its timeline.
        #[arg(long, conflicts_with = "json")]
        conversation: bool,
    },
    /// Wait until the run reaches a status (by default: until it ends), for scripts: exits
    /// 0 there, non-zero if it ends in another status or the timeout passes first.
    Wait {
        run_id: String,
        /// The status to wait for (waiting_approval, waiting_signal, succeeded, ...);
        /// repeat for any of several. Default: succeeded, failed or cancelled.
        #[arg(long = "status", value_name = "STATUS")]
        statuses: Vec<String>,
        /// How long to wait, in seconds.
        #[arg(long, default_value_t = 120)]
        timeout_s: u64,
    },
    /// List the tenant's runs as a table.
    List {
        /// Only runs with this status (running, waiting_approval, succeeded, ...).
        #[arg(long)]
        status: Option<String>,
        /// Only runs of this graph.
        #[arg(long)]
        graph: Option<String>,
        /// Only runs with this label (`key=value`; repeat for several).
        #[arg(long)]
        label: Vec<String>,
        /// At most this many runs.
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Print the runs as JSON instead (for scripts).
        #[arg(long)]
        json: bool,
    },
    /// The open approvals you may decide (the gateway's `GET /v1/inbox`), oldest first.
    Inbox {
        /// Also show the ones you may not decide, and why not.
        #[arg(long)]
        all: bool,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Print the items as JSON instead (for scripts).
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, clap::Args)]
struct Decision {
    run_id: String,
    /// The interrupt to decide (default: the run's only open one; the gateway refuses
    /// and lists them when several are open).
    #[arg(long)]
    interrupt: Option<String>,
    /// The approver's input (JSON), recorded with the decision and delivered to the node
    /// (`$interrupt.payload` in its arguments).
    #[arg(long)]
    payload: Option<String>,
    /// Arguments (JSON) to run instead of the proposed ones (approve only).
    #[arg(long)]
    edited_args: Option<String>,
    /// Why, recorded in the run's history.
    #[arg(long)]
    comment: Option<String>,
}

fn parse_json(what: &str, text: &str) -> anyhow::Result<Value> {
    serde_json::from_str(text).with_context(|| format!("{what} is not JSON"))
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let client = Client::new(args.gateway, args.token)?;
    let mut quiet = false;
    let answer = match args.command {
        Sub::Start {
            graph_id,
            input,
            run_id,
            label,
            quiet: q,
        } => {
            quiet = q;
            let mut body = json!({"graph_id": graph_id, "input": parse_json("--input", &input)?});
            if let Some(run_id) = run_id {
                body["run_id"] = run_id.into();
            }
            let mut labels = serde_json::Map::new();
            for pair in &label {
                let (key, value) = pair
                    .split_once('=')
                    .ok_or_else(|| anyhow::anyhow!("--label {pair:?} is not key=value"))?;
                labels.insert(key.to_owned(), value.into());
            }
            if !labels.is_empty() {
                body["labels"] = Value::Object(labels);
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
        Sub::Fork {
            run_id,
            at_version,
            input_patch,
            new_run_id,
            quiet: q,
        } => {
            quiet = q;
            let mut body = json!({"at_version": at_version});
            if let Some(patch) = input_patch {
                body["input_patch"] = parse_json("--input-patch", &patch)?;
            }
            if let Some(id) = new_run_id {
                body["run_id"] = id.into();
            }
            client
                .send(
                    client
                        .request(reqwest::Method::POST, &format!("/v1/runs/{run_id}/fork"))
                        .json(&body),
                )
                .await?
        }
        Sub::Cancel { run_id } => {
            client
                .send(client.request(reqwest::Method::POST, &format!("/v1/runs/{run_id}/cancel")))
                .await?
        }
        Sub::Signal {
            run_id,
            name,
            payload,
            signal_id,
        } => {
            let mut body = json!({"payload": parse_json("--payload", &payload)?});
            if let Some(id) = signal_id {
                body["signal_id"] = id.into();
            }
            client
                .send(
                    client
                        .request(
                            reqwest::Method::POST,
                            &format!("/v1/runs/{run_id}/signals/{name}"),
                        )
                        .json(&body),
                )
                .await?
        }
        Sub::Forget { run_id, reason } => {
            let mut request =
                client.request(reqwest::Method::DELETE, &format!("/v1/runs/{run_id}"));
            if let Some(reason) = &reason {
                request = request.query(&[("reason", reason)]);
            }
            client.send(request).await?
        }
        Sub::Get {
            run_id,
            json,
            conversation,
        } => {
            let run = client
                .send(client.request(reqwest::Method::GET, &format!("/v1/runs/{run_id}")))
                .await?;
            if json {
                run
            } else {
                return timeline::get(&client, &run_id, &run, conversation).await;
            }
        }
        Sub::Watch {
            run_id,
            json,
            conversation,
        } => return timeline::watch(&client, &run_id, json, conversation).await,
        Sub::Wait {
            run_id,
            statuses,
            timeout_s,
        } => return wait::wait(&client, &run_id, &statuses, timeout_s).await,
        Sub::List {
            status,
            graph,
            label,
            limit,
            json,
        } => return tables::list(&client, status, graph, &label, limit, json).await,
        Sub::Inbox { all, limit, json } => return tables::inbox(&client, all, limit, json).await,
    };
    match answer["run_id"].as_str() {
        Some(run_id) if quiet => println!("{run_id}"),
        _ => println!("{}", serde_json::to_string_pretty(&answer)?),
    }
    Ok(())
}

async fn decide(client: &Client, d: Decision, decision: &str) -> anyhow::Result<Value> {
    // Without --interrupt the gateway picks the only open interrupt, or refuses (409) and
    // names the open ones.
    let mut body = json!({"decision": decision});
    if let Some(id) = d.interrupt {
        body["interrupt_id"] = id.into();
    }
    if let Some(payload) = d.payload {
        body["payload"] = parse_json("--payload", &payload)?;
    }
    if let Some(edited) = d.edited_args {
        body["edited_args"] = parse_json("--edited-args", &edited)?;
    }
    if let Some(comment) = d.comment {
        body["comment"] = comment.into();
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
