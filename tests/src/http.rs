//! The one HTTP client the suites talk to a gateway with: JSON in, `(status, JSON)` out,
//! a panic that shows the body when an answer is not JSON (every answer of the API is,
//! errors included).

use std::time::Duration;

use serde_json::Value;

/// A client for one gateway at `base` (`http://host:port`).
#[derive(Debug, Clone)]
pub struct Api {
    pub client: reqwest::Client,
    pub base: String,
}

impl Api {
    pub fn new(base: &str) -> Api {
        Api {
            client: reqwest::Client::new(),
            base: base.trim_end_matches('/').to_owned(),
        }
    }

    /// A request to `path`, with `token` as its bearer token when given.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
    ) -> reqwest::RequestBuilder {
        let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
        let mut request = self.client.request(method, format!("{}{path}", self.base));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        request
    }

    /// Sends `request`; the status and the JSON body.
    pub async fn send(&self, request: reqwest::RequestBuilder) -> (u16, Value) {
        let response = request.send().await.expect("the gateway answers");
        let status = response.status().as_u16();
        let text = response.text().await.expect("a body");
        let body = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("status {status}: the body is not JSON ({e}): {text}"));
        (status, body)
    }

    pub async fn get(&self, path: &str, token: &str) -> (u16, Value) {
        self.send(self.request("GET", path, Some(token))).await
    }

    pub async fn post(&self, path: &str, token: &str, body: Value) -> (u16, Value) {
        self.send(self.request("POST", path, Some(token)).json(&body))
            .await
    }

    /// `POST /v1/runs` as `token`, which must answer 201; the answer.
    pub async fn start(&self, token: &str, body: Value) -> Value {
        let (status, answer) = self.post("/v1/runs", token, body).await;
        assert_eq!(status, 201, "start: {answer}");
        answer
    }

    /// `GET path` as bytes: the status, the content type and the body.
    pub async fn get_raw(&self, path: &str, token: &str) -> (u16, String, Vec<u8>) {
        let response = self
            .request("GET", path, Some(token))
            .send()
            .await
            .expect("the gateway answers");
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let body = response.bytes().await.expect("a body").to_vec();
        (status, content_type, body)
    }

    /// Polls `GET /v1/runs/{run_id}` as `token` until `done` holds for the run.
    pub async fn wait_run(
        &self,
        what: &str,
        run_id: &str,
        token: &str,
        within: Duration,
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        crate::wait_for(what, within, || async {
            let (status, run) = self.get(&format!("/v1/runs/{run_id}"), token).await;
            (status == 200 && done(&run)).then_some(run)
        })
        .await
    }
}

/// The `error.code` of an error answer (empty for any other body).
pub fn code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or_default()
}
