//! Every `sortie` verb that cannot work says why and exits non-zero: run the way a
//! newcomer gets it wrong — nothing running, a closed port (127.0.0.1:1), a URL without
//! its scheme, no token, a page that is not the gateway's, a missing file, an empty id —
//! each command fails within seconds, and its message names the cause: the address, the
//! flag to change, the file. No broker: nothing here listens but the small fakes below
//! (an HTTP answer the gateway would give, a port that only accepts).
//!
//! Seen red: with `sortie run`'s client taking a success whose body is not JSON as `null`
//! again (as it did before), `run get --json` against a web page exited 0 printing
//! `null`, and `the_gateway_verbs_say_what_is_wrong` failed there; with the fix restored
//! it passes. Before the fixes, the Kafka cases failed after 10 to 60 s without the flag.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A closed port: nothing listens on 127.0.0.1:1.
const CLOSED: &str = "127.0.0.1:1";
/// How long any of these commands may take to fail.
const BOUND: Duration = Duration::from_secs(30);

/// What a `sortie` run left: its exit, its stderr, how long it took.
struct Ran {
    args: Vec<String>,
    success: bool,
    stdout: String,
    stderr: String,
    took: Duration,
}

impl Ran {
    /// Failed, within [`BOUND`], with every one of `needles` in its stderr.
    fn fails_saying(&self, needles: &[&str]) {
        assert!(
            !self.success,
            "{:?} exited 0 (stdout {:?}, stderr {:?})",
            self.args, self.stdout, self.stderr
        );
        assert!(
            self.took < BOUND,
            "{:?} took {:?} to fail",
            self.args,
            self.took
        );
        for needle in needles {
            assert!(
                self.stderr.contains(needle),
                "{:?}: the message does not name {needle:?}:\n{}",
                self.args,
                self.stderr
            );
        }
        assert!(
            !self.stderr.contains("panicked"),
            "{:?} panicked:\n{}",
            self.args,
            self.stderr
        );
    }
}

/// Starts `sortie args` in `dir` with none of the `SORTIE*` variables of this environment
/// (a token or address set here would hide what a newcomer sees).
fn start(dir: &Path, args: &[&str]) -> (Vec<String>, std::process::Child, Instant) {
    let mut command = Command::new(sortie_tests::stack::sortie_bin());
    command
        .args(args)
        .current_dir(dir)
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (name, _) in std::env::vars() {
        if name.starts_with("SORTIE") {
            command.env_remove(name);
        }
    }
    let child = command.spawn().expect("sortie starts");
    (
        args.iter().map(|a| a.to_string()).collect(),
        child,
        Instant::now(),
    )
}

/// Runs every command of `cases` at once (they mostly wait) and collects them; one that
/// has not ended after [`BOUND`] and a margin is killed and reported as it was.
fn run_all(dir: &Path, cases: &[Vec<&str>]) -> Vec<Ran> {
    let started: Vec<_> = cases.iter().map(|args| start(dir, args)).collect();
    started
        .into_iter()
        .map(|(args, child, at)| {
            let pid = child.id();
            let (send, receive) = mpsc::channel();
            std::thread::spawn(move || {
                let _ = send.send(child.wait_with_output());
            });
            let left = (BOUND + Duration::from_secs(15)).saturating_sub(at.elapsed());
            let output = match receive.recv_timeout(left) {
                Ok(output) => output.expect("sortie ran"),
                Err(_) => {
                    if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
                        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                    }
                    receive.recv().expect("killed").expect("sortie ran")
                }
            };
            Ran {
                args,
                success: output.status.success(),
                stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
                took: at.elapsed(),
            }
        })
        .collect()
}

fn run(dir: &Path, args: &[&str]) -> Ran {
    run_all(dir, &[args.to_vec()]).pop().expect("one")
}

/// An HTTP server on a free port that answers every request with `status`,
/// `content_type` and `body`, then closes the connection. Returns its base URL.
fn fake(status: &'static str, content_type: &'static str, body: &'static str) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut reader = BufReader::new(&stream);
                let mut length = 0usize;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                    if let Some((name, value)) = line.split_once(':') {
                        if name.eq_ignore_ascii_case("content-length") {
                            length = value.trim().parse().unwrap_or(0);
                        }
                    }
                }
                // The body read whole, so closing does not reset the answer.
                let mut body_in = vec![0u8; length];
                let _ = reader.read_exact(&mut body_in);
                let answer = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = (&stream).write_all(answer.as_bytes());
            });
        }
    });
    url
}

