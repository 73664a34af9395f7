//! The attacker's receiver: a bare HTTP server on the attacker's own loopback address
//! that records every request and answers by path (huge, endless, redirecting, hanging).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The attacker's receiver: records every request it is sent and answers by path —
/// `/giant` 40 MiB of JSON, `/endless` a body without end, `/redirect?to=URL` a 302,
/// `/hang` nothing at all, anything else a small JSON.
pub(super) struct Receiver {
    pub(super) addr: SocketAddr,
    requests: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Receiver {
    pub(super) async fn start(ip: std::net::IpAddr) -> anyhow::Result<Receiver> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0)).await?;
        let addr = listener.local_addr()?;
        let requests = Arc::new(Mutex::new(Vec::new()));
        let recorded = requests.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, recorded.clone()));
            }
        });
        Ok(Receiver {
            addr,
            requests,
            task,
        })
    }

    pub(super) fn requests(&self) -> Vec<String> {
        self.requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

async fn serve(mut stream: TcpStream, requests: Arc<Mutex<Vec<String>>>) {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 8192];
    // Headers, then as much body as Content-Length says (bounded).
    let header_end = loop {
        match tokio::time::timeout(Duration::from_secs(10), stream.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => buffer.extend_from_slice(&chunk[..n]),
            _ => return,
        }
        if let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
        if buffer.len() > 1 << 20 {
            return;
        }
    };
    let head = String::from_utf8_lossy(&buffer[..header_end]).to_string();
    let length = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0)
        .min(4 << 20);
    while buffer.len() < header_end + length {
        match tokio::time::timeout(Duration::from_secs(10), stream.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => buffer.extend_from_slice(&chunk[..n]),
            _ => break,
        }
    }
    requests
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(String::from_utf8_lossy(&buffer).to_string());
    let path = head.split_whitespace().nth(1).unwrap_or("/").to_owned();
    if path.starts_with("/hang") {
        tokio::time::sleep(Duration::from_secs(60)).await;
        return;
    }
    if let Some(to) = path.split_once("to=").map(|(_, to)| to.to_owned()) {
        let answer = format!("HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        let _ = stream.write_all(answer.as_bytes()).await;
        return;
    }
    if path.starts_with("/endless") || path.starts_with("/giant") {
        let total: u64 = if path.starts_with("/giant") {
            40 << 20
        } else {
            1 << 40
        };
        let head = format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {total}\r\nConnection: close\r\n\r\n");
        if stream.write_all(head.as_bytes()).await.is_err() {
            return;
        }
        let block = vec![b' '; 64 * 1024];
        let mut sent = 0u64;
        while sent < total {
            if stream.write_all(&block).await.is_err() {
                return;
            }
            sent += block.len() as u64;
        }
        return;
    }
    let body =
        json!({"ok": true, "choices": [{"message": {"role": "assistant", "content": "ok"}}]})
            .to_string();
    let answer = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(answer.as_bytes()).await;
}
