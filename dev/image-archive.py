#!/usr/bin/env python3
"""Writes a container image as one tar without a container engine (used by dev/image.sh).

The tar is an OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/...`) that also
carries a Docker `manifest.json` pointing at the same blobs, like `docker save` of Docker
25+: `docker load`, `podman load` and `skopeo copy oci-archive:...|docker-archive:...`
all read it.

    image-archive.py build --rootfs DIR --app PATH... --config FILE --out TAR
    image-archive.py verify TAR

`build` makes two gzip layers from DIR: the base (everything but the --app paths; the
contents of dev, proc, sys, run and tmp are left out, as the runtime provides them) and
the application (the --app paths and their parent directories). Deterministic for the
same tree: entries sorted, mtimes clamped to SOURCE_DATE_EPOCH, numeric owners, no user
or group names, gzip headers without a name or time. It prints a JSON summary.

`verify` re-reads the tar and checks it as a loader would: every blob's sha256 and size,
index → manifest → config and layers, the config's diff_ids against the uncompressed
layers, and the Docker manifest.json against the OCI manifest. It prints the summary.
"""

import argparse
import datetime
import gzip
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
# Directories whose contents belong to the runtime, not to the image.
RUNTIME_DIRS = {"dev", "proc", "sys", "run", "tmp"}


def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


class HashingWriter(io.RawIOBase):
    """A write-only file that hashes and counts what goes through it."""

    def __init__(self, target):
        self.target, self.sha, self.size = target, hashlib.sha256(), 0

    def writable(self):
        return True

    def tell(self):
        return self.size

    def write(self, data):
        self.sha.update(data)
        self.size += len(data)
        return self.target.write(data)


def walk(root, rel):
    """rel and everything below it, sorted, as paths relative to root."""
    yield rel
    full = os.path.join(root, rel)
    if os.path.isdir(full) and not os.path.islink(full):
        if rel in RUNTIME_DIRS:
            return
        for name in sorted(os.listdir(full)):
            yield from walk(root, os.path.join(rel, name))


def layer_entries(root, app, base):
    """Relative paths of the base layer (base=True) or of the application layer."""
    app = [p.strip("/") for p in app]
    if base:
        for rel in sorted(os.listdir(root)):
            for path in walk(root, rel):
                if not any(path == a or path.startswith(a + "/") for a in app):
                    yield path
        return
    parents = set()
    for a in app:
        parts = a.split("/")
        parents.update("/".join(parts[:i]) for i in range(1, len(parts)))
    yield from sorted(parents)
    for a in sorted(app):
        yield from walk(root, a)


def write_layer(root, paths, epoch, out_tar):
    """Writes the entries as a tar into out_tar (a binary file); returns nothing."""
    with tarfile.open(fileobj=out_tar, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in paths:
            full = os.path.join(root, rel)
            info = tar.gettarinfo(full, arcname=rel)
            if info is None or info.type in (tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE):
                continue  # sockets, devices, fifos: the runtime's business
            info.mtime = min(int(info.mtime), epoch)
            info.uname = info.gname = ""
            if info.isreg():
                with open(full, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)


def build_layer(root, paths, epoch, workdir):
    """Returns (diff_id, digest, size, path of the gzip blob)."""
    raw = tempfile.NamedTemporaryFile(dir=workdir, delete=False)
    hashing = HashingWriter(raw)
    write_layer(root, paths, epoch, hashing)
    raw.close()
    diff_id = "sha256:" + hashing.sha.hexdigest()
    gz = tempfile.NamedTemporaryFile(dir=workdir, delete=False)
    hashing = HashingWriter(gz)
    with open(raw.name, "rb") as src, gzip.GzipFile(
        filename="", mode="wb", fileobj=hashing, mtime=0, compresslevel=6
    ) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    gz.close()
    os.unlink(raw.name)
    return diff_id, "sha256:" + hashing.sha.hexdigest(), hashing.size, gz.name


def add_bytes(tar, name, data, epoch):
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), epoch, 0o644
    tar.addfile(info, io.BytesIO(data))


def add_dir(tar, name, epoch):
    info = tarfile.TarInfo(name)
    info.type, info.mtime, info.mode = tarfile.DIRTYPE, epoch, 0o755
    tar.addfile(info)


