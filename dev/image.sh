#!/usr/bin/env bash
# Builds the Sortie container image without a container engine or an image registry:
# the image the Dockerfile describes, from Debian's own tools.
#
#   dev/image.sh           build target/image/sortie-<version>.tar
#   dev/image.sh --check   build it, then prove it (below)
#
# 1. A minimal Debian bookworm root file system with mmdebstrap (`--variant=minbase`,
#    slimmed like debian:bookworm-slim) plus the runtime packages the Dockerfile installs
#    (ca-certificates, libssl3) and the user sortie (uid/gid 10001). Downloaded .debs are
#    kept in target/image/debs, so the next build is quick.
# 2. The release binary (target/release/sortie; built if missing) at
#    /usr/local/bin/sortie, schemas/ and topology/ at /usr/share/sortie/, the working
#    directory /var/lib/sortie (owned by 10001, with links to both).
# 3. dev/image-archive.py writes one tar that is an OCI image layout and a `docker load`
#    archive at once, with the image config (Entrypoint, User, Env, WorkingDir, Labels)
#    and the tag sortie:<workspace version>; mtimes clamped to SOURCE_DATE_EPOCH (the
#    last commit's time), entries sorted.
#
# --check then: re-reads the archive and checks every digest (dev/image-archive.py
# verify, and skopeo, installed from Debian if missing, copies it from both its OCI and
# Docker faces); runs, as uid 10001 inside the root file system (chroot), `ldd` on the
# binary and `sortie --version`; starts the project's local broker on the host on a free
# port and, from inside the root file system, runs `sortie topology apply` and `check`
# against it, then `sortie registry serve` and `sortie reducer` until the reducer's
# /readyz answers 200, then `graph publish`, an executor and a gateway (both /readyz 200)
# and the demo graph run through its approval to succeeded with `sortie run`; stops
# everything and unmounts.
#
# Needs root (mmdebstrap --mode=root, chroot, mounts) and the Debian archive.
set -euo pipefail
cd "$(dirname "$0")/.."

check=false
case "${1:-}" in
    "") ;;
    --check) check=true ;;
    *) echo "usage: dev/image.sh [--check]" >&2; exit 2 ;;
esac
if [ "$(id -u)" -ne 0 ]; then
    echo "dev/image.sh needs root (mmdebstrap --mode=root, chroot, mounts)" >&2
    exit 1
fi

SUITE=bookworm
MIRRORS=(
    "deb http://deb.debian.org/debian $SUITE main"
    "deb http://deb.debian.org/debian $SUITE-updates main"
    "deb http://deb.debian.org/debian-security $SUITE-security main"
)
# Keep in step with the Dockerfile's runtime stage.
RUNTIME_PACKAGES=ca-certificates,libssl3
IMAGE_UID=10001
WORKDIR=/var/lib/sortie
IMAGE_PATH_ENV=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

VERSION=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"$/\1/p' Cargo.toml)
[ -n "$VERSION" ] || { echo "no [workspace.package] version in Cargo.toml" >&2; exit 1; }
REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)
if [ "$REVISION" != unknown ] && ! git diff --quiet HEAD -- 2>/dev/null; then
    REVISION=$REVISION-dirty
fi
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}

OUT=$PWD/target/image
ROOTFS=$OUT/rootfs
DEBS=$OUT/debs
ARCHIVE=$OUT/sortie-$VERSION.tar
BIN=$PWD/target/release/sortie
mkdir -p "$OUT" "$DEBS"

step() { printf '== %s (%ss)\n' "$*" "$SECONDS"; }

# Mounts under the root file system (--check), unmounted on any exit; never delete the
# root file system while one is mounted (a bind-mounted /dev would go with it).
MOUNTS=(proc dev tmp)
unmount_all() {
    local m
    for m in "${MOUNTS[@]}"; do
        if mountpoint -q "$ROOTFS/$m" 2>/dev/null; then
            umount "$ROOTFS/$m" 2>/dev/null || umount -l "$ROOTFS/$m"
        fi
    done
}
PIDS=()
BROKER_DIR=$PWD/target/image-smoke/kafka
broker_started=false
cleanup() {
    local pid deadline=$((SECONDS + 30))
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]}"; do # SIGTERM: each finishes its batch; SIGKILL after 30 s
        while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
        kill -9 "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    if $broker_started; then
        "$BIN" broker stop --data-dir "$BROKER_DIR" >/dev/null 2>&1 || true
    fi
    unmount_all
}
trap cleanup EXIT

if ! command -v mmdebstrap >/dev/null 2>&1; then
    step "installing mmdebstrap (Debian package)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >/dev/null
fi
if [ ! -x "$BIN" ]; then
    step "building the release binary"
    cargo build --release -p sortie
fi

