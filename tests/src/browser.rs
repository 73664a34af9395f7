//! A real browser for the console's tests: Debian's `chromium` driven by `chromedriver`
//! over the W3C WebDriver protocol, spoken with the workspace's `reqwest` (a dozen
//! endpoints; a WebDriver crate would add more than it saves). Headless, no sandbox (tests
//! run as root in CI), a profile of its own in a temp dir. `dev/prerequisites.sh` installs
//! both packages; a missing one is a failure, not a skip.
//!
//! Waiting is polling the DOM against a deadline, never a bare sleep.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use base64::Engine as _;
use serde_json::{json, Value};

/// The key under which WebDriver names an element.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A chromedriver process and one browser session in it. Dropping it ends both.
#[derive(Debug)]
pub struct Browser {
    driver: Child,
    client: reqwest::Client,
    /// `http://127.0.0.1:<port>/session/<id>`.
    session: String,
    _profile: tempfile::TempDir,
}

/// An element of the current page.
#[derive(Debug, Clone)]
pub struct Element(String);

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| Path::new(dir).join(name))
        .find(|p| p.is_file())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

impl Browser {
    /// Starts chromedriver on a free loopback port and opens a headless Chromium session
    /// with a `width`×`height` window; its log goes to `log`.
    pub async fn start(log: &Path, width: u32, height: u32) -> Browser {
        let driver_bin = which("chromedriver")
            .expect("chromedriver is installed (dev/prerequisites.sh installs chromium-driver)");
        let chromium = ["chromium", "chromium-browser", "google-chrome"]
            .into_iter()
            .find_map(which)
            .expect("chromium is installed (dev/prerequisites.sh installs it)");
        let profile = tempfile::Builder::new()
            .prefix("sortie-chromium-")
            .tempdir()
            .expect("a profile dir");
        let port = free_port();
        let file = std::fs::File::create(log).expect("chromedriver log");
        let driver = Command::new(driver_bin)
            .arg(format!("--port={port}"))
            .arg("--allowed-ips=127.0.0.1")
            .stdout(Stdio::from(file.try_clone().expect("log handle")))
            .stderr(Stdio::from(file))
            .spawn()
            .expect("chromedriver starts");
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .expect("HTTP client");
        let base = format!("http://127.0.0.1:{port}");
        crate::wait_until("chromedriver to answer", Duration::from_secs(30), || {
            let status = client.get(format!("{base}/status")).send();
            async move {
                match status.await {
                    Ok(r) => r
                        .json::<Value>()
                        .await
                        .is_ok_and(|v| v["value"]["ready"] == true),
                    Err(_) => false,
                }
            }
        })
        .await;
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:loggingPrefs": {"browser": "ALL"},
            "goog:chromeOptions": {
                "binary": chromium,
                "args": [
                    "--headless=new",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    "--no-first-run",
                    "--hide-scrollbars",
                    "--force-device-scale-factor=1",
                    format!("--window-size={width},{height}"),
                    format!("--user-data-dir={}", profile.path().display()),
                ]
            }
        }}});
        let answer: Value = client
            .post(format!("{base}/session"))
            .json(&capabilities)
            .send()
            .await
            .expect("chromedriver answers POST /session")
            .json()
            .await
            .expect("a JSON answer");
        let id = answer["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("a browser session starts: {answer}"))
            .to_owned();
        Browser {
            driver,
            client,
            session: format!("{base}/session/{id}"),
            _profile: profile,
        }
    }

    /// One WebDriver command; `Err` carries WebDriver's error (e.g. `no such element`).
    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
        let url = format!("{}{path}", self.session);
        let request = match method {
            "GET" => self.client.get(url),
            "DELETE" => self.client.delete(url),
            _ => self
                .client
                .post(url)
                .json(&body.unwrap_or_else(|| json!({}))),
        };
        let response = request.send().await.map_err(|e| e.to_string())?;
        let ok = response.status().is_success();
        let answer: Value = response.json().await.map_err(|e| e.to_string())?;
        if ok {
            Ok(answer["value"].clone())
        } else {
            Err(format!(
                "{}: {}",
                answer["value"]["error"].as_str().unwrap_or("error"),
                answer["value"]["message"].as_str().unwrap_or_default()
            ))
        }
    }

    pub async fn goto(&self, url: &str) {
        self.call("POST", "/url", Some(json!({ "url": url })))
            .await
            .unwrap_or_else(|e| panic!("navigate to {url}: {e}"));
    }

    pub async fn url(&self) -> String {
        self.call("GET", "/url", None)
            .await
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default()
    }

    /// The elements matching a CSS selector now (none is not an error).
    pub async fn all(&self, css: &str) -> Vec<Element> {
        let found = self
            .call(
                "POST",
                "/elements",
                Some(json!({"using": "css selector", "value": css})),
            )
            .await
            .unwrap_or_default();
        found
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|e| e[ELEMENT].as_str().map(|id| Element(id.to_owned())))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The visible text of the first element matching `css`, if there is one.
    pub async fn text(&self, css: &str) -> Option<String> {
        let element = self.all(css).await.into_iter().next()?;
        self.call("GET", &format!("/element/{}/text", element.0), None)
            .await
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
    }

    /// Waits until an element matching `css` shows text for which `done` holds; returns it.
    pub async fn wait_text(
        &self,
        what: &str,
        css: &str,
        deadline: Duration,
        done: impl Fn(&str) -> bool,
    ) -> String {
        crate::wait_for(what, deadline, || async {
            self.text(css).await.filter(|t| done(t))
        })
        .await
    }

    /// Waits until an element matches `css`.
    pub async fn wait_for(&self, what: &str, css: &str, deadline: Duration) -> Element {
        crate::wait_for(what, deadline, || async {
            self.all(css).await.into_iter().next()
        })
        .await
    }

    /// Clicks the first element matching `css`, waiting for it; a page that redrew under
    /// the click (a stale element) is clicked again once the element is back.
    pub async fn click(&self, css: &str, deadline: Duration) {
        crate::wait_until(&format!("a click on {css}"), deadline, || async {
            let Some(element) = self.all(css).await.into_iter().next() else {
                return false;
            };
            self.call("POST", &format!("/element/{}/click", element.0), None)
                .await
                .is_ok()
        })
        .await;
    }

    /// Types into the first element matching `css`.
    pub async fn type_into(&self, css: &str, text: &str, deadline: Duration) {
        let element = self
            .wait_for(&format!("{css} to type into"), css, deadline)
            .await;
        self.call(
            "POST",
            &format!("/element/{}/value", element.0),
            Some(json!({ "text": text })),
        )
        .await
        .unwrap_or_else(|e| panic!("type into {css}: {e}"));
    }

    /// Replaces the text of the first input or textarea matching `css`.
    pub async fn replace_text(&self, css: &str, text: &str, deadline: Duration) {
        let element = self
            .wait_for(&format!("{css} to edit"), css, deadline)
            .await;
        self.call("POST", &format!("/element/{}/clear", element.0), None)
            .await
            .unwrap_or_else(|e| panic!("clear {css}: {e}"));
        self.type_into(css, text, deadline).await;
    }

    /// A PNG of the window, written to `path`.
    pub async fn screenshot(&self, path: &Path) {
        let data = self
            .call("GET", "/screenshot", None)
            .await
            .unwrap_or_else(|e| panic!("screenshot: {e}"));
        let png = base64::engine::general_purpose::STANDARD
            .decode(data.as_str().unwrap_or_default())
            .expect("the screenshot is base64");
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("screenshot dir");
        }
        std::fs::write(path, png).expect("write the screenshot");
    }

    /// The browser's console messages so far (SEVERE ones include CSP refusals).
    pub async fn console_errors(&self) -> Vec<String> {
        let entries = self
            .call("POST", "/se/log", Some(json!({"type": "browser"})))
            .await
            .unwrap_or_default();
        entries
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|e| e["level"] == "SEVERE")
                    .filter_map(|e| e["message"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// `DELETE url` without an async runtime: drop may run inside or outside one.
fn delete(url: &str) -> std::io::Result<()> {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").unwrap_or(url);
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let mut stream = std::net::TcpStream::connect(host)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "DELETE /{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    )?;
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    Ok(())
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Ending the session closes Chromium; then the driver goes.
        let session = self.session.clone();
        let _ = delete(&session);
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}
