"""`make demo`: an SGLang server crashes on a simulated 8 x H200 node the way the seeds' did, beside a vLLM server
whose API server is SIGKILLed (vllm#55510), and the clean_slate playbook gives the node its clean slate back.

The server is a process tree shaped like the real one (gpusim.servers): the launcher holding the HTTP port, its
detokenizer and resource tracker, and one sglang::scheduler_TP<k> per GPU, each in a session of its own, holding
~100 GB on its GPU, with SGLang's, torch's and the CUDA driver's shared memory and ZMQ sockets, named as their
sources name them. Beside it run the daemons that must survive (nvidia-persistenced, nv-hostengine, which maps one
of the server's queues, dcgm-exporter) and an unrelated torch process whose segment nothing holds. A vLLM tp=8 server
shares the GPUs: its API server, VLLM::EngineCore and one VLLM::Worker_TP<k> per GPU, with its resource tracker.

1. The crash: SGLang's launcher is SIGKILLed (its schedulers, reparented, keep their GPUs), and vLLM's API server is
   SIGKILLed (its engine core has no parent-death detection: it and its workers stay on the GPUs, the port frees).
   What is left, and what it does to each next start (they fail, and why).
2. The clean: the real playbook (playbooks/clean_slate.yml) with the role, on the node: what was ended (full names,
   counts that add up, what was protected and why), what was removed, kept or held, and the GPUs before and after.
3. The next start: it binds its ports and creates its queues.

It leaves a JSON report, node_exporter metrics and the inventory under .build/demo/, and prints the command that
runs the playbook again against a simulated node with the same crash (`make demo-shell`).

    tools/pidns-run .venv/bin/python tools/demo/demo.py            # what make demo runs
    tools/pidns-run .venv/bin/python tools/demo/demo.py --shell [-- COMMAND ...]   # make demo-shell

Everything runs inside a private PID namespace, with /dev/shm and /tmp of its own, and is stopped at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
import typing as t
from pathlib import Path

from gpusim import Node
from gpusim.residue import private_shm, spawn
from gpusim.servers import Server, ServerStartError, start_sglang, start_vllm
from support.ansible import ROOT, VENV, local_inventory, run_playbook

OUT = ROOT / ".build" / "demo"
DAEMONS = ("nvidia-persistenced", "nv-hostengine", "dcgm-exporter")
MIN_AGE = 2  # the demo's server ran for seconds; a real one ran for minutes, older than the default minute
SGLANG_MIB, VLLM_MIB = 100000, 40000  # each GPU: SGLang's share and vLLM's (143 GB an H200: both fit, a third start does not)
RERUN = f"ansible-playbook playbooks/clean_slate.yml -i {OUT.relative_to(ROOT)}/inventory.yml"


class Scene:
    """The simulated node with its crashed server and its neighbours."""

    def __init__(self) -> None:
        self.node = Node(gpus=8)
        self.node.start()
        self.sandbox = self.node.sandbox(name="demo")
        private_shm(self.sandbox)  # a GPU node's size: the next start's room there is checked (shm_min_mib)
        port = free(30000)
        self.server = start_sglang(
            self.node, sandbox=self.sandbox, tp=8, port=port, nccl_port=free(port + 1), mib=SGLANG_MIB, tokenizer_workers=2, mq_kib=65536, ipc_kib=4096
        )
        self.vllm = start_vllm(self.node, sandbox=self.sandbox, tp=8, port=free(8000), mib=VLLM_MIB)
        self.daemons = {name: self.node.spawn_daemon(name, sandbox=self.sandbox) for name in DAEMONS if name != "nv-hostengine"}
        mq = next(p for p in self.server.shm if os.path.basename(p).startswith("sgl_shm_mq_"))
        self.hostengine = spawn(self.sandbox, "hold", "--comm", "nv-hostengine", "--map", mq)
        self.beside = spawn(self.sandbox, "creator", "--comm", "pt_main_thread")

    def inventory(self) -> Path:
        """The inventory the playbook runs with (and the one `make demo-shell` runs again)."""
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "metrics").mkdir(exist_ok=True)
        host = {
            "clean_slate_device_dir": str(self.node.dev_dir),
            "clean_slate_expected_gpus": 8,
            "clean_slate_grace_period": 3,
            "clean_slate_residue_min_age": MIN_AGE,
            "clean_slate_residue_list_limit": 200,  # every path in the report (20 by default)
            "clean_slate_residue_ports": [self.server.ports["http"], self.server.ports["store"], self.vllm.ports["http"]],
            "clean_slate_report_dir": str(OUT / "report"),
            "clean_slate_metrics_dir": str(OUT / "metrics"),
        }
        return local_inventory(OUT / "inventory.yml", {"gpu-node-1": host})

    def env(self) -> dict[str, str]:
        env = self.node.env()
        env["PATH"] = f"{VENV / 'bin'}:{self.node.bin_dir}:{os.environ.get('PATH', '')}"
        return env

    def crash(self) -> None:
        self.server.crash()
        self.vllm.crash("api_server")

    def stop(self) -> None:
        self.server.stop()
        self.vllm.stop()
        self.sandbox.stop()
        self.node.stop()


def free(port: int) -> int:
    """``port`` when nothing on this machine uses it, else a free one (the demo's shows the same)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stat(pid: int) -> dict[str, int]:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            rest = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return {}
    return {"ppid": int(rest[1]), "sid": int(rest[3])}


def mib(nbytes: int) -> str:
    return f"{nbytes / 1048576:.1f} MiB" if nbytes >= 1048576 else f"{nbytes // 1024} KiB"


def show_tree(scene: Scene, title: str, srv: Server | None = None) -> None:
    srv, sb = srv or scene.server, scene.sandbox
    print(title)
    print(f"  {'PID':>5} {'PPID':>5} {'SID':>5}  {'process (full name, as /proc/PID/cmdline shows it)':<58}  holds")
    ns = {m.pid: m.ns_pid for m in srv.members}
    ns[sb.init_pid] = 1
    for m in srv.members:
        if not m.alive():
            print(f"  {m.ns_pid:>5} {'-':>5} {'-':>5}  {m.title[:58]:<58}  gone")
            continue
        st = stat(m.pid)
        holds = f"GPU {m.gpu}: {scene.node.memory(m.gpu)['used_mib']} MiB" if m.gpu is not None else ""
        if m.role in ("launcher", "api_server"):
            holds = f"HTTP port {srv.ports['http']}"
        if m.gpu == 0 and srv.kind == "sglang":
            holds += f", store port {srv.ports['store']}"
        name = m.title if len(m.title) <= 58 else m.title[:55] + "..."
        print(f"  {m.ns_pid:>5} {ns.get(st['ppid'], st['ppid']):>5} {ns.get(st['sid'], st['sid']):>5}  {name:<58}  {holds}")


def show_residue(scene: Scene) -> None:
    srv = scene.server
    files = [(p, os.stat(srv.path(p)).st_blocks * 512) for p in srv.shm if os.path.lexists(srv.path(p))]
    print(f"  /dev/shm: {len(files)} files, {mib(sum(b for _p, b in files))}: " + ", ".join(sorted({short(p) for p, _b in files})))
    socks = [p for p in srv.sockets if os.path.lexists(srv.path(p))]
    print(f"  /tmp: {len(socks)} ZMQ ipc:// socket files ({', '.join(socks[:2])}, ...)")


def short(path: str) -> str:
    """The family of a residue name, for one line: sgl_shm_mq_<pid>_<rand>, torch_<pid>_<rand>_<n>, ..."""
    name = os.path.basename(path)
    for prefix in ("sgl_shm_mq_", "sglang_loads_", "multi_tokenizer_args_", "torch_", "cuda.shm.0.", "sem.mp-"):
        if name.startswith(prefix):
            return {"sgl_shm_mq_": "sgl_shm_mq_<pid>_<rand>", "sglang_loads_": "sglang_loads_<ipc>_<hash>.shm"}.get(prefix, prefix + "*")
    return name


def attempt_start(scene: Scene) -> Server | None:
    srv = scene.server
    print(f"  $ python3 -m sglang.launch_server --model-path /models/Qwen3-235B-A22B --tp-size 8 --port {srv.ports['http']}")
    try:
        again = start_sglang(scene.node, sandbox=scene.sandbox, tp=8, port=srv.ports["http"], nccl_port=srv.ports["store"], mib=SGLANG_MIB)
    except ServerStartError as exc:
        print(f"  fails: {exc}")
        return None
    return again


def attempt_vllm(scene: Scene) -> Server | None:
    print(f"  $ vllm serve /models/Llama-3.1-405B-FP8 --tensor-parallel-size 8 --port {scene.vllm.ports['http']}")
    try:
        return start_vllm(scene.node, sandbox=scene.sandbox, tp=8, port=scene.vllm.ports["http"], mib=VLLM_MIB)
    except ServerStartError as exc:
        print(f"  fails: {exc}")
        return None


def show_kill(kill: dict[str, t.Any]) -> None:
    s = kill["summary"]
    # Processes by outcome (each target once: the parts add up to the whole), then the signals sent (a process that
    # needed SIGKILL got SIGTERM first, so signals and processes are two different counts).
    outcomes = [
        (s["terminated"], "ended by SIGTERM"),
        (s["killed"], "ended by SIGKILL after SIGTERM"),
        (s["exited"], "already exiting (waited for, not signalled)"),
        (s.get("stopped", 0), "ended by their server's own stop or, a resource tracker, on their own (no signal)"),
        (s.get("spared", 0), "resource trackers spared (still needed)"),
        (s["vanished"], "gone before their first signal"),
        (s["unkillable"], "unkillable"),
    ]
    parts = [f"{n} {what}" for n, what in outcomes if n] or ["none"]
    signals = ", ".join(f"{n} SIG{sig}" for sig, n in s["signals"].items() if n) or "none"
    print(f"{len(kill['targets'])} processes targeted, in {s['rounds']} round(s): {', '.join(parts)}. Signals sent: {signals}.")
    for x in kill["targets"]:
        teardown = f", waited {x['teardown_s']} s for its teardown" if x.get("teardown_s") is not None else ""
        signals = "+".join(x["signals_sent"]) or "none"
        print(
            f"  {x['pid']:>5} {x['cmdline'][:44]:<44} {x['step']:<7} {x['outcome']:<10} signals {signals:<9} ended by {x['ended_by'] or '-':<10}"
            f" gone after {x['seconds']:.2f} s{teardown}"
        )
        print(f"        found: {'; '.join(x['reasons'])}")
    if kill["protected"]:
        # The report's "protected" list: processes the kill found (on the GPUs' device files, listed by NVML or matching
        # a pattern) and never signalled, each with why.
        print(f"{len(kill['protected'])} found but protected (the report's 'protected': never signalled, whatever the input):")
    for p in kill["protected"]:
        print(f"  {p['pid']:>5} {p['cmdline'][:44]:<44} {protected_why(p)}")
    for p in kill.get("ignored", []):
        print(f"  left  {p.get('pid')!s:>5} {p['why']}")


def protected_why(p: dict[str, t.Any]) -> str:
    """Why a process was protected, in words a newcomer reads without the guide."""
    why = p["why"]
    if why.startswith("started by this module") or why == "this module's own process":
        # The module's NVML helper opens every GPU's device file, so the kill's device-file scan finds it.
        return f"{why}: Ansible's own module and its NVML helper, which opens the GPUs' device files"
    if why.startswith("protected daemon"):
        return f"{why}: an NVIDIA daemon the node needs (the protect list)"
    return why


def show_residue_result(residue: dict[str, t.Any]) -> None:
    s = residue["summary"]
    print(f"Residue: {s['removed']} removed ({mib(s['removed_bytes'])}), {s['held']} held by live processes, {s['kept']} unheld but kept.")
    for x in residue["removed"]:
        released = f"  (released by this run's kill: PID {', '.join(map(str, x['released_by']))})" if x.get("released_by") else ""
        print(f"  removed  {x['path']:<52} {mib(x['bytes']):>10}{released}")
    for x in residue["held"]:
        who = ", ".join(f"PID {h['pid']} {full_name(h)} ({'/'.join(h['how'])}{', protected' if h.get('protected') else ''})" for h in x["holders"])
        print(f"  held     {x['path']:<52} by {who}")
    for x in residue["kept"]:
        print(f"  kept     {x['path']:<52} {x['why']}")
    for p in residue["ports"]:
        if "server" not in p:
            print(f"  port {p['port']}: {p['state']}")
    server = [p for p in residue["ports"] if "server" in p]
    if server:
        states = sorted({p["state"] for p in server})
        print(f"  the profiles' {len(server)} ports (SGLang's 30000 and its data-parallel plan, vLLM's 8000, 29500, 29501, 29550): {', '.join(states)}")


def full_name(rec: dict[str, t.Any]) -> str:
    """A process's name as its command line gives it when the kernel's 15-character comm is a cut of it
    (``sglang::schedul`` is ``sglang::scheduler_TP0``), else its comm."""
    name, first = rec.get("name") or "", (rec.get("cmdline") or "").split(" ", 1)[0]
    return first if name and first.startswith(name) else name


def gpu_table(before: list[dict[str, t.Any]], after: list[dict[str, t.Any]], names: dict[int, str]) -> str:
    """GPUs before and after; holders by their full names (``names``: pid -> cmdline), not NVML's 15-character comm."""
    rows = [f"  {'GPU':>3}  {'before (MiB)':>12}  {'held by (before)':<30}  {'after (MiB)':>11}  {'after':<10}"]
    for b, a in zip(before, after):
        holders = ", ".join(f"{p['pid']} {names.get(p['pid'], p['name'])}" for p in b["processes"]) or "-"
        rows.append(f"  {b['index']:>3}  {b['used_mib']:>12}  {holders[:30]:<30}  {a['used_mib']:>11}  {a['diagnosis']:<10}")
    return "\n".join(rows)


def demo() -> int:
    started = time.monotonic()
    if OUT.exists():
        shutil.rmtree(OUT)
    scene = Scene()
    try:
        srv, node = scene.server, scene.node
        print(f"Simulated node: 8 x NVIDIA H200 ({node.state_dir}); an SGLang server, tp=8, serving on port {srv.ports['http']}:")
        show_tree(scene, "")
        print(f"and a vLLM server, tp=8, serving on port {scene.vllm.ports['http']} (its share of each GPU: {VLLM_MIB} MiB):")
        show_tree(scene, "", scene.vllm)
        print(f"Beside it: {', '.join(DAEMONS)} (must survive; nv-hostengine maps the server's broadcast queue), and a torch")
        print(f"process (PID {scene.beside.ns_pid}, pt_main_thread) whose CUDA IPC segment nothing holds.\n")

        print("== The crash: SGLang's launcher is SIGKILLed, as the seeds' servers died; vLLM's API server too (vllm#55510) ==")
        scene.crash()
        show_tree(scene, "What is left of SGLang (PID 1 is the container's init: the schedulers were reparented to it):")
        show_residue(scene)
        show_tree(scene, "What is left of vLLM (no parent-death detection in its engine core: it and its workers stay):", scene.vllm)
        print("What blocks the next starts:")
        if attempt_start(scene) is not None:
            print("  (it started: the crash left nothing in its way)")
            return 1
        print(f"  and behind that: 8 GPUs each holding {node.memory(0)['used_mib']} MiB (CUDA out of memory), the dead queues in /dev/shm.")
        if attempt_vllm(scene) is not None:
            print("  (it started: the crash left nothing in its way)")
            return 1
        print("  its port is free, so a supervisor restarts it at once: into CUDA out of memory, the orphans still on the GPUs.\n")

        time.sleep(max(0.0, MIN_AGE + 0.5 - (time.monotonic() - started)))
        print("== The clean ==")
        print(f"$ {RERUN}")
        run = run_playbook(ROOT / "playbooks" / "clean_slate.yml", inventory=scene.inventory(), env=scene.env(), wrapper=scene.sandbox.nsenter_prefix())
        if run.rc != 0:
            print(run.output)
            print(f"playbook failed (rc {run.rc})")
            return 1
        names = {x["pid"]: x["cmdline"] for x in run.phase("kill")["targets"]}
        print(gpu_table(run.phase("before")["gpus"], run.phase("verify")["gpus"], names))
        show_kill(run.phase("kill"))
        show_residue_result(run.phase("residue"))
        [tracker] = srv.role("resource_tracker")
        sems = [p for p in srv.shm if os.path.basename(p).startswith("sem.mp-")]
        if not tracker.alive() and not any(os.path.lexists(srv.path(p)) for p in sems):
            print(f"  (the resource tracker exited by itself when the last scheduler died, unlinking its {len(sems)} semaphores)")
        print(run.summary())
        print(f"Playbook wall time {run.elapsed:.1f} s (Ansible start-up included).\n")

        print("== The next starts ==")
        again = attempt_start(scene)
        if again is None:
            return 1
        mq = next(p for p in again.shm if os.path.basename(p).startswith("sgl_shm_mq_"))
        print(f"  listening on {again.ports['http']}, store on {again.ports['store']}; its queues: {mq} and {len(again.shm) - 1} more")
        again_vllm = attempt_vllm(scene)
        if again_vllm is None:
            return 1
        print(f"  listening on {again_vllm.ports['http']}; VLLM::EngineCore and {len(again_vllm.ranks)} workers on the GPUs")
        again.stop()
        again_vllm.stop()
        alive = [n for n, d in scene.daemons.items() if d.alive()] + (["nv-hostengine"] if scene.hostengine.alive() else [])
        print(f"  {', '.join(alive)} still running.\n")
        ok = len(alive) == len(DAEMONS) and scene.beside.alive()
    finally:
        scene.stop()
    print("== Left for you ==")
    for path in sorted(p for p in OUT.rglob("*") if p.is_file()):
        print(f"  {path.relative_to(ROOT)}")
    print("The simulated node stopped with the demo (its processes lived in the demo's PID namespace). To run the")
    print("playbook again yourself, bring one back with the same crash:")
    print("  make demo-shell                 # a shell beside a new node with the crashed server; in it, run:")
    print(f"  {RERUN}")
    print(f'  make demo-shell CMD="{RERUN}"   # or both in one go')
    print(f"Demo finished in {time.monotonic() - started:.1f} s.")
    return 0 if ok else 1


def shell(command: list[str]) -> int:
    """A simulated node with the same crash, its inventory in .build/demo, and a shell (or ``command``) beside it."""
    scene = Scene()
    try:
        scene.crash()
        time.sleep(MIN_AGE + 0.5)
        scene.inventory()
        env = {**os.environ, **scene.env(), "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PS1": r"(gpuops demo node) \w\$ "}
        argv = command or [os.environ.get("SHELL", "/bin/bash")]
        if not command:
            print(f"A simulated 8 x H200 node with a crashed SGLang server and a crashed vLLM server (tp=8). Run:\n  {RERUN}\nExit the shell to stop the node.")
        return subprocess.run([*scene.sandbox.nsenter_prefix(join_cgroup=True, wd=str(ROOT)), *argv], env=env, check=False).returncode
    finally:
        scene.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    p.add_argument("--shell", action="store_true", help="bring up a simulated node with the same crash and open a shell (or run COMMAND) beside it")
    p.add_argument("command", nargs="*", help="with --shell: the command to run instead of a shell")
    args = p.parse_args()
    if args.shell:
        return shell(args.command)
    return demo()


if __name__ == "__main__":
    sys.exit(main())
