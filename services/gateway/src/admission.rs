//! A tenant's starts are admitted at a bounded rate, before anything is published.
//!
//! The reducer folds a partition's commands in offset order, so once a tenant's burst of
//! 10,000 starts is on the commands topic every other tenant's command on those
//! partitions waits behind it: fairness between tenants must begin before the topic.
//! Each tenant has a token bucket (`rate` starts a second, up to `burst` at once); a start
//! without a token is answered 429 `start_rate_exceeded` with `Retry-After`, publishing
//! nothing. The bucket is this gateway's: behind a load balancer spreading a tenant's
//! requests over N gateways, a tenant gets up to N times the rate (the chart divides the
//! rate it is given by the gateway replicas).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// How fast one tenant may start runs through one gateway.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartRate {
    /// Starts a second, sustained.
    pub per_second: f64,
    /// Starts at once after a quiet spell.
    pub burst: u32,
}

impl StartRate {
    /// A rate of `per_second` (above 0) with room for `burst` (at least 1) at once.
    pub fn new(per_second: f64, burst: u32) -> Result<Self, String> {
        if !(per_second.is_finite() && per_second > 0.0) {
            return Err(format!(
                "a start rate must be a positive number of starts a second, not {per_second}"
            ));
        }
        Ok(Self {
            per_second,
            burst: burst.max(1),
        })
    }
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Every tenant's bucket in this gateway.
#[derive(Debug)]
pub(crate) struct Admission {
    rate: Option<StartRate>,
    buckets: Mutex<HashMap<String, Bucket>>,
}

/// Buckets kept before full ones (tenants quiet long enough) are forgotten.
const MAX_BUCKETS: usize = 10_000;

impl Admission {
    pub(crate) fn new(rate: Option<StartRate>) -> Self {
        Self {
            rate,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one of `tenant`'s start tokens, or says how long until one is there.
    pub(crate) fn admit(&self, tenant: &str) -> Result<(), Duration> {
        self.admit_at(tenant, Instant::now())
    }

    fn admit_at(&self, tenant: &str, now: Instant) -> Result<(), Duration> {
        let Some(rate) = self.rate else {
            return Ok(());
        };
        let burst = f64::from(rate.burst);
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if buckets.len() >= MAX_BUCKETS && !buckets.contains_key(tenant) {
            buckets.retain(|_, b| {
                b.tokens + now.saturating_duration_since(b.at).as_secs_f64() * rate.per_second
                    < burst
            });
        }
        let bucket = buckets.entry(tenant.to_owned()).or_insert(Bucket {
            tokens: burst,
            at: now,
        });
        let refill = now.saturating_duration_since(bucket.at).as_secs_f64() * rate.per_second;
        bucket.tokens = (bucket.tokens + refill).min(burst);
        bucket.at = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64(
                (1.0 - bucket.tokens) / rate.per_second,
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_admitted_then_the_rate() {
        let admission = Admission::new(Some(StartRate::new(2.0, 3).expect("a rate")));
        let t0 = Instant::now();
        for _ in 0..3 {
            assert_eq!(admission.admit_at("acme", t0), Ok(()));
        }
        let wait = admission
            .admit_at("acme", t0)
            .expect_err("the burst is spent");
        assert_eq!(wait, Duration::from_millis(500), "one token every 500 ms");
        assert_eq!(admission.admit_at("acme", t0 + wait), Ok(()));
        assert!(admission.admit_at("acme", t0 + wait).is_err());
    }

    #[test]
    fn tenants_have_buckets_of_their_own() {
        let admission = Admission::new(Some(StartRate::new(1.0, 1).expect("a rate")));
        let t0 = Instant::now();
        assert_eq!(admission.admit_at("acme", t0), Ok(()));
        assert!(admission.admit_at("acme", t0).is_err());
        assert_eq!(
            admission.admit_at("globex", t0),
            Ok(()),
            "acme's burst is acme's"
        );
    }

    #[test]
    fn a_quiet_tenant_refills_only_up_to_its_burst() {
        let admission = Admission::new(Some(StartRate::new(10.0, 2).expect("a rate")));
        let t0 = Instant::now();
        assert_eq!(admission.admit_at("acme", t0), Ok(()));
        let later = t0 + Duration::from_secs(3600);
        assert_eq!(admission.admit_at("acme", later), Ok(()));
        assert_eq!(admission.admit_at("acme", later), Ok(()));
        assert!(
            admission.admit_at("acme", later).is_err(),
            "two at once, not 36,000"
        );
    }

    #[test]
    fn without_a_rate_every_start_is_admitted_and_bad_rates_are_refused() {
        let admission = Admission::new(None);
        for _ in 0..1000 {
            assert_eq!(admission.admit("acme"), Ok(()));
        }
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(StartRate::new(bad, 1).is_err(), "{bad}");
        }
        assert_eq!(StartRate::new(1.0, 0).expect("a rate").burst, 1);
    }
}
