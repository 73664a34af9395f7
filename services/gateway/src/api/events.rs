//! A run's events: a page of them, or a live server-sent-event stream that follows the
//! view as it applies new ones.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::http::header;
use axum::response::sse::{self, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use sortie_core::Event;

use super::*;
use crate::extract::QueryParams;
use crate::render;
use crate::view::Progress;

#[derive(Debug, Default, Deserialize)]
pub(super) struct EventsQuery {
    #[serde(default)]
    after: Option<i64>,
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default)]
    min_position: Option<String>,
}

fn wants_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/event-stream"))
}

pub(super) async fn events(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Params(run_id): Params<String>,
    QueryParams(query): QueryParams<EventsQuery>,
) -> Result<Response, ApiError> {
    if wants_stream(&headers) {
        return events_stream(
            State(app),
            caller,
            headers,
            Params(run_id),
            QueryParams(query),
        )
        .await
        .map(IntoResponse::into_response);
    }
    read_after(&app, &headers, query.min_position.as_deref()).await?;
    visible_run(&app, &caller, &run_id)?;
    let after = query.after.unwrap_or(0).max(0);
    let limit = query.limit.unwrap_or(DEFAULT_PAGE).clamp(1, MAX_PAGE);
    let mut page = app
        .view()
        .store
        .events(&run_id, after, limit + 1)
        .map_err(read_failed(&run_id))?;
    let more = page.len() > limit;
    page.truncate(limit);
    let next_after = page.last().map_or(after, |e| e.seq);
    Ok(Json(json!({
        "run_id": run_id,
        "events": page.iter().map(render::event).collect::<Vec<_>>(),
        "next_after": next_after,
        "has_more": more,
    }))
    .into_response())
}

pub(super) async fn events_stream(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Params(run_id): Params<String>,
    QueryParams(query): QueryParams<EventsQuery>,
) -> Result<Sse<impl futures::Stream<Item = Result<sse::Event, Infallible>>>, ApiError> {
    read_after(&app, &headers, query.min_position.as_deref()).await?;
    visible_run(&app, &caller, &run_id)?;
    // `N` (an event of the history) or `N.dM` (a delta, sent after event N): the history
    // after N, and the deltas after offset M still retained (all of them after `N`).
    let last_event_id = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(parse_event_id);
    let after = last_event_id
        .map(|(seq, _)| seq)
        .or(query.after)
        .unwrap_or(0)
        .max(0);
    let delta_after = last_event_id.and_then(|(_, offset)| offset).unwrap_or(-1);
    let slot = app.stream_slot(&caller.tenant).ok_or_else(|| {
        ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_streams",
            format!(
                "tenant {} has {} live event streams open, the most allowed; close one first",
                caller.tenant,
                app.config().max_streams_per_tenant
            ),
        )
    })?;
    let tenant = caller.tenant.clone();
    Ok(
        Sse::new(live(app, run_id, tenant, after, delta_after, slot))
            .keep_alive(KeepAlive::default()),
    )
}

/// A stream's event id: `N`, or `N.dM` for a delta at offset M sent after event N.
fn parse_event_id(id: &str) -> Option<(i64, Option<i64>)> {
    let id = id.trim();
    match id.split_once(".d") {
        Some((seq, offset)) => Some((seq.parse().ok()?, Some(offset.parse().ok()?))),
        None => Some((id.parse().ok()?, None)),
    }
}

struct Cursor {
    app: AppState,
    run_id: String,
    tenant: String,
    after: i64,
    buffer: VecDeque<Event>,
    /// The offset of the last delta sent (-1: none yet).
    delta_after: i64,
    deltas: VecDeque<crate::deltas::Retained>,
    arrivals: tokio::sync::watch::Receiver<u64>,
    progress: tokio::sync::watch::Receiver<Progress>,
    stopping: tokio::sync::watch::Receiver<bool>,
    /// Held for the stream's life: the stream drops it when it ends or its client leaves.
    _slot: crate::app::StreamSlot,
}

/// The run's events after `after`, then every new one as the view applies it, until the
/// client leaves or the gateway stops; between them, the running steps' deltas (after
/// offset `delta_after`) as they arrive (`event: delta`, outside the history's ids).
fn live(
    app: AppState,
    run_id: String,
    tenant: String,
    after: i64,
    delta_after: i64,
    slot: crate::app::StreamSlot,
) -> impl futures::Stream<Item = Result<sse::Event, Infallible>> {
    let cursor = Cursor {
        _slot: slot,
        progress: app.view().progress(),
        arrivals: app.inner.deltas.arrivals(),
        stopping: app.stopping(),
        app,
        run_id,
        tenant,
        after,
        buffer: VecDeque::new(),
        delta_after,
        deltas: VecDeque::new(),
    };
    futures::stream::unfold(cursor, |mut c| async move {
        loop {
            if let Some(event) = c.buffer.pop_front() {
                c.after = event.seq;
                let data = serde_json::to_string(&render::event(&event)).unwrap_or_default();
                let item = sse::Event::default()
                    .id(event.seq.to_string())
                    .event(event.body.name())
                    .data(data);
                return Some((Ok(item), c));
            }
            if let Some(delta) = c.deltas.pop_front() {
                c.delta_after = delta.offset;
                let item = sse::Event::default()
                    .id(format!("{}.d{}", c.after, delta.offset))
                    .event("delta")
                    .data(delta.data.to_string());
                return Some((Ok(item), c));
            }
            if *c.stopping.borrow() {
                return None;
            }
            // Mark the progress seen before reading, so a change after the read wakes us.
            c.progress.borrow_and_update();
            c.arrivals.borrow_and_update();
            match c.app.view().store.events(&c.run_id, c.after, 256) {
                Ok(events) if !events.is_empty() => {
                    c.buffer.extend(events);
                    continue;
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(run_id = %c.run_id, %error, "An event stream ends: the view store failed.");
                    return None;
                }
            }
            let deltas = c
                .app
                .inner
                .deltas
                .after(&c.tenant, &c.run_id, c.delta_after);
            if !deltas.is_empty() {
                c.deltas.extend(deltas);
                continue;
            }
            tokio::select! {
                changed = c.progress.changed() => if changed.is_err() { return None },
                changed = c.arrivals.changed() => if changed.is_err() { return None },
                _ = c.stopping.wait_for(|stop| *stop) => return None,
            }
        }
    })
}
