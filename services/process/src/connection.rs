//! How a command reaches the cluster and its registry: the connection flags every
//! Kafka-facing `sortie` command shares ([`Connection`], [`Brokers`]) and the librdkafka
//! properties file (SASL, TLS) they read.

use std::path::PathBuf;

use anyhow::Context as _;
use sortie_kafka::KafkaConfig;

/// How a command reaches the cluster and its registry: the flags every Kafka-facing
/// command shares (same names, env vars and defaults in each; global, so they may follow
/// a subcommand).
#[derive(Debug, clap::Args)]
pub struct Connection {
    #[command(flatten)]
    pub brokers: Brokers,
    #[arg(
        long,
        global = true,
        env = "SORTIE__REGISTRY__URL",
        default_value = "http://127.0.0.1:8081"
    )]
    pub registry_url: String,
    /// Topic name prefix.
    #[arg(
        long,
        global = true,
        env = "SORTIE__TOPICS__PREFIX",
        default_value = "sortie."
    )]
    pub prefix: String,
}

impl Connection {
    /// A client config for the bootstrap servers with the properties file's settings.
    pub fn kafka_config(&self) -> anyhow::Result<KafkaConfig> {
        self.brokers.kafka_config()
    }

    /// The topics under this prefix.
    pub fn topics(&self) -> sortie_wire::Topics {
        sortie_wire::Topics::new(self.prefix.clone())
    }

    /// A codec for a reader (audit, replay): it never registers schemas.
    pub fn reader_codec(&self) -> sortie_wire::Codec {
        sortie_wire::Codec::new(&sortie_wire::CodecConfig {
            registry_url: self.registry_url.clone(),
            auto_register: false,
        })
    }
}

/// Where the Kafka cluster is and how to sign in to it: the part of [`Connection`] for
/// commands that need no registry or topic prefix (`topology`, `registry serve`).
#[derive(Debug, clap::Args)]
pub struct Brokers {
    #[arg(
        long,
        global = true,
        env = "SORTIE__KAFKA__BOOTSTRAP_SERVERS",
        default_value = "127.0.0.1:9092"
    )]
    pub bootstrap_servers: String,
    #[command(flatten)]
    pub kafka: KafkaProperties,
}

impl Brokers {
    /// A client config for the bootstrap servers with the properties file's settings.
    pub fn kafka_config(&self) -> anyhow::Result<KafkaConfig> {
        self.kafka.config(self.bootstrap_servers.clone())
    }
}

/// librdkafka properties from a file (e.g. a mounted Secret): SASL and TLS settings.
#[derive(Debug, clap::Args)]
pub struct KafkaProperties {
    /// A Java-style properties file (`key=value` lines, `#` comments) of extra librdkafka
    /// settings for every client: `security.protocol`, `sasl.mechanism`,
    /// `sasl.username`, `sasl.password`, `ssl.ca.location`, ...
    #[arg(long, global = true, env = "SORTIE__KAFKA__PROPERTIES_FILE")]
    kafka_properties: Option<PathBuf>,
}

impl KafkaProperties {
    /// A client config for `bootstrap_servers` with the file's properties.
    pub fn config(&self, bootstrap_servers: impl Into<String>) -> anyhow::Result<KafkaConfig> {
        let mut config = KafkaConfig::new(bootstrap_servers);
        if let Some(path) = &self.kafka_properties {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the Kafka properties {}", path.display()))?;
            config.properties = parse_properties(&text)
                .with_context(|| format!("in the Kafka properties {}", path.display()))?;
        }
        Ok(config)
    }
}

fn parse_properties(text: &str) -> anyhow::Result<std::collections::BTreeMap<String, String>> {
    let mut properties = std::collections::BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with('!') {
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            anyhow::bail!("line {}: expected key=value", n + 1);
        };
        properties.insert(key.trim().to_owned(), value.trim().to_owned());
    }
    Ok(properties)
}

#[cfg(test)]
mod tests {
    use super::parse_properties;

    #[test]
    fn properties_files_parse() {
        let parsed = parse_properties(
            "# SASL\nsecurity.protocol=SASL_SSL\n\nsasl.password = a=b\n! also a comment\n",
        )
        .expect("valid");
        assert_eq!(parsed["security.protocol"], "SASL_SSL");
        assert_eq!(parsed["sasl.password"], "a=b");
        assert_eq!(parsed.len(), 2);
        assert!(parse_properties("no equals sign").is_err());
    }
}
