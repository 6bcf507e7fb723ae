"""Benchmark: the peers side by side on the same crashed SGLang server (issue 38).

Run with `tools/pidns-run .venv/bin/python tools/bench/peers.py [--tp 8] [--version 0.5.23]`.

The scene, built afresh for each approach on the simulated 8 x H200 node: an SGLang tp=8 server made as SGLang makes
it (gpusim.servers) crashed as the seeds' crashed (its launcher SIGKILLed: the schedulers, reparented, keep their GPUs,
their store port, their queues); beside it, on the same host, a live torch job (not SGLang: its NCCL segment, torch
and multiprocessing segments, semaphore and sockets, each held, mapped or bound by it) and the NVIDIA daemons
(nvidia-persistenced, nv-hostengine, dcgm-exporter). The scene is 3 s old when the approach runs (the role runs with
``clean_slate_residue_min_age: 2``, standing for a server that ran for minutes against the default minute).

Approaches:

* SGLang's own sweep, ``sglang.srt.utils.stale_shm_cleanup.cleanup_stale_shm()``, and its CI killall,
  ``sglang/cli/killall.py`` (``SGLANG_IS_IN_CI=true``, as SGLang's CI runs both at the start of a job), alone and in
  that order. Their modules are taken from SGLang's published wheel, downloaded here at run time with
  ``pip download sglang==<version> --no-deps`` into ``.build/peers/`` (never copied into the repository) and loaded by
  path: both import the standard library only, so SGLang's dependencies are not needed;
* the seeds' hand-run pipeline (``ps aux | grep python3 | ... | xargs kill -9``, ``fuser -k /dev/nvidia*``, the sleeps);
* the role: playbooks/clean_slate.yml with its defaults (the server profiles applied).

Each row says what the approach ended of the server (of its survivors), of the host's daemons and of the live job
(both wrongly), what it removed of the server's files and left of them, what it removed of the live job's files
(wrongly: they were in use), whether the next start (the same command, the same ports) works, and the wall time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import typing as t
import zipfile
from pathlib import Path

from bench.kill_verify import PIPELINE
from gpusim import Node
from gpusim.residue import private_shm, spawn
from gpusim.servers import ServerStartError, start_sglang
from support.ansible import ROOT, VENV, local_inventory, run_playbook

OUT = ROOT / ".build" / "peers"
DAEMONS = ("nvidia-persistenced", "nv-hostengine", "dcgm-exporter")
MODULES = {"stale_shm_cleanup": "sglang/srt/utils/stale_shm_cleanup.py", "killall": "sglang/cli/killall.py"}
# Loads a peer module by path (no package, no dependencies) and runs it as SGLang's CI does.
LOADER = r"""
import importlib.util, logging, sys
logging.basicConfig(level=logging.INFO)
spec = importlib.util.spec_from_file_location(sys.argv[1], sys.argv[2])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
sys.exit(mod.cleanup_stale_shm() if sys.argv[1] == "stale_shm_cleanup" else mod.main())
"""


def fetch(version: str) -> dict[str, Path]:
    """SGLang's two modules from its published wheel (downloaded without its dependencies), by name."""
    wheels = OUT / f"sglang-{version}"
    wheels.mkdir(parents=True, exist_ok=True)
    if not list(wheels.glob("sglang-*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", f"sglang=={version}", "--no-deps", "--only-binary=:all:", "-d", str(wheels)], check=True)
    [wheel] = wheels.glob("sglang-*.whl")
    out = {}
    with zipfile.ZipFile(wheel) as z:
        for name, member in MODULES.items():
            target = wheels / "src" / member
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(member))
            out[name] = target
    return out


