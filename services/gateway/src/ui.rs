//! The web console at `/ui`: one HTML page, one script, one style sheet, compiled into the
//! binary. The files hold no data and need no auth; every datum the console shows comes
//! from the API with the signed-in user's bearer token (kept in `sessionStorage`, sent as
//! `Authorization`, never in a URL or a cookie).
//!
//! Security headers: a strict Content-Security-Policy (scripts and styles from this origin
//! only, no inline script, no framing), `nosniff`, no referrer. The script and the style
//! sheet are addressed by a digest of their content, so they can be cached for good while
//! the page itself is always revalidated.

use std::sync::OnceLock;

use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

use crate::app::AppState;
use crate::error::ApiError;

const INDEX: &str = include_str!("ui/index.html");
const SCRIPT: &str = include_str!("ui/app.js");
const STYLE: &str = include_str!("ui/app.css");
const ICON: &str = "<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 16 16\">\
<rect width=\"16\" height=\"16\" rx=\"3\" fill=\"#17212e\"/>\
<path d=\"M4 11 L8 4 L12 11 Z\" fill=\"#e8a317\"/></svg>";

/// The policy every console response carries.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; connect-src 'self'; img-src 'self'; form-action 'self'; \
     base-uri 'none'; frame-ancestors 'none'";

struct Assets {
    index: String,
    script_path: String,
    style_path: String,
}

fn assets() -> &'static Assets {
    static ASSETS: OnceLock<Assets> = OnceLock::new();
    ASSETS.get_or_init(|| {
        let digest = |text: &str| sortie_core::json::sha256_hex(&[text])[..16].to_owned();
        let script_path = format!("/ui/app.{}.js", digest(SCRIPT));
        let style_path = format!("/ui/app.{}.css", digest(STYLE));
        let index = INDEX
            .replace("{{SCRIPT}}", &script_path)
            .replace("{{STYLE}}", &style_path);
        Assets {
            index,
            script_path,
            style_path,
        }
    })
}

/// The console's routes.
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/ui", get(|| async { Redirect::permanent("/ui/") }))
        .route("/ui/", get(index))
        .route("/ui/{file}", get(asset))
        .route(
            "/favicon.ico",
            get(|| async { Redirect::permanent("/ui/icon.svg") }),
        )
}

fn console(content_type: &'static str, cache: &'static str, body: String) -> Response {
    let mut response = (StatusCode::OK, body).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static(cache));
    response
}

async fn index() -> Response {
    console(
        "text/html; charset=utf-8",
        "no-cache",
        assets().index.clone(),
    )
}

async fn asset(axum::extract::Path(file): axum::extract::Path<String>) -> Response {
    let assets = assets();
    let immutable = "public, max-age=31536000, immutable";
    let path = format!("/ui/{file}");
    if path == assets.script_path {
        console(
            "text/javascript; charset=utf-8",
            immutable,
            SCRIPT.to_owned(),
        )
    } else if path == assets.style_path {
        console("text/css; charset=utf-8", immutable, STYLE.to_owned())
    } else if file == "icon.svg" {
        console("image/svg+xml", "public, max-age=86400", ICON.to_owned())
    } else {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such console file").into_response()
    }
}

/// Headers for every response: console pages get the content security policy; API
/// answers (tenant data behind a bearer token) are never stored by a browser or a proxy.
pub(crate) async fn secure(request: Request, next: Next) -> Response {
    let console = request.uri().path().starts_with("/ui");
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    if console {
        headers.insert(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CONTENT_SECURITY_POLICY),
        );
        headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    }
    if !headers.contains_key(header::CACHE_CONTROL) {
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_names_its_digested_assets_and_holds_no_inline_script() {
        let assets = assets();
        assert!(assets.index.contains(&assets.script_path));
        assert!(assets.index.contains(&assets.style_path));
        assert!(!assets.index.contains("{{"));
        // Every <script> loads a file; the policy would refuse inline code anyway.
        for tag in assets.index.split("<script").skip(1) {
            assert!(tag.trim_start().starts_with("src="), "inline script: {tag}");
        }
        assert!(
            !assets.index.contains(" style="),
            "inline styles are refused"
        );
        assert!(
            !SCRIPT.contains("innerHTML"),
            "render with textContent only"
        );
    }
}
