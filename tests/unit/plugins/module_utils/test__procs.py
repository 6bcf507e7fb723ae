"""_procs: patterns, users, and discovery's phases on made-up processes (the protection rules: test__protection.py)."""

from __future__ import annotations

import dataclasses
import os
import pwd
import re
import subprocess
import sys
import time
import typing as t
from pathlib import Path

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _procs, _proctable, _protection, _scope
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError


def facts(comm: str, cmdline: str = "", exe: str | None = None, argv: list[str] | None = None) -> _procs.ProcFacts:
    words = argv if argv is not None else (cmdline.split(" ") if cmdline else [])
    return _procs.ProcFacts(pid=100, comm=comm, cmdline=cmdline, exe=exe, uid=0, ppid=1, pgid=100, starttime=1, state="S", kernel=False, argv=words)


def test_an_empty_pattern_is_refused() -> None:
    with pytest.raises(CleanSlateError, match=r"^patterns: an empty pattern matches every process"):
        _procs.compile_patterns(["sglang", ""])
    assert [p.pattern for p in _procs.compile_patterns([".*"])] == [".*"]


def test_patterns_match_cmdline_comm_and_exe() -> None:
    pats = _procs.compile_patterns(["sglang|vllm", "torchrun$"])
    assert _procs.matches_patterns(facts("sglang::schedul", "sglang::scheduler_TP0"), pats) == "sglang|vllm"
    assert _procs.matches_patterns(facts("pt_main_thread", "VLLM::Worker_TP1"), pats) is None  # case matters
    assert _procs.matches_patterns(facts("torchrun", "", "/usr/local/bin/torchrun"), pats) == "torchrun$"
    assert _procs.matches_patterns(facts("bash", "bash -c sleep"), pats) is None


def test_bad_regex_names_the_option_and_the_pattern() -> None:
    with pytest.raises(CleanSlateError) as err:
        _procs.compile_patterns(["ok", "sglang(("])
    assert err.value.msg.startswith("patterns: 'sglang((' is not a valid regular expression")
    assert err.value.reason == "bad_arguments"


def test_users_resolve_names_and_uids() -> None:
    assert _procs.resolve_users([]) is None
    assert _procs.resolve_users(["root", "65534"]) == {0, 65534}
    with pytest.raises(CleanSlateError, match="users: no user named 'no-such-user-x'"):
        _procs.resolve_users(["no-such-user-x"])
    # A uid nobody has would select nothing and look clean.
    with pytest.raises(CleanSlateError, match=r"^users: no user with uid 987654 on this host"):
        _procs.resolve_users(["987654"])
    # What the caller looks at is evidence too: a dead job's files outlive its processes.
    assert _procs.resolve_users(["987654"], owners=lambda: {987654}) == {987654}
    with pytest.raises(CleanSlateError, match=r"no process runs as it, and it owns nothing this module looks at\)"):
        _procs.resolve_users(["987654"], owners=lambda: {1})


def test_a_uid_without_a_passwd_entry_counts_when_a_process_runs_as_it() -> None:
    """An unprivileged container's root is uid 100000+ on its Proxmox host, with no passwd entry there."""
    uid = 987653
    with pytest.raises(KeyError):
        pwd.getpwuid(uid)
    if os.geteuid() != 0:
        pytest.skip("needs root to start a process under another uid")
    with pytest.raises(CleanSlateError, match=r"^users: no user with uid 987653 on this host"):
        _procs.resolve_users([str(uid)])
    proc = subprocess.Popen(["sleep", "30"], user=uid, group=uid)
    try:
        assert _procs.resolve_users([str(uid)]) == {uid}
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def container() -> t.Iterator[_scope.Scope]:
    """A stand-in for an unprivileged container: a process in a user namespace mapped 0 -> 100000, as Proxmox's
    lxc.idmap does (its root file system is the host's, so its passwd is the host's)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to write a uid_map")
    proc = subprocess.Popen(["unshare", "--user", "sleep", "60"], stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and os.readlink(f"/proc/{proc.pid}/exe").rpartition("/")[2] != "sleep":
            time.sleep(0.01)
        Path(f"/proc/{proc.pid}/uid_map").write_text("0 100000 65536\n")
        yield _scope.Scope(vmid=129, init_pid=proc.pid, pidns=_proctable.pidns_inode(proc.pid))
    finally:
        proc.kill()
        proc.wait()


def test_users_in_a_container_are_the_containers_mapped_to_the_hosts_uids(container: _scope.Scope) -> None:
    """One resolve_users for the kill and the residue: in a container scope a name or uid means the container's."""
    cloud = pwd.getpwuid(1000).pw_name if _has_uid(1000) else None
    assert _procs.resolve_users(["root", "0"], container) == {100000}
    if cloud:
        assert _procs.resolve_users([cloud, "1000"], container) == {101000}
    with pytest.raises(CleanSlateError, match=r"^users: no user named 'no-such-user' in container 129"):
        _procs.resolve_users(["no-such-user"], container)
    # A uid the container does not know (not in its passwd, no process as it) is a typo, as on the host.
    with pytest.raises(CleanSlateError, match=r"^users: no user with uid 54321 in container 129"):
        _procs.resolve_users(["54321"], container)
    assert _procs.resolve_users(["54321"], container, owners=lambda: {154321}) == {154321}
    # A uid outside the container's map cannot own anything there.
    with pytest.raises(CleanSlateError, match=r"^users: uid 70000 of container 129 has no uid on this host"):
        _procs.resolve_users(["70000"], container)
    assert _procs.users_by_scope(["root"], [container]) == {129: {100000}}
    assert _procs.users_by_scope(["root"], []) == {None: {0}}
    assert _procs.users_by_scope([], [container]) is None


