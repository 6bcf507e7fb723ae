"""Green means clean in the user's own playbook too (issue 31), through real ansible-playbook on a simulated node.

* The one include pattern (README, guide and role docs say the same, read from them here): under every tag selection a
  user may pass, the task after the role never runs on a host whose GPUs are not proven clean, and a green host's GPUs
  are free in the simulated driver itself.
* An unknown clean_slate_* variable (``-e`` or the include's ``vars:``) is refused before anything runs, naming it and
  the nearest known name, and recorded like any refusal (summary, set_stats, JSON report, metrics); a wrong type given
  with ``-e`` reads without Python's type names.
* A failure is said once: the advice several GPUs share, once.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from gpusim import Node
from prometheus_client.parser import text_string_to_metric_families
from support.ansible import ROOT, VENV, AnsibleRun, ansible_env, local_inventory, run_playbook

ROLE = "gpuops.clean_slate.clean_slate"
DOCS = {
    "README.md": ("### Inside a deploy playbook", "```yaml", "```"),
    "docs/docsite/rst/guide_clean_slate.rst": ("From a larger deploy playbook", ".. code-block:: yaml", ""),
    "roles/clean_slate/README.md": ("## Using it in your own playbook", "```yaml", "```"),
}


def yaml_after(path: str) -> Any:
    """The first YAML block after the heading DOCS names in ``path``."""
    heading, opener, closer = DOCS[path]
    text = (ROOT / path).read_text()
    text = text[text.index(heading) :]
    body = text[text.index(opener) + len(opener) :]
    if closer:
        return yaml.safe_load(body[: body.index("```")])
    # reStructuredText: the indented lines after the directive.
    lines = body.lstrip("\n").splitlines()
    block = []
    for line in lines:
        if line and not line.startswith("    "):
            break
        block.append(line[4:])
    return yaml.safe_load("\n".join(block))


def the_include(doc: Any) -> dict[str, Any]:
    """The include_role task of a documented example (a play, or a list of tasks), without the example's own vars."""
    tasks = doc[0]["tasks"] if isinstance(doc, list) and "tasks" in doc[0] else doc
    found = [t for t in tasks if "ansible.builtin.include_role" in t]
    assert len(found) == 1, doc
    return {k: v for k, v in found[0].items() if k != "vars"}


