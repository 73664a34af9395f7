//! Who is calling: a bearer token is a static token (a dev `--token` or an entry of the
//! hashed tokens file) or a JWT verified against a JWKS (file or URL). The tokens file and
//! the JWKS are reloaded without a restart: files when their content changes (polled) or
//! on SIGHUP, a URL periodically and when a token names a key id the set lacks (rate
//! limited). A reload that fails keeps the last good set.
//!
//! Invariants: a JWT's algorithm is decided by the key, never by the token (each JWK maps
//! to one asymmetric algorithm; `none` and HMAC are never accepted, so a public key can
//! never be used as an HMAC secret); a JWT is refused unless its `exp`, `iss` and `aud`
//! are present and right.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, KeyAlgorithm, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use crate::config::{load_tokens, token_hash, ClaimNames, GatewayConfig, JwksSource, JwtConfig};
use crate::config::{Error as ConfigError, TokenEntry};

/// Why the gateway's auth could not start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Tokens(#[from] ConfigError),
    #[error("the JWKS {source_name} is not usable: {problem}")]
    Jwks {
        source_name: String,
        problem: String,
    },
}

/// Who is calling, as a bearer token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub tenant: String,
    pub principal: String,
    pub roles: Vec<String>,
    /// Approver groups.
    pub groups: Vec<String>,
}

impl From<&TokenEntry> for Principal {
    fn from(entry: &TokenEntry) -> Self {
        Principal {
            tenant: entry.tenant.clone(),
            principal: entry.principal.clone(),
            roles: entry.roles.clone(),
            groups: entry.groups.clone(),
        }
    }
}

/// Why a bearer token was refused (the API answers 401 `invalid_token` with this text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused(pub String);

/// The asymmetric algorithms a JWK may name. HMAC (`HS*`) is absent on purpose: the
/// JWKS is public, so a key from it can never be a shared secret.
const ACCEPTED: &[Algorithm] = &[
    Algorithm::RS256,
    Algorithm::RS384,
    Algorithm::RS512,
    Algorithm::PS256,
    Algorithm::PS384,
    Algorithm::PS512,
    Algorithm::ES256,
    Algorithm::ES384,
    Algorithm::EdDSA,
];

/// The bearer tokens this gateway accepts, reloadable.
pub struct Auth {
    /// Dev tokens from the flags (`--token`): fixed for the process's life.
    dev: Vec<TokenEntry>,
    tokens_file: Option<PathBuf>,
    /// Dev tokens and the tokens file's entries by SHA-256.
    statics: RwLock<Arc<HashMap<String, TokenEntry>>>,
    /// The digest of the tokens file's content last read (loaded or refused).
    tokens_seen: Mutex<Option<[u8; 32]>>,
    jwt: Option<Jwt>,
    reload_interval: Duration,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("tokens_file", &self.tokens_file)
            .field("jwt", &self.jwt.as_ref().map(|j| &j.config))
            .finish_non_exhaustive()
    }
}

struct Jwt {
    config: JwtConfig,
    keys: RwLock<Arc<Vec<Key>>>,
    /// The digest of the JWKS file's content last read.
    file_seen: Mutex<Option<[u8; 32]>>,
    /// When the URL was last fetched and whether that worked; the lock also keeps
    /// fetches one at a time.
    fetched: tokio::sync::Mutex<Option<(Instant, bool)>>,
    client: reqwest::Client,
}

/// One verification key: a JWK with the single algorithm it may verify.
struct Key {
    kid: Option<String>,
    algorithm: Algorithm,
    key: DecodingKey,
}

