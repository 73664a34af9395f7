#!/usr/bin/env bash
# Runs Sortie's whole test suite on this machine, installing what a fresh machine lacks.
# The tests start (or reuse) a real single-node Apache Kafka under target/kafka-test and
# stop it at the end; set SORTIE_TEST_BOOTSTRAP=host:port to use an existing broker instead.
#
#   dev/test.sh                 # everything
#   dev/test.sh -p sortie-wire  # extra arguments go to `cargo test`
set -euo pipefail
cd "$(dirname "$0")/.."

dev/prerequisites.sh --tests

keep_broker=${SORTIE_KEEP_TEST_BROKER:-}
stop_broker() {
    if [ -z "${SORTIE_TEST_BOOTSTRAP:-}" ] && [ -z "$keep_broker" ] && [ -x target/debug/sortie ]; then
        target/debug/sortie broker stop --data-dir target/kafka-test >/dev/null 2>&1 || true
    fi
}
trap stop_broker EXIT

cargo build --workspace --bins

# One broker per test run, on fresh data: thousands of per-test topics from earlier runs
# would make the next start slow. The fetched jars are kept.
if [ -z "${SORTIE_TEST_BOOTSTRAP:-}" ] && [ -z "$keep_broker" ]; then
    target/debug/sortie broker stop --data-dir target/kafka-test >/dev/null 2>&1 || true
    rm -rf target/kafka-test/logs target/test-runs
fi

cargo test --workspace "$@"
