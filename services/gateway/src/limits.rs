//! The shape rule at the HTTP edge: every payload, label set and free text a request
//! carries is held to [`sortie_core::limits`], the rule the reducer holds Kafka commands to,
//! and refused 400 `limit_exceeded` naming the limit and where (`limit`, `at`). Last,
//! right before publishing, the command the gateway built is read as the reducer reads it
//! ([`sortie_model::command_from_wire`]): whatever it would refuse (and dead-letter, so
//! the client would wait for an answer that never comes) is 400 `invalid_request` here.

use std::collections::BTreeMap;

use serde_json::Value;
use sortie_core::limits::{self, ShapeError};
use sortie_wire::records::RunCommand;

use crate::error::ApiError;

/// The limit of a free text (a comment, a reason, an error) in answers.
pub(crate) const TEXT_BYTES: &str = "text_bytes";
/// The limit of a run's labels (count, names, values) in answers.
pub(crate) const LABELS: &str = "labels";
/// Where a body too deep for the JSON parser to read breaks the depth limit.
const BODY: &str = "body";

/// 400 `limit_exceeded`: `limit` (`depth`, `members`, `key_bytes`, `string_bytes`,
/// `labels`, `text_bytes`) broken at `at`.
pub(crate) fn exceeded(limit: &str, at: &str, message: impl Into<String>) -> ApiError {
    ApiError::bad_request("limit_exceeded", message)
        .with("limit", limit)
        .with("at", at)
}

pub(crate) fn shape_exceeded(error: ShapeError) -> ApiError {
    exceeded(error.limit.name(), &error.at, error.message)
}

/// `value`, the payload called `field`, has the shape every payload has.
pub(crate) fn payload(field: &str, value: &Value) -> Result<(), ApiError> {
    limits::check_shape(field, value).map_err(shape_exceeded)
}

pub(crate) fn payload_opt(field: &str, value: Option<&Value>) -> Result<(), ApiError> {
    value.map_or(Ok(()), |v| payload(field, v))
}

/// `value`, the free text called `field`, is at most [`limits::MAX_TEXT_BYTES`].
pub(crate) fn text(field: &str, value: Option<&str>) -> Result<(), ApiError> {
    match value {
        Some(text) => limits::check_text(field, text, limits::MAX_TEXT_BYTES)
            .map_err(|message| exceeded(TEXT_BYTES, field, message)),
        None => Ok(()),
    }
}

pub(crate) fn labels(labels: &BTreeMap<String, String>) -> Result<(), ApiError> {
    limits::check_labels(labels.iter()).map_err(|message| exceeded(LABELS, LABELS, message))
}

/// A body serde_json would not read for its nesting (it stops at 128 levels): the depth
/// limit, named like any other.
pub(crate) fn too_deep_to_parse(error: &serde_json::Error) -> Option<ApiError> {
    error
        .to_string()
        .starts_with("recursion limit exceeded")
        .then(|| {
            exceeded(
                limits::Limit::Depth.name(),
                BODY,
                format!(
                    "the body nests too deep to read; a payload may nest at most {} levels",
                    limits::MAX_DEPTH
                ),
            )
        })
}

/// The command as the reducer will read it: the one rule, so gateway and reducer never
/// disagree about what may be published.
pub(crate) fn as_the_reducer_reads(command: &RunCommand) -> Result<(), ApiError> {
    sortie_model::command_from_wire(command.clone())
        .map(drop)
        .map_err(|invalid| {
            ApiError::bad_request(
                "invalid_request",
                format!("the reducer would refuse this command: {invalid}"),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested(depth: usize) -> Value {
        let mut value = serde_json::json!(1);
        for _ in 0..depth {
            value = serde_json::json!({ "a": value });
        }
        value
    }

    #[test]
    fn a_breach_names_its_limit_and_place() {
        assert!(payload("input", &nested(limits::MAX_DEPTH)).is_ok());
        let deep = payload("input", &nested(limits::MAX_DEPTH + 1)).expect_err("deep");
        assert_eq!(
            (deep.status.as_u16(), deep.code.as_str()),
            (400, "limit_exceeded")
        );
        let details = deep.details.unwrap_or_default();
        assert_eq!(details["limit"], "depth");
        assert!(
            details["at"]
                .as_str()
                .is_some_and(|at| at.starts_with("input.a.a")),
            "{details}"
        );
        let long = "x".repeat(limits::MAX_TEXT_BYTES + 1);
        let text = text("comment", Some(&long)).expect_err("long");
        assert_eq!(text.details.unwrap_or_default()["limit"], TEXT_BYTES);
        let many: BTreeMap<String, String> = (0..=limits::MAX_LABELS)
            .map(|i| (format!("l{i}"), String::new()))
            .collect();
        assert!(labels(&many).is_err());

        let body = "[".repeat(200);
        let refused = serde_json::from_str::<Value>(&body).expect_err("too deep");
        let answer = too_deep_to_parse(&refused).expect("named as depth");
        assert_eq!(answer.details.unwrap_or_default()["limit"], "depth");
        let bad = serde_json::from_str::<Value>("{").expect_err("bad");
        assert!(too_deep_to_parse(&bad).is_none());
    }
}
