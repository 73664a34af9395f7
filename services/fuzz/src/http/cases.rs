//! The cases of a campaign: which route each aims at and what it does to the request.

use std::collections::BTreeSet;

use serde_json::{json, Map, Value};

use super::Route;
use crate::mutate::Rng;
use crate::values;

/// One request to send.
#[derive(Debug, Clone)]
pub struct Case {
    pub index: usize,
    /// The route aimed at (an index into the routes), none for an unknown path or a
    /// method the route does not take.
    pub route: Option<usize>,
    /// What the report counts it under: the route's label, `unknown route` or `wrong method`.
    pub label: String,
    pub method: String,
    /// Path and query, percent-encoded.
    pub path: String,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Option<Vec<u8>>,
    /// What was done to it, for a finding.
    pub mutation: String,
}

impl Case {
    /// What was sent, shortened: method, path, the mutation, headers and body sizes.
    pub fn summary(&self) -> String {
        let mut path = self.path.clone();
        if path.len() > 160 {
            path = format!("{}… ({} bytes)", cut(&path, 160), path.len());
        }
        let body = self.body.as_ref().map_or(0, Vec::len);
        let headers: Vec<String> = self
            .headers
            .iter()
            .map(|(name, value)| match value.len() {
                0..=40 => format!("{name}: {:?}", String::from_utf8_lossy(value)),
                n => format!("{name}: ({n} bytes)"),
            })
            .collect();
        format!(
            "{} {path} [{}] headers {} body {body} bytes",
            self.method,
            self.mutation,
            headers.join("; ")
        )
    }
}

fn cut(text: &str, max: usize) -> &str {
    let mut end = max.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Ids the cases aim at besides made-up ones, so that they get past 404 and 422 to the
/// handlers' deeper checks: published graphs (a start's `graph_id`) and existing runs (a
/// path's `run_id`). Cases that use them start, decide, fork and cancel real runs.
#[derive(Debug, Clone, Default)]
pub struct Aim {
    pub graph_ids: Vec<String>,
    pub run_ids: Vec<String>,
}

/// What the cases are drawn for: the document, its routes, the tokens the gateway
/// accepts (so that most cases get past authentication) and the ids to aim at.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    pub document: &'a Value,
    pub routes: &'a [Route],
    pub tokens: &'a [String],
    pub aim: &'a Aim,
}

/// `count` cases for `target` from `seed`: the same seed and target give the same cases.
pub fn cases(target: Target<'_>, seed: u64, count: usize) -> Vec<Case> {
    let mut rng = Rng(seed);
    let mut next_route = 0;
    let routes = target.routes;
    (0..count)
        .map(|index| {
            let kind = rng.below(20);
            if kind == 0 || routes.is_empty() {
                return unknown_route(index, target.tokens, &mut rng);
            }
            let at = next_route % routes.len();
            next_route += 1;
            if kind == 1 {
                let taken: Vec<&str> = routes
                    .iter()
                    .filter(|r| r.template == routes[at].template)
                    .map(|r| r.method.as_str())
                    .collect();
                wrong_method(index, target, &routes[at], &taken, &mut rng)
            } else {
                aimed(index, target, at, &mut rng)
            }
        })
        .collect()
}

fn unknown_route(index: usize, tokens: &[String], rng: &mut Rng) -> Case {
    let path = rng
        .pick(&[
            "/v1/nothing",
            "/v2/runs",
            "/v1/runs/x/y/z/w",
            "/v1//runs",
            "/v1/runs/x/fork/extra",
            "/%2e%2e/%2e%2e/etc/passwd",
            "/v1/runs/..%2f..%2fetc%2fpasswd/events",
            "/ui/../../etc/passwd",
            "/ui/nothing.js",
            "/metrics/x",
        ])
        .to_string();
    Case {
        index,
        route: None,
        label: "unknown route".into(),
        method: rng.pick(&["GET", "POST", "DELETE"]).to_string(),
        headers: vec![authorization(tokens, rng)],
        path,
        body: None,
        mutation: "unknown route".into(),
    }
}

