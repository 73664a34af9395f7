//! Spend budgets as run state: the limits a run was started with (its own, over its
//! tenant's default — resolved where the run is started and recorded in `RunStarted`, so
//! the fold never reads config and a replay sees the same limits and prices), what the run
//! has spent, and the check before each dispatch.
//!
//! Usage is charged from the recorded outputs themselves: a succeeded step of the `llm`
//! tool ([`LLM_TOOL`], the step's tool as the run state records it) whose output carries
//! `usage.prompt_tokens`/`usage.completion_tokens` is charged when [`crate::evolve`] folds
//! its `StepSucceeded`, priced with the run's price table by the output's `model`. So
//! spend is a pure function of the history.
//!
//! **Untrusted numbers.** Token counts come from a model endpoint through an executor;
//! budgets come from a client. Neither is trusted:
//!
//! - A count must be an integer from 0 to [`MAX_TOKENS_PER_CALL`]. An `llm` step whose
//!   output reports anything else is **failed** (code `usage_refused`, not retried) by
//!   the fold before its output is recorded, and nothing is charged. As a payments
//!   platform would: a cost that cannot be accounted for is not accepted silently —
//!   ignoring it would let a broken or hostile endpoint spend past every limit unseen,
//!   and charging it would let one record exhaust a budget. Failing the step stops the
//!   run from building on a call it cannot account for, and the node's failure policy
//!   (compensation) applies, as for an output too large to keep.
//! - Counters saturate; they never wrap or panic.
//! - Outputs of other tools are never charged, whatever they carry: any receiver can put
//!   a `usage` field in its answer.
//! - Limits, raises and prices are held to [`Limits::check`] and [`Budget::check`]
//!   wherever they enter (the model layer's decode of a `StartRun`, the gateway, a budget
//!   approval's `raise`): finite, not negative, under a sane maximum.
//!
//! **Old histories.** Spend is derived in `evolve`, so the charging rule decides replayed
//! states. A run records the rules it is folded with in `RunStarted.rules`
//! ([`RULES`]); histories written before have none (0) and are folded with the rule they
//! were written under — usage charged from any output that carries it (saturating now,
//! which changes no history that did not already overflow) — so their stored states and
//! the budget decisions recorded against them stay as they were.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::duration::Millis;

/// The node id of a budget interrupt (never a valid node id, so never a graph node's).
pub const BUDGET_NODE: &str = "$budget";

/// The tool whose outputs are charged: the built-in chat-completions handler.
pub const LLM_TOOL: &str = "llm";

/// The rules new runs are decided and folded with (`RunStarted.rules`): 0 — histories
/// written before the field — charges usage from any output; 1 charges `llm` steps only;
/// 2 also arms a step timer of [`GUARDED_TIMEOUT`] for an `unsafe` or `reconcilable` step
/// whose node sets no `timeout` (see `decide`), so an attempt whose executor died after
/// its pre-call commit never holds its run for good; 3 gives a budget pause a required
/// role (the graph's `access.budget`, default [`BUDGET_ROLE`]), so not every member of the
/// tenant can raise a run's limits or fail it. A run keeps the rules it started with: an
/// older run's next decisions are made as they always were.
pub const RULES: u32 = 3;

/// The role that decides a budget pause when the graph names none (`access.budget`).
pub const BUDGET_ROLE: &str = "operator";

/// The step timer of an `unsafe` or `reconcilable` step whose node sets no `timeout`
/// (rules 2): past it, an attempt not heard of is an unknown outcome (an operator, or a
/// status lookup, settles it). Longer than any executor's default call timeout should be:
/// a guarded call that may legitimately run longer sets its own `timeout`.
pub const GUARDED_TIMEOUT: crate::duration::Millis = crate::duration::Millis(15 * 60 * 1000);

