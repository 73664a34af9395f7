//! Which intent topics exist, so a step dispatched to a queue nobody created fails that
//! step instead of stopping its partition.
//!
//! A node's `queue` is the graph author's to write, and any tenant may publish a graph.
//! An intent for a topic that does not exist is refused by Kafka for where it goes
//! (`txn::RefusalKind::Destination`), which stops the partition until an operator acts:
//! one tenant's typo would stop every run on that partition, every tenant's. So before an
//! intent is produced its topic is looked up; one the broker says does not exist gets, in
//! its place, a failed result for the attempt (retryable, `unknown_queue`), written to
//! `sortie.step-results` in the same transaction. The fold takes it like any result, so
//! the step retries by its policy and the run fails naming the topic — or goes on, if the
//! topic is created meanwhile. Only the broker's answer "no such topic" counts: when the
//! metadata cannot be had the intent is produced as before.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};

/// How long a topic found missing is taken as missing before it is looked up again.
const RECHECK: Duration = Duration::from_secs(10);
/// How long one lookup may take.
const LOOKUP: Duration = Duration::from_secs(5);

/// The error code of a dispatch to a queue without a topic.
pub(crate) const UNKNOWN_QUEUE: &str = "unknown_queue";

#[derive(Debug, Default)]
pub(crate) struct KnownTopics {
    known: HashSet<String>,
    missing: HashMap<String, Instant>,
}

impl KnownTopics {
    /// Whether an intent may be produced to `topic`: `false` only when the broker
    /// answered that it does not exist (within the last [`RECHECK`]).
    pub fn exists(&mut self, client: &BaseConsumer, topic: &str) -> bool {
        if self.known.contains(topic) {
            return true;
        }
        if self
            .missing
            .get(topic)
            .is_some_and(|at| at.elapsed() < RECHECK)
        {
            return false;
        }
        let found = match client.fetch_metadata(Some(topic), LOOKUP) {
            Ok(metadata) => metadata
                .topics()
                .iter()
                .find(|t| t.name() == topic)
                .map(|t| t.error().is_none() && !t.partitions().is_empty()),
            // No answer: not a "no".
            Err(_) => None,
        };
        match found {
            Some(true) | None => {
                if found.is_some() {
                    self.known.insert(topic.to_owned());
                    self.missing.remove(topic);
                }
                true
            }
            Some(false) => {
                tracing::warn!(
                    topic,
                    "An intent's topic does not exist: its step fails (unknown_queue) instead."
                );
                self.missing.insert(topic.to_owned(), Instant::now());
                false
            }
        }
    }
}
