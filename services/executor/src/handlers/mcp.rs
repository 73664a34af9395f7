//! `mcp`: calls one tool of an MCP server over Streamable HTTP (`sortie_mcp`, on the
//! official Rust SDK). The node's config names the server and the tool; the fold adds the
//! server's `url` and `auth` (the *name* of the environment variable that holds the
//! header's value) from the graph's `mcp_servers`, so the secret itself is read here, from
//! this executor's environment, and never travels in a record.
//!
//! The step's operation id goes to the server in the request's `_meta`
//! (`sortie/operation_id`, with `sortie/run_id` and `sortie/attempt`). Outcomes:
//!
//! | what happened | outcome |
//! |---|---|
//! | the server could not be reached, or the session not opened | retryable `mcp_unavailable` |
//! | HTTP 429 / 5xx, a JSON-RPC internal error, an expired session | retryable `mcp_busy` |
//! | HTTP 4xx, unknown tool, invalid arguments, a protocol it does not speak | permanent `mcp_refused` |
//! | the tool answered `isError: true` | permanent `tool_error` (its text) |
//! | sent, and no answer came (timeout, connection lost, a task) | unknown `mcp_no_answer` |
//! | the server's address is one the egress policy refuses ([`crate::egress`]) | permanent `egress_forbidden`, nothing sent |
//! | an answer over 1 MiB | `limit_exceeded`: permanent where a repeat is harmless (`pure`, `idempotent`, `keyed`: it would answer the same); unknown for `reconcilable` and `unsafe`, whose call happened (an operator records what it did) |

use serde::Deserialize;
use serde_json::Value;

use sortie_wire::records::SideEffectClass;

use super::{config, receiver_text};
use crate::egress::Clients;
use crate::handler::{Call, HandlerError, StepHandler};

/// What an `mcp` step's config holds when it reaches the executor.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpConfig {
    pub server: String,
    pub tool: String,
    pub url: String,
    #[serde(default)]
    pub auth: Option<sortie_core::mcp::McpAuth>,
}

/// The `mcp` handler.
#[derive(Debug, Clone)]
pub struct Mcp {
    clients: Clients,
}

impl Mcp {
    /// Held to the egress policy of `clients` (its HTTP clients themselves are not used:
    /// the MCP SDK runs over another version of reqwest, and a session gets a client of
    /// its own). Over unchecked clients, no policy.
    pub fn new(clients: impl Into<Clients>) -> Self {
        Self {
            clients: clients.into(),
        }
    }
}

impl StepHandler for Mcp {
    async fn call(&self, call: &Call) -> Result<Value, HandlerError> {
        let config: McpConfig = config("mcp", &call.config)?;
        // Before the secret is read: a refused server gets nothing.
        let policy = self.clients.policy(&call.tenant).cloned();
        if let Some(policy) = &policy {
            if let Ok(url) = reqwest::Url::parse(&config.url) {
                policy.check_url(&url).map_err(|r| r.to_handler_error())?;
            }
        }
        let endpoint = endpoint(&config, &call.tenant)?;
        let arguments = match &call.args {
            Value::Object(map) => map.clone(),
            Value::Null => serde_json::Map::new(),
            _ => {
                return Err(HandlerError::permanent(
                    "bad_args",
                    "an mcp step's arguments must be a JSON object",
                ))
            }
        };
        let request = sortie_mcp::ToolCall {
            tool: config.tool.clone(),
            arguments,
            operation_id: call.operation_id.clone(),
            run_id: call.run_id.clone(),
            attempt: call.attempt,
        };
        let outcome = match &policy {
            Some(policy) => {
                let (client, refused) = crate::egress::mcp_client(policy)?;
                sortie_mcp::call_tool_via(&endpoint, &request, call.timeout, client)
                    .await
                    .map_err(|e| {
                        crate::egress::refused_in(&refused)
                            .unwrap_or_else(|| handler_error(e, call.side_effect))
                    })?
            }
            None => sortie_mcp::call_tool(&endpoint, &request, call.timeout)
                .await
                .map_err(|e| handler_error(e, call.side_effect))?,
        };
        if outcome.is_error {
            let text = outcome.text();
            return Err(HandlerError::permanent(
                "tool_error",
                format!(
                    "tool {} of MCP server {} answered an error: {}",
                    config.tool,
                    config.server,
                    if text.is_empty() {
                        "(no text)".to_owned()
                    } else {
                        receiver_text(&text)
                    }
                ),
            ));
        }
        Ok(outcome.result)
    }
}