impl Auth {
    /// Loads the static tokens and the JWKS. A tokens file or JWKS file that cannot be
    /// read is an error; a JWKS URL that does not answer is not (the gateway starts,
    /// refuses JWTs and fetches again), so a gateway never waits on its identity provider.
    pub async fn load(config: &GatewayConfig) -> Result<Auth, Error> {
        let jwt = config.jwt.clone().map(|config| Jwt {
            config,
            keys: RwLock::new(Arc::new(Vec::new())),
            file_seen: Mutex::new(None),
            fetched: tokio::sync::Mutex::new(None),
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .unwrap_or_default(),
        });
        let auth = Auth {
            dev: config.tokens.clone(),
            tokens_file: config.tokens_file.clone(),
            statics: RwLock::new(Arc::new(HashMap::new())),
            tokens_seen: Mutex::new(None),
            jwt,
            reload_interval: config.auth_reload_interval,
        };
        auth.reload_tokens(true)?;
        if let Some(jwt) = &auth.jwt {
            match &jwt.config.jwks {
                JwksSource::File(_) => jwt.reload_file(true)?,
                JwksSource::Url(_) => {
                    if let Err(error) = jwt.fetch(Duration::ZERO).await {
                        tracing::warn!(%error, "The JWKS URL did not answer; JWTs are refused until it does.");
                    }
                }
            }
        }
        Ok(auth)
    }

    /// Whether any token could be accepted.
    pub fn configured(&self) -> bool {
        !self.dev.is_empty() || self.tokens_file.is_some() || self.jwt.is_some()
    }

    /// Who `token` speaks for: a static token by its hash, else a JWT.
    pub async fn authenticate(&self, token: &str) -> Result<Principal, Refused> {
        let statics = read(&self.statics);
        if let Some(entry) = statics.get(&token_hash(token)) {
            return Ok(entry.into());
        }
        match &self.jwt {
            Some(jwt) if looks_like_jwt(token) => jwt.verify(token).await,
            _ => Err(Refused("the bearer token is not known".into())),
        }
    }

    /// Re-reads what changed: the tokens file and JWKS file when their content differs,
    /// the JWKS URL when `force` or its refresh interval has passed. Failures are logged
    /// and leave the last good sets in place.
    pub async fn reload(&self, force: bool) {
        if let Err(error) = self.reload_tokens(false) {
            tracing::warn!(%error, "The tokens file was not reloaded; the last good tokens stay.");
        }
        let Some(jwt) = &self.jwt else { return };
        match &jwt.config.jwks {
            JwksSource::File(_) => {
                if let Err(error) = jwt.reload_file(false) {
                    tracing::warn!(%error, "The JWKS file was not reloaded; the last good keys stay.");
                }
            }
            JwksSource::Url(_) => {
                let unless_within = if force {
                    Duration::ZERO
                } else {
                    jwt.config.jwks_refresh
                };
                if let Err(error) = jwt.fetch(unless_within).await {
                    tracing::warn!(%error, "The JWKS URL was not fetched; the last good keys stay.");
                }
            }
        }
    }

    /// Loads the tokens file when its content changed since the last read (always when
    /// `first`), and rebuilds the static set.
    fn reload_tokens(&self, first: bool) -> Result<(), Error> {
        let mut from_file = Vec::new();
        if let Some(path) = &self.tokens_file {
            let bytes = std::fs::read(path).map_err(|source| ConfigError::Read {
                path: path.clone(),
                source,
            })?;
            if !changed(&self.tokens_seen, &bytes) && !first {
                return Ok(());
            }
            from_file = load_tokens(path)?;
            tracing::info!(path = %path.display(), tokens = from_file.len(), "Loaded the tokens file.");
        } else if !first {
            return Ok(());
        }
        let set = self
            .dev
            .iter()
            .chain(&from_file)
            .map(|t| (t.sha256.to_ascii_lowercase(), t.clone()))
            .collect();
        *self.statics.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(set);
        Ok(())
    }
}