/// Most prompt (or completion) tokens one model call may report: far past any model's
/// context, small enough that no sum of a run's calls comes near `u64`.
pub const MAX_TOKENS_PER_CALL: u64 = 1_000_000_000;
/// Highest token limit (or raise) a budget may name.
pub const MAX_TOKEN_LIMIT: u64 = 1_000_000_000_000;
/// Highest tool-call limit (or raise) a budget may name.
pub const MAX_TOOL_CALL_LIMIT: u64 = 1_000_000_000;
/// Highest cost limit (or raise) in USD a budget may name.
pub const MAX_COST_USD: f64 = 1e9;
/// Highest price per 1k tokens in USD a price table may name.
pub const MAX_PRICE_PER_1K: f64 = 1e6;
/// Longest wall time (or raise) a budget may name: ten years, in milliseconds.
pub const MAX_WALL_TIME_MS: i64 = 10 * 366 * 24 * 3600 * 1000;
/// Most models in one price table.
pub const MAX_PRICES: usize = 256;

/// A run's budget: its limits and the price table its usage is charged with.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    #[serde(default)]
    pub limits: Limits,
    /// USD per 1k tokens, by model name (the `model` an `llm` output names).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub prices: BTreeMap<String, Price>,
    /// The highest the limits may go, raises included: the tenant's ceiling when the run
    /// started (absent: none). A budget approval's raise is cut to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceiling: Option<Limits>,
}

/// Spend limits; an absent one is no limit.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Prompt plus completion tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
    /// Steps an agent asked for (a model's tool calls, `next_steps`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<u64>,
    /// From the run's start to the dispatch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wall_time: Option<Millis>,
}

impl Limits {
    /// These limits, each no higher than `cap`'s (a limit `cap` lacks stays as asked; one
    /// these lack is `cap`'s: a child never gets more than is left).
    pub fn capped_by(&self, cap: &Limits) -> Limits {
        fn min<T: PartialOrd>(a: Option<T>, b: Option<T>) -> Option<T> {
            match (a, b) {
                (Some(a), Some(b)) => Some(if b < a { b } else { a }),
                (a, b) => a.or(b),
            }
        }
        Limits {
            tokens: min(self.tokens, cap.tokens),
            cost_usd: min(self.cost_usd, cap.cost_usd),
            tool_calls: min(self.tool_calls, cap.tool_calls),
            wall_time: min(self.wall_time, cap.wall_time),
        }
    }

    /// Each count limit divided among `parts` children (a wall time is not divided: each
    /// child's runs from its own start).
    pub fn share(&self, parts: u64) -> Limits {
        let parts = parts.max(1);
        Limits {
            tokens: self.tokens.map(|t| t / parts),
            cost_usd: self.cost_usd.map(|c| c / parts as f64),
            tool_calls: self.tool_calls.map(|t| t / parts),
            wall_time: self.wall_time,
        }
    }
}

impl Budget {
    /// What is left of this budget after `spend`, with the same prices: the most a child
    /// run started now may spend ([`crate::child`]).
    pub fn remaining(&self, spend: &Spend) -> Budget {
        Budget {
            limits: Limits {
                tokens: self.limits.tokens.map(|t| t.saturating_sub(spend.tokens())),
                cost_usd: self.limits.cost_usd.map(|c| (c - spend.cost_usd).max(0.0)),
                tool_calls: self
                    .limits
                    .tool_calls
                    .map(|t| t.saturating_sub(spend.tool_calls)),
                wall_time: self.limits.wall_time,
            },
            prices: self.prices.clone(),
            ceiling: self.ceiling.clone(),
        }
    }
}

impl Limits {
    pub fn is_empty(&self) -> bool {
        self == &Limits::default()
    }

