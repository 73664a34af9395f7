//! Whether a command can reach what it needs — Kafka's bootstrap servers, the schema
//! registry — asked in a few seconds before it starts, and said with the address and the
//! flag that moves it, instead of a client library's timeout half a minute later.

use std::time::{Duration, Instant};

/// How long the one-shot commands give Kafka and the registry to accept a connection (a
/// broker or registry started a moment ago is given that long to open its port).
pub const PATIENCE: Duration = Duration::from_secs(5);

/// Fails unless one of `bootstrap`'s servers accepts a TCP connection within `patience`.
/// Only the port is checked: whether Kafka answers on it is for the client to find out.
pub async fn kafka(bootstrap: &str, patience: Duration) -> anyhow::Result<()> {
    kafka_via(
        bootstrap,
        "--bootstrap-servers",
        "Point --bootstrap-servers (or SORTIE__KAFKA__BOOTSTRAP_SERVERS) at yours, or start one (`sortie dev`, `sortie broker start`)",
        patience,
    )
    .await
}

/// [`kafka`] for a command whose `flag` names the servers; `how` says what to do instead.
pub async fn kafka_via(
    bootstrap: &str,
    flag: &str,
    how: &str,
    patience: Duration,
) -> anyhow::Result<()> {
    let addresses = kafka_addresses(bootstrap);
    if addresses.is_empty() {
        anyhow::bail!("{flag} {bootstrap:?} names no server; give HOST:PORT[,HOST:PORT…]");
    }
    let deadline = Instant::now() + patience;
    loop {
        let mut last = String::new();
        for address in &addresses {
            match tokio::time::timeout(
                Duration::from_secs(2),
                tokio::net::TcpStream::connect(address.as_str()),
            )
            .await
            {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => last = "no answer in 2 s".to_owned(),
            }
        }
        if Instant::now() >= deadline {
            anyhow::bail!(
                "cannot reach Kafka at {bootstrap} ({last}): is a broker running there? {how}"
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Fails unless the registry at `url` answers HTTP (any status) within `patience`.
pub async fn registry(url: &str, patience: Duration) -> anyhow::Result<()> {
    let base = match reqwest::Url::parse(url) {
        Ok(base) if matches!(base.scheme(), "http" | "https") && base.has_host() => base,
        _ => anyhow::bail!(
            "--registry-url {url:?} is not an http(s) URL (like http://127.0.0.1:8081); set it with --registry-url or SORTIE__REGISTRY__URL"
        ),
    };
    let probe = format!("{}/subjects", base.as_str().trim_end_matches('/'));
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()?;
    let deadline = Instant::now() + patience;
    loop {
        let why = match http.get(&probe).send().await {
            Ok(_) => return Ok(()),
            Err(e) => innermost(&e),
        };
        if Instant::now() >= deadline {
            anyhow::bail!("{}", registry_unreachable(url, &why));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn registry_unreachable(url: &str, why: &str) -> String {
    format!(
        "the schema registry at {url} does not answer ({why}): is it running? Point --registry-url (or SORTIE__REGISTRY__URL) at yours, or start one (`sortie dev`, `sortie registry serve`)"
    )
}

/// Kafka, then the registry: what every command reading Sortie's topics needs.
pub async fn both(connection: &crate::connection::Connection) -> anyhow::Result<()> {
    kafka(&connection.brokers.bootstrap_servers, PATIENCE).await?;
    registry(&connection.registry_url, PATIENCE).await
}

/// A service that failed: if Kafka cannot be reached now, that is most likely why (it got
/// nowhere without it), and is said first; so is a registry that does not answer, for an
/// error about the registry. Any other error is returned as it was (a reducer refusing a
/// `CreateTime` topic is not blamed on a registry it never asked).
pub async fn explain(
    error: anyhow::Error,
    bootstrap: &str,
    registry_url: Option<&str>,
) -> anyhow::Error {
    if let Err(unreachable) = kafka(bootstrap, Duration::ZERO).await {
        return error.context(unreachable.to_string());
    }
    if let Some(url) = registry_url.filter(|_| format!("{error:#}").contains("schema registry")) {
        if let Err(unreachable) = registry(url, Duration::ZERO).await {
            return error.context(unreachable.to_string());
        }
    }
    error
}

/// An error of reading Sortie's topics (`audit`, `replay`), with the address and the flag
/// when Kafka or the registry is its cause; any other error (a judgment, a missing run)
/// as it was.
pub fn name_the_cause(
    error: anyhow::Error,
    connection: &crate::connection::Connection,
) -> anyhow::Error {
    use sortie_reducer::driver::Error;
    let context = match error.downcast_ref::<Error>() {
        Some(Error::Kafka(_)) => format!(
            "reading from Kafka at {} (--bootstrap-servers)",
            connection.brokers.bootstrap_servers
        ),
        Some(Error::Registry(_)) => format!(
            "reading schemas from the registry at {} (--registry-url)",
            connection.registry_url
        ),
        _ => return error,
    };
    error.context(context)
}

/// `host:port` of each bootstrap server (a `SCHEME://` prefix dropped, port 9092 when
/// none is given, as librdkafka reads them).
fn kafka_addresses(bootstrap: &str) -> Vec<String> {
    bootstrap
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.rsplit_once("://").map_or(s, |(_, rest)| rest))
        .map(|s| {
            let has_port = match s.rsplit_once(':') {
                // `[::1]` is an address without a port; `[::1]:9092` one with.
                Some((host, port)) => {
                    !port.is_empty()
                        && port.chars().all(|c| c.is_ascii_digit())
                        && (!host.contains(':') || host.ends_with(']'))
                }
                None => false,
            };
            if has_port {
                s.to_owned()
            } else {
                format!("{s}:9092")
            }
        })
        .collect()
}

/// The last cause in a reqwest error's chain ("Connection refused (os error 111)"), the
/// part that says why.
fn innermost(error: &reqwest::Error) -> String {
    let mut cause: &dyn std::error::Error = error;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

#[cfg(test)]
mod tests {
    use super::kafka_addresses;

    #[test]
    fn bootstrap_servers_are_read_as_librdkafka_reads_them() {
        assert_eq!(
            kafka_addresses("127.0.0.1:9092, b:19092,,SASL_SSL://c.example:9093"),
            ["127.0.0.1:9092", "b:19092", "c.example:9093"]
        );
        assert_eq!(
            kafka_addresses("localhost,[::1],[::1]:9094"),
            ["localhost:9092", "[::1]:9092", "[::1]:9094"]
        );
        assert!(kafka_addresses(" , ").is_empty());
    }

    #[tokio::test]
    async fn a_closed_port_is_said_with_its_address_and_flag() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = closed.local_addr().expect("addr").to_string();
        drop(closed);
        let error = super::kafka(&address, std::time::Duration::ZERO)
            .await
            .expect_err("nothing listens");
        let text = error.to_string();
        assert!(
            text.contains(&address) && text.contains("--bootstrap-servers"),
            "{text}"
        );
        let open = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = open.local_addr().expect("addr").to_string();
        super::kafka(&address, std::time::Duration::ZERO)
            .await
            .expect("a listening port is reached");
    }
}
