"""Follow run events: one run's, or every run of a tenant, decoded, in order, with the
hash chain's links checked.

Events are on `<prefix>run-events`, keyed by run id, written inside the reducer's
transactions: read with `isolation.level=read_committed` (an aborted transaction's
events were never history). A run's events are on one partition, in `seq` order
(1, 2, ... gap-free).

**What is verified, and what is not.** Every event carries `prev_hash` (the previous
event's `hash`; null for the first) and `hash`. The follower checks the *links*: each
event's `seq` is one past the last it saw of that run and its `prev_hash` is that
event's `hash` — so a dropped, reordered, duplicated or spliced-in event is caught
(`ChainBroken`). It does **not** recompute `hash` itself: the hash is SHA-256 over the
canonical JSON of the reducer's *domain* event (`sortie_core::Event::compute_hash`),
whose shape differs from the Avro record kind by kind (payload strings parsed to JSON,
fields added or skipped by version); reproducing that mapping for every event kind in
Python would be a second implementation to keep in step. To verify content, run
`sortie audit replay --verify` over the topic. A follower that starts in the middle of a
run's history (not from its first event) checks links from the first event it sees on.

Sealed payloads (`{"$sealed": "v1..."}`) are returned as they are: this package does not
open them.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, Iterator, Optional, Tuple

from confluent_kafka import Consumer, KafkaError, TopicPartition

from .wire import Codec, Connection, partition_count, partition_for, union_kind

#: Fields of event bodies that hold JSON documents as strings; decoded for you.
_JSON_FIELDS = ("input", "args", "output", "proposal", "payload", "edited_args", "context")


class ChainBroken(Exception):
    """An event does not follow the last one seen of its run (gap, reorder, splice)."""


@dataclass
class Event:
    tenant: str
    run_id: str
    seq: int
    state_version: int
    at: datetime
    command_id: Optional[str]
    operation_id: Optional[str]
    prev_hash: Optional[str]
    hash: Optional[str]
    #: The body's kind: `RunStarted`, `StepDispatched`, `Interrupted`, ...
    kind: str
    #: The body's fields, JSON payload strings decoded (`input`, `args`, `output`, ...).
    fields: Dict[str, Any] = field(default_factory=dict)
    partition: int = -1
    offset: int = -1


def decode_event(record: Dict[str, Any], decode_payloads: bool = True) -> Event:
    kind, fields = union_kind(record["body"])
    fields = dict(fields)
    for name in _JSON_FIELDS if decode_payloads else ():
        value = fields.get(name)
        if isinstance(value, str):
            try:
                fields[name] = json.loads(value)
            except ValueError:
                pass
    return Event(
        tenant=record["tenant"],
        run_id=record["run_id"],
        seq=record["seq"],
        state_version=record["state_version"],
        at=record["at"],
        command_id=record.get("command_id"),
        operation_id=record.get("operation_id"),
        prev_hash=record.get("prev_hash"),
        hash=record.get("hash"),
        kind=kind,
        fields=fields,
    )


class Chain:
    """The links of every run seen so far."""

    def __init__(self) -> None:
        self._last: Dict[str, Tuple[int, Optional[str]]] = {}

    def check(self, event: Event) -> None:
        if event.seq == 0:
            return  # the answer to a command about a run that does not exist
        last = self._last.get(event.run_id)
        if last is None:
            if event.seq == 1 and event.prev_hash is not None:
                raise ChainBroken(f"{event.run_id}: its first event has a prev_hash")
        else:
            seq, hash_ = last
            if event.seq <= seq:
                raise ChainBroken(f"{event.run_id}: seq {event.seq} after {seq} (repeated or reordered)")
            if event.seq != seq + 1:
                raise ChainBroken(f"{event.run_id}: seq {event.seq} after {seq} (a gap)")
            if event.prev_hash != hash_:
                raise ChainBroken(
                    f"{event.run_id}: event {event.seq} names prev_hash {event.prev_hash}, "
                    f"but event {seq} has hash {hash_}"
                )
        self._last[event.run_id] = (event.seq, event.hash)


class Follower:
    """Reads run events.

    ```python
    follower = Follower(Connection())
    for event in follower.run("run-42", timeout=60):
        if event.kind == "Interrupted": ...
    ```
    """

    def __init__(self, connection: Optional[Connection] = None, *, decode_payloads: bool = True):
        """`decode_payloads=False` keeps JSON payloads (`input`, `args`, `output`, ...) as
        the JSON text the records carry."""
        self.connection = connection or Connection.from_env()
        self.decode_payloads = decode_payloads
        self._topic = self.connection.topic("run-events")
        self._codec = Codec(self.connection.registry(), self._topic)

    def _consumer(self) -> Consumer:
        return Consumer(
            self.connection.kafka(
                **{
                    "group.id": "sortie-follower-" + str(uuid.uuid4()),
                    "enable.auto.commit": False,
                    "isolation.level": "read_committed",
                    "auto.offset.reset": "earliest",
                }
            )
        )

    def run(self, run_id: str, *, timeout: Optional[float] = None, verify: bool = True) -> Iterator[Event]:
        """One run's events from its first, live; stops after `timeout` seconds of the
        whole read (None: never)."""
        consumer = self._consumer()
        partition = partition_for(run_id, partition_count(consumer, self._topic))
        consumer.assign([TopicPartition(self._topic, partition, 0)])
        return self._read(consumer, lambda e: e.run_id == run_id, timeout, verify)

    def tenant(
        self, tenant: Optional[str], *, timeout: Optional[float] = None, verify: bool = True
    ) -> Iterator[Event]:
        """Every event of every run of `tenant` (None: of every tenant), from the
        beginning, live."""
        consumer = self._consumer()
        count = partition_count(consumer, self._topic)
        consumer.assign([TopicPartition(self._topic, p, 0) for p in range(count)])
        return self._read(consumer, lambda e: tenant is None or e.tenant == tenant, timeout, verify)

    def _read(self, consumer: Consumer, wanted: Any, timeout: Optional[float], verify: bool) -> Iterator[Event]:
        chain = Chain()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while deadline is None or time.monotonic() < deadline:
                msg = consumer.poll(0.2)
                if msg is None:
                    continue
                if (error := msg.error()) is not None:
                    if error.code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(f"reading run events: {error}")
                    continue
                event = decode_event(self._codec.decode(msg.value()), self.decode_payloads)
                if not wanted(event):
                    continue
                event.partition, event.offset = msg.partition() or 0, msg.offset() or 0
                if verify:
                    chain.check(event)
                yield event
        finally:
            consumer.close()
