//! JWT bearer tokens at a real `sortie gateway` process (on the real broker), next to the
//! static tokens: claims become the tenant, principal, roles and groups; forged, expired,
//! misdirected and `alg`-confused tokens are refused 401; the JWKS (file or URL) and the
//! tokens file reload without a restart, so keys rotate.
//!
//! Each guarantee was seen to fail once with the check broken on purpose, then restored:
//! skipping the audience check (`set_audience` removed, `validate_aud = false`) turns
//! `jwts_map_claims_to_the_caller_and_bad_ones_are_refused` red at "wrong audience";
//! skipping the expiry check (`validate_exp = false`) turns it red at "expired";
//! letting the token's header choose the algorithm (no check against the key's) turns it
//! red at "RS384 on an RS256 key";
//! a reload that ignores file changes turns
//! `a_jwks_file_and_the_tokens_file_reload_without_a_restart` red at its first wait;
//! no refetch for an unknown key id turns
//! `a_jwks_url_is_fetched_again_for_a_new_key_id_and_periodically` red at its first wait.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine;
use jsonwebtoken::jwk::{
    AlgorithmParameters, CommonParameters, EllipticCurve, Jwk, JwkSet, KeyAlgorithm,
    OctetKeyPairParameters, OctetKeyPairType,
};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{json, Value};
use sortie_tests::stack::{now_ms, succeed, Stack};
use sortie_tests::GATED;

const ISSUER: &str = "https://idp.test";
const AUDIENCE: &str = "sortie-api";
const LONG: Duration = Duration::from_secs(90);

/// A test signing key and its public JWK.
struct TestKey {
    kid: String,
    alg: Algorithm,
    encoding: EncodingKey,
    jwk: Jwk,
}

impl TestKey {
    /// An Ed25519 key from a fixed seed (test-only, like everything here).
    fn ed25519(kid: &str, seed: u8) -> TestKey {
        let seed = [seed; 32];
        // PKCS#8 v1 for Ed25519 is a fixed prefix and the 32-byte seed.
        let mut der = vec![
            0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22,
            0x04, 0x20,
        ];
        der.extend_from_slice(&seed);
        let public = ed25519_dalek::SigningKey::from_bytes(&seed)
            .verifying_key()
            .to_bytes();
        let jwk = Jwk {
            common: CommonParameters {
                key_id: Some(kid.to_owned()),
                key_algorithm: Some(KeyAlgorithm::EdDSA),
                ..CommonParameters::default()
            },
            algorithm: AlgorithmParameters::OctetKeyPair(OctetKeyPairParameters {
                key_type: OctetKeyPairType::OctetKeyPair,
                curve: EllipticCurve::Ed25519,
                x: URL_SAFE_NO_PAD.encode(public),
            }),
        };
        TestKey {
            kid: kid.to_owned(),
            alg: Algorithm::EdDSA,
            encoding: EncodingKey::from_ed_der(&der),
            jwk,
        }
    }

    /// The checked-in RSA (RS256) or P-256 (ES256) test key.
    fn fixture(kid: &str, file: &str, alg: Algorithm) -> TestKey {
        let path = sortie_tests::workspace_root()
            .join("tests/fixtures/jwt")
            .join(file);
        let pem = std::fs::read_to_string(&path).expect("test key");
        let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        let der = STANDARD.decode(body).expect("PEM body");
        let encoding = match alg {
            Algorithm::RS256 => EncodingKey::from_rsa_der(&der),
            _ => EncodingKey::from_ec_der(&der),
        };
        let mut jwk = Jwk::from_encoding_key(&encoding, alg).expect("public JWK");
        jwk.common.key_id = Some(kid.to_owned());
        TestKey {
            kid: kid.to_owned(),
            alg,
            encoding,
            jwk,
        }
    }

    fn sign(&self, claims: &Value) -> String {
        let mut header = Header::new(self.alg);
        header.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&header, claims, &self.encoding).expect("sign")
    }
}

fn jwks(keys: &[&TestKey]) -> Value {
    serde_json::to_value(JwkSet {
        keys: keys.iter().map(|k| k.jwk.clone()).collect(),
    })
    .expect("JWKS")
}

