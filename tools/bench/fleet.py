"""Benchmark: the clean_slate playbook on a fleet of 24 lab hosts, beside Ansible's own floor, in one run.

Run with ``tools/pidns-run .venv/bin/python tools/bench/fleet.py`` (it re-executes itself there; root, as
``make lab``). It builds, with the lab's builder (tests/lab/builder.py, docs/lab.md), a fleet of 24 GPU hosts
that 2 cores can carry:

* 6 bare GPU servers (``gpu01``-``gpu06``: 2 simulated GPUs each, all their own, no guest; reached over SSH,
  cleaned locally; they join ``gpu_nodes`` through the inventory's ``scan_node_gpus``, from their PCI list);
* 6 Proxmox VE hypervisors (``pve1``-``pve6``: 4 GPUs each, GPU 0 their own);
* 12 real LXC containers, two on each hypervisor: ``ct<n>01`` with its own sshd and address (GPU 1, cleaned
  from inside, Python 3.9), ``ct<n>02`` without network (GPUs 2 and 3, cleaned from its node through pct,
  container scope; pct costs the real one's second per call).

Every host with a GPU job carries the lab's SGLang-like workload (docs/lab.md, "Workloads": renamed
schedulers, a forked child that kept a GPU, a vLLM worker that ignores SIGTERM, so each host waits its grace
period once). The nodes' modules run with the virtual environment the role made on the warm-up run (the
steady state of a fleet whose nodes have the dependencies: ``clean_slate_install_dependencies`` off, one
module execution per host).

In one run, each cell the median of ``--repeat`` cold runs (no SSH connection kept from an earlier run),
interleaved: the empty one-task playbook and the one-``ping``-task play (Ansible's floor, where the role's
module runs: tools/bench/role.py's yardstick() and floor()), and ``playbooks/clean_slate.yml``, each on one
host (``gpu01``) and on all 24 with ``--forks 8`` and ``--forks 24``. Controller CPU is everything the
``ansible-playbook`` process tree spent (its workers, the ssh clients and their ControlPersist masters), read
from a cpuacct cgroup of its own after the connections are closed; hosts CPU is the nodes' cgroups (sshd
sessions, modules, pct, the containers).

Then the SSH rows (24 hosts, forks 24): Ansible's defaults (no pipelining, ``-C -o ControlMaster=auto -o
ControlPersist=60s``) against the recommended configuration (docs/examples/*/ansible.cfg: pipelining,
ControlPersist, no compression), which every other row uses; with ``--mitogen`` the same under Mitogen's
``mitogen_linear`` strategy over SSH, the ping play and the playbook on the 24 hosts (Mitogen installed from PyPI
into .build/mitogen, never the venv);
with ``--runner`` the playbook through ansible-runner over the 24 hosts with one host left dirty (an
orphaned context the driver asks a reset for), reading its artifact back (every host's ``set_stats`` entry,
the failed ones counted).

Nothing here asserts a time. ``--write-docs`` replaces the section "Fleet: 24 lab hosts" of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.role import GRACE, floor, module_runs, yardstick
from support.ansible import VENV, VENV_PYTHON, AnsibleRun, write_docs_section

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DOCS = ROOT / "docs" / "benchmarks.md"
SECTION = "## Fleet: 24 lab hosts, the role beside Ansible's floor (issue 32)"
PLAYBOOK = ROOT / "playbooks" / "clean_slate.yml"
MITOGEN_DIR = ROOT / ".build" / "mitogen"
MITOGEN = "mitogen==0.3.54"
ONE = "gpu01"
LOAD = os.getloadavg()

#: Issue 32's goals (against the floor measured beside them).
GOAL_CPU_RATIO = 1.5
GOAL_WALL_RATIO = 3.0

#: SSH as the recommended ansible.cfg (docs/examples) sets it, and Ansible's own defaults.
RECOMMENDED_SSH = {"ANSIBLE_PIPELINING": "True", "ANSIBLE_SSH_ARGS": "-o ControlMaster=auto -o ControlPersist=60s"}
DEFAULT_SSH = {"ANSIBLE_PIPELINING": "False", "ANSIBLE_SSH_ARGS": "-C -o ControlMaster=auto -o ControlPersist=60s"}

NVIDIA_PCI = {"class": "0x030200", "vendor": "0x10de", "device": "0x2335", "vendor_name": "NVIDIA Corporation", "device_name": "GH100 [H200 SXM 141GB]"}


# ---------------------------------------------------------------------- the fleet
def container_conf(vmid: int, name: str, gpus: list[int], address: str | None) -> str:
    """A Proxmox VE configuration of an unprivileged GPU container (``devN`` passthrough)."""
    devices = [f"/dev/nvidia{g}" for g in gpus] + ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    lines = [f"#fleet container {name}", "arch: amd64", "cores: 8"]
    lines += [f"dev{i}: {d},gid=44" for i, d in enumerate(devices)]
    lines += [f"hostname: {name}", "memory: 65536"]
    if address:
        lines.append(f"net0: name=eth0,bridge=vmbr0,hwaddr=BC:24:11:77:{vmid // 100:02X}:{vmid % 100:02X},ip={address}/24,gw=10.77.0.1,type=veth")
    lines += ["ostype: ubuntu", f"rootfs: local-lvm:vm-{vmid}-disk-0,size=32G", "swap: 0", "tags: gpu;sglang", "unprivileged: 1", ""]
    return "\n".join(lines)


def fleet_cluster(bare: int = 6, hypervisors: int = 6) -> dict[str, Any]:
    """The fleet as the lab builder's cluster description (the format of tests/sim/pvesim/clusters/lab.yml)."""
    nodes: list[dict[str, Any]] = []
    guests: list[dict[str, Any]] = []
    for i in range(1, bare + 1):
        pci = [{"id": f"0000:{0x17 + 0x10 * g:02x}:00.0", "iommugroup": 17 + g, **NVIDIA_PCI} for g in range(2)]
        nodes.append({"name": f"gpu{i:02d}", "ip": f"10.77.0.{20 + i}", "pci": pci, "meta": {"gpus": 2, "own_gpus": [0, 1]}})
    for i in range(1, hypervisors + 1):
        nodes.append({"name": f"pve{i}", "ip": f"10.77.0.{40 + i}", "meta": {"gpus": 4, "own_gpus": [0]}})
        for n, (gpus, address) in enumerate((([1], f"10.77.0.{100 + i}"), ([2, 3], None)), start=1):
            vmid, name = 100 * i + n, f"ct{100 * i + n}"
            guests.append(
                {
                    "vmid": vmid,
                    "node": f"pve{i}",
                    "type": "lxc",
                    "name": name,
                    "tags": ["gpu", "sglang"],
                    "meta": {"gpus": gpus, "reach": "ssh" if address else "hypervisor", **({"address": address} if address else {})},
                    "conf_only": True,
                    "conf": container_conf(vmid, name, gpus, address),
                    "interfaces": [{"name": "lo", "hwaddr": "00:00:00:00:00:00", "inet": "127.0.0.1/8"}],
                }
            )
    return {"name": "gpuops-fleet", "pve_version": "8.2.4", "meta": {"subnet": "10.77.0.0/24", "controller": "10.77.0.1"}, "nodes": nodes, "guests": guests}


