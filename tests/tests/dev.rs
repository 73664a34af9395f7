//! `sortie dev` on its own data dir and ports: it brings the whole stack up from nothing,
//! stops at the demo's approval, the printed CLI approval finishes the run, and Ctrl-C
//! stops every process cleanly.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

fn free_port() -> u16 {
    // Broker and controller need two consecutive free ports.
    (0..200)
        .map(|i| 23_000 + i * 7)
        .find(|p| {
            std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok()
                && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok()
        })
        .expect("a free port pair")
}

fn free_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").to_string()
}

#[test]
fn sortie_dev_runs_the_demo_to_its_approval_and_stops_cleanly() {
    let bin = sortie_tests::stack::sortie_bin();
    let data = sortie_tests::workspace_root()
        .join("target/test-runs")
        .join(sortie_tests::unique_prefix("dev").trim_end_matches('.'));
    let gateway = free_addr();
    let kafka_port = free_port();
    let mut child = Command::new(&bin)
        .args([
            "dev",
            "--data-dir",
            data.to_str().expect("utf-8"),
            "--gateway-addr",
            &gateway,
            "--kafka-port",
            &kafka_port.to_string(),
            "--registry-addr",
            &free_addr(),
            "--ledger-addr",
            &free_addr(),
            "--token",
            "test-token",
        ])
        .current_dir(sortie_tests::workspace_root())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("sortie dev starts");
    let stdout = child.stdout.take().expect("stdout");
    let (lines, received) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let mut approve = None;
    let mut seen = Vec::new();
    while approve.is_none() {
        let line = received
            .recv_timeout(Duration::from_secs(180))
            .unwrap_or_else(|_| {
                panic!(
                    "sortie dev printed no approval command; output so far:\n{}",
                    seen.join("\n")
                )
            });
        if line.contains(" approve run_") {
            approve = Some(line.trim().to_owned());
        }
        seen.push(line);
    }
    // The printed command is `cargo run -q -p sortie -- run --token T approve RUN`: run the
    // same subcommand with the built binary, against this gateway.
    let printed = approve.expect("line");
    let tail = printed.split(" -- ").nth(1).expect("a sortie command");
    let mut args: Vec<&str> = tail.split_whitespace().collect();
    let gateway_url = format!("http://{gateway}");
    args.insert(1, "--gateway");
    args.insert(2, &gateway_url);
    let approved = Command::new(&bin)
        .args(&args)
        .output()
        .expect("approve runs");
    assert!(
        approved.status.success(),
        "approve failed: {}",
        String::from_utf8_lossy(&approved.stderr)
    );
    let run_id = args.last().expect("run id").to_string();
    let watched = Command::new(&bin)
        .args([
            "run",
            "--gateway",
            &gateway_url,
            "--token",
            "test-token",
            "watch",
            &run_id,
        ])
        .output()
        .expect("watch runs");
    let history = String::from_utf8_lossy(&watched.stdout);
    assert!(
        history.contains("\"SUCCEEDED\""),
        "the demo did not finish: {history}"
    );

    let pid = rustix::process::Pid::from_raw(child.id() as i32).expect("pid");
    rustix::process::kill_process(pid, rustix::process::Signal::INT).expect("SIGINT");
    let status = child.wait().expect("sortie dev exits");
    assert!(
        status.success(),
        "sortie dev did not stop cleanly: {status}"
    );
    let rest: Vec<String> = received.try_iter().collect();
    assert!(
        rest.iter().any(|l| l.contains("kafka     stopped")),
        "{rest:?}"
    );
}