/// Claims that pass every check: tenant acme, `sub`, roles, an hour left.
fn claims(sub: &str, roles: Value) -> Value {
    let now = now_ms() / 1000;
    json!({
        "iss": ISSUER, "aud": [AUDIENCE, "other"], "sub": sub, "tenant": "acme",
        "roles": roles, "groups": ["finance"], "iat": now, "nbf": now - 5, "exp": now + 3600,
    })
}

fn with(mut claims: Value, key: &str, value: Value) -> Value {
    if value.is_null() {
        claims.as_object_mut().expect("object").remove(key);
    } else {
        claims[key] = value;
    }
    claims
}

/// An unsigned token with the given header (`alg: none` and friends).
fn raw_token(header: Value, claims: &Value, signature: &[u8]) -> String {
    let part = |v: &Value| URL_SAFE_NO_PAD.encode(serde_json::to_vec(v).expect("json"));
    format!(
        "{}.{}.{}",
        part(&header),
        part(claims),
        URL_SAFE_NO_PAD.encode(signature)
    )
}

async fn call(
    url: &str,
    method: &str,
    path: &str,
    token: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let client = reqwest::Client::new();
    let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
    let mut request = client
        .request(method, format!("{url}{path}"))
        .bearer_auth(token);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("the gateway answers");
    let status = response.status().as_u16();
    let text = response.text().await.expect("a body");
    let body = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("status {status}: the body is not JSON ({e}): {text}"));
    (status, body)
}

async fn me(url: &str, token: &str) -> (u16, Value) {
    call(url, "GET", "/v1/me", token, None).await
}

/// Asserts 401 `invalid_token` whose message holds `why`.
async fn refused(url: &str, token: &str, why: &str, case: &str) {
    let (status, body) = me(url, token).await;
    assert_eq!(status, 401, "{case}: {body}");
    assert_eq!(body["error"]["code"], "invalid_token", "{case}: {body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(why),
        "{case}: {message:?} should say {why:?}"
    );
}

