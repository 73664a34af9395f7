//! What writing a run's state costs per input, as the reducer writes it after every input
//! that changed the run: `serde_json::to_string` against `RunState::to_json_reusing`
//! (unchanged steps' JSON copied from the previous write); and what measuring it costs,
//! as the fold measures every state it writes: `limits::measure` against
//! `limits::measure_state` (unchanged steps' measures remembered).
//!
//! ```sh
//! cargo run --release -p sortie-core --example state_write
//! ```
//!
//! Each input of the simulated run settles the newest step (its output set) and adds the
//! next (dispatched), as a sequential run's step results do; arguments and outputs are
//! `--payload` bytes of text (256 as in `sortie bench`). Prints µs per write and per
//! measure for runs of 5, 20, 50 and 200 steps (the mean over the whole run, every input
//! written and measured once).

use std::sync::Arc;
use std::time::Instant;

use serde_json::json;
use sortie_core::limits::{self, MeasuredSteps};
use sortie_core::state::{Step, StepStatus, WrittenSteps};
use sortie_core::RunState;

fn state() -> RunState {
    serde_json::from_value(json!({
        "tenant": "acme", "run_id": "run-0001", "graph_id": "echo5", "graph_version": 1,
        "status": "RUNNING", "version": 1, "last_event_seq": 1, "last_hash": "0".repeat(64),
        "created_at": 0, "updated_at": 0, "started_by": "bench", "labels": {},
        "input": {"text": "x".repeat(256)}, "deadline_at": null, "steps": {}, "completed": [],
        "interrupts": {}, "timers": {}, "commands": {}, "ending": null, "output": null
    }))
    .expect("state")
}

fn step(i: usize, payload: usize) -> Step {
    serde_json::from_value(json!({
        "step_id": format!("s{i}#1"), "node": format!("s{i}"),
        "operation_id": format!("{:064x}", i), "attempt": 1, "tool": "echo",
        "queue": "default", "side_effect": "pure", "args": {"text": "y".repeat(payload)},
        "role": "Node", "status": "in_flight", "output": null, "error": null
    }))
    .expect("step")
}

/// Mean µs per write over a run of `steps` steps, writing with `write` (what it returns:
/// the bytes written, or measured).
fn run(steps: usize, payload: usize, mut write: impl FnMut(&RunState) -> usize) -> f64 {
    let rounds = (20_000 / steps).max(20);
    let mut writes = 0u64;
    let mut bytes = 0usize;
    let started = Instant::now();
    for _ in 0..rounds {
        let mut run = state();
        for i in 0..steps {
            if i > 0 {
                let prev = format!("s{}#1", i - 1);
                let done = Arc::make_mut(run.steps.get_mut(&prev).expect("step"));
                done.status = StepStatus::Succeeded;
                done.output = Some(json!({"text": "z".repeat(payload)}));
                run.completed.push(prev);
            }
            run.steps
                .insert(format!("s{i}#1"), Arc::new(step(i, payload)));
            run.version += 1;
            bytes += write(&run);
            writes += 1;
        }
    }
    std::hint::black_box(bytes);
    started.elapsed().as_secs_f64() * 1e6 / writes as f64
}

fn main() {
    let payload = std::env::args()
        .skip_while(|a| a != "--payload")
        .nth(1)
        .map_or(256, |p| p.parse().expect("--payload <bytes>"));
    println!("µs per input (payload {payload} bytes)");
    println!("steps  to_string  to_json_reusing  measure  measure_state");
    for steps in [5, 20, 50, 200] {
        let plain = run(steps, payload, |s| {
            serde_json::to_string(s).expect("json").len()
        });
        let mut written = WrittenSteps::default();
        let reusing = run(steps, payload, |s| {
            s.to_json_reusing(&mut written).expect("json").len()
        });
        let measure = run(steps, payload, |s| limits::measure(s).bytes);
        let mut measured = MeasuredSteps::default();
        let remembered = run(steps, payload, |s| {
            limits::measure_state(s, &mut measured).bytes
        });
        println!("{steps:>5}  {plain:>9.2}  {reusing:>15.2}  {measure:>7.2}  {remembered:>13.2}");
    }
}
