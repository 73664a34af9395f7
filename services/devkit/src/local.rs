//! The local Apache Kafka broker (KRaft) that `sortie broker` and the test harness run: a
//! real `kafka.Kafka` JVM, fetched with Maven from `dev/kafka/pom.xml`. One node by
//! default; [`LocalCluster`] runs several (each broker and controller in one JVM, every
//! node a voter) on one machine, for replication and leader-failure tests.
//!
//! Layout of a data dir: `libs/` (the jars), `logs/` (the broker's log dirs and KRaft
//! metadata), `server.properties`, `log4j2.properties`, `broker.log` (the broker's own
//! log), `broker.out` (JVM stdout/stderr), `broker.pid`, and `lock`, a `flock`ed file that
//! serialises start and stop across processes (parallel test binaries).
//!
//! Every call here blocks (process spawns, polling, librdkafka metadata requests): from
//! async code, call it inside `tokio::task::spawn_blocking`.

use std::fs::{self, File};
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;
use rustix::process::Signal;

mod cluster;
mod process;
mod setup;

pub use cluster::LocalCluster;
use process::signal;
pub use setup::configured_port;
use setup::{classpath, missing_tool};

/// The `node.id` of a single-node broker (broker and controller in one JVM).
const NODE_ID: i32 = 1;
/// How many log lines an error carries.
const TAIL_LINES: usize = 40;

/// Errors of the local broker launcher.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("`{tool}` was not found ({source}): install Maven and a JDK 17+")]
    MissingTool {
        tool: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("fetching the Kafka jars with Maven from {pom} failed:\n{output}")]
    FetchJars { pom: PathBuf, output: String },
    #[error("formatting the broker storage in {dir} failed:\n{output}")]
    Format { dir: PathBuf, output: String },
    #[error(
        "port {port} is in use by another process (another broker on other data?); \
         stop it or choose another port"
    )]
    PortInUse { port: u16 },
    #[error("the broker (pid {pid}) exited during start-up; last log lines:\n{tail}")]
    Exited { pid: u32, tail: String },
    #[error(
        "the broker (pid {pid}) did not answer a metadata request within {timeout:?}; \
         last log lines:\n{tail}"
    )]
    NotReady {
        pid: u32,
        timeout: Duration,
        tail: String,
    },
    #[error("the broker (pid {pid}) was still alive {timeout:?} after SIGTERM and SIGKILL")]
    StopTimeout { pid: u32, timeout: Duration },
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

fn io_err<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> Error + 'a {
    move |source| Error::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// Where and how to run the local broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerConfig {
    /// Everything the broker owns lives here (made absolute by [`LocalBroker::new`]).
    pub data_dir: PathBuf,
    /// The PLAINTEXT listener on 127.0.0.1.
    pub port: u16,
    /// The KRaft controller listener on 127.0.0.1.
    pub controller_port: u16,
    /// The pom that resolves the broker's jars (used only when the jars are missing).
    pub pom: PathBuf,
    /// Where the jars live; `None` means `<data_dir>/libs`.
    pub libs_dir: Option<PathBuf>,
    /// JVM maximum heap (`-Xmx`), e.g. `768m`.
    pub heap: String,
    /// JVM flags. The defaults favour start-up time on a small machine (C1 only, serial
    /// GC); pass C2-friendly flags for long benchmarks.
    pub jvm_flags: Vec<String>,
    /// How long a start may take until the broker answers a metadata request.
    pub start_timeout: Duration,
    /// How long `stop` waits after SIGTERM before SIGKILL.
    pub stop_timeout: Duration,
    /// This node's `node.id`.
    pub node_id: i32,
    /// Every controller of the cluster as (node id, controller port); empty: this node
    /// alone.
    pub voters: Vec<(i32, u16)>,
    /// The KRaft cluster id storage is formatted with; `None`: a random one (one node).
    pub cluster_id: Option<String>,
    /// Replication factor of the internal topics (offsets, transaction state) and the
    /// broker default for new topics; their `min.insync.replicas` is one less (at least 1).
    pub replication: u16,
    /// Extra `server.properties` lines (`key=value`), written after the defaults, so a
    /// key set here wins (Kafka reads the last one).
    pub properties: Vec<String>,
}

impl BrokerConfig {
    /// A config with the controller on `port + 1` and the default JVM settings.
    pub fn new(data_dir: impl Into<PathBuf>, port: u16, pom: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            port,
            controller_port: port.saturating_add(1),
            pom: pom.into(),
            libs_dir: None,
            heap: "768m".to_owned(),
            jvm_flags: vec![
                "-XX:+UseSerialGC".to_owned(),
                "-XX:TieredStopAtLevel=1".to_owned(),
                "-XX:+ExitOnOutOfMemoryError".to_owned(),
                "-Djava.awt.headless=true".to_owned(),
            ],
            start_timeout: Duration::from_secs(60),
            stop_timeout: Duration::from_secs(30),
            node_id: NODE_ID,
            voters: Vec::new(),
            cluster_id: None,
            replication: 1,
            properties: Vec::new(),
        }
    }
}

