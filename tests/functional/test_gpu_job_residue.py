"""gpu_job_residue through Ansible, on real residue made by real processes (gpusim.residue).

Host-scope tests run the module inside a gpusim sandbox whose /dev/shm is a tmpfs of its own; sockets,
locks and directories live in test-owned directories given as options. Container-scope tests run the
module in this test's namespace (the "hypervisor") against residue containers with their own /dev/shm,
/tmp and network namespace; the "host" /dev/shm there is pidns-run's private tmpfs.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import typing as t
from pathlib import Path

import pytest
from gpusim import residue
from gpusim.residue import Container, inside, spawn
from support.modules import ModuleRunner, assert_no_traceback, wait_for
from support.threads import THREAD_HOLDER

PRIVATE_TMP = os.environ.get("GPUOPS_PRIVATE_TMP") == "1"
needs_private_tmp = pytest.mark.skipif(not PRIVATE_TMP, reason="writes to /dev/shm: run under tools/pidns-run (private tmpfs)")


@pytest.fixture
def dirs() -> t.Iterator[tuple[Path, Path]]:
    """Test-owned stand-ins for /tmp and ~/.cache, with short paths (a unix socket path has 107 bytes at most)."""
    top = Path(tempfile.mkdtemp(prefix="res-"))
    work, cache = top / "t", top / "c"
    work.mkdir()
    cache.mkdir()
    yield work, cache
    shutil.rmtree(top, ignore_errors=True)


def options(work: Path, cache: Path, **extra) -> dict:
    """The module's default globs, moved from /tmp and the home caches to test-owned directories; the residue these
    tests make is seconds old, so the minimum age is off (test_servers and the unit tests hold that rule)."""
    return {
        "min_age": 0,
        "sockets": [f"{work}/tmp????????", f"{work}/????????-????-????-????-????????????", f"{work}/*-????????-????-????-????-????????????"],
        "locks": [f"{cache}/flashinfer/**/*.lock", f"{cache}/torch_extensions/**/lock"],
        "dirs": [f"{work}/torchelastic_*"],
        **extra,
    }


def paths(result: dict, key: str) -> set[str]:
    return {r["path"] for r in result[key]}


def exists(sb, path: str) -> bool:
    return os.path.lexists(inside(sb, path))


def test_every_orphan_goes_and_nothing_held_goes(mod, shm_sandbox, dirs) -> None:
    sb = shm_sandbox
    work, cache = dirs
    dead = spawn(sb, "job", "--tmp", work, "--cache", cache, "--segments", "3", "--kib", "256")
    live = spawn(sb, "job", "--tmp", work, "--cache", cache, "--segments", "2", "--comm", "sglang::schedul")
    dead.kill()
    # One of the dead job's segments is still mapped by a protected daemon (a raw mapping, its fd closed).
    kept = dead.info["shm"][0]
    daemon = spawn(sb, "hold", "--comm", "nv-hostengine", "--map", kept)
    r = mod("gpu_job_residue", options(work, cache))
    assert r["_status"] == "ok", r
    assert r["changed"] is True
    orphans = set(dead.info["shm"]) - {kept} | set(dead.info["sockets"])
    assert paths(r, "removed") == orphans
    assert not any(exists(sb, p) for p in orphans)
    # Five kinds of shm residue: NCCL, vLLM, torch, psm_ and a semaphore, all made by the real calls.
    names = {os.path.basename(p) for p in dead.info["shm"]}
    assert {n.split("-")[0].split("_")[0] for n in names} >= {"nccl", "vllm", "torch", "psm", "sem.mp"}
    assert r["summary"]["removed_bytes"] == sum(x["bytes"] for x in r["removed"]) > 0
    # Everything held stays, with its holder.
    held = {h["path"]: h for h in r["held"]}
    assert set(held) == {kept, *live.info["shm"], *live.info["sockets"], live.info["locks"][1]}
    assert all(exists(sb, p) for p in held)
    assert held[kept]["holders"] == [
        {
            "pid": daemon.ns_pid,
            "name": "nv-hostengine",
            "cmdline": held[kept]["holders"][0]["cmdline"],
            "protected": True,
            "protected_why": "protected daemon (nv-hostengine)",
            "container": None,
            "how": ["mmap"],
        }
    ]
    for p in live.info["shm"]:
        assert {h["pid"] for h in held[p]["holders"]} == {live.ns_pid} and "mmap" in held[p]["holders"][0]["how"]
    for p in live.info["sockets"]:
        assert held[p]["holders"][0]["pid"] == live.ns_pid and "bound" in held[p]["holders"][0]["how"]
    assert set(held[live.info["locks"][1]]["holders"][0]["how"]) == {"fd", "lock"}
    # Locks and directories are reported, not removed, by default: the live job's baton looks as orphaned as the dead one's.
    assert paths(r, "stale") == {*dead.info["locks"], live.info["locks"][0], *dead.info["dirs"], *live.info["dirs"]}
    assert all(exists(sb, p) for p in paths(r, "stale"))
    assert r["msg"].startswith(f"{len(orphans) - 3} stale segments and 3 sockets (")
    assert live.alive() and daemon.alive()
    # A second run changes nothing.
    again = mod("gpu_job_residue", options(work, cache))
    assert again["_status"] == "ok" and again["changed"] is False and again["removed"] == []
    assert paths(again, "held") == set(held)
    assert again["msg"].startswith("no stale residue")


def test_check_mode_lists_what_would_go_and_the_bytes_and_removes_nothing(mod, shm_sandbox, dirs) -> None:
    sb = shm_sandbox
    work, cache = dirs
    dead = spawn(sb, "job", "--tmp", work, "--cache", cache, "--kib", "1024")
    dead.kill()
    opts = options(work, cache, remove=["shm", "sockets", "locks", "dirs"])
    r = mod("gpu_job_residue", opts, check=True, diff=True)
    assert r["_status"] == "ok" and r["changed"] is True
    everything = {*dead.info["shm"], *dead.info["sockets"], *dead.info["locks"], *dead.info["dirs"]}
    assert paths(r, "removed") == everything
    assert all(exists(sb, p) for p in everything)
    assert r["summary"]["kinds"]["shm"]["bytes"] == dead.info["shm_bytes"] >= 3 * 1024 * 1024
    assert "would be removed" in r["msg"]
    assert sorted(r["diff"]["before"].split()) == sorted(everything) and r["diff"]["after"] == ""
    real = mod("gpu_job_residue", opts)
    assert real["changed"] is True and paths(real, "removed") == everything
    assert not any(exists(sb, p) for p in everything)
    assert real["summary"]["removed_bytes"] == r["summary"]["removed_bytes"]


def test_each_way_of_holding_keeps_a_file(mod, shm_sandbox, dirs) -> None:
    sb = shm_sandbox
    work, cache = dirs
    dead = spawn(sb, "job", "--tmp", work, "--cache", cache, "--segments", "6")
    dead.kill()
    shm = dead.info["shm"]
    baton, flock_file = dead.info["locks"]
    run_dir = dead.info["dirs"][0]
    holders = {
        "fd": spawn(sb, "hold", "--open", shm[0]),
        "mmap": spawn(sb, "hold", "--map", shm[1]),
        "lock": spawn(sb, "hold", "--ofd", shm[2], "--flock", baton),
        "cwd": spawn(sb, "hold", "--cwd", f"{run_dir}/"),
    }
    r = mod("gpu_job_residue", options(work, cache, remove=["shm", "sockets", "locks", "dirs"]))
    assert r["_status"] == "ok", r
    held = {h["path"]: h["holders"] for h in r["held"]}
    assert [h["how"] for h in held[shm[0]]] == [["fd"]] and held[shm[0]][0]["pid"] == holders["fd"].ns_pid
    assert [h["how"] for h in held[shm[1]]] == [["mmap"]]
    # An OFD lock belongs to no process in /proc/locks (pid -1); the fd that carries it names the holder.
    assert {tuple(h["how"]) for h in held[shm[2]]} == {("fd",), ("lock",)}
    assert {tuple(h["how"]) for h in held[baton]} == {("fd", "lock")}
    assert [h["how"] for h in held[run_dir]] == [["cwd"]]
    assert set(held) == {shm[0], shm[1], shm[2], baton, run_dir}
    assert paths(r, "removed") == {*shm[3:], *dead.info["sockets"], flock_file}
    assert all(exists(sb, p) for p in held) and not any(exists(sb, p) for p in paths(r, "removed"))


def test_symbolic_links_are_never_followed(mod, shm_sandbox, dirs) -> None:
    sb = shm_sandbox
    work, cache = dirs
    victims = work.parent / "victims"
    victims.mkdir()
    (victims / "nccl-victim").write_bytes(b"x" * 4096)
    (victims / "torchelastic_victim").mkdir()
    socket_dir = work.parent / "vs"
    socket_dir.mkdir()
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(socket_dir / "plasma_store"))
    s.close()  # a dead socket file: exactly what would be removed if it were reached
    # A symlinked entry in /dev/shm, a symlinked directory on a socket path, a symlinked run directory.
    os.symlink(victims / "nccl-victim", inside(sb, "/dev/shm/nccl-link"))
    (work / "ray" / "session_1").mkdir(parents=True)
    os.symlink(socket_dir, work / "ray" / "session_1" / "sockets")
    os.symlink(victims / "torchelastic_victim", work / "torchelastic_link")
    opts = options(work, cache, remove=["shm", "sockets", "dirs"])
    opts["sockets"].append(f"{work}/ray/session_*/sockets/*")
    r = mod("gpu_job_residue", opts)
    assert r["_status"] == "ok", r
    assert r["removed"] == [] and r["changed"] is False
    assert (victims / "nccl-victim").exists() and (victims / "torchelastic_victim").is_dir() and (socket_dir / "plasma_store").exists()
    assert os.path.islink(inside(sb, "/dev/shm/nccl-link"))
    # A directory reached through a real path is removed: the check above could have failed.
    real = work / "ray" / "session_2" / "sockets"
    real.mkdir(parents=True)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(real / "raylet"))
    s.close()
    r = mod("gpu_job_residue", opts)
    assert paths(r, "removed") == {f"{real}/raylet"}


def test_only_the_given_users_items_are_considered(mod, shm_sandbox, dirs) -> None:
    sb = shm_sandbox
    work, cache = dirs
    dead = spawn(sb, "job", "--kib", "16")
    dead.kill()
    theirs = dead.info["shm"][0]
    os.chown(inside(sb, theirs), 4321, 4321)
    r = mod("gpu_job_residue", options(work, cache, users=["root"]))
    assert r["_status"] == "ok", r
    assert theirs not in paths(r, "removed") and exists(sb, theirs)
    assert {s["path"]: s["why"] for s in r["ignored"]}[theirs] == "owned by uid 4321, not one of users"
    assert paths(r, "removed") == set(dead.info["shm"]) - {theirs}
    r = mod("gpu_job_residue", options(work, cache, users=["4321"]))
    assert paths(r, "removed") == {theirs}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"shm": ["dev/shm/nccl-*"]}, "shm: 'dev/shm/nccl-*' is not an absolute path glob"),
        ({"shm": ["/dev/shm/../../etc/*"]}, "shm: '/dev/shm/../../etc/*' contains '.' or '..'"),
        ({"dirs": ["/tmp/*"]}, "dirs: '/tmp/*' must end with a name that has literal characters"),
        ({"locks": ["/root/.cache/**"]}, "locks: '/root/.cache/**' must end with a name pattern"),
        ({"ports": [70000]}, "ports: 70000 is not a TCP port"),
        ({"containers": [42]}, "containers: 42 is not a valid Proxmox vmid"),
        ({"containers": [999]}, "containers: container 999 does not exist on"),
        ({"time_wait_timeout": -1}, "time_wait_timeout must be from 0 to 86400 seconds, got -1"),
        ({"time_wait_timeout": "nan"}, "time_wait_timeout must be a finite number from 0 to 86400 seconds, got nan"),
        ({"containers": [129], "pct_path": "/nonexistent/pct"}, "pct_path: /nonexistent/pct does not exist on this host"),
        ({"users": ["no-such-user-here"]}, "users: no user named 'no-such-user-here'"),
        ({"patterns": ["sglang(("]}, "patterns: 'sglang((' is not a valid regular expression"),
    ],
)
def test_bad_input_fails_clearly_and_removes_nothing(mod, shm_sandbox, tmp_path, args, message) -> None:
    dead = spawn(shm_sandbox, "job", "--kib", "16")
    dead.kill()
    (tmp_path / "node").write_text("pve1")
    r = mod("gpu_job_residue", args, env={"PCTSIM_DIR": str(tmp_path)})
    assert r["_status"] == "failed"
    assert message in r["msg"], r["msg"]
    assert r["reason"] in ("bad_arguments", "no_such_container")
    assert all(exists(shm_sandbox, p) for p in dead.info["shm"])
    assert_no_traceback(r)


# ---------------------------------------------------------------------- ports, zombies, container scope
def test_ports_are_classified_in_the_containers_network_namespace(node, tmp_path) -> None:
    registry = tmp_path / "pct"
    run = ModuleRunner(node, None)
    env = {"PCTSIM_DIR": str(registry)}
    with Container(vmid=129, registry=registry) as ct:
        # The same port numbers in the host's namespace are not the container's business.
        listener = ct.spawn("listen", "--port", "30000", "--comm", "sglang::schedul")
        ct.spawn("listen", "--port", "6379", "--comm", "gcs_server")
        ct.spawn("time-wait", "--port", "8000", "--count", "2")
        ct.spawn("connected", "--port", "8100")
        args = {
            "containers": [129],
            "ports": [30000, 6379, 8000, 8100, 9000],
            "patterns": ["^sglang::"],
            "fail_on": [],
            "shm": [],
            "sockets": [],
            "locks": [],
            "dirs": [],
        }
        r = run("gpu_job_residue", args, env=env)
        assert r["_status"] == "ok", r
        ports = {p["port"]: p for p in r["ports"]}
        assert {p: v["state"] for p, v in ports.items()} == {30000: "listening", 6379: "listening", 8000: "time_wait", 8100: "connected", 9000: "free"}
        assert all(v["container"] == 129 for v in ports.values())
        owner = ports[30000]["owners"][0]
        assert (owner["pid"], owner["name"], owner["address"], owner["kill_target"]) == (listener.pid, "sglang::schedul", "127.0.0.1:30000", True)
        assert ports[6379]["owners"][0]["name"] == "gcs_server" and ports[6379]["owners"][0]["kill_target"] is False
        assert ports[8000]["time_wait"] == 2 and ports[8000]["owners"] == [] and 0 < ports[8000]["remaining_s"] <= 60
        assert ports[8100]["connections"] >= 1 and ports[8100]["owners"][0]["listening"] is False
        assert "port 8000 (ct 129) in TIME_WAIT (2 socket(s), ~" in r["msg"] and "port 9000 (ct 129) free" in r["msg"]
        # Waiting for TIME_WAIT is bounded by time_wait_timeout, and says what is left.
        started = time.monotonic()
        r = run("gpu_job_residue", {**args, "ports": [8000], "time_wait_timeout": 1}, env=env)
        assert r["ports"][0]["state"] == "time_wait" and 1 <= r["ports"][0]["waited_s"] < 5
        assert time.monotonic() - started < 60  # generous: Ansible's start-up on a loaded 2-core machine
        # A live listener on a port the next server needs fails the module, naming the owner and what to do.
        r = run("gpu_job_residue", {**args, "fail_on": ["listening"]}, env=env)
        assert r["_status"] == "failed" and r["reason"] == "port_in_use"
        assert f"port 30000 in container 129 is still listened on by PID {listener.pid} (sglang::schedul)" in r["msg"]
        assert "run the kill phase (gpu_procs_kill) first" in r["msg"]
        assert {p["port"]: p["state"] for p in r["ports"]}[9000] == "free"
        assert listener.alive()  # the module signals nothing
        assert_no_traceback(r)


def test_a_port_in_time_wait_becomes_free_within_the_deadline(node, tmp_path) -> None:
    """The kernel's own TIME_WAIT (60 s on Linux, not tunable): waited for, then free. The one slow test here."""
    registry = tmp_path / "pct"
    run = ModuleRunner(node, None)
    env = {"PCTSIM_DIR": str(registry)}
    nothing = {"shm": [], "sockets": [], "locks": [], "dirs": []}
    with Container(vmid=133, registry=registry) as ct:
        ct.spawn("time-wait", "--port", "8000", "--count", "1")
        r = run("gpu_job_residue", {"containers": [133], "ports": [8000], "fail_on": ["time_wait"], **nothing}, env=env)
        assert r["_status"] == "failed" and r["reason"] == "port_time_wait", r
        left = r["ports"][0]["remaining_s"]
        assert "port 8000 in container 133 is still in TIME_WAIT (about" in r["msg"]
        r = run("gpu_job_residue", {"containers": [133], "ports": [8000], "time_wait_timeout": left + 15, "fail_on": ["time_wait"], **nothing}, env=env)
        assert r["_status"] == "ok", r
        assert r["ports"][0]["state"] == "free" and 0 < r["ports"][0]["waited_s"] <= left + 15
        assert "port 8000 (ct 133) free" in r["msg"]


