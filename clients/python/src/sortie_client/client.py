"""Start, approve or reject, cancel and signal runs — and wait for the reducer's answer.

A command is a `dev.sortie.v1.RunCommand` on `<prefix>commands`:

* key = the run id, on the partition Java's default partitioner gives it (murmur2); the
  producer is told the partition outright, so no client setting can move it;
* value = Avro in the Confluent wire format, subject `<prefix>commands-value`;
* signed, when a key file is given (`sortie keys new` writes it): headers `sortie-key`
  (the key id) and `sortie-signature` (Ed25519 over the exact value bytes). A reducer
  started with `--require-signatures` takes only signed commands, by a key its keyring
  lets sign as this principal, in this tenant, with these roles; within 5 minutes of
  `issued_at`;
* `command_id` makes it idempotent: sent twice, applied once (the second answer says
  `duplicate`).

The answer is a `CommandAccepted` or `CommandRejected` event with the same `command_id`
on `<prefix>run-events`, on the run's partition. To never miss it, the client reads that
partition's end offset *before* producing and reads from there: the answer is appended
after the command, so it lies past that offset. (Subscribing after producing, or reading
from "latest" once the consumer happens to join, can start past an answer that came
quickly.)
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from .wire import Codec, Connection, partition_count, partition_for, schema_text, union_kind

_NS = "dev.sortie.v1."


class AnswerTimeout(Exception):
    """No answer to the command arrived in time (is a reducer running?)."""


def load_signing_key(path: str) -> Tuple[str, Any]:
    """The key file of `sortie keys new`: `id:` and `secret_key:` (base64 Ed25519 seed)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    fields: Dict[str, str] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#") and ":" in line:
                name, value = line.split(":", 1)
                fields[name.strip()] = value.strip().strip("\"'")
    if "id" not in fields or "secret_key" not in fields:
        raise ValueError(f"{path} is not a key file of `sortie keys new` (id, secret_key)")
    seed = base64.b64decode(fields["secret_key"])
    return fields["id"], Ed25519PrivateKey.from_private_bytes(seed)


def correlated_run_id(tenant: str, graph_id: str, label: str, value: str) -> str:
    """The run id of a graph that declares `correlation: <label>`: the one run of that
    graph whose label has this value, in this tenant (`sortie_core::ids::correlated_run_id`)."""
    digest = hashlib.sha256()
    for part in ("sortie.correlation.v1", tenant, graph_id, label, value):
        digest.update(part.encode())
        digest.update(b"\x1f")
    return "cor_" + digest.hexdigest()[:32]


@dataclass
class Answer:
    """The reducer's answer to one command."""

    command_id: str
    run_id: str
    accepted: bool
    #: `CommandAccepted`: the command was taken before (same command id).
    duplicate: bool = False
    #: `CommandRejected`: why (`unauthenticated`, `forbidden`, `unknown_graph`, ...).
    code: Optional[str] = None
    reason: Optional[str] = None
    #: Where the command was produced.
    partition: int = -1
    offset: int = -1

    def raise_for_rejection(self) -> "Answer":
        if not self.accepted:
            raise CommandRejected(self)
        return self


class CommandRejected(Exception):
    def __init__(self, answer: Answer):
        super().__init__(f"command {answer.command_id} rejected: {answer.code}: {answer.reason}")
        self.answer = answer


