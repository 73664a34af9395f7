"""An executor serving one queue with plain Python functions, under Sortie's side-effect
protocol (docs/reference/executor-protocol.md), as `sortie executor` does in Rust.

```python
from sortie_client import Executor, Permanent, Retryable

executor = Executor.from_args()          # --queue, --bootstrap-servers, ... (or env)

@executor.handler("refund")
def refund(call):
    answer = payments.refund(call.args, idempotency_key=call.operation_id)
    return {"refund_id": answer.id}

executor.run()                           # until SIGTERM / Ctrl-C
```

# What it does, as the Rust executor does

- Consumes `<prefix>intents.<queue>` in the group `<prefix>executor.<queue>` (so it may
  share a queue with other executors, Rust or Python), `read_committed`, no auto-commit,
  `cooperative-sticky` (the Rust executor's strategy: one group must agree on one).
- Reports a `StepResult` keyed by operation id to the run's canonical partition of
  `<prefix>step-results` (murmur2 of the run id), echoing the attempt, from an
  idempotent `acks=all` producer. **No transactions**, like the Rust executor: a result
  may be reported twice (the reducer ignores a repeat and a stale attempt); what must
  never happen twice is the call, and that is what the commit order guards.
- Commit order, per side-effect class:
  - `pure` / `idempotent` / `keyed`: the intent's offset becomes committable once its
    result is delivered. A crash before that redelivers the intent; the receiver sees the
    same operation id again (which is why such nodes must be safe to repeat).
  - `unsafe` / `reconcilable`: first a `STARTED` result is delivered, then a synchronous
    commit *covering the intent's offset* is made, and only then is the function called.
    A crash after the call can never redeliver the intent: an `unsafe` step's outcome is
    then unknown and the run waits for an operator; a `reconcilable` one is asked about.
  - A commit is one position per partition, so it never passes an offset still in
    flight (a per-partition tracker, as `tracker.rs`).
- One attempt of a `reconcilable` operation at a time in this process, and never an
  earlier attempt after a later one (`superseded`), as `OperationLocks` in Rust. Before
  calling, it asks the function's lookup (`@executor.lookup("tool")`) what became of the
  operation and follows the same rules as `dispatch.rs::settle`; a `lookup_only` intent
  (a run winding down) only asks.
- Errors: raise `Retryable` (the attempt certainly had no effect), `Permanent`
  (repeating fails again) or `Unknown` (it may have taken effect). Any other exception
  is reported as unknown (`handler_raised`): it may have come after the request was
  sent. A function still running a second past the intent's timeout is reported unknown
  (`handler_timeout`); Python cannot stop a thread, so it runs on, and its answer is
  dropped.
- `/healthz` (alive) and `/readyz` (consuming: joined the group, not stopping) on
  `--health-addr`.

# What it does not do (refused with a permanent error, naming why)

- Sealed arguments (`{"$sealed": "v1..."}`): `unsealable` — this executor holds no run
  keys. Serve sealed runs' tools with the Rust executor.
- Blob references in arguments (`{"$blob": "sortie-blob:..."}`): `blob_unsupported`.
- Outputs are not offloaded to a blob store, nor checked against the payload shape
  limits before they are produced (the reducer checks them).
- Undecodable intents are logged and skipped (committed), not dead-lettered.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from .wire import Codec, Connection, partition_count, partition_for, read_properties, schema_text

log = logging.getLogger("sortie_client.executor")

GUARDED = ("UNSAFE", "RECONCILABLE")


# ---------------------------------------------------------------------- outcomes


class HandlerError(Exception):
    """Why an attempt did not succeed: raise one of its subclasses."""

    def __init__(self, code: str, message: str = ""):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message or code


class Retryable(HandlerError):
    """The attempt certainly had no effect and a later one may succeed (connection refused
    before sending, 429, 5xx). The reducer applies the node's retry policy."""

    def __init__(self, code: str, message: str = "", retry_after: Optional[float] = None):
        super().__init__(code, message)
        #: Seconds the receiver asked to wait (429 Retry-After).
        self.retry_after = retry_after


