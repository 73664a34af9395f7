//! `run get` and `run watch`: a run's events printed as a timeline, one line per event,
//! or as its agent conversation (`--conversation`), or as JSON lines (`watch --json`).

use std::io::Write as _;

use serde_json::Value;

use super::Client;
use crate::human::{self, Style, Timeline};

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
pub(super) async fn watch(
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
        .await
        .map_err(|e| client.unreachable(e))?;
    if !response.status().is_success() {
        let status = response.status();
        return Err(client.refused(status, &response.text().await.unwrap_or_default()));
    }
    let mut timeline = Timeline::new(Style::for_stdout());
    let mut talk = Talk::default();
    let mut writing = Writing::default();
    let mut response = response;
    let mut buffer = String::new();
    let broke = |e| {
        anyhow::Error::new(e).context(format!(
            "the gateway's event stream of run {run_id} broke before the run ended"
        ))
    };
    while let Some(chunk) = response.chunk().await.map_err(broke)? {
        buffer.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buffer.find("\n\n") {
            let frame: String = buffer.drain(..end + 2).collect();
            let delta = frame.lines().any(|l| l.trim_end() == "event: delta");
            for line in frame.lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let event: Value = serde_json::from_str(data.trim()).unwrap_or(Value::Null);
                if delta {
                    // A running step's text as it is written: not an event of the history,
                    // so never in --json (one history event per line, as before).
                    if !as_json {
                        writing.show(&event)?;
                    }
                    continue;
                }
                writing.end()?;
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
    // The gateway stopped (or a proxy cut the stream): the run has not ended, and a
    // script waiting on `watch` must not take this for its end.
    writing.end()?;
    anyhow::bail!(
        "the gateway closed the event stream before run {run_id} ended; follow it again with `sortie run watch {run_id}`"
    )
}

/// A running step's text on its own line, growing as its deltas arrive; the next event
/// of the history starts a new line. Another execution of the step starts a new line too.
#[derive(Default)]
struct Writing {
    execution: Option<String>,
}

impl Writing {
    fn show(&mut self, delta: &Value) -> anyhow::Result<()> {
        let execution = delta["execution_id"].as_str().unwrap_or_default();
        let text = delta["text"].as_str().unwrap_or_default();
        let mut stdout = std::io::stdout().lock();
        if delta["kind"] == "status" {
            self.end_locked(&mut stdout)?;
            writeln!(
                stdout,
                "{}  {:<18} {:<11} {text}",
                human::clock(delta["at"].as_i64().unwrap_or(0)),
                delta["node"].as_str().unwrap_or("?"),
                "progress"
            )?;
        } else {
            if self.execution.as_deref() != Some(execution) {
                self.end_locked(&mut stdout)?;
                write!(
                    stdout,
                    "{}  {:<18} {:<11} ",
                    human::clock(delta["at"].as_i64().unwrap_or(0)),
                    delta["node"].as_str().unwrap_or("?"),
                    "writing"
                )?;
                self.execution = Some(execution.to_owned());
            }
            // One line: the text's own line breaks are shown as spaces.
            write!(stdout, "{}", text.replace(['\n', '\r'], " "))?;
        }
        stdout.flush()?;
        Ok(())
    }

    fn end(&mut self) -> anyhow::Result<()> {
        let mut stdout = std::io::stdout().lock();
        self.end_locked(&mut stdout)
    }

    fn end_locked(&mut self, stdout: &mut impl std::io::Write) -> anyhow::Result<()> {
        if self.execution.take().is_some() {
            writeln!(stdout)?;
        }
        Ok(())
    }
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
pub(super) async fn get(
    client: &Client,
    run_id: &str,
    run: &Value,
    conversation: bool,
) -> anyhow::Result<()> {
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
