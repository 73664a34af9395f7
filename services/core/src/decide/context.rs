//! What an approver needs to judge a proposal, recorded with the interrupt: the agent's
//! rationale, what the step affects, and what a rejection does.

use serde_json::{json, Map, Value};

use crate::{
    event::StepRole,
    graph::{Node, OnReject},
    state::RunState,
};

/// The `context` of an `Interrupted` event.
pub(crate) fn of(
    run: &RunState,
    node: &Node,
    args: &Value,
    role: &StepRole,
    edited_from: Option<&Value>,
) -> Value {
    let mut affects = json!({
        "node": node.id,
        "tool": node.tool,
        "side_effect": node.side_effect,
        "args": args,
    });
    if let Some(before) = edited_from {
        affects["edited_from"] = before.clone();
        affects["diff"] = diff(before, args);
    }
    let on_reject = match &node.on_reject {
        OnReject::Fail => json!({"action": "fail"}),
        OnReject::Goto(target) => json!({"action": "goto", "node": target}),
    };
    let mut out = json!({"affects": affects, "on_reject": on_reject});
    if let Some(check) = &node.precheck {
        out["precheck"] = json!(check);
    }
    if let Some(rationale) = rationale(run, role) {
        out["rationale"] = rationale;
    }
    out
}

/// The model message that proposed the call: for a step an llm step requested, that
/// step's recorded output (`content`, else `message`, else `rationale`). Otherwise none.
fn rationale(run: &RunState, role: &StepRole) -> Option<Value> {
    let StepRole::Requested { by } = role else {
        return None;
    };
    let requester = run.steps.get(by)?;
    if requester.tool != "llm" {
        return None;
    }
    let output = requester.output.as_ref()?;
    ["content", "message", "rationale"]
        .iter()
        .filter_map(|k| output.get(*k))
        .find(|v| v.as_str().is_some_and(|s| !s.trim().is_empty()))
        .cloned()
}

/// Top-level fields that differ: `{field: {"from": old, "to": new}}` (null when absent).
pub(crate) fn diff(before: &Value, after: &Value) -> Value {
    let (Some(a), Some(b)) = (before.as_object(), after.as_object()) else {
        return json!({"": {"from": before, "to": after}});
    };
    let mut out = Map::new();
    for key in a.keys().chain(b.keys()) {
        let (old, new) = (a.get(key), b.get(key));
        if old != new && !out.contains_key(key) {
            out.insert(
                key.clone(),
                json!({"from": old.cloned().unwrap_or(Value::Null), "to": new.cloned().unwrap_or(Value::Null)}),
            );
        }
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diff_names_changed_added_and_removed_fields() {
        assert_eq!(
            diff(
                &json!({"amount": 30, "order": "o1", "note": "x"}),
                &json!({"amount": 20, "order": "o1", "reason": "partial"})
            ),
            json!({
                "amount": {"from": 30, "to": 20},
                "note": {"from": "x", "to": null},
                "reason": {"from": null, "to": "partial"},
            })
        );
    }
}
