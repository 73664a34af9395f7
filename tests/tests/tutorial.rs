//! `docs/guides/first-agent.md`, run as written: every `sh` block of the page, in order, in
//! one bash session, in an empty directory outside the checkout, against a `sortie dev`
//! of its own — so the tutorial cannot drift from what Sortie does.
//!
//! The one block the page marks "not run by tests/tests/tutorial.rs" (starting the stack
//! in the checkout) is replaced by starting `sortie dev` here, on a data directory of this
//! test; `~/sortie/target/dev` (what the page sources) is that directory, under a home of
//! the test's own. The dev receiver keeps its documented address, `127.0.0.1:8090`, which
//! the page's graph names: the test fails, saying so, when something else holds it.
//!
//! Seen red: with the page's `audit why` naming a node the run does not have.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const PAGE: &str = "docs/guides/first-agent.md";
const SKIP: &str = "not run by tests/tests/tutorial.rs";
const RECEIVER: &str = "127.0.0.1:8090";

/// The page's `sh` blocks, in order, without the ones marked [`SKIP`].
fn blocks(page: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut lines = page.lines();
    let mut skip_next = false;
    while let Some(line) = lines.next() {
        if line.contains(SKIP) {
            skip_next = true;
        } else if line.trim() == "```sh" {
            let block: Vec<&str> = lines.by_ref().take_while(|l| l.trim() != "```").collect();
            if !std::mem::take(&mut skip_next) {
                blocks.push(block.join("\n"));
            }
        }
    }
    blocks
}

fn free_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").to_string()
}

/// Broker and controller need two consecutive free ports.
fn free_port_pair() -> u16 {
    (0..400)
        .map(|i| 41_000 + i * 3)
        .find(|p| {
            std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok()
                && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok()
        })
        .expect("a free port pair")
}

/// Starts `sortie dev --no-demo` on `data` and waits for it to print where its env file is.
fn start_dev(data: &Path) -> sortie_tests::stack::DevStack {
    let mut child = Command::new(sortie_tests::stack::sortie_bin())
        .args(["dev", "--no-demo", "--data-dir"])
        .arg(data)
        .args(["--gateway-addr", &free_addr()])
        .args(["--registry-addr", &free_addr()])
        .args(["--kafka-port", &free_port_pair().to_string()])
        .args(["--ledger-addr", RECEIVER])
        .current_dir(sortie_tests::workspace_root())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("sortie dev starts");
    let stdout = child.stdout.take().expect("stdout");
    let stack = sortie_tests::stack::DevStack(child);
    let (lines, received) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    loop {
        let line = received
            .recv_timeout(Duration::from_secs(180))
            .unwrap_or_else(|_| panic!("sortie dev did not come up:\n{}", seen.join("\n")));
        if line.trim_start().starts_with("elsewhere source ") {
            break;
        }
        seen.push(line);
    }
    // Drain the rest so sortie dev never blocks on a full pipe.
    std::thread::spawn(move || for _ in received {});
    stack
}

#[test]
fn the_first_agent_tutorial_runs_as_written() {
    let root = sortie_tests::workspace_root();
    let page = std::fs::read_to_string(root.join(PAGE)).expect("the tutorial");
    let blocks = blocks(&page);
    assert!(
        blocks.len() >= 8,
        "{PAGE} has fewer sh blocks than expected: {blocks:#?}"
    );
    assert!(
        std::net::TcpListener::bind(RECEIVER).is_ok(),
        "{RECEIVER}, the dev receiver's address the tutorial's graph names, is taken \
         (a `sortie dev` of yours?): stop it to run this test"
    );

    let base: PathBuf = root
        .join("target/test-runs")
        .join(sortie_tests::unique_prefix("tutorial").trim_end_matches('.'));
    let (home, work, data) = (base.join("home"), base.join("work"), base.join("dev"));
    for dir in [&home.join("sortie/target"), &work, &data] {
        std::fs::create_dir_all(dir).expect("test dirs");
    }
    std::os::unix::fs::symlink(&data, home.join("sortie/target/dev")).expect("symlink");
    let _stack = start_dev(&data);

    let script = format!("set -euo pipefail\nset -x\n{}\n", blocks.join("\n"));
    std::fs::write(base.join("tutorial.sh"), &script).expect("script");
    let out = Command::new("bash")
        .arg(base.join("tutorial.sh"))
        .current_dir(&work)
        .env("HOME", &home)
        .env("RUST_BACKTRACE", "0")
        .env_remove("SORTIE_TOKEN")
        .output()
        .expect("bash runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "the tutorial failed ({}):\n--- stdout\n{stdout}\n--- stderr (each command after +)\n{stderr}",
        out.status
    );
    // What the page says happens, happened.
    for expected in [
        "ord-7-refund waiting_approval",
        "ord-7-refund succeeded",
        "tool refund        [succeeded]",
        "every link holds",
    ] {
        assert!(
            stdout.contains(expected),
            "{expected:?} not printed:\n{stdout}"
        );
    }
    assert!(
        stderr.contains("published my-agent@1") || stdout.contains("published my-agent@1"),
        "{stdout}\n{stderr}"
    );
    // One refund: the fork asked again and was rejected (the ledger count is the page's
    // last number before `audit why`).
    let counted = stdout
        .lines()
        .filter_map(|l| l.trim().parse::<u32>().ok())
        .next_back();
    assert_eq!(counted, Some(1), "the ledger's refunds:\n{stdout}");
    assert!(work.join("my-agent/my-agent.yaml").exists());
}
