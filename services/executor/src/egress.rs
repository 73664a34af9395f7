//! The egress policy: where the built-in handlers (`http`, `llm`, `mcp`) may connect.
//!
//! A graph, which any tenant may write, names the URLs its steps call; the executor's
//! network is the platform's. So by default an executor refuses every destination that is
//! not a public unicast address ([`classify`]): loopback, private, link-local (the cloud
//! metadata address), shared (CGNAT), unspecified, multicast, broadcast, documentation,
//! benchmarking and reserved ranges, and IPv6 forms that carry such an IPv4 address
//! (mapped, NAT64, 6to4). An operator allows more ([`Egress`]) for every tenant
//! (`--egress-allow`) or for one (`--egress-allow-tenant`): a CIDR, an address, or a host
//! name (`*.name` for its subdomains), then allowed whatever it resolves to.
//!
//! The check is on the address connected to, never on a name checked earlier: each
//! policy's client resolves names through a resolver that drops the addresses the policy
//! refuses (and fails when none remain), so a name that answers one address when looked
//! at and another when connected to (DNS rebinding) cannot get round it. An IP literal
//! never reaches a resolver, so it is checked before the request is sent, and so is every
//! redirect's target. A refusal is a permanent step error, `egress_forbidden`, raised
//! before anything is sent to the refused address. Proxies named by the environment
//! (`HTTPS_PROXY`) are not used: through a proxy the executor would not know the address
//! it reaches.

use std::collections::BTreeMap;
use std::error::Error as StdError;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::handler::HandlerError;

/// The error code of a refused destination.
pub const CODE: &str = "egress_forbidden";

/// Why a rule could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("egress rule {rule:?}: {why}")]
pub struct BadRule {
    rule: String,
    why: &'static str,
}

/// What an operator allows beyond the public internet: for every tenant, and per tenant
/// on top of that. The default allows nothing more.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Egress {
    every: Allow,
    tenants: BTreeMap<String, Allow>,
}

impl Egress {
    /// Allows `rule` (`10.0.0.0/8`, `10.1.2.3`, `fd00::/8`, `api.internal`,
    /// `*.svc.cluster.local`) to every tenant's steps.
    pub fn allow(&mut self, rule: &str) -> Result<&mut Self, BadRule> {
        self.every.add(rule)?;
        Ok(self)
    }

    /// Allows `rule` to `tenant`'s steps only.
    pub fn allow_tenant(&mut self, tenant: &str, rule: &str) -> Result<&mut Self, BadRule> {
        if tenant.is_empty() {
            return Err(BadRule {
                rule: format!("{tenant}={rule}"),
                why: "no tenant before the =",
            });
        }
        self.tenants
            .entry(tenant.to_owned())
            .or_default()
            .add(rule)?;
        Ok(self)
    }

    /// Reads `tenant=rule`, as `--egress-allow-tenant` takes it.
    pub fn allow_tenant_spec(&mut self, spec: &str) -> Result<&mut Self, BadRule> {
        // A rule never holds `=`: the tenant is everything before the last one.
        let (tenant, rule) = spec.rsplit_once('=').ok_or_else(|| BadRule {
            rule: spec.to_owned(),
            why: "expected <tenant>=<CIDR|address|host>",
        })?;
        self.allow_tenant(tenant.trim(), rule)
    }

    /// The policy `tenant`'s steps are held to.
    pub fn policy(&self, tenant: &str) -> Policy {
        let mut allow = self.every.clone();
        if let Some(more) = self.tenants.get(tenant) {
            allow.nets.extend(more.nets.iter().copied());
            allow.hosts.extend(more.hosts.iter().cloned());
        }
        Policy { allow }
    }
}

/// Allowed networks and host names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Allow {
    nets: Vec<IpNet>,
    hosts: Vec<HostRule>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum HostRule {
    Exact(String),
    /// `*.name`: any subdomain of `name` (not `name` itself).
    Below(String),
}