    /// Whether every limit is one a run can be held to: counts up to their maximum
    /// ([`MAX_TOKEN_LIMIT`], [`MAX_TOOL_CALL_LIMIT`]), a cost that is a finite number from
    /// 0 to [`MAX_COST_USD`], a wall time from 0 to [`MAX_WALL_TIME_MS`]. The same check
    /// holds a raise. The error names the limit.
    pub fn check(&self) -> Result<(), String> {
        if let Some(tokens) = self.tokens.filter(|t| *t > MAX_TOKEN_LIMIT) {
            return Err(format!(
                "tokens is {tokens}; at most {MAX_TOKEN_LIMIT} is allowed"
            ));
        }
        if let Some(calls) = self.tool_calls.filter(|c| *c > MAX_TOOL_CALL_LIMIT) {
            return Err(format!(
                "tool_calls is {calls}; at most {MAX_TOOL_CALL_LIMIT} is allowed"
            ));
        }
        if let Some(cost) = self.cost_usd {
            check_amount("cost_usd", cost, MAX_COST_USD)?;
        }
        if let Some(wall) = self
            .wall_time
            .filter(|w| !(0..=MAX_WALL_TIME_MS).contains(&w.0))
        {
            return Err(format!(
                "wall_time is {} ms; it must be from 0 to {MAX_WALL_TIME_MS} ms",
                wall.0
            ));
        }
        Ok(())
    }

    /// `self` with every limit `over` sets replacing its own (a run's own over its
    /// tenant's default).
    /// The first of these limits that `cap` sets lower (or that `cap` sets and these lack,
    /// which is no limit at all), named with both values: what a start asking past its
    /// tenant's ceiling is told.
    pub fn over(&self, cap: &Limits) -> Option<String> {
        fn past<T: PartialOrd + std::fmt::Debug>(
            name: &str,
            asked: Option<T>,
            cap: Option<T>,
        ) -> Option<String> {
            match (asked, cap) {
                (Some(a), Some(c)) if a > c => {
                    Some(format!("{name} {a:?} is over the ceiling {c:?}"))
                }
                (None, Some(c)) => Some(format!("no {name} limit is over the ceiling {c:?}")),
                _ => None,
            }
        }
        past("tokens", self.tokens, cap.tokens)
            .or_else(|| past("cost_usd", self.cost_usd, cap.cost_usd))
            .or_else(|| past("tool_calls", self.tool_calls, cap.tool_calls))
            .or_else(|| {
                past(
                    "wall_time",
                    self.wall_time.map(|w| w.0),
                    cap.wall_time.map(|w| w.0),
                )
            })
    }

    pub fn overridden_by(&self, over: &Limits) -> Limits {
        Limits {
            tokens: over.tokens.or(self.tokens),
            cost_usd: over.cost_usd.or(self.cost_usd),
            tool_calls: over.tool_calls.or(self.tool_calls),
            wall_time: over.wall_time.or(self.wall_time),
        }
    }

    /// Raises each limit by the amount `raise` gives for it (a limit that is absent stays
    /// absent: there is nothing to raise).
    ///
    /// Saturating: a raise never wraps or panics (raises are checked before they are
    /// recorded, but histories written before the check fold through here too).
    pub fn raised(&self, raise: &Limits) -> Limits {
        Limits {
            tokens: self
                .tokens
                .map(|t| t.saturating_add(raise.tokens.unwrap_or(0))),
            cost_usd: self.cost_usd.map(|c| c + raise.cost_usd.unwrap_or(0.0)),
            tool_calls: self
                .tool_calls
                .map(|t| t.saturating_add(raise.tool_calls.unwrap_or(0))),
            wall_time: self
                .wall_time
                .map(|w| Millis(w.0.saturating_add(raise.wall_time.map_or(0, |r| r.0)))),
        }
    }
}

/// Whether `amount`, called `field`, is a finite number from 0 to `max`.
fn check_amount(field: &str, amount: f64, max: f64) -> Result<(), String> {
    if !amount.is_finite() || !(0.0..=max).contains(&amount) {
        return Err(format!(
            "{field} is {amount}; it must be a number from 0 to {max}"
        ));
    }
    Ok(())
}