/// A method the route's path does not take (`taken`: those it does): judged by the rules
/// alone, not the route's documentation.
fn wrong_method(
    index: usize,
    target: Target<'_>,
    route: &Route,
    taken: &[&str],
    rng: &mut Rng,
) -> Case {
    let method = rng.pick(&["PUT", "PATCH", "DELETE", "POST", "OPTIONS", "FOO"]);
    let method = if taken.contains(method) {
        "PATCH"
    } else {
        method
    };
    Case {
        index,
        route: None,
        label: "wrong method".into(),
        method: method.to_string(),
        path: fill(&route.template, target.aim, rng, false),
        headers: vec![authorization(target.tokens, rng)],
        body: None,
        mutation: format!("{method} on {}", route.label()),
    }
}

fn aimed(index: usize, target: Target<'_>, at: usize, rng: &mut Rng) -> Case {
    let (route, tokens) = (&target.routes[at], target.tokens);
    let mut mutations = Vec::new();
    let hostile_path = rng.chance(25);
    if hostile_path {
        mutations.push("path ids");
    }
    let mut path = fill(&route.template, target.aim, rng, hostile_path);
    if rng.chance(30) {
        mutations.push("query");
        path.push_str(&query(route, rng));
    }
    let mut headers = Vec::new();
    if rng.chance(75) || tokens.is_empty() {
        headers.push(authorization(tokens, rng));
    } else {
        mutations.push("authorization");
        if let Some(header) = hostile_authorization(rng) {
            headers.push(header);
        }
    }
    let body = match &route.body {
        Some(schema) => Some(body(target, schema, rng, &mut mutations)),
        None if rng.chance(10) => {
            mutations.push("unexpected body");
            Some(values::raw_body(rng))
        }
        None => None,
    };
    if body.is_some() {
        if rng.chance(85) {
            headers.push(("content-type".into(), b"application/json".to_vec()));
        } else {
            mutations.push("content-type");
            const GARBLED: &[&[u8]] = &[
                b"text/plain",
                b"application/xml",
                b"multipart/form-data; boundary=",
                b"application/json; charset=ebcdic",
                b"\xff\xfe",
            ];
            headers.push(("content-type".into(), rng.pick(GARBLED).to_vec()));
        }
    }
    for (percent, name, what) in [
        (20, "idempotency-key", "idempotency-key"),
        (10, "traceparent", "traceparent"),
        (10, "sortie-min-position", "min-position"),
        (5, "last-event-id", "last-event-id"),
        (5, "x-fuzz", "huge header"),
    ] {
        if rng.chance(percent) {
            mutations.push(what);
            headers.push((name.into(), header_value(rng)));
        }
    }
    if rng.chance(5) {
        mutations.push("accept event-stream");
        headers.push(("accept".into(), b"text/event-stream".to_vec()));
    }
    if mutations.is_empty() {
        mutations.push("well-formed");
    }
    Case {
        index,
        route: Some(at),
        label: route.label(),
        method: route.method.clone(),
        path,
        headers,
        body,
        mutation: mutations.join(", "),
    }
}

/// The template with its `{params}` filled: plain ids (an aimed-at run's for `{run_id}`,
/// often), or (`hostile`) ids nobody expects, percent-encoded as a client would send them.
fn fill(template: &str, aim: &Aim, rng: &mut Rng, hostile: bool) -> String {
    let mut out = String::new();
    let mut rest = template;
    // The run an aimed-at checkpoint id names.
    let mut run = None;
    while let Some(open) = rest.find('{') {
        let Some(close) = rest[open..].find('}') else {
            break;
        };
        out.push_str(&rest[..open]);
        let param = &rest[open + 1..open + close];
        let segment = if hostile {
            match rng.below(6) {
                0 => "r".repeat(*rng.pick(&[257, 4096, 20_000])),
                1 => "..".into(),
                2 => "%2e%2e%2f%2e%2e%2fetc".into(),
                3 => "%00".into(),
                4 => "%FF%FE".into(),
                _ => encode(&values::id(rng, "id")),
            }
        } else if param == "run_id" && !aim.run_ids.is_empty() && rng.chance(60) {
            let id = rng.pick(&aim.run_ids).clone();
            run = Some(id.clone());
            encode(&id)
        } else if let Some(run) = run.as_ref().filter(|_| param == "checkpoint_id") {
            encode(&format!("ckpt_{run}_{}", rng.below(6)))
        } else {
            format!("fuzz-{}", rng.below(1000))
        };
        out.push_str(if segment.is_empty() { "%20" } else { &segment });
        rest = &rest[open + close + 1..];
    }
    out.push_str(rest);
    out
}

