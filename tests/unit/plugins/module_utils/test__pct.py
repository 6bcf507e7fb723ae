"""Unit tests for plugins/module_utils/_pct.py: command lines, pct error classification, timeouts, containers as scopes."""

from __future__ import annotations

import os
import socket

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _pct, _proctable
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError
from ansible_collections.gpuops.clean_slate.plugins.module_utils._pct import PctExec, classify_pct_error

USAGE = "pct exec <vmid> [<extra-args>] [OPTIONS]\n"


class FakeRunner:
    """Answers run_command calls from a script of (rc, stdout, stderr) keyed by the pct subcommand."""

    def __init__(self, answers: dict[str, list[tuple[int, str, str]]], clock_steps: list[float] | None = None) -> None:
        self.answers = {k: list(v) for k, v in answers.items()}
        self.calls: list[tuple[list[str], str | None, bool]] = []
        self._clock = list(clock_steps or [])

    def __call__(self, argv: list[str], data: str | None, binary: bool) -> tuple[int, str, str]:
        self.calls.append((argv, data, binary))
        sub = argv[argv.index("/usr/sbin/pct") + 1]
        return self.answers[sub].pop(0)

    def clock(self) -> float:
        return self._clock.pop(0)


def running(extra: dict[str, list[tuple[int, str, str]]] | None = None) -> dict[str, list[tuple[int, str, str]]]:
    answers = {"status": [(0, "status: running\n", "")]}
    answers.update(extra or {})
    return answers


# ---------------------------------------------------------------------- command lines
def test_exec_argv_puts_pct_options_before_the_double_dash_and_the_user_argv_after_unchanged():
    runner = PctExec("/usr/sbin/pct", FakeRunner({}))
    argv = ["printf", "%s\\n", "a b", "'q'", '"dq"', "$(id)", "`id`", "-rf", "--", "ünï ✓", ""]
    cmd = runner.exec_argv(129, argv)
    assert cmd == ["/usr/sbin/pct", "exec", "129", "--keep-env", "0", "--", *argv]


def test_exec_argv_keep_env_sudo_timeout_env_and_chdir_compose_in_that_order():
    runner = PctExec("/usr/sbin/pct", FakeRunner({}), sudo=["/usr/bin/sudo", "-n"])
    cmd = runner.exec_argv(129, ["ls", "-la"], keep_env=True, timeout=30, kill_after=3, env={"B": 2, "A": "x y"}, chdir="/srv/my dir")
    assert cmd[:7] == ["/usr/bin/sudo", "-n", "/usr/sbin/pct", "exec", "129", "--keep-env", "1"]
    assert cmd[7] == "--"
    assert cmd[8:] == [
        "timeout",
        "-k",
        "3",
        "30",
        "env",
        "A=x y",
        "B=2",
        "/bin/sh",
        "-c",
        _pct.CHDIR_SCRIPT,
        "pct_exec",
        "/srv/my dir",
        "ls",
        "-la",
    ]


@pytest.mark.parametrize("vmid", [0, 99, 1_000_000_000, -5, True, "129"])
def test_bad_vmid_is_rejected_before_any_command_runs(vmid):
    fake = FakeRunner({})
    runner = PctExec("/usr/sbin/pct", fake)
    with pytest.raises(CleanSlateError) as exc:
        runner.run(vmid, ["true"])
    assert exc.value.reason == "bad_arguments"
    assert fake.calls == []


@pytest.mark.parametrize("name", ["1ABC", "A-B", "-x", "A B", "", "A=B"])
def test_env_names_that_could_be_options_or_commands_are_rejected(name):
    fake = FakeRunner({})
    with pytest.raises(CleanSlateError) as exc:
        PctExec("/usr/sbin/pct", fake).run(129, ["true"], env={name: "v"})
    assert exc.value.reason == "bad_arguments"
    assert fake.calls == []


def test_command_word_with_equals_sign_cannot_follow_env():
    with pytest.raises(CleanSlateError, match="cannot be combined with env"):
        PctExec("/usr/sbin/pct", FakeRunner({})).exec_argv(129, ["A=1"], env={"X": "1"})
    # With chdir the command follows /bin/sh, so env never sees it.
    cmd = PctExec("/usr/sbin/pct", FakeRunner({})).exec_argv(129, ["A=1"], env={"X": "1"}, chdir="/")
    assert cmd[-1] == "A=1"