#[test]
fn the_gateway_verbs_say_what_is_wrong() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let nothing = format!("http://{CLOSED}");
    // What the gateway answers a request without a token.
    let no_token = fake(
        "401 Unauthorized",
        "application/json",
        r#"{"error": {"code": "unauthenticated", "message": "an Authorization: Bearer token is required"}}"#,
    );
    // A web page where the gateway was expected (a console URL, another service).
    let page = fake("200 OK", "text/html", "<html>a console</html>");
    // An event stream that ends before the run does (a gateway that stopped).
    let cut = fake(
        "200 OK",
        "text/event-stream",
        "id: 1\nevent: RunStarted\ndata: {\"seq\": 1, \"at\": 0, \"body\": {\"RunStarted\": {}}}\n\n",
    );

    // Nothing listens: the address and the flag (get, watch, a write, and wait, which
    // used to ask again for its whole 120 s).
    for verb in [
        vec!["get", "run-1"],
        vec!["watch", "run-1"],
        vec!["cancel", "run-1"],
        vec!["wait", "run-1"],
    ] {
        let mut args = vec!["run", "--gateway", &nothing, "--token", "t"];
        args.extend(verb);
        run(dir, &args).fails_saying(&[&nothing, "--gateway"]);
    }
    // Not a URL: said before anything is sent.
    run(dir, &["run", "--gateway", "localhost:8080", "get", "run-1"])
        .fails_saying(&["localhost:8080", "--gateway"]);
    // No token: the gateway's 401, and the flag that gives one (wait does not ask again).
    run(dir, &["run", "--gateway", &no_token, "start", "refund"]).fails_saying(&["401", "--token"]);
    let waited = run(dir, &["run", "--gateway", &no_token, "wait", "run-1"]);
    waited.fails_saying(&["401", "--token"]);
    assert!(waited.took < Duration::from_secs(10), "{:?}", waited.took);
    // An empty token (`--token $UNSET`, `SORTIE_TOKEN=`).
    run(
        dir,
        &[
            "run",
            "--gateway",
            &no_token,
            "--token",
            "",
            "start",
            "refund",
        ],
    )
    .fails_saying(&["token is empty", "--token"]);
    // A page that is not the gateway's: not `null` and exit 0.
    for verb in [vec!["get", "run-1", "--json"], vec!["cancel", "run-1"]] {
        let mut args = vec!["run", "--gateway", &page, "--token", "t"];
        args.extend(verb);
        run(dir, &args).fails_saying(&[&page, "not the gateway's JSON", "--gateway"]);
    }
    // A stream that ends before the run: not the run's end.
    run(
        dir,
        &["run", "--gateway", &cut, "--token", "t", "watch", "run-1"],
    )
    .fails_saying(&["closed the event stream before run run-1 ended"]);
    // What the CLI can tell by itself.
    run(
        dir,
        &[
            "run",
            "--gateway",
            &nothing,
            "wait",
            "run-1",
            "--status",
            "done",
        ],
    )
    .fails_saying(&["--status done", "waiting_approval"]);
    run(dir, &["run", "--gateway", &nothing, "list", "--limit", "0"]).fails_saying(&["--limit"]);
    run(
        dir,
        &[
            "run",
            "--gateway",
            &nothing,
            "start",
            "refund",
            "--input",
            "{x",
        ],
    )
    .fails_saying(&["--input is not JSON"]);
}

#[test]
fn kafka_and_registry_verbs_fail_in_seconds_naming_the_address_and_flag() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let root = sortie_tests::workspace_root();
    let topics = root.join("topology/topics.yaml");
    let graph = root.join("topology/graphs/refund.yaml");
    let (topics, graph) = (
        topics.to_str().expect("utf-8"),
        graph.to_str().expect("utf-8"),
    );
    // A port that accepts connections (as a broker's would) for the registry's case.
    let accepts = TcpListener::bind("127.0.0.1:0").expect("bind");
    let accepts = accepts.local_addr().expect("addr").to_string();
    let registry = format!("http://{CLOSED}");
    let kafka = ["--bootstrap-servers", CLOSED];
    let data = dir.join("data");
    let data = data.to_str().expect("utf-8");
    let mut cases: Vec<Vec<&str>> = vec![
        vec!["topology", "check", "--file", topics],
        vec!["topology", "apply", "--file", topics],
        vec!["graph", "list"],
        vec!["graph", "publish", graph, "--unsigned"],
        vec!["audit", "replay"],
        vec!["audit", "why", "op-1"],
        vec!["replay", "shadow"],
    ];
    for case in &mut cases {
        case.extend(kafka);
    }
    let flagged = cases.len();
    cases.push(vec![
        "graph",
        "list",
        "--bootstrap-servers",
        &accepts,
        "--registry-url",
        &registry,
    ]);
    cases.push(vec![
        "bench",
        "--quick",
        "--bootstrap",
        CLOSED,
        "--data-dir",
        data,
    ]);
    cases.push(vec![
        "fuzz",
        "--cases",
        "1",
        "--bootstrap",
        CLOSED,
        "--data-dir",
        data,
    ]);
    let ran = run_all(dir, &cases);
    for one in &ran[..flagged] {
        one.fails_saying(&["cannot reach Kafka at 127.0.0.1:1", "--bootstrap-servers"]);
    }
    ran[flagged].fails_saying(&["schema registry at http://127.0.0.1:1", "--registry-url"]);
    for one in &ran[flagged + 1..] {
        one.fails_saying(&["cannot reach Kafka at 127.0.0.1:1", "--bootstrap"]);
    }
}

