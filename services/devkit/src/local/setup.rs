//! Setting up a broker's data dir: fetching the jars with Maven, writing
//! `server.properties` and `log4j2.properties`, and formatting the KRaft storage with a
//! fresh cluster id.

use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::process::FileLock;
use super::{io_err, BrokerConfig, Error, LocalBroker, Result};

/// The log4j2 configuration written into every data dir (source: `dev/kafka/`).
const LOG4J2_PROPERTIES: &str = include_str!("../../../../dev/kafka/log4j2.properties");

impl LocalBroker {
    /// Fetches the broker's jars with Maven unless they are already there. Maven copies
    /// into a sibling `.partial` dir that is renamed at the end, so an interrupted fetch
    /// never leaves a half-filled `libs`; a `<libs>.lock` serialises brokers that share
    /// one libs dir.
    pub fn ensure_jars(&self) -> Result<PathBuf> {
        let libs = self.libs_dir();
        if has_kafka_jar(&libs) {
            return Ok(libs);
        }
        let _lock = FileLock::acquire(&libs.with_extension("lock"))?;
        if has_kafka_jar(&libs) {
            return Ok(libs);
        }
        let partial = libs.with_extension("partial");
        if partial.exists() {
            fs::remove_dir_all(&partial).map_err(io_err("removing", &partial))?;
        }
        if let Some(parent) = libs.parent() {
            fs::create_dir_all(parent).map_err(io_err("creating", parent))?;
        }
        tracing::info!(pom = %self.config.pom.display(), libs = %libs.display(), "Fetching the Kafka jars with Maven.");
        let output = Command::new("mvn")
            .args(["-q", "-B", "-f"])
            .arg(&self.config.pom)
            .arg("dependency:copy-dependencies")
            .arg(format!("-DoutputDirectory={}", partial.display()))
            .arg("-DincludeScope=runtime")
            .stdin(Stdio::null())
            .output()
            .map_err(|source| missing_tool("mvn", &self.config.pom, source))?;
        if !output.status.success() || !has_kafka_jar(&partial) {
            return Err(Error::FetchJars {
                pom: self.config.pom.clone(),
                output: output_text(&output),
            });
        }
        if libs.exists() {
            fs::remove_dir_all(&libs).map_err(io_err("removing", &libs))?;
        }
        fs::rename(&partial, &libs).map_err(io_err("renaming", &partial))?;
        Ok(libs)
    }

    /// Writes `server.properties` and `log4j2.properties` (every start, so a port change
    /// applies) and formats the storage once: never again while `logs/meta.properties`
    /// exists, so a restart keeps the data.
    pub fn ensure_formatted(&self) -> Result<()> {
        let dir = &self.config.data_dir;
        fs::create_dir_all(dir).map_err(io_err("creating", dir))?;
        let server = self.path("server.properties");
        fs::write(&server, self.server_properties()).map_err(io_err("writing", &server))?;
        let log4j = self.path("log4j2.properties");
        fs::write(&log4j, LOG4J2_PROPERTIES).map_err(io_err("writing", &log4j))?;
        if self.path("logs").join("meta.properties").exists() {
            return Ok(());
        }
        let libs = self.ensure_jars()?;
        let cluster_id = match &self.config.cluster_id {
            Some(id) => id.clone(),
            None => random_cluster_id()?,
        };
        tracing::info!(data_dir = %dir.display(), %cluster_id, "Formatting the broker storage.");
        let output = Command::new("java")
            .arg(format!("-Dlog4j2.configurationFile={}", log4j.display()))
            .arg(format!("-Dkafka.logs.dir={}", dir.display()))
            .arg("-cp")
            .arg(classpath(&libs))
            .args(["kafka.tools.StorageTool", "format"])
            .arg(format!("--cluster-id={cluster_id}"))
            .arg("-c")
            .arg(&server)
            .stdin(Stdio::null())
            .output()
            .map_err(|source| missing_tool("java", dir, source))?;
        if !output.status.success() {
            return Err(Error::Format {
                dir: dir.clone(),
                output: output_text(&output),
            });
        }
        Ok(())
    }