def test_zombies_and_a_container_init_that_does_not_reap(node, tmp_path) -> None:
    registry = tmp_path / "pct"
    run = ModuleRunner(node, None)
    env = {"PCTSIM_DIR": str(registry)}
    host_parent = residue.start("zombies", "--count", "2", "--comm", "host-parent")
    try:
        with Container(vmid=131, registry=registry, reap=False) as ct:
            job = ct.spawn("zombies", "--count", "3", "--comm", "leaky-job")
            # The job dies: its three zombies and the job itself are re-parented to an init that never reaps.
            job.kill()
            parent = ct.spawn("zombies", "--count", "2", "--comm", "live-parent")
            assert wait_for(lambda: sum(1 for z in ct_zombies(ct) if z) >= 4)
            r = run("gpu_job_residue", {"containers": [131], "shm": [], "sockets": [], "locks": [], "dirs": []}, env=env)
            assert r["_status"] == "ok", r
            parents = {p["pid"]: p for p in r["non_reaping"]}
            assert parents[ct.init_pid]["init"] is True and parents[ct.init_pid]["zombies"] == 4
            assert (
                parents[ct.init_pid]["why"].startswith("PID 1 of container 131 (python")
                and "does not reap its children: 4 zombie(s)" in parents[ct.init_pid]["why"]
            )
            assert parents[parent.pid]["zombies"] == 2 and parents[parent.pid]["init"] is False
            assert host_parent.pid not in parents  # outside the scope
            assert {z["container"] for z in r["zombies"]} == {131} and len(r["zombies"]) == 6
            assert "6 zombie(s) under 2 non-reaping parent(s)" in r["msg"]
            # Nothing was signalled: the zombies and their parents are all still there.
            assert parent.alive() and len(ct_zombies(ct)) == 6
            # Without container scope the host's non-reaping parent shows too.
            r = run("gpu_job_residue", {"shm": [], "sockets": [], "locks": [], "dirs": []})
            assert host_parent.pid in {p["pid"] for p in r["non_reaping"]}
    finally:
        host_parent.kill()