#[test]
fn local_verbs_refuse_what_cannot_work() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir = dir.path();
    let path = |name: &str| dir.join(name).to_str().expect("utf-8").to_owned();
    let (secret, keyring) = (path("k.key"), path("keyring.yaml"));
    let key = |id: &'static str, tenant: &'static str| {
        vec![
            "keys",
            "new",
            "--id",
            id,
            "--principal",
            "svc:p",
            "--tenant",
            tenant,
        ]
    };

    // keys: an id nobody can name, and a keyring that cannot be written.
    let mut args = key("", "acme");
    args.extend(["--secret", &secret, "--keyring", &keyring]);
    run(dir, &args).fails_saying(&["--id is empty"]);
    let mut args = key("k1", " acme");
    args.extend(["--secret", &secret, "--keyring", &keyring]);
    run(dir, &args).fails_saying(&["--tenant"]);
    let nowhere = path("missing/keyring.yaml");
    let mut args = key("k1", "acme");
    args.extend(["--secret", &secret, "--keyring", &nowhere]);
    run(dir, &args).fails_saying(&["--keyring", &nowhere, "does not exist"]);
    assert!(
        !Path::new(&secret).exists(),
        "a secret was left without its keyring entry"
    );
    let broken = path("broken.yaml");
    std::fs::write(&broken, "keys: [").expect("write");
    let mut args = key("k1", "acme");
    args.extend(["--secret", &secret, "--keyring", &broken]);
    run(dir, &args).fails_saying(&["--keyring", &broken]);
    run(
        dir,
        &[
            "keys",
            "kek",
            "--tenant",
            "",
            "--id",
            "k",
            "--keyring",
            &path("kek.yaml"),
        ],
    )
    .fails_saying(&["--tenant is empty"]);

    // The services: what they are given is checked before they start.
    run(
        dir,
        &["executor", "--queue", "", "--bootstrap-servers", CLOSED],
    )
    .fails_saying(&["--queue"]);
    run(
        dir,
        &[
            "gateway",
            "--token",
            "nonsense",
            "--bootstrap-servers",
            CLOSED,
        ],
    )
    .fails_saying(&["--token"]);
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let taken = taken.local_addr().expect("addr").to_string();
    run(
        dir,
        &[
            "reducer",
            "--metrics-addr",
            &taken,
            "--bootstrap-servers",
            CLOSED,
        ],
    )
    .fails_saying(&[&taken, "--metrics-addr"]);
    run(
        dir,
        &["ledger", "--addr", &taken, "--file", &path("ledger.jsonl")],
    )
    .fails_saying(&[&taken, "--addr"]);

    // The local broker: a data dir that was never made holds no broker to stop.
    let never = path("never");
    run(dir, &["broker", "stop", "--data-dir", &never]).fails_saying(&[&never, "--data-dir"]);
    run(dir, &["broker", "status", "--data-dir", &never]).fails_saying(&["--data-dir"]);
    run(
        dir,
        &[
            "broker",
            "start",
            "--data-dir",
            &path("kafka"),
            "--pom",
            &path("pom.xml"),
        ],
    )
    .fails_saying(&["--pom"]);

    // dev: a token the gateway would cut, a data dir that cannot be one.
    run(dir, &["dev", "--data-dir", &path("dev"), "--token", "a:b"]).fails_saying(&["--token"]);
    run(dir, &["dev", "--data-dir", "/dev/null/dev"]).fails_saying(&["--data-dir"]);

    // Files and arguments read before anything is connected to.
    run(dir, &["topology", "check", "--file", &path("topics.yaml")]).fails_saying(&["--file"]);
    run(dir, &["graph", "publish", &path("graph.yaml")]).fails_saying(&["graph.yaml"]);
    run(
        dir,
        &[
            "replay",
            "shadow",
            "--graph",
            "refund",
            "--bootstrap-servers",
            CLOSED,
        ],
    )
    .fails_saying(&["--graph refund is not id@version"]);
}
