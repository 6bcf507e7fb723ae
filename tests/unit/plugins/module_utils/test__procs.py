"""Pure parts of _procs: protection by name, patterns, option validation, and discovery's phases on made-up processes."""

from __future__ import annotations

import os
import re

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _procs, _scope
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError


def facts(comm: str, cmdline: str = "", exe: str | None = None, argv: list[str] | None = None) -> _procs.ProcFacts:
    words = argv if argv is not None else (cmdline.split(" ") if cmdline else [])
    return _procs.ProcFacts(pid=100, comm=comm, cmdline=cmdline, exe=exe, uid=0, ppid=1, pgid=100, starttime=1, state="S", kernel=False, argv=words)


@pytest.mark.parametrize(
    ("f", "expected"),
    [
        (facts("nvidia-persiste", "/usr/bin/nvidia-persistenced --user nvidia-persistenced", "/usr/bin/nvidia-persistenced"), "nvidia-persistenced"),
        (facts("nv-hostengine", "/usr/bin/nv-hostengine -n", "/usr/bin/nv-hostengine"), "nv-hostengine"),
        (facts("dcgm-exporter", "/usr/bin/dcgm-exporter", "/usr/bin/dcgm-exporter"), "dcgm-exporter"),
        (facts("nv-fabricmanage", "/usr/bin/nv-fabricmanager -c /etc/fm.cfg", "/usr/bin/nv-fabricmanager"), "nv-fabricmanager"),
        (facts("Xorg", "/usr/lib/xorg/Xorg :0", "/usr/lib/xorg/Xorg"), "Xorg"),
        (facts("qemu-system-x86", "/usr/bin/qemu-system-x86_64 -id 100", "/usr/bin/qemu-system-x86_64"), "qemu-system-*"),
        (facts("sshd", "sshd: root@pts/0", "/usr/sbin/sshd"), "sshd"),
        (facts("systemd-journal", "/lib/systemd/systemd-journald", "/lib/systemd/systemd-journald"), "systemd-*"),
        # comm is cut at 15 characters, the rest of the identity is a copy under another path
        (facts("nvidia-persiste", "", "/opt/sim/bin/nvidia-persistenced (deleted)"), "nvidia-persistenced"),
    ],
)
def test_protected_daemons_are_recognised(f: _procs.ProcFacts, expected: str) -> None:
    assert _procs.protected_name(f, _procs.protect_list([], [])) == expected


@pytest.mark.parametrize(
    "f",
    [
        facts("python3", "python3 -m sglang.launch_server --model x", "/usr/bin/python3.11"),
        facts("sglang::schedul", "sglang::scheduler_TP0", "/usr/bin/python3.11"),
        facts("pt_main_thread", "VLLM::Worker_TP1", "/usr/bin/python3.11"),
        facts("Xorgish", "Xorgish", "/opt/Xorgish"),
        # A borrowed name protects nothing: exec -a, a title (comm cut at 15 characters), a Python job under either.
        facts("gpusim-worker", "nvidia-persistenced --gpu 0", "/opt/sim/bin/gpusim-worker"),
        facts("nvidia-persiste", "nvidia-persistenced", "/opt/sim/bin/gpusim-worker"),
        facts("nvidia-persiste", "nvidia-persistenced", "/usr/bin/python3.11"),
        facts("python3", "nvidia-persistenced job.py", "/usr/bin/python3.11"),
        facts("dcgm-exporter", "dcgm-exporter", "/usr/bin/python3.11"),
        # Only perl may run under a Proxmox daemon's name.
        facts("pvedaemon worke", "pvedaemon worker", "/usr/bin/python3.11", argv=["pvedaemon worker"]),
    ],
)
def test_workers_are_not_protected(f: _procs.ProcFacts) -> None:
    assert _procs.protected_name(f, _procs.protect_list([], [])) is None


def test_what_a_process_is_decides() -> None:
    defaults = _procs.protect_list([], [])
    # Proxmox's Perl daemons name themselves through $0.
    pve = facts("pvedaemon worke", "pvedaemon worker", "/usr/bin/perl", argv=["pvedaemon worker"])
    assert _procs.protection(pve, defaults) == ("pvedaemon*", "")
    # A user's entry matches a script run by an interpreter, by the script's name, not its title.
    exporter = facts("python3", "/usr/bin/python3 -u /opt/my-exporter.py --port 9400", "/usr/bin/python3.11")
    assert _procs.protected_name(exporter, _procs.protect_list(["my-exporter*"], [])) == "my-exporter*"
    assert _procs.protected_name(facts("my-exporter", "my-exporter", "/usr/bin/python3.11"), _procs.protect_list(["my-exporter*"], [])) is None
    # An executable that cannot be read (a zombie, another user's process): names count, on the safe side.
    unknown = facts("nvidia-persiste", "", None, argv=[])
    assert _procs.protection(unknown, defaults) == ("nvidia-persistenced", "by name, its executable cannot be read")
    assert _procs.protection(facts("python3", "python3 train.py", None), defaults) == (None, "")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["python3", "-c", "print(1)"], None),
        (["python3", "-u", "-W", "ignore", "/opt/a.py", "-c", "x"], "a.py"),
        (["python3", "-m", "sglang.launch_server", "--tp", "8"], "sglang.launch_server"),
        (["bash", "-o", "pipefail", "/opt/run.sh"], "run.sh"),
        (["python3"], None),
        (["perl", "--", "/usr/bin/pvedaemon"], "pvedaemon"),
    ],
)
def test_script_name(argv: list[str], expected: str | None) -> None:
    assert _procs.script_name(argv) == expected


PY = "/work/.venv/bin/python"
TMP = "/root/.ansible/tmp/ansible-tmp-1796095109.17-14-797"