class Client:
    """Publishes signed commands as one principal of one tenant.

    ```python
    client = Client(Connection(), tenant="dev", principal="svc:shop",
                    roles=["approver"], signing_key="target/dev/keys/examples.key")
    answer = client.start("run-42", "refund", {"order_id": "o-1"})
    ```
    """

    def __init__(
        self,
        connection: Optional[Connection] = None,
        *,
        tenant: str,
        principal: str,
        roles: Sequence[str] = (),
        signing_key: Optional[str] = None,
        answer_timeout: float = 30.0,
    ):
        self.connection = connection or Connection.from_env()
        self.tenant = tenant
        self.principal = principal
        self.roles = list(roles)
        self.answer_timeout = answer_timeout
        self._key = load_signing_key(signing_key) if signing_key else None
        self._commands = self.connection.topic("commands")
        self._events = self.connection.topic("run-events")
        registry = self.connection.registry()
        self._command_codec = Codec(registry, self._commands, schema_text("run-command"))
        self._event_codec = Codec(registry, self._events)
        self._producer = Producer(
            self.connection.kafka(**{"enable.idempotence": True, "acks": "all", "linger.ms": 1})
        )
        self._command_partitions = partition_count(self._producer, self._commands)
        self._event_partitions = partition_count(self._producer, self._events)

    # ------------------------------------------------------------------ commands

    def start(
        self,
        run_id: str,
        graph_id: str,
        input: Any = None,
        *,
        graph_version: Optional[int] = None,
        labels: Optional[Dict[str, str]] = None,
        command_id: Optional[str] = None,
        wait: bool = True,
    ) -> Answer:
        body = {
            "graph_id": graph_id,
            "graph_version": graph_version,
            "input": json.dumps({} if input is None else input),
            "labels": dict(labels or {}),
        }
        return self.send(run_id, "StartRun", body, command_id=command_id, wait=wait)

    def approve(self, run_id: str, interrupt_id: str, proposal_hash: str, **kw: Any) -> Answer:
        return self._decide(run_id, interrupt_id, proposal_hash, "APPROVE", **kw)

    def reject(self, run_id: str, interrupt_id: str, proposal_hash: str, **kw: Any) -> Answer:
        return self._decide(run_id, interrupt_id, proposal_hash, "REJECT", **kw)

    def _decide(
        self,
        run_id: str,
        interrupt_id: str,
        proposal_hash: str,
        decision: str,
        *,
        comment: Optional[str] = None,
        payload: Any = None,
        command_id: Optional[str] = None,
        wait: bool = True,
    ) -> Answer:
        body = {
            "interrupt_id": interrupt_id,
            "proposal_hash": proposal_hash,
            "decision": decision,
            "payload": None if payload is None else json.dumps(payload),
            "comment": comment,
        }
        return self.send(run_id, "ResumeRun", body, command_id=command_id, wait=wait)

    def cancel(
        self,
        run_id: str,
        reason: Optional[str] = None,
        *,
        command_id: Optional[str] = None,
        wait: bool = True,
    ) -> Answer:
        return self.send(run_id, "CancelRun", {"reason": reason}, command_id=command_id, wait=wait)

    def signal(
        self,
        run_id: str,
        name: str,
        payload: Any = None,
        *,
        signal_id: Optional[str] = None,
        command_id: Optional[str] = None,
        wait: bool = True,
    ) -> Answer:
        """For a node `wait: {signal: <name>}`; `payload` is held to the wait's schema and
        `signal_id` (default: the command id) is taken once per run."""
        body = {
            "name": name,
            "signal_id": signal_id,
            "payload": None if payload is None else json.dumps(payload),
        }
        return self.send(run_id, "SignalRun", body, command_id=command_id, wait=wait)

    # ------------------------------------------------------------------ the wire

    def send(
        self,
        run_id: str,
        kind: str,
        body: Dict[str, Any],
        *,
        command_id: Optional[str] = None,
        wait: bool = True,
    ) -> Answer:
        """Produces one command (`kind` is the body's record name, e.g. `CancelRun`) and,
        with `wait`, returns the reducer's answer (else an `Answer` with `accepted` False
        and no code: only where it was produced)."""
        command_id = command_id or str(uuid.uuid4())
        value = {
            "command_id": command_id,
            "tenant": self.tenant,
            "run_id": run_id,
            "issuer": {"principal": self.principal, "roles": self.roles},
            "issued_at": int(time.time() * 1000),
            "body": (_NS + kind, body),
        }
        payload = self._command_codec.encode(value)
        headers: List[Tuple[str, Union[str, bytes, None]]] = []
        if self._key is not None:
            key_id, key = self._key
            headers = [("sortie-key", key_id.encode()), ("sortie-signature", key.sign(payload))]
        listener = self._listen(run_id) if wait else None
        try:
            partition, offset = self._produce(run_id, payload, headers)
            if listener is None:
                return Answer(command_id, run_id, False, partition=partition, offset=offset)
            answer = self._await_answer(listener, run_id, command_id)
            answer.partition, answer.offset = partition, offset
            return answer
        finally:
            if listener is not None:
                listener.close()

    def _produce(self, run_id: str, payload: bytes, headers: List[Tuple[str, Union[str, bytes, None]]]) -> Tuple[int, int]:
        delivered: Dict[str, Any] = {}

        def on_delivery(err: Any, msg: Any) -> None:
            delivered["err"] = err
            if err is None and msg is not None:
                delivered["at"] = (msg.partition(), msg.offset())

        self._producer.produce(
            self._commands,
            key=run_id.encode(),
            value=payload,
            partition=partition_for(run_id, self._command_partitions),
            headers=headers,
            on_delivery=on_delivery,
        )
        self._producer.flush(30)
        if delivered.get("err") is not None or "at" not in delivered:
            raise RuntimeError(f"the command was not delivered: {delivered.get('err', 'timeout')}")
        at: Tuple[int, int] = delivered["at"]
        return at

    def _listen(self, run_id: str) -> Consumer:
        """A consumer on the run's run-events partition, positioned at its end *now*."""
        consumer = Consumer(
            self.connection.kafka(
                **{
                    "group.id": "sortie-client-" + str(uuid.uuid4()),
                    "enable.auto.commit": False,
                    "isolation.level": "read_committed",
                    "auto.offset.reset": "earliest",
                }
            )
        )
        partition = partition_for(run_id, self._event_partitions)
        _low, high = consumer.get_watermark_offsets(
            TopicPartition(self._events, partition), timeout=10, cached=False
        )
        consumer.assign([TopicPartition(self._events, partition, high)])
        return consumer

    def _await_answer(self, consumer: Consumer, run_id: str, command_id: str) -> Answer:
        deadline = time.monotonic() + self.answer_timeout
        while time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            if (error := msg.error()) is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    raise RuntimeError(f"reading the answer: {error}")
                continue
            if msg.key() != run_id.encode():
                continue
            record = self._event_codec.decode(msg.value())
            kind, fields = union_kind(record["body"])
            if kind not in ("CommandAccepted", "CommandRejected"):
                continue
            if fields.get("command_id") != command_id:
                continue
            if kind == "CommandAccepted":
                return Answer(command_id, run_id, True, duplicate=bool(fields.get("duplicate")))
            return Answer(command_id, run_id, False, code=fields.get("code"), reason=fields.get("reason"))
        raise AnswerTimeout(
            f"no answer to command {command_id} for run {run_id} within {self.answer_timeout} s"
        )

    def close(self) -> None:
        self._producer.flush(10)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
