//! Tenants share a queue's slots fairly (ADR 0030).
//!
//! A queue's consumer reads intents in partition order, but runs from every tenant hash
//! into the same partitions: taken in that order, one tenant's burst (or its steps that
//! hang until their timeout) would hold every slot while the others' intents wait behind
//! it. So the consumer reads ahead into a bounded buffer of intents *held* per tenant,
//! and a free slot goes to the tenant running the fewest intents for its weight (ties:
//! the one served longest ago). A tenant also never runs more than its cap at once, so a
//! tenant arriving at a queue another one fills finds a slot without waiting for the
//! other's calls to end.
//!
//! A held intent is tracked like a running one (`tracker.rs`): no commit passes its
//! offset, so a crash, a revocation or a shutdown before it runs only means it is
//! delivered again. This module is only the choice: which held item runs next.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// Past this many bytes of held intents, a queue reads no more until some run.
pub const MAX_HELD_BYTES: usize = 64 << 20;

/// How a queue's slots are shared between tenants.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FairShareConfig {
    /// Most intents of one tenant running at once on a queue (of this process). `None`:
    /// three quarters of the queue's slots (at least one), so one tenant never holds them
    /// all.
    pub tenant_max_in_flight: Option<usize>,
    /// A tenant's weight (default 1): with every tenant's intents waiting, slots are
    /// shared in proportion to the weights.
    pub weights: HashMap<String, u32>,
    /// Most intents held (read, not yet running) per queue, beyond which its partitions
    /// are paused. `None`: 64 per slot, from 64 to 4,096. (Held intents also stop being
    /// read past [`MAX_HELD_BYTES`].)
    pub max_held: Option<usize>,
}

impl FairShareConfig {
    /// The per-tenant cap for a queue of `slots`.
    pub fn tenant_cap(&self, slots: usize) -> usize {
        self.tenant_max_in_flight
            .unwrap_or(slots - slots / 4)
            .clamp(1, slots.max(1))
    }

    /// The held-intent bound for a queue of `slots`.
    pub fn held_cap(&self, slots: usize) -> usize {
        self.max_held.unwrap_or((slots * 64).clamp(64, 4096)).max(1)
    }

    /// Parses `TENANT=WEIGHT` (a positive integer).
    pub fn parse_weight(text: &str) -> Result<(String, u32), String> {
        let (tenant, weight) = text
            .split_once('=')
            .ok_or_else(|| format!("expected TENANT=WEIGHT, got {text:?}"))?;
        let weight: u32 = weight
            .trim()
            .parse()
            .map_err(|_| format!("the weight of {tenant:?} is not a whole number: {weight:?}"))?;
        if tenant.trim().is_empty() || weight == 0 || weight > 1000 {
            return Err(format!(
                "expected a tenant name and a weight from 1 to 1000, got {text:?}"
            ));
        }
        Ok((tenant.trim().to_owned(), weight))
    }
}

#[derive(Debug)]
struct Tenant<T> {
    held: VecDeque<T>,
    running: usize,
    weight: u32,
    /// When this tenant was last given a slot (a counter), for round-robin ties.
    served: u64,
}

/// The held intents of one queue, per tenant, and what each tenant runs.
#[derive(Debug)]
pub struct FairShare<T> {
    cap: usize,
    weights: HashMap<String, u32>,
    tenants: HashMap<Arc<str>, Tenant<T>>,
    held: usize,
    turn: u64,
}

impl<T> FairShare<T> {
    pub fn new(config: &FairShareConfig, slots: usize) -> Self {
        Self {
            cap: config.tenant_cap(slots),
            weights: config.weights.clone(),
            tenants: HashMap::new(),
            held: 0,
            turn: 0,
        }
    }

    /// Holds `item` of `tenant` until [`FairShare::admit`] gives it a slot.
    pub fn hold(&mut self, tenant: &str, item: T) {
        self.entry(tenant).held.push_back(item);
        self.held += 1;
    }

