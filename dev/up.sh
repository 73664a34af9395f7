#!/usr/bin/env bash
# The local Sortie stack with a demo mission, in one command on a fresh checkout:
# a real Apache Kafka (KRaft), the schema registry, the topics, the example graphs, the
# ledger, reducer, executor and gateway (each its own process), and a demo run that
# waits for your approval; then it prints how to run the refund story (start, approve,
# watch) against the dev receiver. Ctrl-C stops everything; running it again resumes the data.
# Extra arguments go to `sortie dev` (see `cargo run -p sortie -- dev --help`).
set -euo pipefail
cd "$(dirname "$0")/.."

dev/prerequisites.sh
cargo build -q -p sortie
exec target/debug/sortie dev "$@"
