use std::time::Duration;

use rdkafka::error::KafkaError;

/// Why the registry could not open, persist or serve.
///
/// Errors a client caused (an invalid schema, an unknown subject) are HTTP answers, not
/// values of this type.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kafka error: {0}")]
    Kafka(#[from] KafkaError),
    #[error("could not create the schemas topic {topic}: {reason}")]
    CreateTopic { topic: String, reason: String },
    #[error("timed out after {waited:?} while {doing}")]
    Timeout { waited: Duration, doing: String },
    #[error("record at offset {offset} of {topic} is not valid: {reason}")]
    Corrupt {
        topic: String,
        offset: i64,
        reason: String,
    },
    #[error("Kafka did not confirm the write of {what}: {reason}")]
    Write { what: String, reason: String },
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("a background task failed: {0}")]
    Task(String),
}