def test_the_kill_keeps_to_the_containers_users(container: _scope.Scope) -> None:
    """users: [root] with a container scope ends the container's root processes (host uid 100000), not the host's."""
    real = _procs.read_facts(container.init_pid)
    assert real is not None
    as_container_root = dataclasses.replace(real, uid=100000)
    for users, kept in ((_procs.users_by_scope(["root"], [container]), True), ({129: {0}}, False)):
        c = census([as_container_root], scopes=[container], users=users, kill_management_clients=True)
        c.cand(real.pid).reasons.append("matches pattern 'sleep'")
        plan = _procs.Plan()
        _procs.protect_and_filter(c, plan)
        assert [x.pid for x in plan.targets] == ([real.pid] if kept else [])
        assert plan.ignored == ([] if kept else [{"pid": real.pid, "why": "owned by uid 100000, not one of users"}])


def _has_uid(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


# ---------------------------------------------------------------------- discovery's phases, on a census of made-up processes
def proc(pid: int, ppid: int, pgid: int, comm: str = "python3", exe: str = "/usr/bin/python3", state: str = "S", kernel: bool = False) -> _procs.ProcFacts:
    return _procs.ProcFacts(pid=pid, comm=comm, cmdline=comm, exe=exe, uid=1000, ppid=ppid, pgid=pgid, starttime=pid, state=state, kernel=kernel, argv=[comm])


def census(procs: list[_procs.ProcFacts], guarded: dict[int, str] | None = None, **request) -> _procs.Census:
    req = _procs.Request(gpus=[], all_gpus=True, nvml_processes={}, protect=_protection.protect_list([], []), **request)
    return _procs.Census(
        req=req,
        facts={p.pid: p for p in procs},
        guarded=guarded or {},
        minor_to_index={},
        selected=set(),
        nvml_minors={},
        holders={},
        unreadable=set(),
    )


# A launcher (200) with a worker (201) and the worker's child (202), in process group 200; an unrelated process
# (300) in the same group as this module's stand-in (400, guarded); a daemon (500) with a child (501).
TREE = [
    proc(200, 1, 200, "torchrun"),
    proc(201, 200, 200),
    proc(202, 201, 200),
    proc(300, 1, 400),
    proc(400, 1, 400, "ansible-playbook"),
    proc(500, 1, 500, "nv-hostengine", exe="/usr/bin/nv-hostengine"),
    proc(501, 500, 500),
]


def test_children_are_added_with_the_root_that_lent_them() -> None:
    c = census(TREE, include_children=True)
    c.cand(200).reasons.append("matches pattern 'torchrun'")
    _procs.widen(c)
    assert {pid: cand.reasons for pid, cand in c.cands.items()} == {
        200: ["matches pattern 'torchrun'"],
        201: ["descendant of PID 200"],
        202: ["descendant of PID 200"],
    }


def test_a_protected_or_guarded_candidate_lends_nothing() -> None:
    c = census(TREE, guarded={400: "an ancestor of this module"}, include_children=True, process_group=True)
    for pid in (400, 500):
        c.cand(pid).reasons.append("matches pattern")
    _procs.widen(c)
    assert sorted(c.cands) == [400, 500]  # neither the daemon's child nor the module's group mates


def test_a_group_holding_the_module_is_never_widened_into() -> None:
    c = census(TREE, guarded={400: "this module's own process"}, process_group=True)
    c.cand(300).reasons.append("matches pattern")
    c.cand(200).reasons.append("matches pattern")
    _procs.widen(c)
    assert sorted(c.cands) == [200, 201, 202, 300]
    assert c.cands[202].reasons == ["in process group 200 of PID 200"]


def test_patterns_select_only_among_what_the_gpu_subset_found() -> None:
    c = census(TREE, patterns=[re.compile("^python3$")])
    _procs.from_patterns(c)
    assert sorted(c.cands) == [201, 202, 300, 501]
    subset = census(TREE, patterns=[re.compile("^python3$")])
    subset.req.all_gpus = False
    subset.cand(201).reasons.append("holds nvidia0 (fd+mmap)")
    _procs.from_patterns(subset)
    assert sorted(subset.cands) == [201] and subset.cands[201].reasons[-1] == "matches pattern '^python3$'"


def test_where_keeps_what_it_returns_and_names_the_rest() -> None:
    jmespath = pytest.importorskip("jmespath")
    c = census(TREE, where=jmespath.compile("[?pid > `201`]"))
    survivors = [c.cand(pid) for pid in (200, 201, 202)]
    plan = _procs.Plan()
    assert [x.pid for x in _procs.apply_where(c.req, plan, survivors)] == [202]
    assert plan.ignored == [{"pid": 200, "why": "filtered out by where"}, {"pid": 201, "why": "filtered out by where"}]
    c.req.where = jmespath.compile("length(@)")
    with pytest.raises(CleanSlateError) as err:
        _procs.apply_where(c.req, _procs.Plan(), survivors)
    assert (err.value.reason, err.value.details["option"]) == ("bad_arguments", "where")


def test_a_command_line_and_a_name_that_are_not_utf8_read_as_escaped_text() -> None:
    """The documented form of every name the modules report: a byte that is not UTF-8 as \\xNN, nothing lost."""
    script = "import sys, time; open('/proc/self/comm', 'wb').write(b'job-\\xff'); print('ready', flush=True); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", script, b"--model=\xff\xfe"], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        facts = _procs.read_facts(proc.pid)
        assert facts is not None
        assert facts.argv[-1] == "--model=\\xff\\xfe" and facts.cmdline.endswith(" --model=\\xff\\xfe")
        assert facts.comm == "job-\\xff"
        facts.cmdline.encode("utf-8")  # valid text
    finally:
        proc.kill()
        proc.wait()
