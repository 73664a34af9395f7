//! Reading partitions to an end fixed when the read starts — the one loop behind every
//! "read it all, then go on" in Sortie: the reducer's restore, the graph catalog, the
//! gateway view's starting point, audit replay and the registry's schemas log.
//!
//! The end of a partition is fixed by the caller when the read starts. Asked through a
//! `read_committed` client ([`watermarks`]) it is the last stable offset: what is
//! committed now (audit, views). The reducer's restore asks a `read_uncommitted` client
//! for the high watermark instead: with `read_committed`, records of an open
//! transaction sit above the last stable offset, so a read to the high watermark of the
//! moment ends only once that transaction is decided. Transaction markers and compacted gaps advance a consumer's position without
//! handing out a message: how far a partition has been read is the larger of the last
//! record's offset + 1 and the consumer's position, never the last record alone.
//!
//! Blocking: run it on a blocking thread.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::client::{Client, ClientContext};
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::Offset;

use crate::{list_offsets, End};

/// How long a read may go without a record before it logs what it waits for.
const QUIET: Duration = Duration::from_secs(10);

/// Why a read ended early.
#[derive(Debug, thiserror::Error)]
pub enum ReadError<E> {
    #[error("reading {topic} did not reach the end of partitions {behind:?} within {waited:?}")]
    Timeout {
        topic: String,
        behind: Vec<i32>,
        waited: Duration,
    },
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    /// The caller's handler failed.
    #[error("{0}")]
    Handler(E),
}

/// What the handler says after a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Read on.
    More,
    /// This partition is finished here (e.g. a record that must not be skipped does not
    /// decode): its later records are passed over and it counts as done.
    StopPartition,
}

/// The context of a reader that sets `enable.partition.eof`: reaching the end of a
/// partition is how it knows it has read everything, not an error. librdkafka also
/// reports an empty partition's end as a client-wide error, which the default context
/// logged at ERROR once per start; other errors are warnings (a read is bounded and
/// reports its own failure).
#[derive(Debug, Default, Clone, Copy)]
pub struct ReaderContext;

impl ReaderContext {
    /// Whether `error` is only a partition's end.
    pub fn is_end_of_partition(error: &KafkaError) -> bool {
        matches!(
            error,
            KafkaError::Global(RDKafkaErrorCode::PartitionEOF) | KafkaError::PartitionEOF(_)
        )
    }
}

impl ClientContext for ReaderContext {
    fn error(&self, error: KafkaError, reason: &str) {
        if !Self::is_end_of_partition(&error) {
            tracing::warn!(%error, reason, "A reader's Kafka client reported an error.");
        }
    }
}

impl ConsumerContext for ReaderContext {}

/// The partition ids of `topic`; empty when the topic does not exist.
/// Asked through any client: a consumer's (`consumer.client()`) or a producer's.
pub fn partition_ids<C: ClientContext>(
    client: &Client<C>,
    topic: &str,
    timeout: Duration,
) -> Result<Vec<i32>, KafkaError> {
    let metadata = client.fetch_metadata(Some(topic), timeout)?;
    Ok(metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map(|t| t.partitions().iter().map(|p| p.id()).collect())
        .unwrap_or_default())
}

/// The (low, high) watermarks of `partitions` of `topic`: each end asked for every
/// partition in one request ([`list_offsets`]), retried on transient errors until
/// `deadline`.
pub fn watermarks<C, X>(
    consumer: &C,
    topic: &str,
    partitions: impl IntoIterator<Item = i32>,
    deadline: Instant,
) -> Result<BTreeMap<i32, (i64, i64)>, KafkaError>
where
    C: Consumer<X>,
    X: ConsumerContext,
{
    let partitions: Vec<i32> = partitions.into_iter().collect();
    let lows = list_offsets(consumer, topic, &partitions, End::Earliest, deadline)?;
    let highs = list_offsets(consumer, topic, &partitions, End::Latest, deadline)?;
    // `list_offsets` answers every partition asked, or fails.
    Ok(partitions
        .into_iter()
        .map(|p| (p, (lows[&p], highs[&p])))
        .collect())
}

/// How long [`to_end`] waits for a message before it looks at the positions again.
const POSITION_EVERY: Duration = Duration::from_millis(20);

