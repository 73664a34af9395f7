//! `GET /v1/inbox`: the open approvals of the caller's tenant, each with whether the caller
//! may decide it and, when not, why — the reducer's own rule
//! ([`sortie_core::state::Interrupt::refusal`]), asked
//! ahead of time, so a console can explain a refusal before anyone clicks. It is asked at
//! the gateway's clock; the reducer's answer, at the decision's record time, is final.
//!
//! It is served from the view's inbox index ([`crate::store::InboxEntry`], kept as the view
//! writes each run), so a request reads at most `limit + 1` entries, whatever the number of
//! runs or events.

use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use sortie_core::event::StepRole;
use sortie_core::graph::OnReject;

use crate::api::read_after;
use crate::app::{now_ms, AppState};
use crate::error::ApiError;
use crate::extract::{Caller, QueryParams};
use crate::store::InboxEntry;

const DEFAULT_LIMIT: usize = 100;
const MAX_LIMIT: usize = 500;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct InboxQuery {
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default)]
    min_position: Option<String>,
}

pub(crate) async fn inbox(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    QueryParams(query): QueryParams<InboxQuery>,
) -> Result<Json<Value>, ApiError> {
    read_after(&app, &headers, query.min_position.as_deref()).await?;
    let limit = query.limit.unwrap_or(DEFAULT_LIMIT).clamp(1, MAX_LIMIT);
    let now = now_ms();
    let mut entries = app
        .view()
        .store
        .inbox(&caller.tenant, limit + 1)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let more = entries.len() > limit;
    entries.truncate(limit);
    let items: Vec<Value> = entries
        .iter()
        .map(|entry| item(&app, &caller, entry, now))
        .collect();
    Ok(Json(json!({"items": items, "truncated": more})))
}

fn item(app: &AppState, caller: &Caller, entry: &InboxEntry, now: i64) -> Value {
    let interrupt = &entry.interrupt;
    let refusal = interrupt.refusal(&caller.principal, &caller.roles, &caller.groups, true, now);
    let why_not = refusal.map(|r| match r.code {
        "forbidden" => {
            let roles = if caller.roles.is_empty() {
                "no roles".to_owned()
            } else {
                format!("roles {}", caller.roles.join(", "))
            };
            format!("{}; {} has {roles}", r.reason, caller.principal)
        }
        "not_in_group" => {
            let groups = if caller.groups.is_empty() {
                "no groups".to_owned()
            } else {
                format!("groups {}", caller.groups.join(", "))
            };
            format!("{}; {} is in {groups}", r.reason, caller.principal)
        }
        _ => r.reason,
    });
    let context = interrupt.context.as_ref();
    // The agent's rationale: the model message that proposed the call (recorded with the
    // interrupt), else a `rationale` the agent put in the proposed arguments.
    let rationale = context
        .and_then(|c| c.get("rationale"))
        .or_else(|| {
            interrupt
                .proposal
                .get("args")
                .and_then(|a| a.get("rationale"))
        })
        .and_then(Value::as_str);
    // What the step affects: recorded with the interrupt since 0.2; older interrupts get
    // it from the proposal.
    let affects = context
        .and_then(|c| c.get("affects"))
        .cloned()
        .unwrap_or_else(|| {
            json!({
                "node": interrupt.node,
                "tool": interrupt.proposal.get("tool"),
                "args": interrupt.proposal.get("args"),
            })
        });
    let precheck = context
        .and_then(|c| c.get("precheck"))
        .and_then(Value::as_str);
    // The run, for what the index does not keep: which step asked for the call and the
    // model message that did (one read per item of the page; a run the view cannot read
    // shows without them).
    let stored = match &interrupt.role {
        StepRole::Requested { .. } => app.view().store.run(&entry.run_id).ok().flatten(),
        _ => None,
    };
    let state = stored.as_ref().map(|run| &run.state);
    // A call a model asked for is not skipped or failed on rejection: the fold tells the
    // model the call was rejected, and the model goes on (the tool node's on_reject does
    // not apply).
    let asked_by_a_model = match (&interrupt.role, state) {
        (StepRole::Requested { by }, Some(state)) => state.steps.get(by).is_some_and(|step| {
            app.inner
                .graphs
                .is_tool_loop(&state.graph_id, state.graph_version, &step.node)
                == Some(true)
        }),
        _ => false,
    };
    let on_reject = app
        .inner
        .graphs
        .on_reject(&entry.graph_id, entry.graph_version, &interrupt.node)
        .map(|o| match o {
            _ if asked_by_a_model => {
                "The call does not run; the model is told an approver rejected it, and goes on."
                    .to_owned()
            }
            OnReject::Fail => {
                "The run fails; completed steps that declare a compensation are undone.".to_owned()
            }
            OnReject::Goto(node) => {
                format!("The step is skipped and the run continues at {node}.")
            }
        })
        .map(|text| match precheck {
            Some(check) => format!(
                "{text} The same happens if the precheck {check} finds, after approval, that the step should not run."
            ),
            None => text,
        });
    json!({
        "run_id": entry.run_id,
        "graph_id": entry.graph_id,
        "graph_version": entry.graph_version,
        "tenant": entry.tenant,
        "run_status": entry.run_status.as_str(),
        "interrupt_id": interrupt.interrupt_id,
        "node": interrupt.node,
        "proposal": interrupt.proposal,
        "proposal_hash": interrupt.proposal_hash,
        "reason": interrupt.reason,
        "required_role": interrupt.required_role,
        "quorum": interrupt.quorum,
        "approvals": interrupt.approvals,
        "rationale": rationale,
        // The model message that asked for this call: its text and the tool call.
        "model_message": state.and_then(|state| sortie_core::conversation::asking_message(
            state,
            &interrupt.role,
            &interrupt.node,
            &interrupt.step_id,
        )),
        "affects": affects,
        "on_reject": on_reject,
        "precheck": precheck,
        "approver_group": interrupt.approver_group,
        "members_only": interrupt.members_only,
        "opened_at": entry.opened_at,
        "expires_at": interrupt.expires_at,
        "may_decide": why_not.is_none(),
        "why_not": why_not,
    })
}
