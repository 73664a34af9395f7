//! `sortie run start|approve|reject|cancel|signal|forget|fork|get|watch|list|inbox`: runs
//! through the HTTP gateway, as any client would. `get`, `watch` and `list` print for people (a timeline, a table;
//! colour on a terminal only); `--json` prints what the gateway answered, as before, for
//! scripts.

use std::io::Write as _;

use anyhow::{bail, Context as _};
use serde_json::{json, Value};

use crate::human::{self, Style, Timeline};

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
            let open: Vec<&str> = body["error"]["open_interrupts"]
                .as_array()
                .map(|items| {
                    items
                        .iter()
                        .filter_map(|i| i["interrupt_id"].as_str())
                        .collect()
                })
                .unwrap_or_default();
            if !open.is_empty() {
                bail!(
                    "{status}: {code}: {message} (--interrupt {})",
                    open.join(" | ")
                );
            }
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
                return get(&client, &run_id, &run, conversation).await;
            }
        }
        Sub::Watch {
            run_id,
            json,
            conversation,
        } => return watch(&client, &run_id, json, conversation).await,
        Sub::Wait {
            run_id,
            statuses,
            timeout_s,
        } => return wait(&client, &run_id, &statuses, timeout_s).await,
        Sub::List {
            status,
            graph,
            label,
            limit,
            json,
        } => return list(&client, status, graph, &label, limit, json).await,
        Sub::Inbox { all, limit, json } => return inbox(&client, all, limit, json).await,
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

/// What `watch --conversation` has read so far: the events, and how many conversation
/// entries it printed (the entries only grow as events come).
#[derive(Default)]
struct Talk {
    events: Vec<sortie_core::Event>,
    printed: usize,
}

impl Talk {
    fn take(&mut self, event: &Value) -> anyhow::Result<()> {
        if let Ok(event) = serde_json::from_value::<sortie_core::Event>(event.clone()) {
            self.events.push(event);
        }
        let entries = sortie_core::conversation::of(&self.events);
        let style = Style::for_stdout();
        let mut stdout = std::io::stdout().lock();
        for entry in entries.iter().skip(self.printed) {
            writeln!(stdout, "{}", human::conversation_line(style, entry))?;
        }
        stdout.flush()?;
        self.printed = entries.len();
        Ok(())
    }
}

