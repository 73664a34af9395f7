//! CPU time and memory of processes, from `/proc` (Linux).

use std::time::Instant;

use serde_json::{json, Value};

use crate::stats::round;

/// A `/proc/<pid>[/task/<tid>]/stat` line, read: the command (thread) name, the CPU ticks
/// (user + system) used so far, and the minor page faults taken so far (every first
/// touch of a page the kernel hands out is one, zeroed).
struct Stat<'a> {
    name: &'a str,
    ticks: u64,
    minor_faults: u64,
}

fn parse_stat(stat: &str) -> Option<Stat<'_>> {
    // The name is in parentheses and may hold spaces: count fields after it.
    let (open, close) = (stat.find('(')?, stat.rfind(')')?);
    let fields: Vec<&str> = stat.get(close + 2..)?.split_whitespace().collect();
    // Fields 10 (minflt), 14 (utime) and 15 (stime) of proc(5); `fields` starts at
    // field 3.
    let field = |n: usize| -> Option<u64> { fields.get(n - 3)?.parse().ok() };
    Some(Stat {
        name: stat.get(open + 1..close)?,
        ticks: field(14)? + field(15)?,
        minor_faults: field(10)?,
    })
}

fn read_stat(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()
}

fn seconds(ticks: u64) -> f64 {
    ticks as f64 / rustix::param::clock_ticks_per_second() as f64
}

/// The CPU seconds (user + system) a process has used and the minor page faults it has
/// taken so far, from one read of its `stat`.
fn usage(pid: u32) -> (Option<f64>, Option<u64>) {
    read_stat(pid)
        .as_deref()
        .and_then(parse_stat)
        .map(|stat| (seconds(stat.ticks), stat.minor_faults))
        .unzip()
}

/// CPU seconds the JIT compiler threads of the JVM `pid` (`C1 CompilerThre…`,
/// `C2 CompilerThre…`: thread names are cut at 15 bytes) have used so far.
pub fn jit_cpu_seconds(pid: u32) -> Option<f64> {
    let mut ticks = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let Ok(stat) = std::fs::read_to_string(task.ok()?.path().join("stat")) else {
            continue; // the thread ended meanwhile
        };
        match parse_stat(&stat) {
            Some(Stat {
                name, ticks: used, ..
            }) if name.starts_with("C1 CompilerThre") || name.starts_with("C2 CompilerThre") => {
                ticks += used
            }
            _ => {}
        }
    }
    Some(seconds(ticks))
}

/// `(VmRSS, VmHWM)` of a process in MiB: resident now, and the peak.
pub fn rss_mib(pid: u32) -> Option<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<f64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib / 1024.0)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// `(busy, total)` jiffies of the whole machine (all CPUs), from `/proc/stat`.
fn machine_jiffies() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?;
    let values: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let total: u64 = values.iter().take(8).sum();
    // idle + iowait are not busy.
    let idle = values.get(3).copied().unwrap_or(0) + values.get(4).copied().unwrap_or(0);
    Some((total.saturating_sub(idle), total))
}

/// The number of CPUs this process may run on.
pub fn cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// The 1-minute load average.
pub fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0.0)
}

/// CPU use of named processes and of the whole machine over a window.
#[derive(Debug)]
pub struct CpuWindow {
    started: Instant,
    machine: Option<(u64, u64)>,
    /// (name, pid, CPU seconds, minor page faults) at the start.
    processes: Vec<(String, u32, Option<f64>, Option<u64>)>,
}

impl CpuWindow {
    /// Starts a window over `processes` (name, pid).
    pub fn start(processes: &[(String, u32)]) -> CpuWindow {
        CpuWindow {
            started: Instant::now(),
            machine: machine_jiffies(),
            processes: processes
                .iter()
                .map(|(name, pid)| {
                    let (cpu, faults) = usage(*pid);
                    (name.clone(), *pid, cpu, faults)
                })
                .collect(),
        }
    }

    /// `{"<name>": {"cpu_cores", "page_faults_per_s", "rss_mib", "rss_peak_mib"}, ...,
    /// "machine_busy"}`: cores are CPU seconds per wall second over the window (2.0 = both
    /// cores of a 2-core machine); page faults are minor ones, per wall second.
    pub fn finish(&self) -> Value {
        let wall = self.started.elapsed().as_secs_f64().max(1e-9);
        let mut out = serde_json::Map::new();
        for (name, pid, before, faults_before) in &self.processes {
            let (cpu, faults) = usage(*pid);
            let cores = match (before, cpu) {
                (Some(before), Some(after)) => Some(round((after - before) / wall)),
                _ => None,
            };
            let faults = match (faults_before, faults) {
                (Some(before), Some(after)) => {
                    Some(round(after.saturating_sub(*before) as f64 / wall))
                }
                _ => None,
            };
            let (rss, peak) = rss_mib(*pid).unzip();
            out.insert(
                name.clone(),
                json!({
                    "cpu_cores": cores,
                    "page_faults_per_s": faults,
                    "rss_mib": rss.map(round),
                    "rss_peak_mib": peak.map(round),
                }),
            );
        }
        let busy = match (self.machine, machine_jiffies()) {
            (Some((b0, t0)), Some((b1, t1))) if t1 > t0 => {
                Some(round((b1 - b0) as f64 / (t1 - t0) as f64))
            }
            _ => None,
        };
        out.insert("machine_busy".into(), json!(busy));
        Value::Object(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jit_time_counts_only_compiler_threads() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        let spin = |name: &str, stop: Arc<AtomicBool>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || while !stop.load(Ordering::Relaxed) {})
                .expect("thread")
        };
        let stop = Arc::new(AtomicBool::new(false));
        // Linux keeps 15 bytes of a thread's name, as of the JVM's "C2 CompilerThread0".
        let compiler = spin("C2 CompilerThread0", stop.clone());
        let other = spin("busy", stop.clone());
        let deadline = Instant::now() + std::time::Duration::from_secs(20);
        let (jit, all) = loop {
            let jit = jit_cpu_seconds(std::process::id()).expect("own threads");
            let all = usage(std::process::id()).0.expect("own process");
            if jit > 0.1 || Instant::now() > deadline {
                break (jit, all);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        stop.store(true, Ordering::Relaxed);
        compiler.join().expect("compiler thread");
        other.join().expect("other thread");
        assert!(jit > 0.1, "the compiler thread's time: {jit}");
        assert!(jit < all - 0.05, "only the compiler thread: {jit} of {all}");
        assert_eq!(jit_cpu_seconds(u32::MAX), None);
    }

    /// Seen red reading the field before minflt (9 of proc(5), `flags`: it does not
    /// grow).
    #[test]
    fn minor_faults_grow_as_a_process_touches_new_pages() {
        let pid = std::process::id();
        let before = usage(pid).1.expect("own process");
        // 64 MiB of fresh pages, each touched once.
        let mut pages = vec![0u8; 64 << 20];
        for page in pages.chunks_mut(4096) {
            page[0] = 1;
        }
        std::hint::black_box(&pages);
        let after = usage(pid).1.expect("own process");
        assert!(after >= before + 8_000, "{before} -> {after}");
        assert_eq!(usage(u32::MAX), (None, None));
    }
}
