//! The gateway's configuration: its static bearer tokens (only their SHA-256 hashes are
//! held), where JWTs are checked, budgets and limits.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sortie_core::budget::{Budget, Limits, Price};
use sortie_kafka::KafkaConfig;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read the tokens file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the tokens file {path} is not valid: {source}")]
    Parse {
        path: PathBuf,
        source: serde_yaml::Error,
    },
    #[error("a token must be TENANT:PRINCIPAL:ROLE1,ROLE2:TOKEN; {0}")]
    DevToken(String),
    #[error("token entry for {principal}: {problem}")]
    Invalid { principal: String, problem: String },
    #[error("budgets: {problem}")]
    Budgets { problem: String },
}

/// How a gateway runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    pub kafka: KafkaConfig,
    pub registry_url: String,
    /// Register Sortie's schemas when missing (dev, tests).
    #[serde(default = "yes")]
    pub auto_register: bool,
    /// Topic name prefix (`sortie.`).
    #[serde(default = "default_prefix")]
    pub prefix: String,
    /// The view's sled store (a cache of the Kafka topics; deleting it costs a catch-up).
    pub data_dir: PathBuf,
    /// Dev tokens (fixed for the process's life).
    #[serde(default)]
    pub tokens: Vec<TokenEntry>,
    /// A YAML file of hashed tokens ([`TokensFile`]), re-read when its content changes.
    #[serde(default)]
    pub tokens_file: Option<PathBuf>,
    /// JWT bearer tokens, verified against a JWKS (off when absent).
    #[serde(default)]
    pub jwt: Option<JwtConfig>,
    /// How often the tokens file and a JWKS file are checked for changes (SIGHUP: at once).
    #[serde(default = "default_auth_reload", with = "millis")]
    pub auth_reload_interval: Duration,
    /// How long a write waits for the reducer's answer before 504.
    #[serde(default = "default_answer_timeout", with = "millis")]
    pub answer_timeout: Duration,
    /// How long a read with `min_position` waits for the view before 504.
    #[serde(default = "default_answer_timeout", with = "millis")]
    pub read_wait_timeout: Duration,
    /// Largest request body accepted (413 above).
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    /// How fast one tenant may start runs (and forks) through this gateway; past it a
    /// start is answered 429 `start_rate_exceeded` with `Retry-After`. `None`: unbounded.
    #[serde(default)]
    pub start_rate: Option<crate::admission::StartRate>,
    /// Live event streams (`/events/stream`) one tenant may hold open at once; one more
    /// is refused 429 `too_many_streams` until a stream closes.
    #[serde(default = "default_max_streams")]
    pub max_streams_per_tenant: usize,
    /// Connections held at once; one more is closed as it is accepted.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Connections held at once from one source address (an IPv6 client's /64); one
    /// more from it is closed as it is accepted.
    #[serde(default = "default_max_connections_per_address")]
    pub max_connections_per_address: usize,
    /// How long a client may take to send a request's headers before its connection is
    /// closed (slow or silent sockets).
    #[serde(default = "default_header_read_timeout", with = "millis")]
    pub header_read_timeout: Duration,
    /// How long after its headers a request's body may take to arrive; past it the
    /// request is answered 408 `body_timeout` and its connection closed.
    #[serde(default = "default_body_read_timeout", with = "millis")]
    pub body_read_timeout: Duration,
    /// Die on purpose at this point (crash tests only; never set by default).
    #[serde(default)]
    pub fault: Option<crate::fault::FaultPoint>,
    /// Spend budgets: tenants' default limits and the price table runs are started with.
    #[serde(default)]
    pub budgets: Budgets,
    /// The key file every published command is signed with (a delegate key of the
    /// reducers' keyring: it signs for the principals its bearer tokens authenticate).
    #[serde(default)]
    pub signing_key: Option<PathBuf>,
    /// The keyring graph publications are checked against (the reducers'): with one, a
    /// graph whose signature does not hold is not served as published.
    #[serde(default)]
    pub keyring: Option<PathBuf>,
    /// Refuse unsigned graphs too (the reducers' `--require-signatures`).
    #[serde(default)]
    pub require_signatures: bool,
    /// Where a run's large input and large decision payloads are stored (by reference),
    /// and where `GET /v1/runs/{id}/blobs/{sha256}` reads. `None`: payloads stay inline.
    #[serde(default)]
    pub blobs: Option<sortie_blob::BlobConfig>,
    /// Run payload sealing (see `sortie_seal`): commands' payloads are sealed before they
    /// are published, the view opens what it reads, and `DELETE /v1/runs/{id}` destroys
    /// the run's data key. `None`: plaintext, and a delete forgets without shredding.
    #[serde(default)]
    pub seal: Option<sortie_seal::SealConfig>,
}

