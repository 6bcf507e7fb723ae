"""pct_exec through real Ansible (ansible-playbook, AnsiballZ, local connection) against the fake pct.

Containers are real: a process that is PID 1 of its own PID and mount namespaces, entered by the
fake pct with nsenter, so a command that runs "in the container" sees the container's /proc.
Run inside a private PID namespace: tools/pidns-run .venv/bin/pytest tests/functional/test_pct_exec.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from pvesim import PveSim, load_cluster
from support.ansible import VENV_PYTHON, local_play, run_module, run_playbook
from support.proxmox import CLUSTER_SOURCE, FAKE_PCT, Container, PctRegistry

MODULE = "gpuops.clean_slate.pct_exec"
# The venv's interpreter lives on the shared filesystem, so it runs inside the namespace containers too.
PY = VENV_PYTHON


@pytest.fixture
def registry(tmp_path):
    return PctRegistry(tmp_path / "pctsim", node="pve1")


@pytest.fixture
def container(registry):
    ct = Container()
    registry.add(150, pid=ct.init)
    try:
        yield ct
    finally:
        ct.stop()


def pct_exec(registry: PctRegistry, check: bool = False, process_env: dict[str, str] | None = None, **args) -> dict:
    """Run the module once; ``args`` are its options, ``process_env`` the environment Ansible (and pct) runs in."""
    args.setdefault("pct_path", FAKE_PCT)
    args.setdefault("node", "pve1")
    result, run = run_module(MODULE, args, env={**registry.env(), **(process_env or {})}, check=check)
    result["_output"] = run.output
    return result


def test_argv_arrives_unchanged_inside_the_container(registry, container):
    argv = ["a b", "'single'", '"double"', "$(touch /tmp/pwned)", "`id`", "-rf", "--", "--keep-env", "ünïcødé ✓ 日本", "", "*", "\\n"]
    code = "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'init': open('/proc/1/comm').read().strip()}))"
    r = pct_exec(registry, vmid=150, argv=[PY, "-c", code, *argv])
    assert r["_status"] == "ok", r["_output"]
    out = json.loads(r["stdout"])
    assert out["argv"] == argv
    assert out["init"] == "sleep"  # ran inside the container's PID namespace
    assert not Path("/tmp/pwned").exists()
    assert r["changed"] is True
    assert r["rc"] == 0
    assert (r["vmid"], r["node"]) == (150, "pve1")
    assert r["elapsed_s"] >= 0
    assert r["stdout_lines"] == [r["stdout"].strip()]
    # exactly one status check, then one exec with the argv after "--"
    calls = registry.calls()
    assert [c[0] for c in calls] == ["status", "exec"]
    assert calls[1][calls[1].index("--") + 1 :] == [PY, "-c", code, *argv]


def test_command_runs_in_the_containers_shell(registry, container):
    r = pct_exec(registry, vmid=150, command="echo $$ > /dev/null; cat /proc/1/comm; ls /proc | grep -c '^[0-9]' | tr -d ' '")
    assert r["_status"] == "ok", r["_output"]
    comm, count = r["stdout_lines"]
    assert comm == "sleep"
    assert int(count) < 10  # only the container's processes are visible


def test_env_chdir_stdin_and_cleared_environment(registry, container):
    code = "import os, sys; print(os.getcwd()); print(os.environ.get('JOB_ID')); print(os.environ.get('LEAK')); print(sys.stdin.read().strip())"
    r = pct_exec(
        registry,
        process_env={"LEAK": "from-the-node"},
        vmid=150,
        argv=[PY, "-c", code],
        chdir="/usr/share",
        stdin="line for the job",
        env={"JOB_ID": 42},
    )
    assert r["_status"] == "ok", r["_output"]
    # JOB_ID set by env; LEAK from the node's environment cleared by --keep-env 0
    assert r["stdout_lines"] == ["/usr/share", "42", "None", "line for the job"]


def test_keep_env_passes_the_node_environment(registry, container):
    code = "import os; print(os.environ.get('LEAK')); print(os.environ['PATH'])"
    r = pct_exec(registry, process_env={"LEAK": "from-the-node"}, vmid=150, argv=[PY, "-c", code], keep_env=True)
    assert r["_status"] == "ok", r["_output"]
    assert r["stdout_lines"] == ["from-the-node", "/sbin:/bin:/usr/sbin:/usr/bin"]
    assert r["cmd"][r["cmd"].index("--keep-env") + 1] == "1"


def test_timeout_is_enforced_inside_the_container(registry, container):
    start = time.monotonic()
    r = pct_exec(registry, vmid=150, argv=["sleep", "120"], timeout=1, kill_after=1)
    assert time.monotonic() - start < 60
    assert r["_status"] == "failed"
    assert r["reason"] == "timeout"
    assert r["rc"] in (124, 137)
    assert 1 <= r["elapsed_s"] < 30
    # the sleep was killed where it ran: only the container's init is left inside
    deadline = time.monotonic() + 5
    while any("sleep 120" in p for p in container.processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any("sleep 120" in p for p in container.processes())


def test_term_ignoring_command_is_killed_after_kill_after(registry, container):
    r = pct_exec(registry, vmid=150, command="trap '' TERM; sleep 120", timeout=1, kill_after=1)
    assert (r["_status"], r["reason"], r["rc"]) == ("failed", "timeout", 137)


def test_failures_are_classified(registry, container):
    registry.add(130, status="stopped")
    registry.add(131, node="pve2")  # lives on another cluster node: this pct cannot see it
    stopped = pct_exec(registry, vmid=130, argv=["true"])
    elsewhere = pct_exec(registry, vmid=131, argv=["true"])
    absent = pct_exec(registry, vmid=999, argv=["true"])
    failing = pct_exec(registry, vmid=150, argv=["sh", "-c", "echo partial; exit 255"])
    missing = pct_exec(registry, vmid=150, argv=["no-such-command-here"])
    assert (stopped["_status"], stopped["reason"]) == ("failed", "not_running")
    assert (elsewhere["reason"], absent["reason"]) == ("no_such_container", "no_such_container")
    assert "another cluster node" in elsewhere["msg"]
    # exit 255 from the command is the command's failure, not a pct error
    assert (failing["reason"], failing["rc"], failing["stdout"]) == ("command_failed", 255, "partial\n")
    assert (missing["reason"], missing["rc"]) == ("command_failed", 127)
    # no exec was attempted for the stopped or absent containers
    execs = [c for c in registry.calls() if c[0] == "exec"]
    assert [c[1] for c in execs] == ["150", "150"]


@pytest.mark.parametrize("vmid", [0, 99, 1000000000, "12a", "129; reboot"])
def test_bad_vmid_is_rejected_before_anything_runs(registry, vmid):
    r = pct_exec(registry, vmid=vmid, argv=["true"])
    assert r["_status"] == "failed"
    assert registry.calls() == []
    if isinstance(vmid, int):
        assert r["reason"] == "bad_arguments"


def test_check_mode_and_creates(registry, container):
    marker = "/tmp/pct-exec-marker-150"
    Path(marker).unlink(missing_ok=True)
    checked = pct_exec(registry, check=True, vmid=150, argv=["touch", marker])
    assert (checked["_status"], checked["changed"]) == ("ok", True)
    assert not Path(marker).exists()
    first = pct_exec(registry, vmid=150, argv=["touch", marker], creates=marker)
    second = pct_exec(registry, vmid=150, argv=["touch", marker], creates=marker)
    Path(marker).unlink(missing_ok=True)
    assert (first["changed"], second["changed"]) == (True, False)
    assert "exists" in second["msg"]


def test_inventory_to_pct_exec_on_every_running_gpu_container_of_a_node(registry, tmp_path):
    """The inventory's gpu_nodes group drives pct_exec: one run per running GPU container of pve1."""
    for vmid in (101, 102, 103, 109):
        registry.add(vmid)
    playbook = [
        {
            "name": "Touch every running GPU container of pve1",
            "hosts": "gpu_nodes:&proxmox_containers:&proxmox_running:&proxmox_pve1",
            "gather_facts": False,
            "tasks": [
                {
                    "name": "Ask the container for its vmid",
                    "gpuops.clean_slate.pct_exec": {
                        "vmid": "{{ proxmox_vmid }}",
                        "command": "echo {{ proxmox_vmid }}",
                        "pct_path": FAKE_PCT,
                        "node": "{{ proxmox_node }}",
                    },
                    "delegate_to": "localhost",
                    "vars": {"ansible_connection": "local", "ansible_python_interpreter": VENV_PYTHON},
                }
            ],
        }
    ]
    with PveSim(load_cluster("gpu3")) as sim:
        run = run_playbook(playbook, inventory=CLUSTER_SOURCE, env={**sim.env(), **registry.env()})
    assert run.rc == 0, run.output
    results = {r["host"]: r["result"] for r in run.by_action("pct_exec")}
    assert set(results) == {"train-a", "train-b", "infer-hook", "old-raw"}
    for host, result in results.items():
        assert result["stdout"].strip() == str(result["vmid"]), host
    assert sorted(int(c[1]) for c in registry.calls() if c[0] == "exec") == [101, 102, 103, 109]


