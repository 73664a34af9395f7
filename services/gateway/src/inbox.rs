//! `GET /v1/inbox`: the open approvals of the caller's tenant, each with whether the caller
//! may decide it and, when not, why — the reducer's own rule ([`Interrupt::refusal`]), asked
//! ahead of time, so a console can explain a refusal before anyone clicks. It is asked at
//! the gateway's clock; the reducer's answer, at the decision's record time, is final.

use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use sortie_core::event::StepRole;
use sortie_core::graph::OnReject;
use sortie_core::state::Interrupt;
use sortie_core::{EventBody, RunState, RunStatus};

use crate::api::read_after;
use crate::app::{now_ms, AppState};
use crate::error::ApiError;
use crate::extract::{Caller, QueryParams};

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
    let store = &app.view().store;
    let mut items = Vec::new();
    // An interrupt is normally open while the run waits for approval, but a run with other
    // work in flight is still `running` with an interrupt open.
    for status in [RunStatus::WaitingApproval, RunStatus::Running] {
        let runs = store
            .list(&caller.tenant, Some(status), None, usize::MAX, |run| {
                run.state.open_interrupts().next().is_some()
            })
            .map_err(|e| ApiError::internal(e.to_string()))?;
        for run in runs {
            let opened = opened_at(&app, &run.state)?;
            for interrupt in run.state.open_interrupts() {
                let opened_at = opened
                    .iter()
                    .find(|(id, _)| *id == interrupt.interrupt_id)
                    .map_or(run.state.updated_at, |(_, at)| *at);
                items.push(item(&app, &caller, &run.state, interrupt, opened_at, now));
            }
        }
    }
    items.sort_by_key(|i| (i["opened_at"].as_i64(), i["interrupt_id"].to_string()));
    let more = items.len() > limit;
    items.truncate(limit);
    Ok(Json(json!({"items": items, "truncated": more})))
}

/// When each interrupt of the run was opened: the time of its `Interrupted` event.
fn opened_at(app: &AppState, state: &RunState) -> Result<Vec<(String, i64)>, ApiError> {
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let page = app
            .view()
            .store
            .events(&state.run_id, after, 512)
            .map_err(|e| ApiError::internal(e.to_string()))?;
        let Some(last) = page.last() else {
            return Ok(out);
        };
        after = last.seq;
        for event in &page {
            if let EventBody::Interrupted { interrupt_id, .. } = &event.body {
                out.push((interrupt_id.clone(), event.at));
            }
        }
    }
}

fn item(
    app: &AppState,
    caller: &Caller,
    state: &RunState,
    interrupt: &Interrupt,
    opened_at: i64,
    now: i64,
) -> Value {
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
    // A call a model asked for is not skipped or failed on rejection: the fold tells the
    // model the call was rejected, and the model goes on (the tool node's on_reject does
    // not apply).
    let asked_by_a_model = match &interrupt.role {
        StepRole::Requested { by } => state.steps.get(by).is_some_and(|step| {
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
        .on_reject(&state.graph_id, state.graph_version, &interrupt.node)
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
        "run_id": state.run_id,
        "graph_id": state.graph_id,
        "graph_version": state.graph_version,
        "tenant": state.tenant,
        "run_status": state.status.as_str(),
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
        "model_message": sortie_core::conversation::asking_message(
            state,
            &interrupt.role,
            &interrupt.node,
            &interrupt.step_id,
        ),
        "affects": affects,
        "on_reject": on_reject,
        "precheck": precheck,
        "approver_group": interrupt.approver_group,
        "members_only": interrupt.members_only,
        "opened_at": opened_at,
        "expires_at": interrupt.expires_at,
        "may_decide": why_not.is_none(),
        "why_not": why_not,
    })
}