@pytest.mark.parametrize(
    ("argv", "parent", "expected"),
    [
        # The controller and its forked workers (same command line), other entry points, python -m.
        ([PY, "/work/.venv/bin/ansible-playbook", "-i", "inv", "site.yml"], None, "an Ansible program (ansible-playbook"),
        (["/usr/bin/python3", "/usr/bin/ansible-connection"], None, "an Ansible program (ansible-connection"),
        (["/usr/bin/python3.11", "/usr/local/bin/ansible-runner", "run", "/runner"], None, "an Ansible program (ansible-runner"),
        (["python3", "-m", "ansible", "playbook", "site.yml"], None, "an Ansible program (ansible:"),
        (["/usr/local/bin/ansible", "all", "-m", "ping"], None, "an Ansible program (ansible:"),
        # Async wrapper, module payloads, the become wrapper and its sudo.
        ([PY, f"{TMP}/async_wrapper.py", "j1", "30", "false", f"{TMP}/AnsiballZ_command.py"], None, "an Ansible module, async wrapper"),
        ([PY, f"{TMP}/AnsiballZ_gpu_procs_kill.py"], None, "an Ansible module, async wrapper"),
        (
            ["sudo", "-H", "-S", "-n", "-u", "root", "/bin/sh", "-c", "echo BECOME-SUCCESS-abc ; /usr/bin/python3"],
            None,
            "an Ansible module, async wrapper, become wrapper",
        ),
        # SSH connections to other hosts: the clients and their ControlPersist master, in Ansible's control path.
        (["ssh", "-C", "-o", "ControlMaster=auto", "-o", "ControlPath=/root/.ansible/cp/3f2a9c", "gpu-node-2"], None, "an Ansible module, async wrapper"),
        (["ssh: /root/.ansible/cp/3f2a9c [mux]"], None, "an Ansible module, async wrapper, become wrapper or SSH connection"),
        # A pipelined module: the shells (local connection nests two) and the bare interpreter under them.
        (["/bin/sh", "-c", f"/bin/sh -c {PY}"], None, "Ansible's shell for a pipelined module"),
        (["/bin/sh", "-c", f"{PY} && sleep 0"], None, "Ansible's shell for a pipelined module"),
        ([PY], ["/bin/sh", "-c", PY], "a pipelined Ansible module"),
        (["/usr/bin/python3"], ["/bin/sh", "-c", "echo BECOME-SUCCESS-abc ; /usr/bin/python3"], "a pipelined Ansible module"),
        # Not Ansible: jobs and shells that merely mention it, an interpreter under any other shell.
        (["python3", "-m", "sglang.launch_server"], None, None),
        (["python3", "-c", "import time  # ansible-worker"], None, None),
        (["/bin/sh", "-c", "ansible-playbook site.yml"], None, None),
        (["/bin/sh", "-c", "python3 train.py"], None, None),
        ([PY], ["/bin/bash", "-l"], None),
        (["vllm", "serve", "ansible/model"], None, None),
        ([], None, None),
    ],
)
def test_ansible_processes_are_recognised(argv: list[str], parent: list[str] | None, expected: str | None) -> None:
    found = _procs.ansible_process(argv, parent)
    if expected is None:
        assert found is None
    else:
        assert found is not None and found.startswith(expected), found


def test_an_empty_pattern_is_refused() -> None:
    with pytest.raises(CleanSlateError, match=r"^patterns: an empty pattern matches every process"):
        _procs.compile_patterns(["sglang", ""])
    assert [p.pattern for p in _procs.compile_patterns([".*"])] == [".*"]


def test_protect_extends_and_unprotect_shrinks_only_explicitly() -> None:
    names = _procs.protect_list(["my-exporter"], ["Xorg"])
    assert "my-exporter" in names and "Xorg" not in names and "nvidia-persistenced" in names
    with pytest.raises(CleanSlateError, match="unprotect: python3 is not in the default protect list"):
        _procs.protect_list([], ["python3"])


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


def test_a_uid_without_a_passwd_entry_counts_when_a_process_runs_as_it() -> None:
    """An unprivileged container's root is uid 100000+ on its Proxmox host, with no passwd entry there."""
    import pwd
    import subprocess

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


# ---------------------------------------------------------------------- discovery's phases, on a census of made-up processes
def proc(pid: int, ppid: int, pgid: int, comm: str = "python3", exe: str = "/usr/bin/python3", state: str = "S", kernel: bool = False) -> _procs.ProcFacts:
    return _procs.ProcFacts(pid=pid, comm=comm, cmdline=comm, exe=exe, uid=1000, ppid=ppid, pgid=pgid, starttime=pid, state=state, kernel=kernel, argv=[comm])


def census(procs: list[_procs.ProcFacts], guarded: dict[int, str] | None = None, **request) -> _procs.Census:
    req = _procs.Request(gpus=[], all_gpus=True, nvml_processes={}, protect=_procs.protect_list([], []), **request)
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


@pytest.mark.parametrize(
    ("pid", "guarded", "scopes", "expected"),
    [
        (1, {}, [], "PID 1 of its namespace (an init)"),
        (400, {400: "this module's own process"}, [], "this module's own process"),
        (500, {}, [], "protected daemon (nv-hostengine)"),
        (201, {}, [_scope.Scope(vmid=129, init_pid=4000, pidns=77)], "outside the container scope (129)"),
        (201, {}, [], None),
    ],
)
def test_protection_comes_first_whatever_selected_the_candidate(pid, guarded, scopes, expected) -> None:
    c = census([*TREE, proc(1, 0, 1, "init", exe="/sbin/init")], guarded=guarded, scopes=scopes)
    cand = c.cand(pid)
    cand.pidns = 99
    assert _procs.protection_reason(c.req, cand, c.guarded, c.holders) == expected


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