fn query(route: &Route, rng: &mut Rng) -> String {
    let mut names: Vec<String> = route.query.clone();
    names.extend(["unknown".to_owned(), "limit".to_owned()]);
    let pairs: Vec<String> = (0..=rng.below(3))
        .map(|_| {
            let name = rng.pick(&names).clone();
            let value = rng
                .pick(&[
                    "-1",
                    "0",
                    "99999999999999999999999",
                    "garbage",
                    "p0:o-1",
                    "p99999:o1,p-1:o0",
                    "%00",
                    "%FF",
                    "key=value=more",
                    "",
                ])
                .to_string();
            let value = if rng.chance(20) {
                encode(&values::id(rng, "id"))
            } else {
                value
            };
            format!("{name}={value}")
        })
        .collect();
    format!("?{}", pairs.join("&"))
}

/// Percent-encodes everything but unreserved characters.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            b => format!("%{b:02X}"),
        })
        .collect()
}

fn authorization(tokens: &[String], rng: &mut Rng) -> (String, Vec<u8>) {
    let token = if tokens.is_empty() {
        "no-token".to_owned()
    } else {
        rng.pick(tokens).clone()
    };
    (
        "authorization".into(),
        format!("Bearer {token}").into_bytes(),
    )
}

/// Missing (`None`) or garbled.
fn hostile_authorization(rng: &mut Rng) -> Option<(String, Vec<u8>)> {
    let value: Vec<u8> = match rng.below(8) {
        0 => return None,
        1 => b"Bearer".to_vec(),
        2 => b"Bearer ".to_vec(),
        3 => b"Basic YWxpY2U6c2VjcmV0".to_vec(),
        4 => format!("Bearer {}", "t".repeat(*rng.pick(&[4096, 60_000]))).into_bytes(),
        5 => "Bearer tök-é👩".as_bytes().to_vec(),
        6 => b"Bearer eyJhbGciOiJub25lIn0.eyJ0ZW5hbnQiOiJ4In0.".to_vec(),
        _ => b"bearer  tok-bob  extra".to_vec(),
    };
    Some(("authorization".into(), value))
}

/// A header value a client can send (no control characters, which HTTP forbids) that the
/// gateway does not expect: huge, unicode, or a wrong shape.
fn header_value(rng: &mut Rng) -> Vec<u8> {
    match rng.below(6) {
        0 => "k".repeat(*rng.pick(&[201, 4096, 60_000])).into_bytes(),
        1 => "ключ-é-👩".as_bytes().to_vec(),
        2 => b"\xff\xfe\x80".to_vec(),
        3 => b"00-zzzz-yyyy-01".to_vec(),
        4 => b"p1:o2,,,p-3".to_vec(),
        _ => Vec::new(),
    }
}

/// A body for a route that takes `schema`: a sample of it with one field made hostile,
/// the wrong type, or no JSON at all.
fn body(target: Target<'_>, schema: &Value, rng: &mut Rng, mutations: &mut Vec<&str>) -> Vec<u8> {
    let document = target.document;
    let mut sample = sample(target, schema, rng, 0);
    match rng.below(10) {
        0 | 1 => mutations.push("body well-formed"),
        2..=6 => {
            mutations.push("body field hostile");
            let schema = resolve(document, schema);
            let mut fields: Vec<String> = schema["properties"]
                .as_object()
                .map(|p| p.keys().cloned().collect())
                .unwrap_or_default();
            fields.push("unknown_field".into());
            let field = rng.pick(&fields).clone();
            let hostile = values::value(rng);
            match &mut sample {
                Value::Object(map) => {
                    map.insert(field, hostile);
                }
                other => *other = hostile,
            }
        }
        7 => {
            mutations.push("body wrong type");
            sample = values::value(rng);
        }
        _ => {
            mutations.push("body not JSON");
            return values::raw_body(rng);
        }
    }
    serde_json::to_vec(&sample).unwrap_or_default()
}

