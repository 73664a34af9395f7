//! `GET /v1/runs/{run_id}/blobs/{sha256}`: a blob the run references, served as a
//! checked download to the run's own tenant.

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};

use super::*;
use crate::extract::QueryParams;

/// A blob the run references (its input, an output, a decision's payload stored by
/// reference), to the run's own tenant: the bytes exactly as stored, with the media type
/// of the reference. Only a hash the run's state references is served (through that
/// reference's key, so a fork serves what it carries from its source); the bytes are
/// checked against the reference's size and hash before they are sent.
pub(super) async fn blob(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    Params((run_id, sha256)): Params<(String, String)>,
    QueryParams(query): QueryParams<ReadQuery>,
) -> Result<Response, ApiError> {
    read_after(&app, &headers, query.min_position.as_deref()).await?;
    let run = visible_run(&app, &caller, &run_id)?;
    let unknown = || {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_blob",
            format!("run {run_id} references no blob {sha256}"),
        )
    };
    if !sortie_core::blob::is_sha256_hex(&sha256) {
        return Err(unknown());
    }
    let state = serde_json::to_value(&run.state).map_err(|e| ApiError::internal(e.to_string()))?;
    let reference = sortie_core::blob::refs(&state)
        .into_iter()
        .find(|r| r.sha256 == sha256)
        .ok_or_else(unknown)?;
    let Some(store) = app.inner.blobs.as_deref() else {
        return Err(ApiError::unavailable(
            "blob_store_unavailable",
            "this gateway has no blob store configured (--blob-store)",
        ));
    };
    use sortie_blob::resolve::ResolveError as E;
    let bytes = sortie_blob::resolve::fetch_verified(store, &reference, &caller.tenant)
        .await
        .map_err(|e| match e {
            E::Missing { .. } => ApiError::new(StatusCode::NOT_FOUND, "blob_missing", e.to_string()),
            E::Unavailable { .. } | E::NoStore { .. } => {
                ApiError::unavailable("blob_store_unavailable", e.to_string())
            }
            E::Forbidden { .. } => unknown(),
            E::Corrupt { .. } | E::Invalid { .. } => {
                tracing::error!(run_id = %run_id, error = %e, "A referenced blob failed its check; not served.");
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.code(), e.to_string())
            }
        })?;
    // Served as a download, never as a page: a run's data is whatever its tenant (or a
    // receiver) wrote, so a browser that opens this URL must not run or render it.
    let content_type = if is_json_media_type(&reference.media_type) {
        "application/json"
    } else {
        "application/octet-stream"
    };
    Ok((
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
            (
                header::CONTENT_DISPOSITION,
                HeaderValue::from_static("attachment"),
            ),
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(BLOB_CONTENT_SECURITY_POLICY),
            ),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
            (
                header::ETAG,
                HeaderValue::from_str(&format!("\"{sha256}\""))
                    .map_err(|e| ApiError::internal(e.to_string()))?,
            ),
        ],
        bytes,
    )
        .into_response())
}

/// The blob route's policy: nothing loads, and the document is sandboxed (no script, no
/// origin of its own) should a browser render it anyway.
const BLOB_CONTENT_SECURITY_POLICY: &str = "default-src 'none'; sandbox";

/// Whether a blob's stored media type is JSON (`application/json`, parameters aside):
/// the one type the blob route names; any other is served as
/// `application/octet-stream`, whatever the reference says.
fn is_json_media_type(media_type: &str) -> bool {
    media_type
        .split(';')
        .next()
        .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("application/json"))
}

#[cfg(test)]
mod blob_tests {
    use super::*;

    /// The blob route names JSON only; whatever else a reference says (HTML, SVG, script)
    /// is served as `application/octet-stream`.
    #[test]
    fn only_a_json_media_type_is_named() {
        assert!(is_json_media_type("application/json"));
        assert!(is_json_media_type("Application/JSON; charset=utf-8"));
        for other in [
            "text/html",
            "image/svg+xml",
            "application/javascript",
            "application/json+html",
            "",
        ] {
            assert!(!is_json_media_type(other), "{other}");
        }
    }
}
