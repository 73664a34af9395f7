//! `sortie dev`: the whole local stack in one command, on a fresh checkout.
//!
//! A real Apache Kafka (KRaft), the schema registry, the topology, the example graphs,
//! then the services as their own processes — ledger (the dev receiver every example
//! graph calls, recording each call), reducer, executor, gateway — and a demo mission that
//! stops at an approval. Ctrl-C stops
//! everything cleanly; running it again resumes with the same data.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde_json::{json, Value};
use sortie_devkit::local::{BrokerConfig, LocalBroker};
use sortie_devkit::receiver;
use sortie_kafka::topology::Topology;
use sortie_kafka::KafkaConfig;
use sortie_wire::{Codec, CodecConfig, Topics};

/// `println!` that ignores a closed stdout: `sortie dev | tee log` stopped with Ctrl-C (or
/// a test harness that died) must still stop every service and the broker, not panic on
/// the first goodbye line and leave them running.
macro_rules! say {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Where broker and service data live (kept across runs).
    #[arg(long, default_value = "target/dev")]
    data_dir: PathBuf,
    /// The gateway's address.
    #[arg(long, default_value = "127.0.0.1:8080")]
    gateway_addr: String,
    /// The dev tenant's bearer token (default: generated once and kept in the data dir).
    #[arg(long, env = "SORTIE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Kafka's port on 127.0.0.1 (the controller uses the next one).
    #[arg(long, default_value_t = 9092)]
    kafka_port: u16,
    #[arg(long, default_value = "127.0.0.1:8081")]
    registry_addr: String,
    /// The ledger and dev receiver: the example graphs' URLs (`http://127.0.0.1:8090/...`)
    /// are rewritten to this address when they are published.
    #[arg(long, default_value = "127.0.0.1:8090")]
    ledger_addr: String,
    /// Do not start the demo mission.
    #[arg(long)]
    no_demo: bool,
}

/// Finds a file of the repository from the current directory upwards (then from where
/// this binary was built), so `sortie dev` works from any folder of a checkout.
fn repo_file(relative: &str) -> anyhow::Result<PathBuf> {
    let mut dir = std::env::current_dir()?;
    loop {
        let candidate = dir.join(relative);
        if candidate.exists() {
            return Ok(candidate);
        }
        if !dir.pop() {
            break;
        }
    }
    let built = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(relative);
    if built.exists() {
        return Ok(built);
    }
    bail!("{relative} not found: run `sortie dev` from a Sortie checkout")
}

struct Service {
    name: &'static str,
    args: Vec<String>,
    child: Child,
    log: PathBuf,
}

struct Stack {
    services: Vec<Service>,
    exe: PathBuf,
    logs: PathBuf,
    env: Vec<(&'static str, String)>,
}

impl Stack {
    fn spawn(&mut self, name: &'static str, args: &[&str]) -> anyhow::Result<()> {
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        let service = self.start(name, args)?;
        self.services.push(service);
        Ok(())
    }