/// Reloads `auth` every reload interval and on SIGHUP until `stopped` turns true.
pub(crate) async fn watch(auth: Arc<Auth>, mut stopped: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(auth.reload_interval.max(Duration::from_millis(100)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    #[cfg(unix)]
    let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    loop {
        #[cfg(unix)]
        let hup = async {
            match hangup.as_mut() {
                Some(signal) => signal.recv().await,
                None => std::future::pending().await,
            }
        };
        #[cfg(not(unix))]
        let hup = std::future::pending::<Option<()>>();
        let force = tokio::select! {
            _ = tick.tick() => false,
            _ = hup => {
                tracing::info!("SIGHUP: reloading the tokens file and the JWKS.");
                true
            }
            _ = stopped.wait_for(|s| *s) => return,
        };
        auth.reload(force).await;
    }
}

impl Jwt {
    async fn verify(&self, token: &str) -> Result<Principal, Refused> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| {
            Refused(
                "the JWT's header is not valid or names an algorithm that is not accepted".into(),
            )
        })?;
        if !ACCEPTED.contains(&header.alg) {
            return Err(Refused(format!(
                "the JWT's algorithm {:?} is not accepted",
                header.alg
            )));
        }
        let mut keys = read(&self.keys);
        if let Some(kid) = &header.kid {
            if !keys.iter().any(|k| k.kid.as_ref() == Some(kid)) {
                // A key the set lacks may be a new one the provider just published.
                if matches!(self.config.jwks, JwksSource::Url(_)) {
                    self.refetch_for_kid(kid).await;
                    keys = read(&self.keys);
                }
                if !keys.iter().any(|k| k.kid.as_ref() == Some(kid)) {
                    return Err(Refused(format!(
                        "the JWT's key id {kid:?} is not in the JWKS"
                    )));
                }
            }
        }
        let candidates = keys
            .iter()
            .filter(|k| header.kid.is_none() || k.kid == header.kid);
        let mut refused = None;
        for key in candidates {
            if key.algorithm != header.alg {
                refused.get_or_insert(Refused(format!(
                    "the JWT's algorithm {:?} is not its key's ({:?})",
                    header.alg, key.algorithm
                )));
                continue;
            }
            let mut validation = Validation::new(key.algorithm);
            validation.set_issuer(&[&self.config.issuer]);
            validation.set_audience(&[&self.config.audience]);
            validation.set_required_spec_claims(&["exp", "iss", "aud"]);
            validation.validate_nbf = true;
            validation.leeway = self.config.leeway.as_secs();
            match jsonwebtoken::decode::<Map<String, Value>>(token, &key.key, &validation) {
                Ok(data) => return principal(&self.config.claims, &data.claims),
                // Without a key id every key is tried; another may be the signer.
                Err(e) if matches!(e.kind(), ErrorKind::InvalidSignature) => {
                    refused = Some(Refused("the JWT's signature does not verify".into()));
                }
                Err(e) => return Err(Refused(describe(e.kind()))),
            }
        }
        Err(refused.unwrap_or_else(|| Refused("no key of the JWKS can verify the JWT".into())))
    }

    /// Fetches the JWKS again for an unknown key id, unless it was fetched less than
    /// `unknown_kid_refetch` ago (made-up key ids must not hammer the provider).
    async fn refetch_for_kid(&self, kid: &str) {
        match self.fetch(self.config.unknown_kid_refetch).await {
            Ok(false) => {}
            Ok(true) => tracing::info!(
                kid,
                "A JWT named a key id the JWKS lacked: fetched the JWKS again."
            ),
            Err(error) => {
                tracing::warn!(%error, "The JWKS URL was not fetched; the last good keys stay.")
            }
        }
    }

    /// Fetches the JWKS URL and swaps the key set in, unless the last fetch is younger
    /// than `unless_within` (after a failed one, at most `unknown_kid_refetch`); whether
    /// it fetched.
    async fn fetch(&self, unless_within: Duration) -> Result<bool, Error> {
        let JwksSource::Url(url) = &self.config.jwks else {
            return Ok(false);
        };
        let mut fetched = self.fetched.lock().await;
        let first = fetched.is_none();
        if let Some((at, ok)) = *fetched {
            let window = if ok {
                unless_within
            } else {
                unless_within.min(self.config.unknown_kid_refetch)
            };
            if at.elapsed() < window {
                return Ok(false);
            }
        }
        let now = Instant::now();
        *fetched = Some((now, false));
        let problem = |problem: String| Error::Jwks {
            source_name: url.clone(),
            problem,
        };
        let response = self
            .client
            .get(url)
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| problem(e.to_string()))?;
        let bytes = response.bytes().await.map_err(|e| problem(e.to_string()))?;
        let keys = parse_jwks(&bytes).map_err(problem)?;
        self.install(keys, url, first);
        *fetched = Some((now, true));
        Ok(true)
    }

    /// Loads the JWKS file when its content changed since the last read (always when
    /// `first`).
    fn reload_file(&self, first: bool) -> Result<(), Error> {
        let JwksSource::File(path) = &self.config.jwks else {
            return Ok(());
        };
        let name = path.display().to_string();
        let problem = |problem: String| Error::Jwks {
            source_name: name.clone(),
            problem,
        };
        let bytes = std::fs::read(path).map_err(|e| problem(e.to_string()))?;
        if !changed(&self.file_seen, &bytes) && !first {
            return Ok(());
        }
        let keys = parse_jwks(&bytes).map_err(problem)?;
        self.install(keys, &name, first);
        Ok(())
    }

    fn install(&self, keys: Vec<Key>, from: &str, first: bool) {
        let kids: Vec<&str> = keys.iter().filter_map(|k| k.kid.as_deref()).collect();
        if first {
            tracing::info!(from, keys = keys.len(), ?kids, "Loaded the JWKS.");
        } else {
            tracing::info!(from, keys = keys.len(), ?kids, "Reloaded the JWKS.");
        }
        drop(kids);
        *self.keys.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(keys);
    }
}