/// Prints each event from the SSE stream until the run ends: a timeline line, or (with
/// `--json`) the event as one JSON line, or (with `--conversation`) what each event adds
/// to the run's conversation.
async fn watch(
    client: &Client,
    run_id: &str,
    as_json: bool,
    conversation: bool,
) -> anyhow::Result<()> {
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
    let mut timeline = Timeline::new(Style::for_stdout());
    let mut talk = Talk::default();
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
                if as_json {
                    println!("{}", serde_json::to_string(&event)?);
                } else if conversation {
                    talk.take(&event)?;
                } else {
                    print_event(&mut timeline, &event)?;
                }
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

/// One timeline line for an event as the gateway renders it (an event this build does not
/// know is shown by its kind, not dropped).
fn print_event(timeline: &mut Timeline, event: &Value) -> anyhow::Result<()> {
    let line = match serde_json::from_value::<sortie_core::Event>(event.clone()) {
        Ok(event) => timeline.line(&event),
        Err(_) => {
            let kind = event["body"]
                .as_object()
                .and_then(|b| b.keys().next().cloned())
                .unwrap_or_else(|| "event".into());
            format!(
                "{}  {:<18} {kind}",
                human::clock(event["at"].as_i64().unwrap_or(0)),
                "?"
            )
        }
    };
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{line}")?;
    stdout.flush()?;
    Ok(())
}

/// `run get`: a header (run, graph, status, steps, open interrupts), then the timeline
/// (or, with `--conversation`, the run's conversation).
async fn get(client: &Client, run_id: &str, run: &Value, conversation: bool) -> anyhow::Result<()> {
    let style = Style::for_stdout();
    println!(
        "{}  {}@{}  {}  ({} steps done)",
        run["run_id"].as_str().unwrap_or(run_id),
        run["graph_id"].as_str().unwrap_or("?"),
        run["graph_version"],
        human::paint_status(style, run["status"].as_str().unwrap_or("?")),
        run["steps_done"],
    );
    for interrupt in run["interrupts"].as_array().into_iter().flatten() {
        println!(
            "waiting for approval: {} ({}){}: {}",
            interrupt["node"].as_str().unwrap_or("?"),
            interrupt["interrupt_id"].as_str().unwrap_or("?"),
            interrupt["required_role"]
                .as_str()
                .map(|r| format!(", role {r}"))
                .unwrap_or_default(),
            interrupt["reason"].as_str().unwrap_or(""),
        );
    }
    if let Some(reason) = run["ending"]["reason"].as_str() {
        println!("ended: {reason}");
    }
    let mut timeline = Timeline::new(style);
    let mut talk = Talk::default();
    let mut after = 0i64;
    loop {
        let page = client
            .send(client.request(
                reqwest::Method::GET,
                &format!("/v1/runs/{run_id}/events?after={after}&limit=500"),
            ))
            .await?;
        for event in page["events"].as_array().into_iter().flatten() {
            if conversation {
                if let Ok(event) = serde_json::from_value::<sortie_core::Event>(event.clone()) {
                    talk.events.push(event);
                }
            } else {
                print_event(&mut timeline, event)?;
            }
        }
        let next = page["next_after"].as_i64().unwrap_or(after);
        if !page["has_more"].as_bool().unwrap_or(false) || next <= after {
            if conversation {
                let entries = sortie_core::conversation::of(&talk.events);
                if entries.is_empty() {
                    println!("(no agent conversation in this run)");
                }
                for entry in &entries {
                    println!("{}", human::conversation_line(style, entry));
                }
            }
            return Ok(());
        }
        after = next;
    }
}

/// `run list`: the tenant's runs as a table. Status, graph, the first label and limit
/// are the list route's filters; further labels are matched here, on the rows it returns.
async fn list(
    client: &Client,
    status: Option<String>,
    graph: Option<String>,
    labels: &[String],
    limit: usize,
    as_json: bool,
) -> anyhow::Result<()> {
    let wanted: Vec<(&str, &str)> = labels
        .iter()
        .map(|l| {
            l.split_once('=')
                .with_context(|| format!("--label {l:?} is not key=value"))
        })
        .collect::<anyhow::Result<_>>()?;
    let mut runs: Vec<Value> = Vec::new();
    let mut after: Option<String> = None;
    while runs.len() < limit {
        let mut query: Vec<(&str, String)> = vec![("limit", limit.clamp(1, 500).to_string())];
        if let Some(status) = &status {
            query.push(("status", status.clone()));
        }
        if let Some(graph) = &graph {
            query.push(("graph_id", graph.clone()));
        }
        if let Some(label) = labels.first() {
            query.push(("label", label.clone()));
        }
        if let Some(after) = &after {
            query.push(("after", after.clone()));
        }
        let page = client
            .send(
                client
                    .request(reqwest::Method::GET, "/v1/runs")
                    .query(&query),
            )
            .await?;
        for run in page["runs"].as_array().into_iter().flatten() {
            if wanted
                .iter()
                .all(|(k, v)| run["labels"][*k].as_str() == Some(*v))
            {
                runs.push(run.clone());
            }
        }
        match page["next_after"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => break,
        }
    }
    runs.truncate(limit);
    if as_json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({ "runs": runs }))?
        );
        return Ok(());
    }
    if runs.is_empty() {
        println!("no runs");
        return Ok(());
    }
    let style = Style::for_stdout();
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|run| {
            let labels = run["labels"]
                .as_object()
                .map(|m| {
                    m.iter()
                        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .unwrap_or_default();
            vec![
                run["run_id"].as_str().unwrap_or("?").to_owned(),
                format!(
                    "{}@{}",
                    run["graph_id"].as_str().unwrap_or("?"),
                    run["graph_version"]
                ),
                human::paint_status(style, run["status"].as_str().unwrap_or("?")),
                run["steps_done"].to_string(),
                run["open_interrupts"].to_string(),
                human::date_time(run["updated_at"].as_i64().unwrap_or(0)),
                labels,
            ]
        })
        .collect();
    print!(
        "{}",
        human::table(
            style,
            &[
                "RUN",
                "GRAPH",
                "STATUS",
                "STEPS",
                "WAITING",
                "UPDATED (UTC)",
                "LABELS"
            ],
            &rows
        )
    );
    Ok(())
}

