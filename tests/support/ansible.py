"""Run real Ansible (ansible-playbook and the module transport) from tests.

Every functional, lab and benchmark test goes through these helpers, so the
modules run exactly as they do for users: AnsiballZ payload, interpreter,
connection plugin. Results come back through the ``results_json`` callback.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

ROOT = Path(__file__).resolve().parents[2]
# GPUOPS_TEST_VENV: run the tests' Ansible from another virtual environment (another ansible-core series: a machine
# whose newest Python is 3.11 gets 2.19, tools/pick-python), its python also the modules' interpreter.
VENV = Path(os.environ.get("GPUOPS_TEST_VENV") or ROOT / ".venv")
VENV_PYTHON = str(VENV / "bin" / "python")
CALLBACK_DIR = Path(__file__).resolve().parent / "callback"


def ansible_env(extra: dict[str, str] | None = None, results_path: str | None = None) -> dict[str, str]:
    """Environment for an Ansible run from the checkout."""
    env = dict(os.environ)
    env.update(
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_COLLECTIONS_PATH=str(ROOT),
        ANSIBLE_CALLBACK_PLUGINS=str(CALLBACK_DIR),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_HOST_KEY_CHECKING="False",
        ANSIBLE_LOCAL_TEMP=os.path.join(tempfile.gettempdir(), "gpuops-ansible-local"),
        ANSIBLE_REMOTE_TEMP=os.path.join(tempfile.gettempdir(), "gpuops-ansible-remote"),
        PATH=f"{VENV / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
    )
    if results_path:
        env["GPUOPS_TEST_RESULTS"] = results_path
    if extra:
        env.update(extra)
    return env


@dataclass
class AnsibleRun:
    """Outcome of one ansible-playbook run."""

    rc: int
    stdout: str
    stderr: str
    elapsed: float
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def results(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("status") != "stats"]

    @property
    def stats(self) -> dict[str, Any]:
        for r in reversed(self.records):
            if r.get("status") == "stats":
                return r
        return {}

    def task(self, name: str, host: str | None = None) -> dict[str, Any]:
        """The last result record of the task called ``name`` (for ``host``)."""
        # Role tasks are reported as "<role> : <name>".
        found = [r for r in self.results if (r["task"] == name or r["task"].endswith(f" : {name}")) and (host is None or r["host"] == host)]
        if not found:
            raise AssertionError(f"task {name!r} has no result; tasks seen: {sorted({r['task'] for r in self.results})}\n{self.output}")
        return found[-1]

    def clean_slate_result(self, host: str | None = None) -> dict[str, Any]:
        """The role's last ``clean_slate_result`` fact (for ``host``)."""
        found = [
            r["result"]["ansible_facts"]["clean_slate_result"]
            for r in self.results
            if "clean_slate_result" in ((r.get("result") or {}).get("ansible_facts") or {}) and (host is None or r["host"] == host)
        ]
        if not found:
            raise AssertionError(f"no clean_slate_result for {host}\n{self.output}")
        return found[-1]

    def summary(self, host: str | None = None) -> str:
        """The role's summary line of ``host`` (clean_slate_result.summary): what the role's last task shows for every
        host, and the message it fails a dirty host with."""
        return str(self.clean_slate_result(host)["summary"])

    def role_clean(self, host: str | None = None) -> dict[str, Any]:
        """The record of the role's "Clean the GPUs" task (for ``host``): its clean_slate_node run."""
        found = [r for r in self.results if r["task"].split(" : ")[-1].startswith("Clean the GPUs") and (host is None or r["host"] == host)]
        if not found:
            raise AssertionError(f"no 'Clean the GPUs' task for {host}\n{self.output}")
        return found[-1]

    def node_runs(self, host: str | None = None) -> list[dict[str, Any]]:
        """The results of every execution of gpuops.clean_slate.clean_slate_node on a host (for ``host``): the module's
        own tasks and the role's, not a task its action plugin answered without running it (tags that select nothing,
        a refused host with nothing to record on the node)."""
        return [r for r in self.results if is_node_run(r) and (host is None or r["host"] == host)]

    def phase(self, name: str, host: str | None = None) -> dict[str, Any]:
        """A phase's result (before, plan, pre_stop, kill, residue, verify) in the last run of
        gpuops.clean_slate.clean_slate_node (for ``host``): what that phase's own module returns."""
        runs = self.node_runs(host)
        if not runs or name not in runs[-1]["result"]:
            raise AssertionError(f"no {name!r} phase result; clean_slate_node results: {[r['result'] for r in runs]}\n{self.output}")
        return runs[-1]["result"][name]

    def by_action(self, action: str, host: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.results if r["action"].endswith(action) and (host is None or r["host"] == host)]

    @property
    def output(self) -> str:
        return f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"


def is_node_run(record: dict[str, Any]) -> bool:
    """Whether a result record (ours or the GPU harness's) is an execution of gpuops.clean_slate.clean_slate_node on its
    host: every result the module returns, success or failure, says which Python ran it."""
    result = record.get("result") or {}
    return str(record.get("action", "")).endswith("clean_slate_node") and record.get("status") != "skipped" and isinstance(result, dict) and "python" in result


