"""Create (once) and reuse the Python virtualenv of Sortie's tests.

Usage: python3 ensure_venv.py VENV_DIR REQUIREMENTS_TXT

Prints the venv's python executable on the last line of stdout. Tests run in parallel,
so creation happens under an exclusive flock on VENV_DIR + ".lock"; a marker file in the
venv records the sha256 of the requirements it was built from, and a venv without a
matching marker (a changed file, an interrupted install) is rebuilt. pip's output is
printed to stderr when it fails.
"""

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys

MARKER = ".sortie-requirements.sha256"
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    venv = os.path.abspath(sys.argv[1])
    requirements = os.path.abspath(sys.argv[2])
    with open(requirements, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    python = os.path.join(venv, "bin", "python")
    marker = os.path.join(venv, MARKER)
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    with open(venv + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _read(marker) != digest or not os.path.exists(python):
            shutil.rmtree(venv, ignore_errors=True)
            _run([sys.executable, "-m", "venv", venv], "python3 -m venv")
            # From the repository's root, as README runs it: a local path in the
            # requirements (the client package, `-e ./clients/python`) is relative to it.
            _run(
                [python, "-m", "pip", "install", "--disable-pip-version-check",
                 "-r", requirements],
                "pip install",
                cwd=ROOT,
            )
            with open(marker, "w") as f:
                f.write(digest)
    print(python)
    return 0


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _run(command: list, what: str, cwd=None) -> None:
    result = subprocess.run(command, capture_output=True, text=True, cwd=cwd)
    if result.returncode != 0:
        sys.stderr.write(f"{what} failed with exit code {result.returncode}\n")
        sys.stderr.write(result.stdout)
        sys.stderr.write(result.stderr)
        sys.exit(1)


if __name__ == "__main__":
    sys.exit(main())
