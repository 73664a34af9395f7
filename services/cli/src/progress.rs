//! Progress of long operations, for people: one line on stderr, rewritten in place, and
//! only when stderr is a terminal. Into a pipe or a log nothing is written, so scripts and
//! CI see exactly what they saw before.

use std::future::Future;
use std::io::{IsTerminal as _, Write as _};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Whether a progress line is on the screen (it must be cleared before other output).
static SHOWN: AtomicBool = AtomicBool::new(false);

/// Shows `text` as the progress line (replacing the previous one); `""` clears it. A
/// plain `fn(&str)`, so crates that know nothing of terminals can be handed it.
pub fn line(text: &str) {
    let stderr = std::io::stderr();
    if !stderr.is_terminal() {
        return;
    }
    let mut stderr = stderr.lock();
    // \r: back to the line's start; ESC[2K: erase the line.
    let _ = write!(stderr, "\r\x1b[2K{text}");
    let _ = stderr.flush();
    SHOWN.store(!text.is_empty(), Ordering::Relaxed);
}

/// Clears the progress line if one is shown.
pub fn clear() {
    if SHOWN.load(Ordering::Relaxed) {
        line("");
    }
}

/// Awaits `work`, showing `label` and the seconds elapsed on a terminal while it runs.
pub async fn during<T>(label: &str, work: impl Future<Output = T>) -> T {
    if !std::io::stderr().is_terminal() {
        return work.await;
    }
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    tokio::pin!(work);
    loop {
        tokio::select! {
            out = &mut work => {
                clear();
                return out;
            }
            _ = tick.tick() => line(&format!("{label} … {:.1} s", started.elapsed().as_secs_f64())),
        }
    }
}
