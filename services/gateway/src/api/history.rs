//! A run's history as the view holds it, and its state at an earlier version, folded
//! from that history.

use super::*;

/// Every event of `run_id`'s history in the view, in order.
pub(crate) fn history(app: &AppState, run_id: &str) -> Result<Vec<sortie_core::Event>, ApiError> {
    let mut out: Vec<sortie_core::Event> = Vec::new();
    loop {
        let page = app
            .view()
            .store
            .events(run_id, out.len() as i64, 512)
            .map_err(|e| ApiError::internal(e.to_string()))?;
        if page.is_empty() {
            return Ok(out);
        }
        for event in page {
            if event.seq != out.len() as i64 + 1 {
                return Err(ApiError::new(
                    StatusCode::GONE,
                    "history_incomplete",
                    format!("the view lacks event {} of this run", out.len() + 1),
                ));
            }
            out.push(event);
        }
    }
}

/// The run's state after `version`: every version is recoverable from history, by
/// folding the events up to it.
pub(super) fn state_at(
    app: &AppState,
    run_id: &str,
    version: i64,
) -> Result<Option<sortie_core::RunState>, ApiError> {
    let mut state = None;
    let mut after = 0;
    'fold: loop {
        let page = app
            .view()
            .store
            .events(run_id, after, 512)
            .map_err(read_failed(run_id))?;
        if page.is_empty() {
            break;
        }
        for event in page {
            if event.seq != after + 1 {
                return Err(ApiError::new(
                    StatusCode::GONE,
                    "history_incomplete",
                    format!("the view lacks event {} of this run", after + 1),
                ));
            }
            if event.state_version > version {
                break 'fold;
            }
            after = event.seq;
            state = sortie_core::evolve(state, &event);
        }
    }
    Ok(state.filter(|s: &sortie_core::RunState| s.version == version))
}