/// The keys of a JWKS document that can verify signatures. Keys this gateway cannot use
/// (symmetric, encryption-only, unknown types or curves) are skipped with a warning; a
/// document that is not a JWKS at all is an error.
fn parse_jwks(bytes: &[u8]) -> Result<Vec<Key>, String> {
    #[derive(serde::Deserialize)]
    struct Document {
        keys: Vec<Value>,
    }
    let document: Document =
        serde_json::from_slice(bytes).map_err(|e| format!("not a JWKS document: {e}"))?;
    let mut keys = Vec::new();
    for value in document.keys {
        let kid = value.get("kid").and_then(Value::as_str).map(str::to_owned);
        match serde_json::from_value::<Jwk>(value)
            .map_err(|e| e.to_string())
            .and_then(|jwk| key(&jwk))
        {
            Ok(key) => keys.push(key),
            Err(problem) => tracing::warn!(?kid, %problem, "A JWKS key is skipped."),
        }
    }
    Ok(keys)
}

/// The verification key of `jwk` with the one algorithm it may verify: the JWK's own
/// `alg` when it names one (it must fit the key's type), else the key type's usual one.
fn key(jwk: &Jwk) -> Result<Key, String> {
    if jwk.common.public_key_use == Some(PublicKeyUse::Encryption) {
        return Err("an encryption key (use: enc)".into());
    }
    let family: &[Algorithm] = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => &ACCEPTED[..6],
        AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
            EllipticCurve::P256 => &[Algorithm::ES256],
            EllipticCurve::P384 => &[Algorithm::ES384],
            _ => return Err(format!("the curve {:?} is not supported", ec.curve)),
        },
        AlgorithmParameters::OctetKeyPair(okp) => match okp.curve {
            EllipticCurve::Ed25519 => &[Algorithm::EdDSA],
            _ => return Err(format!("the curve {:?} is not supported", okp.curve)),
        },
        AlgorithmParameters::OctetKey(_) => {
            return Err("a symmetric key (kty: oct) is never accepted".into())
        }
    };
    let algorithm = match jwk.common.key_algorithm {
        None => family[0],
        Some(alg) => {
            let named = key_algorithm(alg)
                .ok_or_else(|| format!("the algorithm {alg} is not a signature algorithm"))?;
            if !family.contains(&named) {
                return Err(format!("the algorithm {alg} does not fit the key's type"));
            }
            named
        }
    };
    let key = DecodingKey::from_jwk(jwk).map_err(|e| e.to_string())?;
    Ok(Key {
        kid: jwk.common.key_id.clone(),
        algorithm,
        key,
    })
}

fn key_algorithm(alg: KeyAlgorithm) -> Option<Algorithm> {
    ACCEPTED
        .iter()
        .copied()
        .find(|a| format!("{a:?}") == alg.to_string())
}

/// The principal a verified JWT's claims name.
fn principal(names: &ClaimNames, claims: &Map<String, Value>) -> Result<Principal, Refused> {
    let text = |name: &str| {
        claims
            .get(name)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .ok_or_else(|| {
                Refused(format!(
                    "the JWT has no `{name}` claim (a non-empty string)"
                ))
            })
    };
    Ok(Principal {
        tenant: text(&names.tenant)?,
        principal: text(&names.principal)?,
        roles: list(claims.get(&names.roles)),
        groups: list(claims.get(&names.groups)),
    })
}

