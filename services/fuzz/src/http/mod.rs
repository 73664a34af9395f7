//! Hostile HTTP requests for every route of the gateway's OpenAPI document, and the runner
//! that sends them and judges each answer.
//!
//! A case aims at one route (round-robin over the document, so a campaign of at least as
//! many cases as routes reaches every one) or at none (an unknown path, a method the route
//! does not take), and mutates what it sends: the path's ids (huge, unicode,
//! percent-encoded, traversals), the query, the headers (Authorization missing, garbled or
//! huge; Idempotency-Key, Content-Type, traceparent and min-position garbled; a huge header
//! of its own) and the body (a sample of the route's schema with one field made hostile,
//! the wrong type, or no JSON at all). Each answer must be: below 500 but for a 503 or 504
//! the route documents; for every status from 400, a JSON body with `error.code`; and an
//! answer at all (a dropped connection, or none in time, is a finding).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use serde_json::Value;

mod cases;

pub use cases::{cases, Aim, Case, Target};

/// How long one answer may take: past the gateway's own bounded waits (the reducer's
/// answer, a read's min_position).
const ANSWER_WITHIN: Duration = Duration::from_secs(60);

/// One route of the document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// `GET`, `POST`, ...
    pub method: String,
    /// `/v1/runs/{run_id}`
    pub template: String,
    /// The request body's schema, when it takes one.
    pub body: Option<Value>,
    /// The query parameters it names.
    pub query: Vec<String>,
    /// Whether it asks for a bearer token.
    pub secured: bool,
    /// The statuses it documents.
    pub documented: BTreeSet<u16>,
}

impl Route {
    pub fn label(&self) -> String {
        format!("{} {}", self.method, self.template)
    }
}

/// Every route of an OpenAPI document, by template and method.
pub fn routes(document: &Value) -> Vec<Route> {
    let mut out = Vec::new();
    let Some(paths) = document["paths"].as_object() else {
        return out;
    };
    for (template, operations) in paths {
        let Some(operations) = operations.as_object() else {
            continue;
        };
        for (method, operation) in operations {
            let parameters = operation["parameters"].as_array();
            out.push(Route {
                method: method.to_uppercase(),
                template: template.clone(),
                body: operation["requestBody"]["content"]["application/json"]["schema"]
                    .as_object()
                    .map(|s| Value::Object(s.clone())),
                query: parameters
                    .into_iter()
                    .flatten()
                    .filter(|p| p["in"] == "query")
                    .filter_map(|p| p["name"].as_str().map(str::to_owned))
                    .collect(),
                secured: operation.get("security").is_some(),
                documented: operation["responses"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .filter_map(|(status, _)| status.parse().ok())
                    .collect(),
            });
        }
    }
    out.sort_by(|a, b| (&a.template, &a.method).cmp(&(&b.template, &b.method)));
    out
}

/// One broken rule: which case (replay it with the report's seed), what it aimed at and
/// what was sent, and what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Finding {
    pub case: usize,
    pub route: String,
    /// What was sent, shortened (method, path, the mutation).
    pub request: String,
    pub problem: String,
}

/// An HTTP campaign's outcome.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Report {
    pub seed: u64,
    pub cases: usize,
    /// route → status → answers; status 0 counts cases with no answer at all.
    pub by_route: BTreeMap<String, BTreeMap<u16, usize>>,
    pub findings: Vec<Finding>,
}

impl Report {
    pub fn new(seed: u64) -> Report {
        Report {
            seed,
            ..Report::default()
        }
    }

    /// Counts one answer (`0`: none).
    pub fn count(&mut self, route: &str, status: u16) {
        self.cases += 1;
        *self
            .by_route
            .entry(route.to_owned())
            .or_default()
            .entry(status)
            .or_default() += 1;
    }

    pub fn find(&mut self, finding: Finding) {
        self.findings.push(finding);
    }

