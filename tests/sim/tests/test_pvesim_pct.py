"""The fake pct (tests/sim/bin/pct) behaves like pve-container's pct.

Usage errors, messages and exit codes as in proxmox-facts.md §6; exec passes argv, stdin and exit
status through; --keep-env 0 clears the environment; with an init pid it enters a real PID + mount
namespace (a "container" made with unshare), where the command sees the container's own /proc.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.host_safe

PCT = str(Path(__file__).resolve().parents[1] / "bin" / "pct")
USAGE_EXEC = "pct exec <vmid> [<extra-args>] [OPTIONS]\n"


@pytest.fixture
def registry(tmp_path):
    d = tmp_path / "pctsim"
    d.mkdir()
    (d / "node").write_text("pve1\n")
    # These tests check what pct says, not how long it takes (test_each_call_takes_about_a_second
    # does): no start-up delay here.
    (d / "latency_ms").write_text("0\n")
    return d


def register(d: Path, vmid: int, status: str = "running", pid: int | None = None, node: str = "pve1", **extra) -> None:
    (d / f"{vmid}.json").write_text(json.dumps({"vmid": vmid, "status": status, "pid": pid, "node": node, "hostname": f"ct{vmid}", **extra}))


def pct(d: Path, *args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {"PATH": os.environ["PATH"], "PCTSIM_DIR": str(d), **(env or {})}
    return subprocess.run([PCT, *args], input=stdin, capture_output=True, text=True, env=full, timeout=30, check=False)


# ---------------------------------------------------------------------- usage and pct's own errors
@pytest.mark.parametrize(
    ("args", "stderr"),
    [
        (["exec"], "400 not enough arguments\n" + USAGE_EXEC),
        (["exec", "129", "ls", "-la"], "Unknown option: la\n400 unable to parse option\n" + USAGE_EXEC),
        (["exec", "abc", "--", "true"], "400 Parameter verification failed.\nvmid: type check ('integer') failed - got 'abc'\n" + USAGE_EXEC),
        (["exec", "99", "--", "true"], "400 Parameter verification failed.\nvmid: value must have a minimum value of 100\n" + USAGE_EXEC),
        (["exec", "129", "--keep-env", "maybe", "--", "true"], "400 unable to parse boolean option\n" + USAGE_EXEC),
        (["status", "129", "130"], "400 too many arguments\npct status <vmid> [OPTIONS]\n"),
        (["exec", "129", "--"], "missing command at /usr/share/perl5/PVE/CLI/pct.pm line 246.\n"),
    ],
)
def test_argument_errors_match_pct(registry, args, stderr):
    register(registry, 129)
    proc = pct(registry, *args)
    assert (proc.returncode, proc.stdout, proc.stderr) == (255, "", stderr)


def test_unknown_command_prints_the_short_usage(registry):
    proc = pct(registry, "frobnicate")
    assert proc.returncode == 255
    lines = proc.stderr.splitlines()
    assert lines[:2] == ["ERROR: unknown command 'pct frobnicate'", "USAGE: pct <COMMAND> [ARGS] [OPTIONS]"]
    assert "       pct exec <vmid> [<extra-args>] [OPTIONS]" in lines


def test_absent_container_and_container_of_another_node(registry):
    register(registry, 131, node="pve2")
    for vmid in ("128", "131"):
        for args in (["status", vmid], ["exec", vmid, "--", "true"], ["config", vmid]):
            proc = pct(registry, *args)
            assert (proc.returncode, proc.stderr) == (255, f"Configuration file 'nodes/pve1/lxc/{vmid}.conf' does not exist\n"), args


def test_stopped_container_cannot_exec(registry):
    register(registry, 130, status="stopped")
    proc = pct(registry, "exec", "130", "--", "true")
    assert (proc.returncode, proc.stderr) == (255, "container '130' not running!\n")


def test_node_name_comes_from_the_registry(registry):
    (registry / "node").write_text("gpu-7\n")
    register(registry, 129, node="gpu-7")
    assert pct(registry, "status", "129").stdout == "status: running\n"
    assert "nodes/gpu-7/lxc/555.conf" in pct(registry, "status", "555").stderr


# ---------------------------------------------------------------------- status, list, config
def test_status_plain_and_verbose(registry):
    register(registry, 129, pid=os.getpid())
    register(registry, 130, status="stopped")
    assert pct(registry, "status", "129").stdout == "status: running\n"
    assert pct(registry, "status", "130").stdout == "status: stopped\n"
    verbose = pct(registry, "status", "129", "--verbose").stdout.splitlines()
    keys = [line.split(": ", 1)[0] for line in verbose]
    assert keys == sorted(keys)
    assert f"pid: {os.getpid()}" in verbose
    assert "name: ct129" in verbose
    assert "vmid: 129" in verbose


def test_status_verbose_follows_the_pve_version(registry, tmp_path):
    # PVE 9 (pve-container 6, commit 275807b) adds the container's pressure stall averages, read
    # from its cgroup (lxc/<vmid>, above the container's "ns"), for a running container only.
    cg = tmp_path / "cgroup" / "lxc" / "129"
    (cg / "ns").mkdir(parents=True)
    (cg / "cpu.pressure").write_text("some avg10=1.25 avg60=0.50 avg300=0.10 total=123\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    (cg / "memory.pressure").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    register(registry, 129, pid=os.getpid(), cgroup=str(cg / "ns"))
    register(registry, 130, status="stopped", cgroup=str(tmp_path / "cgroup" / "lxc" / "130" / "ns"))
    pressure = ["pressurecpufull: 0.00", "pressurecpusome: 1.25", "pressurememoryfull: 0.00", "pressurememorysome: 0.00"]
    (registry / "pve").write_text("9\n")
    v9 = pct(registry, "status", "129", "--verbose").stdout.splitlines()
    assert [line for line in v9 if line.startswith("pressure")] == pressure  # no io.pressure file: no io keys
    assert [line.split(": ")[0] for line in v9] == sorted(line.split(": ")[0] for line in v9)
    assert not [line for line in pct(registry, "status", "130", "--verbose").stdout.splitlines() if line.startswith("pressure")]
    (registry / "pve").write_text("8\n")
    v8 = pct(registry, "status", "129", "--verbose").stdout.splitlines()
    assert v8 == [line for line in v9 if not line.startswith("pressure")]
    # The plain form is the same in both.
    assert pct(registry, "status", "129").stdout == "status: running\n"


def test_status_verbose_prints_what_the_api_reports_for_a_container(registry):
    """pct status --verbose prints PVE::LXC::vmstatus, key by key, except cpu; the API's
    status/current (a recorded PVE 8 answer in pvesim/fixtures) is the same hash plus ha."""
    fixture = Path(__file__).resolve().parents[1] / "pvesim" / "fixtures" / "lxc_status_current.json"
    doc = json.loads(fixture.read_text())
    api = doc.get("data", doc)
    register(registry, 129, pid=os.getpid())
    (registry / "pve").write_text("8\n")
    keys = {line.split(": ", 1)[0] for line in pct(registry, "status", "129", "--verbose").stdout.splitlines()}
    assert keys == set(api) - {"cpu", "ha"}


def test_each_call_takes_about_a_second(tmp_path):
    """The real pct is a Perl program that loads the PVE API modules before it acts: about a
    second per call, errors included. The default models that; latency_ms changes it."""
    d = tmp_path / "slow"
    d.mkdir()
    register(d, 129, pid=os.getpid())
    for args in (["status", "129"], ["status", "999"], ["exec", "abc"]):
        start = time.monotonic()
        pct(d, *args)
        # A lower bound (a loaded machine only makes it slower): the call did wait.
        assert time.monotonic() - start >= 0.95, args
    (d / "latency_ms").write_text("300\n")
    start = time.monotonic()
    assert pct(d, "status", "129").stdout == "status: running\n"
    assert time.monotonic() - start >= 0.3


def test_registered_pid_that_is_gone_means_stopped(registry):
    dead = subprocess.Popen(["true"])
    dead.wait()
    register(registry, 129, pid=dead.pid)
    assert pct(registry, "status", "129").stdout == "status: stopped\n"


def test_list_is_local_sorted_fixed_width_and_empty_without_containers(registry):
    assert pct(registry, "list").stdout == ""
    register(registry, 200, status="stopped")
    register(registry, 129)
    register(registry, 131, node="pve2")
    assert pct(registry, "list").stdout.splitlines() == [
        "VMID       Status     Lock         Name                ",
        "129        running                 ct129               ",
        "200        stopped                 ct200               ",
    ]


def test_config_prints_sorted_keys_then_raw_lxc_pairs_in_order(registry):
    register(registry, 129, config={"memory": 2048, "dev0": "/dev/nvidia0,gid=44", "lxc": [["lxc.mount.entry", "b"], ["lxc.cgroup2.devices.allow", "a"]]})
    lines = pct(registry, "config", "129").stdout.splitlines()
    assert lines[-2:] == ["lxc.mount.entry: b", "lxc.cgroup2.devices.allow: a"]
    head = [line.split(":")[0] for line in lines[:-2]]
    assert head == sorted(head)
    assert "dev0: /dev/nvidia0,gid=44" in lines


# ---------------------------------------------------------------------- exec
def test_argv_arrives_unchanged(registry):
    register(registry, 129)
    argv = ["a b", "'single'", '"double"', "$(id)", "`id`", "-n", "--", "--keep-env", "ünïcødé ✓", "", "*"]
    code = "import json, sys; print(json.dumps(sys.argv[1:]))"
    proc = pct(registry, "exec", "129", "--", sys.executable, "-c", code, *argv)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == argv


def test_options_may_follow_the_vmid_before_the_double_dash(registry):
    register(registry, 129)
    proc = pct(registry, "exec", "129", "--keep-env=0", "--", "/usr/bin/env")
    assert proc.returncode == 0
    assert proc.stdout.splitlines() == ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "container=lxc"]
    # The container's own environment (its lxc.environment) is set either way, as lxc-attach sets it.
    register(registry, 130, environment={"GPUSIM_STATE": "/run/gpusim"})
    for keep in ("0", "1"):
        env = dict(line.split("=", 1) for line in pct(registry, "exec", "130", f"--keep-env={keep}", "--", "/usr/bin/env").stdout.splitlines())
        assert env["GPUSIM_STATE"] == "/run/gpusim" and env["container"] == "lxc", env


def test_keep_env_default_passes_the_environment_with_pct_path(registry):
    register(registry, 129)
    proc = pct(registry, "exec", "129", "--", "/usr/bin/env", env={"MY_VAR": "x y", "SSL_CERT_FILE": "/etc/ssl/x.pem"})
    env = dict(line.split("=", 1) for line in proc.stdout.splitlines())
    assert env["MY_VAR"] == "x y"
    assert env["PATH"] == "/sbin:/bin:/usr/sbin:/usr/bin"
    assert env["container"] == "lxc"
    assert "SSL_CERT_FILE" not in env
    assert "PCTSIM_DIR" not in env


@pytest.mark.parametrize(
    ("argv", "rc"),
    [
        (["/bin/sh", "-c", "exit 0"], 0),
        (["/bin/sh", "-c", "exit 3"], 3),
        (["/bin/sh", "-c", "exit 255"], 255),
        (["no-such-command-anywhere"], 127),
        (["/etc/hostname"], 126),
        (["/bin/sh", "-c", "kill -TERM $$"], 128 + 15),
        (["/bin/sh", "-c", "kill -KILL $$"], 128 + 9),
    ],
)
def test_exit_status_is_the_commands(registry, argv, rc):
    register(registry, 129)
    assert pct(registry, "exec", "129", "--", *argv).returncode == rc


def test_stdin_passes_through(registry):
    register(registry, 129)
    proc = pct(registry, "exec", "129", "--", "/usr/bin/tr", "a-z", "A-Z", stdin="hello\n")
    assert proc.stdout == "HELLO\n"


def test_every_call_is_logged(registry):
    register(registry, 129)
    pct(registry, "status", "129")
    pct(registry, "exec", "129", "--", "/bin/true", "x y")
    logged = [json.loads(line)["argv"] for line in (registry / "calls.jsonl").read_text().splitlines()]
    assert logged == [["status", "129"], ["exec", "129", "--", "/bin/true", "x y"]]


# ---------------------------------------------------------------------- a real PID-namespace container
@pytest.fixture
def container(registry):
    """A 'container': sleep as PID 1 of a new PID + mount namespace with its own /proc."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"):
        pytest.fail("needs root, unshare and nsenter (util-linux)")
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "sleep", "300"])
    deadline = time.monotonic() + 10
    init = None
    while time.monotonic() < deadline and init is None:
        children = Path(f"/proc/{outer.pid}/task/{outer.pid}/children")
        pids = children.read_text().split() if children.exists() else []
        init = int(pids[0]) if pids else None
        time.sleep(0.02)
    assert init, "the namespace's init did not start"
    register(registry, 150, pid=init)
    try:
        yield init
    finally:
        # unshare ignores SIGTERM while it waits; ending the namespace's init ends it all.
        try:
            os.kill(init, 9)
        except ProcessLookupError:
            pass
        try:
            outer.wait(timeout=10)
        except subprocess.TimeoutExpired:
            outer.kill()
            outer.wait(timeout=10)


