"""Benchmark: the residue phase (gpu_job_residue) on 10 000 files in /dev/shm and 3 000 processes.

Run with `make bench` (or `tools/pidns-run .venv/bin/python tools/bench/residue.py`; it
re-executes itself there, where /dev/shm and /tmp are a tmpfs of the run's own). Per repetition:

* /dev/shm holds 10 000 files of 4 KiB named like the real residue (nccl-XXXXXX, vllm_offload_*.mmap,
  torch_<pid>_<n>, psm_*, sem.mp-*): 9 000 orphans and 1 000 that 20 live processes map (a raw
  mapping each, its fd closed, so only /proc/PID/maps shows it);
* 3 000 processes are alive: the 20 holders, and `sleep` processes for the rest (small real processes,
  each with its fds and ~25 mappings to read);
* the module's defaults (shm, sockets, locks, dirs; no ports) are used.

Rows: the module's logic in this process (`_residue.module.run`, removing the 9 000 orphans, and in check
mode), the same through Ansible (the module's own `elapsed_s`, and the task's wall time with
Ansible's start-up), and the /proc pass alone. Each cell is the median of --repeat runs, each on a
fresh set of orphans. ``--write-docs`` replaces the section of docs/benchmarks.md. ``--files`` sets the
number of files (10 000; a tenth of them held).

Then the same 3 000 processes again, each with ``--threads`` threads (a small C program: every thread
sleeps): the /proc pass alone and the module's logic, since every thread's file table and working
directory count (issue 26).

``--compare REV`` times, interleaved with the checkout's, the /proc pass of ``_holders.py`` as it was at
git revision REV (it imports nothing of the collection, so it is loaded from that revision alone), on
both populations: the before/after of a change to the pass, measured side by side under the same load.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import typing as t
from pathlib import Path

from gpusim.residue import ResidueProc, start
from support.ansible import VENV_PYTHON, run_module, write_docs_section

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _holders
from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue import module, walk

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


DOCS = ROOT / "docs" / "benchmarks.md"
SECTION = "## Residue: gpu_job_residue on files in /dev/shm and 3 000 processes, with threads or not"
HOLDERS, PROCESSES = 20, 3000
GOAL_S = 0.3
NAMES = ("nccl-{}{:05d}", "vllm_offload_{}{:05d}.mmap", "torch_4242_{}{}", "psm_{}{:06x}", "sem.mp-{}{:06x}")


THREADS_C = r"""
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>
static void *idle(void *arg) { (void)arg; for (;;) pause(); return 0; }
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 1;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 65536);
    for (int i = 1; i < n; i++) { pthread_t t; if (pthread_create(&t, &attr, idle, 0)) return 1; }
    for (;;) pause();
}
"""


def threaded_program(tmp: Path) -> str | None:
    """A program whose process runs ``argv[1]`` threads, all asleep; None without a C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    (tmp / "threads.c").write_text(THREADS_C)
    subprocess.run([cc, "-O2", "-pthread", "-o", str(tmp / "threads"), str(tmp / "threads.c")], check=True)
    return str(tmp / "threads")


