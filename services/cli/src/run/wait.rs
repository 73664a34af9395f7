//! `run wait`: polls a run until it reaches a status, for scripts.

use anyhow::bail;

use sortie_core::RunStatus;

use super::client::{Client, Refused};

/// `run wait`: polls the run until its status is one of `statuses` (default: an end).
pub(super) async fn wait(
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
    let known: Vec<&str> = RunStatus::ALL.iter().map(|s| s.as_str()).collect();
    if let Some(unknown) = wanted.iter().find(|s| !known.contains(s)) {
        bail!(
            "--status {unknown} is not a run status; one of: {}",
            known.join(", ")
        );
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(timeout_s);
    let mut answered = false;
    loop {
        let answer = client
            .send(client.request(reqwest::Method::GET, &format!("/v1/runs/{run_id}")))
            .await;
        // A run just started may not be in the read view yet: asked again until the end.
        let run = match answer {
            Ok(run) => {
                answered = true;
                run
            }
            Err(e) if std::time::Instant::now() >= deadline => return Err(e),
            Err(e) if !worth_asking_again(&e, answered) => return Err(e),
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

/// Whether `run wait` asks again after `error`: a run not in the read view yet (404), a
/// gateway or proxy not ready (5xx), or a gateway that answered before and is restarting.
/// A refusal (401, 403, 400), an answer that is not the gateway's, or nothing answering at
/// `--gateway` from the start would be the same at the deadline: said at once.
fn worth_asking_again(error: &anyhow::Error, answered: bool) -> bool {
    match error.downcast_ref::<Refused>() {
        Some(refused) => {
            refused.status == reqwest::StatusCode::NOT_FOUND || refused.status.is_server_error()
        }
        None => answered,
    }
}