fn resolve<'d>(document: &'d Value, schema: &'d Value) -> &'d Value {
    match schema["$ref"].as_str() {
        Some(reference) => reference
            .strip_prefix("#/")
            .map(|path| {
                path.split('/')
                    .fold(document, |at, step| at.get(step).unwrap_or(&Value::Null))
            })
            .unwrap_or(&Value::Null),
        None => schema,
    }
}

/// A value `schema` allows (roughly: its required fields, some optional ones; a
/// `graph_id` often an aimed-at graph).
fn sample(target: Target<'_>, schema: &Value, rng: &mut Rng, depth: usize) -> Value {
    let schema = resolve(target.document, schema);
    if let Some(options) = schema["enum"].as_array().filter(|o| !o.is_empty()) {
        return rng.pick(options).clone();
    }
    let kind = match &schema["type"] {
        Value::Array(kinds) => kinds.first().and_then(Value::as_str),
        kind => kind.as_str(),
    };
    match kind {
        Some("string") => json!(format!("fuzz-{}", rng.below(1000))),
        Some("integer") => json!(rng.below(5)),
        Some("number") => json!(1.5),
        Some("boolean") => json!(rng.chance(50)),
        Some("array") => json!([]),
        Some("null") => Value::Null,
        Some("object") if depth < 4 => {
            let required: BTreeSet<&str> = schema["required"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            let mut map = Map::new();
            let graphs = &target.aim.graph_ids;
            for (name, property) in schema["properties"].as_object().into_iter().flatten() {
                if !required.contains(name.as_str()) && !rng.chance(40) {
                    continue;
                }
                let value = match name.as_str() {
                    "graph_id" if !graphs.is_empty() && rng.chance(70) => json!(rng.pick(graphs)),
                    _ => sample(target, property, rng, depth + 1),
                };
                map.insert(name.clone(), value);
            }
            Value::Object(map)
        }
        _ => json!({"key": "value", "n": 1}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::{routes, test_document};

    #[test]
    fn a_seed_replays_its_cases_and_every_route_is_reached() {
        let doc = test_document();
        let routes = routes(&doc);
        let tokens = vec!["tok".to_owned()];
        let aim = Aim {
            graph_ids: vec!["three".into()],
            run_ids: vec!["run-1".into()],
        };
        let target = Target {
            document: &doc,
            routes: &routes,
            tokens: &tokens,
            aim: &aim,
        };
        let summaries = |seed| -> Vec<String> {
            cases(target, seed, 60)
                .iter()
                .map(|c| format!("{} {:?} {:?}", c.summary(), c.headers, c.body))
                .collect()
        };
        assert_eq!(summaries(7), summaries(7));
        assert_ne!(summaries(7), summaries(8));
        let drawn = cases(target, 7, 60);
        for route in &routes {
            assert!(
                drawn.iter().any(|c| c.label == route.label()),
                "{} is reached",
                route.label()
            );
        }
        assert!(drawn.iter().all(|c| !c.path.contains('{')), "params filled");
        let started: Vec<&Case> = drawn
            .iter()
            .filter(|c| c.label == "POST /v1/runs")
            .collect();
        assert!(started.iter().all(|c| c.body.is_some()));
        let aimed = |c: &Case| {
            c.path.contains("/run-1/")
                || c.body
                    .as_ref()
                    .is_some_and(|b| String::from_utf8_lossy(b).contains("\"three\""))
        };
        assert!(drawn.iter().any(aimed), "the aim is taken");
    }
}
