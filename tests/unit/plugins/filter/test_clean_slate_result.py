"""The role's filters: its result, the refusal of its variables, survey text, and the one mapping from role
variables to module options (the role's tasks/main.yml)."""

from __future__ import annotations

import typing as t
from pathlib import Path

import pytest
import yaml
from ansible.errors import AnsibleFilterError

from ansible_collections.gpuops.clean_slate.plugins.filter import clean_slate_result as f
from ansible_collections.gpuops.clean_slate.plugins.filter.text_list import text_list
from ansible_collections.gpuops.clean_slate.plugins.module_utils import _node, _restore
from ansible_collections.gpuops.clean_slate.plugins.plugin_utils import _record

ROOT = Path(__file__).resolve().parents[4]
ROLE = ROOT / "roles" / "clean_slate"
DEFAULTS: dict[str, t.Any] = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
SPEC = f.role_spec(str(ROLE))


def test_the_argument_spec_covers_every_public_variable_and_nothing_else() -> None:
    assert set(SPEC) == {k for k in DEFAULTS if k.startswith("clean_slate_")}


def test_every_module_option_the_role_writes_out_names_a_role_variable() -> None:
    mapped = _record.option_variables(str(ROLE))
    tasks = yaml.safe_load((ROLE / "tasks" / "main.yml").read_text())
    node = next(t["gpuops.clean_slate.clean_slate_node"] for t in tasks[0]["block"] if "gpuops.clean_slate.clean_slate_node" in t)
    for section in ("verify", "kill", "residue"):
        for option in node[section]:
            assert mapped.get(f"{section}.{option}") in SPEC, (section, option)
    for option in ("containers", "pre_stop", "pre_stop_timeout", "restore", "metrics"):
        assert mapped.get(option) in SPEC, option
    # Each phase's options are that module's own (the module refuses an unknown one).
    assert set(node["kill"]) <= set(_node._kill.argument_spec()) and set(node["residue"]) <= set(_node.residue_module.argument_spec())
    assert set(node["verify"]) <= set(_node._verify.argument_spec()) and set(node) <= set(_node.argument_spec())
    assert (mapped["kill.grace_period"], mapped["verify.timeout"], mapped["containers"]) == (
        "clean_slate_grace_period",
        "clean_slate_verify_timeout",
        "clean_slate_vmid",
    )


def test_refusals_name_the_variable_without_pythons_types_and_unknown_names_get_the_nearest() -> None:
    given = {
        **DEFAULTS,
        "clean_slate_grace_period": "soon",
        "clean_slate_signal": "STOPP",
        "clean_slate_expected_gpu": 8,
        "clean_slate_zzz": True,
        # The role's own result and its hook's reading are not options and not refused.
        "clean_slate_result": {},
        "clean_slate_preflight": {},
    }
    out = f.role_refusals(given, str(ROLE))
    # Ansible's own validator, in its words (ansible.builtin.validate_argument_spec says the same), without Python's types.
    assert out[0] == "clean_slate_grace_period must be a number; the value given is text that cannot be read as one."
    assert out[1] == "value of clean_slate_signal must be one of: TERM, INT, HUP, QUIT, USR1, USR2, KILL, got: STOPP."
    # The unknown names in one sentence, each with its nearest known name where there is one, the advice said once.
    assert out[2] == (
        "clean_slate_expected_gpu (did you mean clean_slate_expected_gpus?) and clean_slate_zzz are not variables of the"
        " gpuops.clean_slate.clean_slate role: rename or remove them (ansible-doc -t role gpuops.clean_slate.clean_slate lists them)."
    )
    assert len(out) == 3 and all("_AnsibleTaggedStr" not in s and "<class" not in s for s in out)
    # The defaults pass, and text the spec converts (survey answers) is no refusal.
    assert f.role_refusals(dict(DEFAULTS), str(ROLE)) == []
    assert f.role_refusals({**DEFAULTS, "clean_slate_grace_period": "2", "clean_slate_include_children": "yes"}, str(ROLE)) == []
    assert f.role_refusals({**DEFAULTS, "clean_slate_grace_perod": 5}, str(ROLE)) == [
        "clean_slate_grace_perod is not a variable of the gpuops.clean_slate.clean_slate role (did you mean clean_slate_grace_period?):"
        " rename or remove it (ansible-doc -t role gpuops.clean_slate.clean_slate lists them)."
    ]
    with pytest.raises(AnsibleFilterError):
        f.role_refusals(["clean_slate_signal"], str(ROLE))


