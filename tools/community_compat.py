"""Compare community.proxmox's inventory groups with ours under ``compat_groups: true``, on one simulated cluster.

Usage: ``.venv/bin/python tools/community_compat.py`` (needs the package index once: community.proxmox comes
from the PyPI ``ansible`` package, installed into the throwaway venv the inventory benchmark uses and caches).

pvesim serves clusters/gpu3.yml (its duplicate guest names made unique, because community.proxmox merges
guests of the same name into one host). Both plugins read it through ``ansible-inventory --list``; for every
community.proxmox group name, the table shows the vmids each puts in it. It is a check of docs/proxmox.md's
group table against the real plugin, run by hand: the migration test in tests/functional checks the table
against our plugin on every run, and this checks the other column.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.inventory import community_venv, community_version
from pvesim import PveSim, load_cluster
from support.ansible import VENV, ansible_env, plain

ROOT = Path(__file__).resolve().parents[1]


def vmids(inv: dict, group: str) -> set:
    hostvars = inv["_meta"]["hostvars"]
    return {hostvars.get(h, {}).get("proxmox_vmid", h) for h in inv.get(group, {}).get("hosts", [])}


def main() -> int:
    desc = load_cluster("gpu3")
    for g in desc["guests"]:
        if g["vmid"] in (106, 204):
            g["name"] = f"train-a{g['vmid']}"
            g["conf"] = g["conf"].replace("hostname: train-a", f"hostname: train-a{g['vmid']}")
    bindir = community_venv()
    with tempfile.TemporaryDirectory(prefix="gpuops-compat-") as tmp, PveSim(desc) as sim:
        work = Path(tmp)
        token_id, secret = sim.token
        user, name = token_id.split("!")
        theirs_src = work / "community.proxmox.yml"
        theirs_src.write_text(json.dumps({"plugin": "community.proxmox.proxmox", "url": sim.url, "user": user, "token_id": name, "token_secret": secret}))
        ours_src = work / "ours.proxmox.yml"
        ours_src.write_text(json.dumps({"plugin": "gpuops.clean_slate.proxmox", "validate_certs": False, "compat_groups": True, "exclude_templates": False}))
        # requests would replace verify=False with a CA bundle from the environment (proxmox-facts.md section 8).
        env = {k: v for k, v in os.environ.items() if k not in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "ANSIBLE_COLLECTIONS_PATH", "ANSIBLE_CONFIG")}
        theirs_cmd = [str(bindir / "ansible-inventory"), "-i", str(theirs_src), "--list"]
        theirs = subprocess.run(theirs_cmd, env=env, cwd=tmp, capture_output=True, text=True, check=False)
        ours_cmd = [str(VENV / "bin" / "ansible-inventory"), "-i", str(ours_src), "--list"]
        ours = subprocess.run(ours_cmd, env=ansible_env(sim.env()), cwd=str(ROOT), capture_output=True, text=True, check=False)
    for proc in (theirs, ours):
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return 1
    ti, oi = plain(json.loads(theirs.stdout)), plain(json.loads(ours.stdout))
    compat = {g for g in oi if g.startswith(("proxmox_all_", "proxmox_pool_")) or g.endswith(("_lxc", "_qemu")) or g == "proxmox_nodes"}
    names = sorted({g for g in ti if g.startswith("proxmox_")} | compat)
    print(f"community.proxmox {community_version(bindir)} vs gpuops.clean_slate.proxmox (compat_groups: true, exclude_templates: false), cluster gpu3\n")
    print("| Group | Same members | Only community.proxmox | Only ours |")
    print("|---|---|---|---|")
    for group in names:
        a, b = vmids(ti, group), vmids(oi, group)
        print(f"| `{group}` | {'yes' if a == b else 'no'} | {sorted(a - b, key=str) or ''} | {sorted(b - a, key=str) or ''} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