/// Spend budgets (a `budgets` file): the limits a run gets when its start names none (per
/// tenant, else `default`), the most a run of a tenant may have (`ceilings` per tenant,
/// else `ceiling`: a start asking for more is refused, a budget raise stops there) and the
/// USD price per 1k tokens of each model. The gateway resolves a run's budget when it
/// starts the run and the run records it (its ceiling too), so changing this file never
/// changes a run that already started.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budgets {
    #[serde(default)]
    pub default: Limits,
    #[serde(default)]
    pub tenants: BTreeMap<String, Limits>,
    /// The most any run may have, for tenants without their own ceiling.
    #[serde(default)]
    pub ceiling: Limits,
    #[serde(default)]
    pub ceilings: BTreeMap<String, Limits>,
    #[serde(default)]
    pub prices: BTreeMap<String, Price>,
}

impl Budgets {
    /// Reads a budgets YAML file.
    pub fn load(path: &Path) -> Result<Budgets, Error> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Budgets {
            problem: format!("cannot read {}: {e}", path.display()),
        })?;
        serde_yaml::from_str(&text).map_err(|e| Error::Budgets {
            problem: format!("{}: {e}", path.display()),
        })
    }

    /// The budget a run of `tenant` starts with: the limits its start gives over the
    /// tenant's default (the default held to the ceiling), the price table and the
    /// ceiling. `Ok(None)` when there is none of them; `Err` names a limit the start asks
    /// past the tenant's ceiling.
    pub fn for_run(&self, tenant: &str, own: Option<&Limits>) -> Result<Option<Budget>, String> {
        let base = self.tenants.get(tenant).unwrap_or(&self.default);
        let ceiling = self.ceilings.get(tenant).unwrap_or(&self.ceiling);
        let limits = match own {
            Some(own) => base.capped_by(ceiling).overridden_by(own),
            None => base.capped_by(ceiling),
        };
        if let Some(over) = limits.over(ceiling) {
            return Err(format!("budget: {over} of tenant {tenant}"));
        }
        if limits.is_empty() && self.prices.is_empty() {
            return Ok(None);
        }
        Ok(Some(Budget {
            limits,
            prices: self.prices.clone(),
            ceiling: (!ceiling.is_empty()).then(|| ceiling.clone()),
        }))
    }
}

fn yes() -> bool {
    true
}

fn default_prefix() -> String {
    sortie_wire::Topics::DEFAULT_PREFIX.to_owned()
}

fn default_answer_timeout() -> Duration {
    Duration::from_secs(10)
}

fn default_max_body() -> usize {
    256 * 1024
}

fn default_max_connections() -> usize {
    4096
}

fn default_max_connections_per_address() -> usize {
    256
}

fn default_header_read_timeout() -> Duration {
    Duration::from_secs(10)
}

fn default_body_read_timeout() -> Duration {
    Duration::from_secs(10)
}

fn default_max_streams() -> usize {
    32
}

fn default_auth_reload() -> Duration {
    Duration::from_secs(2)
}

/// JWT bearer tokens: who issues them, for which audience, the keys that sign them, and
/// which claims name the tenant, principal, roles and groups.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JwtConfig {
    /// The `iss` a token must carry.
    pub issuer: String,
    /// A value the token's `aud` must hold.
    pub audience: String,
    pub jwks: JwksSource,
    #[serde(default)]
    pub claims: ClaimNames,
    /// Clock skew allowed on `exp` and `nbf`.
    #[serde(default = "default_leeway", with = "millis")]
    pub leeway: Duration,
    /// How often a JWKS URL is fetched again.
    #[serde(default = "default_jwks_refresh", with = "millis")]
    pub jwks_refresh: Duration,
    /// A token naming a key id the set lacks fetches a JWKS URL again, at most this often.
    #[serde(default = "default_unknown_kid_refetch", with = "millis")]
    pub unknown_kid_refetch: Duration,
}

impl JwtConfig {
    pub fn new(issuer: impl Into<String>, audience: impl Into<String>, jwks: JwksSource) -> Self {
        JwtConfig {
            issuer: issuer.into(),
            audience: audience.into(),
            jwks,
            claims: ClaimNames::default(),
            leeway: default_leeway(),
            jwks_refresh: default_jwks_refresh(),
            unknown_kid_refetch: default_unknown_kid_refetch(),
        }
    }
}

/// Where the JWKS (the issuer's public keys) comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JwksSource {
    /// A JSON file, re-read when its content changes.
    File(PathBuf),
    /// An `https://…/jwks.json` URL, fetched periodically and for unknown key ids.
    Url(String),
}

/// The claims a JWT's principal is read from. `roles` and `groups` may be arrays of
/// strings or one space-separated string.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClaimNames {
    pub tenant: String,
    pub principal: String,
    pub roles: String,
    pub groups: String,
}

