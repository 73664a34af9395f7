//! CPU time and memory of processes, from `/proc` (Linux).

use std::time::Instant;

use serde_json::{json, Value};

use crate::stats::round;

/// CPU seconds (user + system) a process has used so far.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: count fields after it.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 (utime) and 15 (stime) of proc(5); `rest` starts at field 3.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) as f64 / rustix::param::clock_ticks_per_second() as f64)
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
    processes: Vec<(String, u32, Option<f64>)>,
}

impl CpuWindow {
    /// Starts a window over `processes` (name, pid).
    pub fn start(processes: &[(String, u32)]) -> CpuWindow {
        CpuWindow {
            started: Instant::now(),
            machine: machine_jiffies(),
            processes: processes
                .iter()
                .map(|(name, pid)| (name.clone(), *pid, cpu_seconds(*pid)))
                .collect(),
        }
    }

    /// `{"<name>": {"cpu_cores", "rss_mib", "rss_peak_mib"}, ..., "machine_busy"}`: cores are
    /// CPU seconds per wall second over the window (2.0 = both cores of a 2-core machine).
    pub fn finish(&self) -> Value {
        let wall = self.started.elapsed().as_secs_f64().max(1e-9);
        let mut out = serde_json::Map::new();
        for (name, pid, before) in &self.processes {
            let cores = match (before, cpu_seconds(*pid)) {
                (Some(before), Some(after)) => Some(round((after - before) / wall)),
                _ => None,
            };
            let (rss, peak) = rss_mib(*pid).unzip();
            out.insert(
                name.clone(),
                json!({
                    "cpu_cores": cores,
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