def test_exec_enters_the_containers_pid_and_mount_namespaces(registry, container):
    proc = pct(registry, "exec", "150", "--", "/bin/sh", "-c", "cat /proc/1/comm; echo $$; ls /proc | grep -c '^[0-9]'")
    assert proc.returncode == 0, proc.stderr
    comm, mypid, nprocs = proc.stdout.split()
    assert comm == "sleep"  # PID 1 in there is the container's init, not the host's
    assert int(mypid) < 10
    assert int(nprocs) < 10
    assert Path(f"/proc/{container}/ns/pid").resolve() != Path("/proc/self/ns/pid").resolve()


def test_exec_in_the_namespace_keeps_exit_codes(registry, container):
    assert pct(registry, "exec", "150", "--", "/bin/sh", "-c", "exit 7").returncode == 7
    assert pct(registry, "exec", "150", "--", "no-such-command-anywhere").returncode == 127
    assert pct(registry, "exec", "150", "--", "/bin/sh", "-c", "kill -TERM $$").returncode == 143


@pytest.fixture
def unprivileged(registry):
    """An unprivileged 'container': its own user namespace (root inside is host uid 100000, as
    Proxmox maps it), PID and mount namespaces; sleep is its init."""
    if os.geteuid() != 0:
        pytest.fail("needs root")
    nsview = Path(__file__).resolve().parents[1] / "gpusim" / "_nsview.py"
    argv = [
        sys.executable,
        "-I",
        "-S",
        str(nsview),
        "--map",
        "100000",
        "65536",
        "--",
        "unshare",
        "--pid",
        "--fork",
        "--mount-proc",
        "--kill-child",
        "sleep",
        "300",
    ]
    outer = subprocess.Popen(argv)
    deadline = time.monotonic() + 10
    init = None
    while time.monotonic() < deadline and init is None:
        # The first child may be _nsview's short-lived id-map helper: wait for the init itself.
        children = Path(f"/proc/{outer.pid}/task/{outer.pid}/children")
        pids = children.read_text().split() if children.exists() else []
        init = next((int(p) for p in pids if Path(f"/proc/{p}/comm").exists() and Path(f"/proc/{p}/comm").read_text().strip() == "sleep"), None)
        time.sleep(0.02)
    assert init, "the namespace's init did not start"
    register(registry, 151, pid=init, unprivileged=1)
    try:
        yield init
    finally:
        try:
            os.kill(init, 9)
        except ProcessLookupError:
            pass
        outer.wait(timeout=10)


def test_exec_enters_an_unprivileged_containers_user_namespace(registry, unprivileged):
    proc = pct(registry, "exec", "151", "--", "/bin/sh", "-c", "id -u; cat /proc/self/uid_map; cat /proc/1/comm")
    assert proc.returncode == 0, proc.stderr
    uid, inner, outer, count, comm = proc.stdout.split()
    # root inside, host uid 100000 outside: the shifted map of an unprivileged container
    assert (uid, inner, outer, count, comm) == ("0", "0", "100000", "65536", "sleep")
    with open(f"/proc/{unprivileged}/status") as fh:
        assert next(line.split()[1] for line in fh if line.startswith("Uid:")) == "100000"


def test_container_whose_init_died_is_not_running(registry, container):
    os.kill(container, 9)
    deadline = time.monotonic() + 5
    while Path(f"/proc/{container}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    proc = pct(registry, "exec", "150", "--", "true")
    assert (proc.returncode, proc.stderr) == (255, "container '150' not running!\n")