impl Default for ClaimNames {
    fn default() -> Self {
        ClaimNames {
            tenant: "tenant".into(),
            principal: "sub".into(),
            roles: "roles".into(),
            groups: "groups".into(),
        }
    }
}

fn default_leeway() -> Duration {
    Duration::from_secs(30)
}

fn default_jwks_refresh() -> Duration {
    Duration::from_secs(300)
}

fn default_unknown_kid_refetch() -> Duration {
    Duration::from_secs(10)
}

mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_millis)
    }
}

impl GatewayConfig {
    pub fn new(kafka: KafkaConfig, registry_url: impl Into<String>, data_dir: PathBuf) -> Self {
        Self {
            kafka,
            registry_url: registry_url.into(),
            auto_register: true,
            prefix: default_prefix(),
            data_dir,
            tokens: Vec::new(),
            tokens_file: None,
            jwt: None,
            auth_reload_interval: default_auth_reload(),
            answer_timeout: default_answer_timeout(),
            read_wait_timeout: default_answer_timeout(),
            max_body_bytes: default_max_body(),
            max_streams_per_tenant: default_max_streams(),
            start_rate: None,
            max_connections: default_max_connections(),
            max_connections_per_address: default_max_connections_per_address(),
            header_read_timeout: default_header_read_timeout(),
            body_read_timeout: default_body_read_timeout(),
            fault: None,
            budgets: Budgets::default(),
            signing_key: None,
            keyring: None,
            require_signatures: false,
            blobs: None,
            seal: None,
        }
    }
}

/// One accepted bearer token: its SHA-256 (hex), and who presents it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenEntry {
    pub sha256: String,
    pub tenant: String,
    pub principal: String,
    #[serde(default)]
    pub roles: Vec<String>,
    /// Approver groups the principal belongs to: a gate with `approver_group` accepts
    /// decisions only from its members.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<String>,
}

/// The YAML file of hashed tokens: `tokens: [{sha256, tenant, roles, principal, groups}]`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokensFile {
    pub tokens: Vec<TokenEntry>,
}

/// Lowercase hex SHA-256 of a token, as configured.
pub fn token_hash(token: &str) -> String {
    sortie_core::blob::sha256_hex(token.as_bytes())
}

impl TokenEntry {
    /// A dev token `TENANT:PRINCIPAL:ROLE1,ROLE2,@GROUP:TOKEN`, hashed at once: entries of
    /// the role list starting `@` are groups. The principal may contain `:` (e.g.
    /// `user:alice`); the roles and the token may not.
    pub fn from_dev_spec(spec: &str) -> Result<Self, Error> {
        let mut tail = spec.rsplitn(3, ':');
        let (Some(token), Some(roles), Some(head)) = (tail.next(), tail.next(), tail.next()) else {
            return Err(Error::DevToken("too few fields".into()));
        };
        let Some((tenant, principal)) = head.split_once(':') else {
            return Err(Error::DevToken("no principal".into()));
        };
        let entry = TokenEntry {
            sha256: token_hash(token),
            tenant: tenant.to_owned(),
            principal: principal.to_owned(),
            roles: roles
                .split(',')
                .filter(|r| !r.is_empty() && !r.starts_with('@'))
                .map(str::to_owned)
                .collect(),
            groups: roles
                .split(',')
                .filter_map(|r| r.strip_prefix('@'))
                .filter(|g| !g.is_empty())
                .map(str::to_owned)
                .collect(),
        };
        if token.is_empty() {
            return Err(Error::DevToken("empty token".into()));
        }
        entry.check()?;
        Ok(entry)
    }

    fn check(&self) -> Result<(), Error> {
        let problem =
            if self.sha256.len() != 64 || !self.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                Some("sha256 must be 64 hex digits")
            } else if self.tenant.is_empty() {
                Some("tenant is empty")
            } else if self.principal.is_empty() {
                Some("principal is empty")
            } else {
                None
            };
        match problem {
            Some(problem) => Err(Error::Invalid {
                principal: self.principal.clone(),
                problem: problem.into(),
            }),
            None => Ok(()),
        }
    }
}

