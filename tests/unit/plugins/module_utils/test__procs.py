"""Pure parts of _procs: protection by name, patterns, option validation."""

from __future__ import annotations

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _procs
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError


def facts(comm: str, cmdline: str = "", exe: str | None = None) -> _procs.ProcFacts:
    return _procs.ProcFacts(pid=100, comm=comm, cmdline=cmdline, exe=exe, uid=0, ppid=1, pgid=100, starttime=1, state="S", kernel=False)


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
    ],
)
def test_workers_are_not_protected(f: _procs.ProcFacts) -> None:
    assert _procs.protected_name(f, _procs.protect_list([], [])) is None


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
