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
    let mut pause = Duration::from_millis(50);
    let started = Instant::now();
    let mut warned = false;
    loop {
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(100));
        match consumer.fetch_watermarks(topic, partition, left) {
            Ok(marks) => return Ok(marks),
            Err(e) if is_transient(&e) && Instant::now() + pause < deadline => {
                // A moment after a topic is created this is normal; seconds of it mean a
                // leader is gone (a broker died): say so once, so a wait is never silent.
                if !warned && started.elapsed() >= Duration::from_secs(2) {
                    warned = true;
                    tracing::warn!(
                        topic,
                        partition,
                        error = %e,
                        waited_ms = started.elapsed().as_millis() as u64,
                        left_ms = deadline.saturating_duration_since(Instant::now()).as_millis() as u64,
                        "Watermarks still not available (a leader moving?); retrying until the deadline."
                    );
                } else {
                    tracing::debug!(topic, partition, error = %e, "Watermarks not available yet; retrying.");
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
