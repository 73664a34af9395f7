//! History checks and the audit command.

#[allow(unused_imports)]
use super::*;

/// Audit-style checks on one run's committed history: gap-free seq (so no record of an
/// aborted transaction and no repeat), an intact hash chain, no step attempt dispatched
/// twice, and folding it gives `state` (the changelog's). Panics on the first problem.
pub fn check_history(run_id: &str, events: &[sortie_core::Event], state: &RunState) {
    if let Some(problem) = history_problems(run_id, events, state).into_iter().next() {
        panic!("{problem}");
    }
}

/// What [`check_history`] checks, as a list of problems (empty: the history is sound), so
/// a test can report every broken run at once. A repeated or missing seq is reported once
/// per run with the seqs as committed.
pub fn history_problems(
    run_id: &str,
    events: &[sortie_core::Event],
    state: &RunState,
) -> Vec<String> {
    let mut problems = Vec::new();
    let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
    if seqs.iter().enumerate().any(|(i, seq)| *seq != i as i64 + 1) {
        let shown: Vec<i64> = seqs.iter().copied().take(40).collect();
        problems.push(format!(
            "{run_id}: seq gap or repeat: committed seqs {shown:?}{}",
            if seqs.len() > 40 { " ..." } else { "" }
        ));
        // The chain and the fold break too; the seqs say it all.
        return problems;
    }
    let mut folded = None;
    let mut prev = None;
    let mut dispatched = std::collections::BTreeSet::new();
    for event in events {
        if event.prev_hash != prev {
            problems.push(format!("{run_id}: hash chain broken at seq {}", event.seq));
        }
        if event.hash.as_deref() != Some(event.compute_hash().as_str()) {
            problems.push(format!("{run_id}: hash of seq {}", event.seq));
        }
        prev = event.hash.clone();
        if let sortie_core::EventBody::StepDispatched {
            step_id, attempt, ..
        } = &event.body
        {
            if !dispatched.insert((step_id.clone(), *attempt)) {
                problems.push(format!(
                    "{run_id}: {step_id} attempt {attempt} dispatched twice"
                ));
            }
        }
        folded = sortie_core::evolve(folded, event);
    }
    if folded.as_ref() != Some(state) {
        problems.push(format!(
            "{run_id}: folding the history does not give the changelog state"
        ));
    }
    problems
}

impl Stack {
    /// `sortie audit replay --verify` on this stack's topics: whether it exited 0, and its
    /// JSON report (`Value::Null` if it printed none).
    pub async fn audit_verify(&self) -> (bool, serde_json::Value) {
        self.audit_verify_with(&[]).await
    }

    /// [`Stack::audit_verify`] with extra arguments (e.g. the run keys).
    pub async fn audit_verify_with(&self, extra: &[&str]) -> (bool, serde_json::Value) {
        let mut args = vec![
            "audit",
            "replay",
            "--verify",
            "--bootstrap-servers",
            &self.bootstrap,
            "--registry-url",
            &self.registry.url,
            "--prefix",
            &self.prefix,
        ];
        args.extend_from_slice(extra);
        let output = tokio::process::Command::new(sortie_bin())
            .args(args)
            .env("RUST_LOG", "warn")
            .output()
            .await
            .expect("run sortie audit");
        let report = serde_json::from_slice(&output.stdout).unwrap_or(serde_json::Value::Null);
        if !output.status.success() {
            eprintln!(
                "sortie audit replay --verify failed ({}):\n{}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        (output.status.success(), report)
    }

    /// Every run event record as `(run_id, seq)` read with `isolation`: under
    /// `ReadUncommitted` it includes the records of aborted transactions.
    pub async fn event_keys(&self, isolation: Isolation) -> Vec<(String, i64)> {
        let mut out = Vec::new();
        for message in crate::read_all(&self.bootstrap, &self.topics.run_events(), isolation).await
        {
            let record: w::RunEvent = self
                .codec
                .decode(message.payload())
                .await
                .expect("decode run-event");
            out.push((record.run_id.clone(), record.seq));
        }
        out
    }
}
