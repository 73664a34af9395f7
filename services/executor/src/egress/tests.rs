use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use sortie_wire::records::SideEffectClass;

use super::*;
use crate::handler::{Call, Lookup, StepHandler};
use crate::handlers::{Http, Llm, Mcp};

fn ip(text: &str) -> IpAddr {
    text.parse().expect("an address")
}

/// What the default policy says of `text`: `None` for allowed, else the range's words.
fn what(text: &str) -> Option<&'static str> {
    classify(ip(text)).map(|r| r.what)
}

#[test]
fn every_special_range_is_refused_and_public_addresses_are_not() {
    for (address, expected) in [
        ("0.0.0.0", "an unspecified (this network)"),
        ("0.1.2.3", "an unspecified (this network)"),
        ("10.255.255.1", "a private"),
        ("100.64.0.1", "a shared (carrier-grade NAT)"),
        ("100.127.255.255", "a shared (carrier-grade NAT)"),
        ("127.0.0.1", "a loopback"),
        ("127.255.0.9", "a loopback"),
        ("169.254.169.254", "a link-local (cloud metadata)"),
        ("172.16.0.1", "a private"),
        ("172.31.255.255", "a private"),
        ("192.0.0.8", "a reserved (IETF protocol assignments)"),
        ("192.0.2.1", "a documentation"),
        ("192.88.99.1", "a reserved (6to4 relay)"),
        ("192.168.1.1", "a private"),
        ("198.18.0.1", "a benchmarking"),
        ("198.19.255.255", "a benchmarking"),
        ("198.51.100.7", "a documentation"),
        ("203.0.113.9", "a documentation"),
        ("224.0.0.1", "a multicast"),
        ("239.255.255.250", "a multicast"),
        ("240.0.0.1", "a reserved"),
        ("255.255.255.255", "a broadcast"),
        ("::", "an unspecified"),
        ("::1", "a loopback"),
        ("::2", "a reserved (outside global unicast 2000::/3)"),
        (
            "::127.0.0.1",
            "a reserved (outside global unicast 2000::/3)",
        ),
        ("64:ff9b:1::1", "a private (local NAT64)"),
        ("100::1", "a reserved (discard-only)"),
        ("2001::1", "a reserved (Teredo)"),
        ("2001:2::1", "a benchmarking"),
        ("2001:10::1", "a reserved (ORCHID)"),
        ("2001:20::1", "a reserved (ORCHIDv2)"),
        ("2001:db8::1", "a documentation"),
        ("3fff::1", "a documentation"),
        ("5f00::1", "a reserved (SRv6)"),
        ("fc00::1", "a unique local (private)"),
        ("fd12:3456::1", "a unique local (private)"),
        ("fe80::1", "a link-local"),
        ("fec0::1", "a site-local (private)"),
        ("ff02::1", "a multicast"),
        ("4000::1", "a reserved (outside global unicast 2000::/3)"),
    ] {
        assert_eq!(what(address), Some(expected), "{address}");
    }
    for public in [
        "1.1.1.1",
        "8.8.8.8",
        "100.63.255.255",
        "100.128.0.0",
        "172.15.255.255",
        "172.32.0.0",
        "169.253.255.255",
        "192.0.1.1",
        "223.255.255.255",
        "2606:4700:4700::1111",
        "2a00:1450:4001::1",
        "2001:4860:4860::8888",
    ] {
        assert_eq!(what(public), None, "{public}");
    }
}

/// IPv6 forms that reach an IPv4 address are judged by that address: mapped, NAT64 and
/// 6to4.
#[test]
fn ipv4_inside_ipv6_is_judged_as_the_ipv4_it_carries() {
    assert_eq!(what("::ffff:127.0.0.1"), Some("a loopback"));
    assert_eq!(
        what("::ffff:169.254.169.254"),
        Some("a link-local (cloud metadata)")
    );
    assert_eq!(what("::ffff:10.0.0.1"), Some("a private"));
    assert_eq!(what("::ffff:8.8.8.8"), None);
    let nat64 = classify(ip("64:ff9b::a00:1")).expect("refused");
    assert_eq!(
        (nat64.what, nat64.inside),
        ("a private", Some("NAT64 64:ff9b::/96"))
    );
    assert_eq!(what("64:ff9b::808:808"), None);
    let six_to_four = classify(ip("2002:c0a8:0101::1")).expect("refused");
    assert_eq!(
        (six_to_four.what, six_to_four.inside),
        ("a private", Some("6to4 2002::/16"))
    );
    assert_eq!(what("2002:0808:0808::1"), None);
}