@pytest.mark.parametrize(("timeout", "kill_after"), [(0, 5), (-1, 5), (10, -1)])
def test_nonsense_timeouts_are_bad_arguments(timeout, kill_after):
    with pytest.raises(CleanSlateError) as exc:
        PctExec("/usr/sbin/pct", FakeRunner({})).exec_argv(129, ["true"], timeout=timeout, kill_after=kill_after)
    assert exc.value.reason == "bad_arguments"


# ---------------------------------------------------------------------- classification
@pytest.mark.parametrize(
    ("stderr", "reason", "pct_node"),
    [
        ("Configuration file 'nodes/pve2/lxc/129.conf' does not exist\n", "no_such_container", "pve2"),
        ("container '129' not running!\n", "not_running", None),
        ("Error: container '129' not running!\n", "not_running", None),
        ("400 not enough arguments\n" + USAGE, "bad_arguments", None),
        ("Unknown option: keep-env\n400 unable to parse option\n" + USAGE, "bad_arguments", None),
        ("400 Parameter verification failed.\nvmid: type check ('integer') failed - got 'x'\n" + USAGE, "bad_arguments", None),
    ],
)
def test_pct_messages_are_classified(stderr, reason, pct_node):
    got = classify_pct_error(stderr, 129)
    assert got is not None
    assert got[0] == reason
    assert got[2] == pct_node


@pytest.mark.parametrize(
    "stderr",
    [
        "",
        "some output\ncontainer '129' not running!\n",  # the command printed it among other lines
        "Traceback (most recent call last):\n  ...\n",
        "400 bad request from my own tool\n",  # no pct usage line
    ],
)
def test_command_output_is_not_mistaken_for_a_pct_error(stderr):
    assert classify_pct_error(stderr, 129) is None


def test_old_pct_without_keep_env_gets_an_upgrade_hint():
    got = classify_pct_error("Unknown option: keep-env\n400 unable to parse option\n" + USAGE, 129)
    assert got is not None
    assert "Proxmox VE 8.2" in got[1]


# ---------------------------------------------------------------------- runs
def test_successful_run_returns_output_lines_and_elapsed_time():
    fake = FakeRunner(running({"exec": [(0, "a\nb\n", "warn\n")]}), clock_steps=[10.0, 12.5])
    result = PctExec("/usr/sbin/pct", fake, node="pve1", clock=fake.clock).run(129, ["echo"], stdin="data", stdin_add_newline=False)
    assert result["changed"] is True
    assert result["rc"] == 0
    assert result["stdout_lines"] == ["a", "b"]
    assert result["stderr_lines"] == ["warn"]
    assert result["elapsed_s"] == 2.5
    assert result["node"] == "pve1"
    # pct status first, then pct exec with the stdin data (binary_data=True: no newline added)
    assert [c[0][1] for c in fake.calls] == ["status", "exec"]
    assert fake.calls[1][1:] == ("data", True)


def test_stopped_container_is_not_running_and_exec_is_never_called():
    fake = FakeRunner({"status": [(0, "status: stopped\n", "")]})
    with pytest.raises(CleanSlateError) as exc:
        PctExec("/usr/sbin/pct", fake, node="pve1").run(129, ["true"])
    assert exc.value.reason == "not_running"
    assert len(fake.calls) == 1


def test_container_of_another_node_is_no_such_container_and_names_the_node():
    fake = FakeRunner({"status": [(255, "", "Configuration file 'nodes/pve1/lxc/129.conf' does not exist\n")]})
    runner = PctExec("/usr/sbin/pct", fake, node=None)
    with pytest.raises(CleanSlateError) as exc:
        runner.run(129, ["true"])
    assert exc.value.reason == "no_such_container"
    assert exc.value.details["node"] == "pve1"
    assert "another cluster node" in exc.value.msg


def test_container_stopping_between_status_and_exec_is_still_not_running():
    fake = FakeRunner(running({"exec": [(255, "", "container '129' not running!\n")]}), clock_steps=[0.0, 0.1])
    with pytest.raises(CleanSlateError) as exc:
        PctExec("/usr/sbin/pct", fake, clock=fake.clock).run(129, ["true"])
    assert exc.value.reason == "not_running"


