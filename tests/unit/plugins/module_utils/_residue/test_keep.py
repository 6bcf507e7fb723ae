"""_residue.keep: what is kept although nothing holds it (a live named creator, a file younger than min_age), a compile
lock whose directory a process works in; and the new options refused before anything is looked at (under
tools/pidns-run: pids are forced with ns_last_pid)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import typing as t
from pathlib import Path

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError
from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue import keep, module, walk


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"])


def segments(tmp: Path, **kw: t.Any) -> module.Request:
    return module.Request(globs=[walk.parse_glob("shm", f"{tmp}/*")], remove={"shm"}, **kw)


def test_a_name_whose_creator_lives_is_kept_one_whose_creator_died_goes(short_tmp: Path) -> None:
    live = sleeper()
    try:
        # torch's ref counter of a live process: nothing holds it (as on the H200), its creator lives.
        (short_tmp / f"torch_{live.pid}_2399602362_1").write_bytes(b"x")
        # SGLang's queue and the CUDA driver's segment (pid in hex) of processes that are gone.
        gone = dead_pid()
        (short_tmp / f"sgl_shm_mq_{gone}_4ad13bf3").write_bytes(b"x")
        (short_tmp / f"cuda.shm.0.{gone:x}.1").write_bytes(b"x")
        # The pid of a dead creator, taken since by a process that started after the file last changed.
        reused = dead_pid()
        (short_tmp / f"multi_tokenizer_args_{reused}").write_bytes(b"x")
        time.sleep(0.05)  # more than a clock tick between the file and the newcomer
        with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
            fh.write(str(reused - 1))
        newcomer = sleeper()
        try:
            assert newcomer.pid == reused, "could not force the pid to be reused"
            # min_age does not keep a file whose named creator is gone: the files were made a moment ago.
            check = module.run(segments(short_tmp, min_age=600), check_mode=True)
            r = module.run(segments(short_tmp, min_age=600), check_mode=False)
        finally:
            newcomer.kill()
            newcomer.wait()
        for result in (check, r):  # check mode says what the run does
            [kept] = result["kept"]
            assert kept["path"] == f"{short_tmp}/torch_{live.pid}_2399602362_1"
            assert kept["creator"] == {"pid": live.pid, "name": "sleep"}
            assert kept["why"] == f"its creator, PID {live.pid} (sleep), is alive; kept while it lives"
            assert {os.path.basename(x["path"]) for x in result["removed"]} == {
                f"sgl_shm_mq_{gone}_4ad13bf3",
                f"cuda.shm.0.{gone:x}.1",
                f"multi_tokenizer_args_{reused}",
            }
            assert result["summary"]["kept"] == 1 and result["summary"]["kinds"]["shm"]["kept"] == 1
        assert "1 unheld but kept (a live creator, or younger than min_age)" in r["msg"]
        assert os.listdir(short_tmp) == [f"torch_{live.pid}_2399602362_1"]
    finally:
        live.kill()
        live.wait()


def test_a_file_younger_than_min_age_is_kept_and_check_mode_agrees(short_tmp: Path) -> None:
    (short_tmp / "nccl-AbC123").write_bytes(b"x" * 4096)
    for check_mode in (True, False):
        r = module.run(segments(short_tmp, min_age=600), check_mode=check_mode)
        assert r["removed"] == [] and [x["path"] for x in r["kept"]] == [f"{short_tmp}/nccl-AbC123"]
        assert r["kept"][0]["why"].startswith("younger than min_age (") and r["kept"][0]["why"].endswith(
            " s < 600 s): a process starting now may not hold it yet"
        )
    assert (short_tmp / "nccl-AbC123").exists()
    # The same file judged as of 601 s later (the rule's clock, without waiting): orphaned.
    items, walkers = walk.collect(segments(short_tmp).globs, walk.open_roots([]), [])
    try:
        [item] = items
        changed = item.changed_ns()
        assert changed is not None
        keep.apply(items, {None: walk.open_roots([])[0]}, 600, now_ns=changed + 599 * 10**9)
        assert item.verdict == "kept"
        item.verdict = "remove"
        keep.apply(items, {None: walk.open_roots([])[0]}, 600, now_ns=changed + 601 * 10**9)
        assert item.verdict == "remove"
    finally:
        for w in walkers:
            w.close()


def test_a_directory_is_as_young_as_the_newest_thing_in_it(short_tmp: Path) -> None:
    run = short_tmp / "torchelastic_x" / "attempt_0"
    run.mkdir(parents=True)
    old = time.time() - 3600
    for path in (run, run.parent):
        os.utime(path, (old, old))
    (run / "error.json").write_text("{}")
    req = module.Request(globs=[walk.parse_glob("dirs", f"{short_tmp}/torchelastic_*")], remove={"dirs"}, min_age=600)
    r = module.run(req, check_mode=False)
    assert [x["path"] for x in r["kept"]] == [f"{short_tmp}/torchelastic_x"] and (run / "error.json").exists()


def test_a_compile_lock_whose_directory_a_process_works_in_is_held(short_tmp: Path, hold) -> None:
    build = short_tmp / "torch_extensions" / "py311_cu124" / "fused_adam"
    build.mkdir(parents=True)
    (build / "lock").write_bytes(b"")  # FileBaton: O_CREAT|O_EXCL, never held open
    other = short_tmp / "torch_extensions" / "py311_cu124" / "idle"
    other.mkdir()
    (other / "lock").write_bytes(b"")
    ninja = hold("cwd", build)  # torch runs ninja with cwd=build_directory
    req = module.Request(globs=[walk.parse_glob("locks", f"{short_tmp}/torch_extensions/**/lock")], remove={"locks"})
    r = module.run(req, check_mode=False)
    [held] = r["held"]
    assert held["path"] == f"{build}/lock" and held["holders"][0]["pid"] == ninja.pid and held["holders"][0]["how"] == ["cwd in its directory"]
    assert [x["path"] for x in r["removed"]] == [f"{other}/lock"]
    assert (build / "lock").exists() and not (other / "lock").exists()


def test_compile_locks_go_only_when_asked_unheld_by_any_lock_and_older_than_min_age(short_tmp: Path, hold) -> None:
    """torch's O_CREAT|O_EXCL baton, flashinfer's, triton's and vLLM's FileLocks, each held a different way."""
    locks = {
        "baton": short_tmp / "torch_extensions" / "py311_cu124" / "fused_adam" / "lock",
        "flock": short_tmp / "flashinfer" / "90a" / "cached_ops" / "norm.lock",
        "posix": short_tmp / "triton" / "cache" / "abc" / "kernel.lock",
        "ofd": short_tmp / "vllm" / "torch_compile_cache" / "rank_0" / "cache.lock",
        "young": short_tmp / "vllm" / "torch_compile_cache" / "rank_1" / "cache.lock",
    }
    made = time.monotonic()
    for path in locks.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        if path != locks["young"]:
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644))  # as FileBaton makes its lock
    holders = {name: hold(name, locks[name]) for name in ("flock", "posix", "ofd")}
    # A file's ctime cannot be set back: the others age past min_age (2 s), then the young one is made.
    time.sleep(max(0.0, made + 2.2 - time.monotonic()))
    os.close(os.open(locks["young"], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644))
    globs = [walk.parse_glob("locks", f"{short_tmp}/**/lock"), walk.parse_glob("locks", f"{short_tmp}/**/*.lock")]
    # Not asked: every orphan is only reported (stale), held or young ones as such.
    r = module.run(module.Request(globs=globs, remove={"shm"}, min_age=2), check_mode=False)
    assert [x["path"] for x in r["stale"]] == [str(locks["baton"])] and r["removed"] == []
    for check_mode in (True, False):
        r = module.run(module.Request(globs=globs, remove={"locks"}, min_age=2), check_mode=check_mode)
        # Held by flock, by a POSIX lock and by an OFD lock (which belongs to no pid: the fd names the holder).
        held = {x["path"]: {h["pid"] for h in x["holders"]} - {None} for x in r["held"]}
        assert held == {str(locks[n]): {holders[n].pid} for n in holders}, r["held"]
        assert all(any("lock" in h["how"] for h in x["holders"]) for x in r["held"])
        assert [x["path"] for x in r["kept"]] == [str(locks["young"])] and r["kept"][0]["why"].startswith("younger than min_age")
        assert [x["path"] for x in r["removed"]] == [str(locks["baton"])]
    assert [name for name, path in locks.items() if path.exists()] == ["flock", "posix", "ofd", "young"]


def residue_params(**kw: t.Any) -> dict[str, t.Any]:
    p: dict[str, t.Any] = {kind: [] for kind in walk.KINDS}
    p.update(remove=["shm"], users=[], containers=[], pct_path=None, ports=[], time_wait_timeout=0.0, patterns=[], protect=[])
    p.update(fail_on=["listening"], list_limit=200, min_age=60.0, roots=list(walk.DEFAULT_ROOTS))
    p.update(kw)
    return p


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("min_age", -1.0, "min_age must be from 0 to 86400 seconds, got -1"),
        ("min_age", float("nan"), "min_age must be a finite number"),
        ("min_age", float("inf"), "min_age must be a finite number"),
        ("roots", ["/"], "roots: '/' is the root directory"),
        ("roots", ["/etc"], "roots: '/etc' is a system directory"),
        ("roots", ["/var/lib/docker"], "roots: '/var/lib/docker' is a system directory"),
        ("roots", ["tmp"], "roots: 'tmp' is not an absolute directory"),
        ("roots", ["/tmp/*"], "roots: '/tmp/*' is not an absolute directory without globs"),
        ("shm", ["/etc/*"], "shm: '/etc/*' is outside the roots (/dev/shm, /tmp, /var/tmp, /root, /home)"),
        ("locks", ["/sgl-workspace/aiter/jit/build/lock_*"], "locks: '/sgl-workspace/aiter/jit/build/lock_*' is outside the roots"),
        ("dirs", ["/tmp"], "dirs: '/tmp' is outside the roots"),
    ],
)
def test_bad_ages_and_patterns_outside_the_roots_are_refused_before_anything_is_looked_at(option: str, value: t.Any, words: str) -> None:
    looked_up: list[int] = []
    with pytest.raises(CleanSlateError) as err:
        module.build_request(residue_params(**{option: value}), lambda: looked_up.append(1) or [])
    assert err.value.reason == "bad_arguments" and err.value.details["option"] == option and looked_up == []
    assert words in err.value.msg, err.value.msg


def test_the_defaults_lie_under_the_default_roots_and_a_root_can_be_added() -> None:
    defaults = {kind: list(g) for kind, g in zip(walk.KINDS, (walk.DEFAULT_SHM, walk.DEFAULT_SOCKETS, walk.DEFAULT_LOCKS, walk.DEFAULT_DIRS))}
    req = module.build_request(residue_params(**defaults), list)
    assert req.min_age == 60.0 and len(req.globs) == sum(len(g) for g in defaults.values())
    req = module.build_request(residue_params(locks=["/sgl-workspace/aiter/jit/build/lock_*"], roots=[*walk.DEFAULT_ROOTS, "/sgl-workspace"]), list)
    assert [g.pattern for g in req.globs] == ["/sgl-workspace/aiter/jit/build/lock_*"]


@pytest.mark.parametrize(
    ("name", "pid"),
    [
        ("sgl_shm_mq_1234_abcd1234", 1234),
        ("sgl_shm_xputensor_77_0a1b2c3d", 77),
        ("multi_tokenizer_args_5678", 5678),
        ("torch_733_2399602362_1", 733),
        ("torch_2952_1126906123", 2952),
        ("cuda.shm.0.2dd.1", 0x2DD),
        ("sgl_shm_mm_0_abcd1234", None),
        ("sgl_shm_garbage", None),
        ("psm_deadbeef", None),
        ("nccl-AbC123", None),
    ],
)
def test_the_creator_pid_is_read_as_each_source_writes_it(name: str, pid: int | None) -> None:
    assert walk.creator_pid(name) == pid


# ---------------------------------------------------------------------- issue 38
def test_a_file_its_server_opens_only_while_in_use_is_kept_while_the_server_runs(short_tmp: Path) -> None:
    # A torch FileStore: opened per operation, so nothing holds it while its vLLM runs.
    store = short_tmp / ("vllm_dist_" + "0" * 32)
    store.write_bytes(b"\x08\0\0\0cnt_0000")
    rule = {"server": "vllm", "paths": [f"{short_tmp}/vllm_dist_*"], "patterns": [f"^VLLM::EngineCore {short_tmp.name} "]}
    req = module.Request(globs=[walk.parse_glob("files", f"{short_tmp}/vllm_dist_*")], remove={"files"}, keep_while=module.parse_keep_while([rule]))
    server = subprocess.Popen(["bash", "-c", f'exec -a "VLLM::EngineCore {short_tmp.name}" sleep 60'])
    try:
        deadline = time.monotonic() + 10
        # Until bash has exec'd, its own cmdline holds the title inside its -c argument: wait for
        # the title to be argv[0], which is what the pattern reads.
        while not Path(f"/proc/{server.pid}/cmdline").read_bytes().startswith(b"VLLM::"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = module.run(req, check_mode=False)
        [kept] = r["kept"]
        assert kept["why"].startswith(f"a process of vllm runs, PID {server.pid} (sleep)") and store.exists(), kept
    finally:
        server.kill()
        server.wait()
    r = module.run(req, check_mode=False)  # no vLLM process runs any more: nothing can use it
    assert [x["path"] for x in r["removed"]] == [str(store)] and not store.exists()


def test_what_this_runs_kill_released_goes_whatever_its_age(short_tmp: Path) -> None:
    young = short_tmp / "sgl_shm_mq_x"  # no pid in its name (no creator rule), made a moment ago
    young.write_bytes(b"x")
    holder = subprocess.Popen([sys.executable, "-c", f"import time; f = open({str(young)!r}); time.sleep(60)"])
    other = short_tmp / "nccl-young"
    other.write_bytes(b"x")  # nobody was seen holding it: min_age keeps protecting it
    try:
        deadline = time.monotonic() + 10
        while not any(os.path.realpath(f"/proc/{holder.pid}/fd/{fd}") == str(young) for fd in os.listdir(f"/proc/{holder.pid}/fd")):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        req = segments(short_tmp, min_age=600)
        before = module.holders_before(req)
        ident = keep_ident(holder.pid)
        assert before == {(os.stat(young).st_dev, os.stat(young).st_ino): frozenset({ident})}
        # Check mode: the kill only plans to end the holder, which still holds the file; the run removes it after.
        check = module.run(req, check_mode=True, handoff=module.Handoff(before=before, ended=frozenset({ident})))
        assert [(x["path"], x["released_by"]) for x in check["held"]] == [(str(young), [holder.pid])] and check["removed"] == []
        assert "1 of them held only by what the kill ends (removed after it)" in check["msg"]
        assert [x["path"] for x in check["kept"]] == [str(other)]
    finally:
        holder.kill()
        holder.wait()
    r = module.run(req, check_mode=False, handoff=module.Handoff(before=before, ended=frozenset({ident})))
    assert [(x["path"], x["released_by"]) for x in r["removed"]] == [(str(young), [holder.pid])] and not young.exists()
    assert [x["path"] for x in r["kept"]] == [str(other)]
    # A holder that ended otherwise (not by this run's kill) releases nothing: min_age keeps the file.
    young.write_bytes(b"x")
    assert module.run(req, check_mode=False, handoff=module.Handoff(before={}, ended=frozenset({ident})))["removed"] == []


def keep_ident(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/stat") as fh:
        return (pid, int(fh.read().rpartition(")")[2].split()[19]))


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("keep_while", [{"server": "x", "paths": ["/etc/x"], "patterns": ["a"]}], "keep_while: '/etc/x' is outside the roots"),
        ("keep_while", [{"server": "x", "paths": ["/tmp/x"], "patterns": []}], "keep_while: the rule for 'x' names no patterns"),
        ("keep_while", [{"server": "x", "paths": ["/tmp/x"], "patterns": ["("]}], "keep_while: '(' is not a valid regular expression"),
        ("server_ports", [{"port": 70000, "server": "vllm"}], "server_ports: 70000 is not a TCP port (1-65535)"),
        ("dirs_holding", [{"dir": "/etc/tmp????????", "files": "*_1.db"}], "dirs_holding: '/etc/tmp????????' is outside the roots"),
        ("files", ["/etc/vllm_dist_*"], "files: '/etc/vllm_dist_*' is outside the roots"),
    ],
)
def test_the_profiles_options_are_refused_before_anything_is_looked_at(option: str, value: t.Any, words: str) -> None:
    looked_up: list[int] = []
    with pytest.raises(CleanSlateError) as err:
        module.build_request(residue_params(**{option: value}), lambda: looked_up.append(1) or [])
    assert err.value.reason == "bad_arguments" and err.value.details["option"] == option and looked_up == []
    assert words in err.value.msg, err.value.msg
