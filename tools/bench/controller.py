"""Profile the clean_slate playbook's controller: where each task's time and CPU go, per host.

Run with ``tools/pidns-run .venv/bin/python tools/bench/controller.py`` (the simulated 8 x H200 node, connection
local) or ``... controller.py --fleet`` (the 24 hosts of tools/bench/fleet.py, over SSH). It runs the playbook once
with ``ansible-playbook`` started through this file's launcher (``--launch``), which:

* times every worker process Ansible forks (one per task and host): its own CPU (``time.process_time``, without
  the children it starts: ssh, or the module under the local connection) and its wall time, with the task, the
  host and the action, into ``workers.jsonl``;
* with ``--cprofile``, profiles each worker and the main process with cProfile (``*.prof`` files; the main
  process's profile shows the strategy: variables per host and task, forks, results and callbacks);
* records the main process's own CPU at exit (``main.json``);

and writes each task's wall time with the benchmark callback (tools/bench/callback/tasktime.py). It then prints,
per task, the workers' CPU summed over the hosts and per host, and the main process's CPU; and the AnsiballZ
payload of ``clean_slate_node`` against ``ping``'s (bytes, files, module_utils lines) with the time the target's
Python takes to import each (``python -X importtime`` of the exploded payload). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import base64
import cProfile
import io
import json
import os
import pstats
import resource
import runpy
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


# ---------------------------------------------------------------------- the launcher (inside ansible-playbook)
def launch(argv: list[str]) -> None:
    """Run the ansible-playbook script ``argv[0]`` with its workers timed (and profiled with GPUOPS_PROFILE_CPROFILE)."""
    out = Path(os.environ["GPUOPS_PROFILE_DIR"])
    profile = os.environ.get("GPUOPS_PROFILE_CPROFILE") == "1"
    main_prof = cProfile.Profile() if profile else None
    from ansible.executor.process import worker
    from jinja2 import environment as jinja_env

    original = worker.WorkerProcess._run
    # Every template Ansible compiles (Jinja's Environment.compile: parse, code generation, Python's compile): its
    # CPU, counted per worker. A forked worker starts with nothing compiled, so each task pays for its templates anew.
    compiled = {"n": 0, "cpu": 0.0, "payload_cpu": 0.0}
    jinja_compile = jinja_env.Environment.compile

    def counted_compile(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.process_time()
        try:
            return jinja_compile(self, *args, **kwargs)
        finally:
            compiled["n"] += 1
            compiled["cpu"] += time.process_time() - started
            if os.environ.get("GPUOPS_PROFILE_TEMPLATES"):
                with open(out / f"templates-{os.getpid()}.txt", "a", encoding="utf-8") as fh:
                    fh.write(f"{time.process_time() - started:.5f} {' '.join(str(args[0] if args else '').split())[:200]}\n")

    jinja_env.Environment.compile = counted_compile  # type: ignore[method-assign]

    def _run(self: Any) -> Any:
        if main_prof is not None:
            main_prof.disable()  # inherited through the fork: the worker's own profile replaces it
        prof = cProfile.Profile() if profile else None
        compiled.update(n=0, cpu=0.0, payload_cpu=0.0)
        cpu, wall = time.process_time(), time.perf_counter()
        if prof is not None:
            prof.enable()
        try:
            return original(self)
        finally:
            if prof is not None:
                prof.disable()
            record = {
                "task": self._task.get_name(),
                "action": self._task.action,
                "host": self._host.name,
                "cpu": time.process_time() - cpu,
                "wall": time.perf_counter() - wall,
                "templates": compiled["n"],
                "template_cpu": compiled["cpu"],
                "payload_cpu": compiled["payload_cpu"],
            }
            with open(out / "workers.jsonl", "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")
            if prof is not None:
                prof.dump_stats(str(out / f"worker-{os.getpid()}.prof"))
                with open(out / "worker-profiles.jsonl", "a", encoding="utf-8") as fh:
                    fh.write(json.dumps({"pid": os.getpid(), **record}) + "\n")

    worker.WorkerProcess._run = _run

    from ansible.plugins import action

    build = action.modify_module

    def modify_module(**kw: Any) -> Any:
        """Keep the first payload built for each module, as it goes to the host; count the CPU of building it."""
        started = time.process_time()
        built = build(**kw)
        compiled["payload_cpu"] += time.process_time() - started
        dest = out / f"payload-{kw['module_name']}.py"
        if not dest.exists():
            dest.write_bytes(built.b_module_data)
        return built

    action.modify_module = modify_module
    sys.argv = argv
    if main_prof is not None:
        main_prof.enable()
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        if main_prof is not None:
            main_prof.disable()
            main_prof.dump_stats(str(out / "main.prof"))
        usage = resource.getrusage(resource.RUSAGE_SELF)
        (out / "main.json").write_text(json.dumps({"cpu": usage.ru_utime + usage.ru_stime}))


# ---------------------------------------------------------------------- runs
def env_for(out: Path, cprofile: bool) -> dict[str, str]:
    return {
        "GPUOPS_PROFILE_DIR": str(out),
        "GPUOPS_PROFILE_CPROFILE": "1" if cprofile else "0",
        "GPUOPS_TASKTIME": str(out / "tasktime.txt"),
        "ANSIBLE_CALLBACK_PLUGINS": f"{HERE / 'callback'}:{ROOT / 'tests' / 'support' / 'callback'}",
    }


def wrapper() -> list[str]:
    from support.ansible import VENV_PYTHON

    return [VENV_PYTHON, str(Path(__file__).resolve()), "--launch"]


def local_run(out: Path, cprofile: bool, playbook: Path, root: Path) -> float:
    from bench.kill_verify import build
    from bench.role import GRACE
    from gpusim import Node
    from support.ansible import local_inventory, run_playbook

    with Node(gpus=8) as node, tempfile.TemporaryDirectory(prefix="gpuops-profile-") as tmp:
        sb = node.sandbox()
        build(node, sb, "plain")
        inventory = local_inventory(
            Path(tmp) / "inventory.yml",
            {"gpu-node-1": {"clean_slate_device_dir": str(node.dev_dir), "clean_slate_expected_gpus": 8, "clean_slate_grace_period": GRACE}},
        )
        env = node.env()
        env["PATH"] = f"{node.bin_dir}:{os.environ.get('PATH', '')}"
        env.update(ANSIBLE_CONFIG=str(root / "ansible.cfg"), ANSIBLE_COLLECTIONS_PATH=str(root), **env_for(out, cprofile))
        run = run_playbook(playbook, inventory=inventory, env=env, wrapper=[*sb.nsenter_prefix(), *wrapper()])
        sb.stop()
        if run.rc != 0:
            raise RuntimeError(run.output[-4000:])
        return run.elapsed


def fleet_run(out: Path, cprofile: bool, playbook: Path, forks: int) -> tuple[float, float]:
    from bench.fleet import GRACE, RECOMMENDED_SSH, Fleet

    fleet = Fleet()
    try:
        fleet.build()
        fleet.steady_state()
        warm = fleet.lab.playbook(limit="all", forks=forks, extra_vars={"clean_slate_grace_period": GRACE}, env=RECOMMENDED_SSH)
        if warm.rc != 0:
            raise RuntimeError(warm.output[-4000:])
        fleet.refill(fleet.hosts)
        run, ctl, _hosts = fleet.run(playbook, None, forks, env=env_for(out, cprofile), wrapper=wrapper(), extra_vars={"clean_slate_grace_period": GRACE})
        if run.rc != 0:
            raise RuntimeError(run.output[-4000:])
        return run.elapsed, ctl
    finally:
        fleet.teardown()


# ---------------------------------------------------------------------- payload
def payload(path: Path, python: str) -> dict[str, Any]:
    """An AnsiballZ payload the launcher kept: its size, files and lines, and the time ``python`` takes to import
    the module from it (sources compiled, as on a target, where nothing of the payload is cached)."""
    text = path.read_text(errors="replace")
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key in ("zip_data", "module_fqn"):
            fields[key] = value.rstrip(",").strip("'\"")
    zipped = base64.b64decode(fields.get("zip_data", ""))
    fqn = fields.get("module_fqn", "")
    files, lines = 0, 0
    dest = Path(tempfile.mkdtemp(prefix="gpuops-payload-"))
    if zipped:
        with zipfile.ZipFile(io.BytesIO(zipped)) as zf:
            names = [n for n in zf.namelist() if n.endswith(".py")]
            files = len(names)
            lines = sum(zf.read(n).count(b"\n") for n in names)
            zf.extractall(dest)
    # From the payload's directory (python -c puts it first on the path); -E -s: no PYTHON* variables, no user site.
    cmd = [python, "-X", "importtime", "-E", "-s", "-B", "-c", f"import {fqn}"]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=str(dest))
    wall = time.perf_counter() - started
    top = []
    for line in done.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            top.append((int(parts[1]) / 1e6, parts[2].rstrip()))
    top.sort(reverse=True)
    return {
        "module": fqn,
        "bytes": path.stat().st_size,
        "zip_bytes": len(zipped),
        "py_files": files,
        "py_lines": lines,
        "import_wall": wall,
        "top": top[:12],
        "rc": done.returncode,
    }


# ---------------------------------------------------------------------- report
def report(out: Path, top: int) -> None:
    workers = [json.loads(line) for line in (out / "workers.jsonl").read_text().splitlines()]
    main = json.loads((out / "main.json").read_text())
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    order: list[str] = []
    for w in workers:
        if w["task"] not in by:
            order.append(w["task"])
        by[w["task"]].append(w)
    print(
        "| Task | Action | Hosts | Worker CPU, all hosts (s) | per host (s) | of it compiling templates, per host (s)"
        " | templates per host | Worker wall, median (s) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    total = 0.0
    for task in order:
        ws = by[task]
        cpu = sum(w["cpu"] for w in ws)
        total += cpu
        walls = sorted(w["wall"] for w in ws)
        jinja = sum(w.get("template_cpu", 0.0) for w in ws) / len(ws)
        templates = sum(w.get("templates", 0) for w in ws) / len(ws)
        print(
            f"| {task.split(' : ')[-1][:70]} | {ws[0]['action'].split('.')[-1]} | {len(ws)} | {cpu:.3f} | {cpu / len(ws):.4f} | {jinja:.4f} |"
            f" {templates:.0f} | {walls[len(walls) // 2]:.3f} |"
        )
    print(f"\nworkers' own CPU {total:.2f} s (ssh clients and local modules not included); main process CPU {main['cpu']:.2f} s")
    tasktime = out / "tasktime.txt"
    if tasktime.exists():
        print("\ntask wall times (tasktime callback):\n" + tasktime.read_text())
    if (out / "main.prof").exists():
        print("main process, by own time:")
        stats = pstats.Stats(str(out / "main.prof"), stream=sys.stdout)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(top)
    profiles = out / "worker-profiles.jsonl"
    if profiles.exists():
        grouped: dict[str, list[str]] = defaultdict(list)
        for line in profiles.read_text().splitlines():
            rec = json.loads(line)
            grouped[rec["task"]].append(str(out / f"worker-{rec['pid']}.prof"))
        for task, files in grouped.items():
            print(f"\nworkers of {task!r} ({len(files)}), cumulative:")
            stats = pstats.Stats(*files, stream=sys.stdout)
            stats.sort_stats("cumulative").print_stats(top)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--launch":
        launch(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fleet", action="store_true", help="on the 24-host fleet of tools/bench/fleet.py, over SSH")
    parser.add_argument("--forks", type=int, default=24, help="--fleet: forks")
    parser.add_argument("--cprofile", action="store_true", help="also cProfile the main process and every worker")
    parser.add_argument("--playbook", type=Path, default=ROOT / "playbooks" / "clean_slate.yml")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose ansible.cfg and collection run (local only)")
    parser.add_argument("--payload", action="store_true", help="also the AnsiballZ payload of each module the run shipped (size, import time)")
    parser.add_argument("--out", type=Path, help="keep the raw files here (default: a temporary directory)")
    parser.add_argument("--top", type=int, default=25, help="functions shown per profile")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuops-profile-out-") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        for stale in ("workers.jsonl", "worker-profiles.jsonl", "tasktime.txt"):
            (out / stale).unlink(missing_ok=True)
        if args.fleet:
            wall, ctl = fleet_run(out, args.cprofile, args.playbook, args.forks)
            print(f"fleet run: {wall:.2f} s, controller CPU (whole tree) {ctl:.2f} s")
        else:
            wall = local_run(out, args.cprofile, args.playbook, args.root)
            print(f"local run: {wall:.2f} s")
        report(out, args.top)
        if args.payload:
            from support.ansible import VENV_PYTHON

            for kept in sorted(out.glob("payload-*.py")):
                p = payload(kept, VENV_PYTHON)
                print(
                    f"\npayload {p['module']}: {p['bytes']} bytes ({p['zip_bytes']} zipped), {p['py_files']} Python files, {p['py_lines']} lines;"
                    f" import from source {p['import_wall']:.3f} s (rc {p['rc']}); slowest imports (s, cumulative):"
                )
                for seconds, name in p["top"]:
                    print(f"  {seconds:.3f} {name}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--launch":
        sys.exit(main())
    if not os.environ.get("GPUOPS_PIDNS"):
        tool = str(HERE.parent / "pidns-run")
        from support.ansible import VENV_PYTHON

        os.execvp(tool, [tool, VENV_PYTHON, __file__, *sys.argv[1:]])
    sys.exit(main())
