#!/usr/bin/env bash
# The local Sortie stack: a real single-node Apache Kafka (KRaft) under target/dev/kafka,
# Sortie's topics, and the schema registry on 127.0.0.1:8081. Ctrl-C stops the registry;
# the broker keeps its data and stays up until `cargo run -p sortie -- broker stop`.
set -euo pipefail
cd "$(dirname "$0")/.."

dev/prerequisites.sh
cargo build -p sortie
sortie=target/debug/sortie

bootstrap=$($sortie broker start)
export SORTIE__KAFKA__BOOTSTRAP_SERVERS=$bootstrap
echo "Kafka is up at $bootstrap (data in target/dev/kafka)."
$sortie topology apply
$sortie topology check
echo "Schema registry on http://127.0.0.1:8081 (Ctrl-C to stop it; '$sortie broker stop' stops Kafka)."
exec $sortie registry serve --addr 127.0.0.1:8081