class Permanent(HandlerError):
    """The attempt failed and repeating it fails again (bad arguments, a 4xx)."""


class Unknown(HandlerError):
    """The request may or may not have taken effect (a timeout after sending)."""


@dataclass
class Found:
    """Lookup answer: the operation took effect; this is its output (reported, no call)."""

    output: Any


@dataclass
class RecordedFailed:
    """Lookup answer: the receiver recorded the operation as failed (no effect)."""

    code: str
    message: str = ""


class NotFound:
    """Lookup answer: the receiver has no record of the operation."""


Lookup = Union[Found, RecordedFailed, NotFound]


@dataclass
class Call:
    """One attempt of one operation, as a function sees it."""

    #: Stable across attempts: hand it to the receiver as its idempotency key.
    operation_id: str
    attempt: int
    tenant: str
    run_id: str
    step_id: str
    node: str
    tool: str
    #: PURE, IDEMPOTENT, KEYED, RECONCILABLE or UNSAFE.
    side_effect: str
    args: Any
    config: Any
    #: This attempt's budget in seconds.
    timeout: float


# ---------------------------------------------------------------------- config


@dataclass
class ExecutorConfig:
    """`sortie executor`'s settings that apply here, with its flag and env names."""

    connection: Connection = field(default_factory=Connection)
    queue: str = "default"
    executor_id: str = field(default_factory=lambda: f"py-executor-{socket.gethostname()}-{os.getpid()}")
    static_membership: bool = False
    max_in_flight: int = 16
    commit_interval: float = 0.1
    drain_timeout: float = 10.0
    session_timeout: float = 10.0
    default_timeout: float = 30.0
    #: host:port for /healthz and /readyz (port 0: any; None: not served).
    health_addr: Optional[str] = None

    @classmethod
    def from_args(cls, argv: Optional[Sequence[str]] = None) -> "ExecutorConfig":
        env = os.environ
        p = argparse.ArgumentParser(description="A Sortie executor serving one queue with Python functions.")
        p.add_argument("--bootstrap-servers", default=env.get("SORTIE__KAFKA__BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
        p.add_argument("--registry-url", default=env.get("SORTIE__REGISTRY__URL", "http://127.0.0.1:8081"))
        p.add_argument("--prefix", default=env.get("SORTIE__TOPICS__PREFIX", "sortie."))
        p.add_argument("--kafka-properties", default=env.get("SORTIE__KAFKA__PROPERTIES_FILE"),
                       help="a Java-style properties file of librdkafka settings (SASL, TLS)")
        p.add_argument("--queue", default=env.get("SORTIE__EXECUTOR__QUEUES", "default"),
                       help="the queue to serve (one: run a process per queue)")
        p.add_argument("--executor-id", default=env.get("SORTIE__EXECUTOR__ID"))
        p.add_argument("--static-membership", action="store_true",
                       default=env.get("SORTIE__EXECUTOR__STATIC_MEMBERSHIP", "") in ("1", "true"))
        p.add_argument("--max-in-flight", type=int, default=int(env.get("SORTIE__EXECUTOR__MAX_IN_FLIGHT", "16")))
        p.add_argument("--commit-interval-ms", type=int,
                       default=int(env.get("SORTIE__EXECUTOR__COMMIT_INTERVAL_MS", "100")))
        p.add_argument("--drain-timeout-ms", type=int,
                       default=int(env.get("SORTIE__EXECUTOR__DRAIN_TIMEOUT_MS", "10000")))
        p.add_argument("--session-timeout-ms", type=int,
                       default=int(env.get("SORTIE__EXECUTOR__SESSION_TIMEOUT_MS", "10000")))
        p.add_argument("--default-timeout-ms", type=int,
                       default=int(env.get("SORTIE__EXECUTOR__DEFAULT_TIMEOUT_MS", "30000")))
        p.add_argument("--health-addr", default=env.get("SORTIE__EXECUTOR__HEALTH_ADDR", "127.0.0.1:9466"),
                       help="where to serve /healthz and /readyz ('' to serve none)")
        a = p.parse_args(argv)
        queues = [q.strip() for q in a.queue.split(",") if q.strip()]
        if len(queues) != 1:
            p.error("serve exactly one queue per process")
        if a.static_membership and not a.executor_id:
            p.error("--static-membership needs --executor-id")
        config = cls(
            connection=Connection(
                bootstrap_servers=a.bootstrap_servers,
                registry_url=a.registry_url,
                prefix=a.prefix,
                kafka_properties=read_properties(a.kafka_properties) if a.kafka_properties else {},
            ),
            queue=queues[0],
            static_membership=a.static_membership,
            max_in_flight=a.max_in_flight,
            commit_interval=a.commit_interval_ms / 1000,
            drain_timeout=a.drain_timeout_ms / 1000,
            session_timeout=a.session_timeout_ms / 1000,
            default_timeout=a.default_timeout_ms / 1000,
            health_addr=a.health_addr or None,
        )
        if a.executor_id:
            config.executor_id = a.executor_id
        if config.max_in_flight < 1:
            p.error("--max-in-flight must be at least 1")
        return config


# ---------------------------------------------------------------------- offsets


class _Tracker:
    """Which offsets of one partition may be committed (`tracker.rs`): the lowest offset
    still pending, or one past the highest handed out."""

    def __init__(self, epoch: int):
        self.epoch = epoch
        self.pending: Set[int] = set()
        self.next: Optional[int] = None
        self.committed: Optional[int] = None
        #: offset -> (event, verdict): done before the call, waiting for a commit.
        self.waiters: Dict[int, Tuple[threading.Event, List[bool]]] = {}

    def track(self, offset: int) -> None:
        self.pending.add(offset)
        self.next = offset + 1 if self.next is None else max(self.next, offset + 1)

    def to_commit(self) -> Optional[int]:
        position = min(self.pending) if self.pending else self.next
        if position is None or (self.committed is not None and self.committed >= position):
            return None
        return position

    def was_committed(self, position: int) -> None:
        self.committed = position if self.committed is None else max(self.committed, position)
        for offset in [o for o in self.waiters if o < position]:
            event, verdict = self.waiters.pop(offset)
            verdict.append(True)
            event.set()

    def hand_back(self) -> None:
        for offset, (event, verdict) in self.waiters.items():
            self.pending.add(offset)
            verdict.append(False)
            event.set()
        self.waiters.clear()


class _Offsets:
    """The trackers of the assigned partitions, shared by the consumer thread (which alone
    commits) and the workers."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.partitions: Dict[int, _Tracker] = {}
        self.urgent = False
        self.closing = False
        self.in_flight = 0
        self._epochs = 0

    def assign(self, partitions: List[int]) -> None:
        with self.lock:
            for p in partitions:
                self._epochs += 1
                self.partitions[p] = _Tracker(self._epochs)

    def ticket(self, partition: int, offset: int) -> "_Ticket":
        with self.lock:
            tracker = self.partitions[partition]
            tracker.track(offset)
            self.in_flight += 1
            return _Ticket(self, partition, offset, tracker.epoch)


class _Ticket:
    def __init__(self, offsets: _Offsets, partition: int, offset: int, epoch: int):
        self.offsets, self.partition, self.offset, self.epoch = offsets, partition, offset, epoch

    def _tracker(self) -> Optional[_Tracker]:
        tracker = self.offsets.partitions.get(self.partition)
        return tracker if tracker is not None and tracker.epoch == self.epoch else None

    def done(self) -> None:
        """The intent's work is done: its offset may be committed."""
        with self.offsets.lock:
            tracker = self._tracker()
            if tracker is not None:
                tracker.pending.discard(self.offset)
            self.offsets.lock.notify_all()

    def commit_first(self) -> bool:
        """Marks the offset committable before the call and waits until a commit covers
        it. False: the partition was revoked (or the executor stops) first: do not call."""
        event, verdict = threading.Event(), []  # type: Tuple[threading.Event, List[bool]]
        with self.offsets.lock:
            tracker = self._tracker()
            if tracker is None or self.offsets.closing:
                return False
            tracker.pending.discard(self.offset)
            tracker.waiters[self.offset] = (event, verdict)
            self.offsets.urgent = True
            self.offsets.lock.notify_all()
        event.wait()
        return bool(verdict and verdict[0])

    def release(self) -> None:
        with self.offsets.lock:
            self.offsets.in_flight -= 1
            self.offsets.lock.notify_all()


class _OperationLocks:
    """One attempt of an operation at a time, never an earlier one after a later one
    (`OperationLocks` in Rust)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops: Dict[str, List[Any]] = {}  # op -> [lock, highest attempt, users]

    def acquire(self, operation_id: str, attempt: int) -> Optional[Callable[[], None]]:
        with self._lock:
            entry = self._ops.setdefault(operation_id, [threading.Lock(), 0, 0])
            entry[2] += 1
        entry[0].acquire()

        def release() -> None:
            entry[0].release()
            with self._lock:
                entry[2] -= 1
                if entry[2] == 0 and len(self._ops) > 4096:
                    self._ops.pop(operation_id, None)

        if entry[1] > attempt:
            release()
            return None
        entry[1] = attempt
        return release


# ---------------------------------------------------------------------- the executor


def _has(value: Any, test: Callable[[Dict[str, Any]], bool]) -> bool:
    if isinstance(value, dict):
        return test(value) or any(_has(v, test) for v in value.values())
    if isinstance(value, list):
        return any(_has(v, test) for v in value)
    return False


def _sealed(v: Dict[str, Any]) -> bool:
    return set(v) == {"$sealed"} and isinstance(v["$sealed"], str)


def _blob(v: Dict[str, Any]) -> bool:
    return isinstance(v.get("$blob"), str) and v["$blob"].startswith("sortie-blob:")


def _attempt_deadline(intent: Dict[str, Any]) -> Optional[int]:
    """When the reducer gives up on this attempt: its ``issued_at`` plus the node's
    ``timeout_ms`` (none without one)."""
    timeout_ms = intent.get("timeout_ms")
    issued_at = intent.get("issued_at")
    if not timeout_ms or timeout_ms <= 0 or issued_at is None:
        return None
    if hasattr(issued_at, "timestamp"):  # a timestamp-millis decoded as a datetime
        issued_at = int(issued_at.timestamp() * 1000)
    return int(issued_at) + int(timeout_ms)


def _now_ms() -> int:
    return int(time.time() * 1000)


class Executor:
    """Serves one queue: register functions with `handler`, then `run`."""

    def __init__(self, config: Optional[ExecutorConfig] = None):
        self.config = config or ExecutorConfig(connection=Connection.from_env())
        self._handlers: Dict[str, Callable[[Call], Any]] = {}
        self._lookups: Dict[str, Callable[[Call], Lookup]] = {}
        self._offsets = _Offsets()
        self._operations = _OperationLocks()
        self._stop = threading.Event()
        self._joined = False
        self.health_port: Optional[int] = None

    @classmethod
    def from_args(cls, argv: Optional[Sequence[str]] = None) -> "Executor":
        return cls(ExecutorConfig.from_args(argv))

    def handler(self, tool: str) -> Callable[[Callable[[Call], Any]], Callable[[Call], Any]]:
        """Registers `fn(call) -> output` (any JSON value) for nodes with `tool: <tool>`."""

        def register(fn: Callable[[Call], Any]) -> Callable[[Call], Any]:
            self._handlers[tool] = fn
            return fn

        return register

    def lookup(self, tool: str) -> Callable[[Callable[[Call], Lookup]], Callable[[Call], Lookup]]:
        """Registers `fn(call) -> Found | RecordedFailed | NotFound` answering "what became
        of this operation?" for `reconcilable` nodes of `tool`."""

        def register(fn: Callable[[Call], Lookup]) -> Callable[[Call], Lookup]:
            self._lookups[tool] = fn
            return fn

        return register

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ running

    def run(self, install_signal_handlers: bool = True) -> None:
        """Serves until `stop()` (or SIGTERM/SIGINT), then drains and leaves the group."""
        if install_signal_handlers and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop())
        c = self.config
        conn = c.connection
        self._intents = conn.topic("intents." + c.queue)
        self._results = conn.topic("step-results")
        registry = conn.registry()
        self._intent_codec = Codec(registry, self._intents)
        self._result_codec = Codec(registry, self._results, schema_text("step-result"))
        self._producer = Producer(
            conn.kafka(
                **{
                    "client.id": f"{conn.prefix}executor-{c.executor_id}-producer",
                    "linger.ms": 1,
                    "compression.type": "lz4",
                }
            )
            | {"enable.idempotence": True, "acks": "all"}
        )
        self._result_partitions = partition_count(self._producer, self._results)
        group = f"{conn.prefix}executor.{c.queue}"
        settings: Dict[str, Any] = {
            "group.id": group,
            "client.id": f"{group}-{c.executor_id}",
            "session.timeout.ms": int(c.session_timeout * 1000),
        }
        if c.static_membership:
            settings["group.instance.id"] = c.executor_id
        consumer = Consumer(
            conn.kafka(**settings)
            | {
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "isolation.level": "read_committed",
                "auto.offset.reset": "earliest",
                "partition.assignment.strategy": "cooperative-sticky",
                "allow.auto.create.topics": False,
            }
        )
        partition_count(consumer, self._intents)
        self._consumer = consumer
        server = self._serve_health()
        pool = ThreadPoolExecutor(max_workers=c.max_in_flight, thread_name_prefix="sortie-intent")
        consumer.subscribe([self._intents], on_assign=self._on_assign, on_revoke=self._on_revoke,
                           on_lost=self._on_revoke)
        log.info("Executor %s serving queue %s (tools %s).", c.executor_id, c.queue, sorted(self._handlers))
        print(f"executor serving {self._intents} as {c.executor_id}", flush=True)
        try:
            self._loop(pool)
        finally:
            log.info("Shutting down: finishing in-flight intents.")
            deadline = time.monotonic() + c.drain_timeout
            while time.monotonic() < deadline:
                with self._offsets.lock:
                    if not self._offsets.in_flight:
                        break
                self._commit()
                time.sleep(0.02)
            with self._offsets.lock:
                self._offsets.closing = True
                for tracker in self._offsets.partitions.values():
                    tracker.hand_back()
            self._commit()
            pool.shutdown(wait=False)
            self._producer.flush(10)
            consumer.close()
            if server is not None:
                server.shutdown()

    def _loop(self, pool: ThreadPoolExecutor) -> None:
        c = self.config
        last_commit = time.monotonic()
        paused = False
        while not self._stop.is_set():
            with self._offsets.lock:
                urgent, in_flight = self._offsets.urgent, self._offsets.in_flight
            if urgent or time.monotonic() - last_commit >= c.commit_interval:
                self._commit()
                last_commit = time.monotonic()
            full = in_flight >= c.max_in_flight
            if full != paused:
                assignment = self._consumer.assignment()
                if assignment:
                    (self._consumer.pause if full else self._consumer.resume)(assignment)
                paused = full
            msg = self._consumer.poll(0.02 if in_flight else 0.1)
            if msg is None:
                continue
            if (error := msg.error()) is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    log.warning("Consuming intents: %s", error)
                continue
            partition, offset = msg.partition(), msg.offset()
            if partition is None or offset is None:
                continue
            with self._offsets.lock:
                if partition not in self._offsets.partitions:
                    continue
            ticket = self._offsets.ticket(partition, offset)
            pool.submit(self._process, ticket, msg.value())

    def _commit(self, only: Optional[Set[int]] = None) -> None:
        """Commits every committable position and releases the waiters it covers. On the
        consumer thread only."""
        with self._offsets.lock:
            self._offsets.urgent = False
            positions: List[Tuple[int, int]] = []
            for p, t in self._offsets.partitions.items():
                position = t.to_commit()
                if position is not None and (only is None or p in only):
                    positions.append((p, position))
        if not positions:
            return
        try:
            self._consumer.commit(
                offsets=[TopicPartition(self._intents, p, pos) for p, pos in positions],
                asynchronous=False,
            )
        except Exception as e:  # noqa: BLE001 - a failed commit is retried, never fatal
            log.warning("Committing offsets failed; will retry: %s", e)
            with self._offsets.lock:
                self._offsets.urgent = any(t.waiters for t in self._offsets.partitions.values())
            return
        with self._offsets.lock:
            for p, pos in positions:
                tracker = self._offsets.partitions.get(p)
                if tracker is not None:
                    tracker.was_committed(pos)

    def _on_assign(self, consumer: Consumer, partitions: List[TopicPartition]) -> None:
        self._offsets.assign([tp.partition for tp in partitions])
        self._joined = True
        log.info("Partitions assigned: %s", [tp.partition for tp in partitions])

    def _on_revoke(self, consumer: Consumer, partitions: List[TopicPartition]) -> None:
        revoked = {tp.partition for tp in partitions}
        log.info("Partitions revoked; draining them: %s", sorted(revoked))
        deadline = time.monotonic() + self.config.drain_timeout
        while True:
            self._commit(revoked)
            with self._offsets.lock:
                pending = sum(
                    len(t.pending) for p, t in self._offsets.partitions.items() if p in revoked
                )
                if pending == 0 or self._offsets.closing or time.monotonic() >= deadline:
                    break
                self._offsets.lock.wait(0.02)
        self._commit(revoked)
        with self._offsets.lock:
            for p in revoked:
                tracker = self._offsets.partitions.pop(p, None)
                if tracker is not None:
                    tracker.hand_back()

    # ------------------------------------------------------------------ one intent

    def _process(self, ticket: _Ticket, value: Optional[bytes]) -> None:
        try:
            started_at = _now_ms()
            try:
                intent = self._intent_codec.decode(value)
            except Exception as e:  # noqa: BLE001
                log.error("Skipping an undecodable intent at %s/%s: %s", ticket.partition, ticket.offset, e)
                ticket.done()
                return
            self._perform(ticket, intent, started_at)
        except Exception:  # noqa: BLE001 - a bug here must not kill the worker silently
            log.exception("Processing an intent failed; its offset stays uncommitted.")
        finally:
            ticket.release()

    def _perform(self, ticket: _Ticket, intent: Dict[str, Any], started_at: int) -> None:
        def report(outcome: Any) -> None:
            self._report(intent, outcome, started_at)

        deadline = _attempt_deadline(intent)
        if deadline is not None and started_at >= deadline:
            # The reducer has already retried this attempt or left it to an operator,
            # whose ruling a late call would make false.
            report(Retryable("deadline_passed", "the attempt's deadline passed before an executor could start it"))
            ticket.done()
            return
        try:
            call = self._call(intent)
        except HandlerError as e:
            report(e)
            ticket.done()
            return
        side_effect = call.side_effect
        if intent.get("lookup_only"):
            asking = self._operations.acquire(call.operation_id, call.attempt)
            if asking is None:
                report(_superseded(call.attempt))
            else:
                try:
                    report(self._only_ask(call))
                finally:
                    asking()
            ticket.done()
            return
        if side_effect not in GUARDED:
            report(self._timed_call(call))
            ticket.done()
            return
        # Guarded classes: record STARTED, commit the intent, then call.
        self._send_result(self._result(intent, "STARTED", started_at))
        if not ticket.commit_first():
            log.info("Handing the intent back: its offset could not be committed before the call.")
            return
        release = None
        if side_effect == "RECONCILABLE":
            release = self._operations.acquire(call.operation_id, call.attempt)
            if release is None:
                report(_superseded(call.attempt))
                return
        try:
            if side_effect == "RECONCILABLE":
                known = self._ask_first(call)
                if known is not None:
                    report(known)
                    return
            report(self._timed_call(call))
        finally:
            if release is not None:
                release()

    def _call(self, intent: Dict[str, Any]) -> Call:
        def parse(what: str, text: Optional[str]) -> Any:
            if text is None or not text.strip():
                return {}
            try:
                return json.loads(text)
            except ValueError as e:
                raise Permanent(f"bad_{what}", f"{what} is not JSON: {e}")

        timeout_ms = intent.get("timeout_ms")
        call = Call(
            operation_id=intent["operation_id"],
            attempt=intent["attempt"],
            tenant=intent["tenant"],
            run_id=intent["run_id"],
            step_id=intent["step_id"],
            node=intent["node"],
            tool=intent["tool"],
            side_effect=intent["side_effect"],
            args=parse("args", intent["args"]),
            config=parse("config", intent.get("config")),
            timeout=timeout_ms / 1000 if timeout_ms and timeout_ms > 0 else self.config.default_timeout,
        )
        if call.tool not in self._handlers:
            raise Permanent("unknown_tool", f"no handler for tool {call.tool!r} in this executor")
        if _has(call.args, _sealed) or intent["args"] == "null":
            raise Permanent(
                "unsealable",
                "the arguments are sealed, and the Python executor holds no run keys: "
                "serve this tool with the Rust executor (sortie executor --seal-*)",
            )
        if _has(call.args, _blob):
            raise Permanent(
                "blob_unsupported",
                "the arguments reference a blob, and the Python executor reads no blob store",
            )
        return call

    def _timed_call(self, call: Call) -> Any:
        """Runs the function within the call's timeout (plus a second, as Rust): its
        output, or the HandlerError that reports it."""
        box: List[Any] = []
        done = threading.Event()

        def target() -> None:
            try:
                box.append(("ok", self._handlers[call.tool](call)))
            except BaseException as e:  # noqa: BLE001
                box.append(("err", e))
            finally:
                done.set()

        threading.Thread(target=target, name=f"sortie-call-{call.operation_id}", daemon=True).start()
        if not done.wait(call.timeout + 1.0):
            return Unknown("handler_timeout", f"the handler did not finish within {call.timeout} s")
        kind, value = box[0]
        if kind == "ok":
            try:
                json.dumps(value)
            except (TypeError, ValueError) as e:
                return (
                    Unknown("bad_output", f"the output is not JSON: {e}")
                    if call.side_effect in GUARDED
                    else Permanent("bad_output", f"the output is not JSON: {e}")
                )
            return _Output(value)
        if isinstance(value, HandlerError):
            return value
        log.exception("The handler raised.", exc_info=value)
        return Unknown("handler_raised", f"{type(value).__name__}: {value}")

    def _lookup(self, call: Call) -> Any:
        fn = self._lookups.get(call.tool)
        if fn is None:
            return None  # Unsupported
        try:
            return fn(call)
        except HandlerError as e:
            return e
        except Exception as e:  # noqa: BLE001
            return Retryable("lookup_raised", f"{type(e).__name__}: {e}")

    def _ask_first(self, call: Call) -> Any:
        """`dispatch.rs::settle`: an outcome that settles the attempt without a call, or
        None when calling is safe."""
        answer = self._lookup(call)
        authoritative = isinstance(call.config, dict) and call.config.get("lookup_authoritative") is True
        if isinstance(answer, Found):
            return _Output(answer.output)
        if isinstance(answer, NotFound):
            if call.attempt <= 1 or authoritative:
                return None
            return Unknown(
                "lookup_not_found",
                "the receiver has no record of the operation, but an earlier attempt may have "
                "reached it and its lookup is not declared authoritative "
                "(config.lookup_authoritative): not calling again",
            )
        if isinstance(answer, RecordedFailed):
            return None
        if answer is None:
            if call.attempt <= 1:
                return None
            return Unknown("not_reconcilable", "a later attempt of a reconcilable step, but no lookup")
        if isinstance(answer, Permanent):
            return answer
        return Unknown("lookup_failed", f"the receiver could not be asked: {answer}")

    def _only_ask(self, call: Call) -> Any:
        """`dispatch.rs::only_ask`: a lookup-only attempt's outcome; it never calls."""
        answer = self._lookup(call)
        authoritative = isinstance(call.config, dict) and call.config.get("lookup_authoritative") is True
        if isinstance(answer, Found):
            return _Output(answer.output)
        if isinstance(answer, RecordedFailed):
            return Permanent(answer.code, answer.message)
        if isinstance(answer, NotFound):
            if authoritative:
                return Permanent("not_performed", "the receiver has no record of the operation "
                                 "(its lookup is authoritative): it was never performed")
            return Unknown("lookup_not_found", "the receiver has no record of the operation, but its "
                           "lookup is not declared authoritative")
        if answer is None:
            return Unknown("not_reconcilable", "a lookup-only attempt, but no lookup")
        return Unknown("lookup_failed", f"the receiver could not be asked: {answer}")

    # ------------------------------------------------------------------ results

    def _result(self, intent: Dict[str, Any], status: str, started_at: int) -> Dict[str, Any]:
        return {
            "operation_id": intent["operation_id"],
            "attempt": intent["attempt"],
            "tenant": intent["tenant"],
            "run_id": intent["run_id"],
            "step_id": intent["step_id"],
            "status": status,
            "retryable": False,
            "output": None,
            "error": None,
            "executor": self.config.executor_id,
            "started_at": started_at,
            "finished_at": None,
            "spend": None,
        }

    def _report(self, intent: Dict[str, Any], outcome: Any, started_at: int) -> None:
        if isinstance(outcome, _Output):
            result = self._result(intent, "SUCCEEDED", started_at)
            result["output"] = json.dumps(outcome.value, separators=(",", ":"))
        else:
            assert isinstance(outcome, HandlerError)
            status = "UNKNOWN" if isinstance(outcome, Unknown) else "FAILED"
            result = self._result(intent, status, started_at)
            result["retryable"] = isinstance(outcome, Retryable)
            retry_after = getattr(outcome, "retry_after", None)
            result["error"] = {
                "code": outcome.code,
                "message": outcome.message.encode()[:4096].decode(errors="ignore"),
                "retry_after_ms": int(retry_after * 1000) if retry_after is not None else None,
            }
        result["finished_at"] = _now_ms()
        self._send_result(result)
        log.info("Reported %s for %s attempt %s.", result["status"], intent["operation_id"], intent["attempt"])

    def _send_result(self, result: Dict[str, Any]) -> None:
        """Produces a result to the run's canonical partition and waits until it is
        delivered, retrying until it is."""
        partition = partition_for(result["run_id"], self._result_partitions)
        backoff = 0.1
        while True:
            delivered = threading.Event()
            error: List[Any] = []

            def on_delivery(err: Any, _msg: Any) -> None:
                if err is not None:
                    error.append(err)
                delivered.set()

            try:
                payload = self._result_codec.encode(result)
                self._producer.produce(
                    self._results,
                    key=result["operation_id"].encode(),
                    value=payload,
                    partition=partition,
                    on_delivery=on_delivery,
                )
                while not delivered.wait(0.05):
                    self._producer.poll(0)
                if not error:
                    return
                problem: Any = error[0]
            except Exception as e:  # noqa: BLE001
                problem = e
            log.warning("Producing a result failed; retrying in %.1f s: %s", backoff, problem)
            time.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    # ------------------------------------------------------------------ health

    def _serve_health(self) -> Optional[ThreadingHTTPServer]:
        if not self.config.health_addr:
            return None
        host, _, port = self.config.health_addr.rpartition(":")
        executor = self

        class Health(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                if self.path == "/healthz":
                    self._answer(200, {"status": "ok"})
                elif self.path == "/readyz":
                    reason = executor.readiness()
                    if reason is None:
                        self._answer(200, {"status": "ready"})
                    else:
                        self._answer(503, {"status": "not_ready", "reason": reason})
                else:
                    self._answer(404, {"error": "not found"})

            def _answer(self, status: int, body: Dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer((host or "127.0.0.1", int(port)), Health)
        self.health_port = server.server_address[1]
        threading.Thread(target=server.serve_forever, name="sortie-health", daemon=True).start()
        print(f"health listening on http://{host or '127.0.0.1'}:{self.health_port}", flush=True)
        return server

    def readiness(self) -> Optional[str]:
        """None when ready (joined the group, not stopping), else why not."""
        if self._stop.is_set():
            return "shutting down"
        if not self._joined:
            return f"not consuming queue {self.config.queue} yet"
        return None


@dataclass
class _Output:
    value: Any


def _superseded(attempt: int) -> Unknown:
    return Unknown(
        "superseded",
        f"a later attempt of the operation came before attempt {attempt}; it did not call",
    )