def run_playbook(
    playbook: str | Path | list[dict[str, Any]],
    inventory: str | Path | None = None,
    extra_vars: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    check: bool = False,
    diff: bool = False,
    limit: str | None = None,
    tags: str | None = None,
    forks: int | None = None,
    args: Sequence[str] = (),
    wrapper: Sequence[str] = (),
    timeout: float = 600,
    cwd: str | Path | None = None,
    runner: Any = None,
    owner: int | None = None,
) -> AnsibleRun:
    """Run ansible-playbook; ``playbook`` is a path or a list of plays to write out.

    ``wrapper`` prefixes the command (for example an ``nsenter`` into a
    sandbox PID namespace). ``runner(cmd, env=, cwd=, timeout=)`` replaces
    subprocess.run (the host gate runs Ansible under its signal guard). ``owner``
    hands the run's files to that uid (Ansible run as an unprivileged container's root).
    """
    with tempfile.TemporaryDirectory(prefix="gpuops-run-") as tmp:
        if owner is not None:
            os.chown(tmp, owner, owner)
        if isinstance(playbook, list):
            path = Path(tmp) / "playbook.yml"
            path.write_text(yaml.safe_dump(playbook, sort_keys=False))
            playbook = path
        results_path = str(Path(tmp) / "results.jsonl")
        cmd = [*wrapper, str(VENV / "bin" / "ansible-playbook"), str(playbook)]
        if inventory is not None:
            cmd += ["-i", str(inventory)]
        if extra_vars:
            evfile = Path(tmp) / "extra_vars.json"
            evfile.write_text(json.dumps(extra_vars))
            if owner is not None:
                os.chown(evfile, owner, owner)
            cmd += ["-e", f"@{evfile}"]
        if check:
            cmd.append("--check")
        if diff:
            cmd.append("--diff")
        if limit:
            cmd += ["--limit", limit]
        if tags:
            cmd += ["--tags", tags]
        if forks:
            cmd += ["--forks", str(forks)]
        cmd += list(args)
        start = time.monotonic()
        if runner is not None:
            proc = runner(cmd, env=ansible_env(env, results_path), cwd=str(cwd or ROOT), timeout=timeout)
        else:
            proc = subprocess.run(
                cmd,
                env=ansible_env(env, results_path),
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=str(cwd or ROOT),
                check=False,
            )
        elapsed = time.monotonic() - start
        records: list[dict[str, Any]] = []
        if os.path.exists(results_path):
            with open(results_path, encoding="utf-8") as fh:
                records = [json.loads(line) for line in fh if line.strip()]
        return AnsibleRun(proc.returncode, proc.stdout, proc.stderr, elapsed, records)


def local_play(
    tasks: list[dict[str, Any]], name: str = "Test play", gather_facts: bool = False, interpreter: str = VENV_PYTHON, **play: Any
) -> list[dict[str, Any]]:
    """A one-play playbook against localhost over the local connection."""
    return [
        {
            "name": name,
            "hosts": "localhost",
            "connection": "local",
            "gather_facts": gather_facts,
            "vars": {"ansible_python_interpreter": interpreter},
            **play,
            "tasks": tasks,
        }
    ]


def run_module(
    module: str,
    module_args: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    check: bool = False,
    diff: bool = False,
    wrapper: Sequence[str] = (),
    timeout: float = 300,
    interpreter: str = VENV_PYTHON,
    runner: Any = None,
    owner: int | None = None,
) -> tuple[dict[str, Any], AnsibleRun]:
    """Run one module on localhost through ansible-playbook and return its result."""
    name = f"Run {module}"
    task: dict[str, Any] = {"name": name, module: module_args or {}}
    run = run_playbook(
        local_play([task], interpreter=interpreter),
        inventory="localhost,",
        env=env,
        check=check,
        diff=diff,
        wrapper=wrapper,
        timeout=timeout,
        runner=runner,
        owner=owner,
    )
    record = run.task(name)
    result = dict(record["result"])
    result["_status"] = record["status"]
    return result, run


def plain(value: Any) -> Any:
    """ansible-inventory JSON with the unsafe-string wrappers removed."""
    if isinstance(value, dict):
        if set(value) == {"__ansible_unsafe"}:
            return value["__ansible_unsafe"]
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def local_inventory(path: Path, hosts: dict[str, dict[str, Any]], group: str = "gpu_nodes") -> Path:
    """Write an inventory of local-connection hosts (on simulated nodes) in ``group``.

    Each host gets the controller venv's interpreter; ``hosts`` maps names to extra host vars.
    """
    inventory = {group: {"hosts": {name: {"ansible_connection": "local", "ansible_python_interpreter": VENV_PYTHON, **hv} for name, hv in hosts.items()}}}
    path.write_text(yaml.safe_dump(inventory, sort_keys=False))
    return path


def write_docs_section(docs: Path, heading: str, section: str) -> None:
    """Replace (or append) the ``## heading`` section of a Markdown file, leaving the others alone."""
    text = docs.read_text(encoding="utf-8") if docs.exists() else "# Benchmarks\n"
    start = text.find(heading)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(heading))
        text = text[:start] + section + (text[nxt + 1 :] if nxt >= 0 else "")
    docs.write_text(text.rstrip("\n") + "\n", encoding="utf-8")