def holders_at(rev: str) -> object:
    """``_holders`` as it was at git revision ``rev``, loaded on its own."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:plugins/module_utils/_holders.py"], check=True, capture_output=True, text=True).stdout
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"holders_{rev.replace('/', '_')}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"holders_{rev}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def make_files(prefix: str, count: int) -> list[str]:
    out = []
    page = b"\0" * 4096
    for i in range(count):
        path = "/dev/shm/" + NAMES[i % len(NAMES)].format(prefix, i)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, page)
        os.close(fd)
        out.append(path)
    return out


def request(check: bool = False) -> module.Request:
    globs = [
        walk.parse_glob(kind, g) for kind, gs in zip(walk.KINDS, (walk.DEFAULT_SHM, walk.DEFAULT_SOCKETS, walk.DEFAULT_LOCKS, walk.DEFAULT_DIRS)) for g in gs
    ]
    return module.Request(globs=globs, remove=set(module.DEFAULT_REMOVE))


def bare_reads() -> None:
    """The floor of the pass over /proc: the same reads (fd links, maps) with no matching at all."""
    buf = bytearray(65536)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        base = "/proc/" + name
        try:
            for fd in os.listdir(base + "/fd"):
                try:
                    os.readlink(base + "/fd/" + fd)
                except OSError:
                    pass
            mfd = os.open(base + "/maps", os.O_RDONLY)
            try:
                while os.readv(mfd, [buf]):
                    pass
            finally:
                os.close(mfd)
        except OSError:
            pass


def timed(fn) -> tuple[float, float, object]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="runs per cell (median reported)")
    parser.add_argument("--files", type=int, default=10000, help="files in /dev/shm (a tenth of them held)")
    parser.add_argument("--threads", type=int, default=6, help="threads per process in the second population (0: skip it)")
    parser.add_argument("--compare", metavar="REV", help="also time the /proc pass of _holders.py at git revision REV, interleaved")
    parser.add_argument("--write-docs", action="store_true", help=f"write the figures into {DOCS.relative_to(ROOT)}")
    args = parser.parse_args()
    if os.environ.get("GPUOPS_PRIVATE_TMP") != "1":
        print("needs the private /dev/shm of tools/pidns-run", file=sys.stderr)
        return 2
    files, held_count = args.files, args.files // 10
    before = holders_at(args.compare) if args.compare else None

    held = make_files("h", held_count)
    per = held_count // HOLDERS
    holders: list[ResidueProc] = []
    population: list[subprocess.Popen[bytes]] = []
    rows: dict[str, list[tuple[float, float]]] = {}

    def time_row(key: str, fn: t.Callable[[], object]) -> object:
        wall, cpu, out = timed(fn)
        rows.setdefault(key, []).append((wall, cpu))
        return out

    def logic_rows(suffix: str, rep: int) -> None:
        make_files(f"o{suffix}{rep}", files - held_count)
        res = time_row("check" + suffix, lambda: module.run(request(), check_mode=True))
        assert res["summary"]["removed"] == files - held_count and res["summary"]["held"] == held_count, res["summary"]  # type: ignore[index]
        res = time_row("logic" + suffix, lambda: module.run(request(), check_mode=False))
        assert res["summary"]["removed"] == files - held_count and res["summary"]["held"] == held_count, res["summary"]  # type: ignore[index]
        assert len(os.listdir("/dev/shm")) == held_count

    def scan_rows(suffix: str) -> None:
        watch = _holders.Watch(keys={(os.stat(p).st_dev, os.stat(p).st_ino) for p in held}, names={os.path.basename(p) for p in held})
        # Interleaved, so that the machine's load falls on both alike.
        found = time_row("scan" + suffix, lambda: _holders.scan(watch))
        assert len(found.holds) == held_count, len(found.holds)  # type: ignore[attr-defined]
        if before is not None:
            old = before.Watch(keys=watch.keys, names=watch.names)  # type: ignore[attr-defined]
            time_row("scan_before" + suffix, lambda: before.scan(old))  # type: ignore[attr-defined]

    def fill(argv: list[str]) -> int:
        while len(holders) + len(population) + 2 < PROCESSES:  # + this process and pidns-run's init
            population.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL))
        return sum(1 for n in os.listdir("/proc") if n.isdigit())

    def empty() -> None:
        for proc in population:
            proc.kill()
        for proc in population:
            proc.wait()
        population.clear()

    tasks = 0
    try:
        for i in range(HOLDERS):
            holders.append(start("hold", *[x for p in held[i * per : (i + 1) * per] for x in ("--map", p)]))
        processes = fill(["sleep", "3600"])
        load_before = os.getloadavg()[0]
        for rep in range(args.repeat):
            logic_rows("", rep)
            scan_rows("")
            time_row("bare", bare_reads)
            make_files(f"a{rep}", files - held_count)
            started = time.perf_counter()
            result, _run = run_module("gpuops.clean_slate.gpu_job_residue", {"min_age": 0}, interpreter=VENV_PYTHON)
            rows.setdefault("task", []).append((time.perf_counter() - started, 0.0))
            assert result["_status"] == "ok" and result["summary"]["removed"] == files - held_count, result.get("msg")
            rows.setdefault("ansible", []).append((result["elapsed_s"], 0.0))
        program = threaded_program(Path(os.environ.get("TMPDIR", "/tmp"))) if args.threads > 1 else None
        if program is not None:
            empty()
            fill([program, str(args.threads)])
            tasks = sum(int(os.stat(f"/proc/{n}/task").st_nlink) - 2 for n in os.listdir("/proc") if n.isdigit() and os.path.exists(f"/proc/{n}/task"))
            for rep in range(args.repeat):
                scan_rows("_threads")
                logic_rows("_threads", rep)
        load_after = os.getloadavg()[0]
    finally:
        for h in holders:
            h.kill()
        empty()
    med = {k: (statistics.median(w for w, _c in v), statistics.median(c for _w, c in v)) for k, v in rows.items()}
    n_files, n_orphans = f"{files:,}".replace(",", " "), f"{files - held_count:,}".replace(",", " ")
    labels = {
        "logic": f"module logic in-process (`_residue.module.run`): judge {n_files}, remove {n_orphans}",
        "check": "the same in check mode (judge, check each orphan as a run would, list what would go)",
        "scan": "the pass over /proc alone (fds, maps of every process; two threads)",
        "bare": "its floor: the same reads in a bare loop, one thread, no matching",
        "ansible": "through Ansible: the module's own `elapsed_s`",
        "task": "through Ansible: the whole task (ansible-playbook start-up included)",
        "scan_threads": f"the pass over /proc alone, every process with {args.threads} threads ({tasks} tasks)",
        "logic_threads": f"module logic in-process, every process with {args.threads} threads",
        "check_threads": f"the same in check mode, every process with {args.threads} threads",
    }
    lines = ["| Run | Wall (s) | CPU (s) |", "|---|---:|---:|"]
    for key in [k for k in labels if k in med]:
        cpu = f"{med[key][1]:.3f}" if key not in ("ansible", "task") else "-"
        lines.append(f"| {labels[key]} | {med[key][0]:.3f} | {cpu} |")
    table = "\n".join(lines)
    compare = ""
    if before is not None:
        crows = ["| The /proc pass alone | before (" + str(args.compare) + ") wall / CPU s | after wall / CPU s |", "|---|---:|---:|"]
        for suffix, label in (("", f"{processes} processes, one thread each"), ("_threads", f"{processes} processes, {args.threads} threads each")):
            if "scan_before" + suffix in med:
                b, a = med["scan_before" + suffix], med["scan" + suffix]
                crows.append(f"| {label} | {b[0]:.3f} / {b[1]:.3f} | {a[0]:.3f} / {a[1]:.3f} |")
        compare = "\n".join(crows)
    verdict = "met" if med["ansible"][0] <= GOAL_S else "missed"
    summary = (
        f"module elapsed_s {med['ansible'][0]:.3f} s with {processes} processes (goal <= {GOAL_S} s: {verdict});"
        f" the machine's 1-minute load average was {load_before:.1f} before and {load_after:.1f} after, on {os.cpu_count()} cores"
    )
    print(f"gpu_job_residue, {args.repeat} runs per cell (medians), {files} files in /dev/shm ({held_count} held), {processes} processes")
    print(table)
    if compare:
        print(compare)
    print(summary)
    if args.write_docs:
        command = f"tools/pidns-run .venv/bin/python tools/bench/residue.py --repeat {args.repeat} --files {files} --threads {args.threads}"
        command += f" --compare {args.compare}" if args.compare else ""
        compare_text = ""
        if compare:
            one, many = ("scan_before", "scan"), ("scan_before_threads", "scan_threads")
            delta = [f"{med[a][1]:.3f} s to {med[b][1]:.3f} s of CPU" if a in med else "not measured" for a, b in (one, many)]
            compare_text = (
                "\nBefore and after, side by side in the same run (each repetition times both, one after the other):\n\n"
                f"{compare}\n\n"
                f"- One thread per process: {delta[0]}. The pass makes one call more per process (a stat of its task\n"
                "  directory, which counts its threads), a few microseconds each.\n"
                f"- {args.threads} threads per process: {delta[1]}. Before, only the main thread's file table and working\n"
                "  directory were read, so a file only another thread held was removed; now each thread is compared with\n"
                "  the main thread (kcmp, a few microseconds) and one with tables of its own is read as well.\n"
            )
        section = f"""{SECTION}