/// `run inbox`: the open interrupts the caller may decide (`--all`: every open one, with
/// why the caller may not decide it), as a table with the command that decides each.
async fn inbox(client: &Client, all: bool, limit: usize, as_json: bool) -> anyhow::Result<()> {
    let answer = client
        .send(
            client
                .request(reqwest::Method::GET, "/v1/inbox")
                .query(&[("limit", limit.clamp(1, 500).to_string())]),
        )
        .await?;
    let items: Vec<Value> = answer["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|item| all || item["may_decide"].as_bool().unwrap_or(false))
        .cloned()
        .collect();
    if as_json {
        let body = json!({"items": items, "truncated": answer["truncated"]});
        println!("{}", serde_json::to_string_pretty(&body)?);
        return Ok(());
    }
    if items.is_empty() {
        println!(
            "{}",
            if all {
                "no open approvals"
            } else {
                "nothing waits for you"
            }
        );
        return Ok(());
    }
    let style = Style::for_stdout();
    let rows: Vec<Vec<String>> = items
        .iter()
        .map(|item| {
            let mut row = vec![
                item["run_id"].as_str().unwrap_or("?").to_owned(),
                item["graph_id"].as_str().unwrap_or("?").to_owned(),
                item["node"].as_str().unwrap_or("?").to_owned(),
                human::date_time(item["opened_at"].as_i64().unwrap_or(0)),
                item["expires_at"]
                    .as_i64()
                    .map_or_else(|| "never".to_owned(), human::date_time),
                item["reason"].as_str().unwrap_or("").to_owned(),
            ];
            if all {
                row.push(
                    item["why_not"]
                        .as_str()
                        .unwrap_or("you may decide")
                        .to_owned(),
                );
            }
            row
        })
        .collect();
    let mut header = vec![
        "RUN",
        "GRAPH",
        "NODE",
        "OPENED (UTC)",
        "EXPIRES (UTC)",
        "REASON",
    ];
    if all {
        header.push("WHY NOT");
    }
    print!("{}", human::table(style, &header, &rows));
    if answer["truncated"].as_bool().unwrap_or(false) {
        println!("(more are open: raise --limit)");
    }
    if let Some(first) = items
        .iter()
        .find(|i| i["may_decide"].as_bool().unwrap_or(false))
    {
        println!();
        println!(
            "Decide with: sortie run approve|reject {} --interrupt {}   (see it first: sortie run get {})",
            first["run_id"].as_str().unwrap_or("?"),
            first["interrupt_id"].as_str().unwrap_or("?"),
            first["run_id"].as_str().unwrap_or("?"),
        );
    }
    Ok(())
}

/// `run wait`: polls the run until its status is one of `statuses` (default: an end).
async fn wait(
    client: &Client,
    run_id: &str,
    statuses: &[String],
    timeout_s: u64,
) -> anyhow::Result<()> {
    const ENDS: [&str; 3] = ["succeeded", "failed", "cancelled"];
    let wanted: Vec<&str> = if statuses.is_empty() {
        ENDS.to_vec()
    } else {
        statuses.iter().map(String::as_str).collect()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(timeout_s);
    loop {
        let answer = client
            .send(client.request(reqwest::Method::GET, &format!("/v1/runs/{run_id}")))
            .await;
        // A run just started may not be in the read view yet: asked again until the end.
        let run = match answer {
            Ok(run) => run,
            Err(e) if std::time::Instant::now() >= deadline => return Err(e),
            Err(_) => {
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
                continue;
            }
        };
        let status = run["status"].as_str().unwrap_or_default().to_owned();
        if wanted.contains(&status.as_str()) {
            println!("{run_id} {status}");
            return Ok(());
        }
        if ENDS.contains(&status.as_str()) {
            bail!("run {run_id} ended {status}, not {}", wanted.join(" or "));
        }
        if std::time::Instant::now() >= deadline {
            bail!(
                "run {run_id} is still {status} after {timeout_s} s, not {}",
                wanted.join(" or ")
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}
