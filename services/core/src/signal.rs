//! Signals: named outside events a run waits for ("the laptop was delivered").
//!
//! A node with `wait:` calls no tool: it opens a wait for a signal of its name and is done
//! when the signal (or, for a list, the signals) arrived, or when its deadline passed and
//! `on_timeout` says what follows. A signal is a `SignalRun` command on the commands
//! topic, like a decision: signed, keyed by the run id, answered by the reducer. This
//! module holds the node's declaration, the output a wait gives the nodes after it, and
//! the subset of JSON Schema a signal's payload is held to; the fold's handling is
//! `decide/signal.rs`.

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::duration::Millis;

/// Most signals one list wait takes (one without a `count` ends when it has this many).
pub const MAX_WAIT_SIGNALS: u32 = 100;
/// Most signals a run keeps for waits not open yet.
pub const MAX_EARLY_SIGNALS: usize = 32;
/// Most bytes (their JSON) the signals a run keeps for waits not open yet may take.
pub const MAX_EARLY_SIGNAL_BYTES: usize = 256 * 1024;
/// The tool name a waiting node has on the wire and in the state: it calls nothing.
pub const WAIT_TOOL: &str = "$wait";

/// `wait: {signal, schema, roles, timeout, on_timeout, many, count}` on a node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignalWait {
    /// The signal's name: 1-64 of `[A-Za-z0-9_.-]`, unique among the graph's waits.
    pub signal: String,
    /// What the payload must be: a JSON Schema of the subset [`check_schema`] accepts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<Value>,
    /// A sender needs one of these roles (empty: any principal of the run's tenant).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub roles: Vec<String>,
    /// How long the wait stays open. Nothing waits forever by default: 7 days.
    #[serde(default = "default_timeout")]
    pub timeout: Millis,
    #[serde(default, skip_serializing_if = "OnWaitTimeout::is_default")]
    pub on_timeout: OnWaitTimeout,
    /// Several signals (a list) rather than one.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub many: bool,
    /// With `many`: the wait ends once this many arrived (absent: at
    /// [`MAX_WAIT_SIGNALS`], or at the deadline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
}

fn default_timeout() -> Millis {
    Millis(7 * 86_400_000)
}

impl SignalWait {
    /// How many signals end the wait.
    pub fn wanted(&self) -> u32 {
        if self.many {
            self.count.unwrap_or(MAX_WAIT_SIGNALS)
        } else {
            1
        }
    }

    /// Why a principal with `roles` may not send this signal, if they may not.
    pub fn refusal(&self, roles: &[String]) -> Option<String> {
        if self.roles.is_empty() || self.roles.iter().any(|r| roles.contains(r)) {
            return None;
        }
        Some(format!(
            "sending signal {} needs one of the roles {}",
            self.signal,
            self.roles.join(", ")
        ))
    }
}

/// `on_timeout: fail | continue | {goto: <node>}` of a wait.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "OnWaitTimeoutRepr", into = "OnWaitTimeoutRepr")]
pub enum OnWaitTimeout {
    /// The run fails (compensations run).
    #[default]
    Fail,
    /// The wait ends with what arrived (`timed_out: true` in its output).
    Continue,
    /// The run goes on at another (detached) node instead: escalation.
    Goto(String),
}