impl Budget {
    /// [`Limits::check`], and a price table of at most [`MAX_PRICES`] models, each named
    /// by an id, with finite prices from 0 to [`MAX_PRICE_PER_1K`].
    pub fn check(&self) -> Result<(), String> {
        self.limits.check()?;
        if self.prices.len() > MAX_PRICES {
            return Err(format!(
                "prices names {} models; at most {MAX_PRICES} are allowed",
                self.prices.len()
            ));
        }
        for (model, price) in &self.prices {
            crate::limits::check_id("a priced model's name", model)?;
            check_amount(
                &format!("prices.{model}.input_per_1k"),
                price.input_per_1k,
                MAX_PRICE_PER_1K,
            )?;
            check_amount(
                &format!("prices.{model}.output_per_1k"),
                price.output_per_1k,
                MAX_PRICE_PER_1K,
            )?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    pub input_per_1k: f64,
    pub output_per_1k: f64,
}

/// What a run has spent so far.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Spend {
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub completion_tokens: u64,
    #[serde(default)]
    pub cost_usd: f64,
    /// Model calls charged (outputs that carried usage).
    #[serde(default)]
    pub llm_calls: u64,
    #[serde(default)]
    pub tool_calls: u64,
}

/// The token usage one model call reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

impl Usage {
    /// The usage `output` reports: `None` when it names no count (no `usage`, or one
    /// without `prompt_tokens` and `completion_tokens`); an error when a count is not an
    /// integer from 0 to [`MAX_TOKENS_PER_CALL`], or `usage` is not an object. The error
    /// is a fixed sentence naming the field: it never copies the value.
    pub fn of(output: &Value) -> Result<Option<Usage>, String> {
        let usage = match output.get("usage") {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::Object(usage)) => usage,
            Some(_) => return Err("usage is not an object".into()),
        };
        let count = |key: &str| -> Result<Option<u64>, String> {
            match usage.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(value) => value
                    .as_u64()
                    .filter(|n| *n <= MAX_TOKENS_PER_CALL)
                    .map(Some)
                    .ok_or_else(|| {
                        format!("usage.{key} is not a token count from 0 to {MAX_TOKENS_PER_CALL}")
                    }),
            }
        };
        match (count("prompt_tokens")?, count("completion_tokens")?) {
            (None, None) => Ok(None),
            (prompt, completion) => Ok(Some(Usage {
                prompt_tokens: prompt.unwrap_or(0),
                completion_tokens: completion.unwrap_or(0),
            })),
        }
    }
}

impl Spend {
    pub fn is_zero(&self) -> bool {
        self == &Spend::default()
    }

    /// Adds what a child run spent (saturating; a cost stays finite).
    pub fn add(&mut self, other: &Spend) {
        self.prompt_tokens = self.prompt_tokens.saturating_add(other.prompt_tokens);
        self.completion_tokens = self
            .completion_tokens
            .saturating_add(other.completion_tokens);
        self.cost_usd = (self.cost_usd + other.cost_usd).min(f64::MAX);
        self.llm_calls = self.llm_calls.saturating_add(other.llm_calls);
        self.tool_calls = self.tool_calls.saturating_add(other.tool_calls);
    }

