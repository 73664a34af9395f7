//! Server-sent events: the events of a streamed answer, the words and pieces its deltas
//! carry, and the response that sends them, at once or a slow model's deltas apart.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use super::{SLOW_PAUSE, SLOW_SUFFIX};

/// One server-sent event of a streamed answer, and whether it is a delta (which a slow
/// model waits before).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Sent {
    pub(super) delta: bool,
    pub(super) text: String,
}

pub(super) fn data(delta: bool, data: &Value) -> Sent {
    Sent {
        delta,
        text: format!("data: {data}\n\n"),
    }
}

pub(super) fn event(delta: bool, data: &Value) -> Sent {
    Sent {
        delta,
        text: format!(
            "event: {}\ndata: {data}\n\n",
            data["type"].as_str().unwrap_or("message")
        ),
    }
}

/// `text` a piece per word, each but the first with the whitespace before it.
pub(super) fn words(text: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    let (mut start, mut spaced) = (0, false);
    for (i, c) in text.char_indices() {
        if c.is_whitespace() && !spaced && i > start {
            pieces.push(&text[start..i]);
            start = i;
        }
        spaced = c.is_whitespace();
    }
    if start < text.len() {
        pieces.push(&text[start..]);
    }
    pieces
}

/// `text` in pieces of at most `size` characters.
pub(super) fn pieces(text: &str, size: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    chars.chunks(size).map(|c| c.iter().collect()).collect()
}

/// A streamed answer: at once, or a slow model's deltas [`SLOW_PAUSE`] apart.
pub(super) fn event_stream(sent: Vec<Sent>, request: &Value) -> Response {
    let slow = request["model"]
        .as_str()
        .is_some_and(|m| m.ends_with(SLOW_SUFFIX));
    let body = if slow {
        paced(sent, SLOW_PAUSE)
    } else {
        Body::from(sent.into_iter().map(|s| s.text).collect::<String>())
    };
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// A body whose events go out as they would from a model writing them: each delta but
/// the first `pause` after the one before.
fn paced(sent: Vec<Sent>, pause: Duration) -> Body {
    let events = futures::stream::unfold(
        (sent.into_iter(), true),
        move |(mut sent, first)| async move {
            let piece = sent.next()?;
            if piece.delta && !first {
                tokio::time::sleep(pause).await;
            }
            let first = first && !piece.delta;
            Some((Ok::<_, Infallible>(piece.text), (sent, first)))
        },
    );
    Body::from_stream(events)
}

#[cfg(test)]
pub(super) mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::model::FINAL_ANSWER;

    /// The `data:` of each event of a stream, in order.
    pub fn data_of(sent: &[Sent]) -> Vec<String> {
        sent.iter()
            .flat_map(|s| s.text.lines())
            .filter_map(|l| l.strip_prefix("data: "))
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn words_keep_their_spaces_and_pieces_their_characters() {
        assert_eq!(
            words(FINAL_ANSWER),
            ["Done:", " both", " tools", " answered."]
        );
        assert_eq!(words("  a  b "), ["  a", "  b", " "]);
        assert!(words("").is_empty());
        assert_eq!(pieces("{\"é\": 1}", 3), ["{\"é", "\": ", "1}"]);
    }
}