impl OnWaitTimeout {
    fn is_default(&self) -> bool {
        *self == OnWaitTimeout::Fail
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            OnWaitTimeout::Fail => "fail",
            OnWaitTimeout::Continue => "continue",
            OnWaitTimeout::Goto(_) => "goto",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
enum OnWaitTimeoutRepr {
    Word(String),
    Goto { goto: String },
}

impl TryFrom<OnWaitTimeoutRepr> for OnWaitTimeout {
    type Error = String;

    fn try_from(repr: OnWaitTimeoutRepr) -> Result<Self, String> {
        match repr {
            OnWaitTimeoutRepr::Word(word) if word == "fail" => Ok(OnWaitTimeout::Fail),
            OnWaitTimeoutRepr::Word(word) if word == "continue" => Ok(OnWaitTimeout::Continue),
            OnWaitTimeoutRepr::Word(word) => Err(format!(
                "wait.on_timeout is `fail`, `continue` or `{{goto: <node>}}`, not {word:?}"
            )),
            OnWaitTimeoutRepr::Goto { goto } => Ok(OnWaitTimeout::Goto(goto)),
        }
    }
}

impl From<OnWaitTimeout> for OnWaitTimeoutRepr {
    fn from(value: OnWaitTimeout) -> Self {
        match value {
            OnWaitTimeout::Fail => OnWaitTimeoutRepr::Word("fail".into()),
            OnWaitTimeout::Continue => OnWaitTimeoutRepr::Word("continue".into()),
            OnWaitTimeout::Goto(goto) => OnWaitTimeoutRepr::Goto { goto },
        }
    }
}

/// Why a principal with `roles` may not send the signal `node` takes (a waiting node's,
/// or a conversation's messages), if they may not. The fold's rule, which the gateway
/// applies too before it publishes.
pub fn refusal(node: &crate::graph::Node, roles: &[String]) -> Option<String> {
    let (name, allowed) = match (&node.wait, &node.conversation) {
        (Some(wait), _) => return wait.refusal(roles),
        (None, Some(c)) => (&c.signal, &c.roles),
        (None, None) => return None,
    };
    if allowed.is_empty() || allowed.iter().any(|r| roles.contains(r)) {
        return None;
    }
    Some(format!(
        "sending signal {name} needs one of the roles {}",
        allowed.join(", ")
    ))
}

/// Why `payload` is no signal `node` takes: it fails the wait's schema, or it is no
/// conversation message ([`crate::converse::message`]).
pub fn check_payload(node: &crate::graph::Node, payload: &Value) -> Result<(), String> {
    if let Some(schema) = node.wait.as_ref().and_then(|w| w.schema.as_ref()) {
        validate(schema, payload)?;
    }
    if node.conversation.is_some() {
        crate::converse::message(payload)?;
    }
    Ok(())
}

/// Whether `name` is a valid signal name: 1-64 of `[A-Za-z0-9_.-]`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

/// One signal a wait took, as its output shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Received {
    pub signal_id: String,
    pub payload: Value,
    pub sent_by: String,
    pub at: i64,
}

impl Received {
    fn to_json(&self) -> Value {
        json!({
            "signal_id": self.signal_id,
            "payload": self.payload,
            "sent_by": self.sent_by,
            "at": self.at,
        })
    }
}

/// What a wait gives the nodes after it (`$steps.<node>.output`): for one signal
/// `{signal, signal_id, payload, sent_by, at, timed_out}` (the signal's fields null when
/// none arrived before a `continue` deadline); for a list `{signal, signals: [{signal_id,
/// payload, sent_by, at}], count, timed_out}`.
pub fn output(name: &str, many: bool, received: &[Received], timed_out: bool) -> Value {
    if many {
        return json!({
            "signal": name,
            "signals": received.iter().map(Received::to_json).collect::<Vec<_>>(),
            "count": received.len(),
            "timed_out": timed_out,
        });
    }
    let mut out = match received.first() {
        Some(signal) => signal.to_json(),
        None => json!({"signal_id": null, "payload": null, "sent_by": null, "at": null}),
    };
    if let Value::Object(map) = &mut out {
        map.insert("signal".into(), Value::String(name.to_owned()));
        map.insert("timed_out".into(), Value::Bool(timed_out));
    }
    out
}

/// The JSON Schema keywords a signal's schema may use. A schema naming any other keyword
/// is refused when the graph is published, so nobody relies on a rule nothing checks.
const KEYWORDS: &[&str] = &[
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "enum",
    "const",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "title",
    "description",
];
const TYPES: &[&str] = &[
    "object", "array", "string", "number", "integer", "boolean", "null",
];

/// Problems with a signal schema: a keyword outside the subset, a malformed value.
pub fn check_schema(schema: &Value) -> Result<(), String> {
    check_schema_at(schema, "schema")
}

fn check_schema_at(schema: &Value, at: &str) -> Result<(), String> {
    let Value::Object(map) = schema else {
        return Err(format!("{at} must be a JSON object"));
    };
    for (key, value) in map {
        if !KEYWORDS.contains(&key.as_str()) {
            return Err(format!(
                "{at}: keyword {key:?} is not supported (supported: {})",
                KEYWORDS.join(", ")
            ));
        }
        let ok = match key.as_str() {
            "type" => match value {
                Value::String(t) => TYPES.contains(&t.as_str()),
                Value::Array(ts) => ts
                    .iter()
                    .all(|t| t.as_str().is_some_and(|t| TYPES.contains(&t))),
                _ => false,
            },
            "properties" => match value {
                Value::Object(props) => {
                    for (name, sub) in props {
                        check_schema_at(sub, &format!("{at}.properties.{name}"))?;
                    }
                    true
                }
                _ => false,
            },
            "required" => value
                .as_array()
                .is_some_and(|r| r.iter().all(Value::is_string)),
            "additionalProperties" => match value {
                Value::Bool(_) => true,
                sub @ Value::Object(_) => {
                    check_schema_at(sub, &format!("{at}.additionalProperties"))?;
                    true
                }
                _ => false,
            },
            "items" => {
                check_schema_at(value, &format!("{at}.items"))?;
                true
            }
            "enum" => value.is_array(),
            "minimum" | "maximum" => value.is_number(),
            "minLength" | "maxLength" | "minItems" | "maxItems" => value.is_u64(),
            "title" | "description" => value.is_string(),
            _ => true, // const: any value
        };
        if !ok {
            return Err(format!("{at}.{key} has a value of the wrong kind"));
        }
    }
    Ok(())
}

/// Why `value` does not match `schema` (a schema [`check_schema`] accepted), naming the
/// first place that fails and never repeating the value itself.
pub fn validate(schema: &Value, value: &Value) -> Result<(), String> {
    validate_at(schema, value, "payload")
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn has_type(value: &Value, wanted: &str) -> bool {
    let actual = type_name(value);
    actual == wanted || (wanted == "number" && actual == "integer")
}

fn validate_at(schema: &Value, value: &Value, at: &str) -> Result<(), String> {
    let Value::Object(rules) = schema else {
        return Ok(());
    };
    if let Some(wanted) = rules.get("type") {
        let ok = match wanted {
            Value::String(t) => has_type(value, t),
            Value::Array(ts) => ts
                .iter()
                .filter_map(Value::as_str)
                .any(|t| has_type(value, t)),
            _ => true,
        };
        if !ok {
            return Err(format!(
                "{at} is {}, the schema wants {}",
                type_name(value),
                match wanted {
                    Value::String(t) => t.clone(),
                    other => other.to_string(),
                }
            ));
        }
    }
    if let Some(Value::Array(allowed)) = rules.get("enum") {
        if !allowed.contains(value) {
            return Err(format!("{at} is not one of the schema's enum values"));
        }
    }
    if let Some(constant) = rules.get("const") {
        if constant != value {
            return Err(format!("{at} is not the schema's const value"));
        }
    }
    if let Some(n) = value.as_f64() {
        if let Some(min) = rules.get("minimum").and_then(Value::as_f64) {
            if n < min {
                return Err(format!("{at} is below the minimum {min}"));
            }
        }
        if let Some(max) = rules.get("maximum").and_then(Value::as_f64) {
            if n > max {
                return Err(format!("{at} is above the maximum {max}"));
            }
        }
    }
    let bound = |key: &str| rules.get(key).and_then(Value::as_u64);
    if let Value::String(text) = value {
        let chars = text.chars().count() as u64;
        if bound("minLength").is_some_and(|min| chars < min) {
            return Err(format!("{at} is shorter than the schema's minLength"));
        }
        if bound("maxLength").is_some_and(|max| chars > max) {
            return Err(format!("{at} is longer than the schema's maxLength"));
        }
    }
    if let Value::Array(items) = value {
        let len = items.len() as u64;
        if bound("minItems").is_some_and(|min| len < min) {
            return Err(format!("{at} has fewer items than the schema's minItems"));
        }
        if bound("maxItems").is_some_and(|max| len > max) {
            return Err(format!("{at} has more items than the schema's maxItems"));
        }
        if let Some(item_schema) = rules.get("items") {
            for (i, item) in items.iter().enumerate() {
                validate_at(item_schema, item, &format!("{at}[{i}]"))?;
            }
        }
    }
    if let Value::Object(fields) = value {
        validate_object(rules, fields, at)?;
    }
    Ok(())
}

fn validate_object(
    rules: &Map<String, Value>,
    fields: &Map<String, Value>,
    at: &str,
) -> Result<(), String> {
    for name in rules
        .get("required")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
    {
        if !fields.contains_key(name) {
            return Err(format!("{at} lacks the required field {name:?}"));
        }
    }
    let properties = rules.get("properties").and_then(Value::as_object);
    for (name, field) in fields {
        // A field name is the sender's: shown only when the schema declares it.
        match properties.and_then(|p| p.get(name)) {
            Some(sub) => validate_at(sub, field, &format!("{at}.{name}"))?,
            None => match rules.get("additionalProperties") {
                Some(Value::Bool(false)) => {
                    return Err(format!(
                    "{at} has a field the schema does not declare (additionalProperties is false)"
                ))
                }
                Some(sub @ Value::Object(_)) => validate_at(sub, field, &format!("{at}.*"))?,
                _ => {}
            },
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schema_subset_is_checked_and_held() {
        let schema = json!({
            "type": "object",
            "required": ["tracking"],
            "properties": {
                "tracking": {"type": "string", "minLength": 3},
                "boxes": {"type": "integer", "minimum": 1},
                "state": {"enum": ["delivered", "left_at_door"]},
            },
            "additionalProperties": false,
        });
        check_schema(&schema).expect("a schema of the subset");
        assert!(validate(&schema, &json!({"tracking": "1Z9", "boxes": 2})).is_ok());
        let why = |v: Value| validate(&schema, &v).expect_err("refused");
        assert_eq!(
            why(json!({})),
            "payload lacks the required field \"tracking\""
        );
        assert_eq!(
            why(json!({"tracking": 7})),
            "payload.tracking is integer, the schema wants string"
        );
        assert!(why(json!({"tracking": "1Z"})).contains("minLength"));
        assert!(why(json!({"tracking": "1Z9", "boxes": 0})).contains("minimum"));
        assert!(why(json!({"tracking": "1Z9", "state": "lost"})).contains("enum"));
        assert!(why(json!({"tracking": "1Z9", "secret-name": 1})).contains("does not declare"));
        assert!(!why(json!({"tracking": "1Z9", "secret-name": 1})).contains("secret-name"));
        assert_eq!(why(json!([1])), "payload is array, the schema wants object");

        assert!(check_schema(&json!({"type": "object", "pattern": "x"}))
            .expect_err("refused")
            .contains("\"pattern\" is not supported"));
        assert!(check_schema(&json!({"type": "thing"})).is_err());
        assert!(check_schema(&json!({"properties": {"a": {"$ref": "#/x"}}})).is_err());
        assert!(check_schema(&json!("object")).is_err());
    }

    #[test]
    fn a_wait_gives_one_signal_or_a_list() {
        let got = [Received {
            signal_id: "s1".into(),
            payload: json!({"tracking": "1Z9"}),
            sent_by: "svc:logistics".into(),
            at: 5,
        }];
        let one = output("laptop_delivered", false, &got, false);
        assert_eq!(one["payload"]["tracking"], "1Z9");
        assert_eq!(one["signal"], "laptop_delivered");
        assert_eq!(one["timed_out"], false);
        let none = output("laptop_delivered", false, &[], true);
        assert_eq!(none["payload"], Value::Null);
        assert_eq!(none["timed_out"], true);
        let list = output("votes", true, &got, false);
        assert_eq!(list["signals"][0]["payload"]["tracking"], "1Z9");
        assert_eq!(list["count"], 1);
    }

    #[test]
    fn on_timeout_reads_three_ways() {
        let parse = |yaml: &str| serde_yaml::from_str::<OnWaitTimeout>(yaml);
        assert_eq!(parse("fail").ok(), Some(OnWaitTimeout::Fail));
        assert_eq!(parse("continue").ok(), Some(OnWaitTimeout::Continue));
        assert_eq!(
            parse("{goto: escalate}").ok(),
            Some(OnWaitTimeout::Goto("escalate".into()))
        );
        assert!(parse("cancel").is_err());
    }
}