#[test]
fn rules_read_cidrs_addresses_and_host_names() {
    let mut egress = Egress::default();
    egress
        .allow("10.0.0.0/8")
        .and_then(|e| e.allow("192.168.1.7"))
        .and_then(|e| e.allow("[fd00::1]"))
        .and_then(|e| e.allow("Ledger.Internal."))
        .and_then(|e| e.allow("*.svc.cluster.local"))
        .expect("rules");
    let policy = egress.policy("acme");
    assert_eq!(policy.check_ip(ip("10.9.8.7")), Ok(()));
    assert_eq!(policy.check_ip(ip("::ffff:10.9.8.7")), Ok(()), "mapped");
    assert_eq!(policy.check_ip(ip("192.168.1.7")), Ok(()));
    assert!(policy.check_ip(ip("192.168.1.8")).is_err());
    assert_eq!(policy.check_ip(ip("fd00::1")), Ok(()));
    assert!(policy.allows_name("ledger.internal"));
    assert!(policy.allows_name("db.ns.svc.cluster.local"));
    assert!(!policy.allows_name("svc.cluster.local"), "only below it");
    assert!(!policy.allows_name("evilsvc.cluster.local"));
    for bad in ["", "10.0.0.0/33", "10.0.0/8", "a b", "http://x", "*."] {
        assert!(Egress::default().allow(bad).is_err(), "{bad:?}");
    }
    let mut egress = Egress::default();
    egress
        .allow_tenant_spec("acme=127.0.0.1")
        .expect("a tenant's rule");
    assert!(egress.allow_tenant_spec("127.0.0.1").is_err());
    assert!(egress.allow_tenant_spec("=127.0.0.1").is_err());
    assert_eq!(egress.policy("acme").check_ip(ip("127.0.0.1")), Ok(()));
    let refused = egress
        .policy("globex")
        .check_ip(ip("127.0.0.1"))
        .expect_err("another tenant");
    assert_eq!(
        refused.message(),
        "127.0.0.1 is a loopback address (127.0.0.0/8); executors do not call it unless an \
         operator allows it (--egress-allow, --egress-allow-tenant)"
    );
}

#[test]
fn literal_hosts_are_checked_in_every_spelling() {
    let policy = Egress::default().policy("acme");
    for url in [
        "http://127.0.0.1:8080/x",
        "http://[::1]/",
        "http://2130706433/",
        "http://0x7f.1/",
        "http://[::ffff:169.254.169.254]/latest/meta-data",
        "https://10.0.0.1/",
        "http://0.0.0.0:9/",
    ] {
        let url = reqwest::Url::parse(url).expect("a URL");
        assert!(policy.check_url(&url).is_err(), "{url}");
    }
    for url in [
        "https://api.openai.com/v1",
        "http://8.8.8.8/",
        "http://localhost/",
    ] {
        let url = reqwest::Url::parse(url).expect("a URL");
        assert_eq!(
            policy.check_url(&url),
            Ok(()),
            "{url}: a name is the resolver's"
        );
    }
}

/// The resolver keeps only what the policy allows: `localhost` resolves to loopback
/// only, so it is refused by default and kept with loopback (or the name) allowed.
#[tokio::test]
async fn the_resolver_drops_refused_addresses() {
    let error = Egress::default()
        .policy("acme")
        .resolve("localhost")
        .await
        .expect_err("refused");
    let refused = refusal(error.as_ref()).expect("a refusal");
    assert!(
        refused
            .message()
            .starts_with("localhost resolves to no allowed address: "),
        "{refused}"
    );
    assert!(
        refused.message().contains("a loopback address"),
        "{refused}"
    );

    let mut egress = Egress::default();
    egress.allow("127.0.0.0/8").expect("rule");
    let kept = egress
        .policy("acme")
        .resolve("localhost")
        .await
        .expect("allowed");
    assert!(!kept.is_empty());
    assert!(
        kept.iter()
            .all(|a| a.ip().is_ipv4() && a.ip().is_loopback()),
        "::1 is not allowed: {kept:?}"
    );

    let mut egress = Egress::default();
    egress.allow("localhost").expect("rule");
    assert!(egress.policy("acme").resolve("localhost").await.is_ok());
}