/// Reads `topic` with `consumer` — already assigned to every partition of `spans` at its
/// start offset — until each partition's `next` reaches its end. `spans` maps a partition
/// to `(next, end)`: the first offset not read yet and the offset to read up to.
/// `handle` sees each record once, in offset order per partition; records of partitions
/// outside `spans` or below `next` are passed over. A record at or past `end` (written
/// after the read began) is still handed over when it comes in the same fetch: skipping it
/// while the position moves past it would count it as read.
///
/// Returns how far each partition was read (`next` per partition; a stopped partition
/// keeps the offset of the record that stopped it).
pub fn to_end<X, E>(
    consumer: &BaseConsumer<X>,
    topic: &str,
    spans: &BTreeMap<i32, (i64, i64)>,
    deadline: Instant,
    mut handle: impl FnMut(&BorrowedMessage<'_>) -> Result<Next, E>,
) -> Result<BTreeMap<i32, i64>, ReadError<E>>
where
    X: ConsumerContext,
{
    let started = Instant::now();
    let mut next: BTreeMap<i32, i64> = spans.iter().map(|(&p, &(from, _))| (p, from)).collect();
    let mut open: BTreeMap<i32, i64> = spans
        .iter()
        .filter(|(_, &(from, end))| from < end)
        .map(|(&p, &(_, end))| (p, end))
        .collect();
    // When nothing has been read for a while (a partition's leader gone, a transaction
    // left open), say which partitions are waited for: a wait is never silent.
    let mut quiet_since = Instant::now();
    while !open.is_empty() {
        if quiet_since.elapsed() >= QUIET {
            tracing::warn!(
                topic,
                behind = ?open.keys().collect::<Vec<_>>(),
                waited_ms = started.elapsed().as_millis() as u64,
                left_ms = deadline.saturating_duration_since(Instant::now()).as_millis() as u64,
                "Reading to the end of a topic: nothing read for a while; still waiting."
            );
            quiet_since = Instant::now();
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ReadError::Timeout {
                topic: topic.to_owned(),
                behind: open.keys().copied().collect(),
                waited: started.elapsed(),
            });
        }
        // Short: a partition whose tail is only transaction markers (a warm restart's
        // changelog: the last commit's) never delivers a message, only a new position,
        // and librdkafka serves the markers inside a poll that then waits out its
        // timeout. 200 ms here was most of a warm restart's restore.
        match consumer.poll(left.min(POSITION_EVERY)) {
            Some(Ok(message)) => {
                let partition = message.partition();
                let Some(&end) = open.get(&partition) else {
                    continue; // done, stopped, or not ours
                };
                let at = next.entry(partition).or_insert(0);
                if message.offset() < *at {
                    continue;
                }
                quiet_since = Instant::now();
                match handle(&message).map_err(ReadError::Handler)? {
                    Next::More => {
                        *at = message.offset() + 1;
                        if *at >= end {
                            open.remove(&partition);
                        }
                    }
                    Next::StopPartition => {
                        *at = message.offset();
                        open.remove(&partition);
                    }
                }
            }
            Some(Err(KafkaError::PartitionEOF(_))) | None => {
                // Control records (transaction markers) advance the position without a
                // message: the position, not the last message, says how far we are.
                if let Ok(position) = consumer.position() {
                    for element in position.elements_for_topic(topic) {
                        let partition = element.partition();
                        if let (Some(&end), Offset::Offset(o)) =
                            (open.get(&partition), element.offset())
                        {
                            let at = next.entry(partition).or_insert(0);
                            *at = (*at).max(o);
                            if *at >= end {
                                open.remove(&partition);
                            }
                        }
                    }
                }
            }
            Some(Err(error)) => {
                tracing::warn!(topic, %error, "Reading to the end of a topic: a read failed; reading on.");
            }
        }
    }
    Ok(next)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_partitions_end_is_quiet() {
        assert!(ReaderContext::is_end_of_partition(&KafkaError::Global(
            RDKafkaErrorCode::PartitionEOF
        )));
        assert!(ReaderContext::is_end_of_partition(
            &KafkaError::PartitionEOF(3)
        ));
        assert!(!ReaderContext::is_end_of_partition(&KafkaError::Global(
            RDKafkaErrorCode::AllBrokersDown
        )));
    }
}