def test_the_include_pattern_is_the_same_in_readme_guide_and_role_docs() -> None:
    """One pattern: tagged always, the play's tags applied to the role's tasks, Ansible's own spec check off."""
    includes = {path: the_include(yaml_after(path)) for path in DOCS}
    assert len({json.dumps(i, sort_keys=True) for i in includes.values()}) == 1, includes
    include = includes["README.md"]
    assert include["tags"] == ["always"]
    assert include["ansible.builtin.include_role"] == {"name": ROLE, "apply": {"tags": ["deploy"]}, "rolespec_validate": False}
    # What ansible-doc shows says the same.
    out = subprocess.run(
        [str(VENV / "bin" / "ansible-doc"), "-t", "role", ROLE], env=ansible_env(), capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    text = " ".join(out.split())
    for words in ("tags: [always]", "apply: {tags: [<your play's tags>]}", "rolespec_validate: false"):
        assert words in text, text[:3000]
    assert "or give it" not in text  # no second pattern


# ---------------------------------------------------------------------- the include pattern under every tag selection
def deploy_play(started: Path) -> list[dict[str, Any]]:
    """README.md's deploy play as written, its include task verbatim; the server start writes a file instead of starting
    SGLang (as a real start, it does nothing in check mode), and a task that runs in check mode too is guarded as the
    README says (``check_mode: false`` with ``when: clean_slate_result.clean``)."""
    play = yaml_after("README.md")
    tasks = play[0]["tasks"]
    assert tasks[1]["name"] == "Start SGLang" and tasks[1]["tags"] == ["deploy"]
    dest = f"{started}/{{{{ inventory_hostname }}}}"
    tasks[1] = {"name": "Start SGLang", "ansible.builtin.copy": {"content": "started\n", "dest": dest, "mode": "0644"}, "tags": ["deploy"]}
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "(`check_mode: false`) with `when: clean_slate_result.clean`" in readme
    guarded = {"content": "started\n", "dest": dest + ".guarded", "mode": "0644"}
    guard = {"check_mode": False, "when": "clean_slate_result.clean", "tags": ["deploy"]}
    tasks.append({"name": "Start, check mode too", "ansible.builtin.copy": guarded, **guard})
    return play


#: --tags/--skip-tags, then what must follow: the phases that ran, whether the host is on record and proven clean,
#: its reason when red, whether the worker holding a GPU was ended, whether the server started.
SELECTIONS = {
    "none": ([], ["preflight", "kill", "residue", "verify"], True, "", False, True),
    "tags-deploy": (["--tags", "deploy"], ["preflight", "kill", "residue", "verify"], True, "", False, True),
    "skip-deploy": (["--skip-tags", "deploy"], [], None, "", True, False),
    "tags-clean_slate": (["--tags", "clean_slate"], ["preflight", "kill", "residue", "verify"], True, "", False, False),
    "skip-clean_slate": (["--skip-tags", "clean_slate"], [], False, "not_verified", True, False),
    "tags-preflight": (["--tags", "clean_slate_preflight"], ["preflight"], False, "busy", True, False),
    "skip-preflight": (["--skip-tags", "clean_slate_preflight"], [], False, "gpus_not_read", True, False),
    "tags-kill": (["--tags", "clean_slate_kill"], ["preflight", "kill"], False, "not_verified", False, False),
    "skip-kill": (["--skip-tags", "clean_slate_kill"], ["residue", "verify"], False, "busy", True, False),
    "tags-residue": (["--tags", "clean_slate_residue"], ["residue"], False, "not_verified", True, False),
    "skip-residue": (["--skip-tags", "clean_slate_residue"], ["preflight", "kill", "verify"], True, "", False, True),
    "tags-restore": (["--tags", "clean_slate_restore"], [], False, "not_verified", True, False),
    "skip-restore": (["--skip-tags", "clean_slate_restore"], ["preflight", "kill", "residue", "verify"], True, "", False, True),
    "tags-verify": (["--tags", "clean_slate_verify"], ["verify"], False, "busy", True, False),
    "skip-verify": (["--skip-tags", "clean_slate_verify"], ["preflight", "kill", "residue"], False, "not_verified", False, False),
    "tags-other": (["--tags", "nginx"], [], None, "", True, False),
    "check": (["--check"], ["preflight", "kill", "residue", "verify"], False, "busy", True, False),
}

#: What the record says where a phase alone ran.
SAYS = {"tags-preflight": "Only the GPUs were read", "tags-kill": "the clean_slate_verify phase did not run"}

PHASE_KEYS = (("before", "preflight"), ("kill", "kill"), ("residue", "residue"), ("verify", "verify"))


def phases_run(run: AnsibleRun) -> list[str]:
    return [phase for r in run.node_runs() for key, phase in PHASE_KEYS if key in r["result"]]


def run_selection(work: Path, args: list[str]) -> tuple[AnsibleRun, list[int], Path]:
    """The deploy play under one tag selection, on a node of its own whose GPU 1 a worker holds; the run, the GPUs'
    memory in use as the simulated driver read it when the run ended, and the directory the start tasks write to."""
    started = work / "started"
    started.mkdir(parents=True)
    with Node(gpus=2, seed="include") as n:
        sb = n.sandbox()
        try:
            sb.spawn_worker(gpus=[1], mib=8000, title="sglang::scheduler_TP1")
            hv = {"clean_slate_device_dir": str(n.dev_dir), "clean_slate_grace_period": 1, "clean_slate_verify_timeout": 2}
            inv = local_inventory(work / "hosts.yml", {"host-a": hv})
            run = run_playbook(deploy_play(started), inventory=inv, env=n.env(), args=args, wrapper=sb.nsenter_prefix())
            return run, [n.memory(i)["used_mib"] for i in range(2)], started
        finally:
            sb.stop()


def test_the_task_after_the_role_never_runs_on_a_host_not_proven_clean(tmp_path: Path) -> None:
    """Every selection at once, each its own ansible-playbook on a node and in a PID namespace of its own: the runs
    mostly wait (grace periods, the verification's deadline, Ansible's polling), so together they take about as long
    as the slowest, not the sum."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        futures = {selection: pool.submit(run_selection, tmp_path / selection, want[0]) for selection, want in SELECTIONS.items()}
    for selection, (args, phases, clean, reason, survives, starts) in SELECTIONS.items():
        run, used, started = futures[selection].result()
        where = f"{selection}: {run.output}"
        assert phases_run(run) == phases, where
        published = (run.stats.get("custom") or {}).get("_run", {}).get("clean_slate", {})
        if clean is None:  # the role is not part of this run: nothing recorded, nothing failed
            assert published == {} and run.rc == 0, where
        else:
            entry = published["host-a"]
            assert entry["clean"] is clean and entry["reason"] == reason, (selection, entry)
            assert SAYS.get(selection, "") in entry["msg"], (selection, entry)
            # A host not proven clean fails (and Ansible runs no task after that on it), except in check mode, which
            # changes nothing and never fails a host for busy GPUs.
            failed = not clean and "--check" not in args
            assert run.rc == (2 if failed else 0) and run.stats["stats"]["host-a"]["failures"] == int(failed), where
        # The worker's 8000 MiB on GPU 1, as the simulated driver read them when the run ended.
        assert (used[1] >= 8000) == survives, (selection, used, run.output)
        # The server started only where the GPUs were proven clean, and they are: the simulated driver reads them free.
        assert (started / "host-a").exists() == starts, where
        # The README's guard keeps a task that runs even under --check off a host not proven clean.
        assert (started / "host-a.guarded").exists() == starts, where
        if starts:
            assert clean and used == [0, 0], (selection, used)


# ---------------------------------------------------------------------- unknown and wrong variables
def metrics(directory: Path, host: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families((directory / f"clean_slate_{host}.prom").read_text())}


@pytest.mark.parametrize("given", ["extra-vars", "include-vars"])
def test_a_misspelt_variable_is_refused_before_anything_runs_and_recorded(tmp_path: Path, given: str) -> None:
    """``-e clean_slate_expected_gpu=7 -e clean_slate_grace_perod=5`` (or the same under the include's ``vars:``) used
    to run green with the GPU-count check silently off; a wrong type given with -e read ``<class '..._AnsibleTaggedStr'>``."""
    reports, prom = tmp_path / "reports", tmp_path / "metrics"
    prom.mkdir()
    typos = {"clean_slate_expected_gpu": "7", "clean_slate_grace_perod": "5"}
    records = {"clean_slate_report_dir": str(reports), "clean_slate_metrics_dir": str(prom)}
    play = deploy_play(tmp_path)
    args: list[str] = []
    if given == "extra-vars":
        for k, v in {**typos, "clean_slate_kill_timeout": "soon"}.items():
            args += ["-e", f"{k}={v}"]
        play[0]["tasks"][0]["vars"] = records
    else:
        play[0]["tasks"][0]["vars"] = {**typos, **records}
    with Node(gpus=2, seed="typo") as n:
        sb = n.sandbox()
        try:
            worker = sb.spawn_worker(gpus=[0], mib=8000, title="sglang::scheduler_TP0")
            inv = local_inventory(tmp_path / "hosts.yml", {"host-a": {"clean_slate_device_dir": str(n.dev_dir)}})
            run = run_playbook(play, inventory=inv, env=n.env(), args=args, wrapper=sb.nsenter_prefix())
            assert worker.alive(), "a refused host ended a process"
        finally:
            sb.stop()
    assert run.rc == 2, run.output
    assert not phases_run(run) and not (tmp_path / "host-a").exists()
    entry = run.stats["custom"]["_run"]["clean_slate"]["host-a"]
    assert (entry["clean"], entry["phase"], entry["reason"]) == (False, "arguments", "bad_variable"), entry
    msg = entry["msg"]
    assert (
        "clean_slate_expected_gpu (did you mean clean_slate_expected_gpus?) and clean_slate_grace_perod (did you mean"
        " clean_slate_grace_period?) are not variables of the gpuops.clean_slate.clean_slate role: rename or remove them" in msg
    ), msg
    if given == "extra-vars":
        assert "clean_slate_kill_timeout must be a number; the value given is text that cannot be read as one." in msg, msg
    assert "<class" not in msg and "_AnsibleTagged" not in msg and "host-a" not in msg, msg
    assert msg.count("ansible-doc -t role") == 1 and msg.endswith("Nothing was changed."), msg
    # Recorded like any refusal: the summary printed once, the JSON report, the metrics on the node.
    assert entry["summary"] == f"host-a: GPUs not read, no process ended - FAILED in arguments (bad_variable): {msg}"
    assert len([line for line in run.stdout.splitlines() if line.startswith("fatal: [host-a]")]) == 1, run.output
    report = json.loads((reports / "host-a.json").read_text())
    assert (report["clean"], report["reason"], report["msg"]) == (False, "bad_variable", msg)
    fams = metrics(prom, "host-a")
    assert fams["clean_slate_last_run_success"].samples[0].value == 0
    assert fams["clean_slate_last_run_info"].samples[0].labels == {"host": "host-a", "phase": "arguments", "reason": "bad_variable"}


# ---------------------------------------------------------------------- a failure said once
def test_a_busy_node_fails_once_and_says_the_shared_advice_once(tmp_path: Path) -> None:
    """``--tags clean_slate_verify`` on a node whose seven GPUs are held: each GPU's facts (its UUID, memory, the PID
    holding it) a line each, the fix they share once, one failing task that shows those lines under the summary."""
    with Node(gpus=8, seed="noise") as n:
        sb = n.sandbox()
        try:
            workers = [sb.spawn_worker(gpus=[i], mib=8000, title=f"job{i}") for i in range(7)]
            inv = local_inventory(tmp_path / "hosts.yml", {"host-a": {"clean_slate_device_dir": str(n.dev_dir), "clean_slate_verify_timeout": 0}})
            run = run_playbook(ROOT / "playbooks" / "clean_slate.yml", inventory=inv, env=n.env(), tags="clean_slate_verify", wrapper=sb.nsenter_prefix())
            assert all(w.alive() for w in workers)
        finally:
            sb.stop()
    assert run.rc == 2, run.output
    entry = run.stats["custom"]["_run"]["clean_slate"]["host-a"]
    msg = entry["msg"]
    advice = "End the processes that hold it (the kill phase, gpuops.clean_slate.gpu_procs_kill) or stop the service that owns them."
    assert msg.count(advice) == 1 and f"(job0). Fix: {advice}" in msg, msg
    for i, w in enumerate(workers):
        assert re.search(rf"GPU {i} \(GPU-[0-9a-f-]+\): busy: \d+ MiB used, held by PID\(s\) {w.ns_pid} \(job{i}\)\.", msg), msg
    # One task fails the host and prints the failure, once in the whole output, a line per GPU under the summary; no task
    # that succeeded prints it.
    lines = run.stdout.splitlines()
    fatal = [i for i, line in enumerate(lines) if line.startswith("fatal: [host-a]")]
    assert len(fatal) == 1 and run.stdout.count(advice) == 1, run.output
    shown = "\n".join(lines[fatal[0] : fatal[0] + 12])
    assert advice in shown and "FAILED in verify (busy):" in shown and "7 of 8 GPU(s) not clean after" in shown, run.output
