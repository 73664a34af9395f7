//! The gateway client of `sortie run`: a request with the bearer token, and an answer
//! that is not a success turned into an error naming its status, code and message.

use anyhow::{bail, Context as _};
use serde_json::Value;

pub(super) struct Client {
    pub(super) base: String,
    pub(super) token: Option<String>,
    pub(super) http: reqwest::Client,
}

impl Client {
    pub(super) fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let request = self
            .http
            .request(method, format!("{}{path}", self.base.trim_end_matches('/')));
        match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    pub(super) async fn send(&self, request: reqwest::RequestBuilder) -> anyhow::Result<Value> {
        let response = request
            .send()
            .await
            .with_context(|| format!("the gateway at {} did not answer", self.base))?;
        let status = response.status();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            let message = body["error"]["message"].as_str().unwrap_or("no message");
            let code = body["error"]["code"].as_str().unwrap_or("error");
            let open: Vec<&str> = body["error"]["open_interrupts"]
                .as_array()
                .map(|items| {
                    items
                        .iter()
                        .filter_map(|i| i["interrupt_id"].as_str())
                        .collect()
                })
                .unwrap_or_default();
            if !open.is_empty() {
                bail!(
                    "{status}: {code}: {message} (--interrupt {})",
                    open.join(" | ")
                );
            }
            bail!("{status}: {code}: {message}");
        }
        Ok(body)
    }
}