def test_command_exiting_255_is_command_failed_not_a_pct_error():
    fake = FakeRunner(running({"exec": [(255, "", "ssh: connect to host x: Connection refused\n")]}), clock_steps=[0.0, 0.1])
    with pytest.raises(CleanSlateError) as exc:
        PctExec("/usr/sbin/pct", fake, clock=fake.clock).run(129, ["ssh", "x"])
    assert exc.value.reason == "command_failed"
    assert exc.value.details["rc"] == 255


@pytest.mark.parametrize("rc", [124, 137, 143])
def test_timeout_exit_after_the_deadline_is_timeout(rc):
    fake = FakeRunner(running({"exec": [(rc, "", "")]}), clock_steps=[0.0, 2.01])
    with pytest.raises(CleanSlateError) as exc:
        PctExec("/usr/sbin/pct", fake, clock=fake.clock).run(129, ["sleep", "9"], timeout=2)
    assert exc.value.reason == "timeout"
    assert exc.value.details["rc"] == rc


def test_exit_124_before_the_deadline_is_the_commands_own_status():
    fake = FakeRunner(running({"exec": [(124, "", "")]}), clock_steps=[0.0, 0.2])
    with pytest.raises(CleanSlateError) as exc:
        PctExec("/usr/sbin/pct", fake, clock=fake.clock).run(129, ["false"], timeout=5)
    assert exc.value.reason == "command_failed"


def test_sudo_refusal_is_pct_failed_with_a_hint():
    fake = FakeRunner({"status": [(1, "", "sudo: a password is required\n")]})
    with pytest.raises(CleanSlateError) as exc:
        PctExec("/usr/sbin/pct", fake, sudo=["sudo", "-n"]).run(129, ["true"])
    assert exc.value.reason == "pct_failed"
    assert "passwordless sudo" in exc.value.msg


def test_creates_existing_path_skips_without_running():
    fake = FakeRunner(running({"exec": [(0, "", "")]}))
    result = PctExec("/usr/sbin/pct", fake).run(129, ["touch", "/x"], creates="/x")
    assert result["changed"] is False
    assert "exists" in result["msg"]
    assert fake.calls[1][0][-3:] == ["test", "-e", "/x"]
    assert len(fake.calls) == 2


def test_removes_missing_path_skips_and_present_path_runs():
    fake = FakeRunner(running({"exec": [(1, "", "")]}))
    assert PctExec("/usr/sbin/pct", fake).run(129, ["rm", "/x"], removes="/x")["changed"] is False
    fake = FakeRunner(running({"exec": [(0, "", ""), (0, "", "")]}), clock_steps=[0.0, 0.1])
    result = PctExec("/usr/sbin/pct", fake, clock=fake.clock).run(129, ["rm", "/x"], removes="/x")
    assert result["changed"] is True
    assert fake.calls[-1][0][-2:] == ["rm", "/x"]


def test_check_mode_checks_the_container_but_runs_nothing():
    fake = FakeRunner(running())
    result = PctExec("/usr/sbin/pct", fake).run(129, ["reboot"], check_mode=True)
    assert result["changed"] is True
    assert "rc" not in result
    assert [c[0][1] for c in fake.calls] == ["status"]


def test_local_node_name_reads_etc_pve_local(tmp_path):
    link = tmp_path / "local"
    link.symlink_to("nodes/gpu-node-7")
    assert _pct.local_node_name(str(link)) == "gpu-node-7"
    # Without /etc/pve/local (not a PVE node, or pmxcfs down): the short host name, as PVE names nodes.
    assert _pct.local_node_name(str(tmp_path / "absent")) == socket.gethostname().split(".")[0]


# ---------------------------------------------------------------------- containers as scopes (the Proxmox lookup)
def verbose(status: str, pid: int | str | None) -> tuple[int, str, str]:
    lines = f"status: {status}\n" + (f"pid: {pid}\n" if pid is not None else "") + "name: ct\n"
    return (0, lines, "")


