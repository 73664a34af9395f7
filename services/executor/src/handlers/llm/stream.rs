//! A streamed answer: server-sent events read as they arrive, each piece of text handed to
//! the step's [`Progress`], and the events assembled into the JSON the API answers when it
//! does not stream, so the recorded output is the same either way.
//!
//! Failures are those of a body read whole ([`crate::handlers::classify`]): a stream cut
//! off before its end (no `[DONE]`, no `message_stop`) is `body_lost`, one past
//! [`MAX_ANSWER_BYTES`] is `answer_too_large`, an event that is not JSON is `bad_response`,
//! and an error the API reports inside the stream is `stream_error` (unknown: the model
//! was called, and a `pure` step is simply called again).

use reqwest::StatusCode;
use serde_json::Value;
use sortie_wire::records::SideEffectClass;

use crate::handler::HandlerError;
use crate::handlers::{answer_too_large, receiver_text, MAX_ANSWER_BYTES};
use crate::progress::Progress;

/// One server-sent event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Event {
    /// The `event:` field (`message` when there is none).
    pub name: String,
    /// The `data:` lines, joined by newlines.
    pub data: String,
}

/// Splits bytes into server-sent events, whatever the chunks' boundaries: lines end with
/// LF or CRLF, an empty line ends an event, a line starting with `:` is a comment, and
/// `id:` and `retry:` are ignored.
#[derive(Debug, Default)]
pub(super) struct Parser {
    /// Bytes of a line not ended yet.
    line: Vec<u8>,
    name: Option<String>,
    data: Option<String>,
}

impl Parser {
    /// The events `chunk` completes.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<Event> {
        let mut events = Vec::new();
        let mut rest = chunk;
        while let Some(end) = rest.iter().position(|b| *b == b'\n') {
            let (head, tail) = rest.split_at(end);
            rest = &tail[1..];
            let line = if self.line.is_empty() {
                self.take_line(head)
            } else {
                self.line.extend_from_slice(head);
                let whole = std::mem::take(&mut self.line);
                self.take_line(&whole)
            };
            events.extend(line);
        }
        self.line.extend_from_slice(rest);
        events
    }

    /// The event the stream's last lines make without the blank line that would end it
    /// (a line without its end is dropped).
    pub fn finish(&mut self) -> Option<Event> {
        self.line.clear();
        self.dispatch()
    }

    fn take_line(&mut self, line: &[u8]) -> Option<Event> {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            return self.dispatch();
        }
        let line = String::from_utf8_lossy(line);
        if line.starts_with(':') {
            return None;
        }
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line.as_ref(), ""),
        };
        match field {
            "event" => self.name = Some(value.to_owned()),
            "data" => match &mut self.data {
                Some(data) => {
                    data.push('\n');
                    data.push_str(value);
                }
                None => self.data = Some(value.to_owned()),
            },
            _ => {}
        }
        None
    }

    fn dispatch(&mut self) -> Option<Event> {
        let name = self.name.take();
        let data = self.data.take()?;
        Some(Event {
            name: name
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| "message".to_owned()),
            data,
        })
    }
}

/// An API's streamed answer, put together event by event.
pub(super) trait Assembly {
    /// The event that ends the stream, as the API names it (for messages).
    const END: &'static str;
    /// Takes one event, its text reported to `progress`; `true` when it ends the answer.
    fn take(&mut self, event: &Event, progress: &Progress) -> Result<bool, HandlerError>;
    /// The answer, as the API's non-streaming JSON.
    fn answer(self) -> Value;
}

/// Reads a streamed answer and assembles it.
pub(super) struct Reader<A> {
    parser: Parser,
    assembly: A,
    read: usize,
    status: StatusCode,
    class: SideEffectClass,
}

impl<A: Assembly> Reader<A> {
    pub fn new(assembly: A, status: StatusCode, class: SideEffectClass) -> Self {
        Reader {
            parser: Parser::default(),
            assembly,
            read: 0,
            status,
            class,
        }
    }

    /// Takes one chunk of the body: the answer when its end came.
    pub fn feed(&mut self, chunk: &[u8], progress: &Progress) -> Result<bool, HandlerError> {
        if self.read + chunk.len() > MAX_ANSWER_BYTES {
            return Err(answer_too_large(
                self.status,
                self.class,
                "the rest was not read",
            ));
        }
        self.read += chunk.len();
        for event in self.parser.feed(chunk) {
            if self.assembly.take(&event, progress)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The body ended: the answer, if its end event came.
    pub fn end(mut self, progress: &Progress) -> Result<Value, HandlerError> {
        if let Some(event) = self.parser.finish() {
            if self.assembly.take(&event, progress)? {
                return Ok(self.assembly.answer());
            }
        }
        Err(HandlerError::unknown(
            "body_lost",
            format!(
                "the receiver answered {} but its stream ended before {}: the answer is incomplete",
                self.status,
                A::END
            ),
        ))
    }

    /// The answer, once [`Reader::feed`] said it came.
    pub fn answer(self) -> Value {
        self.assembly.answer()
    }
}

/// Reads `response`'s event stream to its end event.
pub(super) async fn read<A: Assembly>(
    mut response: reqwest::Response,
    assembly: A,
    class: SideEffectClass,
    progress: &Progress,
) -> Result<Value, HandlerError> {
    let status = response.status();
    let mut reader = Reader::new(assembly, status, class);
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if reader.feed(&chunk, progress)? {
                    return Ok(reader.answer());
                }
            }
            Ok(None) => return reader.end(progress),
            Err(e) => {
                return Err(HandlerError::unknown(
                    "body_lost",
                    format!("the receiver answered {status} but its body was lost: {e}"),
                ))
            }
        }
    }
}