step "root file system: mmdebstrap $SUITE minbase + $RUNTIME_PACKAGES"
unmount_all
rm -rf --one-file-system "$ROOTFS"
# The hooks run on the host with the root file system as "$1"; sync-in/-out keep the
# downloaded packages in target/image/debs (the cleanup step empties the apt cache of
# the root file system afterwards). The dpkg filters are debian:*-slim's. The merged-usr
# hook sets up /usr like the official images do, instead of installing the usrmerge
# package (which drags perl in: 50 MB).
mmdebstrap --quiet --mode=root --variant=minbase --format=directory \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --include="$RUNTIME_PACKAGES" \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/groff/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/lintian/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --skip=download/empty --skip=essential/unlink \
    --setup-hook='mkdir -p "$1"/var/cache/apt/archives/' \
    --setup-hook="sync-in '$DEBS' /var/cache/apt/archives/" \
    --customize-hook="sync-out /var/cache/apt/archives '$DEBS'" \
    --customize-hook="chroot \"\$1\" groupadd --system --gid $IMAGE_UID sortie" \
    --customize-hook="chroot \"\$1\" useradd --system --uid $IMAGE_UID --gid $IMAGE_UID --home-dir $WORKDIR --no-create-home --shell /usr/sbin/nologin sortie" \
    "$SUITE" "$ROOTFS" "${MIRRORS[@]}" >"$OUT/mmdebstrap.log" 2>&1 ||
    { tail -n 40 "$OUT/mmdebstrap.log" >&2; echo "mmdebstrap failed: $OUT/mmdebstrap.log" >&2; exit 1; }
rm -rf "$DEBS/lock" "$DEBS/partial"

step "application: /usr/local/bin/sortie, /usr/share/sortie, $WORKDIR"
install -D -m 0755 -o 0 -g 0 "$BIN" "$ROOTFS/usr/local/bin/sortie"
install -d -m 0755 "$ROOTFS/usr/share/sortie"
cp -R --no-preserve=ownership schemas topology "$ROOTFS/usr/share/sortie/"
chmod -R u=rwX,go=rX "$ROOTFS/usr/share/sortie"
install -d -m 0755 -o "$IMAGE_UID" -g "$IMAGE_UID" "$ROOTFS$WORKDIR"
ln -s /usr/share/sortie/topology "$ROOTFS$WORKDIR/topology"
ln -s /usr/share/sortie/schemas "$ROOTFS$WORKDIR/schemas"
chown -h "$IMAGE_UID:$IMAGE_UID" "$ROOTFS$WORKDIR/topology" "$ROOTFS$WORKDIR/schemas"

step "image archive: sortie:$VERSION"
created=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
spec=$OUT/spec.json
python3 - "$spec" <<PY
import json, sys
labels = {
    "org.opencontainers.image.title": "sortie",
    "org.opencontainers.image.description": "Durable execution for AI agent runs on Kafka: the sortie binary (reducer, executor, gateway, topology, graph, registry)",
    "org.opencontainers.image.version": "$VERSION",
    "org.opencontainers.image.revision": "$REVISION",
    "org.opencontainers.image.created": "$created",
    "org.opencontainers.image.licenses": "Apache-2.0",
    "org.opencontainers.image.base.name": "debian:$SUITE-slim (mmdebstrap minbase)",
}
json.dump({
    "name": "sortie",
    "tag": "$VERSION",
    "config": {
        "User": "$IMAGE_UID:$IMAGE_UID",
        "Env": ["PATH=$IMAGE_PATH_ENV"],
        "Entrypoint": ["sortie"],
        "Cmd": ["--help"],
        "WorkingDir": "$WORKDIR",
        "Labels": labels,
    },
    "history": [
        {"created_by": "mmdebstrap --variant=minbase --include=$RUNTIME_PACKAGES $SUITE (dev/image.sh)", "comment": "debian:$SUITE-slim equivalent, user sortie $IMAGE_UID"},
        {"created_by": "dev/image.sh: /usr/local/bin/sortie, /usr/share/sortie/{schemas,topology}, $WORKDIR"},
    ],
    "annotations": {k: v for k, v in labels.items() if k != "org.opencontainers.image.created"},
}, open(sys.argv[1], "w"), indent=2)
PY
summary=$(python3 dev/image-archive.py build --rootfs "$ROOTFS" \
    --app usr/local/bin/sortie --app usr/share/sortie --app "${WORKDIR#/}" \
    --config "$spec" --out "$ARCHIVE")