def ct_zombies(ct: Container) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                fields = fh.read().rpartition(")")[2].split()
            if fields[0] == "Z" and os.stat(f"/proc/{fields[1]}/ns/pid").st_ino == ct.ns_inode:
                out.append(int(name))
        except OSError:
            continue
    return out


@needs_private_tmp
def test_container_scope_never_touches_the_hosts_dev_shm(node, tmp_path) -> None:
    registry = tmp_path / "pct"
    run = ModuleRunner(node, None)
    env = {"PCTSIM_DIR": str(registry)}
    # Orphans on the "hypervisor" (this namespace's /dev/shm and /tmp, pidns-run's private tmpfs).
    host_dead = residue.start("job", "--tmp", "/tmp", "--kib", "16")
    host_dead.kill()
    with Container(vmid=130, registry=registry) as ct, Container(vmid=132, registry=registry) as other:
        dead = ct.spawn("job", "--tmp", "/tmp", "--kib", "16")
        dead.kill()
        others = other.spawn("job", "--tmp", "/tmp", "--kib", "16")
        others.kill()
        # The container's own daemon maps one of its segments.
        ct.spawn("hold", "--comm", "dcgm-exporter", "--map", dead.info["shm"][0])
        r = run("gpu_job_residue", {"containers": [130], "min_age": 0}, env=env)
        assert r["_status"] == "ok", r
        assert paths(r, "removed") == (set(dead.info["shm"]) - {dead.info["shm"][0]}) | set(dead.info["sockets"])
        assert {x["container"] for x in r["removed"]} == {130}
        assert not any(os.path.lexists(ct.path(p)) for p in paths(r, "removed"))
        assert paths(r, "held") == {dead.info["shm"][0]}
        assert r["held"][0]["holders"][0]["name"] == "dcgm-exporter" and r["held"][0]["holders"][0]["protected"] is True
        # Same names on the host and in the other container: untouched.
        assert all(os.path.lexists(p) for p in host_dead.info["shm"] + host_dead.info["sockets"])
        assert all(os.path.lexists(other.path(p)) for p in others.info["shm"])
        # On the host they are orphans as well: a run there would have removed them.
        r = run("gpu_job_residue", {"remove": [], "min_age": 0})
        assert set(host_dead.info["shm"]) <= paths(r, "stale")


