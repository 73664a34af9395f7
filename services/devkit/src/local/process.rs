//! The broker's process seen from outside: its pid file, whether it is alive (and really
//! this data dir's broker), the signals that stop it, and the data dir's `flock`.

use std::fs::{self, File, OpenOptions};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use rustix::fs::FlockOperation;
use rustix::process::{Pid, Signal};

use super::{io_err, Error, LocalBroker, Result};

impl LocalBroker {
    pub(super) fn kill_pid(&self, pid: u32) -> Result<()> {
        signal(pid, Signal::KILL);
        let timeout = Duration::from_secs(10);
        if self.wait_gone(pid, timeout) {
            Ok(())
        } else {
            Err(Error::StopTimeout { pid, timeout })
        }
    }

    pub(super) fn wait_gone(&self, pid: u32, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.is_alive(pid) {
            if Instant::now() >= deadline {
                return false;
            }
            thread::sleep(Duration::from_millis(50));
        }
        true
    }

    pub(super) fn read_pid(&self) -> Option<u32> {
        fs::read_to_string(self.path("broker.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Alive, not a zombie, and really this data dir's broker (pids get reused).
    pub(super) fn is_alive(&self, pid: u32) -> bool {
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

    pub(super) fn lock(&self) -> Result<FileLock> {
        FileLock::acquire(&self.path("lock"))
    }
}

/// Holds an exclusive `flock` until dropped (closing the file releases it). Blocks until
/// the lock is free. std opens files close-on-exec, so the broker never inherits it.
#[derive(Debug)]
pub(super) struct FileLock {
    _file: File,
}

impl FileLock {
    pub(super) fn acquire(path: &Path) -> Result<Self> {
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

pub(super) fn signal(pid: u32, signal: Signal) {
    if let Some(raw) = i32::try_from(pid).ok().and_then(Pid::from_raw) {
        // ESRCH (already gone) is fine: the caller polls for the exit anyway.
        let _ = rustix::process::kill_process(raw, signal);
    }
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

#[cfg(test)]
mod liveness {
    use std::process::{Command, Stdio};

    use super::*;
    use crate::local::BrokerConfig;

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
