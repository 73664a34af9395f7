use std::time::{Duration, Instant};

use rdkafka::consumer::{Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

/// Whether a metadata/offset error is the broker still settling (a topic just created, a
/// leader moving) rather than a real failure.
pub fn is_transient(error: &KafkaError) -> bool {
    matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::NotLeaderForPartition
                | RDKafkaErrorCode::LeaderNotAvailable
                | RDKafkaErrorCode::UnknownTopicOrPartition
                | RDKafkaErrorCode::UnknownPartition
                | RDKafkaErrorCode::OperationTimedOut
                | RDKafkaErrorCode::RequestTimedOut
                | RDKafkaErrorCode::BrokerTransportFailure
                | RDKafkaErrorCode::AllBrokersDown
                | RDKafkaErrorCode::NotCoordinator
        )
    )
}

/// `fetch_watermarks`, retried on transient errors until `deadline`: right after a topic
/// is created the broker may still answer "not leader" for a moment.
///
/// The watermarks are as the client's `isolation.level` sees them: a `read_committed`
/// client gets the last stable offset as its "high" one, not the high watermark (librdkafka
/// sends its isolation level in ListOffsets). Ask through a `read_uncommitted` client for
/// the high watermark.
///
/// librdkafka caches a partition without a leader (a broker just died) as a permanent
/// error and answers "unknown partition" from that cache until something refreshes the
/// topic's metadata — which, for a topic the client does not consume, nothing does. So
/// every retry asks for the topic's metadata first.
pub fn fetch_watermarks<C, X>(
    consumer: &C,
    topic: &str,
    partition: i32,
    deadline: Instant,
) -> Result<(i64, i64), KafkaError>
where
    C: Consumer<X>,
    X: ConsumerContext,
{
    retrying(consumer, topic, &[partition], deadline, |left| {
        consumer.fetch_watermarks(topic, partition, left)
    })
}

/// Calls `ask` (given the time left, at least 100 ms) until it answers, or fails with an
/// error that is not [transient](is_transient), or `deadline` would pass before the
/// next try. Between tries it backs off (50 ms, doubling to 1 s) and asks for the topic's
/// metadata (see [`fetch_watermarks`]); after 2 s of waiting it warns once, naming
/// `partitions`, so a wait is never silent.
fn retrying<C, X, T>(
    consumer: &C,
    topic: &str,
    partitions: &[i32],
    deadline: Instant,
    mut ask: impl FnMut(Duration) -> Result<T, KafkaError>,
) -> Result<T, KafkaError>
where
    C: Consumer<X>,
    X: ConsumerContext,
{
    let mut pause = Duration::from_millis(50);
    let started = Instant::now();
    let mut warned = false;
    loop {
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(100));
        match ask(left) {
            Ok(answer) => return Ok(answer),
            Err(e) if is_transient(&e) && Instant::now() + pause < deadline => {
                // A moment after a topic is created this is normal; seconds of it mean a
                // leader is gone (a broker died): say so once, so a wait is never silent.
                if !warned && started.elapsed() >= Duration::from_secs(2) {
                    warned = true;
                    tracing::warn!(
                        topic,
                        ?partitions,
                        error = %e,
                        waited_ms = started.elapsed().as_millis() as u64,
                        left_ms = deadline.saturating_duration_since(Instant::now()).as_millis() as u64,
                        "Offsets still not available (a leader moving?); retrying until the deadline."
                    );
                } else {
                    tracing::debug!(topic, ?partitions, error = %e, "Offsets not available yet; retrying.");
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_secs(1));
                let left = deadline.saturating_duration_since(Instant::now());
                let _ = consumer.fetch_metadata(Some(topic), left.min(Duration::from_secs(2)));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Which end of a partition [`list_offsets`] asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The log start offset (what `auto.offset.reset=earliest` starts from).
    Earliest,
    /// The high watermark (`read_uncommitted` client) or the last stable offset
    /// (`read_committed`), as [`fetch_watermarks`] explains.
    Latest,
}

/// One end of each of `partitions` of `topic` (every one of them, or an error), in **one**
/// ListOffsets request (librdkafka's
/// `offsets_for_times` with the special timestamps −2/−1), retried like
/// [`fetch_watermarks`] until `deadline`. `fetch_watermarks` asks per partition and for
/// both ends, one after the other: for twelve partitions that was ~240 ms of a restart.
pub fn list_offsets<C, X>(
    consumer: &C,
    topic: &str,
    partitions: &[i32],
    end: End,
    deadline: Instant,
) -> Result<std::collections::BTreeMap<i32, i64>, KafkaError>
where
    C: Consumer<X>,
    X: ConsumerContext,
{
    use rdkafka::{Offset, TopicPartitionList};
    let mut found = std::collections::BTreeMap::new();
    if partitions.is_empty() {
        return Ok(found);
    }
    let at = match end {
        End::Earliest => Offset::Beginning,
        End::Latest => Offset::End,
    };
    retrying(consumer, topic, partitions, deadline, |left| {
        // Partitions answered by an earlier try are not asked again.
        let mut asked = TopicPartitionList::new();
        for &partition in partitions.iter().filter(|p| !found.contains_key(*p)) {
            asked.add_partition_offset(topic, partition, at)?;
        }
        let mut failed = None;
        for element in consumer.offsets_for_times(asked, left)?.elements() {
            match (element.error(), element.offset()) {
                (Ok(()), Offset::Offset(offset)) => {
                    found.insert(element.partition(), offset);
                }
                (Err(e), _) => failed = Some(e),
                (Ok(()), other) => {
                    // A broker answers every partition with an offset; anything else is
                    // a bug to report, not to wait out.
                    tracing::error!(
                        topic,
                        partition = element.partition(),
                        ?other,
                        "ListOffsets answered without an offset."
                    );
                    return Err(KafkaError::OffsetFetch(RDKafkaErrorCode::InvalidPartitions));
                }
            }
        }
        failed.map_or(Ok(()), Err)
    })?;
    // Every partition asked has its offset, or none is returned: a caller never reads a
    // missing one as 0.
    if let Some(missing) = partitions.iter().find(|p| !found.contains_key(*p)) {
        tracing::error!(
            topic,
            partition = missing,
            "ListOffsets left a partition unanswered."
        );
        return Err(KafkaError::OffsetFetch(RDKafkaErrorCode::UnknownPartition));
    }
    Ok(found)
}