/// What [`LocalBroker::ensure_running`] found or did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Running {
    pub pid: u32,
    /// `127.0.0.1:<port>`.
    pub bootstrap: String,
    /// `true` when an already running broker was reused, `false` when this call started it.
    pub reused: bool,
}

/// What [`LocalBroker::status`] observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// The process is alive and answers metadata requests.
    Running { pid: u32 },
    /// The process is alive but did not answer a metadata request (starting, or hung).
    Unresponsive { pid: u32 },
    /// No live broker process for this data dir.
    Stopped,
}

/// A single-node broker bound to one data dir.
#[derive(Debug, Clone)]
pub struct LocalBroker {
    config: BrokerConfig,
}

impl LocalBroker {
    /// Resolves the data and libs dirs to canonical absolute paths: the broker's command
    /// line carries them, and a later call (from another cwd, through `..` or a symlink)
    /// must recognise its process.
    pub fn new(mut config: BrokerConfig) -> Self {
        config.data_dir = resolve(&config.data_dir);
        config.libs_dir = config.libs_dir.as_deref().map(resolve);
        Self { config }
    }

    pub fn config(&self) -> &BrokerConfig {
        &self.config
    }

    /// `127.0.0.1:<port>`, the value for `bootstrap.servers`.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.config.port)
    }

    pub fn data_dir(&self) -> &Path {
        &self.config.data_dir
    }

    pub fn libs_dir(&self) -> PathBuf {
        self.config
            .libs_dir
            .clone()
            .unwrap_or_else(|| self.config.data_dir.join("libs"))
    }

    fn path(&self, name: &str) -> PathBuf {
        self.config.data_dir.join(name)
    }

    /// Reuses the broker of this data dir if it is alive and answers metadata requests;
    /// otherwise (no pid file, or a stale one) starts it on the same data, formatting the
    /// storage only the first time. Serialised across processes by the data dir's lock.
    pub fn ensure_running(&self) -> Result<Running> {
        let _lock = self.lock()?;
        if let Some(pid) = self.read_pid() {
            if self.is_alive(pid) {
                // Alive: either ready, or starting/hung. Give it the start budget.
                self.wait_ready(pid, self.config.start_timeout)?;
                return Ok(Running {
                    pid,
                    bootstrap: self.bootstrap(),
                    reused: true,
                });
            }
            tracing::info!(pid, "Removing a stale broker pid file.");
            let pid_file = self.path("broker.pid");
            fs::remove_file(&pid_file).map_err(io_err("removing", &pid_file))?;
        }
        let pid = self.start_locked()?;
        Ok(Running {
            pid,
            bootstrap: self.bootstrap(),
            reused: false,
        })
    }

    fn start_locked(&self) -> Result<u32> {
        let started = Instant::now();
        let pid = self.spawn_locked()?;
        self.await_started(pid)?;
        tracing::info!(
            pid,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "The local Kafka broker is ready."
        );
        Ok(pid)
    }

    /// Waits for a just-spawned broker; one that never becomes ready is killed (it is of
    /// no use) and its pid file removed.
    fn await_started(&self, pid: u32) -> Result<()> {
        if let Err(error) = self.wait_ready(pid, self.config.start_timeout) {
            if matches!(error, Error::NotReady { .. }) {
                let _ = self.kill_pid(pid);
            }
            let _ = fs::remove_file(self.path("broker.pid"));
            return Err(error);
        }
        Ok(())
    }

    /// Formats if needed and starts the JVM; returns its pid without waiting for it.
    fn spawn_locked(&self) -> Result<u32> {
        // A port can stay busy a moment after its owner is gone: give it a few seconds.
        let deadline = Instant::now() + Duration::from_secs(15);
        for port in [self.config.port, self.config.controller_port] {
            while TcpListener::bind(("127.0.0.1", port)).is_err() {
                if Instant::now() >= deadline {
                    return Err(Error::PortInUse { port });
                }
                thread::sleep(Duration::from_millis(100));
            }
        }
        self.ensure_formatted()?;
        let libs = self.ensure_jars()?;
        let out_path = self.path("broker.out");
        let out = File::create(&out_path).map_err(io_err("creating", &out_path))?;
        let err = out.try_clone().map_err(io_err("opening", &out_path))?;
        let mut child = Command::new("java")
            .arg(format!("-Xmx{}", self.config.heap))
            .args(&self.config.jvm_flags)
            .arg(format!(
                "-Dlog4j2.configurationFile={}",
                self.path("log4j2.properties").display()
            ))
            .arg(format!(
                "-Dkafka.logs.dir={}",
                self.config.data_dir.display()
            ))
            .arg("-cp")
            .arg(classpath(&libs))
            .arg("kafka.Kafka")
            .arg(self.path("server.properties"))
            .current_dir(&self.config.data_dir)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            // Its own process group: Ctrl-C in the caller's terminal does not reach it,
            // and it outlives the caller.
            .process_group(0)
            .spawn()
            .map_err(|source| missing_tool("java", &self.config.data_dir, source))?;
        let pid = child.id();
        // Reap it when it exits while this process lives, so that a dead broker does not
        // linger as a zombie that still answers kill(pid, 0).
        thread::Builder::new()
            .name(format!("kafka-reaper-{pid}"))
            .spawn(move || {
                let _ = child.wait();
            })
            .map_err(io_err(
                "spawning a reaper thread for",
                &self.config.data_dir,
            ))?;
        let pid_file = self.path("broker.pid");
        fs::write(&pid_file, format!("{pid}\n")).map_err(io_err("writing", &pid_file))?;
        tracing::info!(pid, bootstrap = %self.bootstrap(), "Started the local Kafka broker; waiting for it to answer.");
        Ok(pid)
    }

    /// Polls until the broker answers a metadata request listing itself; fails early
    /// (with the log tail) if the process dies.
    fn wait_ready(&self, pid: u32, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if !self.is_alive(pid) {
                return Err(Error::Exited {
                    pid,
                    tail: self.log_tail(),
                });
            }
            if self.answers_metadata(Duration::from_secs(2)) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::NotReady {
                    pid,
                    timeout,
                    tail: self.log_tail(),
                });
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// Whether the broker on this config's port answers a metadata request (listing
    /// itself) within `timeout`.
    pub fn answers_metadata(&self, timeout: Duration) -> bool {
        let addr = SocketAddr::from(([127, 0, 0, 1], self.config.port));
        // A plain connect first keeps librdkafka from logging refused connections.
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            return false;
        }
        let consumer: BaseConsumer = match ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .set("reconnect.backoff.ms", "50")
            .set("reconnect.backoff.max.ms", "200")
            .set_log_level(RDKafkaLogLevel::Emerg)
            .create()
        {
            Ok(consumer) => consumer,
            Err(_) => return false,
        };
        match consumer.fetch_metadata(None, timeout) {
            Ok(metadata) => metadata
                .brokers()
                .iter()
                .any(|b| b.id() == self.config.node_id && b.port() == i32::from(self.config.port)),
            Err(_) => false,
        }
    }

    /// What runs in this data dir right now. Does not take the lock.
    pub fn status(&self) -> Status {
        match self.read_pid() {
            Some(pid) if self.is_alive(pid) => {
                if self.answers_metadata(Duration::from_secs(3)) {
                    Status::Running { pid }
                } else {
                    Status::Unresponsive { pid }
                }
            }
            _ => Status::Stopped,
        }
    }

    /// The pid of this data dir's live broker process, if any.
    pub fn pid(&self) -> Option<u32> {
        self.read_pid().filter(|&pid| self.is_alive(pid))
    }

    /// SIGTERM, wait up to `stop_timeout` for a clean exit, then SIGKILL. Returns the pid
    /// it stopped, `None` if nothing was running. The data stays: `ensure_running` later
    /// restarts on it.
    pub fn stop(&self) -> Result<Option<u32>> {
        let _lock = self.lock()?;
        let stopped = match self.read_pid() {
            Some(pid) if self.is_alive(pid) => {
                tracing::info!(pid, "Stopping the local Kafka broker.");
                signal(pid, Signal::TERM);
                if !self.wait_gone(pid, self.config.stop_timeout) {
                    tracing::warn!(pid, timeout = ?self.config.stop_timeout, "The broker ignored SIGTERM; sending SIGKILL.");
                    self.kill_pid(pid)?;
                }
                Some(pid)
            }
            _ => None,
        };
        let pid_file = self.path("broker.pid");
        if pid_file.exists() {
            fs::remove_file(&pid_file).map_err(io_err("removing", &pid_file))?;
        }
        Ok(stopped)
    }

    /// SIGKILL, no clean shutdown: what a machine crash looks like to the clients. The pid
    /// file stays (stale); `ensure_running` restarts on the same data.
    pub fn kill(&self) -> Result<Option<u32>> {
        let _lock = self.lock()?;
        match self.read_pid() {
            Some(pid) if self.is_alive(pid) => {
                self.kill_pid(pid)?;
                Ok(Some(pid))
            }
            _ => Ok(None),
        }
    }

    /// The last lines of `broker.log` and `broker.out`, for error messages.
    pub fn log_tail(&self) -> String {
        let mut tail = String::new();
        for name in ["broker.log", "broker.out"] {
            let path = self.path(name);
            let text = fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let start = lines.len().saturating_sub(TAIL_LINES);
            tail.push_str(&format!("--- {} ---\n", path.display()));
            for line in &lines[start..] {
                tail.push_str(line);
                tail.push('\n');
            }
        }
        tail
    }
}

/// Absolute, with symlinks and `..` resolved as far as the path exists.
fn resolve(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    if let Ok(canonical) = fs::canonicalize(&absolute) {
        return canonical;
    }
    match (absolute.parent(), absolute.file_name()) {
        (Some(parent), Some(name)) => resolve(parent).join(name),
        _ => absolute,
    }
}
