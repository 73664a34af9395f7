//! What a handler reports while it runs: an `llm` step's text as the model writes it, a
//! custom handler's progress. Deltas go to `sortie.step-deltas`, outside the run's history:
//! never folded, never replayed, gone after the topic's retention. The step's result, when
//! it is committed, stays the one truth; a delta only shows what is happening meanwhile.

use std::sync::Arc;

/// One piece of progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delta {
    /// Text to append to what the step has written so far (a model's answer).
    Text(String),
    /// A note on where the step is ("fetching page 3 of 7"), replacing the previous one.
    Status(String),
}

/// Where a handler reports progress ([`crate::Call::progress`]). Reporting never blocks
/// and never fails the step: deltas are coalesced and sent in the background, and
/// dropped when nobody can take them (no topic, an executor built without one, a test).
#[derive(Clone, Default)]
pub struct Progress {
    sink: Option<Arc<dyn Fn(Delta) + Send + Sync>>,
}

impl Progress {
    /// Progress handed to `sink`.
    pub fn new(sink: impl Fn(Delta) + Send + Sync + 'static) -> Progress {
        Progress {
            sink: Some(Arc::new(sink)),
        }
    }

    /// Whether reports go anywhere (a handler may skip work that only feeds progress).
    pub fn is_listened(&self) -> bool {
        self.sink.is_some()
    }

    /// Appends `text` to what the step has written so far.
    pub fn text(&self, text: impl Into<String>) {
        let text = text.into();
        if let (Some(sink), false) = (&self.sink, text.is_empty()) {
            sink(Delta::Text(text));
        }
    }

    /// Says where the step is.
    pub fn status(&self, note: impl Into<String>) {
        if let Some(sink) = &self.sink {
            sink(Delta::Status(note.into()));
        }
    }
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Progress")
            .field("listened", &self.is_listened())
            .finish()
    }
}

/// Progress is not part of what a call is: two calls differing only in it are equal.
impl PartialEq for Progress {
    fn eq(&self, _: &Progress) -> bool {
        true
    }
}
