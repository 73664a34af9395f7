//! A service as its own process: its log, its exit, its metrics address, and what the
//! crash tests read from its log.

#[allow(unused_imports)]
use super::*;

/// A `sortie` child process (or another program's, e.g. [`own_executor_bin`]) whose
/// output goes to a log file under target/test-runs.
#[derive(Debug)]
pub struct Process {
    pub(crate) child: Child,
    /// The program (a supervisor starts it again).
    pub(crate) program: PathBuf,
    pub log: PathBuf,
    /// Where this spawn's output starts in the (appended) log.
    pub(crate) log_start: u64,
    /// What it was started with (a supervisor starts it again with the same).
    pub(crate) args: Vec<String>,
}

/// Starts `sortie` with `args`, its output appended to `log`.
pub(crate) fn spawn_logged(log: PathBuf, args: Vec<String>) -> Process {
    spawn_program(sortie_bin(), log, args)
}

/// Starts `program` with `args`, its output appended to `log`.
pub(crate) fn spawn_program(program: PathBuf, log: PathBuf, args: Vec<String>) -> Process {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .expect("log file");
    let log_start = file.metadata().map(|m| m.len()).unwrap_or(0);
    let child = Command::new(&program)
        .args(&args)
        .env("RUST_LOG", "info,sortie_reducer=debug")
        .stdout(Stdio::from(file.try_clone().expect("log handle")))
        .stderr(Stdio::from(file))
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {}: {e}", program.display()));
    Process {
        child,
        program,
        log,
        log_start,
        args,
    }
}

/// A process started again whenever it ends itself as wedged (status 75,
/// `sortie_kafka::watchdog::WEDGED_EXIT_CODE`), as `sortie dev` and the kubelet do. Any
/// other exit ends the supervision (the test sees the process gone).
#[derive(Debug)]
pub struct Supervised {
    process: Arc<Mutex<Process>>,
    restarts: Arc<std::sync::atomic::AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Process {
    /// Hands the process to a supervisor (see [`Supervised`]).
    pub fn supervised(self) -> Supervised {
        let process = Arc::new(Mutex::new(self));
        let restarts = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::spawn({
            let (process, restarts, stop) = (process.clone(), restarts.clone(), stop.clone());
            move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(100));
                    let mut current = process.lock().unwrap_or_else(|e| e.into_inner());
                    match current.try_exit() {
                        None => {}
                        Some(status)
                            if status.code() == Some(sortie_kafka::watchdog::WEDGED_EXIT_CODE) =>
                        {
                            eprintln!(
                                "supervisor: {} ended itself as wedged; starting it again",
                                current.log.display()
                            );
                            let again = spawn_program(
                                current.program.clone(),
                                current.log.clone(),
                                current.args.clone(),
                            );
                            *current = again;
                            restarts.fetch_add(1, Ordering::Relaxed);
                        }
                        Some(_) => return,
                    }
                }
            }
        });
        Supervised {
            process,
            restarts,
            stop,
            thread: Some(thread),
        }
    }
}

impl Supervised {
    /// How many times it was started again.
    pub fn restarts(&self) -> usize {
        self.restarts.load(Ordering::Relaxed)
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.process
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .kill();
    }
}

impl Process {
    /// Every thread's backtrace of the running process (`gdb -batch`), for a test that
    /// found it stalled; a note when gdb is missing or fails.
    pub fn backtraces(&self) -> String {
        match Command::new("gdb")
            .args([
                "-p",
                &self.pid().to_string(),
                "-batch",
                "-ex",
                "thread apply all bt",
            ])
            .output()
        {
            Ok(out) => String::from_utf8_lossy(&out.stdout).into_owned(),
            Err(e) => format!("(no backtraces: gdb: {e})"),
        }
    }
    /// SIGKILL: no chance to finish anything.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait for a clean exit.
    pub fn stop(&mut self) {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32);
        if let Some(pid) = pid {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let _ = self.child.wait();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

// ---------------------------------------------------------------- crash tests

impl Process {
    /// Waits (polling, never blocking the runtime) until the process has exited, at most
    /// `deadline`; returns its status, or `None` if it is still running.
    pub async fn wait_exit(&mut self, deadline: Duration) -> Option<std::process::ExitStatus> {
        let started = std::time::Instant::now();
        loop {
            if let Some(status) = self.try_exit() {
                return Some(status);
            }
            if started.elapsed() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// This spawn's part of its log (a restart under the same name appends to the file).
    pub fn own_log_text(&self) -> String {
        let text = self.log_text();
        text.get(self.log_start as usize..)
            .map(str::to_owned)
            .unwrap_or(text)
    }

    /// The value of `field` in each of this spawn's (a reducer's) "Partition restored
    /// from the changelog" lines, unquoted.
    pub fn restored_partitions(&self, field: &str) -> Vec<String> {
        let name = format!("{field}=");
        self.own_log_text()
            .lines()
            .filter(|l| l.contains("Partition restored from the changelog"))
            .filter_map(|l| {
                let value = &l[l.find(&name)? + name.len()..];
                Some(match value.strip_prefix('"') {
                    Some(quoted) => quoted.split('"').next()?.to_owned(),
                    None => value.split_whitespace().next()?.to_owned(),
                })
            })
            .collect()
    }

    /// How this spawn (a reducer) counted each restored partition's runs for its gauges:
    /// `snapshot` (the tally stored with the cache's marker), `restore` (a cold
    /// partition, counted as it was read) or `scan` (every cached run read back).
    pub fn gauges_counted_by(&self) -> Vec<String> {
        self.restored_partitions("gauges")
    }

    /// Waits until this spawn's `sortie_runs` gauge shows `expected` (status → runs) for
    /// every status named there.
    pub async fn wait_for_run_gauges(&self, expected: &[(&str, f64)], within: Duration) {
        let url = self.metrics_url().await;
        let what = format!("the run gauges to show {expected:?}");
        crate::wait_until(&what, within, || async {
            let metrics = scrape(&url).await;
            expected
                .iter()
                .all(|(status, n)| metric_sum(&metrics, "sortie_runs", &[("status", status)]) == *n)
        })
        .await;
    }

    /// Whether this spawn died at a fault point (its log says so).
    pub fn died_at_fault(&self) -> bool {
        // The line logged at the point itself, not the start-up warning that a fault is
        // configured.
        self.own_log_text().contains("dies here on purpose")
    }
}

/// `sortie dev`, stopped with Ctrl-C (SIGINT) when it drops — a test's end, or a failed
/// assertion unwinding — so no broker or service is left behind; killed if it has not
/// stopped within 90 s.
#[derive(Debug)]
pub struct DevStack(pub Child);

impl Drop for DevStack {
    fn drop(&mut self) {
        if !matches!(self.0.try_wait(), Ok(None)) {
            return;
        }
        if let Some(pid) = rustix::process::Pid::from_raw(self.0.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::INT);
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(90);
        while matches!(self.0.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
