"""Publish Sortie run commands from another service, the way any Kafka producer would:
confluent-kafka with its Avro serializer and the schema registry.

    python publish_commands.py --bootstrap 127.0.0.1:9092 --registry http://127.0.0.1:8081 \
        start --run-id run-42 --graph refund --input '{"order_id": "o-42"}'
    python publish_commands.py ... approve --run-id run-42 --interrupt-id int_... --proposal-hash ...
    python publish_commands.py ... cancel --run-id run-42 --reason "customer asked"
    python publish_commands.py ... --principal svc:logistics --role logistics \
        signal --run-id run-42 --name laptop_delivered --payload '{"tracking": "1Z999"}'
    python publish_commands.py ... signal --correlated onboarding hire_id h-42 \
        --name laptop_delivered --payload '{"tracking": "1Z999"}'

Two things matter for Sortie:
  * the record key is the run id, and the producer hashes keys like the Java client
    (`partitioner=murmur2_random`; librdkafka's default would pick other partitions,
    which Sortie tolerates by forwarding, at the cost of a hop);
  * `command_id` makes a command idempotent: send it again and it is applied once (a
    signal's `--signal-id` does the same across command ids: resend an event under a new
    command id and its run takes it once);
  * with `--signing-key` (a key file from `sortie keys new`), the record carries an
    Ed25519 signature over its exact value bytes (headers `sortie-key`,
    `sortie-signature`, signed with `cryptography` from PyPI): reducers started with
    `--require-signatures` take only signed commands, by a key of their keyring that may
    sign as `--principal` for `--tenant` with `--role`s.
The reducer answers every command with a CommandAccepted or CommandRejected event carrying
the same command_id on the run-events topic (see dashboard.py); a signal its run takes is
followed by SignalReceived (or SignalBuffered, kept for a wait not open yet), one it
refuses is answered `unknown_signal`, `forbidden`, `invalid_payload`, `not_waiting`, ...
"""

import argparse
import base64
import hashlib
import json
import os
import sys
import time
import uuid

from confluent_kafka import Producer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

def load_signing_key(path):
    """The key file of `sortie keys new`: `id:` and `secret_key:` (base64 Ed25519 seed)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    fields = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#") and ":" in line:
                name, value = line.split(":", 1)
                fields[name.strip()] = value.strip()
    seed = base64.b64decode(fields["secret_key"])
    return fields["id"], Ed25519PrivateKey.from_private_bytes(seed)


SCHEMA = os.path.join(os.path.dirname(__file__), "..", "..", "schemas", "run-command.avsc")
NS = "dev.sortie.v1."


def body(args):
    if args.command == "start":
        return (NS + "StartRun", {
            "graph_id": args.graph,
            "graph_version": args.graph_version,
            "input": json.dumps(json.loads(args.input)),
            "labels": {},
        })
    if args.command in ("approve", "reject"):
        return (NS + "ResumeRun", {
            "interrupt_id": args.interrupt_id,
            "proposal_hash": args.proposal_hash,
            "decision": "APPROVE" if args.command == "approve" else "REJECT",
            "payload": None,
            "comment": args.comment,
        })
    if args.command == "cancel":
        return (NS + "CancelRun", {"reason": args.reason})
    if args.command == "signal":
        # For a node with `wait: {signal: <name>}`; the payload is held to the wait's schema.
        return (NS + "SignalRun", {
            "name": args.name,
            "signal_id": args.signal_id,
            "payload": None if args.payload is None else json.dumps(json.loads(args.payload)),
        })
    raise SystemExit(f"unknown command {args.command}")


def correlated_run_id(tenant: str, graph_id: str, label: str, value: str) -> str:
    """The run id of a graph that declares `correlation: <label>`: the one run of that
    graph whose label has this value, in this tenant (`sortie_core::ids::correlated_run_id`)."""
    digest = hashlib.sha256()
    for part in ("sortie.correlation.v1", tenant, graph_id, label, value):
        digest.update(part.encode())
        digest.update(b"\x1f")
    return "cor_" + digest.hexdigest()[:32]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--registry", default="http://127.0.0.1:8081")
    parser.add_argument("--prefix", default="sortie.")
    parser.add_argument("--tenant", default="dev")
    parser.add_argument("--principal", default="svc:python-example")
    parser.add_argument("--role", action="append", default=[])
    parser.add_argument("--command-id", default=None, help="defaults to a new UUID")
    parser.add_argument("--signing-key", default=None,
                        help="sign the command with this key file (sortie keys new)")
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start")
    start.add_argument("--run-id", required=True)
    start.add_argument("--graph", required=True)
    start.add_argument("--graph-version", type=int, default=None)
    start.add_argument("--input", default="{}")
    for name in ("approve", "reject"):
        decide = sub.add_parser(name)
        decide.add_argument("--run-id", required=True)
        decide.add_argument("--interrupt-id", required=True)
        decide.add_argument("--proposal-hash", required=True)
        decide.add_argument("--comment", default=None)
    cancel = sub.add_parser("cancel")
    cancel.add_argument("--run-id", required=True)
    cancel.add_argument("--reason", default=None)
    signal = sub.add_parser("signal")
    target = signal.add_mutually_exclusive_group(required=True)
    target.add_argument("--run-id")
    target.add_argument("--correlated", nargs=3, metavar=("GRAPH", "LABEL", "VALUE"),
                        help="the run of GRAPH (which declares correlation: LABEL) whose label is VALUE")
    signal.add_argument("--name", required=True, help="the signal the run's wait names")
    signal.add_argument("--payload", default=None, help="JSON (default null)")
    signal.add_argument("--signal-id", default=None,
                        help="your id of this event, taken once per run (default: the command id)")
    args = parser.parse_args()
    if getattr(args, "correlated", None):
        args.run_id = correlated_run_id(args.tenant, *args.correlated)

    topic = args.prefix + "commands"
    with open(SCHEMA) as f:
        schema = f.read()
    serializer = AvroSerializer(SchemaRegistryClient({"url": args.registry}), schema)
    producer = Producer({
        "bootstrap.servers": args.bootstrap,
        "partitioner": "murmur2_random",
        "enable.idempotence": True,
    })
    command_id = args.command_id or str(uuid.uuid4())
    value = {
        "command_id": command_id,
        "tenant": args.tenant,
        "run_id": args.run_id,
        "issuer": {"principal": args.principal, "roles": args.role},
        "issued_at": int(time.time() * 1000),
        "body": body(args),
    }
    payload = serializer(value, SerializationContext(topic, MessageField.VALUE))
    delivered = {}

    def on_delivery(err, msg):
        delivered["err"] = err
        if msg is not None and err is None:
            delivered["partition"] = msg.partition()
            delivered["offset"] = msg.offset()

    headers = []
    if args.signing_key:
        key_id, key = load_signing_key(args.signing_key)
        headers = [("sortie-key", key_id.encode()), ("sortie-signature", key.sign(payload))]
    producer.produce(topic, key=args.run_id.encode(), value=payload, headers=headers,
                     on_delivery=on_delivery)
    producer.flush(30)
    if delivered.get("err") is not None or "offset" not in delivered:
        print(json.dumps({"error": str(delivered.get("err", "not delivered"))}))
        return 1
    print(json.dumps({"command_id": command_id, "run_id": args.run_id, "topic": topic,
                      "partition": delivered["partition"], "offset": delivered["offset"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