    /// This spend with the budget `reserved` for children in flight counted as spent:
    /// what the run's limits are held to.
    pub fn with_reserved<'r>(&self, reserved: impl IntoIterator<Item = &'r Limits>) -> Spend {
        let mut out = self.clone();
        for limits in reserved {
            out.prompt_tokens = out.prompt_tokens.saturating_add(limits.tokens.unwrap_or(0));
            out.cost_usd = (out.cost_usd + limits.cost_usd.unwrap_or(0.0)).min(f64::MAX);
            out.tool_calls = out
                .tool_calls
                .saturating_add(limits.tool_calls.unwrap_or(0));
        }
        out
    }

    /// Whether every count is one a child run's report may carry: token counts and tool
    /// calls up to their limits' maxima, a finite cost from 0 to [`MAX_COST_USD`].
    pub fn check(&self) -> Result<(), String> {
        for (name, n, max) in [
            ("prompt_tokens", self.prompt_tokens, MAX_TOKEN_LIMIT),
            ("completion_tokens", self.completion_tokens, MAX_TOKEN_LIMIT),
            ("llm_calls", self.llm_calls, MAX_TOOL_CALL_LIMIT),
            ("tool_calls", self.tool_calls, MAX_TOOL_CALL_LIMIT),
        ] {
            if n > max {
                return Err(format!("spend.{name} is {n}; at most {max} is allowed"));
            }
        }
        check_amount("spend.cost_usd", self.cost_usd, MAX_COST_USD)
    }

    pub fn tokens(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }

    /// Charges the output of a step of `tool` under the run's `rules` (see the module
    /// doc): from rules 1, only an `llm` step's usage within bounds; before, any output's.
    pub fn charge_step(
        &mut self,
        rules: u32,
        tool: &str,
        output: &Value,
        prices: &BTreeMap<String, Price>,
    ) {
        if rules == 0 {
            return self.charge_any(output, prices);
        }
        if tool != LLM_TOOL {
            return;
        }
        // The fold refuses an llm output whose usage is out of bounds before it is
        // recorded, so a recorded one is always within them.
        if let Ok(Some(usage)) = Usage::of(output) {
            self.charge(usage, output["model"].as_str(), prices);
        }
    }

    /// Charges one call's usage, priced by `model`.
    pub fn charge(&mut self, usage: Usage, model: Option<&str>, prices: &BTreeMap<String, Price>) {
        let Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
        } = usage;
        self.prompt_tokens = self.prompt_tokens.saturating_add(prompt);
        self.completion_tokens = self.completion_tokens.saturating_add(completion);
        self.llm_calls = self.llm_calls.saturating_add(1);
        if let Some(price) = model.and_then(|m| prices.get(m)) {
            let cost = (prompt as f64 * price.input_per_1k
                + completion as f64 * price.output_per_1k)
                / 1000.0;
            self.cost_usd = (self.cost_usd + cost).min(f64::MAX);
        }
    }

    /// The rule of histories written before `RunStarted.rules` (rules 0): any output that
    /// carries a count is charged, whatever the step's tool. Kept so those histories fold
    /// to the states they were written with.
    fn charge_any(&mut self, output: &Value, prices: &BTreeMap<String, Price>) {
        let usage = &output["usage"];
        let count = |key: &str| usage.get(key).and_then(Value::as_u64);
        let (prompt, completion) = (count("prompt_tokens"), count("completion_tokens"));
        if prompt.is_none() && completion.is_none() {
            return;
        }
        let usage = Usage {
            prompt_tokens: prompt.unwrap_or(0),
            completion_tokens: completion.unwrap_or(0),
        };
        self.charge(usage, output["model"].as_str(), prices);
    }
}

/// Which limit the next dispatch would exceed, as a sentence, if any. `new_tool_calls` is
/// how many agent-requested steps the dispatch adds; `elapsed` is the time since the run's
/// start (input timestamps).
pub fn exceeded(
    limits: &Limits,
    spend: &Spend,
    new_tool_calls: u64,
    elapsed: i64,
) -> Option<String> {
    if let Some(max) = limits.tokens {
        if spend.tokens() >= max {
            return Some(format!("tokens: {} spent of {max}", spend.tokens()));
        }
    }
    if let Some(max) = limits.cost_usd {
        if spend.cost_usd >= max {
            return Some(format!("cost_usd: {:.6} spent of {max}", spend.cost_usd));
        }
    }
    if let Some(max) = limits.tool_calls {
        if new_tool_calls > 0 && spend.tool_calls + new_tool_calls > max {
            return Some(format!(
                "tool_calls: {} made, {new_tool_calls} more asked for, of {max}",
                spend.tool_calls
            ));
        }
    }
    if let Some(max) = limits.wall_time {
        if elapsed >= max.0 {
            return Some(format!(
                "wall_time: {elapsed} ms since the start, of {} ms",
                max.0
            ));
        }
    }
    None
}