class Fleet:
    """The lab builder's Lab, built from fleet_cluster(), with what the benchmark measures around it."""

    def __init__(self, bare: int = 6, hypervisors: int = 6) -> None:
        from lab.builder import Lab, cgroup_bases, make_cgroup

        self.lab = Lab(fleet_cluster(bare, hypervisors))
        self._cgroup_bases, self._make_cgroup = cgroup_bases, make_cgroup
        self.inventory: Path | None = None
        self.ctl_cgroup: Path | None = None

    def build(self) -> Fleet:
        lab = self.lab
        lab.build()
        assert lab.inventory is not None
        # The same API source with scan_node_gpus: the bare servers join gpu_nodes from their PCI list.
        self.inventory = lab.inventory.parent / "fleet.proxmox.yml"
        self.inventory.write_text(lab.inventory.read_text() + "scan_node_gpus: true\n")
        lab.inventory.unlink()
        lab.inventory = self.inventory
        cpuacct = next(b for b in self._cgroup_bases() if (b / "cpuacct.usage").exists())
        self.ctl_cgroup = self._make_cgroup(cpuacct, f"{lab.run_name}/controller")
        return self

    @property
    def hosts(self) -> list[str]:
        return sorted(self.lab.hosts)

    def steady_state(self) -> Path:
        """The nodes as a fleet whose images have the modules' dependencies: one virtual environment, made as the
        role makes it (``python3 -m venv --system-site-packages`` with Debian's python3, the pinned wheels of
        .build/wheels), is every node's modules' Python, and the role installs nothing (one module execution per
        host; the lab's own tests take the role's install path). Returns the environment's Python."""
        from lab.builder import SYSTEM_PYTHON, WHEELS

        lab = self.lab
        assert self.inventory is not None and lab.workdir is not None
        venv = lab.workdir / "fleet-venv"
        subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--system-site-packages", str(venv)], check=True)
        wheels = ["nvidia-ml-py", "psutil", "jmespath"]
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--find-links", str(WHEELS)]
        subprocess.run([*pip, *wheels], check=True, env={"PATH": os.environ.get("PATH", ""), "PIP_CONFIG_FILE": os.devnull})
        for host in lab.hosts.values():
            if host.venv is None:
                continue
            path = self.inventory.parent / "host_vars" / f"{host.name}.yml"
            lines = [
                line
                for line in path.read_text().splitlines()
                if not line.startswith(("clean_slate_install_dependencies", "clean_slate_wheels_dir", "clean_slate_venv_dir"))
            ]
            if host.kind == "node":
                lines.append(f"ansible_python_interpreter: {venv}/bin/python")
            lines.append("clean_slate_install_dependencies: false")
            path.write_text("\n".join(lines) + "\n")
        return venv / "bin" / "python"

    # ------------------------------------------------------------------ measuring
    def cpu(self, cgroup: Path) -> float:
        return int((cgroup / "cpuacct.usage").read_text()) / 1e9

    def hosts_cpu(self) -> float:
        assert self.ctl_cgroup is not None
        return sum(self.cpu(self.ctl_cgroup.parent / h.name) for h in self.lab.nodes if (self.ctl_cgroup.parent / h.name / "cpuacct.usage").exists())

    def _runner(self, cmd: list[str], env: dict[str, str], cwd: str, timeout: float) -> subprocess.CompletedProcess[str]:
        procs = self.ctl_cgroup / "cgroup.procs"  # type: ignore[operator]

        def join() -> None:
            with open(procs, "w", encoding="ascii") as fh:
                fh.write(f"{os.getpid()}\n")

        return subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout, capture_output=True, text=True, check=False, preexec_fn=join)

    def run(self, playbook: Any, limit: str | None, forks: int, env: dict[str, str] | None = None, **kw: Any) -> tuple[AnsibleRun, float, float]:
        """One cold run: (the run, controller CPU, hosts CPU)."""
        assert self.ctl_cgroup is not None
        self.lab.close_connections()
        ctl, hosts = self.cpu(self.ctl_cgroup), self.hosts_cpu()
        run = self.lab.playbook(playbook, limit=limit or "all", forks=forks, env={**RECOMMENDED_SSH, **(env or {})}, runner=self._runner, **kw)
        # Closing the connections ends the ControlPersist masters (their CPU is the controller's) and the sessions.
        self.lab.close_connections()
        time.sleep(0.2)
        return run, self.cpu(self.ctl_cgroup) - ctl, self.hosts_cpu() - hosts

    def refill(self, names: list[str]) -> None:
        """A fresh workload on these hosts (whatever the last run left of theirs is ended first)."""
        lab = self.lab
        lab.end_workload([lab[name] for name in names])
        for name in names:
            lab.wait_free(lab[name])
        for name in names:
            lab.spawn_workload(lab[name])

    def clean(self, names: list[str]) -> bool:
        return all(not any(self.lab.used_mib(self.lab[n]).values()) for n in names)

    def teardown(self) -> None:
        self.lab.teardown()