fn write_json(path: &std::path::Path, value: &Value) {
    // Write then rename, so a poll never reads half a file.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(value).expect("json")).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

fn jwt_args<'a>(jwks_flag: &'a str, jwks: &'a str) -> Vec<&'a str> {
    vec![
        "--jwt-issuer",
        ISSUER,
        "--jwt-audience",
        AUDIENCE,
        jwks_flag,
        jwks,
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwts_map_claims_to_the_caller_and_bad_ones_are_refused() {
    let stack = Stack::start("gateway-jwt", &[GATED]).await;
    let _reducer = stack.reducer("0");
    let _executor = stack.executor("default", succeed);
    let ed = TestKey::ed25519("ed-1", 1);
    let rsa = TestKey::fixture("rsa-1", "rsa-test-key.pem", Algorithm::RS256);
    let ec = TestKey::fixture("ec-1", "es256-test-key.pem", Algorithm::ES256);
    let jwks_path = stack.dir.join("jwks.json");
    write_json(&jwks_path, &jwks(&[&ed, &rsa, &ec]));
    let path = jwks_path.to_str().expect("path");
    let (_gateway, url) = stack
        .gateway_process_with(
            &stack.dir.join("gateway"),
            &["acme:user:static:operator:tok-static"],
            &jwt_args("--jwks-file", path),
        )
        .await;

    // Claims become the caller; roles may be one space-separated string.
    let approver = ed.sign(&claims("user:ana", json!(["approver", "viewer"])));
    let (status, who) = me(&url, &approver).await;
    assert_eq!(status, 200, "{who}");
    assert_eq!(who["tenant"], "acme", "{who}");
    assert_eq!(who["principal"], "user:ana", "{who}");
    assert_eq!(who["roles"], json!(["approver", "viewer"]), "{who}");
    assert_eq!(who["groups"], json!(["finance"]), "{who}");
    let viewer = rsa.sign(&claims("user:vic", json!("viewer reader")));
    let (status, who) = me(&url, &viewer).await;
    assert_eq!(
        (status, &who["roles"]),
        (200, &json!(["viewer", "reader"])),
        "{who}"
    );
    let (status, who) = me(&url, &ec.sign(&claims("user:eli", json!([])))).await;
    assert_eq!(
        (status, &who["principal"]),
        (200, &json!("user:eli")),
        "ES256: {who}"
    );
    // Static tokens keep working next to JWTs.
    let (status, who) = me(&url, "tok-static").await;
    assert_eq!(
        (status, &who["principal"]),
        (200, &json!("user:static")),
        "{who}"
    );

    // A JWT's roles decide: the viewer starts a gated run but may not approve it.
    let (status, started) = call(
        &url,
        "POST",
        "/v1/runs",
        &viewer,
        Some(json!({"graph_id": "gated", "input": {"amount": 5}, "checkpoint_ns": "acme", "run_id": "jwt-run"})),
    )
    .await;
    assert_eq!(status, 201, "{started}");
    let run = sortie_tests::wait_for("the run to wait for approval", LONG, || async {
        let (status, run) = call(&url, "GET", "/v1/runs/jwt-run", &viewer, None).await;
        (status == 200 && run["status"] == "waiting_approval").then_some(run)
    })
    .await;
    let decision = json!({"decision": "approve", "interrupt_id": run["interrupt"]["interrupt_id"]});
    let (status, body) = call(
        &url,
        "POST",
        "/v1/runs/jwt-run/resume",
        &viewer,
        Some(decision.clone()),
    )
    .await;
    assert_eq!(status, 403, "a viewer's approval: {body}");
    let (status, body) = call(
        &url,
        "POST",
        "/v1/runs/jwt-run/resume",
        &approver,
        Some(decision),
    )
    .await;
    assert_eq!(status, 200, "the approver's approval: {body}");
    let (status, run) = call(&url, "GET", "/v1/runs/jwt-run", &approver, None).await;
    assert_eq!(status, 200, "{run}");

    // Refusals, each for its own reason.
    let now = now_ms() / 1000;
    let good = claims("user:ana", json!(["approver"]));
    let expired = with(
        with(good.clone(), "exp", json!(now - 120)),
        "iat",
        json!(now - 900),
    );
    refused(&url, &ed.sign(&expired), "expired", "expired").await;
    let early = with(good.clone(), "nbf", json!(now + 600));
    refused(&url, &ed.sign(&early), "not valid yet", "nbf in the future").await;
    let no_exp = with(good.clone(), "exp", Value::Null);
    refused(&url, &ed.sign(&no_exp), "`exp`", "no exp").await;
    let issuer = with(good.clone(), "iss", json!("https://evil.test"));
    refused(&url, &ed.sign(&issuer), "issuer", "wrong issuer").await;
    let audience = with(good.clone(), "aud", json!("someone-else"));
    refused(&url, &ed.sign(&audience), "audience", "wrong audience").await;
    let tenantless = with(good.clone(), "tenant", Value::Null);
    refused(&url, &ed.sign(&tenantless), "`tenant`", "no tenant").await;

    // Signed by a key outside the JWKS under a listed key id.
    let forger = TestKey::ed25519("ed-1", 66);
    refused(&url, &forger.sign(&good), "signature", "forged signature").await;
    // A listed key's token with its payload changed after signing.
    let genuine = ed.sign(&good);
    let mut parts: Vec<&str> = genuine.split('.').collect();
    let tampered_claims = URL_SAFE_NO_PAD
        .encode(serde_json::to_vec(&with(good.clone(), "tenant", json!("globex"))).expect("json"));
    parts[1] = &tampered_claims;
    refused(&url, &parts.join("."), "signature", "tampered payload").await;
    // alg none, with and without a key id.
    let none = raw_token(
        json!({"alg": "none", "typ": "JWT", "kid": "ed-1"}),
        &good,
        b"",
    );
    refused(&url, &none, "algorithm", "alg none").await;
    let none = raw_token(json!({"alg": "none", "typ": "JWT"}), &good, b"");
    refused(&url, &none, "algorithm", "alg none, no kid").await;
    // HS256 with a public key as the secret (alg confusion): the Ed25519 key's bytes and
    // the RSA modulus, i.e. what a confused verifier would use.
    let AlgorithmParameters::OctetKeyPair(okp) = &ed.jwk.algorithm else {
        panic!("an OKP key")
    };
    let AlgorithmParameters::RSA(rsa_params) = &rsa.jwk.algorithm else {
        panic!("an RSA key")
    };
    for (kid, public) in [("ed-1", &okp.x), ("rsa-1", &rsa_params.n)] {
        let secret = URL_SAFE_NO_PAD.decode(public).expect("b64");
        let mut header = Header::new(Algorithm::HS256);
        header.kid = Some(kid.to_owned());
        let hs =
            jsonwebtoken::encode(&header, &good, &EncodingKey::from_secret(&secret)).expect("sign");
        refused(&url, &hs, "HS256", "HS256 with a public key").await;
        let jwk_secret = serde_json::to_vec(&jwks(&[&ed, &rsa])).expect("json");
        let hs = jsonwebtoken::encode(&header, &good, &EncodingKey::from_secret(&jwk_secret))
            .expect("sign");
        refused(&url, &hs, "HS256", "HS256 with the JWKS").await;
    }
    // A listed key's token that claims another of its family's algorithms.
    let mut header = Header::new(Algorithm::RS384);
    header.kid = Some("rsa-1".into());
    let rs384 = jsonwebtoken::encode(&header, &good, &rsa.encoding).expect("sign");
    refused(&url, &rs384, "algorithm", "RS384 on an RS256 key").await;
    let stranger = TestKey::ed25519("ed-unknown", 7);
    refused(
        &url,
        &stranger.sign(&good),
        "not in the JWKS",
        "unknown kid",
    )
    .await;
    refused(&url, "not-a-token", "not known", "unknown static token").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jwks_file_and_the_tokens_file_reload_without_a_restart() {
    let stack = Stack::start("gateway-jwt-reload", &[]).await;
    let (old, new) = (TestKey::ed25519("old", 11), TestKey::ed25519("new", 12));
    let jwks_path = stack.dir.join("jwks.json");
    write_json(&jwks_path, &jwks(&[&old]));
    let tokens_path = stack.dir.join("tokens.yaml");
    let hashed = |token: &str, principal: &str| {
        format!(
            "  - {{sha256: {}, tenant: acme, principal: {principal}, roles: [viewer]}}\n",
            sortie_gateway::config::token_hash(token)
        )
    };
    std::fs::write(
        &tokens_path,
        format!("tokens:\n{}", hashed("tok-one", "one")),
    )
    .expect("write");
    let mut args = jwt_args("--jwks-file", jwks_path.to_str().expect("path"));
    args.extend([
        "--tokens-file",
        tokens_path.to_str().expect("path"),
        "--auth-reload-ms",
        "200",
    ]);
    let (gateway, url) = stack
        .gateway_process_with(&stack.dir.join("gateway"), &[], &args)
        .await;
    let (old_token, new_token) = (
        old.sign(&claims("user:a", json!([]))),
        new.sign(&claims("user:b", json!([]))),
    );
    assert_eq!(me(&url, &old_token).await.0, 200);
    refused(
        &url,
        &new_token,
        "not in the JWKS",
        "a key not yet published",
    )
    .await;

    // Rotation: the new key is published and the old one withdrawn.
    write_json(&jwks_path, &jwks(&[&new]));
    sortie_tests::wait_until("the new key to be accepted", LONG, || async {
        me(&url, &new_token).await.0 == 200
    })
    .await;
    refused(&url, &old_token, "not in the JWKS", "a withdrawn key").await;

    // A broken JWKS file is not loaded: the last good keys stay.
    std::fs::write(&jwks_path, "{not json").expect("write");
    sortie_tests::wait_until("the broken JWKS to be noticed", LONG, || {
        let log = gateway.log_text();
        async move { log.contains("The JWKS file was not reloaded") }
    })
    .await;
    assert_eq!(me(&url, &new_token).await.0, 200, "the last good keys stay");

    // The tokens file: a token is added, another removed.
    std::fs::write(
        &tokens_path,
        format!("tokens:\n{}", hashed("tok-two", "two")),
    )
    .expect("write");
    sortie_tests::wait_until("the added static token to be accepted", LONG, || async {
        me(&url, "tok-two").await.0 == 200
    })
    .await;
    refused(&url, "tok-one", "not known", "a removed static token").await;
    // A broken tokens file keeps the last good tokens.
    std::fs::write(
        &tokens_path,
        "tokens:\n  - {sha256: nope, tenant: acme, principal: x}\n",
    )
    .expect("write");
    sortie_tests::wait_until("the broken tokens file to be noticed", LONG, || {
        let log = gateway.log_text();
        async move { log.contains("The tokens file was not reloaded") }
    })
    .await;
    assert_eq!(
        me(&url, "tok-two").await.0,
        200,
        "the last good tokens stay"
    );
}

/// A JWKS served over HTTP by the test, counting its fetches.
struct JwksServer {
    url: String,
    keys: Arc<Mutex<Value>>,
    fetches: Arc<AtomicUsize>,
    _task: tokio::task::JoinHandle<()>,
}

impl JwksServer {
    async fn start(initial: Value) -> JwksServer {
        let keys = Arc::new(Mutex::new(initial));
        let fetches = Arc::new(AtomicUsize::new(0));
        let (served, counted) = (keys.clone(), fetches.clone());
        let app = axum::Router::new().route(
            "/jwks.json",
            axum::routing::get(move || {
                let (served, counted) = (served.clone(), counted.clone());
                async move {
                    counted.fetch_add(1, Ordering::SeqCst);
                    let body = served.lock().expect("keys").clone();
                    axum::Json(body)
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.expect("serve");
        });
        JwksServer {
            url: format!("http://{addr}/jwks.json"),
            keys,
            fetches,
            _task: task,
        }
    }

    fn publish(&self, keys: Value) {
        *self.keys.lock().expect("keys") = keys;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jwks_url_is_fetched_again_for_a_new_key_id_and_periodically() {
    let stack = Stack::start("gateway-jwt-url", &[]).await;
    let (k1, k2, k3) = (
        TestKey::ed25519("k1", 21),
        TestKey::ed25519("k2", 22),
        TestKey::ed25519("k3", 23),
    );
    let (t1, t2, t3) = (
        k1.sign(&claims("user:one", json!([]))),
        k2.sign(&claims("user:two", json!([]))),
        k3.sign(&claims("user:three", json!([]))),
    );

    // Gateway A never refreshes on its own: only an unknown key id fetches again.
    let server = JwksServer::start(jwks(&[&k1])).await;
    let mut args = jwt_args("--jwks-url", &server.url);
    args.extend([
        "--jwks-refresh-secs",
        "3600",
        "--jwks-refetch-min-ms",
        "500",
    ]);
    let (_a, url) = stack
        .gateway_process_with(&stack.dir.join("gateway-a"), &[], &args)
        .await;
    assert_eq!(me(&url, &t1).await.0, 200);
    server.publish(jwks(&[&k2]));
    sortie_tests::wait_until("the new key id to be fetched", LONG, || async {
        me(&url, &t2).await.0 == 200
    })
    .await;
    refused(&url, &t1, "not in the JWKS", "a key the refetch withdrew").await;
    // Made-up key ids do not hammer the provider: fetches are rate limited.
    let before = server.fetches.load(Ordering::SeqCst);
    let began = std::time::Instant::now();
    for n in 0..20 {
        let made_up = TestKey::ed25519(&format!("made-up-{n}"), 30);
        refused(
            &url,
            &made_up.sign(&claims("x", json!([]))),
            "not in the JWKS",
            "made up",
        )
        .await;
    }
    let fetched = server.fetches.load(Ordering::SeqCst) - before;
    let allowed = began.elapsed().as_millis() as usize / 500 + 1;
    assert!(
        fetched <= allowed,
        "20 unknown key ids fetched the JWKS {fetched} times (at most {allowed})"
    );

    // Gateway B refreshes every second and never refetches for a key id: a withdrawn key
    // is refused and a new one accepted by the periodic refresh alone.
    let server = JwksServer::start(jwks(&[&k1, &k2])).await;
    let mut args = jwt_args("--jwks-url", &server.url);
    args.extend([
        "--jwks-refresh-secs",
        "1",
        "--jwks-refetch-min-ms",
        "3600000",
        "--auth-reload-ms",
        "200",
    ]);
    let (_b, url) = stack
        .gateway_process_with(&stack.dir.join("gateway-b"), &[], &args)
        .await;
    assert_eq!(me(&url, &t2).await.0, 200);
    server.publish(jwks(&[&k1, &k3]));
    sortie_tests::wait_until("the withdrawn key to be refused", LONG, || async {
        me(&url, &t2).await.0 == 401
    })
    .await;
    sortie_tests::wait_until("the new key to be accepted", LONG, || async {
        me(&url, &t3).await.0 == 200
    })
    .await;
    assert_eq!(me(&url, &t1).await.0, 200, "a kept key stays");
}