    fn entry(&mut self, tenant: &str) -> &mut Tenant<T> {
        if !self.tenants.contains_key(tenant) {
            let weight = self.weights.get(tenant).copied().unwrap_or(1).max(1);
            self.tenants.insert(
                Arc::from(tenant),
                Tenant {
                    held: VecDeque::new(),
                    running: 0,
                    weight,
                    served: 0,
                },
            );
        }
        self.tenants.get_mut(tenant).expect("inserted above")
    }

    /// The next item to run and its tenant, counted as running: of the tenants with
    /// items held and below their cap, the one running the fewest for its weight (the
    /// one served longest ago on a tie). `None`: nothing held, or every tenant holding
    /// something is at its cap.
    pub fn admit(&mut self) -> Option<(Arc<str>, T)> {
        let cap = self.cap;
        let (name, _) = self
            .tenants
            .iter()
            .filter(|(_, t)| !t.held.is_empty() && t.running < cap)
            .min_by(|(_, a), (_, b)| {
                // a.running / a.weight against b.running / b.weight, without division.
                (a.running as u64 * b.weight as u64)
                    .cmp(&(b.running as u64 * a.weight as u64))
                    .then(a.served.cmp(&b.served))
            })?;
        let name = name.clone();
        self.turn += 1;
        let turn = self.turn;
        let tenant = self.tenants.get_mut(&name).expect("chosen above");
        let item = tenant.held.pop_front().expect("chosen with something held");
        tenant.running += 1;
        tenant.served = turn;
        self.held -= 1;
        Some((name, item))
    }

    /// `tenant` runs one more (a call taken back after its pre-call commit), even over
    /// its cap.
    pub fn resume(&mut self, tenant: &str) {
        self.entry(tenant).running += 1;
    }

    /// One of `tenant`'s items stopped running (ended, or waits without a slot).
    pub fn finished(&mut self, tenant: &str) {
        if let Some(t) = self.tenants.get_mut(tenant) {
            t.running = t.running.saturating_sub(1);
            if t.running == 0 && t.held.is_empty() && self.tenants.len() > 1024 {
                self.tenants.remove(tenant);
            }
        }
    }

