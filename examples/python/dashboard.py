"""A dashboard's view of Sortie: consume the run-events topic (Avro, schema registry,
read_committed) and print every event as one JSON line, live.

    python dashboard.py --bootstrap 127.0.0.1:9092 --registry http://127.0.0.1:8081
    python dashboard.py ... --run run-42 --until SUCCEEDED --timeout 60

Events of a run arrive in order (`seq` 1, 2, ...): the topic is keyed by run id. The
`event` field names the kind (RunStarted, StepDispatched, Interrupted, ...) and the rest
are that kind's fields; JSON payloads (input, args, outputs) are JSON strings.
"""

import argparse
import json
import sys
import time
import uuid

from confluent_kafka import Consumer, KafkaError
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--registry", default="http://127.0.0.1:8081")
    parser.add_argument("--prefix", default="sortie.")
    parser.add_argument("--run", default=None, help="only this run's events")
    parser.add_argument("--until", default=None,
                        help="exit 0 once the run reaches this status (or WAITING_APPROVAL, any terminal one)")
    parser.add_argument("--timeout", type=float, default=0, help="give up (exit 1) after this many seconds")
    args = parser.parse_args()

    topic = args.prefix + "run-events"
    deserializer = AvroDeserializer(SchemaRegistryClient({"url": args.registry}), return_record_name=True)
    consumer = Consumer({
        "bootstrap.servers": args.bootstrap,
        "group.id": "dashboard-" + str(uuid.uuid4()),
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
        "enable.auto.commit": False,
    })
    consumer.subscribe([topic])
    deadline = time.time() + args.timeout if args.timeout else None
    try:
        while deadline is None or time.time() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() != KafkaError._PARTITION_EOF:
                    print(json.dumps({"error": str(msg.error())}), file=sys.stderr)
                continue
            record = deserializer(msg.value(), SerializationContext(topic, MessageField.VALUE))
            if args.run and record["run_id"] != args.run:
                continue
            kind, fields = record["body"]
            line = {"run_id": record["run_id"], "seq": record["seq"], "at": str(record["at"]),
                    "event": kind.rsplit(".", 1)[-1], **fields}
            print(json.dumps(line, default=str), flush=True)
            status = fields.get("status") if line["event"] == "RunStatusChanged" else None
            if args.until and status and (status == args.until or status in TERMINAL):
                return 0 if status == args.until else 2
    finally:
        consumer.close()
    return 1


if __name__ == "__main__":
    sys.exit(main())
