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

/// The prefix of a correlated run's id: reserved for ids [`correlated_run_id`] derives.
pub const CORRELATED_PREFIX: &str = "cor_";

/// The run id of the one run of graph `graph_id` whose start label `label` (the graph's
/// `correlation`) is `value`, in `tenant`: `cor_` and 32 hex digits of SHA-256 over the
/// four, each followed by a unit separator (0x1f). An outside service that knows the
/// label's value (an order id) computes it to address the run — no index holds the
/// value in clear. Another tenant computes another id, and the reducer takes a `cor_` id
/// only from a start whose own tenant, graph and label derive it.
pub fn correlated_run_id(tenant: &str, graph_id: &str, label: &str, value: &str) -> String {
    let digest = json::sha256_hex(&["sortie.correlation.v1", tenant, graph_id, label, value]);
    format!("{CORRELATED_PREFIX}{}", &digest[..32])
}

/// The prefix of a run id derived from a start's `Idempotency-Key` ([`keyed_run_id`]).
pub const KEYED_PREFIX: &str = "key_";

/// The run id the gateway gives a start without a run id that carries an
/// `Idempotency-Key` (which becomes the start's command id): `key_` and 32 hex digits of
/// SHA-256 over a domain tag, the tenant and the key, so a retry names the same run. The
/// reducer takes a `key_` id only from a start whose own tenant and command id derive it:
/// nobody can take the id of another tenant's start before it is sent by guessing its key,
/// and within a tenant the same key is the same request.
pub fn keyed_run_id(tenant: &str, key: &str) -> String {
    let digest = json::sha256_hex(&["sortie.keyed-run.v1", tenant, key]);
    format!("{KEYED_PREFIX}{}", &digest[..32])
}

/// The `n`-th candidate id of a fork made without a run id under an `Idempotency-Key`
/// (the fork's command id): `key_`, 32 hex digits of SHA-256 over a domain tag, the
/// tenant, the key and `n`, then `_n`. A fork's id must be on its source's partition, so
/// the gateway takes the first candidate that is; the reducer recomputes the one the id
/// names ([`is_keyed_id`]). Like [`keyed_run_id`], nobody can take it first by guessing.
pub fn keyed_fork_id(tenant: &str, key: &str, n: u32) -> String {
    let digest = json::sha256_hex(&["sortie.keyed-fork.v1", tenant, key, &n.to_string()]);
    format!("{KEYED_PREFIX}{}_{n}", &digest[..32])
}

/// Whether `run_id` is the `key_` id a start of `tenant` with command id `command_id`
/// derives: [`keyed_run_id`], or for a fork one of its [`keyed_fork_id`] candidates.
pub fn is_keyed_id(tenant: &str, command_id: &str, run_id: &str, fork: bool) -> bool {
    if keyed_run_id(tenant, command_id) == run_id {
        return true;
    }
    let candidate = run_id
        .rsplit_once('_')
        .and_then(|(_, n)| n.parse::<u32>().ok())
        .filter(|n| run_id.ends_with(&format!("_{n}")));
    fork && candidate.is_some_and(|n| keyed_fork_id(tenant, command_id, n) == run_id)
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
    fn a_fork_candidate_is_recognised_only_as_its_own() {
        let id = keyed_fork_id("acme", "k", 7);
        assert!(id.starts_with("key_") && id.ends_with("_7"));
        assert!(is_keyed_id("acme", "k", &id, true));
        assert!(!is_keyed_id("acme", "k", &id, false));
        assert!(!is_keyed_id("globex", "k", &id, true));
        assert!(!is_keyed_id("acme", "k2", &id, true));
        let renumbered = format!("{}_8", id.trim_end_matches("_7"));
        assert!(!is_keyed_id("acme", "k", &renumbered, true));
        assert!(!is_keyed_id("acme", "k", &format!("{id}_07"), true));
        assert!(is_keyed_id("acme", "k", &keyed_run_id("acme", "k"), false));
    }

    /// The published formula, pinned: outside clients (the Python one included)
    /// compute the same id from the same four values.
    #[test]
    fn a_correlated_run_id_is_the_published_hash() {
        let id = correlated_run_id("acme", "hire", "hire_id", "h-42");
        assert_eq!(
            id,
            "cor_".to_owned()
                + &json::sha256_hex(&["sortie.correlation.v1", "acme", "hire", "hire_id", "h-42"])
                    [..32]
        );
        assert_eq!(id.len(), 36);
        assert_ne!(id, correlated_run_id("globex", "hire", "hire_id", "h-42"));
        assert_ne!(id, correlated_run_id("acme", "hire", "hire_id", "h-43"));
    }

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
