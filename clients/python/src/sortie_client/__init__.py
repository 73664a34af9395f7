"""Talk to Sortie from Python: a `Client` that publishes signed run commands and waits
for their answers, a `Follower` that reads run events with their chain checked, and an
`Executor` that serves a queue with plain functions under the side-effect protocol."""

from .client import Answer, AnswerTimeout, Client, CommandRejected, correlated_run_id, load_signing_key
from .executor import (
    Call,
    Executor,
    ExecutorConfig,
    Found,
    HandlerError,
    NotFound,
    Permanent,
    RecordedFailed,
    Retryable,
    Unknown,
)
from .follower import ChainBroken, Event, Follower
from .wire import Connection, murmur2, partition_for, read_properties

__version__ = "0.1.0"

__all__ = [
    "Answer",
    "AnswerTimeout",
    "Call",
    "ChainBroken",
    "Client",
    "CommandRejected",
    "Connection",
    "Event",
    "Executor",
    "ExecutorConfig",
    "Follower",
    "Found",
    "HandlerError",
    "NotFound",
    "Permanent",
    "RecordedFailed",
    "Retryable",
    "Unknown",
    "correlated_run_id",
    "load_signing_key",
    "murmur2",
    "partition_for",
    "read_properties",
]
