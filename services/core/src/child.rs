//! Child runs: a node that starts a run of another graph and waits for it (sub-agents).
//!
//! A child is a step of its parent ([ADR 0028]): its operation id, attempt, retry policy
//! and timeline entry are the step's. Dispatching it is not an intent for an executor but
//! a `StartRun` for the child, produced in the parent's transaction to the child's
//! partition; the child's id is derived from the parent's operation and attempt, so a
//! re-fold sends the same start and a retry starts a fresh child. When the child ends its
//! fold reports to the parent as an executor would: a step report for the parent's
//! operation id and attempt, produced to the parent's partition of the step results.
//! Cancelling the parent cancels its children.
//!
//! The step's failure codes: `child_failed` (retryable under the node's policy),
//! `child_cancelled`, and for a start the child's fold refused, `child_` and its code
//! (`child_unknown_graph`, `child_forbidden`).
//!
//! [ADR 0028]: ../../../docs/adr/0028-a-child-run-is-a-step-whose-result-crosses-partitions.md

use serde::{Deserialize, Serialize};

use crate::json;

/// The tool name a child node has on the wire and in the state: it calls no executor.
pub const CHILD_TOOL: &str = "$run";
/// The prefix of a child run's id: reserved for ids [`child_run_id`] derives.
pub const CHILD_PREFIX: &str = "sub_";
/// The principal a parent's commands to its children are issued as: `run:<parent id>`.
pub const PARENT_PRINCIPAL: &str = "run:";

/// `run: {graph, version, budget}` on a node: the graph its child runs (pinned, or the
/// latest when the child starts); the node's `args` are the child's input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChildRun {
    pub graph: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u32>,
    /// The most the child may spend (each limit capped by what the parent has left);
    /// absent: an even share of what the parent has left among the children started
    /// together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<crate::budget::Limits>,
}

/// Who started a child run: its parent's run, step, operation and attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParentLink {
    pub run_id: String,
    pub step_id: String,
    pub operation_id: String,
    pub attempt: u32,
}

/// The principal a run's commands to its children are issued as: `run:<run id>`.
pub fn parent_principal(parent_run: &str) -> String {
    format!("{PARENT_PRINCIPAL}{parent_run}")
}

/// The id of the child run a parent's `operation_id` starts at `attempt`, in `tenant`:
/// `sub_` and 32 hex digits of SHA-256 over the four (each followed by 0x1f). The same
/// attempt always names the same child (a re-fold sends the same start); another attempt
/// names a fresh one. The reducer takes a `sub_` id only from a start whose parent link
/// derives it, so no tenant can hold a child's id before its parent starts it.
pub fn child_run_id(tenant: &str, parent_run: &str, operation_id: &str, attempt: u32) -> String {
    let digest = json::sha256_hex(&[
        "sortie.child.v1",
        tenant,
        parent_run,
        operation_id,
        &attempt.to_string(),
    ]);
    format!("{CHILD_PREFIX}{}", &digest[..32])
}

impl ParentLink {
    /// The child run id this link derives in `tenant`.
    pub fn child_id(&self, tenant: &str) -> String {
        child_run_id(tenant, &self.run_id, &self.operation_id, self.attempt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_id_is_per_tenant_and_attempt() {
        let id = child_run_id("acme", "run_1", "op_1", 1);
        assert!(id.starts_with(CHILD_PREFIX) && id.len() == 36, "{id}");
        assert_eq!(id, child_run_id("acme", "run_1", "op_1", 1));
        assert_ne!(id, child_run_id("acme", "run_1", "op_1", 2));
        assert_ne!(id, child_run_id("globex", "run_1", "op_1", 1));
    }
}
