"""Benchmark: the gpuops.clean_slate.proxmox inventory vs community.proxmox's, on one simulated cluster.

Run with `make bench` (or `.venv/bin/python tools/bench/inventory.py`). One pvesim over HTTPS
serves a generated cluster (3 nodes x 300 guests by default, see pvesim.generate) with 20 ms of
latency on every request. Against it, in one run:

* community.proxmox's inventory plugin, from the PyPI ``ansible`` package installed into a
  throwaway virtual environment (cached under /tmp between runs), with ``want_facts: true`` -
  the only way it reads guest configs at all;
* ours with its defaults (every non-template guest's config is read);
* ours as the clean-slate job runs it, limited to running guests with ``filters`` (a stopped
  guest holds no GPU memory; its config is not read).

Each is one ``ansible-inventory --list`` (interpreter start-up included). The table gives the
requests the simulator counted, the wall time, the GPU guests each found (guests in a GPU group
with their GPU recognised) against the generator's ground truth, and the ratios to community's.
``--write-docs`` replaces the section "Inventory: gpuops.clean_slate.proxmox vs community.proxmox"
of docs/benchmarks.md with the figures and leaves the rest of the file alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pvesim import PveSim
from pvesim.generate import benchmark_cluster, gpu_guests
from support.ansible import VENV, ansible_env, plain, write_docs_section

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


ANSIBLE_PACKAGE = "ansible==14.5.0"
COMMUNITY_VENV = Path(tempfile.gettempdir()) / "gpuops-bench" / "community-ansible-14.5.0"
DOCS = ROOT / "docs" / "benchmarks.md"
SECTION = "## Inventory: gpuops.clean_slate.proxmox vs community.proxmox"


def community_venv() -> Path:
    """A throwaway venv with the PyPI ansible package (community.proxmox inside), requests and proxmoxer."""
    bindir = COMMUNITY_VENV / "bin"
    stamp = COMMUNITY_VENV / ".installed"
    if stamp.exists():
        return bindir
    base = getattr(sys, "_base_executable", sys.executable)
    print(f"installing {ANSIBLE_PACKAGE} into {COMMUNITY_VENV} (once)...", flush=True)
    subprocess.run([base, "-m", "venv", "--clear", str(COMMUNITY_VENV)], check=True)
    subprocess.run([str(bindir / "python"), "-m", "pip", "install", "-q", ANSIBLE_PACKAGE, "requests", "proxmoxer==2.3.0"], check=True)
    stamp.write_text(ANSIBLE_PACKAGE + "\n")
    return bindir


def community_version(bindir: Path) -> str:
    code = (
        "import json, pathlib, ansible_collections.community.proxmox as m; "
        "print(json.load(open(pathlib.Path(m.__path__[0]) / 'MANIFEST.json'))['collection_info']['version'])"
    )
    return subprocess.run([str(bindir / "python"), "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def run_inventory(sim: PveSim, argv: list[str], env: dict[str, str], cwd: Path) -> tuple[dict, float, int]:
    sim.reset_counter()
    start = time.monotonic()
    proc = subprocess.run(argv, env=env, cwd=str(cwd), capture_output=True, text=True, timeout=3600, check=False)
    wall = time.monotonic() - start
    if proc.returncode != 0 or not proc.stdout.strip().startswith("{"):
        raise SystemExit(f"{' '.join(argv)} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return plain(json.loads(proc.stdout)), wall, sim.request_count


def gpu_found(inv: dict, truth: set[int]) -> tuple[int, int]:
    """(GPU guests found, false positives): hosts in a GPU group whose vmid is (or is not) a GPU guest."""
    hostvars = inv.get("_meta", {}).get("hostvars", {})
    hosts = set(inv.get("gpu_nodes", {}).get("hosts", []))
    vmids = {hostvars[h].get("proxmox_vmid") for h in hosts if hostvars.get(h, {}).get("proxmox_type") in ("lxc", "qemu")}
    vmids.discard(None)
    return len(vmids & truth), len(vmids - truth)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--guests", type=int, default=300, help="guests per node")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--write-docs", action="store_true", help=f"write the figures into {DOCS.relative_to(ROOT)}")
    args = ap.parse_args()

    desc = benchmark_cluster(nodes=args.nodes, guests_per_node=args.guests)
    truth = gpu_guests(desc)
    running = {g["vmid"] for g in desc["guests"] if g.get("status", "running") == "running"}
    truth_running = truth & running
    bindir = community_venv()
    version = community_version(bindir)

    with tempfile.TemporaryDirectory(prefix="gpuops-bench-inv-") as tmp, PveSim(desc, tls=True, latency_ms=args.latency_ms) as sim:
        work = Path(tmp)
        token_id, secret = sim.token
        user, token_name = token_id.split("!")
        (work / "community.proxmox.yml").write_text(
            json.dumps(
                {
                    "plugin": "community.proxmox.proxmox",
                    "url": sim.url,
                    "user": user,
                    "token_id": token_name,
                    "token_secret": secret,
                    "validate_certs": True,
                    "want_facts": True,
                }
            )
        )
        (work / "ours.proxmox.yml").write_text(json.dumps({"plugin": "gpuops.clean_slate.proxmox"}))
        (work / "job.proxmox.yml").write_text(json.dumps({"plugin": "gpuops.clean_slate.proxmox", "filters": ["proxmox_status == 'running'"]}))
        (work / "ansible.cfg").write_text("[defaults]\n")

        # community: its own venv, its own (empty) config, requests trusting the simulator's CA.
        cenv = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
        cenv.update(ANSIBLE_CONFIG=str(work / "ansible.cfg"), REQUESTS_CA_BUNDLE=str(sim.ca_path), PATH=f"{bindir}:{os.environ['PATH']}")
        cenv.pop("CURL_CA_BUNDLE", None)
        ours_env = ansible_env({"PROXMOX_URL": sim.url, "PROXMOX_TOKEN_ID": token_id, "PROXMOX_TOKEN_SECRET": secret, "PROXMOX_CA_PATH": str(sim.ca_path)})

        rows = []
        print(f"community.proxmox {version} (from {ANSIBLE_PACKAGE}), want_facts: true ...", flush=True)
        inv, wall, requests = run_inventory(sim, [str(bindir / "ansible-inventory"), "-i", "community.proxmox.yml", "--list"], cenv, work)
        found, wrong = gpu_found(inv, truth)
        hosts = len(inv.get("_meta", {}).get("hostvars", {}))
        rows.append(
            {
                "name": f"community.proxmox {version}, want_facts: true",
                "requests": requests,
                "wall": wall,
                "found": found,
                "wrong": wrong,
                "of": len(truth),
                "hosts": hosts,
            }
        )
        for name, source, want in (
            ("gpuops.clean_slate.proxmox, defaults", "ours.proxmox.yml", truth),
            ("gpuops.clean_slate.proxmox, running guests (the job's filter)", "job.proxmox.yml", truth_running),
        ):
            print(f"{name} ...", flush=True)
            inv, wall, requests = run_inventory(sim, [str(VENV / "bin" / "ansible-inventory"), "-i", str(work / source), "--list"], ours_env, ROOT)
            found, wrong = gpu_found(inv, want)
            hosts = len(inv.get("_meta", {}).get("hostvars", {}))
            rows.append({"name": name, "requests": requests, "wall": wall, "found": found, "wrong": wrong, "of": len(want), "hosts": hosts})

    base = rows[0]
    lines = [
        "| Inventory | Requests | Wall (s) | GPU guests found | Inventory hosts | Fewer requests | Faster |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio_req = "-" if r is base else f"{base['requests'] / r['requests']:.1f}x"
        ratio_wall = "-" if r is base else f"{base['wall'] / r['wall']:.1f}x"
        found = f"{r['found']} of {r['of']}" + (f" (+{r['wrong']} wrong)" if r["wrong"] else "")
        lines.append(f"| {r['name']} | {r['requests']} | {r['wall']:.1f} | {found} | {r['hosts']} | {ratio_req} | {ratio_wall} |")
    table = "\n".join(lines)
    print()
    print(table)

    guests = args.nodes * args.guests
    n_running = len(running & {g["vmid"] for g in desc["guests"] if not g.get("template")})
    command = ".venv/bin/python tools/bench/inventory.py" + (" --write-docs" if args.write_docs else "")
    if (args.nodes, args.guests, args.latency_ms) != (3, 300, 20.0):
        command += f" --nodes {args.nodes} --guests {args.guests} --latency-ms {args.latency_ms:g}"
    if args.write_docs:
        write_docs(table, rows, version, guests, len(truth), len(truth_running), n_running, args.latency_ms, command)
        print(f"\nwrote {DOCS.relative_to(ROOT)}")
    return 0


def write_docs(table: str, rows: list[dict], version: str, guests: int, n_gpu: int, n_gpu_running: int, n_running: int, latency: float, command: str) -> None:
    ours, job = rows[1], rows[2]
    base = rows[0]
    section = f"""{SECTION}

