//! Metrics every Kafka consumer of Sortie reports: the name is a constant here, described
//! by [`describe`] at startup; [`consumer_lag`] is fed by a client context's `stats`
//! callback (`statistics.interval.ms` set on the consumer).

use metrics::{describe_gauge, gauge, Unit};
use rdkafka::Statistics;

/// Records behind the end of each partition, by `topic` and `partition`.
pub const CONSUMER_LAG: &str = "sortie_consumer_lag_records";

/// How often consumers that report lag emit librdkafka statistics.
pub const STATISTICS_INTERVAL_MS: &str = "5000";

pub fn describe() {
    describe_gauge!(
        CONSUMER_LAG,
        Unit::Count,
        "Records between this consumer's position and the end of each partition (last stable offset under read_committed), by topic and partition; 0 for partitions it does not own. From librdkafka statistics every 5 s."
    );
}

/// Sets the lag gauges from one statistics report: the partition's end minus the
/// position (or the committed offset before anything was consumed). The committed
/// offset alone would be stale for the reducer, whose offsets are committed by its
/// producer's transaction, not by the consumer.
pub fn consumer_lag(statistics: &Statistics) {
    for (topic, stats) in &statistics.topics {
        for (partition, p) in &stats.partitions {
            if *partition < 0 {
                continue; // librdkafka's internal "unassigned" partition
            }
            let end = if p.ls_offset >= 0 {
                p.ls_offset
            } else {
                p.hi_offset
            };
            let position = if p.app_offset >= 0 {
                p.app_offset
            } else {
                p.committed_offset
            };
            let lag = if p.desired && end >= 0 && position >= 0 {
                (end - position).max(0)
            } else {
                0
            };
            gauge!(CONSUMER_LAG, "topic" => topic.clone(), "partition" => partition.to_string())
                .set(lag as f64);
        }
    }
}
