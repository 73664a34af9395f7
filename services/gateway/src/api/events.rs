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
    let last_event_id = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<i64>().ok());
    let after = last_event_id.or(query.after).unwrap_or(0).max(0);
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
    Ok(Sse::new(live(app, run_id, after, slot)).keep_alive(KeepAlive::default()))
}

struct Cursor {
    app: AppState,
    run_id: String,
    after: i64,
    buffer: VecDeque<Event>,
    progress: tokio::sync::watch::Receiver<Progress>,
    stopping: tokio::sync::watch::Receiver<bool>,
    /// Held for the stream's life: the stream drops it when it ends or its client leaves.
    _slot: crate::app::StreamSlot,
}

/// The run's events after `after`, then every new one as the view applies it, until the
/// client leaves or the gateway stops.
fn live(
    app: AppState,
    run_id: String,
    after: i64,
    slot: crate::app::StreamSlot,
) -> impl futures::Stream<Item = Result<sse::Event, Infallible>> {
    let cursor = Cursor {
        _slot: slot,
        progress: app.view().progress(),
        stopping: app.stopping(),
        app,
        run_id,
        after,
        buffer: VecDeque::new(),
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
            if *c.stopping.borrow() {
                return None;
            }
            // Mark the progress seen before reading, so a change after the read wakes us.
            c.progress.borrow_and_update();
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
            tokio::select! {
                changed = c.progress.changed() => if changed.is_err() { return None },
                _ = c.stopping.wait_for(|stop| *stop) => return None,
            }
        }
    })
}
