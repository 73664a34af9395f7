//! Commands and results as a producer of `sortie.commands` would build them, and the
//! harness's graph publisher key.

#[allow(unused_imports)]
use super::*;

/// A successful result for an intent, echoing its args as output.
pub fn succeed(intent: &w::StepIntent) -> Option<w::StepResult> {
    Some(w::StepResult {
        spend: None,
        operation_id: intent.operation_id.clone(),
        attempt: intent.attempt,
        tenant: intent.tenant.clone(),
        run_id: intent.run_id.clone(),
        step_id: intent.step_id.clone(),
        status: w::StepStatus::Succeeded,
        retryable: false,
        output: Some(format!(
            r#"{{"echo":{},"step":"{}"}}"#,
            intent.args, intent.step_id
        )),
        error: None,
        executor: "test".into(),
        started_at: now_ms(),
        finished_at: Some(now_ms()),
    })
}

/// The key the harness signs every graph it publishes with (principal `test`, a
/// publisher for every tenant). A keyring of a test that should take the harness's graphs
/// lists [`publisher_entry`].
pub fn test_publisher() -> sortie_wire::signing::Signer {
    sortie_wire::signing::Signer::from_seed("test-publisher", [7u8; 32])
}

/// [`test_publisher`]'s keyring entry.
pub fn publisher_entry() -> sortie_wire::signing::KeyEntry {
    let mut entry = test_publisher().entry("test", &["*".to_owned()], &[], false);
    entry.publisher = true;
    entry
}

impl Stack {
    /// Writes the stack's keyring (`<dir>/keyring.yaml`): `entries` and the harness's
    /// graph publisher ([`publisher_entry`]), whose signature every graph of the stack
    /// carries. Written again, it is a rotation (a reducer given `--keyring` reloads it).
    /// Returns its path.
    pub fn write_keyring(&self, entries: &[sortie_wire::signing::KeyEntry]) -> PathBuf {
        let mut all = entries.to_vec();
        all.push(publisher_entry());
        let path = self.dir.join("keyring.yaml");
        std::fs::write(&path, sortie_wire::signing::keyring_text(&all)).expect("keyring");
        path
    }
}

/// Publishes `graph` as the harness does: signed by [`test_publisher`], as `test`.
pub(crate) async fn publish_signed(
    kafka: &KafkaConfig,
    codec: &Codec,
    topics: &Topics,
    graph: &Graph,
) {
    let signer = test_publisher();
    sortie_catalog::publish_signed(
        kafka,
        codec,
        topics,
        graph,
        "test",
        now_ms(),
        Some(&signer),
        None,
    )
    .await
    .expect("publish graph");
}

/// `base`, or `base-<n>` for the first n that puts it on `source`'s partition among
/// `partitions`: a fork's run id must share its source's partition.
pub fn fork_id(base: &str, source: &str, partitions: u32) -> String {
    let partition = partition_for(source.as_bytes(), partitions);
    std::iter::once(base.to_owned())
        .chain((1..).map(|n| format!("{base}-{n}")))
        .find(|id| partition_for(id.as_bytes(), partitions) == partition)
        .unwrap_or_default()
}

pub fn start_run(run_id: &str, graph: &str, input: &str) -> w::RunCommand {
    command(
        run_id,
        &format!("start-{run_id}"),
        w::CommandBody::StartRun(w::StartRun {
            graph_id: graph.into(),
            graph_version: None,
            input: input.into(),
            labels: BTreeMap::new(),
            budget: None,
            fork: None,
            parent: None,
        }),
    )
}

/// An approval of `interrupt` of `run_id` as proposed (no payload, no edits).
pub fn approve(
    run_id: &str,
    command_id: &str,
    interrupt: &sortie_core::state::Interrupt,
) -> w::RunCommand {
    command(
        run_id,
        command_id,
        w::CommandBody::ResumeRun(w::ResumeRun {
            interrupt_id: interrupt.interrupt_id.clone(),
            proposal_hash: interrupt.proposal_hash.clone(),
            decision: w::Decision::Approve,
            payload: None,
            comment: Some("ok".into()),
            edited_args: None,
            payload_is_input: false,
        }),
    )
}

pub fn command(run_id: &str, command_id: &str, body: w::CommandBody) -> w::RunCommand {
    w::RunCommand {
        command_id: command_id.into(),
        tenant: "acme".into(),
        run_id: run_id.into(),
        issuer: w::Issuer {
            principal: "svc:test".into(),
            roles: vec!["approver".into(), "operator".into()],
            groups: vec![],
        },
        issued_at: now_ms(),
        body,
    }
}