/// A list claim: an array of strings or one space-separated string (OAuth's `scope`
/// style); anything else is empty.
fn list(value: Option<&Value>) -> Vec<String> {
    match value {
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect(),
        Some(Value::String(s)) => s.split_whitespace().map(str::to_owned).collect(),
        _ => Vec::new(),
    }
}

fn describe(kind: &ErrorKind) -> String {
    match kind {
        ErrorKind::ExpiredSignature => "the JWT has expired".into(),
        ErrorKind::ImmatureSignature => "the JWT is not valid yet (nbf)".into(),
        ErrorKind::InvalidIssuer => "the JWT's issuer is not trusted".into(),
        ErrorKind::InvalidAudience => "the JWT is not meant for this audience".into(),
        ErrorKind::InvalidSignature => "the JWT's signature does not verify".into(),
        ErrorKind::MissingRequiredClaim(claim) => format!("the JWT has no `{claim}` claim"),
        ErrorKind::InvalidAlgorithm => "the JWT's algorithm is not its key's".into(),
        other => format!("the JWT is not valid: {other:?}"),
    }
}

/// Three dot-separated parts, the first of them base64url JSON (`eyJ`).
fn looks_like_jwt(token: &str) -> bool {
    token.split('.').count() == 3 && token.starts_with("eyJ")
}

/// Whether `bytes` differ from the content last seen (and remembers them).
fn changed(seen: &Mutex<Option<[u8; 32]>>, bytes: &[u8]) -> bool {
    let digest: [u8; 32] = Sha256::digest(bytes).into();
    let mut seen = seen.lock().unwrap_or_else(PoisonError::into_inner);
    let changed = *seen != Some(digest);
    *seen = Some(digest);
    changed
}

fn read<T>(lock: &RwLock<Arc<T>>) -> Arc<T> {
    lock.read().unwrap_or_else(PoisonError::into_inner).clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const ED_X: &str = "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo";

    #[test]
    fn each_jwk_verifies_one_asymmetric_algorithm_and_symmetric_keys_are_skipped() {
        let document = json!({"keys": [
            {"kty": "OKP", "crv": "Ed25519", "x": ED_X, "kid": "ed"},
            {"kty": "OKP", "crv": "Ed25519", "x": ED_X, "kid": "ed-rs", "alg": "RS256"},
            {"kty": "OKP", "crv": "Ed25519", "x": ED_X, "kid": "enc", "use": "enc"},
            {"kty": "oct", "k": "c2VjcmV0", "kid": "hmac", "alg": "HS256"},
            {"kty": "weird", "kid": "unknown"},
        ]});
        let keys = parse_jwks(&serde_json::to_vec(&document).expect("json")).expect("a JWKS");
        let kept: Vec<_> = keys
            .iter()
            .map(|k| (k.kid.clone().unwrap_or_default(), k.algorithm))
            .collect();
        assert_eq!(kept, vec![("ed".to_owned(), Algorithm::EdDSA)]);
        assert!(parse_jwks(b"{\"not\": \"a jwks\"}").is_err());
    }

    #[test]
    fn claims_become_the_caller_and_the_tenant_is_required() {
        let names = ClaimNames::default();
        let claims = |v: Value| v.as_object().cloned().expect("object");
        let who = principal(
            &names,
            &claims(json!({"tenant": "acme", "sub": "u1", "roles": "a b", "groups": ["g"]})),
        )
        .expect("a caller");
        assert_eq!(who.roles, vec!["a", "b"]);
        assert_eq!(who.groups, vec!["g"]);
        assert!(principal(&names, &claims(json!({"sub": "u1"})))
            .is_err_and(|r| r.0.contains("`tenant`")));
        assert!(principal(&names, &claims(json!({"tenant": "", "sub": "u1"}))).is_err());
        assert!(principal(&names, &claims(json!({"tenant": 7, "sub": "u1"}))).is_err());
        assert!(looks_like_jwt("eyJa.b.c") && !looks_like_jwt("tok-alice"));
    }
}
