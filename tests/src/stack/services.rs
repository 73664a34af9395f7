//! Executor and ledger processes, and publishing graphs after the start.

#[allow(unused_imports)]
use super::*;

/// A `sortie ledger` child process and where it listens.
#[derive(Debug)]
pub struct LedgerProcess {
    pub process: Process,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    pub file: PathBuf,
}

impl LedgerProcess {
    /// Everything the ledger has recorded.
    pub async fn snapshot(&self) -> sortie_devkit::ledger::Snapshot {
        reqwest::get(format!("{}/ledger", self.url))
            .await
            .and_then(|r| r.error_for_status())
            .expect("GET /ledger")
            .json()
            .await
            .expect("ledger snapshot")
    }

    /// Arms a fault for the next calls (`{"status": 429, "times": 2}`, `{"delay_ms": ..}`,
    /// `{"drop_after_commit": true}`).
    pub async fn fault(&self, spec: serde_json::Value) {
        reqwest::Client::new()
            .post(format!("{}/faults", self.url))
            .json(&spec)
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .expect("POST /faults");
    }
}

impl Stack {
    /// Publishes one more graph (e.g. one whose config names a ledger started after the
    /// stack).
    pub async fn publish(&self, yaml: &str) {
        let graph = Graph::parse(yaml).expect("test graph is valid");
        publish_signed(&self.kafka, &self.codec, &self.topics, &graph).await;
    }

    /// Starts `sortie ledger --mode <mode>` on a free port, its file under the test's dir,
    /// and waits until it listens. A second call with the same name reopens the same file.
    pub async fn ledger_process(&self, name: &str, mode: &str) -> LedgerProcess {
        let file = self.dir.join(format!("{name}.jsonl"));
        // Measured before the spawn: a fast ledger may print its address before this
        // function could read the log's length afterwards.
        let before = std::fs::read_to_string(self.dir.join(format!("{name}.log")))
            .map(|t| t.len())
            .unwrap_or(0);
        let process = self.spawn(
            name,
            &[
                "ledger",
                "--addr",
                "127.0.0.1:0",
                "--file",
                file.to_str().unwrap_or_default(),
                "--mode",
                mode,
            ],
        );
        let log = process.log.clone();
        let url = crate::wait_for(
            &format!("ledger {name} to listen"),
            Duration::from_secs(30),
            || {
                let log = log.clone();
                async move {
                    let text = std::fs::read_to_string(&log).ok()?;
                    let line = text
                        .get(before..)?
                        .lines()
                        .find_map(|l| l.strip_prefix("ledger listening on ").map(str::to_owned))?;
                    Some(line.trim().to_owned())
                }
            },
        )
        .await;
        LedgerProcess { process, url, file }
    }

    /// Starts `sortie executor` for `queues` named `name`, with fast commits, a short
    /// drain and loopback allowed (`--egress-allow`); `extra` args are appended (e.g.
    /// `["--static-membership"]` so a restart under the same name takes its partitions
    /// back at once, `["--fault", "executor.after_call"]`).
    pub fn executor_process(&self, name: &str, queues: &[&str], extra: &[&str]) -> Process {
        let mut args = vec!["executor".to_owned()];
        args.extend(self.executor_args(name, queues, extra));
        spawn_logged(self.dir.join(format!("{name}.log")), args)
    }

    /// [`Stack::executor_process`] with the executor of your own that
    /// `examples/rust-executor` builds ([`own_executor_bin`]): the same flags.
    pub fn own_executor_process(&self, name: &str, queues: &[&str], extra: &[&str]) -> Process {
        let args = self.executor_args(name, queues, extra);
        spawn_program(
            own_executor_bin(),
            self.dir.join(format!("{name}.log")),
            args,
        )
    }

    fn executor_args(&self, name: &str, queues: &[&str], extra: &[&str]) -> Vec<String> {
        let queues = queues.join(",");
        let mut args = vec![
            "--bootstrap-servers",
            &self.bootstrap,
            "--registry-url",
            &self.registry.url,
            "--prefix",
            &self.prefix,
            "--queue",
            &queues,
            "--executor-id",
            name,
            "--commit-interval-ms",
            "50",
            "--session-timeout-ms",
            "6000",
            "--drain-timeout-ms",
            "3000",
            "--metrics-addr",
            "127.0.0.1:0",
            // The ledger, fake models and MCP servers of the tests listen on loopback,
            // which executors refuse by default.
            "--egress-allow",
            "127.0.0.0/8",
            "--egress-allow",
            "::1/128",
        ];
        args.extend_from_slice(extra);
        args.into_iter().map(str::to_owned).collect()
    }
}

impl Process {
    /// The exit status, if the process has ended (never blocks).
    pub fn try_exit(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

/// The scripted fake model (`sortie_devkit::model`) served on a free loopback port for the
/// rest of the test: its memory of what it was asked, and its base URL (`http://…`, the
/// graphs' `base_url` is this plus `/v1`).
pub async fn serve_fake_model() -> (Arc<sortie_devkit::model::FakeModel>, String) {
    let fake = sortie_devkit::model::FakeModel::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(sortie_devkit::model::serve(
        listener,
        fake.clone(),
        std::future::pending::<()>(),
    ));
    (fake, url)
}