fn call(tool: &str, tenant: &str, config: Value) -> Call {
    Call {
        operation_id: "op-1".into(),
        attempt: 1,
        tenant: tenant.into(),
        run_id: "run-1".into(),
        step_id: "a#1".into(),
        node: "a".into(),
        tool: tool.into(),
        side_effect: SideEffectClass::Keyed,
        args: json!({"messages": [{"role": "user", "content": "hi"}]}),
        config,
        timeout: Duration::from_secs(5),
        progress: Default::default(),
    }
}

/// A receiver on `addr` ("127.0.0.1:0") that counts what reaches it and answers
/// `{"ok": true}`, or redirects to `redirect` when one is given.
async fn receiver(addr: &str, redirect: Option<String>) -> (String, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/x",
            post(
                |State((hits, redirect)): State<(Arc<AtomicUsize>, Option<String>)>| async move {
                    hits.fetch_add(1, Ordering::SeqCst);
                    match redirect {
                        Some(to) => Redirect::temporary(&to).into_response(),
                        None => axum::Json(json!({"ok": true})).into_response(),
                    }
                },
            ),
        )
        .route(
            "/status/{id}",
            get(
                |State((hits, _)): State<(Arc<AtomicUsize>, Option<String>)>| async move {
                    hits.fetch_add(1, Ordering::SeqCst);
                    StatusCode::NOT_FOUND
                },
            ),
        )
        .with_state((hits.clone(), redirect));
    let listener = tokio::net::TcpListener::bind(addr).await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), hits)
}

fn policed(rules: &[&str]) -> Clients {
    let mut egress = Egress::default();
    for rule in rules {
        egress.allow(rule).expect("rule");
    }
    Clients::new(&egress)
}

/// The guarantee: a graph's URL on a refused address is never called, however it is
/// spelled — as a literal (checked before sending) or as a name that resolves there
/// (checked by the resolver on the address connected to, so rebinding cannot get round
/// it) — and the step fails for good, `egress_forbidden`, naming the rule. The status
/// lookup is held to the same. Seen red: with the literal check in `Clients::for_url`
/// skipped, the receiver got the call and the step succeeded; with the resolver's filter
/// skipped, `localhost` was called.
#[tokio::test]
async fn a_refused_address_is_never_called_whatever_its_spelling() {
    let (base, hits) = receiver("127.0.0.1:0", None).await;
    let port = base.rsplit(':').next().expect("a port").to_owned();
    let http = Http::new(policed(&[]));
    for url in [
        format!("{base}/x"),
        format!("http://localhost:{port}/x"),
        format!("http://[::ffff:127.0.0.1]:{port}/x"),
    ] {
        let error = http
            .call(&call("http", "acme", json!({"url": url})))
            .await
            .expect_err("refused");
        assert_eq!(error.code(), CODE, "{url}: {error:?}");
        assert!(!error.is_retryable() && !error.is_unknown(), "{error:?}");
        assert!(error.message().contains("loopback"), "{error}");
    }
    let lookup = call(
        "http",
        "acme",
        json!({"url": format!("{base}/x"), "status_url": format!("http://localhost:{port}/status")}),
    );
    let error = http.lookup(&lookup).await.expect_err("refused");
    assert_eq!(error.code(), CODE, "{error:?}");
    assert_eq!(
        hits.load(Ordering::SeqCst),
        0,
        "nothing reached the receiver"
    );

    // The same receiver, allowed: called.
    let http = Http::new(policed(&["127.0.0.0/8"]));
    assert_eq!(
        http.call(&call(
            "http",
            "acme",
            json!({"url": format!("http://localhost:{port}/x")})
        ))
        .await,
        Ok(json!({"ok": true}))
    );
    assert_eq!(http.lookup(&lookup).await, Ok(Lookup::NotFound));
    assert_eq!(hits.load(Ordering::SeqCst), 2);
}