/// The server's endpoint, its auth header's value read from the tenant's secrets
/// ([`crate::secrets`]).
fn endpoint(config: &McpConfig, tenant: &str) -> Result<sortie_mcp::Endpoint, HandlerError> {
    let mut headers = Vec::new();
    if let Some(auth) = &config.auth {
        super::secret_allowed(tenant, &auth.env)?;
        let secret = crate::secrets::read(&auth.env).ok_or_else(|| {
            HandlerError::permanent(
                "bad_config",
                format!(
                    "MCP server {}: secret {} (its auth) is set neither in this executor's environment nor in its secrets directory",
                    config.server, auth.env
                ),
            )
        })?;
        let value = match &auth.scheme {
            Some(scheme) => format!("{scheme} {secret}"),
            None => secret,
        };
        headers.push((auth.header.clone(), value));
    }
    Ok(sortie_mcp::Endpoint {
        url: config.url.clone(),
        headers,
    })
}

/// A failure of the MCP client as the step's error. Its text may quote the server (a
/// JSON-RPC error's message, an unexpected answer): it is held to
/// [`super::MAX_RECEIVER_TEXT`] characters, its start and its end (where the cause is).
fn handler_error(error: sortie_mcp::Error, class: SideEffectClass) -> HandlerError {
    use sortie_mcp::Error as E;
    let error = match error {
        E::NotSent(m) => E::NotSent(ends(&m)),
        E::Refused(m) => E::Refused(ends(&m)),
        E::Busy {
            message,
            retry_after,
        } => E::Busy {
            message: ends(&message),
            retry_after,
        },
        E::Lost(m) => E::Lost(ends(&m)),
        E::TooLarge(m) => E::TooLarge(ends(&m)),
    };
    match error {
        E::NotSent(message) => HandlerError::retryable("mcp_unavailable", message),
        E::Busy {
            message,
            retry_after,
        } => HandlerError::Retryable {
            code: "mcp_busy".into(),
            message,
            retry_after,
        },
        E::Refused(message) => HandlerError::permanent("mcp_refused", message),
        E::Lost(message) => HandlerError::unknown("mcp_no_answer", message),
        E::TooLarge(message) => match class {
            SideEffectClass::Reconcilable | SideEffectClass::Unsafe => {
                HandlerError::unknown("limit_exceeded", message)
            }
            _ => HandlerError::permanent("limit_exceeded", message),
        },
    }
}