class Scene:
    """The crashed server, the live job beside it and the daemons, in a sandbox of their own."""

    def __init__(self, node: Node, tp: int) -> None:
        self.node = node
        self.sandbox = node.sandbox()
        private_shm(self.sandbox)  # a GPU node's size: the role checks the next start's room there
        self.tmp = "/tmp"  # the sandbox's own
        self.work = Path(tempfile.mkdtemp(prefix="run-", dir=OUT))  # the controller's: the role's inventory
        self.server = start_sglang(node, sandbox=self.sandbox, tmp=self.tmp, tp=tp, port=0, nccl_port=0, mib=100000, tokenizer_workers=2)
        self.daemons = [node.spawn_daemon(name, sandbox=self.sandbox) for name in DAEMONS]
        self.job = spawn(self.sandbox, "job", "--tmp", self.tmp, "--comm", "pt_main_thread")
        self.survivors = self.server.crash()
        time.sleep(3)

    def files(self) -> set[str]:
        return set(self.server.shm + self.server.sockets)

    def job_files(self) -> set[str]:
        return set(self.job.info["shm"] + self.job.info["sockets"])

    def exists(self, path: str) -> bool:
        return os.path.lexists(self.server.path(path))

    def next_start(self) -> str:
        try:
            srv = start_sglang(
                self.node, sandbox=self.sandbox, tmp=self.tmp, tp=len(self.server.ranks), port=self.server.ports["http"],
                nccl_port=self.server.ports["store"], mib=100000,
            )  # fmt: skip
        except ServerStartError as exc:
            return f"no: {exc}"
        srv.stop()
        return "yes"

    def stop(self) -> None:
        self.server.stop()
        self.sandbox.stop()
        self.node.wait_clean(timeout=30)  # the next scene starts on GPUs whose memory is back


def run_peer(scene: Scene, modules: dict[str, Path], names: list[str]) -> None:
    env = {"SGLANG_IS_IN_CI": "true", "PATH": f"{scene.node.bin_dir}:/usr/bin:/bin"}
    for name in names:
        scene.sandbox.run([sys.executable, "-c", LOADER, name, str(modules[name])], env=env, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_pipeline(scene: Scene) -> None:
    env = {"DEV": str(scene.node.dev_dir), "OUT": f"{scene.tmp}/smi.txt", "PATH": f"{scene.node.bin_dir}:/usr/bin:/bin:/usr/sbin:/sbin"}
    scene.sandbox.run(["bash", "-c", PIPELINE], env=env, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_role(scene: Scene) -> None:
    host = {"clean_slate_device_dir": str(scene.node.dev_dir), "clean_slate_residue_min_age": 2, "clean_slate_grace_period": 10}
    inv = local_inventory(scene.work / "inventory.yml", {"gpu-node-1": host})
    env = scene.node.env()
    env["PATH"] = f"{VENV / 'bin'}:{scene.node.bin_dir}:{os.environ.get('PATH', '')}"
    run_playbook(ROOT / "playbooks" / "clean_slate.yml", inventory=inv, env=env, wrapper=scene.sandbox.nsenter_prefix())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--version", default="0.5.23", help="the SGLang release whose modules are compared")
    args = ap.parse_args()
    modules = fetch(args.version)
    approaches: dict[str, t.Callable[[Scene], None]] = {
        f"SGLang {args.version} stale_shm_cleanup": lambda s: run_peer(s, modules, ["stale_shm_cleanup"]),
        f"SGLang {args.version} killall (CI)": lambda s: run_peer(s, modules, ["killall"]),
        f"SGLang {args.version} killall, then stale_shm_cleanup": lambda s: run_peer(s, modules, ["killall", "stale_shm_cleanup"]),
        "the seeds' pipeline": run_pipeline,
        "the role (playbooks/clean_slate.yml)": run_role,
    }
    rows = []
    with Node(gpus=8) as node:
        for name, approach in approaches.items():
            scene = Scene(node, args.tp)
            try:
                files, job_files = scene.files(), scene.job_files()
                before = {p for p in files if scene.exists(p)}
                began = time.monotonic()
                approach(scene)
                wall = time.monotonic() - began
                rows.append(
                    {
                        "approach": name,
                        "ended": sum(1 for m in scene.survivors if not m.alive()),
                        "of": len(scene.survivors),
                        "daemons": sum(1 for d in scene.daemons if not d.alive()),
                        "job": "ended" if not scene.job.alive() else "kept",
                        "removed": len({p for p in before if not scene.exists(p)}),
                        "left": len({p for p in before if scene.exists(p)}),
                        "wrong": len({p for p in job_files if not scene.exists(p)}) if scene.job.alive() else "-",
                        "next": scene.next_start(),
                        "s": wall,
                    }
                )
            finally:
                scene.stop()
    print(f"Simulated 8 x H200, SGLang tp={args.tp} crashed (launcher SIGKILLed); a live torch job and the NVIDIA daemons beside it.\n")
    print(
        "| approach | server processes ended | daemons ended (wrong) | live job | server files removed | server files left |"
        " live job's files removed (wrong) | next start works | s |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---|---:|")
    for r in rows:
        print(
            f"| {r['approach']} | {r['ended']}/{r['of']} | {r['daemons']}/{len(DAEMONS)} | {r['job']} | {r['removed']} | {r['left']} | {r['wrong']} |"
            f" {r['next']} | {r['s']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