def build(args):
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    created = datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )
    spec = json.load(open(args.config))  # {name, tag, config, history, annotations}
    workdir = os.path.dirname(os.path.abspath(args.out))
    layers = []
    for base in (True, False):
        paths = list(layer_entries(args.rootfs, args.app, base))
        layers.append(build_layer(args.rootfs, paths, epoch, workdir))

    config = {
        "architecture": spec.get("architecture", "amd64"),
        "os": "linux",
        "created": created,
        "config": spec["config"],
        "rootfs": {"type": "layers", "diff_ids": [l[0] for l in layers]},
        "history": [dict(h, created=created) for h in spec["history"]],
    }
    config_bytes = canonical(config)
    config_digest = "sha256:" + hashlib.sha256(config_bytes).hexdigest()
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config_bytes)},
        "layers": [
            {"mediaType": OCI_LAYER_GZIP, "digest": digest, "size": size}
            for _, digest, size, _ in layers
        ],
        "annotations": dict(spec.get("annotations", {}), **{"org.opencontainers.image.created": created}),
    }
    manifest_bytes = canonical(manifest)
    manifest_digest = "sha256:" + hashlib.sha256(manifest_bytes).hexdigest()
    reference = f"{spec['name']}:{spec['tag']}"
    index = {
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [
            {
                "mediaType": OCI_MANIFEST,
                "digest": manifest_digest,
                "size": len(manifest_bytes),
                "annotations": {
                    # podman and skopeo name the image by this; containerd (docker load
                    # with the containerd store) by the second.
                    "org.opencontainers.image.ref.name": reference,
                    "io.containerd.image.name": f"docker.io/library/{reference}",
                },
            }
        ],
    }
    blob = lambda digest: "blobs/sha256/" + digest.split(":", 1)[1]
    docker_manifest = [
        {
            "Config": blob(config_digest),
            "RepoTags": [reference],
            "Layers": [blob(digest) for _, digest, _, _ in layers],
        }
    ]

    tmp_out = args.out + ".partial"
    with tarfile.open(tmp_out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        add_dir(tar, "blobs", epoch)
        add_dir(tar, "blobs/sha256", epoch)
        blobs = [(config_digest, config_bytes), (manifest_digest, manifest_bytes)]
        blobs += [(digest, path) for _, digest, _, path in layers]
        for digest, content in sorted(blobs, key=lambda b: b[0]):
            if isinstance(content, bytes):
                add_bytes(tar, blob(digest), content, epoch)
            else:
                info = tarfile.TarInfo(blob(digest))
                info.size, info.mtime, info.mode = os.path.getsize(content), epoch, 0o644
                with open(content, "rb") as f:
                    tar.addfile(info, f)
        add_bytes(tar, "index.json", canonical(index), epoch)
        add_bytes(tar, "manifest.json", canonical(docker_manifest), epoch)
        add_bytes(tar, "oci-layout", canonical({"imageLayoutVersion": "1.0.0"}), epoch)
    for _, _, _, path in layers:
        os.unlink(path)
    os.replace(tmp_out, args.out)
    print(json.dumps(summary(args.out), indent=2))


def summary(path):
    """Checks the archive as a loader would; returns what it found. Exits on a fault."""

    def fail(message):
        sys.exit(f"{path}: {message}")

    with tarfile.open(path) as tar:
        members = {m.name.rstrip("/"): m for m in tar.getmembers()}

        def read(name):
            if name not in members:
                fail(f"missing {name}")
            return tar.extractfile(members[name]).read()

        def blob(descriptor):
            name = "blobs/sha256/" + descriptor["digest"].split(":", 1)[1]
            data = read(name)
            if "sha256:" + hashlib.sha256(data).hexdigest() != descriptor["digest"]:
                fail(f"{name}: content does not match its digest")
            if len(data) != descriptor["size"]:
                fail(f"{name}: size {len(data)}, descriptor says {descriptor['size']}")
            return data

        if json.loads(read("oci-layout")) != {"imageLayoutVersion": "1.0.0"}:
            fail("bad oci-layout")
        index = json.loads(read("index.json"))
        if len(index["manifests"]) != 1:
            fail("expected one manifest in index.json")
        descriptor = index["manifests"][0]
        manifest = json.loads(blob(descriptor))
        config = json.loads(blob(manifest["config"]))
        layers = [gzip.decompress(blob(layer)) for layer in manifest["layers"]]
        diff_ids = ["sha256:" + hashlib.sha256(l).hexdigest() for l in layers]
        if diff_ids != config["rootfs"]["diff_ids"]:
            fail("the config's diff_ids do not match the layers")
        docker = json.loads(read("manifest.json"))
        expected = {
            "Config": "blobs/sha256/" + manifest["config"]["digest"].split(":", 1)[1],
            "Layers": ["blobs/sha256/" + l["digest"].split(":", 1)[1] for l in manifest["layers"]],
        }
        if len(docker) != 1 or {k: docker[0][k] for k in expected} != expected:
            fail("manifest.json does not match the OCI manifest")
        files = {}
        for data in layers:  # the image's file system: later layers win
            with tarfile.open(fileobj=io.BytesIO(data)) as layer:
                for m in layer.getmembers():
                    files[m.name.rstrip("/")] = m
        return {
            "archive": path,
            "archive_bytes": os.path.getsize(path),
            "reference": descriptor["annotations"]["org.opencontainers.image.ref.name"],
            "repo_tags": docker[0]["RepoTags"],
            "manifest_digest": descriptor["digest"],
            "config_digest": manifest["config"]["digest"],
            "layers": [
                {"digest": l["digest"], "bytes": l["size"], "uncompressed_bytes": len(d),
                 "entries": len(tarfile.open(fileobj=io.BytesIO(d)).getnames())}
                for l, d in zip(manifest["layers"], layers)
            ],
            "config": config["config"],
            "files": {
                name: {"mode": oct(files[name].mode), "uid": files[name].uid, "gid": files[name].gid,
                       "type": "dir" if files[name].isdir() else "symlink -> " + files[name].linkname
                       if files[name].issym() else "file"}
                for name in ("usr/local/bin/sortie", "usr/share/sortie/topology/topics.yaml",
                             "usr/share/sortie/schemas/run-command.avsc", "var/lib/sortie",
                             "var/lib/sortie/topology", "etc/ssl/certs/ca-certificates.crt")
                if name in files
            },
        }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("--rootfs", required=True)
    b.add_argument("--app", action="append", required=True)
    b.add_argument("--config", required=True)
    b.add_argument("--out", required=True)
    v = sub.add_parser("verify")
    v.add_argument("archive")
    args = parser.parse_args()
    if args.command == "build":
        build(args)
    else:
        print(json.dumps(summary(args.archive), indent=2))


if __name__ == "__main__":
    main()