/// `text` whole, or its first and last characters with `…` between, at most
/// [`super::MAX_RECEIVER_TEXT`] characters in all.
fn ends(text: &str) -> String {
    let max = super::MAX_RECEIVER_TEXT;
    let count = text.chars().count();
    if count <= max {
        return text.to_owned();
    }
    let head = (max - 1) / 2;
    let tail = max - 1 - head;
    let mut kept: String = text.chars().take(head).collect();
    kept.push('…');
    kept.extend(text.chars().skip(count - tail));
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_by_what_the_server_can_have_done() {
        use sortie_mcp::Error as E;
        let cases = [
            (E::NotSent("x".into()), "mcp_unavailable", "retryable"),
            (
                E::Busy {
                    message: "x".into(),
                    retry_after: None,
                },
                "mcp_busy",
                "retryable",
            ),
            (E::Refused("x".into()), "mcp_refused", "permanent"),
            (E::Lost("x".into()), "mcp_no_answer", "unknown"),
            (E::TooLarge("x".into()), "limit_exceeded", "permanent"),
        ];
        for (error, code, kind) in cases {
            let mapped = handler_error(error, SideEffectClass::Keyed);
            assert_eq!(mapped.code(), code);
            let actual = if mapped.is_retryable() {
                "retryable"
            } else if mapped.is_unknown() {
                "unknown"
            } else {
                "permanent"
            };
            assert_eq!(actual, kind, "{code}");
        }
        // The call of an unsafe tool happened: an answer too large to keep is unknown.
        let mapped = handler_error(E::TooLarge("x".into()), SideEffectClass::Unsafe);
        assert!(mapped.is_unknown());
        // A server's text is bounded, its start and end kept.
        let long = format!("start {} end", "x".repeat(5000));
        let mapped = handler_error(E::Refused(long), SideEffectClass::Keyed);
        assert_eq!(
            mapped.message().chars().count(),
            crate::handlers::MAX_RECEIVER_TEXT
        );
        assert!(mapped.message().starts_with("start ") && mapped.message().ends_with(" end"));
    }

    #[test]
    fn a_missing_secret_is_a_permanent_bad_config_and_never_printed() {
        let config = McpConfig {
            server: "shop".into(),
            tool: "refund".into(),
            url: "http://127.0.0.1:1/mcp".into(),
            auth: Some(sortie_core::mcp::McpAuth {
                header: "Authorization".into(),
                env: "SORTIE_SECRET_acme__UNSET_MCP_SECRET".into(),
                scheme: Some("Bearer".into()),
            }),
        };
        let error = endpoint(&config, "acme").expect_err("unset");
        assert_eq!(error.code(), "bad_config");
        assert!(error
            .message()
            .contains("SORTIE_SECRET_acme__UNSET_MCP_SECRET"));
    }

    /// A secret not in the environment is read from the operator's secrets directory,
    /// the tenant's own file only (`crate::secrets`).
    #[test]
    fn a_secret_comes_from_the_tenants_file_in_the_secrets_directory() {
        let dir = std::env::temp_dir().join(format!("sortie-mcp-secrets-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("acme")).expect("dir");
        std::fs::write(dir.join("acme/SHOP_FILE_TOKEN"), "tok-from-file\n").expect("file");
        crate::secrets::set_dir(dir.clone());
        let config = McpConfig {
            server: "shop".into(),
            tool: "refund".into(),
            url: "http://127.0.0.1:1/mcp".into(),
            auth: Some(sortie_core::mcp::McpAuth {
                header: "Authorization".into(),
                env: "SORTIE_SECRET_acme__SHOP_FILE_TOKEN".into(),
                scheme: Some("Bearer".into()),
            }),
        };
        let endpoint = endpoint(&config, "acme").expect("read from the file");
        assert_eq!(
            endpoint.headers,
            [(
                "Authorization".to_owned(),
                "Bearer tok-from-file".to_owned()
            )]
        );
        // Another tenant naming it is refused before anything is read.
        let refused = super::endpoint(&config, "globex").expect_err("refused");
        assert_eq!(refused.code(), "secret_forbidden");
        std::fs::remove_dir_all(&dir).expect("cleaned");
    }

    /// A graph names only its own tenant's secrets: `HOME`, a cloud key or another
    /// tenant's token is refused before anything is read or sent. Seen red: with the
    /// check skipped, `HOME` was read and would have gone out as the bearer token.
    #[test]
    fn a_variable_outside_the_tenants_secrets_is_refused() {
        for (tenant, env) in [
            ("acme", "HOME"),
            ("acme", "AWS_SECRET_ACCESS_KEY"),
            ("acme", "SORTIE_SECRET_globex__SHOP_TOKEN"),
        ] {
            let config = McpConfig {
                server: "shop".into(),
                tool: "refund".into(),
                url: "http://127.0.0.1:1/mcp".into(),
                auth: Some(sortie_core::mcp::McpAuth {
                    header: "Authorization".into(),
                    env: env.into(),
                    scheme: Some("Bearer".into()),
                }),
            };
            let error = endpoint(&config, tenant).expect_err("refused");
            assert_eq!(error.code(), "secret_forbidden", "{env}");
            assert!(!error.is_retryable());
        }
    }
}