def start_thread_holder(sb, mode: str, path: str):
    """A process inside the sandbox one of whose threads, not the main one, holds ``path`` (support.threads)."""
    proc = sb.popen([sys.executable, "-c", THREAD_HOLDER, mode, path], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@needs_private_tmp
def test_what_a_thread_holds_stays_and_a_name_that_is_not_utf8_comes_back_escaped(mod, shm_sandbox, dirs) -> None:
    """Issue 26: segments only a thread held were removed; a name that is not UTF-8 lost the whole result."""
    sb = shm_sandbox
    work, cache = dirs
    held = {mode: f"/dev/shm/nccl-{mode}" for mode in ("files", "exit-fd", "exit-map")}
    for path in held.values():
        inside(sb, path).write_bytes(b"\0" * 4096)
    odd = os.fsencode(inside(sb, "/dev/shm")) + b"/nccl-\xff\xfe"
    os.close(os.open(odd, os.O_CREAT | os.O_WRONLY, 0o600))
    holders = {mode: start_thread_holder(sb, mode, path) for mode, path in held.items()}
    try:
        r = mod("gpu_job_residue", options(work, cache))
        assert r["_status"] == "ok", r
        assert_no_traceback(r)
        assert paths(r, "held") == set(held.values()) and all(exists(sb, p) for p in held.values())
        assert [(x["path"], x.get("path_escaped")) for x in r["removed"]] == [("/dev/shm/nccl-\\xff\\xfe", True)]
        assert not os.path.lexists(odd)
        assert r["zombies"] == []
    finally:
        for proc in holders.values():
            proc.kill()
            proc.wait()