/// A redirect is followed only to an allowed address: the allowed receiver on
/// 127.0.0.1 redirecting to 127.0.0.2 (a literal, which no resolver sees) fails the
/// step `egress_forbidden`, and 127.0.0.2 is never called. Seen red: with the redirect
/// check skipped (reqwest's default policy), 127.0.0.2 was called and the step
/// succeeded.
#[tokio::test]
async fn a_redirect_to_a_refused_address_is_not_followed() {
    let (target, target_hits) = receiver("127.0.0.2:0", None).await;
    let (base, hits) = receiver("127.0.0.1:0", Some(format!("{target}/x"))).await;
    let error = Http::new(policed(&["127.0.0.1"]))
        .call(&call("http", "acme", json!({"url": format!("{base}/x")})))
        .await
        .expect_err("refused");
    assert_eq!(error.code(), CODE, "{error:?}");
    assert!(
        error
            .message()
            .starts_with("the receiver redirected: 127.0.0.2 is a loopback address"),
        "{error}"
    );
    assert_eq!(hits.load(Ordering::SeqCst), 1);
    assert_eq!(target_hits.load(Ordering::SeqCst), 0, "never called");

    // Both allowed: the redirect is followed, as before.
    let answer = Http::new(policed(&["127.0.0.0/8"]))
        .call(&call("http", "acme", json!({"url": format!("{base}/x")})))
        .await;
    assert_eq!(answer, Ok(json!({"ok": true})));
    assert_eq!(target_hits.load(Ordering::SeqCst), 1);
}

/// A tenant's allowance serves that tenant's steps only.
#[tokio::test]
async fn a_tenants_allowance_is_its_own() {
    let (base, hits) = receiver("127.0.0.1:0", None).await;
    let mut egress = Egress::default();
    egress
        .allow_tenant("acme", "127.0.0.1/32")
        .expect("a tenant's rule");
    let http = Http::new(Clients::new(&egress));
    let config = json!({"url": format!("{base}/x")});
    assert_eq!(
        http.call(&call("http", "acme", config.clone())).await,
        Ok(json!({"ok": true}))
    );
    let error = http
        .call(&call("http", "globex", config))
        .await
        .expect_err("refused");
    assert_eq!(error.code(), CODE);
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

/// `llm` and `mcp` are held to the same policy: the metadata address as a model, a
/// loopback MCP server by literal and by name (the latter refused by the MCP client's
/// own resolver).
#[tokio::test]
async fn llm_and_mcp_are_held_to_the_policy() {
    let clients = policed(&[]);
    let error = Llm::new(clients.clone())
        .call(&call(
            "llm",
            "acme",
            json!({"base_url": "http://169.254.169.254/v1", "model": "m"}),
        ))
        .await
        .expect_err("refused");
    assert_eq!(error.code(), CODE, "{error:?}");
    assert!(error.message().contains("link-local"), "{error}");

    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = closed.local_addr().expect("addr").port();
    drop(closed);
    let mcp = Mcp::new(clients);
    for url in [
        format!("http://127.0.0.1:{port}/mcp"),
        format!("http://localhost:{port}/mcp"),
    ] {
        let config = json!({"server": "shop", "tool": "refund", "url": url});
        let mut step = call("mcp", "acme", config);
        step.args = json!({});
        let error = mcp.call(&step).await.expect_err("refused");
        assert_eq!(error.code(), CODE, "{url}: {error:?}");
        assert!(!error.is_retryable(), "{error:?}");
    }
    // Allowed, the same closed port is only unavailable (retryable), as before.
    let config =
        json!({"server": "shop", "tool": "refund", "url": format!("http://localhost:{port}/mcp")});
    let mut step = call("mcp", "acme", config);
    step.args = json!({});
    let error = Mcp::new(policed(&["127.0.0.0/8", "::1"]))
        .call(&step)
        .await
        .expect_err("nobody listens");
    assert_eq!(error.code(), "mcp_unavailable", "{error:?}");
}