Measured {time.strftime("%Y-%m-%d")} on {platform.node() or "the build machine"} ({os.cpu_count()} cores, Python {platform.python_version()}), with

    {command} --write-docs

/dev/shm (a tmpfs of the run's own) holds {files} files of 4 KiB named like real residue (NCCL, vLLM, torch,
Python shared memory and semaphores): {files - held_count} orphans and {held_count} mapped by {HOLDERS} live processes;
{processes} processes are alive (the holders and `sleep` processes; for the last rows, the holders and
processes of {args.threads} sleeping threads each). The module runs with its defaults
(every kind searched with the default globs, shm and sockets removed, no ports). Medians of {args.repeat} runs, each on fresh orphans.

{table}
{compare_text}
- {summary}.
- Where the time goes: the pass over /proc reads, for every process, the link count of its task directory
  (its number of threads), its fd directory (one readlink per fd; a stat only for an fd whose name is a
  candidate's) and its maps (searched for the candidates' device first), in two threads; for a process with
  several threads, one kcmp per thread tells whether it shares the main thread's file table (and, with
  directories among the candidates, its working directory), and a thread that does not is read too. Its cost
  grows with the number of processes and threads and is almost all kernel work: the bare loop doing only the
  fd and maps reads is its floor. The rest grows with the number of files: one directory listing, then per
  orphan one `fstatat` (the check right before the unlink, which check mode makes too) and one `unlink`.
  The CPU column counts every thread.
- Wall time on this shared 2-core machine is not the machine's own: with a load average above the
  number of cores, wall time is up to twice the CPU time. The CPU figures are what the phase costs.

"""
        write_docs_section(DOCS, SECTION, section)
    return 0


if __name__ == "__main__":
    if not os.environ.get("GPUOPS_PIDNS"):
        tool = str(HERE.parent / "pidns-run")
        os.execvp(tool, [tool, VENV_PYTHON, __file__, *sys.argv[1:]])
    sys.exit(main())