    /// Drops the held items `keep` refuses (a revoked partition's), returning how many.
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) -> usize {
        let mut dropped = 0;
        for tenant in self.tenants.values_mut() {
            let before = tenant.held.len();
            tenant.held.retain(&mut keep);
            dropped += before - tenant.held.len();
        }
        self.held -= dropped;
        dropped
    }

    /// How many items are held (not running).
    pub fn held(&self) -> usize {
        self.held
    }

    /// How many of `tenant`'s items run.
    pub fn running(&self, tenant: &str) -> usize {
        self.tenants.get(tenant).map_or(0, |t| t.running)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(cap: Option<usize>, weights: &[(&str, u32)], slots: usize) -> FairShare<u32> {
        FairShare::new(
            &FairShareConfig {
                tenant_max_in_flight: cap,
                weights: weights.iter().map(|(t, w)| (t.to_string(), *w)).collect(),
                max_held: None,
            },
            slots,
        )
    }

    /// Takes up to `slots` items, as the consumer does when that many slots are free.
    fn take(share: &mut FairShare<u32>, slots: usize) -> Vec<(String, u32)> {
        (0..slots)
            .map_while(|_| share.admit())
            .map(|(t, i)| (t.to_string(), i))
            .collect()
    }

    #[test]
    fn a_burst_first_in_line_does_not_take_every_slot() {
        let mut s = share(None, &[], 16);
        for i in 0..1000 {
            s.hold("attacker", i);
        }
        s.hold("victim", 0);
        let taken = take(&mut s, 16);
        assert!(
            taken.iter().any(|(t, _)| t == "victim"),
            "the victim's intent, held behind a thousand, runs among the first 16: {taken:?}"
        );
        assert_eq!(
            taken.iter().filter(|(t, _)| t == "attacker").count(),
            12,
            "the attacker stops at its cap (3/4 of 16)"
        );
        assert_eq!(s.held(), 1000 - 12);
    }

    #[test]
    fn a_tenant_holding_every_slot_leaves_room_for_a_newcomer() {
        let mut s = share(None, &[], 16);
        for i in 0..100 {
            s.hold("a", i);
        }
        assert_eq!(
            take(&mut s, 16).len(),
            12,
            "alone, a tenant stops at its cap"
        );
        s.hold("b", 0);
        assert_eq!(
            take(&mut s, 4),
            vec![("b".into(), 0)],
            "the newcomer runs at once"
        );
    }

    #[test]
    fn items_of_one_tenant_run_in_the_order_they_were_read() {
        let mut s = share(Some(16), &[], 16);
        for i in 0..10 {
            s.hold("a", i);
        }
        let order: Vec<u32> = take(&mut s, 10).into_iter().map(|(_, i)| i).collect();
        assert_eq!(order, (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn slots_are_shared_by_weight_when_every_tenant_waits() {
        let mut s = share(Some(100), &[("gold", 3)], 100);
        for i in 0..1000 {
            s.hold("gold", i);
            s.hold("bronze", i);
        }
        let taken = take(&mut s, 40);
        let gold = taken.iter().filter(|(t, _)| t == "gold").count();
        assert_eq!(gold, 30, "3:1 of 40 slots: {taken:?}");
    }

    #[test]
    fn equal_tenants_take_turns() {
        let mut s = share(Some(100), &[], 100);
        for i in 0..10 {
            for t in ["a", "b", "c"] {
                s.hold(t, i);
            }
        }
        let taken = take(&mut s, 9);
        for t in ["a", "b", "c"] {
            assert_eq!(taken.iter().filter(|(n, _)| n == t).count(), 3, "{taken:?}");
        }
    }

    #[test]
    fn a_finished_item_frees_its_tenants_slot() {
        let mut s = share(Some(1), &[], 4);
        s.hold("a", 1);
        s.hold("a", 2);
        assert_eq!(take(&mut s, 4).len(), 1, "cap 1");
        s.finished("a");
        assert_eq!(take(&mut s, 4), vec![("a".into(), 2)]);
        assert_eq!(s.running("a"), 1);
    }

    #[test]
    fn a_resumed_call_counts_even_over_the_cap() {
        let mut s = share(Some(1), &[], 4);
        s.hold("a", 1);
        take(&mut s, 1);
        s.finished("a"); // waits for its pre-call commit without a slot
        s.hold("a", 2);
        take(&mut s, 1);
        s.resume("a"); // the commit came: it calls
        assert_eq!(s.running("a"), 2);
        s.hold("a", 3);
        assert!(s.admit().is_none(), "over the cap: nothing more of a runs");
    }

    #[test]
    fn a_revoked_partitions_held_items_are_dropped() {
        let mut s = share(None, &[], 16);
        for i in 0..10 {
            s.hold(if i % 2 == 0 { "a" } else { "b" }, i);
        }
        assert_eq!(s.retain(|i| *i >= 5), 5);
        assert_eq!(s.held(), 5);
        let mut left: Vec<u32> = take(&mut s, 16).into_iter().map(|(_, i)| i).collect();
        left.sort_unstable();
        assert_eq!(left, vec![5, 6, 7, 8, 9]);
    }

    #[test]
    fn caps_and_weights_parse_and_clamp() {
        let config = FairShareConfig::default();
        assert_eq!(config.tenant_cap(16), 12);
        assert_eq!(config.tenant_cap(1), 1);
        assert_eq!(config.tenant_cap(3), 3);
        assert_eq!(config.held_cap(16), 1024);
        assert_eq!(config.held_cap(1), 64);
        assert_eq!(config.held_cap(1000), 4096);
        let config = FairShareConfig {
            tenant_max_in_flight: Some(100),
            ..FairShareConfig::default()
        };
        assert_eq!(config.tenant_cap(16), 16, "never above the queue's slots");
        assert_eq!(
            FairShareConfig::parse_weight("acme=3"),
            Ok(("acme".into(), 3))
        );
        for bad in ["acme", "acme=0", "acme=x", "=3", "acme=1001"] {
            assert!(FairShareConfig::parse_weight(bad).is_err(), "{bad}");
        }
    }
}
