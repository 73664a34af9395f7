#!/usr/bin/env bash
# Installs what building and running Sortie needs and a fresh machine may lack: a C
# toolchain and OpenSSL headers for librdkafka, a JDK and Maven for the local Kafka broker
# (fetched from Maven Central by dev/kafka/pom.xml), Python's venv (the outside-client
# examples and tests, dev/helm-check.sh), and rustfmt/clippy. With --tests (dev/test.sh
# passes it) also what only the tests use: Chromium and its WebDriver for the console's
# browser test, tmux for the CLI's terminal test. Idempotent; quick when nothing is
# missing.
set -euo pipefail

tests=
for arg in "$@"; do
    case "$arg" in
        --tests) tests=1 ;;
        *) echo "usage: dev/prerequisites.sh [--tests]" >&2; exit 2 ;;
    esac
done

missing=()
need() { command -v "$1" >/dev/null 2>&1 || missing+=("$2"); }
need cc build-essential
need make build-essential
need pkg-config pkg-config
need cmake cmake
need java openjdk-17-jre-headless
need mvn maven
[ -f /usr/include/openssl/ssl.h ] || missing+=(libssl-dev)
[ -f /usr/include/zlib.h ] || missing+=(zlib1g-dev)
need python3 python3
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
if [ -n "$tests" ]; then
    need chromium chromium
    need chromedriver chromium-driver
    need tmux tmux   # tests/tests/human.rs reads the CLI's output the way a person sees it
fi

if [ ${#missing[@]} -gt 0 ]; then
    echo "Installing: ${missing[*]}" >&2
    if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
    echo "cargo is missing: install Rust (https://rustup.rs) first" >&2
    exit 1
fi
if command -v rustup >/dev/null 2>&1; then
    for component in rustfmt clippy; do
        rustup component list --installed 2>/dev/null | grep -q "^$component" ||
            rustup component add "$component" >/dev/null
    done
fi
