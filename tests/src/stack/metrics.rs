//! Scraping and summing Prometheus metrics.

#[allow(unused_imports)]
use super::*;

impl Process {
    /// The base URL of this spawn's metrics and health server (`http://127.0.0.1:<port>`),
    /// from the `metrics listening on <url>` line it prints (reducer and executor spawned
    /// with `--metrics-addr 127.0.0.1:0`, as [`Stack::reducer`] and
    /// [`Stack::executor_process`] do).
    pub async fn metrics_url(&self) -> String {
        let (log, start) = (self.log.clone(), self.log_start as usize);
        crate::wait_for(
            "the process to print its metrics address",
            Duration::from_secs(60),
            || {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                async move {
                    text.get(start..)?.lines().find_map(|l| {
                        l.trim()
                            .strip_prefix("metrics listening on ")
                            .map(str::to_owned)
                    })
                }
            },
        )
        .await
    }
}

/// One scrape of a Prometheus text endpoint: `series{labels}` (as rendered, labels
/// sorted as the exporter writes them) → value. Comment lines are skipped.
pub async fn scrape(url: &str) -> BTreeMap<String, f64> {
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .and_then(|r| r.error_for_status())
        .expect("GET /metrics")
        .text()
        .await
        .expect("metrics body");
    parse_metrics(&text)
}

/// Parses the Prometheus text format into `series → value`.
pub fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// The sum of every series of metric `name` whose labels include all of `labels`
/// (`[("tool", "echo")]`); 0 when none.
pub fn metric_sum(metrics: &BTreeMap<String, f64>, name: &str, labels: &[(&str, &str)]) -> f64 {
    metrics
        .iter()
        .filter(|(series, _)| {
            let (metric, rest) = series.split_once('{').unwrap_or((series.as_str(), ""));
            metric == name
                && labels
                    .iter()
                    .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
        })
        .map(|(_, value)| value)
        .sum()
}
