//! The one list of the gateway's routes: the router is built from it, the OpenAPI
//! document is checked against it (a unit test below), and the docs' HTTP reference is
//! checked against it (`tests/tests/docs.rs`). A route is added here, in `openapi.rs`,
//! and in `docs/reference/http-api.md`.

use axum::routing::{on, MethodFilter};
use axum::Router;

use super::*;

/// Declares the routes once: `ROUTES` (method, path) and the router that serves them.
macro_rules! routes {
    ($( $path:literal => { $( $method:ident : $handler:expr ),+ $(,)? } )*) => {
        /// Every (method, path) the API serves, besides the console's `/ui/` assets.
        pub const ROUTES: &[(&str, &str)] = &[ $( $( (stringify!($method), $path), )+ )* ];

        /// `router` with every route of [`ROUTES`].
        pub(super) fn api(router: Router<AppState>) -> Router<AppState> {
            router $( .route($path, {
                let methods = axum::routing::MethodRouter::new();
                $( let methods = methods.merge(on(MethodFilter::$method, $handler)); )+
                methods
            }) )*
        }
    };
}

routes! {
    "/healthz" => { GET: service::healthz }
    "/readyz" => { GET: service::readyz }
    "/metrics" => { GET: crate::metrics::render }
    "/openapi.json" => { GET: service::openapi_json }
    "/v1/runs" => { POST: starts::start_run, GET: reads::list_runs }
    "/v1/inbox" => { GET: crate::inbox::inbox }
    "/v1/me" => { GET: service::me }
    "/v1/runs/{run_id}" => { GET: reads::get_run, DELETE: operator::delete_run }
    "/v1/runs/{run_id}/resume" => { POST: decisions::resume_run }
    "/v1/runs/{run_id}/cancel" => { POST: decisions::cancel_run }
    "/v1/runs/{run_id}/signals/{name}" => { POST: signals::signal_run }
    "/v1/signals/{name}" => { POST: signals::signal_correlated }
    "/v1/runs/{run_id}/events" => { GET: events::events }
    "/v1/runs/{run_id}/conversation" => { GET: reads::conversation }
    "/v1/runs/{run_id}/events/stream" => { GET: events::events_stream }
    "/v1/runs/{run_id}/checkpoints/{checkpoint_id}" => { GET: reads::checkpoint }
    "/v1/runs/{run_id}/fork" => { POST: fork::fork_run }
    "/v1/runs/{run_id}/blobs/{sha256}" => { GET: blobs::blob }
    "/v1/runs/{run_id}/operations/{operation_id}/reconcile" => { POST: operator::reconcile }
    "/v1/runs/{run_id}/operations/{operation_id}/why" => { GET: crate::why::why }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::ROUTES;

    /// The OpenAPI document describes exactly the routes the router serves (and the
    /// console's page).
    #[test]
    fn the_openapi_document_lists_every_route_and_no_other() {
        let doc = crate::openapi::document();
        let documented: BTreeSet<(String, String)> = doc["paths"]
            .as_object()
            .expect("paths")
            .iter()
            .flat_map(|(path, item)| {
                item.as_object()
                    .expect("path item")
                    .keys()
                    .filter(|k| ["get", "post", "put", "delete", "patch"].contains(&k.as_str()))
                    .map(|method| (method.to_uppercase(), path.clone()))
                    .collect::<Vec<_>>()
            })
            .collect();
        let mut served: BTreeSet<(String, String)> = ROUTES
            .iter()
            .map(|(m, p)| ((*m).to_owned(), (*p).to_owned()))
            .collect();
        served.insert(("GET".to_owned(), "/ui/".to_owned()));
        let missing: Vec<_> = served.difference(&documented).collect();
        let extra: Vec<_> = documented.difference(&served).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "served but not documented: {missing:?}; documented but not served: {extra:?}"
        );
    }
}
