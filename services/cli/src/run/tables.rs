//! `run list` and `run inbox`: the tenant's runs and its open approvals as tables
//! (or, with `--json`, as the JSON scripts read).

use anyhow::Context as _;
use serde_json::{json, Value};

use super::Client;
use crate::human::{self, Style};

/// `run list`: the tenant's runs as a table. Status, graph, the first label and limit
/// are the list route's filters; further labels are matched here, on the rows it returns.
pub(super) async fn list(
    client: &Client,
    status: Option<String>,
    graph: Option<String>,
    labels: &[String],
    limit: usize,
    as_json: bool,
) -> anyhow::Result<()> {
    anyhow::ensure!(limit > 0, "--limit 0 lists nothing: give at least 1");
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
pub(super) async fn inbox(
    client: &Client,
    all: bool,
    limit: usize,
    as_json: bool,
) -> anyhow::Result<()> {
    anyhow::ensure!(limit > 0, "--limit 0 lists nothing: give at least 1");
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