/// The `raise` of a budget approval's payload: `{"raise": {"tokens": 1000, ...}}`.
pub fn raise_of(payload: Option<&Value>) -> Result<Limits, String> {
    let raise = payload
        .and_then(|p| p.get("raise"))
        .ok_or("approving a budget needs a payload {\"raise\": {...}} naming what to raise")?;
    // A fixed sentence: serde's message may quote what the client sent.
    let limits: Limits = serde_json::from_value(raise.clone()).map_err(|_| {
        "payload.raise is not a set of limits (tokens, cost_usd, tool_calls, wall_time)".to_owned()
    })?;
    if limits.is_empty() {
        return Err("payload.raise raises nothing".into());
    }
    Ok(limits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn usage_is_charged_with_the_models_price() {
        let prices = BTreeMap::from([(
            "m".to_owned(),
            Price {
                input_per_1k: 1.0,
                output_per_1k: 2.0,
            },
        )]);
        let mut spend = Spend::default();
        spend.charge_step(RULES, LLM_TOOL, &json!({"order": 1}), &prices);
        assert!(spend.is_zero());
        spend.charge_step(
            RULES,
            LLM_TOOL,
            &json!({"model": "m", "usage": {"prompt_tokens": 500, "completion_tokens": 250}}),
            &prices,
        );
        assert_eq!(spend.tokens(), 750);
        assert!((spend.cost_usd - 1.0).abs() < 1e-9, "{}", spend.cost_usd);
        spend.charge_step(
            RULES,
            LLM_TOOL,
            &json!({"model": "other", "usage": {"prompt_tokens": 10}}),
            &prices,
        );
        spend.charge_step(
            RULES,
            "http",
            &json!({"model": "m", "usage": {"prompt_tokens": 10}}),
            &prices,
        );
        assert_eq!((spend.tokens(), spend.llm_calls), (760, 2));
    }

    #[test]
    fn limits_trip_before_the_dispatch_that_would_pass_them() {
        let limits = Limits {
            tokens: Some(100),
            tool_calls: Some(2),
            wall_time: Some(Millis(1_000)),
            cost_usd: None,
        };
        let mut spend = Spend::default();
        assert_eq!(exceeded(&limits, &spend, 2, 999), None);
        assert!(exceeded(&limits, &spend, 3, 0).is_some_and(|r| r.starts_with("tool_calls")));
        assert!(exceeded(&limits, &spend, 0, 1_000).is_some_and(|r| r.starts_with("wall_time")));
        spend.prompt_tokens = 100;
        assert!(exceeded(&limits, &spend, 0, 0).is_some_and(|r| r.starts_with("tokens")));
        let raised =
            limits.raised(&raise_of(Some(&json!({"raise": {"tokens": 50}}))).expect("a raise"));
        assert_eq!(raised.tokens, Some(150));
        assert_eq!(exceeded(&raised, &spend, 0, 0), None);
        assert!(raise_of(Some(&json!({"raise": {}}))).is_err());
        assert!(raise_of(None).is_err());
    }

    #[test]
    fn usage_counts_are_bounded_integers() {
        let of = |usage: Value| Usage::of(&json!({ "usage": usage }));
        assert_eq!(of(json!(null)), Ok(None));
        assert_eq!(of(json!({"total_tokens": 5})), Ok(None));
        assert_eq!(
            of(json!({"prompt_tokens": MAX_TOKENS_PER_CALL})),
            Ok(Some(Usage {
                prompt_tokens: MAX_TOKENS_PER_CALL,
                completion_tokens: 0
            }))
        );
        for bad in [
            json!({"prompt_tokens": MAX_TOKENS_PER_CALL + 1}),
            json!({"completion_tokens": -1}),
            json!({"completion_tokens": 2.5}),
            json!({"prompt_tokens": "7"}),
            json!([1, 2]),
        ] {
            let refused = of(bad.clone());
            assert!(refused.is_err(), "{bad}");
            assert!(
                !refused.expect_err("refused").contains('7'),
                "never echoes the value"
            );
        }
        assert!(
            Limits::default().raised(&Limits {
                tokens: Some(u64::MAX),
                ..Limits::default()
            }) == Limits::default()
        );
        let saturated = Limits {
            tokens: Some(u64::MAX - 1),
            wall_time: Some(Millis(i64::MAX - 1)),
            ..Limits::default()
        }
        .raised(&Limits {
            tokens: Some(10),
            wall_time: Some(Millis(10)),
            ..Limits::default()
        });
        assert_eq!(saturated.tokens, Some(u64::MAX));
        assert_eq!(saturated.wall_time, Some(Millis(i64::MAX)));
    }
}