python3 - "$summary" <<'PY'
import json, sys
s = json.loads(sys.argv[1])
print(f"image     {s['reference']}  ({', '.join(s['repo_tags'])})")
print(f"archive   {s['archive']}  {s['archive_bytes'] / 2**20:.1f} MiB")
print(f"digest    {s['manifest_digest']}  (manifest; config {s['config_digest']})")
for i, l in enumerate(s["layers"]):
    print(f"layer {i}   {l['digest']}  {l['bytes'] / 2**20:.1f} MiB gzip, "
          f"{l['uncompressed_bytes'] / 2**20:.1f} MiB, {l['entries']} entries")
PY

if ! $check; then
    step "done: load it with docker load -i / podman load -i $ARCHIVE"
    exit 0
fi

step "check: archive digests, config and files (dev/image-archive.py verify)"
python3 dev/image-archive.py verify "$ARCHIVE" | python3 -c '
import json, sys
s = json.load(sys.stdin)
c = s["config"]
assert c["User"] == "'$IMAGE_UID:$IMAGE_UID'" and c["Entrypoint"] == ["sortie"], c
assert c["WorkingDir"] == "'$WORKDIR'", c
assert s["files"]["usr/local/bin/sortie"]["mode"] == "0o755", s["files"]
assert s["files"]["var/lib/sortie"]["uid"] == '$IMAGE_UID', s["files"]
assert "etc/ssl/certs/ca-certificates.crt" in s["files"], s["files"]
print("   config:", json.dumps({k: c[k] for k in ("User", "Entrypoint", "Cmd", "WorkingDir", "Env")}))
for name, f in s["files"].items():
    print(f"   {name}: {f}")'

step "check: skopeo reads both faces of the archive"
if ! command -v skopeo >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq skopeo >/dev/null
fi
copies=$(mktemp -d "$OUT/skopeo.XXXXXX")
PIDS=()
skopeo --insecure-policy copy --quiet "oci-archive:$ARCHIVE" "oci:$copies/from-oci:sortie:$VERSION"
skopeo --insecure-policy copy --quiet "docker-archive:$ARCHIVE" "dir:$copies/from-docker"
skopeo inspect --config "docker-archive:$ARCHIVE" | python3 -c '
import json, sys
c = json.load(sys.stdin)["config"]
print("   docker-archive config: User", c["User"], "Entrypoint", c["Entrypoint"], "WorkingDir", c["WorkingDir"])'
skopeo inspect "oci-archive:$ARCHIVE" | python3 -c '
import json, sys
i = json.load(sys.stdin)
print("   oci-archive:", i["Digest"], len(i["Layers"]), "layers, version label", i["Labels"]["org.opencontainers.image.version"])'
rm -rf "$copies"

step "check: inside the root file system as uid $IMAGE_UID"
mount -t proc proc "$ROOTFS/proc"
mount --bind /dev "$ROOTFS/dev"
mount -t tmpfs -o mode=1777,size=256m tmpfs "$ROOTFS/tmp"
# What the image's config says: its Env only, its User, its WorkingDir, its Entrypoint
# (plus a quieter log level: the commands' own output is what the check shows). Every
# program in it execs the next, so a background `"${IN_IMAGE[@]}" ... &` has the pid of
# sortie itself (a shell function in the background would not: killing its subshell
# leaves sortie running).
IN_IMAGE=(env -i PATH="$IMAGE_PATH_ENV" HOME="$WORKDIR" SORTIE__LOG__LEVEL="${SMOKE_LOG_LEVEL:-warn}"
    chroot --userspec="$IMAGE_UID:$IMAGE_UID" "$ROOTFS"
    /usr/bin/env --chdir="$WORKDIR" sortie)
in_image() { "${IN_IMAGE[@]}" "$@"; }
if chroot "$ROOTFS" ldd /usr/local/bin/sortie | grep 'not found'; then
    echo "the image lacks a library the binary needs" >&2
    exit 1
fi
chroot "$ROOTFS" ldd /usr/local/bin/sortie | sed 's/ (0x.*//; s/^\s*/   ldd: /'
echo "   id: $(chroot --userspec="$IMAGE_UID:$IMAGE_UID" "$ROOTFS" id)"
got=$(in_image --version)
echo "   sortie --version: $got"
[ "$got" = "sortie $VERSION" ] || { echo "expected 'sortie $VERSION'" >&2; exit 1; }

# Two free ports in a row for the broker (PLAINTEXT and controller), then two more.
free_port() {
    python3 - "$@" <<'PY'
import socket, sys
def free(p):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", p)); return True
        except OSError:
            return False
for p in range(int(sys.argv[1]), 65000):
    if free(p) and free(p + 1):
        print(p); break
PY
}
port=$(free_port 29092)
registry_port=$(free_port $((port + 2)))
metrics_port=$((registry_port + 1))
bootstrap=127.0.0.1:$port

