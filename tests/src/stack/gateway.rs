//! A gateway process on the stack.

#[allow(unused_imports)]
use super::*;

impl Stack {
    /// A `sortie gateway` process on a free port, with its view under `data` and the given
    /// dev tokens (`TENANT:PRINCIPAL:ROLE1,ROLE2:TOKEN`). Returns once `/readyz` answers 200,
    /// with the process and its base URL (`http://127.0.0.1:<port>`).
    pub async fn gateway_process(
        &self,
        data: &std::path::Path,
        tokens: &[&str],
    ) -> (Process, String) {
        self.gateway_process_with(data, tokens, &[]).await
    }

    /// [`Stack::gateway_process`] with extra arguments appended (e.g. `["--fault",
    /// "gateway.after_publish"]`).
    pub async fn gateway_process_with(
        &self,
        data: &std::path::Path,
        tokens: &[&str],
        extra: &[&str],
    ) -> (Process, String) {
        static SPAWNED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SPAWNED.fetch_add(1, Ordering::Relaxed);
        let data = data.to_str().unwrap_or_default().to_owned();
        let mut args = vec![
            "gateway",
            "--bootstrap-servers",
            &self.bootstrap,
            "--registry-url",
            &self.registry.url,
            "--prefix",
            &self.prefix,
            "--addr",
            "127.0.0.1:0",
            "--data-dir",
            &data,
            "--answer-timeout-ms",
            "30000",
        ];
        for token in tokens {
            args.extend(["--token", token]);
        }
        args.extend_from_slice(extra);
        // A log of its own per spawn: the first line is this process's address.
        let process = self.spawn(&format!("gateway-{n}"), &args);
        let addr: std::net::SocketAddr = crate::wait_for(
            "the gateway to print its address",
            Duration::from_secs(60),
            || {
                let text = process.log_text();
                async move { text.lines().find_map(|l| l.trim().parse().ok()) }
            },
        )
        .await;
        let url = format!("http://{addr}");
        let client = reqwest::Client::new();
        crate::wait_until("the gateway to be ready", Duration::from_secs(90), || {
            let request = client.get(format!("{url}/readyz")).send();
            async move { request.await.is_ok_and(|r| r.status().as_u16() == 200) }
        })
        .await;
        (process, url)
    }
}
