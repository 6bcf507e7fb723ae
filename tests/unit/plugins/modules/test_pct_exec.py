"""Unit tests for the pct_exec module's main(): argument handling, sudo, results, failures.

main() runs in-process with patch_module_args; pct is the fake pct (tests/sim/bin/pct), a real
process started by AnsibleModule.run_command, with a registry in a temporary PCTSIM_DIR.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _pct
from ansible_collections.gpuops.clean_slate.plugins.module_utils._pct import CHDIR_SCRIPT
from ansible_collections.gpuops.clean_slate.plugins.modules import pct_exec

FAKE_PCT = str(Path(__file__).resolve().parents[3] / "sim" / "bin" / "pct")


@pytest.fixture
def registry(tmp_path, monkeypatch):
    d = tmp_path / "pctsim"
    d.mkdir()
    (d / "node").write_text("pve1\n")
    for vmid, status, node in ((129, "running", "pve1"), (130, "stopped", "pve1"), (131, "running", "pve2")):
        (d / f"{vmid}.json").write_text(json.dumps({"vmid": vmid, "status": status, "pid": None, "node": node, "hostname": f"ct{vmid}"}))
    monkeypatch.setenv("PCTSIM_DIR", str(d))
    return d


def calls(registry: Path) -> list[list[str]]:
    path = registry / "calls.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["argv"] for line in path.read_text().splitlines()]


def run_main(args: dict, capsys) -> tuple[int, dict]:
    with patch_module_args(args), pytest.raises(SystemExit) as exc:
        pct_exec.main()
    return int(exc.value.code or 0), json.loads(capsys.readouterr().out)


def test_runs_argv_and_returns_output(registry, capsys):
    code, result = run_main({"vmid": 129, "argv": ["/bin/echo", "-n", "hello world"], "pct_path": FAKE_PCT, "node": "pve1"}, capsys)
    assert code == 0, result
    assert result["changed"] is True
    assert result["stdout"] == "hello world"
    assert result["vmid"] == 129
    assert result["node"] == "pve1"
    assert calls(registry) == [["status", "129"], ["exec", "129", "--keep-env", "0", "--", "/bin/echo", "-n", "hello world"]]


def test_command_goes_through_sh_inside_the_container(registry, capsys):
    code, result = run_main({"vmid": 129, "command": "echo $((6*7)) | tr 4 X", "pct_path": FAKE_PCT}, capsys)
    assert code == 0, result
    assert result["stdout"] == "X2\n"
    assert calls(registry)[-1][-3:] == ["/bin/sh", "-c", "echo $((6*7)) | tr 4 X"]


@pytest.mark.parametrize("vmid", [5, 99, 1000000000])
def test_out_of_range_vmid_fails_before_pct_runs(registry, capsys, vmid):
    code, result = run_main({"vmid": vmid, "argv": ["true"], "pct_path": FAKE_PCT}, capsys)
    assert code == 1
    assert result["failed"] is True
    assert result["reason"] == "bad_arguments"
    assert calls(registry) == []


def test_argv_and_command_together_are_refused(registry, capsys):
    code, result = run_main({"vmid": 129, "argv": ["true"], "command": "true", "pct_path": FAKE_PCT}, capsys)
    assert code == 1
    assert "mutually exclusive" in result["msg"]
    assert calls(registry) == []


def test_failures_carry_a_reason(registry, capsys):
    _unused, stopped = run_main({"vmid": 130, "argv": ["true"], "pct_path": FAKE_PCT}, capsys)
    _unused, elsewhere = run_main({"vmid": 131, "argv": ["true"], "pct_path": FAKE_PCT}, capsys)
    _unused, failing = run_main({"vmid": 129, "argv": ["/bin/sh", "-c", "echo out; echo err >&2; exit 3"], "pct_path": FAKE_PCT}, capsys)
    assert stopped["reason"] == "not_running"
    assert elsewhere["reason"] == "no_such_container"
    assert elsewhere["node"] == "pve1"
    assert failing["reason"] == "command_failed"
    assert (failing["rc"], failing["stdout"], failing["stderr"]) == (3, "out\n", "err\n")


def test_missing_pct_is_reported(registry, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(pct_exec._module.Module, "get_bin_path", lambda self, *a, **kw: None)
    code, result = run_main({"vmid": 129, "argv": ["true"]}, capsys)
    assert code == 1
    assert result["reason"] == "pct_failed"
    assert "pct not found" in result["msg"]


def test_non_root_goes_through_sudo_n(registry, capsys, monkeypatch, tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "sudo.log"
    sudo = bindir / "sudo"
    # A stand-in sudo: records its arguments, refuses anything but -n first, then runs the rest.
    sudo.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {log}\n[ "$1" = "-n" ] || exit 1\nshift\nexec "$@"\n')
    sudo.chmod(sudo.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setattr(_pct.os, "geteuid", lambda: 1000)
    code, result = run_main({"vmid": 129, "argv": ["/bin/true"], "pct_path": FAKE_PCT}, capsys)
    assert code == 0, result
    assert result["cmd"][:3] == [str(sudo), "-n", FAKE_PCT]
    assert log.read_text().splitlines() == [f"-n {FAKE_PCT} status 129", f"-n {FAKE_PCT} exec 129 --keep-env 0 -- /bin/true"]


def test_check_mode_does_not_exec(registry, capsys):
    code, result = run_main({"vmid": 129, "argv": ["/bin/false"], "pct_path": FAKE_PCT, "_ansible_check_mode": True}, capsys)
    assert code == 0, result
    assert result["changed"] is True
    assert "would have run" in result["msg"]
    assert calls(registry) == [["status", "129"]]


def test_nothing_is_expanded_on_the_node_and_cmd_is_what_ran(registry, capsys, monkeypatch, tmp_path):
    # The node's environment and home must not reach the container through the user's words.
    monkeypatch.setenv("NODE_SECRET", "s3cr3t-of-the-node")
    marker = tmp_path / "marker"
    monkeypatch.setenv("MARKER", str(marker))
    marker.write_text("")
    words = ["$NODE_SECRET", "${NODE_SECRET}", "~", "~/x", "$HOME"]
    code, result = run_main(
        {"vmid": 129, "argv": ["/bin/echo", *words], "env": {"JOB": "$NODE_SECRET"}, "chdir": "~", "creates": "$MARKER", "pct_path": FAKE_PCT}, capsys
    )
    # creates "$MARKER" was tested as written, so the command was not skipped although $MARKER names a file here;
    # chdir "~" is no directory where the command runs (a bare registry entry), so it failed in its cd.
    assert result["reason"] == "command_failed", result
    ran = calls(registry)
    assert ran[1] == ["exec", "129", "--keep-env", "0", "--", "test", "-e", "$MARKER"]
    assert ran[2][ran[2].index("--") + 1 :] == ["env", "JOB=$NODE_SECRET", "/bin/sh", "-c", CHDIR_SCRIPT, "pct_exec", "~", "/bin/echo", *words]
    assert result["cmd"] == [FAKE_PCT, *ran[2]]
    assert "s3cr3t" not in json.dumps(result) and "s3cr3t" not in json.dumps(ran)
    code, result = run_main({"vmid": 129, "argv": ["/bin/echo", *words], "env": {"JOB": "$NODE_SECRET"}, "pct_path": FAKE_PCT}, capsys)
    assert code == 0, result
    assert result["stdout"] == " ".join(words) + "\n"
    assert result["cmd"] == [FAKE_PCT, *calls(registry)[-1]]


def test_a_missing_pct_path_is_named(registry, capsys, tmp_path):
    code, result = run_main({"vmid": 129, "argv": ["true"], "pct_path": str(tmp_path / "no-pct-here")}, capsys)
    assert code == 1
    assert result["reason"] == "bad_arguments"
    assert result["msg"].startswith(f"pct_path: {tmp_path / 'no-pct-here'} does not exist")
    code, result = run_main({"vmid": 129, "argv": ["true"], "pct_path": str(tmp_path)}, capsys)
    assert (result["reason"], result["msg"]) == ("bad_arguments", f"pct_path: {tmp_path} is not an executable file.")
    assert calls(registry) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"timeout": 0}, "timeout must be from 1 to 86400 seconds, got 0."),
        ({"timeout": 86401}, "timeout must be from 1 to 86400 seconds, got 86401."),
        ({"timeout": 5, "kill_after": 3601}, "kill_after must be from 0 to 3600 seconds, got 3601."),
        ({"kill_after": -1}, "kill_after must be from 0 to 3600 seconds, got -1."),
    ],
)
def test_numbers_are_bounded(registry, capsys, args, message):
    code, result = run_main({"vmid": 129, "argv": ["true"], "pct_path": FAKE_PCT, **args}, capsys)
    assert (code, result["reason"], result["msg"]) == (1, "bad_arguments", message)
    assert calls(registry) == []


def test_ansibles_own_argument_errors_carry_a_reason(registry, capsys):
    code, result = run_main({"vmid": "12a", "argv": ["true"], "pct_path": FAKE_PCT}, capsys)
    assert code == 1 and result["reason"] == "bad_arguments"
    code, result = run_main({"vmid": 129, "pct_path": FAKE_PCT}, capsys)
    assert code == 1 and result["reason"] == "bad_arguments" and "one of the following is required" in result["msg"]