impl Allow {
    fn add(&mut self, rule: &str) -> Result<(), BadRule> {
        let bad = |why| BadRule {
            rule: rule.to_owned(),
            why,
        };
        let text = rule.trim();
        if text.is_empty() {
            return Err(bad("empty"));
        }
        if let Ok(net) = text.parse::<IpNet>() {
            self.nets.push(net.trunc());
            return Ok(());
        }
        let bare = text.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = bare.parse::<IpAddr>() {
            self.nets.push(IpNet::from(canonical(ip)));
            return Ok(());
        }
        if text.contains('/') {
            return Err(bad("not a CIDR (address/prefix length)"));
        }
        let (below, name) = match text.strip_prefix("*.") {
            Some(name) => (true, name),
            None => (false, text),
        };
        let name = normal_host(name);
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        if name.is_empty() || name.len() > 253 || !name.split('.').all(label_ok) {
            return Err(bad("neither a CIDR, an address nor a host name"));
        }
        self.hosts.push(if below {
            HostRule::Below(name)
        } else {
            HostRule::Exact(name)
        });
        Ok(())
    }
}

fn normal_host(host: &str) -> String {
    host.trim_end_matches('.').to_ascii_lowercase()
}

/// One tenant's rules: the default refusals less what the operator allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    allow: Allow,
}

/// A destination the policy refuses. Its text names the rule, and how to allow it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refused(String);

impl Refused {
    pub fn message(&self) -> &str {
        &self.0
    }

    pub(crate) fn to_handler_error(&self) -> HandlerError {
        HandlerError::permanent(CODE, self.0.clone())
    }
}

const HOW_TO_ALLOW: &str =
    "executors do not call it unless an operator allows it (--egress-allow, --egress-allow-tenant)";

impl Policy {
    /// Whether `ip` may be connected to; if not, why.
    pub fn check_ip(&self, ip: IpAddr) -> Result<(), Refused> {
        let ip = canonical(ip);
        if self.allow.nets.iter().any(|n| n.contains(&ip)) {
            return Ok(());
        }
        match classify(ip) {
            None => Ok(()),
            Some(range) => Err(Refused(format!("{ip} is {range}; {HOW_TO_ALLOW}"))),
        }
    }

    fn allows_name(&self, host: &str) -> bool {
        let host = normal_host(host);
        self.allow.hosts.iter().any(|rule| match rule {
            HostRule::Exact(name) => host == *name,
            HostRule::Below(name) => host
                .strip_suffix(name.as_str())
                .is_some_and(|head| head.ends_with('.')),
        })
    }

    /// Checks a URL's host where no resolver will: an IP literal. A name passes here;
    /// the client's resolver checks what it resolves to.
    pub fn check_url(&self, url: &reqwest::Url) -> Result<(), Refused> {
        // A special scheme's URL has its IPv4 forms (`2130706433`, `0x7f.1`) normalised
        // by the parser; an IPv6 literal keeps its brackets here.
        let host = url.host_str().unwrap_or_default();
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        match bare.parse::<IpAddr>() {
            Ok(ip) => self.check_ip(ip),
            Err(_) => Ok(()),
        }
    }

    /// Resolves `host` and keeps the addresses the policy allows (all of them for an
    /// allowed name); none left is a [`Refused`] naming the first refused address.
    pub async fn resolve(
        &self,
        host: &str,
    ) -> Result<Vec<SocketAddr>, Box<dyn StdError + Send + Sync>> {
        let found: Vec<SocketAddr> = tokio::net::lookup_host((host, 0)).await?.collect();
        if self.allows_name(host) {
            return Ok(found);
        }
        let mut refused = None;
        let kept: Vec<SocketAddr> = found
            .iter()
            .copied()
            .filter(|addr| match self.check_ip(addr.ip()) {
                Ok(()) => true,
                Err(why) => {
                    refused.get_or_insert(why);
                    false
                }
            })
            .collect();
        match (kept.is_empty(), refused) {
            (true, Some(why)) => Err(Box::new(Refused(format!(
                "{host} resolves to no allowed address: {why}"
            )))),
            (true, None) => Err(format!("{host} resolved to no address").into()),
            (false, _) => Ok(kept),
        }
    }
}