Measured {time.strftime("%Y-%m-%d")} on {platform.node() or "the build machine"} ({os.cpu_count()} cores, Python {platform.python_version()}), with

    {command}

The simulator (`tests/sim/pvesim`, HTTPS) serves a generated cluster of {guests} guests on 3 nodes
(two thirds LXC, one third QEMU; {n_running} running; {n_gpu} use a GPU through every passthrough
variant, {n_gpu_running} of them running; some VMs pass a NIC through) and adds {latency:g} ms to every
request. Each row is one `ansible-inventory --list`, interpreter start-up included; requests are
the simulator's own count. community.proxmox {version} comes from the PyPI `{ANSIBLE_PACKAGE}` package,
installed by the benchmark into a throwaway virtual environment, with `want_facts: true` (without it
it reads no configs at all). "GPU guests found" counts guests in `gpu_nodes` with their GPU
recognised, against the generator's ground truth (all GPU guests for the defaults, the running ones
for the job's filter).

{table}

- community.proxmox reads status, config and snapshots of every guest, plus interfaces of every
  running container and the agent of every VM with `agent` set, one request after another. It has
  no notion of GPUs, folds the repeated `lxc.*` keys into one value each and merges guests that
  share a name into one host ({base["hosts"]} hosts for {guests} guests and 3 nodes).
- Ours makes 2 discovery requests, then one config read per selected guest, 8 at a time, plus
  `/interfaces` of running GPU containers and `/hardware/pci` of nodes with `hostpciN` VMs
  ({ours["requests"]} requests with the defaults, {job["requests"]} for the job, which skips the
  configs of stopped guests because they hold no GPU memory).
- Goal: at least 5x fewer requests and 5x faster with every GPU guest found. The job's
  configuration reaches {base["requests"] / job["requests"]:.1f}x fewer requests and {base["wall"] / job["wall"]:.1f}x less
  time and finds every running GPU guest; the defaults, which read every guest's config, reach
  {base["requests"] / ours["requests"]:.1f}x and {base["wall"] / ours["wall"]:.1f}x and find every GPU guest, stopped ones included.
  The request ratio is bounded by the API: community spends 3-5 requests per guest, ours one per
  guest whose config it reads, so below 5x unless a filter leaves some guests out.
"""
    write_docs_section(DOCS, SECTION, section)


if __name__ == "__main__":
    sys.exit(main())