    /// No finding.
    pub fn is_clean(&self) -> bool {
        self.findings.is_empty()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "seed {}: {} cases, {} findings",
            self.seed,
            self.cases,
            self.findings.len()
        )?;
        for (route, statuses) in &self.by_route {
            let counts: Vec<String> = statuses
                .iter()
                .map(|(status, n)| match status {
                    0 => format!("no answer ×{n}"),
                    status => format!("{status} ×{n}"),
                })
                .collect();
            writeln!(f, "  {route}: {}", counts.join(", "))?;
        }
        for finding in &self.findings {
            writeln!(
                f,
                "  case {} ({}): {}\n    sent: {}",
                finding.case, finding.route, finding.problem, finding.request
            )?;
        }
        Ok(())
    }
}

/// What came back for one case.
#[derive(Debug)]
enum Outcome {
    Answered {
        status: u16,
        body: Option<Vec<u8>>,
    },
    /// No answer at all: the connection dropped, or nothing came in time.
    Dropped(String),
}

async fn send(client: &reqwest::Client, base: &str, case: &Case) -> Outcome {
    let Ok(method) = reqwest::Method::from_bytes(case.method.as_bytes()) else {
        return Outcome::Dropped(format!("the method {} cannot be sent", case.method));
    };
    let mut request = client.request(method, format!("{base}{}", case.path));
    for (name, value) in &case.headers {
        let (Ok(name), Ok(value)) = (
            reqwest::header::HeaderName::from_bytes(name.as_bytes()),
            reqwest::header::HeaderValue::from_bytes(value),
        ) else {
            continue;
        };
        request = request.header(name, value);
    }
    if let Some(body) = &case.body {
        request = request.body(body.clone());
    }
    let response = match request.send().await {
        Ok(response) => response,
        Err(error) => return Outcome::Dropped(describe(&error)),
    };
    let status = response.status().as_u16();
    let streaming = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    if case.method == "HEAD" || (streaming && status < 400) {
        // A live stream is judged by its head; a HEAD answer has no body.
        return Outcome::Answered { status, body: None };
    }
    match response.bytes().await {
        Ok(bytes) => Outcome::Answered {
            status,
            body: Some(bytes.to_vec()),
        },
        Err(error) => Outcome::Dropped(format!(
            "the body of a {status} broke off: {}",
            describe(&error)
        )),
    }
}