/// What a refused address is: its range and what the range is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    pub net: IpNet,
    pub what: &'static str,
    /// The IPv6 form that carried an IPv4 address (`NAT64 64:ff9b::/96`, `6to4 2002::/16`).
    pub inside: Option<&'static str>,
}

impl std::fmt::Display for Range {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} address ({}", self.what, self.net)?;
        if let Some(inside) = self.inside {
            write!(f, ", inside {inside}")?;
        }
        f.write_str(")")
    }
}

/// The special-purpose IPv4 ranges an executor refuses (IANA's registry, less the few
/// global ones), most specific first.
const V4: &[([u8; 4], u8, &str)] = &[
    ([255, 255, 255, 255], 32, "a broadcast"),
    ([0, 0, 0, 0], 8, "an unspecified (this network)"),
    ([10, 0, 0, 0], 8, "a private"),
    ([100, 64, 0, 0], 10, "a shared (carrier-grade NAT)"),
    ([127, 0, 0, 0], 8, "a loopback"),
    ([169, 254, 0, 0], 16, "a link-local (cloud metadata)"),
    ([172, 16, 0, 0], 12, "a private"),
    ([192, 0, 0, 0], 24, "a reserved (IETF protocol assignments)"),
    ([192, 0, 2, 0], 24, "a documentation"),
    ([192, 88, 99, 0], 24, "a reserved (6to4 relay)"),
    ([192, 168, 0, 0], 16, "a private"),
    ([198, 18, 0, 0], 15, "a benchmarking"),
    ([198, 51, 100, 0], 24, "a documentation"),
    ([203, 0, 113, 0], 24, "a documentation"),
    ([224, 0, 0, 0], 4, "a multicast"),
    ([240, 0, 0, 0], 4, "a reserved"),
];

/// The IPv6 ranges an executor refuses, most specific first; past them, anything
/// outside global unicast (`2000::/3`) is refused as reserved.
const V6: &[(u128, u8, &str)] = &[
    (0, 128, "an unspecified"),
    (1, 128, "a loopback"),
    (0x0064_ff9b_0001 << 80, 48, "a private (local NAT64)"),
    (0x0100 << 112, 64, "a reserved (discard-only)"),
    (0x2001_0000 << 96, 32, "a reserved (Teredo)"),
    (0x2001_0002 << 96, 48, "a benchmarking"),
    (0x2001_0010 << 96, 28, "a reserved (ORCHID)"),
    (0x2001_0020 << 96, 28, "a reserved (ORCHIDv2)"),
    (0x2001_0db8 << 96, 32, "a documentation"),
    (0x3fff << 112, 20, "a documentation"),
    (0x5f00 << 112, 16, "a reserved (SRv6)"),
    (0xfc00 << 112, 7, "a unique local (private)"),
    (0xfe80 << 112, 10, "a link-local"),
    (0xfec0 << 112, 10, "a site-local (private)"),
    (0xff00 << 112, 8, "a multicast"),
];

/// An IPv4-mapped IPv6 address (`::ffff:a.b.c.d`) is the IPv4 address it maps: a socket
/// to it reaches that address.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => ip,
        },
        IpAddr::V4(_) => ip,
    }
}

/// The range `ip` lies in if the executor refuses it by default; `None` for a public
/// unicast address.
pub fn classify(ip: IpAddr) -> Option<Range> {
    match canonical(ip) {
        IpAddr::V4(v4) => classify_v4(v4),
        IpAddr::V6(v6) => classify_v6(v6),
    }
}

fn classify_v4(ip: Ipv4Addr) -> Option<Range> {
    V4.iter().find_map(|(base, len, what)| {
        let net = Ipv4Net::new(Ipv4Addr::from(*base), *len).ok()?;
        net.contains(&ip).then_some(Range {
            net: IpNet::V4(net),
            what,
            inside: None,
        })
    })
}

