"""_protection: every rule that keeps a process from being signalled, on made-up processes.

Real processes: tests/functional/test_protection.py (Ansible's own processes under async, daemons by executable)
and tests/host (the modules in the initial PID namespace).
"""

from __future__ import annotations

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _procs, _proctable, _protection, _scope
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
    assert _protection.protected_name(f, _protection.protect_list([], [])) == expected


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
    assert _protection.protected_name(f, _protection.protect_list([], [])) is None


def test_what_a_process_is_decides() -> None:
    defaults = _protection.protect_list([], [])
    # Proxmox's Perl daemons name themselves through $0.
    pve = facts("pvedaemon worke", "pvedaemon worker", "/usr/bin/perl", argv=["pvedaemon worker"])
    assert _protection.protection(pve, defaults) == ("pvedaemon*", "")
    # A user's entry matches a script run by an interpreter, by the script's name, not its title.
    exporter = facts("python3", "/usr/bin/python3 -u /opt/my-exporter.py --port 9400", "/usr/bin/python3.11")
    assert _protection.protected_name(exporter, _protection.protect_list(["my-exporter*"], [])) == "my-exporter*"
    assert _protection.protected_name(facts("my-exporter", "my-exporter", "/usr/bin/python3.11"), _protection.protect_list(["my-exporter*"], [])) is None
    # An executable that cannot be read (a zombie, another user's process): names count, on the safe side.
    unknown = facts("nvidia-persiste", "", None, argv=[])
    assert _protection.protection(unknown, defaults) == ("nvidia-persistenced", "by name, its executable cannot be read")
    assert _protection.protection(facts("python3", "python3 train.py", None), defaults) == (None, "")


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
    assert _protection.script_name(argv) == expected


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
    found = _protection.ansible_process(argv, parent)
    if expected is None:
        assert found is None
    else:
        assert found is not None and found.startswith(expected), found


def test_protect_extends_and_unprotect_shrinks_only_explicitly() -> None:
    names = _protection.protect_list(["my-exporter"], ["Xorg"])
    assert "my-exporter" in names and "Xorg" not in names and "nvidia-persistenced" in names
    with pytest.raises(CleanSlateError, match="unprotect: python3 is not in the default protect list"):
        _protection.protect_list([], ["python3"])


@pytest.mark.parametrize(
    ("pid", "f", "nspid", "guarded", "kw", "expected"),
    [
        (1, facts("init", "/sbin/init", "/sbin/init"), [1], {}, {}, "PID 1 of its namespace (an init)"),
        (4000, facts("init", "/sbin/init", "/sbin/init"), [4000, 1], {}, {}, "PID 1 of its namespace (an init)"),
        (
            2,
            _procs.ProcFacts(pid=2, comm="kthreadd", cmdline="", exe=None, uid=0, ppid=0, pgid=0, starttime=1, state="S", kernel=True),
            [2],
            {},
            {},
            "kernel thread",
        ),
        (400, facts("python3", "x", "/usr/bin/python3"), [400], {400: "this module's own process"}, {}, "this module's own process"),
        (500, facts("nv-hostengine", "nv-hostengine", "/usr/bin/nv-hostengine"), [500], {}, {}, "protected daemon (nv-hostengine)"),
        # Rules 1-4 come before the scope: a daemon outside the scope is named for what it is.
        (
            500,
            facts("nv-hostengine", "nv-hostengine", "/usr/bin/nv-hostengine"),
            [500],
            {},
            {"scopes": [_scope.Scope(vmid=129, init_pid=4000, pidns=77)], "pidns": 99},
            "protected daemon (nv-hostengine)",
        ),
        (
            201,
            facts("python3", "x", "/usr/bin/python3"),
            [201],
            {},
            {"scopes": [_scope.Scope(vmid=129, init_pid=4000, pidns=77)], "pidns": 99},
            "outside the container scope (129)",
        ),
        (201, facts("python3", "x", "/usr/bin/python3"), [201], {}, {"scopes": [_scope.Scope(vmid=129, init_pid=4000, pidns=77)], "pidns": 77}, None),
        (
            201,
            facts("nvidia-smi", "nvidia-smi", "/usr/bin/nvidia-smi"),
            [201],
            {},
            {"holding": _proctable.Holding(gpu_fds={0})},
            "management client (holds device files but maps none); set kill_management_clients: true to end it",
        ),
        (
            201,
            facts("nvidia-smi", "nvidia-smi", "/usr/bin/nvidia-smi"),
            [201],
            {},
            {"holding": _proctable.Holding(gpu_fds={0}), "kill_management_clients": True},
            None,
        ),
        (201, facts("nvidia-smi", "nvidia-smi", "/usr/bin/nvidia-smi"), [201], {}, {"holding": _proctable.Holding(gpu_fds={0}), "nvml_listed": True}, None),
        (201, facts("python3", "x", "/usr/bin/python3"), [201], {}, {}, None),
    ],
)
def test_protection_comes_first_whatever_selected_the_candidate(pid, f, nspid, guarded, kw, expected) -> None:
    assert _protection.protection_reason(pid, f, nspid, guarded, _protection.protect_list([], []), **kw) == expected
    if "scopes" not in kw and "holding" not in kw:
        assert _protection.never_signal(pid, f, nspid, guarded, _protection.protect_list([], [])) == expected
