//! Derived identities. Nothing here is random: the same facts give the same id on every
//! replay, which is what makes retries safe and histories reproducible.

use serde_json::Value;

use crate::json;

/// The stable identity of a step's side effect, handed to receivers as the idempotency
/// key: the same across attempts of the step, different for a legitimately repeated
/// action (another step, other arguments).
pub fn operation_id(tenant: &str, run_id: &str, step_id: &str, tool: &str, args: &Value) -> String {
    let args_hash = json::sha256_hex(&[&json::canonical(args)]);
    let digest = json::sha256_hex(&[tenant, run_id, step_id, tool, &args_hash]);
    format!("op_{}", &digest[..32])
}

/// The hash a decision must name: over the canonical proposal.
pub fn proposal_hash(proposal: &Value) -> String {
    json::sha256_hex(&[&json::canonical(proposal)])
}

/// An interrupt's id: derived from the run, the step and the exact proposal, so a client
/// can know it before the interrupt is registered and a changed proposal gets a new id.
pub fn interrupt_id(run_id: &str, step_id: &str, proposal_hash: &str) -> String {
    let digest = json::sha256_hex(&[run_id, step_id, proposal_hash]);
    format!("int_{}", &digest[..24])
}

/// Checkpoint id of a run's state at a version.
pub fn checkpoint_id(run_id: &str, version: i64) -> String {
    format!("ckpt_{run_id}_{version}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn operation_ids_are_stable_and_distinguish_actions() {
        let a = operation_id(
            "t",
            "run_1",
            "refund#1",
            "http",
            &json!({"amount": 10, "to": "x"}),
        );
        let same = operation_id(
            "t",
            "run_1",
            "refund#1",
            "http",
            &json!({"to": "x", "amount": 10}),
        );
        assert_eq!(a, same, "key order does not matter");
        assert_ne!(
            a,
            operation_id(
                "t",
                "run_1",
                "refund#2",
                "http",
                &json!({"amount": 10, "to": "x"})
            )
        );
        assert_ne!(
            a,
            operation_id(
                "t",
                "run_1",
                "refund#1",
                "http",
                &json!({"amount": 11, "to": "x"})
            )
        );
        assert_ne!(
            a,
            operation_id(
                "u",
                "run_1",
                "refund#1",
                "http",
                &json!({"amount": 10, "to": "x"})
            )
        );
        assert!(a.starts_with("op_") && a.len() == 35);
    }
}