step "check: the project's local broker on the host, $bootstrap"
rm -rf "${BROKER_DIR:?}"/{logs,server.properties,broker.pid,broker.out,broker.log*}
broker_started=true
mkdir -p "$OUT/smoke-logs"
"$BIN" broker start --data-dir "$BROKER_DIR" --port "$port" >/dev/null 2>"$OUT/smoke-logs/broker-start.log" ||
    { cat "$OUT/smoke-logs/broker-start.log" >&2; exit 1; }

step "check: sortie topology apply / check from the image"
in_image topology apply --bootstrap-servers "$bootstrap" \
    --file /usr/share/sortie/topology/topics.yaml --prefix smoke. | sed 's/^/   /'
in_image topology check --bootstrap-servers "$bootstrap" \
    --file /usr/share/sortie/topology/topics.yaml --prefix smoke. | sed 's/^/   /'
# The working directory's link makes the default --file work too.
in_image topology check --bootstrap-servers "$bootstrap" --prefix smoke. | sed 's/^/   default --file: /'

step "check: sortie registry serve + sortie reducer from the image, until /readyz is 200"
logs=$OUT/smoke-logs
mkdir -p "$logs"
"${IN_IMAGE[@]}" registry serve --bootstrap-servers "$bootstrap" --addr "127.0.0.1:$registry_port" \
    --topic smoke._schemas >"$logs/registry.log" 2>&1 &
PIDS+=($!)
wait_http() { # url seconds what
    local deadline=$((SECONDS + $2))
    until curl -fsS --max-time 2 -o /dev/null "$1" 2>/dev/null; do
        if [ $SECONDS -ge $deadline ]; then
            echo "$3 did not answer $1 within $2 s; logs in $logs" >&2
            tail -n 20 "$logs"/*.log >&2
            exit 1
        fi
        sleep 0.5
    done
}
wait_http "http://127.0.0.1:$registry_port/subjects" 60 "the registry"
echo "   registry: http://127.0.0.1:$registry_port/subjects answers"
started=$SECONDS
"${IN_IMAGE[@]}" reducer --bootstrap-servers "$bootstrap" \
    --registry-url "http://127.0.0.1:$registry_port" --prefix smoke. \
    --data-dir /tmp/reducer --instance-id smoke-0 \
    --metrics-addr "127.0.0.1:$metrics_port" >"$logs/reducer.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$metrics_port/readyz" 120 "the reducer"
echo "   reducer: /readyz 200 after $((SECONDS - started)) s: $(curl -fsS "http://127.0.0.1:$metrics_port/readyz")"

step "check: executor + gateway from the image, then the demo graph through its approval"
executor_port=$(free_port $((metrics_port + 1)))
gateway_port=$((executor_port + 1))
connection=(--bootstrap-servers "$bootstrap" --registry-url "http://127.0.0.1:$registry_port" --prefix smoke.)
# A relative path: the working directory's link to /usr/share/sortie/topology.
in_image graph publish "${connection[@]}" --by image-check topology/graphs/demo.yaml | sed 's/^/   /'
"${IN_IMAGE[@]}" executor "${connection[@]}" --queue default \
    --metrics-addr "127.0.0.1:$executor_port" >"$logs/executor.log" 2>&1 &
PIDS+=($!)
"${IN_IMAGE[@]}" gateway "${connection[@]}" --addr "127.0.0.1:$gateway_port" --data-dir /tmp/gateway \
    --token smoke:image-check:approver:smoke-token >"$logs/gateway.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$executor_port/readyz" 120 "the executor"
wait_http "http://127.0.0.1:$gateway_port/readyz" 120 "the gateway"
echo "   executor and gateway: /readyz 200"
run_cli() { in_image run --gateway "http://127.0.0.1:$gateway_port" --token smoke-token "$@"; }
field() { python3 -c 'import json, sys; print(json.load(sys.stdin).get(sys.argv[1]) or "")' "$1"; }
wait_status() { # run_id status seconds
    local deadline=$((SECONDS + $3)) status=""
    while [ "$status" != "$2" ]; do
        [ $SECONDS -lt $deadline ] || { echo "run $1 is $status, not $2, after $3 s; logs in $logs" >&2; exit 1; }
        sleep 0.5
        status=$(run_cli get "$1" | field status)
    done
}
run_id=$(run_cli start demo --input '{"message": "from the image"}' | field run_id)
[ -n "$run_id" ] || { echo "the demo run did not start; logs in $logs" >&2; exit 1; }
wait_status "$run_id" waiting_approval 60
echo "   run $run_id: waiting_approval"
run_cli approve "$run_id" >/dev/null
wait_status "$run_id" succeeded 60
echo "   run $run_id: approved, succeeded"

step "check: stopping (SIGTERM), broker, unmounting"
cleanup
PIDS=()
broker_started=false
trap - EXIT
step "check OK: $ARCHIVE"