    fn start(&self, name: &'static str, args: Vec<String>) -> anyhow::Result<Service> {
        let log = self.logs.join(format!("{name}.log"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let mut command = Command::new(&self.exe);
        command
            .args(&args)
            .stdout(Stdio::from(file.try_clone()?))
            .stderr(Stdio::from(file));
        for (key, value) in &self.env {
            command.env(key, value);
        }
        let child = command
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        say!(
            "  {name:<9} started (pid {}, log {})",
            child.id(),
            log.display()
        );
        Ok(Service {
            name,
            args,
            child,
            log,
        })
    }

    /// A service that exited on its own, if any. One that exited asking to be restarted
    /// (a reducer or executor whose Kafka client wedged: status 75, see
    /// `sortie_kafka::watchdog`)
    /// is started again in its place, as Kubernetes would.
    fn exited(&mut self) -> Option<(&'static str, PathBuf, String)> {
        for at in 0..self.services.len() {
            let service = &mut self.services[at];
            let Ok(Some(status)) = service.child.try_wait() else {
                continue;
            };
            let (name, log) = (service.name, service.log.clone());
            if status.code() == Some(sortie_kafka::watchdog::WEDGED_EXIT_CODE) {
                let args = service.args.clone();
                match self.start(name, args) {
                    Ok(again) => {
                        say!("  {name:<9} exited ({status}: a wedged Kafka client); restarted");
                        self.services[at] = again;
                        continue;
                    }
                    Err(e) => return Some((name, log, format!("{status}; restarting it: {e}"))),
                }
            }
            return Some((name, log, status.to_string()));
        }
        None
    }

    /// SIGTERM in reverse start order, then wait (SIGKILL after 20 s).
    fn stop(&mut self) {
        while let Some(mut service) = self.services.pop() {
            if let Some(pid) = rustix::process::Pid::from_raw(service.child.id() as i32) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            }
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                match service.child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() > deadline => {
                        let _ = service.child.kill();
                        let _ = service.child.wait();
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(100)),
                }
            }
            say!("  {} stopped", service.name);
        }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn wait_http(
    what: &str,
    url: &str,
    token: Option<&str>,
    stack: &mut Stack,
) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let mut request = client.get(url).timeout(Duration::from_secs(2));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        if let Ok(response) = request.send().await {
            if response.status().is_success() {
                return Ok(());
            }
        }
        if let Some((name, log, status)) = stack.exited() {
            bail!(
                "{name} exited ({status}) while waiting for {what}; see {}",
                log.display()
            );
        }
        if Instant::now() > deadline {
            bail!("{what} did not come up at {url}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn dev_token(data_dir: &Path, given: Option<String>) -> anyhow::Result<String> {
    if let Some(token) = given {
        // The gateway reads it as the last field of `TENANT:PRINCIPAL:ROLES:TOKEN`: a `:`
        // would cut it, and the token printed would not be the one it takes.
        if token.is_empty() || token.contains(':') || token.chars().any(char::is_whitespace) {
            bail!("--token (or SORTIE_TOKEN) {token:?} cannot be the dev token: give one that is not empty, without ':' or whitespace, or leave it out for a generated one");
        }
        return Ok(token);
    }
    let file = data_dir.join("dev-token");
    if let Ok(token) = std::fs::read_to_string(&file) {
        if !token.trim().is_empty() {
            return Ok(token.trim().to_owned());
        }
    }
    let mut bytes = [0u8; 16];
    std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut bytes)?;
    let token = format!("dev-{}", sortie_core::json::hex(&bytes));
    std::fs::write(&file, &token)?;
    Ok(token)
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let data_dir = std::fs::create_dir_all(&args.data_dir)
        .and_then(|()| std::fs::canonicalize(&args.data_dir))
        .with_context(|| format!("cannot use --data-dir {}", args.data_dir.display()))?;
    let logs = data_dir.join("logs");
    std::fs::create_dir_all(&logs)?;
    let token = dev_token(&data_dir, args.token.clone())?;
    say!(
        "Starting Sortie's local stack (data in {}).",
        data_dir.display()
    );

    // 0. Every address the stack listens on is free, before anything is started.
    for (what, addr, flag) in [
        ("gateway", &args.gateway_addr, "--gateway-addr"),
        ("schema registry", &args.registry_addr, "--registry-addr"),
        ("ledger", &args.ledger_addr, "--ledger-addr"),
    ] {
        if let Err(e) = std::net::TcpListener::bind(addr.as_str()) {
            let how = format!(
                "`sortie dev {flag} HOST:PORT` (or stop what holds it: an earlier `sortie dev`?)"
            );
            return Err(crate::cannot_listen(what, addr, &e, &how));
        }
    }

    // 1. Kafka.
    let broker = || {
        Ok::<_, anyhow::Error>(LocalBroker::new(BrokerConfig::new(
            data_dir.join("kafka"),
            args.kafka_port,
            repo_file("dev/kafka/pom.xml")?,
        )))
    };
    let starting = broker()?;
    let running = tokio::task::spawn_blocking(move || starting.ensure_running()).await??;
    let bootstrap = running.bootstrap.clone();
    say!(
        "  kafka     {bootstrap} ({})",
        if running.reused {
            "already running"
        } else {
            "started"
        }
    );
    let served = serve(&args, &data_dir, logs, &token, &bootstrap).await;
    // A stack that failed to start stops the broker it started (one it found running is
    // left as it was); one that ran stops it on the way out, as always.
    if served.is_ok() || !running.reused {
        let stopping = broker()?;
        tokio::task::spawn_blocking(move || stopping.stop()).await??;
        say!("  kafka     stopped (data kept)");
    }
    served
}

/// Starts the services on the running broker and serves until Ctrl-C or a service exits;
/// on `Err` every service started so far is stopped (the stack's `Drop`).
async fn serve(
    args: &Args,
    data_dir: &Path,
    logs: PathBuf,
    token: &str,
    bootstrap: &str,
) -> anyhow::Result<()> {
    let token = token.to_owned();
    let bootstrap = bootstrap.to_owned();
    let data_dir = data_dir.to_path_buf();
    let registry_url = format!("http://{}", args.registry_addr);
    let gateway_url = format!("http://{}", args.gateway_addr);
    let mut stack = Stack {
        services: Vec::new(),
        exe: std::env::current_exe()?,
        logs,
        env: vec![
            ("SORTIE__KAFKA__BOOTSTRAP_SERVERS", bootstrap.clone()),
            ("SORTIE__REGISTRY__URL", registry_url.clone()),
            (
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            ),
        ],
    };

    // 2. The schema registry, 3. the topics, 4. the graphs.
    stack.spawn(
        "registry",
        &["registry", "serve", "--addr", &args.registry_addr],
    )?;
    wait_http(
        "the schema registry",
        &format!("{registry_url}/subjects"),
        None,
        &mut stack,
    )
    .await?;
    let kafka = KafkaConfig::new(bootstrap.clone());
    let report = Topology::load(repo_file("topology/topics.yaml")?)?
        .apply(&kafka)
        .await?;
    say!(
        "  topics    {} created, {} already there",
        report.created.len(),
        report.unchanged.len()
    );
    let codec = Codec::new(&CodecConfig {
        registry_url: registry_url.clone(),
        auto_register: true,
    });
    let topics = Topics::default();
    let now = sortie_kafka::clock::now_ms();
    let receiver_url = format!("http://{}", args.ledger_addr);

    // 5. The services, each its own process; the dev receiver first: it serves the MCP
    // server whose tools publishing the MCP example pins.
    let ledger_file = data_dir.join("ledger.jsonl").display().to_string();
    stack.spawn(
        "ledger",
        &[
            "ledger",
            "--addr",
            &args.ledger_addr,
            "--file",
            &ledger_file,
            "--mode",
            "keyed",
            "--dev-routes",
        ],
    )?;
    wait_http(
        "the dev receiver",
        &format!("{receiver_url}/ledger"),
        None,
        &mut stack,
    )
    .await?;
    let keys = dev_keys(&data_dir)?;
    // Graphs are signed by the dev publisher key: reducers and the gateway take only
    // graphs a publisher key of the keyring signed.
    let publisher = sortie_wire::signing::Signer::load(&keys.publisher)?;
    for mut graph in sortie_catalog::load_dir(repo_file("topology/graphs")?)? {
        for node in &mut graph.nodes {
            receiver::rebase_urls(&mut node.config, &receiver_url);
        }
        for server in &mut graph.mcp_servers {
            receiver::rebase_url(&mut server.url, &receiver_url);
        }
        sortie_catalog::publish_signed(
            &kafka,
            &codec,
            &topics,
            &graph,
            DEV_PUBLISHER,
            now,
            Some(&publisher),
            None,
        )
        .await?;
        say!("  graph     {} published (signed)", graph.key());
    }
    let keyring = keys.keyring.display().to_string();
    let gateway_key = keys.gateway.display().to_string();
    let reducer_key = keys.reducer.display().to_string();
    let reducer_dir = data_dir.join("reducer").display().to_string();
    // Run payloads are sealed with per-run data keys (`docs/guides/retention-and-deletion.md`).
    let kek = keys.kek.display().to_string();
    let run_keys = format!(
        "file://{}",
        std::path::absolute(data_dir.join("run-keys"))?.display()
    );
    stack.spawn(
        "reducer",
        &[
            "reducer",
            "--data-dir",
            &reducer_dir,
            "--keyring",
            &keyring,
            "--require-signatures",
            "--signing-key",
            &reducer_key,
            "--seal-keyring",
            &kek,
            "--seal-key-store",
            &run_keys,
        ],
    )?;
    // One blob store for the executor and the gateway: large inputs and outputs go by
    // reference (`docs/guides/large-payloads.md`).
    let blobs = format!(
        "file://{}",
        std::path::absolute(data_dir.join("blobs"))?.display()
    );
    // The dev receivers (the ledger, a local model or MCP server) listen on loopback,
    // which executors refuse by default (docs/security.md, "Egress").
    stack.spawn(
        "executor",
        &[
            "executor",
            "--queue",
            "default,http,llm",
            "--blob-store",
            &blobs,
            "--seal-keyring",
            &kek,
            "--seal-key-store",
            &run_keys,
            "--egress-allow",
            "127.0.0.0/8",
            "--egress-allow",
            "::1/128",
        ],
    )?;
    let gateway_dir = data_dir.join("gateway").display().to_string();
    // The dev user is an approver in the group `managers`: the onboarding example's
    // laptop gate admits only the hire's manager's group (`$input.manager`).
    let dev_token = format!("dev:dev-user:approver,operator,@managers:{token}");
    let budgets = repo_file("topology/budgets.yaml")?.display().to_string();
    stack.spawn(
        "gateway",
        &[
            "gateway",
            "--addr",
            &args.gateway_addr,
            "--data-dir",
            &gateway_dir,
            "--token",
            &dev_token,
            "--budgets-file",
            &budgets,
            "--signing-key",
            &gateway_key,
            "--keyring",
            &keyring,
            "--require-signatures",
            "--blob-store",
            &blobs,
            "--seal-keyring",
            &kek,
            "--seal-key-store",
            &run_keys,
        ],
    )?;
    wait_http(
        "the gateway",
        &format!("{gateway_url}/readyz"),
        None,
        &mut stack,
    )
    .await?;

    say!();
    say!("Sortie is running.");
    say!("  gateway   {gateway_url}   (tenant \"dev\", token {token})");
    say!("  console   {gateway_url}/ui/   (sign in with the token)");
    say!("  registry  {registry_url}");
    say!("  ledger    {receiver_url}/ledger   (every call the graphs' receivers answered)");
    say!("  kafka     {bootstrap}");
    say!(
        "  commands  signed: reducers take only what a key of {} signs; a service's key: {}",
        keys.keyring.display(),
        keys.examples.display()
    );
    say!(
        "  payloads  sealed with per-run keys in {} (KEK {}); `sortie run forget` shreds a run",
        run_keys.trim_start_matches("file://"),
        keys.kek.display()
    );

    let env_file = data_dir.join("env");
    let exe = std::env::current_exe()?;
    write_env_file(
        &env_file,
        &[
            (
                "PATH",
                format!("{}:$PATH", exe.parent().unwrap_or(&data_dir).display()),
            ),
            ("SORTIE_DEV_DIR", data_dir.display().to_string()),
            ("SORTIE__GATEWAY__URL", gateway_url.clone()),
            ("SORTIE_TOKEN", token.clone()),
            ("SORTIE__KAFKA__BOOTSTRAP_SERVERS", bootstrap.clone()),
            ("SORTIE__REGISTRY__URL", registry_url.clone()),
            ("SORTIE_KEYRING", keyring.clone()),
            ("SORTIE__SEAL__KEYRING", kek.clone()),
            ("SORTIE__SEAL__KEY_STORE", run_keys.clone()),
            ("SORTIE_DEV_RECEIVER", receiver_url.clone()),
        ],
    )?;
    say!(
        "  elsewhere source {} (the sortie binary, this stack's addresses, token and keys)",
        env_file.display()
    );

    if !args.no_demo {
        demo(&gateway_url, &token).await?;
    }
    refund_story(&gateway_url, &receiver_url, &token);
    say!("Ctrl-C stops everything; `sortie dev` again resumes with the same data.");

    loop {
        tokio::select! {
            () = crate::shutdown_signal() => break,
            () = tokio::time::sleep(Duration::from_secs(1)) => {
                if let Some((name, log, status)) = stack.exited() {
                    let _ = writeln!(std::io::stderr(), "{name} exited ({status}); see {}. Stopping the stack.", log.display());
                    break;
                }
            }
        }
    }
    say!("Stopping...");
    stack.stop();
    Ok(())
}

/// Writes `<data dir>/env`: shell lines exporting what a terminal outside the checkout
/// needs to use this stack — the `sortie` binary on `PATH`, the addresses, the dev token,
/// the keyring and the run keys (read by `sortie run`, `graph publish`, `audit`) and the dev
/// receiver's URL (`SORTIE_DEV_RECEIVER`, for graphs of your own).
fn write_env_file(path: &Path, vars: &[(&str, String)]) -> anyhow::Result<()> {
    let mut text = String::from(
        "# Written by `sortie dev` for this stack: `source` it in a shell outside the checkout.\n",
    );
    for (name, value) in vars {
        // Single-quoted, so nothing in a value is expanded; PATH keeps its `$PATH` tail.
        let (value, tail) = match value.strip_suffix(":$PATH") {
            Some(head) => (head, ":\"$PATH\""),
            None => (value.as_str(), ""),
        };
        let quoted = value.replace('\'', "'\\''");
        text.push_str(&format!("export {name}='{quoted}'{tail}\n"));
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// The dev stack's command keys, under `<data dir>/keys` (made once, then reused).
struct DevKeys {
    keyring: PathBuf,
    /// The gateway's delegate key.
    gateway: PathBuf,
    /// A service key for outside producers (`examples/python/publish_commands.py
    /// --signing-key`): principal `svc:python-example`, tenant `dev`, approver and operator.
    examples: PathBuf,
    /// The key-encryption keyring that wraps run data keys (`--seal-keyring`).
    kek: PathBuf,
    /// The key the dev stack signs its graphs with (principal [`DEV_PUBLISHER`]).
    publisher: PathBuf,
    /// The reducer's delegate key: it signs the commands the reducer sends other runs
    /// (a child run's start and cancel).
    reducer: PathBuf,
}

/// Who publishes the dev stack's graphs.
pub(crate) const DEV_PUBLISHER: &str = "sortie-dev";

fn dev_keys(data_dir: &Path) -> anyhow::Result<DevKeys> {
    use sortie_wire::signing::{keyring_text, Signer};
    let dir = data_dir.join("keys");
    let keys = DevKeys {
        keyring: dir.join("keyring.yaml"),
        gateway: dir.join("gateway.key"),
        examples: dir.join("examples.key"),
        kek: dir.join("kek.yaml"),
        publisher: dir.join("publisher.key"),
        reducer: dir.join("reducer.key"),
    };
    std::fs::create_dir_all(&dir)?;
    if !keys.kek.exists() {
        // One KEK for every tenant of the dev stack (made once: data keys it wrapped
        // must keep unwrapping).
        let text = sortie_seal::kek::Keyring::generate("*", "dev-kek-1")?;
        crate::keys::write_secret(&keys.kek, &text)?;
    }
    let made = [
        &keys.keyring,
        &keys.gateway,
        &keys.examples,
        &keys.publisher,
        &keys.reducer,
    ];
    if made.iter().all(|path| path.exists()) {
        return Ok(keys);
    }
    let gateway = Signer::generate("dev-gateway")?;
    let examples = Signer::generate("dev-examples")?;
    let publisher = Signer::generate("dev-publisher")?;
    let reducer = Signer::generate("dev-reducer")?;
    let tenants = ["dev".to_owned()];
    let roles = ["approver".to_owned(), "operator".to_owned()];
    let mut publishes = publisher.entry(DEV_PUBLISHER, &["*".to_owned()], &[], false);
    publishes.publisher = true;
    let entries = [
        gateway.entry("gateway", &tenants, &[], true),
        examples.entry("svc:python-example", &tenants, &roles, false),
        publishes,
        reducer.entry("reducer", &tenants, &[], true),
    ];
    for path in [
        &keys.gateway,
        &keys.examples,
        &keys.publisher,
        &keys.reducer,
    ] {
        let _ = std::fs::remove_file(path);
    }
    crate::keys::write_secret(&keys.gateway, &gateway.to_file())?;
    crate::keys::write_secret(&keys.examples, &examples.to_file())?;
    crate::keys::write_secret(&keys.publisher, &publisher.to_file())?;
    crate::keys::write_secret(&keys.reducer, &reducer.to_file())?;
    std::fs::write(&keys.keyring, keyring_text(&entries))?;
    Ok(keys)
}

/// Starts the demo mission and waits until it stops at its approval.
async fn demo(gateway: &str, token: &str) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    let started: Value = client
        .post(format!("{gateway}/v1/runs"))
        .bearer_auth(token)
        .json(&json!({"graph_id": "demo", "input": {"message": "Hello from Sortie"}}))
        .send()
        .await?
        .json()
        .await?;
    let Some(run_id) = started["run_id"].as_str() else {
        bail!("the demo run did not start: {started}");
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let interrupt = loop {
        let run: Value = client
            .get(format!("{gateway}/v1/runs/{run_id}"))
            .bearer_auth(token)
            .send()
            .await?
            .json()
            .await?;
        if let Some(id) = run["interrupt"]["interrupt_id"].as_str() {
            break id.to_owned();
        }
        if Instant::now() > deadline {
            bail!("the demo run did not reach its approval: {run}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    say!();
    say!("A demo mission is waiting for your approval: {run_id}");
    say!("Approve it with curl:");
    say!(
        "  curl -s -X POST {gateway}/v1/runs/{run_id}/resume -H 'Authorization: Bearer {token}' -H 'Content-Type: application/json' -d '{{\"decision\": \"approve\", \"interrupt_id\": \"{interrupt}\"}}'"
    );
    say!("or with the CLI:");
    say!("  cargo run -q -p sortie -- run --gateway {gateway} --token {token} approve {run_id}");
    say!("or in the console's approval inbox: {gateway}/ui/#/inbox");
    say!("Follow it:");
    say!("  cargo run -q -p sortie -- run --gateway {gateway} --token {token} watch {run_id}");
    say!("  curl -s {gateway}/v1/runs/{run_id} -H 'Authorization: Bearer {token}'");
    say!();
    Ok(())
}

/// How to run the refund story (`topology/graphs/refund.yaml`) against the dev receiver.
fn refund_story(gateway: &str, receiver: &str, token: &str) {
    let sortie = format!("cargo run -q -p sortie -- run --gateway {gateway} --token {token}");
    say!("The refund story (topology/graphs/refund.yaml): read the order, check the policy,");
    say!("wait for an approver, refund (keyed by the operation id), notify the customer.");
    say!("  {sortie} start refund --input '{{\"order_id\": \"ord-1001\", \"customer_id\": \"cus-42\", \"reason\": \"arrived damaged\"}}'");
    say!("  {sortie} get <run_id>        # waiting_approval: a refund waits for an approver");
    say!("  {sortie} approve <run_id>");
    say!("  {sortie} watch <run_id>      # the timeline, until the run has succeeded");
    say!("  curl -s {receiver}/ledger      # one refund per idempotency key");
    say!();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stack of `sh` "services": one exits as a wedged reducer does, one as a broken one.
    fn stack(dir: &Path) -> Stack {
        Stack {
            services: Vec::new(),
            exe: PathBuf::from("/bin/sh"),
            logs: dir.to_path_buf(),
            env: Vec::new(),
        }
    }

    fn wait_exited(stack: &mut Stack) -> Option<(&'static str, PathBuf, String)> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(exited) = stack.exited() {
                return Some(exited);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Checked red: with the status-75 branch of `exited` removed, "status 75 does not
    /// stop the stack" fails.
    #[test]
    fn a_service_that_exits_wedged_is_restarted_and_any_other_exit_stops_the_stack() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut stack = stack(dir.path());
        // Exits 75 the first time only (its marker file then exists), then stays up.
        let marker = dir.path().join("once");
        let script = format!(
            "if [ -e {m} ]; then exec sleep 30; else touch {m}; exit 75; fi",
            m = marker.display()
        );
        stack.spawn("reducer", &["-c", &script]).expect("spawn");
        let first = stack.services[0].child.id();
        let deadline = Instant::now() + Duration::from_secs(10);
        while stack.services[0].child.id() == first {
            assert!(
                stack.exited().is_none(),
                "status 75 does not stop the stack"
            );
            assert!(
                Instant::now() < deadline,
                "the wedged service was not restarted"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(stack.services.len(), 1);

        stack.spawn("gateway", &["-c", "exit 3"]).expect("spawn");
        let (name, _, status) = wait_exited(&mut stack).expect("the broken service is reported");
        assert_eq!(name, "gateway");
        assert!(status.contains('3'), "{status}");
    }
}