fn classify_v6(ip: Ipv6Addr) -> Option<Range> {
    let bits = u128::from(ip);
    let carried = |inside: &'static str, v4: u32| {
        classify_v4(Ipv4Addr::from(v4)).map(|r| Range {
            inside: Some(inside),
            ..r
        })
    };
    // NAT64 (64:ff9b::/96) and 6to4 (2002::/16) reach the IPv4 address they carry.
    if bits >> 32 == 0x0064_ff9b_u128 << 64 {
        return carried("NAT64 64:ff9b::/96", bits as u32);
    }
    if bits >> 112 == 0x2002 {
        return carried("6to4 2002::/16", (bits >> 80) as u32);
    }
    let listed = V6.iter().find_map(|(base, len, what)| {
        let net = Ipv6Net::new(Ipv6Addr::from(*base), *len).ok()?;
        net.contains(&ip).then_some(Range {
            net: IpNet::V6(net),
            what,
            inside: None,
        })
    });
    listed.or_else(|| {
        (bits >> 125 != 1).then(|| Range {
            net: IpNet::V6(Ipv6Net::new(ip, 3).map(|n| n.trunc()).unwrap_or_default()),
            what: "a reserved (outside global unicast 2000::/3)",
            inside: None,
        })
    })
}

/// A refusal somewhere in `error`'s chain of sources.
pub(crate) fn refusal<'a>(error: &'a (dyn StdError + 'static)) -> Option<&'a Refused> {
    let mut source = Some(error);
    while let Some(error) = source {
        if let Some(refused) = error.downcast_ref::<Refused>() {
            return Some(refused);
        }
        source = error.source();
    }
    None
}

/// The HTTP clients of the built-in handlers: one per egress policy (the default one,
/// and one for each tenant with allowances of its own), chosen per call by its tenant,
/// so one tenant's allowance never serves another's steps (nor its pooled connections).
#[derive(Debug, Clone)]
pub struct Clients {
    every: Route,
    tenants: Arc<BTreeMap<String, Route>>,
}

#[derive(Debug, Clone)]
struct Route {
    client: reqwest::Client,
    /// `None`: a client given as it is, no policy (tests; your own binary).
    policy: Option<Arc<Policy>>,
}

impl Clients {
    /// Clients that hold every call to `egress`.
    pub fn new(egress: &Egress) -> Clients {
        let route = |policy: Policy| {
            let policy = Arc::new(policy);
            Route {
                client: policed_client(&policy),
                policy: Some(policy),
            }
        };
        Clients {
            every: route(Policy {
                allow: egress.every.clone(),
            }),
            tenants: Arc::new(
                egress
                    .tenants
                    .keys()
                    .map(|tenant| (tenant.clone(), route(egress.policy(tenant))))
                    .collect(),
            ),
        }
    }

    /// `client` for every call, as it is: no egress policy. For tests, and for a binary
    /// of your own that polices its network itself.
    pub fn unchecked(client: reqwest::Client) -> Clients {
        Clients {
            every: Route {
                client,
                policy: None,
            },
            tenants: Arc::default(),
        }
    }

    fn route(&self, tenant: &str) -> &Route {
        self.tenants.get(tenant).unwrap_or(&self.every)
    }

    /// The client for `tenant`'s call to `url`, once the URL's host is known not to be a
    /// refused address (a name is checked by the client's resolver when it connects).
    /// A refusal is a permanent `egress_forbidden`; a URL that does not parse is left to
    /// the request to report.
    pub(crate) fn for_url(
        &self,
        tenant: &str,
        url: &str,
    ) -> Result<&reqwest::Client, HandlerError> {
        let route = self.route(tenant);
        if let (Some(policy), Ok(url)) = (&route.policy, reqwest::Url::parse(url)) {
            policy.check_url(&url).map_err(|r| r.to_handler_error())?;
        }
        Ok(&route.client)
    }

    /// The policy `tenant`'s calls are held to (`None` for unchecked clients).
    pub(crate) fn policy(&self, tenant: &str) -> Option<&Arc<Policy>> {
        self.route(tenant).policy.as_ref()
    }
}

impl From<reqwest::Client> for Clients {
    fn from(client: reqwest::Client) -> Self {
        Clients::unchecked(client)
    }
}

/// The refusal behind a failed request, as the step's error.
pub(crate) fn forbidden(error: &reqwest::Error) -> Option<HandlerError> {
    refusal(error).map(Refused::to_handler_error)
}

fn policed_client(policy: &Arc<Policy>) -> reqwest::Client {
    crate::handlers::client_builder()
        .dns_resolver(Arc::new(Resolver(policy.clone())))
        .redirect(redirects(policy.clone()))
        .no_proxy()
        .build()
        // Only the TLS backend can fail here, as `reqwest::Client::new` would.
        .expect("the TLS backend initialises")
}

/// Resolves names for a policy's client (reqwest 0.12: `http`, `llm`).
#[derive(Debug)]
struct Resolver(Arc<Policy>);

impl reqwest::dns::Resolve for Resolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let policy = self.0.clone();
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let addrs = policy.resolve(&host).await?;
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// reqwest's default redirects (at most 10), each target checked first: a name by the
/// resolver when it is connected to, an IP literal here.
fn redirects(policy: Arc<Policy>) -> reqwest::redirect::Policy {
    let default = reqwest::redirect::Policy::default();
    reqwest::redirect::Policy::custom(move |attempt| match policy.check_url(attempt.url()) {
        Ok(()) => default.redirect(attempt),
        Err(why) => {
            let why = Refused(format!("the receiver redirected: {why}"));
            attempt.error(why)
        }
    })
}

/// Where an MCP call's client keeps the first refusal it made.
pub(crate) type Remembered = Arc<Mutex<Option<Refused>>>;

/// An MCP call's HTTP client (reqwest 0.13, under the MCP SDK), made per call as the MCP
/// client makes its own: the policy's resolver and redirect check, like [`Clients`]'
/// ones. What it refused is kept in the returned slot, since the MCP client reports a
/// failure to connect as text only.
pub(crate) fn mcp_client(
    policy: &Arc<Policy>,
) -> Result<(reqwest13::Client, Remembered), HandlerError> {
    let refused = Remembered::default();
    let resolver = Resolver13 {
        policy: policy.clone(),
        refused: refused.clone(),
    };
    let redirect_policy = policy.clone();
    let redirect_refused = refused.clone();
    let default = reqwest13::redirect::Policy::default();
    let client = sortie_mcp::client_builder()
        .dns_resolver(resolver)
        .redirect(reqwest13::redirect::Policy::custom(move |attempt| {
            let url = reqwest::Url::parse(attempt.url().as_str());
            match url.map(|url| redirect_policy.check_url(&url)) {
                Ok(Err(why)) => {
                    let why = Refused(format!("the server redirected: {why}"));
                    remember(&redirect_refused, &why);
                    attempt.error(why)
                }
                _ => default.redirect(attempt),
            }
        }))
        .no_proxy()
        .build()
        .map_err(|e| {
            HandlerError::retryable("mcp_unavailable", format!("building the HTTP client: {e}"))
        })?;
    Ok((client, refused))
}

fn remember(slot: &Mutex<Option<Refused>>, why: &Refused) {
    if let Ok(mut slot) = slot.lock() {
        slot.get_or_insert_with(|| why.clone());
    }
}

/// What an MCP call's client refused, if anything, as the step's error.
pub(crate) fn refused_in(slot: &Mutex<Option<Refused>>) -> Option<HandlerError> {
    slot.lock().ok()?.as_ref().map(Refused::to_handler_error)
}

/// [`Resolver`] for reqwest 0.13, remembering a refusal.
#[derive(Debug)]
struct Resolver13 {
    policy: Arc<Policy>,
    refused: Remembered,
}

impl reqwest13::dns::Resolve for Resolver13 {
    fn resolve(&self, name: reqwest13::dns::Name) -> reqwest13::dns::Resolving {
        let policy = self.policy.clone();
        let refused = self.refused.clone();
        let host = name.as_str().to_owned();
        Box::pin(async move {
            match policy.resolve(&host).await {
                Ok(addrs) => Ok(Box::new(addrs.into_iter()) as reqwest13::dns::Addrs),
                Err(error) => {
                    let source: &(dyn StdError + 'static) = &*error;
                    if let Some(why) = refusal(source) {
                        remember(&refused, why);
                    }
                    Err(error)
                }
            }
        })
    }
}

#[cfg(test)]
mod tests;