/// An error with its causes (reqwest's own message rarely says what happened).
fn describe(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// What is wrong with `outcome` as an answer to a case aimed at `route`, if anything.
fn judge(route: Option<&Route>, outcome: &Outcome) -> Option<String> {
    let (status, body) = match outcome {
        Outcome::Dropped(why) => return Some(format!("no answer: {why}")),
        Outcome::Answered { status, body } => (*status, body),
    };
    let documented = route.is_some_and(|r| r.documented.contains(&status));
    if status >= 500 && !(matches!(status, 503 | 504) && documented) {
        return Some(format!(
            "answered {status}{}",
            if documented { " (documented)" } else { "" }
        ));
    }
    if status >= 400 {
        let Some(body) = body else {
            return None;
        };
        let code = serde_json::from_slice::<Value>(body)
            .ok()
            .and_then(|v| v["error"]["code"].as_str().map(str::to_owned));
        if code.is_none() {
            let shown = String::from_utf8_lossy(&body[..body.len().min(120)]).into_owned();
            return Some(format!(
                "answered {status} without a JSON error body with error.code: {shown:?}"
            ));
        }
    }
    None
}

/// Sends `cases` hostile requests, drawn from `seed`, to the gateway at `base_url` (the
/// routes are those of its `/openapi.json`; `tokens` are bearer tokens it accepts, so that
/// most cases get past authentication), and judges every answer.
pub async fn run_http(base_url: &str, tokens: &[String], seed: u64, cases: usize) -> Report {
    run_http_aimed(base_url, tokens, &Aim::default(), seed, cases).await
}

/// [`run_http`] aiming at the graphs and runs `aim` names too.
pub async fn run_http_aimed(
    base_url: &str,
    tokens: &[String],
    aim: &Aim,
    seed: u64,
    cases: usize,
) -> Report {
    let mut report = Report::new(seed);
    let base = base_url.trim_end_matches('/');
    let client = match reqwest::Client::builder().timeout(ANSWER_WITHIN).build() {
        Ok(client) => client,
        Err(error) => {
            report.find(Finding {
                case: 0,
                route: "client".into(),
                request: String::new(),
                problem: format!("no HTTP client: {}", describe(&error)),
            });
            return report;
        }
    };
    let document = match fetch_document(&client, base).await {
        Ok(document) => document,
        Err(problem) => {
            report.find(Finding {
                case: 0,
                route: "GET /openapi.json".into(),
                request: format!("GET {base}/openapi.json"),
                problem,
            });
            return report;
        }
    };
    let routes = routes(&document);
    let target = Target {
        document: &document,
        routes: &routes,
        tokens,
        aim,
    };
    for case in self::cases(target, seed, cases) {
        let route = case.route.map(|at| &routes[at]);
        let outcome = send(&client, base, &case).await;
        let status = match &outcome {
            Outcome::Answered { status, .. } => *status,
            Outcome::Dropped(_) => 0,
        };
        report.count(&case.label, status);
        if let Some(problem) = judge(route, &outcome) {
            report.find(Finding {
                case: case.index,
                route: case.label.clone(),
                request: case.summary(),
                problem,
            });
        }
    }
    report
}

/// The gateway's OpenAPI document.
pub async fn fetch_document(client: &reqwest::Client, base: &str) -> Result<Value, String> {
    let response = client
        .get(format!("{base}/openapi.json"))
        .send()
        .await
        .map_err(|e| format!("the document could not be fetched: {}", describe(&e)))?;
    if !response.status().is_success() {
        return Err(format!("the document answered {}", response.status()));
    }
    response
        .json()
        .await
        .map_err(|e| format!("the document is not JSON: {}", describe(&e)))
}

/// A small OpenAPI document of the gateway's shape, for the unit tests of this module
/// and of `cases`.
#[cfg(test)]
pub(crate) fn test_document() -> Value {
    serde_json::json!({
        "components": {"schemas": {"Start": {
            "type": "object",
            "required": ["graph_id"],
            "properties": {"graph_id": {"type": "string"}, "input": {}, "decision": {"enum": ["approve", "reject"]}}
        }}},
        "paths": {
            "/v1/runs": {
                "post": {
                    "security": [{"bearer": []}],
                    "requestBody": {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Start"}}}},
                    "responses": {"201": {}, "400": {}, "504": {}}
                },
                "get": {"parameters": [{"name": "limit", "in": "query"}], "responses": {"200": {}}}
            },
            "/v1/runs/{run_id}/events": {"get": {"responses": {"200": {}}}},
            "/healthz": {"get": {"responses": {"200": {}}}}
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_come_from_the_document() {
        let routes = routes(&test_document());
        let labels: Vec<String> = routes.iter().map(Route::label).collect();
        assert_eq!(
            labels,
            [
                "GET /healthz",
                "GET /v1/runs",
                "POST /v1/runs",
                "GET /v1/runs/{run_id}/events"
            ]
        );
        assert_eq!(routes[1].query, ["limit"]);
        assert!(routes[2].secured && routes[2].body.is_some());
        assert_eq!(routes[2].documented, BTreeSet::from([201, 400, 504]));
    }

    #[test]
    fn answers_are_judged_by_the_rules() {
        let routes = routes(&test_document());
        let start = routes.iter().find(|r| r.label() == "POST /v1/runs");
        let answered = |status: u16, body: &str| Outcome::Answered {
            status,
            body: Some(body.as_bytes().to_vec()),
        };
        let error = r#"{"error": {"code": "bad_json", "message": "no"}}"#;
        assert_eq!(judge(start, &answered(400, error)), None);
        assert_eq!(judge(start, &answered(201, "{}")), None);
        assert_eq!(judge(start, &answered(504, error)), None, "documented");
        assert!(
            judge(start, &answered(503, error)).is_some(),
            "undocumented"
        );
        assert!(judge(start, &answered(500, error)).is_some());
        assert!(judge(None, &answered(504, error)).is_some());
        assert!(judge(start, &answered(404, "not found")).is_some());
        assert!(judge(start, &answered(422, r#"{"error": {}}"#)).is_some());
        assert_eq!(
            judge(
                start,
                &Outcome::Answered {
                    status: 401,
                    body: None
                }
            ),
            None,
            "a HEAD answer has no body"
        );
        assert!(judge(start, &Outcome::Dropped("reset".into())).is_some());
    }
}