/// Whether a response is an event stream (its `Content-Type` is `text/event-stream`).
pub(super) fn is_event_stream(response: &reqwest::Response) -> bool {
    response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("text/event-stream"))
}

/// An event's data as JSON, or the permanent failure of an unparsable answer.
pub(super) fn json(event: &Event) -> Result<Value, HandlerError> {
    serde_json::from_str(&event.data).map_err(|e| {
        HandlerError::permanent(
            "bad_response",
            format!(
                "an event of the model's answer is not JSON ({e}): {}",
                receiver_text(&event.data)
            ),
        )
    })
}

/// An error the API reported inside its stream: the model was called, so the outcome is
/// unknown, as for a body lost after a 2xx.
pub(super) fn stream_error(error: &Value) -> HandlerError {
    HandlerError::unknown(
        "stream_error",
        format!(
            "the model's answer stream reported an error: {}",
            receiver_text(&error.to_string())
        ),
    )
}

#[cfg(test)]
pub(super) mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::progress::Delta;

    /// A progress sink and what it saw.
    pub fn recorded() -> (Progress, Arc<Mutex<Vec<String>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        let progress = Progress::new(move |delta| {
            if let (Delta::Text(text), Ok(mut seen)) = (delta, sink.lock()) {
                seen.push(text);
            }
        });
        (progress, seen)
    }

    /// `text` fed to an assembly in chunks of `size` bytes (splitting lines, CRLFs and
    /// characters), then the body's end.
    pub fn assemble<A: Assembly>(
        assembly: A,
        text: &str,
        size: usize,
        progress: &Progress,
    ) -> Result<Value, HandlerError> {
        let mut reader = Reader::new(assembly, StatusCode::OK, SideEffectClass::Pure);
        for chunk in text.as_bytes().chunks(size) {
            if reader.feed(chunk, progress)? {
                return Ok(reader.answer());
            }
        }
        reader.end(progress)
    }

    fn events(text: &str, size: usize) -> Vec<Event> {
        let mut parser = Parser::default();
        let mut out = Vec::new();
        for chunk in text.as_bytes().chunks(size) {
            out.extend(parser.feed(chunk));
        }
        out.extend(parser.finish());
        out
    }

    fn event(name: &str, data: &str) -> Event {
        Event {
            name: name.into(),
            data: data.into(),
        }
    }

    #[test]
    fn events_are_parsed_across_chunks_with_lf_or_crlf() {
        let text =
            ": a comment\r\nevent: message_start\r\ndata: {\"a\":\r\ndata: 1}\r\nid: 7\r\n\r\n\
                    data: héllo wörld\n\ndata:no space\nretry: 10\n\nevent: ping\n\n\
                    data: [DONE]\n";
        let want = vec![
            event("message_start", "{\"a\":\n1}"),
            event("message", "héllo wörld"),
            event("message", "no space"),
            // `event: ping` without data is no event; the last one lacks its blank line.
            event("message", "[DONE]"),
        ];
        for size in [1, 2, 3, 5, 7, 64, text.len()] {
            assert_eq!(events(text, size), want, "chunks of {size}");
        }
        // A line cut before its end is dropped.
        assert_eq!(events("data: {\"cut", 4), vec![]);
    }

    #[test]
    fn a_too_large_stream_fails_as_a_too_large_body_does() {
        struct Never;
        impl Assembly for Never {
            const END: &'static str = "never";
            fn take(&mut self, _: &Event, _: &Progress) -> Result<bool, HandlerError> {
                Ok(false)
            }
            fn answer(self) -> Value {
                Value::Null
            }
        }
        let chunk = vec![b':'; 1 << 20];
        for (class, unknown) in [
            (SideEffectClass::Pure, false),
            (SideEffectClass::Unsafe, true),
        ] {
            let mut reader = Reader::new(Never, StatusCode::OK, class);
            let progress = Progress::default();
            let error = loop {
                if let Err(error) = reader.feed(&chunk, &progress) {
                    break error;
                }
            };
            assert_eq!(error.code(), "answer_too_large");
            assert_eq!(error.is_unknown(), unknown);
            assert!(!error.is_retryable());
        }
        let error = Reader::new(Never, StatusCode::OK, SideEffectClass::Pure)
            .end(&Progress::default())
            .expect_err("no end");
        assert_eq!(error.code(), "body_lost");
        assert!(error.is_unknown());
    }
}
