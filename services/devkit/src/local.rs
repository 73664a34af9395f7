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

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;
use rustix::fs::FlockOperation;
use rustix::process::{Pid, Signal};

/// The `node.id` of a single-node broker (broker and controller in one JVM).
const NODE_ID: i32 = 1;
/// The log4j2 configuration written into every data dir (source: `dev/kafka/`).
const LOG4J2_PROPERTIES: &str = include_str!("../../../dev/kafka/log4j2.properties");
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

    fn kill_pid(&self, pid: u32) -> Result<()> {
        signal(pid, Signal::KILL);
        let timeout = Duration::from_secs(10);
        if self.wait_gone(pid, timeout) {
            Ok(())
        } else {
            Err(Error::StopTimeout { pid, timeout })
        }
    }

    fn wait_gone(&self, pid: u32, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.is_alive(pid) {
            if Instant::now() >= deadline {
                return false;
            }
            thread::sleep(Duration::from_millis(50));
        }
        true
    }

    fn read_pid(&self) -> Option<u32> {
        fs::read_to_string(self.path("broker.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Alive, not a zombie, and really this data dir's broker (pids get reused).
    fn is_alive(&self, pid: u32) -> bool {
        let Some(raw) = i32::try_from(pid).ok().and_then(Pid::from_raw) else {
            return false;
        };
        if rustix::process::test_kill_process(raw).is_err() {
            return false;
        }
        let proc_dir = PathBuf::from(format!("/proc/{pid}"));
        let Ok(stat) = fs::read_to_string(proc_dir.join("stat")) else {
            // Reaped since kill(pid, 0) answered (seen: a zombie's parent reaped it in
            // between), unless there is no procfs at all: then trust kill(pid, 0).
            return !Path::new("/proc/self/stat").exists();
        };
        // The state follows the last ')' (the command name may contain anything).
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next());
        if matches!(state, Some("Z" | "X")) {
            // A SIGKILLed JVM's leader turns zombie while its other threads still exit
            // and hold the sockets: dead only once it is the last thread.
            let status = fs::read_to_string(proc_dir.join("status")).unwrap_or_default();
            let threads = status
                .lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|n| n.trim().parse::<u32>().ok())
                .unwrap_or(1);
            return threads > 1;
        }
        // An empty command line is a process that is exiting (its memory is gone
        // already): still alive. Any other command line must be this broker's.
        let server = self.path("server.properties");
        let server = server.to_string_lossy();
        let ours = |cmdline: &str| {
            cmdline.is_empty() || (cmdline.contains("kafka.Kafka") && cmdline.contains(&*server))
        };
        // Unreadable: reaped since the stat was read.
        let Some(cmdline) = read_cmdline(&proc_dir) else {
            return false;
        };
        if ours(&cmdline) {
            return true;
        }
        // A process whose memory goes away during the read leaves the read cut short:
        // not this broker's command line, yet the broker is still exiting. Its memory
        // never comes back, so a second read is empty then; a process that reuses the
        // pid reads the same again.
        read_cmdline(&proc_dir).is_some_and(|again| ours(&again))
    }

    fn lock(&self) -> Result<FileLock> {
        FileLock::acquire(&self.path("lock"))
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

/// Several local brokers forming one KRaft cluster: node `i` (1-based) lives in
/// `<data_dir>/node-<i>`, every node is broker and controller (a voter), and the cluster
/// id is kept in `<data_dir>/cluster.id` so restarts rejoin the same cluster.
#[derive(Debug, Clone)]
pub struct LocalCluster {
    data_dir: PathBuf,
    nodes: Vec<LocalBroker>,
}

impl LocalCluster {
    /// A cluster of `ports.len()` nodes; node `i` listens on `ports[i - 1]` (PLAINTEXT,
    /// controller). Internal topics get replication factor min(nodes, 3). Creates the
    /// data dir and the cluster id if missing.
    pub fn new(
        data_dir: impl Into<PathBuf>,
        ports: &[(u16, u16)],
        pom: impl Into<PathBuf>,
        libs_dir: Option<PathBuf>,
    ) -> Result<Self> {
        let data_dir = resolve(&data_dir.into());
        fs::create_dir_all(&data_dir).map_err(io_err("creating", &data_dir))?;
        let id_file = data_dir.join("cluster.id");
        let cluster_id = match fs::read_to_string(&id_file) {
            Ok(id) if !id.trim().is_empty() => id.trim().to_owned(),
            _ => {
                let id = random_cluster_id()?;
                fs::write(&id_file, format!("{id}\n")).map_err(io_err("writing", &id_file))?;
                id
            }
        };
        let pom = pom.into();
        let voters: Vec<(i32, u16)> = ports
            .iter()
            .enumerate()
            .map(|(i, &(_, controller))| (i as i32 + 1, controller))
            .collect();
        let replication = ports.len().min(3) as u16;
        let nodes = ports
            .iter()
            .enumerate()
            .map(|(i, &(port, controller_port))| {
                let mut config =
                    BrokerConfig::new(data_dir.join(format!("node-{}", i + 1)), port, pom.clone());
                config.controller_port = controller_port;
                config.node_id = i as i32 + 1;
                config.voters = voters.clone();
                config.cluster_id = Some(cluster_id.clone());
                config.replication = replication;
                config.heap = "512m".to_owned();
                config.libs_dir = Some(libs_dir.clone().unwrap_or_else(|| data_dir.join("libs")));
                config.start_timeout = Duration::from_secs(90);
                LocalBroker::new(config)
            })
            .collect();
        Ok(Self { data_dir, nodes })
    }

    /// The node ports a cluster in `data_dir` was configured with, in node order; empty
    /// when no cluster was ever configured there.
    pub fn configured_ports(data_dir: &Path) -> Vec<(u16, u16)> {
        (1..)
            .map(|i| data_dir.join(format!("node-{i}")))
            .take_while(|dir| dir.join("server.properties").exists())
            .filter_map(|dir| {
                let port = configured_port(&dir)?;
                let text = fs::read_to_string(dir.join("server.properties")).ok()?;
                let controller = text
                    .lines()
                    .find_map(|l| l.strip_prefix("listeners="))?
                    .split(',')
                    .find_map(|l| l.strip_prefix("CONTROLLER://"))?
                    .rsplit_once(':')?
                    .1
                    .trim()
                    .parse()
                    .ok()?;
                Some((port, controller))
            })
            .collect()
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    pub fn nodes(&self) -> &[LocalBroker] {
        &self.nodes
    }

    /// Node `id` (1-based).
    pub fn node(&self, id: i32) -> Option<&LocalBroker> {
        self.nodes.iter().find(|n| n.config.node_id == id)
    }

    /// Every node's address, comma-separated: the value for `bootstrap.servers`.
    pub fn bootstrap(&self) -> String {
        self.nodes
            .iter()
            .map(LocalBroker::bootstrap)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Every node's data-dir lock, in node order (so two callers never deadlock).
    fn lock_all(&self) -> Result<Vec<FileLock>> {
        self.nodes.iter().map(LocalBroker::lock).collect()
    }

    /// Starts every node that does not run (no node can be ready before a quorum of
    /// controllers is up, so all are spawned first, then awaited) and reuses the ones
    /// that do. Serialised per node by each data dir's lock.
    pub fn ensure_running(&self) -> Result<Vec<Running>> {
        let locks = self.lock_all()?;
        let mut spawned = Vec::new();
        for node in &self.nodes {
            match node.read_pid() {
                Some(pid) if node.is_alive(pid) => spawned.push((pid, true)),
                stale => {
                    if stale.is_some() {
                        let pid_file = node.path("broker.pid");
                        fs::remove_file(&pid_file).map_err(io_err("removing", &pid_file))?;
                    }
                    match node.spawn_locked() {
                        Ok(pid) => spawned.push((pid, false)),
                        Err(error) => {
                            for (node, (pid, reused)) in self.nodes.iter().zip(&spawned) {
                                if !reused {
                                    let _ = node.kill_pid(*pid);
                                }
                            }
                            return Err(error);
                        }
                    }
                }
            }
        }
        let mut running = Vec::new();
        for (node, &(pid, reused)) in self.nodes.iter().zip(&spawned) {
            if reused {
                node.wait_ready(pid, node.config.start_timeout)?;
            } else {
                node.await_started(pid)?;
            }
            running.push(Running {
                pid,
                bootstrap: node.bootstrap(),
                reused,
            });
        }
        drop(locks);
        Ok(running)
    }

    /// Stops every node (SIGTERM, then SIGKILL after the stop timeout); data is kept.
    /// Returns the pids that were running. All nodes are told at once: the last one of a
    /// KRaft quorum cannot finish a controlled shutdown alone, so stopping them one after
    /// another would leave it waiting for the SIGKILL.
    pub fn stop(&self) -> Result<Vec<u32>> {
        let locks = self.lock_all()?;
        let mut live = Vec::new();
        for node in &self.nodes {
            if let Some(pid) = node.read_pid().filter(|&pid| node.is_alive(pid)) {
                tracing::info!(
                    pid,
                    node = node.config.node_id,
                    "Stopping a node of the local Kafka cluster."
                );
                signal(pid, Signal::TERM);
                live.push((node, pid));
            }
        }
        for (node, pid) in &live {
            if !node.wait_gone(*pid, node.config.stop_timeout) {
                tracing::warn!(pid, "A node ignored SIGTERM; sending SIGKILL.");
                node.kill_pid(*pid)?;
            }
        }
        for node in &self.nodes {
            let pid_file = node.path("broker.pid");
            if pid_file.exists() {
                fs::remove_file(&pid_file).map_err(io_err("removing", &pid_file))?;
            }
        }
        drop(locks);
        Ok(live.into_iter().map(|(_, pid)| pid).collect())
    }
}

/// Holds an exclusive `flock` until dropped (closing the file releases it). Blocks until
/// the lock is free. std opens files close-on-exec, so the broker never inherits it.
#[derive(Debug)]
struct FileLock {
    _file: File,
}

impl FileLock {
    fn acquire(path: &Path) -> Result<Self> {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(io_err("creating", dir))?;
        }
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(io_err("opening", path))?;
        rustix::fs::flock(&file, FlockOperation::LockExclusive)
            .map_err(|e| io_err("locking", path)(e.into()))?;
        Ok(Self { _file: file })
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

fn signal(pid: u32, signal: Signal) {
    if let Some(raw) = i32::try_from(pid).ok().and_then(Pid::from_raw) {
        // ESRCH (already gone) is fine: the caller polls for the exit anyway.
        let _ = rustix::process::kill_process(raw, signal);
    }
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

/// A process's command line in one `read` (`fs::read` starts with a 32-byte probe, and a
/// process exiting between two reads leaves a truncated line); `None` if unreadable.
fn read_cmdline(proc_dir: &Path) -> Option<String> {
    let mut buf = vec![0; 256 * 1024];
    let n = File::open(proc_dir.join("cmdline"))
        .and_then(|mut f| f.read(&mut buf))
        .ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

fn classpath(libs: &Path) -> String {
    // The JVM expands `dir/*` itself.
    format!("{}/*", libs.display())
}

fn missing_tool(tool: &'static str, path: &Path, source: io::Error) -> Error {
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
fn random_cluster_id() -> Result<String> {
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

#[cfg(test)]
mod liveness {
    use super::*;

    /// After SIGKILL, `is_alive` may say "alive" for a while, but once it says "gone" it
    /// must never say "alive" again: `kill` trusts the first "gone". Red before the fix
    /// (7 of 40 processes came back): a parent reaping its zombie between `kill(pid, 0)`
    /// and the read of `/proc/<pid>/stat` made the failed read count as "no procfs, so
    /// alive" (the CI flake of `local_broker_restarts_on_its_own_data`).
    #[test]
    fn a_killed_process_never_comes_back_to_life() {
        // Nothing is written there: the path only goes into the command line.
        let dir = std::env::temp_dir().join(format!("sortie-liveness-{}", std::process::id()));
        let broker = LocalBroker::new(BrokerConfig::new(&dir, 19556, "pom.xml"));
        let server = broker.path("server.properties");
        let mut flips = 0;
        for _ in 0..40 {
            // A process with threads and some memory, so that its exit takes a while;
            // its command line names this broker's server.properties.
            let mut child = Command::new("python3")
                .arg("-c")
                .arg("import threading,time\nb=bytearray(64<<20)\n[threading.Thread(target=time.sleep,args=(100,)).start() for _ in range(16)]\nprint('up',flush=True)\ntime.sleep(100)")
                .arg("kafka.Kafka")
                .arg(&server)
                .stdout(Stdio::piped())
                .spawn()
                .expect("python3");
            let mut up = [0u8; 3];
            child
                .stdout
                .take()
                .expect("stdout")
                .read_exact(&mut up)
                .expect("up");
            let pid = child.id();
            assert!(broker.is_alive(pid));
            let reaper = thread::spawn(move || child.wait());
            signal(pid, Signal::KILL);
            let mut gone = false;
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                let alive = broker.is_alive(pid);
                if gone && alive {
                    flips += 1;
                    break;
                }
                gone |= !alive;
                if gone && reaper.is_finished() {
                    break;
                }
            }
            reaper.join().expect("reaper").expect("wait");
        }
        assert_eq!(flips, 0, "a process said gone, then alive again");
    }
}