# ---------------------------------------------------------------------- runs
def cell(fleet: Fleet, what: str, playbook: Any, limit: str | None, forks: int, env: dict[str, str] | None = None) -> dict[str, Any]:
    names = [limit] if limit else fleet.hosts
    role = not isinstance(playbook, list)  # the playbook (a path), not a yardstick play
    if role:
        fleet.refill(names)
    run, ctl, hosts = fleet.run(playbook, limit, forks, env=env, extra_vars={"clean_slate_grace_period": GRACE} if role else None)
    if run.rc != 0:
        raise RuntimeError(f"{what}: rc {run.rc}\n{run.output[-4000:]}")
    tasks = Counter(r["host"] for r in run.results if r["status"] != "skipped")
    return {
        "what": what,
        "hosts": len(run.stats.get("stats", {})),
        "forks": forks,
        "wall": run.elapsed,
        "ctl": ctl,
        "hosts_cpu": hosts,
        "clean": fleet.clean(names) if role else None,
        "modules": sorted(set(module_runs(run).values())) if role else None,
        "tasks": sorted(set(tasks.values())),
    }


def median_rows(samples: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for runs in samples.values():
        first = runs[0]
        rows.append(
            {
                **first,
                "wall": statistics.median(r["wall"] for r in runs),
                "ctl": statistics.median(r["ctl"] for r in runs),
                "hosts_cpu": statistics.median(r["hosts_cpu"] for r in runs),
                "clean": None if first["clean"] is None else all(r["clean"] for r in runs),
                "walls": [r["wall"] for r in runs],
                "ctls": [r["ctl"] for r in runs],
            }
        )
    return rows


def baseline_env(root: Path) -> dict[str, str]:
    """A --baseline checkout's collection (and this checkout's test collections: community.proxmox)."""
    from lab.builder import TEST_COLLECTIONS

    return {"ANSIBLE_COLLECTIONS_PATH": f"{root}:{TEST_COLLECTIONS}"}


def short(root: Path) -> str:
    done = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%h"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or root.name


def measure(
    fleet: Fleet, repeat: int, forks: list[int], ssh: bool, mitogen: Path | None, baselines: list[Path], only: list[str] | None = None
) -> list[dict[str, Any]]:
    n = len(fleet.hosts)
    plays = {"empty play": yardstick(), "ping play": floor(), "playbook": PLAYBOOK}
    plan: list[tuple[str, Any, str | None, int, dict[str, str] | None]] = []
    for label, pb in plays.items():
        plan.append((f"{label}, 1 host", pb, ONE, max(forks), None))
        for f in forks:
            plan.append((f"{label}, {n} hosts, forks {f}", pb, None, f, None))
    for root in baselines:
        label, before = f"playbook before: {short(root)}", root / "playbooks" / "clean_slate.yml"
        plan.append((f"{label}, 1 host", before, ONE, max(forks), baseline_env(root)))
        for f in forks:
            plan.append((f"{label}, {n} hosts, forks {f}", before, None, f, baseline_env(root)))
    if ssh:
        for label in ("ping play", "playbook"):
            plan.append((f"{label}, {n} hosts, forks {max(forks)}, Ansible's SSH defaults (no pipelining, -C)", plays[label], None, max(forks), DEFAULT_SSH))
    if mitogen is not None:
        # Mitogen starts its own Python on each host over the SSH connection; 24 of them at once on 2 shared cores take
        # longer than the lab's 10 s connection timeout (measured: three containers timed out), so its rows allow 60 s.
        menv = {
            "ANSIBLE_STRATEGY_PLUGINS": str(mitogen / "ansible_mitogen" / "plugins" / "strategy"),
            "ANSIBLE_STRATEGY": "mitogen_linear",
            "ANSIBLE_TIMEOUT": "60",
        }
        for label in ("ping play", "playbook"):
            plan.append((f"{label}, {n} hosts, forks {max(forks)}, Mitogen (mitogen_linear)", plays[label], None, max(forks), menv))
    if only:
        plan = [p for p in plan if any(word in p[0] for word in only)]
    samples: dict[str, list[dict[str, Any]]] = {p[0]: [] for p in plan}
    for i in range(repeat):
        for what, pb, limit, f, env in plan:
            try:
                samples[what].append(cell(fleet, what, pb, limit, f, env))
            except RuntimeError as exc:
                print(f"repeat {i + 1}: {str(exc)[:3000]}", file=sys.stderr)
                samples[what].append(
                    {
                        "what": what,
                        "hosts": 0,
                        "forks": f,
                        "wall": float("nan"),
                        "ctl": float("nan"),
                        "hosts_cpu": float("nan"),
                        "clean": False,
                        "modules": None,
                        "tasks": [],
                        "failed": True,
                    }
                )
            print(f"repeat {i + 1}: {what}: {samples[what][-1]['wall']:.2f} s, controller CPU {samples[what][-1]['ctl']:.2f} s", flush=True)
    return median_rows(samples)


# ---------------------------------------------------------------------- ansible-runner
def runner_row(fleet: Fleet, forks: int) -> dict[str, Any]:
    """ansible-runner over the fleet with one host left dirty (a leaked context the driver asks a GPU reset for):
    the artifact must hold every host and count the failed one."""
    lab = fleet.lab
    assert fleet.inventory is not None
    fleet.refill(fleet.hosts)
    dirty = lab[ONE]
    dirty.gpu_sim.set_fault(orphan={1: 4096}, recovery_action={1: 1})
    with tempfile.TemporaryDirectory(prefix="gpuops-fleet-runner-") as tmp:
        pdd = Path(tmp)
        (pdd / "project").mkdir()
        (pdd / "env").mkdir()
        (pdd / "project" / "clean_slate.yml").write_text("---\n- name: Clean slate\n  ansible.builtin.import_playbook: gpuops.clean_slate.clean_slate\n")
        (pdd / "inventory").symlink_to(fleet.inventory.parent)
        env = {**lab.env(), **RECOMMENDED_SSH, "ANSIBLE_FORKS": str(forks), "PATH": f"{VENV / 'bin'}:{os.environ.get('PATH', '')}"}
        (pdd / "env" / "envvars").write_text(json.dumps(env))
        (pdd / "env" / "extravars").write_text(json.dumps({"clean_slate_grace_period": str(GRACE)}))
        run_env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
        run_env["PATH"] = env["PATH"]
        lab.close_connections()
        ctl = fleet.cpu(fleet.ctl_cgroup)  # type: ignore[arg-type]
        started = time.monotonic()
        cmd = [str(VENV / "bin" / "ansible-runner"), "run", str(pdd), "-p", "clean_slate.yml", "--ident", "fleet"]
        fleet._runner(cmd, env=run_env, cwd=str(ROOT), timeout=900)
        wall = time.monotonic() - started
        lab.close_connections()
        ctl = fleet.cpu(fleet.ctl_cgroup) - ctl  # type: ignore[arg-type]
        art = pdd / "artifacts" / "fleet"
        events = [json.loads(p.read_text()) for p in (art / "job_events").glob("*.json")]
        stats = next(e for e in events if e.get("event") == "playbook_on_stats")["event_data"]
        published = stats.get("artifact_data", {}).get("clean_slate", {})
        failures = {h for h, n in (stats.get("failures") or {}).items() if n}
        red = sorted(h for h, v in published.items() if not v.get("clean"))
        row = {
            "what": f"ansible-runner, {len(fleet.hosts)} hosts, forks {forks}, {ONE} left dirty",
            "hosts": len(published),
            "forks": forks,
            "wall": wall,
            "ctl": ctl,
            "status": (art / "status").read_text().strip(),
            "rc": int((art / "rc").read_text()),
            "published": len(published),
            "failed": sorted(failures),
            "red": red,
        }
    dirty.gpu_sim.clear_faults()
    return row


# ---------------------------------------------------------------------- Mitogen
def mitogen_dir() -> Path:
    """Mitogen from PyPI into .build/mitogen (pip --target), never into the venv."""
    if not (MITOGEN_DIR / "ansible_mitogen").exists():
        subprocess.run([VENV_PYTHON, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target", str(MITOGEN_DIR), MITOGEN], check=True)
    return MITOGEN_DIR


# ---------------------------------------------------------------------- report
def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| Run | Hosts | Forks | Wall (s) | Controller CPU (s) | Hosts CPU (s) | Clean | gpuops module runs per host | Tasks run per host |",
        "|---|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        clean = "-" if r.get("clean") is None else "yes" if r["clean"] else "NO"
        mods = "-" if r.get("modules") is None else ", ".join(map(str, r["modules"]))
        out.append(
            f"| {r['what']} | {r['hosts']} | {r['forks']} | {r['wall']:.2f} | {r['ctl']:.2f} | {r['hosts_cpu']:.1f} | {clean} | {mods}"
            f" | {', '.join(map(str, r['tasks'])) or '-'} |"
        )
    return "\n".join(out)


def summary(rows: list[dict[str, Any]], forks: list[int], n: int, baselines: list[str]) -> list[str]:
    by = {r["what"]: r for r in rows}
    lines = []
    for name in baselines:
        for f in forks:
            before = {k: by[f"playbook before: {name}, {k}"] for k in ("1 host", f"{n} hosts, forks {f}")}
            after = {k: by[f"playbook, {k}"] for k in before}
            per_before = (before[f"{n} hosts, forks {f}"]["ctl"] - before["1 host"]["ctl"]) / (n - 1)
            per_after = (after[f"{n} hosts, forks {f}"]["ctl"] - after["1 host"]["ctl"]) / (n - 1)
            lines.append(
                f"forks {f}, before ({name}) -> after: controller CPU per extra host {per_before:.3f} -> {per_after:.3f} s; {n} hosts"
                f" {before[f'{n} hosts, forks {f}']['wall']:.2f} -> {after[f'{n} hosts, forks {f}']['wall']:.2f} s, 1 host"
                f" {before['1 host']['wall']:.2f} -> {after['1 host']['wall']:.2f} s; tasks run per host"
                f" {', '.join(map(str, before['1 host']['tasks']))} -> {', '.join(map(str, after['1 host']['tasks']))}"
            )
    for f in forks:
        get = {label: (by[f"{label}, 1 host"], by[f"{label}, {n} hosts, forks {f}"]) for label in ("empty play", "ping play", "playbook")}
        per = {label: (many["ctl"] - one["ctl"]) / (n - 1) for label, (one, many) in get.items()}
        ratio = {label: many["wall"] / one["wall"] for label, (one, many) in get.items()}
        ping_module = per["ping play"] - per["empty play"]
        lines.append(
            f"forks {f}: controller CPU per extra host: playbook {per['playbook']:.3f} s, ping play {per['ping play']:.3f} s, empty play"
            f" {per['empty play']:.3f} s; playbook / ping play {per['playbook'] / per['ping play']:.2f}x (goal <= {GOAL_CPU_RATIO}x:"
            f" {'met' if per['playbook'] <= GOAL_CPU_RATIO * per['ping play'] else 'missed'}); the role's tasks beyond the empty play per host"
            f" {per['playbook'] - per['empty play']:.3f} s against one ping task's {ping_module:.3f} s"
        )
        lines.append(
            f"forks {f}: {n} hosts / 1 host wall: playbook {get['playbook'][1]['wall']:.2f} / {get['playbook'][0]['wall']:.2f} s = {ratio['playbook']:.2f}x"
            f" (goal <= {GOAL_WALL_RATIO:g}x: {'met' if ratio['playbook'] <= GOAL_WALL_RATIO else 'missed'}); ping play {ratio['ping play']:.2f}x;"
            f" empty play {ratio['empty play']:.2f}x"
        )
    return lines


def write_docs(rows: list[dict[str, Any]], lines: list[str], runner: dict[str, Any] | None, args: argparse.Namespace) -> None:
    flags = "".join(
        [
            f" --repeat {args.repeat}",
            *(f" --baseline {b}" for b in args.baseline),
            " --no-ssh" if args.no_ssh else "",
            " --mitogen" if args.mitogen else "",
            " --runner" if args.runner else "",
        ]
    )
    runner_text = ""
    if runner is not None:
        runner_text = (
            f"\nansible-runner over the fleet ({runner['what']}): {runner['wall']:.2f} s, controller CPU {runner['ctl']:.2f} s; status"
            f" {runner['status']}, rc {runner['rc']}; the artifact's set_stats holds {runner['published']} hosts, red: {', '.join(runner['red']) or 'none'};"
            f" failed hosts counted in the stats: {len(runner['failed'])} ({', '.join(runner['failed'])}).\n"
        )
    section = f"""{SECTION}

Measured {time.strftime("%Y-%m-%d %H:%M")} on {platform.node() or "the build machine"} ({os.cpu_count()} cores, Python {platform.python_version()};
load average {LOAD[0]:.1f} when the run started and {os.getloadavg()[0]:.1f} when it ended), with

    tools/pidns-run .venv/bin/python tools/bench/fleet.py{flags} --write-docs

The fleet (tools/bench/fleet.py, built with the lab's builder): 6 bare GPU servers (2 GPUs each), 6 Proxmox VE
hypervisors (4 GPUs, one their own) and 12 real LXC containers (one per hypervisor with its own sshd, one cleaned
from its node through pct), each with an SGLang-like job and a worker that ignores SIGTERM; 24 hosts over SSH,
cold runs, the recommended SSH settings unless the row says otherwise. Medians of {args.repeat} runs, interleaved.
Controller CPU is the whole ansible-playbook tree (ssh clients and ControlPersist masters included).

{table(rows)}

{chr(10).join(f"- {line}" for line in lines)}
{runner_text}"""
    write_docs_section(DOCS, SECTION, section)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell (median reported)")
    parser.add_argument("--forks", default="8,24", help="forks for the 24-host rows (comma-separated)")
    parser.add_argument("--no-ssh", action="store_true", help="leave out the rows with Ansible's SSH defaults")
    parser.add_argument("--mitogen", action="store_true", help="add rows under Mitogen's mitogen_linear strategy (installs it into .build/mitogen)")
    parser.add_argument("--runner", action="store_true", help="add the ansible-runner run over the fleet with one dirty host")
    parser.add_argument("--bare", type=int, default=6, help="bare GPU servers")
    parser.add_argument("--hypervisors", type=int, default=6, help="hypervisors, each with two containers")
    parser.add_argument("--baseline", type=Path, action="append", default=[], help="a checkout whose playbook to measure beside this one's (repeatable)")
    parser.add_argument("--only", action="append", help="run only the rows whose name contains this (repeatable; no summary, no docs)")
    parser.add_argument("--write-docs", action="store_true", help=f"write the figures into {DOCS.relative_to(ROOT)}")
    args = parser.parse_args()
    forks = [int(f) for f in args.forks.split(",")]
    mitogen = mitogen_dir() if args.mitogen else None
    fleet = Fleet(args.bare, args.hypervisors)
    try:
        started = time.monotonic()
        fleet.build()
        print(f"built {len(fleet.hosts)} hosts in {time.monotonic() - started:.1f} s", flush=True)
        fleet.steady_state()
        warm = fleet.lab.playbook(limit="all", forks=max(forks), extra_vars={"clean_slate_grace_period": GRACE}, env=RECOMMENDED_SSH)
        if warm.rc != 0:
            raise RuntimeError(f"warm-up run failed:\n{warm.output[-6000:]}")
        print(f"warm-up run in {warm.elapsed:.1f} s", flush=True)
        rows = measure(fleet, args.repeat, forks, not args.no_ssh, mitogen, args.baseline, args.only)
        runner = runner_row(fleet, max(forks)) if args.runner else None
    finally:
        fleet.teardown()
    n = args.bare + 3 * args.hypervisors
    lines = [] if args.only else summary(rows, forks, n, [short(b) for b in args.baseline])
    print(table(rows))
    print("\n".join(lines))
    if runner is not None:
        print(json.dumps(runner))
    if args.write_docs and not args.only:
        write_docs(rows, lines, runner, args)
    return 0


if __name__ == "__main__":
    if not os.environ.get("GPUOPS_PIDNS"):
        tool = str(HERE.parent / "pidns-run")
        os.execvp(tool, [tool, VENV_PYTHON, __file__, *sys.argv[1:]])
    sys.exit(main())