def test_a_running_containers_init_gives_its_scope() -> None:
    # Its init is a real process: this one, so that its PID namespace can be read.
    fake = FakeRunner({"status": [verbose("running", os.getpid())]})
    [scope] = _pct.scopes([129], fake, "/usr/sbin/pct", None)
    assert (scope.vmid, scope.init_pid, scope.pidns) == (129, os.getpid(), _proctable.pidns_inode(os.getpid()))
    assert fake.calls[0][0] == ["/usr/sbin/pct", "status", "129", "--verbose"]


@pytest.mark.parametrize(
    ("answer", "reason", "message"),
    [
        (verbose("stopped", None), "not_running", "containers: container 129 is not running (status: stopped)"),
        (verbose("running", None), "not_running", "containers: could not find the init process of container 129."),
        (verbose("running", _proctable.pid_max() + 5), "not_running", "is not visible here; run the task on the hypervisor itself."),
        (
            (255, "", "Configuration file 'nodes/pve2/lxc/129.conf' does not exist\n"),
            "no_such_container",
            "containers: container 129 does not exist on node pve2",
        ),
        ((1, "", "sudo: a password is required\n"), "pct_failed", "containers: pct status 129 failed with rc 1 (pct needs root"),
    ],
)
def test_a_container_that_cannot_be_scoped_is_named_with_its_reason(answer, reason, message) -> None:
    with pytest.raises(CleanSlateError) as exc:
        _pct.scopes([129], FakeRunner({"status": [answer]}), "/usr/sbin/pct", None)
    assert exc.value.reason == reason and exc.value.details["vmid"] == 129
    assert message in exc.value.msg and exc.value.msg.startswith("containers: ")


class LxcInfo:
    def __init__(self, rc: int, out: str, err: str = "") -> None:
        self.answer = (rc, out, err)
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], data: str | None, binary: bool) -> tuple[int, str, str]:
        self.calls.append(argv)
        return self.answer


def test_without_pct_lxc_info_names_the_init() -> None:
    run = LxcInfo(0, f"State:          RUNNING\nPID:            {os.getpid()}\n")
    [scope] = _pct.scopes([129], run, None, "/usr/bin/lxc-info")
    assert scope.init_pid == os.getpid() and run.calls == [["/usr/bin/lxc-info", "-n", "129", "-s", "-p"]]
    with pytest.raises(CleanSlateError) as exc:
        _pct.scopes([130], LxcInfo(1, "", "130 doesn't exist\n"), None, "/usr/bin/lxc-info")
    assert (exc.value.reason, exc.value.msg) == ("no_such_container", "containers: container 130 does not exist here (130 doesn't exist).")


def test_without_pct_or_lxc_info_containers_are_refused() -> None:
    with pytest.raises(CleanSlateError) as exc:
        _pct.scopes([129], LxcInfo(0, ""), None, None)
    assert (exc.value.reason, exc.value.details["option"]) == ("bad_arguments", "containers")


class Host:
    """What the module helpers use of an AnsibleModule: get_bin_path and run_command, recorded."""

    def __init__(self, bins: dict[str, str]) -> None:
        self.bins = bins
        self.runs: list[tuple[list[str], dict]] = []
        self.params: dict = {}
        self.check_mode = False

    def get_bin_path(self, arg: str, required: bool = False, opt_dirs: list[str] | None = None) -> str | None:
        return self.bins.get(arg)

    def run_command(self, args, **kwargs) -> tuple[int, str, str]:
        self.runs.append((args, kwargs))
        return verbose("running", os.getpid())


def test_the_modules_run_nothing_through_expansion() -> None:
    host = Host({"pct": "/usr/sbin/pct"})
    assert _pct.container_scopes(host, [], None) == [] and host.runs == []  # no containers: pct is not even looked for
    [scope] = _pct.container_scopes(host, [129], None)
    assert scope.vmid == 129
    [(argv, kwargs)] = host.runs
    # $VAR and ~ in a word must reach pct as written: run_command would expand them with the node's environment.
    assert argv[:3] == ["/usr/sbin/pct", "status", "129"] and kwargs["expand_user_and_vars"] is False
    assert _pct.find_pct(host, "/opt/pct") == "/opt/pct" and _pct.find_pct(Host({}), None) is None
