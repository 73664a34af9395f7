"""Drive Sortie's schema registry with Confluent's Python client and print what it saw.

Usage: python registry_client.py REGISTRY_URL NAME_PREFIX

Registers a schema, reads it back by id, by latest version and by version number, looks
it up, tests two candidate schemas for compatibility, sets and reads a subject's
compatibility level, and round-trips a record through AvroSerializer/AvroDeserializer.
Prints one JSON object on stdout; the Rust test (tests/tests/registry.rs) asserts on it.
Exits non-zero (with a traceback) only when the client itself fails unexpectedly.
"""

import json
import sys

from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext

V1 = {
    "type": "record",
    "name": "Order",
    "namespace": "sortie.pytest",
    "fields": [
        {"name": "id", "type": "string"},
        {"name": "amount", "type": "long"},
    ],
}
V2_COMPATIBLE = {
    **V1,
    "fields": V1["fields"] + [{"name": "note", "type": "string", "default": ""}],
}
V2_INCOMPATIBLE = {
    **V1,
    "fields": V1["fields"] + [{"name": "note", "type": "string"}],
}


def error_code(call):
    try:
        call()
    except SchemaRegistryError as error:
        return error.error_code
    return None


def main() -> int:
    url, prefix = sys.argv[1], sys.argv[2]
    client = SchemaRegistryClient({"url": url})
    subject = f"{prefix}orders-value"
    out = {"subject": subject}

    schema_id = client.register_schema(subject, Schema(json.dumps(V1), "AVRO"))
    out["registered_id"] = schema_id
    out["registered_again_id"] = client.register_schema(
        subject, Schema(json.dumps(V1, indent=2), "AVRO")
    )

    fetched = client.get_schema(schema_id)
    out["by_id_type"] = fetched.schema_type
    out["by_id_fields"] = [f["name"] for f in json.loads(fetched.schema_str)["fields"]]

    latest = client.get_latest_version(subject)
    out["latest"] = {"id": latest.schema_id, "version": latest.version, "subject": latest.subject}
    first = client.get_version(subject, 1)
    out["version_1_id"] = first.schema_id
    looked_up = client.lookup_schema(subject, Schema(json.dumps(V1), "AVRO"))
    out["lookup"] = {"id": looked_up.schema_id, "version": looked_up.version}
    out["subjects_contains"] = subject in client.get_subjects()
    out["versions"] = client.get_versions(subject)

    out["compatible_v2"] = client.test_compatibility(
        subject, Schema(json.dumps(V2_COMPATIBLE), "AVRO")
    )
    out["incompatible_v2"] = client.test_compatibility(
        subject, Schema(json.dumps(V2_INCOMPATIBLE), "AVRO")
    )
    out["register_incompatible_code"] = error_code(
        lambda: client.register_schema(subject, Schema(json.dumps(V2_INCOMPATIBLE), "AVRO"))
    )

    out["set_compatibility"] = client.set_compatibility(subject, "FULL")
    out["get_compatibility"] = client.get_compatibility(subject)
    out["global_compatibility"] = client.get_compatibility()
    out["missing_version_code"] = error_code(lambda: client.get_version(subject, 99))
    out["missing_subject_code"] = error_code(
        lambda: client.get_latest_version(f"{prefix}no-such-subject")
    )

    # A record through the serializer, which registers its schema under <topic>-value.
    topic = f"{prefix}payments"
    serializer = AvroSerializer(
        client,
        json.dumps({**V1, "name": "Payment"}),
        conf={"auto.register.schemas": True},
    )
    deserializer = AvroDeserializer(client)
    context = SerializationContext(topic, MessageField.VALUE)
    record = {"id": "pay-1", "amount": 4200}
    data = serializer(record, context)
    out["wire_magic"] = data[0]
    out["wire_id"] = int.from_bytes(data[1:5], "big")
    out["serializer_subject_latest_id"] = client.get_latest_version(f"{topic}-value").schema_id
    out["decoded"] = deserializer(data, context)
    out["record"] = record

    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
