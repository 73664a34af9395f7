//! The gateway client of `sortie run`: a request with the bearer token, and an answer
//! that is not a success (or not the gateway's) turned into an error naming its status,
//! code and message, and the flag to fix when the cause is ours (`--gateway`, `--token`).

use anyhow::bail;
use serde_json::Value;

pub(super) struct Client {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

/// The gateway answered, but not with a success. Kept typed so `run wait` can tell a run
/// not in the view yet (404) from a refusal asking it again will not change (401, 403).
#[derive(Debug)]
pub(super) struct Refused {
    pub(super) status: reqwest::StatusCode,
    message: String,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Refused {}

impl Client {
    /// A client for `--gateway`, refused unless it is an http(s) URL, and `--token`,
    /// refused when empty (an unset variable in `--token $TOKEN`, `SORTIE_TOKEN=`).
    pub(super) fn new(base: String, token: Option<String>) -> anyhow::Result<Client> {
        match reqwest::Url::parse(&base) {
            Ok(url) if matches!(url.scheme(), "http" | "https") && url.has_host() => {}
            _ => bail!(
                "--gateway {base:?} is not the gateway's http(s) URL (like http://127.0.0.1:8080); set it with --gateway or SORTIE__GATEWAY__URL"
            ),
        }
        if token.as_deref().is_some_and(|t| t.trim().is_empty()) {
            bail!(
                "the token is empty: give the gateway's bearer token with --token or SORTIE_TOKEN (`sortie dev` keeps its own in target/dev/dev-token)"
            );
        }
        Ok(Client {
            base,
            token,
            http: reqwest::Client::new(),
        })
    }

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
        let response = request.send().await.map_err(|e| self.unreachable(e))?;
        let status = response.status();
        let text = response.text().await.map_err(|e| self.unreachable(e))?;
        if !status.is_success() {
            return Err(self.refused(status, &text));
        }
        if text.trim().is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_str(&text).map_err(|_| self.not_the_gateway(status, &text))
    }

    /// Nothing answered at `--gateway`: a transport error, with where to point it.
    pub(super) fn unreachable(&self, error: reqwest::Error) -> anyhow::Error {
        anyhow::Error::new(error).context(format!(
            "the gateway at {} did not answer; is it running? (set its URL with --gateway or SORTIE__GATEWAY__URL)",
            self.base
        ))
    }

    /// A non-success answer: the gateway's error code and message (and the open
    /// interrupts, when a decision must name one), or, if the body is not the gateway's
    /// JSON, what answered instead.
    pub(super) fn refused(&self, status: reqwest::StatusCode, text: &str) -> anyhow::Error {
        let Ok(body) = serde_json::from_str::<Value>(text) else {
            return self.not_the_gateway(status, text);
        };
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
        let mut message = if open.is_empty() {
            format!("{status}: {code}: {message}")
        } else {
            format!(
                "{status}: {code}: {message} (--interrupt {})",
                open.join(" | ")
            )
        };
        if status == reqwest::StatusCode::UNAUTHORIZED {
            message.push_str(match self.token {
                None => "; no token was given: pass --token or set SORTIE_TOKEN",
                Some(_) => "; the gateway does not take the token given (--token or SORTIE_TOKEN)",
            });
        }
        anyhow::Error::new(Refused { status, message })
    }

    /// Something answered at `--gateway`, but not with the gateway's JSON (a web page, a
    /// proxy's error, another service on that port).
    fn not_the_gateway(&self, status: reqwest::StatusCode, text: &str) -> anyhow::Error {
        let start: String = text.trim().chars().take(80).collect();
        let message = format!(
            "{status} from {} is not the gateway's JSON answer ({start:?}); is --gateway (or SORTIE__GATEWAY__URL) the gateway's base URL?",
            self.base
        );
        anyhow::Error::new(Refused { status, message })
    }
}