def test_local_play_helper_reaches_the_module(registry, container):
    # The same module through a hand-written play, with register + failed_when as users write it.
    # Inside the container PID 1 is its init (sleep) and it is the only sleep; on this host
    # PID 1 is the test sandbox's init, so a command that ran anywhere else would say otherwise.
    tasks = [
        {
            "name": "Look inside",
            MODULE: {"vmid": 150, "command": "sh -c 'cat /proc/1/comm; ps -eo comm | grep -cx sleep'", "pct_path": FAKE_PCT},
            "register": "inside",
        },
        {"name": "Show", "ansible.builtin.assert": {"that": ["inside.rc == 0", "inside.stdout_lines == ['sleep', '1']", "inside.vmid == 150"]}},
    ]
    run = run_playbook(local_play(tasks), inventory="localhost,", env=registry.env())
    assert run.rc == 0, run.output
    assert run.task("Show")["status"] == "ok"


def test_nothing_of_the_nodes_environment_reaches_the_container(registry, container, tmp_path):
    """$VAR, ${VAR} and ~ reach the container as written: the node's secrets and home stay on the node."""
    node_env = {"NODE_SECRET": "s3cr3t-of-the-node", "MARKER": str(tmp_path / "exists-on-the-node")}
    (tmp_path / "exists-on-the-node").write_text("")
    words = ["$NODE_SECRET", "${NODE_SECRET}", "~", "~root", "$HOME"]
    code = "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'job': os.environ.get('JOB'), 'secret': os.environ.get('NODE_SECRET')}))"
    r = pct_exec(registry, process_env=node_env, vmid=150, argv=[PY, "-c", code, *words], env={"JOB": "${NODE_SECRET}"}, creates="$MARKER")
    assert r["_status"] == "ok", r["_output"]
    out = json.loads(r["stdout"])
    assert out == {"argv": words, "job": "${NODE_SECRET}", "secret": None}
    # cmd is what ran, word for word, and what pct received
    assert r["cmd"][r["cmd"].index("--") + 1 :] == registry.calls()[-1][registry.calls()[-1].index("--") + 1 :]
    assert r["cmd"][-len(words) :] == words
    # creates was tested as written, inside the container: "$MARKER" is no file there, so the command ran
    assert registry.calls()[1][-3:] == ["test", "-e", "$MARKER"]
    # command: the shell that expands is the container's, with the container's (cleared) environment
    r = pct_exec(registry, process_env=node_env, vmid=150, command='echo "[$NODE_SECRET]" ~')
    assert r["_status"] == "ok", r["_output"]
    # (no HOME in the cleared environment, so the container's shell leaves ~ alone)
    assert r["stdout_lines"] == ["[] ~"]
    assert "s3cr3t" not in json.dumps({k: v for k, v in r.items() if k != "_output"})
    assert r["cmd"][-1] == 'echo "[$NODE_SECRET]" ~'


def test_a_missing_pct_path_is_named(registry, tmp_path):
    r = pct_exec(registry, vmid=150, argv=["true"], pct_path=str(tmp_path / "nowhere" / "pct"))
    assert (r["_status"], r["reason"]) == ("failed", "bad_arguments")
    assert f"pct_path: {tmp_path / 'nowhere' / 'pct'} does not exist" in r["msg"]
    assert registry.calls() == []


def test_output_that_is_not_utf8_arrives_escaped_with_the_result_intact(registry, container):
    """A container's command may print any bytes; Ansible refuses to carry back text that is not UTF-8."""
    code = "import os; os.write(1, b'ok \\xff\\xfe\\n'); os.write(2, b'err \\xc3\\n'); raise SystemExit(3)"
    r = pct_exec(registry, vmid=150, argv=[PY, "-c", code])
    assert r["_status"] == "failed" and r["reason"] == "command_failed", r["_output"]
    assert r["rc"] == 3
    assert r["stdout"] == "ok \\xff\\xfe\n" and r["stdout_lines"] == ["ok \\xff\\xfe"]
    assert r["stderr"] == "err \\xc3\n"
