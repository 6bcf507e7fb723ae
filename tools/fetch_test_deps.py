"""Test-only downloads for the lab, made once by `make setup` so that no test needs the network.

* ``.build/collections/ansible_collections/community/proxmox``: the collection community.proxmox (for its
  ``proxmox_pct_remote`` connection), taken from the PyPI ``ansible`` package (no Galaxy tarball of it is on
  PyPI). Only that collection is extracted from the wheel; the lab puts ``.build/collections`` on
  ANSIBLE_COLLECTIONS_PATH.
* ``.build/wheels``: wheels of the modules' dependencies (the versions tests/requirements.txt pins) for the
  lab hypervisors' Python, this machine's system ``/usr/bin/python3`` (Debian 12: 3.11), and architecture:
  the lab installs them with ``clean_slate_wheels_dir`` (its hosts reach nothing but the controller) and
  serves them as a package index for the index path.

Usage: ``.venv/bin/python tools/fetch_test_deps.py`` (the Makefile runs it with the venv's Python).
Idempotent: a stamp records what was fetched; a changed pin or version fetches again.
"""

from __future__ import annotations

import json
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / ".build"
COLLECTIONS = BUILD / "collections"
WHEELS = BUILD / "wheels"
STAMP = BUILD / "test-deps.json"
# community.proxmox 2.0.0 (docs/proxmox.md): it needs ansible-core >= 2.17, and our controller runs 2.21.
ANSIBLE_PACKAGE = "ansible==14.5.0"
COLLECTION = "ansible_collections/community/proxmox/"
TARGET_PYTHON = "/usr/bin/python3"
PACKAGES = ("nvidia-ml-py", "psutil", "jmespath")


def pins() -> list[str]:
    wanted = []
    for line in (ROOT / "tests" / "requirements.txt").read_text().splitlines():
        spec = line.split(";")[0].strip()
        if re.match(rf"^({'|'.join(PACKAGES)})==", spec):
            wanted.append(spec)
    if len(wanted) != len(PACKAGES):
        raise SystemExit(f"fetch-test-deps: tests/requirements.txt must pin {', '.join(PACKAGES)}, found {wanted}")
    return wanted


def target_version() -> str:
    out = subprocess.run([TARGET_PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"fetch-test-deps: {TARGET_PYTHON} does not run: {out.stderr.strip()}")
    return out.stdout.strip()


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", *args], check=True)


def fetch_collection() -> str:
    with tempfile.TemporaryDirectory(prefix="gpuops-fetch-") as tmp:
        pip("--no-deps", "--only-binary=:all:", "-d", tmp, ANSIBLE_PACKAGE)
        wheel = next(Path(tmp).glob("ansible-*.whl"))
        dest = COLLECTIONS / COLLECTION
        shutil.rmtree(dest, ignore_errors=True)
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.startswith(COLLECTION)]
            if not members:
                raise SystemExit(f"fetch-test-deps: {wheel.name} has no {COLLECTION}")
            zf.extractall(COLLECTIONS, members)
    manifest = json.loads((dest / "MANIFEST.json").read_text())
    return str(manifest["collection_info"]["version"])


def fetch_wheels(version: str, specs: list[str]) -> list[str]:
    arch = platform.machine()
    shutil.rmtree(WHEELS, ignore_errors=True)
    WHEELS.mkdir(parents=True)
    platforms = [f"manylinux2014_{arch}", f"manylinux_2_17_{arch}", f"manylinux_2_28_{arch}", f"linux_{arch}"]
    platform_args = [a for p in platforms for a in ("--platform", p)]
    pip("--only-binary=:all:", "--python-version", version, "--implementation", "cp", *platform_args, "-d", str(WHEELS), *specs)
    return sorted(p.name for p in WHEELS.glob("*.whl"))


def main() -> int:
    specs = pins()
    version = target_version()
    want = {"ansible": ANSIBLE_PACKAGE, "python": version, "arch": platform.machine(), "pins": specs}
    if STAMP.exists():
        have = json.loads(STAMP.read_text())
        if {k: have.get(k) for k in want} == want and (COLLECTIONS / COLLECTION / "MANIFEST.json").exists() and have.get("wheels"):
            return 0
    BUILD.mkdir(exist_ok=True)
    print(f"fetch-test-deps: community.proxmox from {ANSIBLE_PACKAGE}, wheels of {', '.join(specs)} for Python {version}")
    collection = fetch_collection()
    wheels = fetch_wheels(version, specs)
    STAMP.write_text(json.dumps({**want, "community.proxmox": collection, "wheels": wheels}, indent=1) + "\n")
    print(f"fetch-test-deps: community.proxmox {collection} in {COLLECTIONS}; {len(wheels)} wheels in {WHEELS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
