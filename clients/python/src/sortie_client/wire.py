"""What every part of the package shares: Kafka's murmur2 partitioner, the topics, the
Avro schemas (copies of the repository's `schemas/*.avsc`), Kafka properties files and
the connection settings.

Records are Avro in the Confluent wire format, registered under TopicNameStrategy
(`<topic>-value`); keys are UTF-8 run ids or operation ids.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

_SCHEMAS = os.path.join(os.path.dirname(__file__), "schemas")


def schema_text(name: str) -> str:
    """The Avro schema `name` (e.g. `run-command`) as shipped with this package."""
    with open(os.path.join(_SCHEMAS, name + ".avsc")) as f:
        return f.read()


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (seed 0x9747b28c), bit for bit as the Java client's
    `Utils.murmur2`, as a signed 32-bit int."""
    length = len(data)
    seed = 0x9747B28C
    m = 0x5BD1E995
    r = 24
    h = (seed ^ length) & 0xFFFFFFFF
    length4 = length // 4
    for i in range(length4):
        i4 = i * 4
        k = (data[i4] & 0xFF) | ((data[i4 + 1] & 0xFF) << 8) | ((data[i4 + 2] & 0xFF) << 16) | (
            (data[i4 + 3] & 0xFF) << 24
        )
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    rest = length % 4
    tail = length & ~3
    if rest == 3:
        h ^= (data[tail + 2] & 0xFF) << 16
    if rest >= 2:
        h ^= (data[tail + 1] & 0xFF) << 8
    if rest >= 1:
        h ^= data[tail] & 0xFF
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def partition_for(key: str, partitions: int) -> int:
    """The partition the Java client's default partitioner (and Sortie) gives `key`."""
    if partitions <= 0:
        raise ValueError("a topic has at least one partition")
    return (murmur2(key.encode()) & 0x7FFFFFFF) % partitions


def read_properties(path: str) -> Dict[str, str]:
    """A Java-style properties file (`key=value` lines, `#` and `!` comments) of librdkafka
    settings, read as `sortie --kafka-properties` reads it (SASL, TLS, ...)."""
    properties: Dict[str, str] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#") or line.startswith("!"):
                continue
            if "=" not in line:
                raise ValueError(f"{path}: line {n}: expected key=value")
            key, value = line.split("=", 1)
            properties[key.strip()] = value.strip()
    return properties


@dataclass
class Connection:
    """Where the cluster and its registry are: the settings every Sortie process shares
    (`--bootstrap-servers`, `--registry-url`, `--prefix`, `--kafka-properties`, and their
    `SORTIE__...` environment variables)."""

    bootstrap_servers: str = "127.0.0.1:9092"
    registry_url: str = "http://127.0.0.1:8081"
    prefix: str = "sortie."
    #: Extra librdkafka settings for every client (SASL, TLS); see [`read_properties`].
    kafka_properties: Dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "Connection":
        """The connection `sortie` would use with no flags: its environment variables."""
        env = os.environ if env is None else env
        path = env.get("SORTIE__KAFKA__PROPERTIES_FILE")
        return cls(
            bootstrap_servers=env.get("SORTIE__KAFKA__BOOTSTRAP_SERVERS", "127.0.0.1:9092"),
            registry_url=env.get("SORTIE__REGISTRY__URL", "http://127.0.0.1:8081"),
            prefix=env.get("SORTIE__TOPICS__PREFIX", "sortie."),
            kafka_properties=read_properties(path) if path else {},
        )

    def kafka(self, **settings: Any) -> Dict[str, Any]:
        """A client config: the bootstrap servers, the properties file, then `settings`
        (which win: they are what Sortie's guarantees rest on)."""
        config: Dict[str, Any] = {"bootstrap.servers": self.bootstrap_servers}
        config.update(self.kafka_properties)
        config.update({k.replace("_", "."): v for k, v in settings.items()})
        return config

    def topic(self, name: str) -> str:
        return self.prefix + name

    def registry(self) -> SchemaRegistryClient:
        return SchemaRegistryClient({"url": self.registry_url})


class Codec:
    """Avro in the Confluent wire format for one topic, through the registry."""

    def __init__(self, registry: SchemaRegistryClient, topic: str, schema: Optional[str] = None):
        self.topic = topic
        self._context = SerializationContext(topic, MessageField.VALUE)
        self._serializer = AvroSerializer(registry, schema) if schema else None
        self._deserializer = AvroDeserializer(registry, return_record_name=True)

    def encode(self, value: Dict[str, Any]) -> bytes:
        if self._serializer is None:
            raise RuntimeError(f"no writer schema for {self.topic}")
        data = self._serializer(value, self._context)
        if not isinstance(data, bytes):
            raise ValueError(f"{self.topic}: the value did not encode")
        return data

    def decode(self, data: Optional[bytes]) -> Dict[str, Any]:
        if data is None:
            raise ValueError("a record without a value")
        record = self._deserializer(data, self._context)
        if not isinstance(record, dict):
            raise ValueError("not a record")
        return record


def partition_count(client: Any, topic: str, timeout: float = 10.0) -> int:
    """How many partitions `topic` has (a Producer's or Consumer's metadata)."""
    metadata = client.list_topics(topic, timeout=timeout)
    found = metadata.topics.get(topic)
    if found is None or found.error is not None or not found.partitions:
        raise RuntimeError(f"topic {topic} does not exist; run `sortie topology apply`")
    return len(found.partitions)


def union_kind(value: Any) -> Tuple[str, Dict[str, Any]]:
    """`(short record name, fields)` of a union branch decoded with record names."""
    kind, fields = value
    return kind.rsplit(".", 1)[-1], fields