    fn server_properties(&self) -> String {
        let BrokerConfig {
            port,
            controller_port,
            node_id,
            replication,
            ..
        } = self.config;
        let voters = if self.config.voters.is_empty() {
            format!("{node_id}@127.0.0.1:{controller_port}")
        } else {
            self.config
                .voters
                .iter()
                .map(|(id, port)| format!("{id}@127.0.0.1:{port}"))
                .collect::<Vec<_>>()
                .join(",")
        };
        let min_isr = replication.saturating_sub(1).max(1);
        let logs = self.path("logs");
        // Small internal topics start faster; a fast cleaner makes compaction testable;
        // after a SIGKILL the broker cannot re-register until its old session expires, so
        // a short session timeout keeps crash-restart tests quick.
        format!(
            "# Written by sortie_devkit::local on every start; edits are overwritten.\n\
             process.roles=broker,controller\n\
             node.id={node_id}\n\
             controller.quorum.voters={voters}\n\
             listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}\n\
             advertised.listeners=PLAINTEXT://127.0.0.1:{port}\n\
             controller.listener.names=CONTROLLER\n\
             listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT\n\
             log.dirs={logs}\n\
             num.partitions=1\n\
             default.replication.factor={replication}\n\
             offsets.topic.replication.factor={replication}\n\
             offsets.topic.num.partitions=10\n\
             transaction.state.log.replication.factor={replication}\n\
             transaction.state.log.min.isr={min_isr}\n\
             transaction.state.log.num.partitions=10\n\
             share.coordinator.state.topic.replication.factor={replication}\n\
             share.coordinator.state.topic.min.isr={min_isr}\n\
             group.initial.rebalance.delay.ms=0\n\
             auto.create.topics.enable=false\n\
             unclean.leader.election.enable=false\n\
             log.cleaner.backoff.ms=500\n\
             broker.heartbeat.interval.ms=1000\n\
             broker.session.timeout.ms=4000\n\
             {extra}",
            logs = logs.display(),
            extra = self
                .config
                .properties
                .iter()
                .map(|line| format!("{line}\n"))
                .collect::<String>()
        )
    }
}

/// The PLAINTEXT port recorded in `<data_dir>/server.properties`, if a broker was ever
/// configured there: lets `stop`/`status` find a broker started with a non-default port.
pub fn configured_port(data_dir: &Path) -> Option<u16> {
    let text = fs::read_to_string(data_dir.join("server.properties")).ok()?;
    let listeners = text
        .lines()
        .find_map(|line| line.strip_prefix("listeners="))?;
    listeners
        .split(',')
        .find_map(|l| l.strip_prefix("PLAINTEXT://"))
        .and_then(|hostport| hostport.rsplit_once(':'))
        .and_then(|(_, port)| port.trim().parse().ok())
}

fn has_kafka_jar(dir: &Path) -> bool {
    fs::read_dir(dir)
        .map(|entries| {
            entries.flatten().any(|e| {
                let name = e.file_name();
                let name = name.to_string_lossy();
                name.starts_with("kafka_2.13-") && name.ends_with(".jar")
            })
        })
        .unwrap_or(false)
}

pub(super) fn classpath(libs: &Path) -> String {
    // The JVM expands `dir/*` itself.
    format!("{}/*", libs.display())
}

pub(super) fn missing_tool(tool: &'static str, path: &Path, source: io::Error) -> Error {
    if source.kind() == io::ErrorKind::NotFound {
        Error::MissingTool { tool, source }
    } else {
        Error::Io {
            action: if tool == "mvn" {
                "running mvn for"
            } else {
                "running java for"
            },
            path: path.to_path_buf(),
            source,
        }
    }
}

fn output_text(output: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// A KRaft cluster id: 16 random bytes, base64url without padding (22 chars), as
/// `kafka-storage random-uuid` makes.
/// Like Kafka's own `Uuid.randomUuid`, never one that starts with `-`: the storage tool's
/// argument parser takes `-t -abc…` for an option and fails (1 in 64 ids did).
pub(super) fn random_cluster_id() -> Result<String> {
    let path = Path::new("/dev/urandom");
    let mut bytes = [0u8; 16];
    loop {
        File::open(path)
            .and_then(|mut f| f.read_exact(&mut bytes))
            .map_err(io_err("reading", path))?;
        let id = base64url(&bytes);
        if !id.starts_with('-') {
            return Ok(id);
        }
    }
}

fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | (u32::from(b) << (16 - 8 * i)));
        let chars = chunk.len() + 1;
        for i in 0..chars {
            out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_ids_never_start_with_a_dash() {
        // Without the retry, 1 id in 64 starts with '-' (and the storage tool refused it:
        // seen in a CI rehearsal); 2000 draws would meet one almost surely.
        for _ in 0..2000 {
            let id = random_cluster_id().expect("an id");
            assert!(!id.starts_with('-'), "{id}");
            assert_eq!(id.len(), 22);
        }
    }

    #[test]
    fn base64url_matches_known_vectors() {
        assert_eq!(base64url(b""), "");
        assert_eq!(base64url(b"f"), "Zg");
        assert_eq!(base64url(b"fo"), "Zm8");
        assert_eq!(base64url(b"foo"), "Zm9v");
        assert_eq!(base64url(&[0xfb, 0xff]), "-_8");
        assert_eq!(base64url(&[0u8; 16]).len(), 22);
    }

    #[test]
    fn configured_port_reads_the_plaintext_listener() {
        let dir = std::env::temp_dir().join(format!("sortie-local-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("temp dir");
        let broker = LocalBroker::new(BrokerConfig::new(&dir, 19555, "pom.xml"));
        fs::write(dir.join("server.properties"), broker.server_properties()).expect("write");
        assert_eq!(configured_port(&dir), Some(19555));
        fs::remove_dir_all(&dir).expect("cleanup");
    }
}