/// Reads a tokens file (YAML).
pub fn load_tokens(path: impl AsRef<Path>) -> Result<Vec<TokenEntry>, Error> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|source| Error::Read {
        path: path.to_owned(),
        source,
    })?;
    let file: TokensFile = serde_yaml::from_str(&text).map_err(|source| Error::Parse {
        path: path.to_owned(),
        source,
    })?;
    let mut tokens = file.tokens;
    for token in &mut tokens {
        token.sha256 = token.sha256.to_ascii_lowercase();
        token.check()?;
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runs_budget_is_its_own_limits_over_its_tenants_default_with_the_prices() {
        let budgets: Budgets = serde_yaml::from_str(
            "default: {tokens: 100}\ntenants:\n  acme: {tokens: 500, tool_calls: 3}\nprices:\n  m: {input_per_1k: 1.0, output_per_1k: 2.0}\n",
        )
        .expect("budgets");
        let acme = budgets
            .for_run("acme", None)
            .expect("within the ceiling")
            .expect("a budget");
        assert_eq!(
            (acme.limits.tokens, acme.limits.tool_calls),
            (Some(500), Some(3))
        );
        assert_eq!(acme.prices.len(), 1);
        let own = Limits {
            tokens: Some(7),
            ..Limits::default()
        };
        let other = budgets
            .for_run("other", Some(&own))
            .expect("within the ceiling")
            .expect("a budget");
        assert_eq!(
            (other.limits.tokens, other.limits.tool_calls),
            (Some(7), None)
        );
        assert_eq!(Budgets::default().for_run("acme", None), Ok(None));
        assert!(
            serde_yaml::from_str::<Budgets>("tokens: 5\n").is_err(),
            "unknown fields"
        );
    }

    /// Issue #57: a tenant's budget is a ceiling as well as a default. Seen red with the
    /// start's own limits taken as they are (the ceiling not consulted): the start asking
    /// 10^9 tokens got them.
    #[test]
    fn a_start_asks_no_more_than_its_tenants_ceiling() {
        let budgets: Budgets = serde_yaml::from_str(
            "default: {tokens: 100}\nceiling: {tokens: 1000}\nceilings:\n  acme: {tokens: 50, cost_usd: 2.0}\n",
        )
        .expect("budgets");
        let acme = budgets
            .for_run("acme", None)
            .expect("within the ceiling")
            .expect("a budget");
        assert_eq!(
            acme.limits.tokens,
            Some(50),
            "the default held to the ceiling"
        );
        assert_eq!(
            acme.limits.cost_usd,
            Some(2.0),
            "a limit the default lacks is the ceiling"
        );
        assert_eq!(acme.ceiling.as_ref().and_then(|c| c.tokens), Some(50));
        let greedy = Limits {
            tokens: Some(1_000_000_000),
            ..Limits::default()
        };
        let refused = budgets
            .for_run("other", Some(&greedy))
            .expect_err("over the ceiling");
        assert!(
            refused.contains("tokens 1000000000 is over the ceiling 1000"),
            "{refused}"
        );
        let modest = Limits {
            tokens: Some(700),
            ..Limits::default()
        };
        let other = budgets
            .for_run("other", Some(&modest))
            .expect("within the ceiling")
            .expect("a budget");
        assert_eq!(other.limits.tokens, Some(700));
    }

    #[test]
    fn dev_tokens_are_hashed_and_principals_may_hold_colons() {
        let entry = TokenEntry::from_dev_spec("acme:user:alice:approver,viewer:s3cret")
            .expect("valid spec");
        assert_eq!(entry.tenant, "acme");
        assert_eq!(entry.principal, "user:alice");
        assert_eq!(entry.roles, vec!["approver", "viewer"]);
        assert_eq!(entry.sha256, token_hash("s3cret"));
        assert!(!format!("{entry:?}").contains("s3cret"));
        let no_roles = TokenEntry::from_dev_spec("acme:bob::tok").expect("no roles");
        assert!(no_roles.roles.is_empty());
        assert!(no_roles.groups.is_empty());
        let member = TokenEntry::from_dev_spec("acme:user:carol:approver,@finance,@ops:tok")
            .expect("groups");
        assert_eq!(member.roles, vec!["approver"]);
        assert_eq!(member.groups, vec!["finance", "ops"]);
        assert!(TokenEntry::from_dev_spec("acme:tok").is_err());
        assert!(TokenEntry::from_dev_spec("acme:bob:r:").is_err());
    }

    #[test]
    fn tokens_files_hold_hashes_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tokens.yaml");
        let hash = token_hash("t");
        std::fs::write(
            &path,
            format!(
                "tokens:\n  - {{sha256: \"{}\", tenant: acme, principal: ops, roles: [operator]}}\n",
                hash.to_uppercase()
            ),
        )
        .expect("write");
        let tokens = load_tokens(&path).expect("load");
        assert_eq!(tokens[0].sha256, hash);
        std::fs::write(
            &path,
            "tokens:\n  - {sha256: abc, tenant: acme, principal: ops}\n",
        )
        .expect("write");
        assert!(load_tokens(&path).is_err());
        std::fs::write(
            &path,
            "tokens:\n  - {token: plain, tenant: acme, principal: ops}\n",
        )
        .expect("write");
        assert!(load_tokens(&path).is_err(), "plaintext tokens are refused");
    }
}