def test_what_the_spec_cannot_say_is_refused_with_the_hosts_mode(tmp_path: Path) -> None:
    """A container cleaned from its node needs the node and its vmid; the venv an absolute path; the wheels a directory
    on the controller. Refused only with the host's mode given (the role passes it) and only where it applies."""
    given = {**DEFAULTS, "clean_slate_hypervisor": "", "clean_slate_vmid": 50}
    assert f.role_refusals(given, str(ROLE), mode="hypervisor", host="ct129") == [
        "clean_slate_hypervisor is empty, but clean_slate_mode is hypervisor for ct129: name the Proxmox node that hosts it"
        " (the gpuops.clean_slate.proxmox inventory sets proxmox_node_host).",
        'clean_slate_vmid must be the container\'s vmid (an integer from 100) in hypervisor mode, got "50"'
        " (the gpuops.clean_slate.proxmox inventory sets proxmox_vmid).",
    ]
    assert f.role_refusals({**given, "clean_slate_hypervisor": "pve1", "clean_slate_vmid": "129"}, str(ROLE), mode="hypervisor", host="ct129") == []
    # A local host's node and vmid are not looked at; without mode, only the spec's refusals.
    assert f.role_refusals(given, str(ROLE), mode="local", host="ct129") == [] == f.role_refusals(given, str(ROLE))
    deps = {**DEFAULTS, "clean_slate_install_dependencies": True, "clean_slate_venv_dir": "opt/venv", "clean_slate_wheels_dir": "wheels"}
    missing = str(tmp_path / "wheels")
    assert f.role_refusals(deps, str(ROLE), mode="local", host="h", wheels_path=missing) == [
        'clean_slate_venv_dir must be an absolute path on the host where the modules run, got "opt/venv".',
        f'clean_slate_wheels_dir must be a directory on the controller holding the wheels to install, got "wheels" ({missing} is not a directory).',
    ]
    (tmp_path / "wheels").mkdir()
    ok = {**deps, "clean_slate_venv_dir": "/opt/venv"}
    assert f.role_refusals(ok, str(ROLE), mode="local", host="h", wheels_path=missing) == []
    # Without clean_slate_install_dependencies neither is the role's business.
    assert f.role_refusals({**deps, "clean_slate_install_dependencies": False}, str(ROLE), mode="local", host="h", wheels_path="/nowhere") == []


def test_published_for_a_batch_holds_each_host_the_role_recorded() -> None:
    result = {"clean": True, "summary": "a: 2/2 GPUs clean", "gpus": [{"index": 0}], "targets": [{"pid": 1}]}
    hostvars = {
        "a": {"clean_slate_result": result, "_clean_slate_r_node": {"in_run": True}},
        # Rescued before the clean (one of its tasks before the kill failed): recorded all the same.
        "b": {"clean_slate_result": {"clean": False, "summary": "b: FAILED"}},
        # A run for other --tags: the role recorded nothing (an older result is not published again).
        "c": {"clean_slate_result": result, "_clean_slate_r_node": {"in_run": False}},
        # Not reached by the role.
        "d": {},
    }
    out = f.clean_slate_published(["a", "b", "c", "d", "e"], hostvars)
    assert out == {"a": {"clean": True, "summary": "a: 2/2 GPUs clean"}, "b": {"clean": False, "summary": "b: FAILED"}}
    assert f.clean_slate_published(result) == {"clean": True, "summary": "a: 2/2 GPUs clean"}
    with pytest.raises(AnsibleFilterError):
        f.clean_slate_published("a", hostvars)


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ({}, {}),
        ("", {}),
        ({"compute_mode": "default"}, {"gpus": [0], "compute_mode": "default"}),
        ("compute_mode=default mps=stopped", {"gpus": [0], "compute_mode": "default", "mps": "stopped"}),
        ('{"mps": "stopped", "gpus": [3]}', {"gpus": [3], "mps": "stopped"}),
    ],
)
def test_restore_options_declare_only_what_was_given(given: t.Any, want: dict[str, t.Any]) -> None:
    got = f.restore_options(given, [0])
    assert got == want
    if got:
        # gpu_mode_restore's own spec takes them.
        _node.phase_params("restore", _restore.argument_spec(), got)


def test_restore_options_refuse_what_is_no_dictionary() -> None:
    with pytest.raises(AnsibleFilterError, match="clean_slate_restore must be a dictionary"):
        f.restore_options(["compute_mode"], [])


@pytest.mark.parametrize(
    ("given", "split", "read"),
    [
        ([], True, []),
        (None, True, []),
        ([0, 1], True, [0, 1]),
        ("0,1", True, [0, 1]),
        (" 0 , 1 ,", True, [0, 1]),
        ("[0, 1]", True, [0, 1]),
        ("GPU-1234-abcd", True, ["GPU-1234-abcd"]),
        (3, True, [3]),
        (["2", "/dev/nvidia1"], True, [2, "/dev/nvidia1"]),
        ("", True, []),
        ("[0, {]", True, ["[0, {]"]),  # no YAML: one value, which the module then refuses naming it
        ("^a{1,2}$", False, ["^a{1,2}$"]),  # a regular expression may hold a comma
        ("echo a,b", False, ["echo a,b"]),
        ("alice, bob", True, ["alice", "bob"]),
        ("[x, y]", False, ["x", "y"]),
    ],
)
def test_text_lists_read_as_a_survey_or_the_inventory_gives_them(given: t.Any, split: bool, read: list[t.Any]) -> None:
    assert text_list(given, split=split) == read


def test_the_result_filter_refuses_what_is_not_a_run_and_maps_a_failed_hook() -> None:
    with pytest.raises(AnsibleFilterError):
        f.clean_slate_result([["verify", "verify", {}]], {})
    with pytest.raises(AnsibleFilterError):
        f.clean_slate_result({}, "not a context")
    error = {"failed": True, "phase": "before_kill", "msg": "Drain the load balancer: Status code was 503"}
    r = f.clean_slate_result({}, {"host": "h", "error": error, "fail_on_dirty": True})
    assert (r["clean"], r["phase"], r["reason"]) == (False, "before_kill", "before_kill_failed")
    assert r["msg"] == "Drain the load balancer: Status code was 503. Nothing was ended."
