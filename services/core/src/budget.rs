//! Spend budgets as run state: the limits a run was started with (its own, over its
//! tenant's default — resolved where the run is started and recorded in `RunStarted`, so
//! the fold never reads config and a replay sees the same limits and prices), what the run
//! has spent, and the check before each dispatch.
//!
//! Usage is charged from the recorded outputs themselves: a succeeded step whose output
//! carries `usage.prompt_tokens`/`usage.completion_tokens` (what the `llm` handler records)
//! is charged when [`crate::evolve`] folds its `StepSucceeded`, priced with the run's price
//! table by the output's `model`. So spend is a pure function of the history.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::duration::Millis;

/// The node id of a budget interrupt (never a valid node id, so never a graph node's).
pub const BUDGET_NODE: &str = "$budget";

/// A run's budget: its limits and the price table its usage is charged with.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    #[serde(default)]
    pub limits: Limits,
    /// USD per 1k tokens, by model name (the `model` an `llm` output names).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub prices: BTreeMap<String, Price>,
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
    pub fn is_empty(&self) -> bool {
        self == &Limits::default()
    }

    /// `self` with every limit `over` sets replacing its own (a run's own over its
    /// tenant's default).
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
    pub fn raised(&self, raise: &Limits) -> Limits {
        Limits {
            tokens: self.tokens.map(|t| t + raise.tokens.unwrap_or(0)),
            cost_usd: self.cost_usd.map(|c| c + raise.cost_usd.unwrap_or(0.0)),
            tool_calls: self.tool_calls.map(|t| t + raise.tool_calls.unwrap_or(0)),
            wall_time: self
                .wall_time
                .map(|w| Millis(w.0 + raise.wall_time.map_or(0, |r| r.0))),
        }
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

impl Spend {
    pub fn is_zero(&self) -> bool {
        self == &Spend::default()
    }

    pub fn tokens(&self) -> u64 {
        self.prompt_tokens + self.completion_tokens
    }

    /// Charges a step's output if it carries token usage.
    pub fn charge(&mut self, output: &Value, prices: &BTreeMap<String, Price>) {
        let usage = &output["usage"];
        let count = |key: &str| usage.get(key).and_then(Value::as_u64);
        let (prompt, completion) = (count("prompt_tokens"), count("completion_tokens"));
        if prompt.is_none() && completion.is_none() {
            return;
        }
        let (prompt, completion) = (prompt.unwrap_or(0), completion.unwrap_or(0));
        self.prompt_tokens += prompt;
        self.completion_tokens += completion;
        self.llm_calls += 1;
        let price = output["model"].as_str().and_then(|m| prices.get(m));
        if let Some(price) = price {
            self.cost_usd += (prompt as f64 * price.input_per_1k
                + completion as f64 * price.output_per_1k)
                / 1000.0;
        }
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
    let limits: Limits =
        serde_json::from_value(raise.clone()).map_err(|e| format!("payload.raise: {e}"))?;
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
        spend.charge(&json!({"order": 1}), &prices);
        assert!(spend.is_zero());
        spend.charge(
            &json!({"model": "m", "usage": {"prompt_tokens": 500, "completion_tokens": 250}}),
            &prices,
        );
        assert_eq!(spend.tokens(), 750);
        assert!((spend.cost_usd - 1.0).abs() < 1e-9, "{}", spend.cost_usd);
        spend.charge(
            &json!({"model": "other", "usage": {"prompt_tokens": 10}}),
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
}
