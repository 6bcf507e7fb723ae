"""_role: the clean_slate role's controller-side logic (the clean_slate_host action plugin), as the role's Jinja had it.

The functional tests run it through ansible-playbook; these pin the rules one by one (survey text, refusals that
name the variable, the targets per mode, the metrics text Prometheus parses)."""

from __future__ import annotations

import typing as t
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _node, _restore
from ansible_collections.gpuops.clean_slate.plugins.plugin_utils import _result, _role

ROOT = Path(__file__).resolve().parents[4]
DEFAULTS: dict[str, t.Any] = yaml.safe_load((ROOT / "roles" / "clean_slate" / "defaults" / "main.yml").read_text())


def role_vars(**over: t.Any) -> dict[str, t.Any]:
    v = {k: x for k, x in DEFAULTS.items() if k.startswith("clean_slate_")}
    v.update(clean_slate_hypervisor="", clean_slate_vmid=0)
    v.update(over)
    return v


@pytest.mark.parametrize(
    ("given", "read"),
    [
        ([], []),
        (None, []),
        ([0, 1], [0, 1]),
        ("0,1", [0, 1]),
        (" 0 , 1 ,", [0, 1]),
        ("[0, 1]", [0, 1]),
        ("GPU-1234-abcd", ["GPU-1234-abcd"]),
        (3, [3]),
        (["2", "/dev/nvidia1"], [2, "/dev/nvidia1"]),
        ("", []),
        ("[0, {]", ["[0, {]"]),  # no YAML: one value, which the refusal then names
    ],
)
def test_gpus_are_read_as_the_survey_or_the_inventory_gives_them(given: t.Any, read: list[t.Any]) -> None:
    assert _role.gpu_list(given) == read


def test_lists_split_where_a_comma_cannot_be_part_of_a_value() -> None:
    read = _role.lists(
        role_vars(clean_slate_users="alice, bob", clean_slate_patterns="^a{1,2}$", clean_slate_pre_stop_commands="echo a,b", clean_slate_protect="[x, y]")
    )
    assert read["clean_slate_users"] == ["alice", "bob"]
    assert read["clean_slate_patterns"] == ["^a{1,2}$"]  # a regular expression may hold a comma
    assert read["clean_slate_pre_stop_commands"] == ["echo a,b"]
    assert read["clean_slate_protect"] == ["x", "y"]
    assert read["clean_slate_unprotect"] == []


def test_good_defaults_have_no_problem() -> None:
    v = role_vars()
    assert _role.problems(v, _role.gpu_list(v["clean_slate_gpus"]), _role.lists(v), "local", "h", "") == []


@pytest.mark.parametrize(
    ("over", "mode", "says"),
    [
        ({"clean_slate_verify_timeout": -1}, "local", "clean_slate_verify_timeout must be >= 0, got -1."),
        ({"clean_slate_grace_period": "soon"}, "local", 'clean_slate_grace_period must be a number >= 0, got "soon".'),
        ({"clean_slate_verify_interval": 0}, "local", "clean_slate_verify_interval must be > 0, got 0."),
        ({"clean_slate_pre_stop_timeout": True}, "local", 'clean_slate_pre_stop_timeout must be a number > 0, got "True".'),
        ({"clean_slate_gpus": "0,x"}, "local", 'clean_slate_gpus: "x" is not a GPU index, a GPU UUID nor a device path (given: "0,x")'),
        ({"clean_slate_gpus": [-1]}, "local", 'clean_slate_gpus: "-1" is not a GPU index'),
        ({"clean_slate_users": [""]}, "local", None),  # an empty string in a list is dropped only from text; a list keeps it
        ({"clean_slate_protect": [3]}, "local", 'clean_slate_protect: every element must be a non-empty string, got "3".'),
        ({"clean_slate_metrics_dir": "metrics"}, "local", "clean_slate_metrics_dir must be an absolute path on the GPU node"),
        ({"clean_slate_install_dependencies": True, "clean_slate_venv_dir": "opt/venv"}, "local", "clean_slate_venv_dir must be an absolute path"),
        ({"clean_slate_vmid": 129}, "hypervisor", "clean_slate_hypervisor is empty, but clean_slate_mode is hypervisor for h:"),
        (
            {"clean_slate_hypervisor": "pve1", "clean_slate_vmid": 99},
            "hypervisor",
            'clean_slate_vmid must be the container\'s vmid (an integer from 100) in hypervisor mode, got "99"',
        ),
    ],
)
def test_each_bad_variable_is_named_in_its_own_sentence(over: dict[str, t.Any], mode: str, says: str | None) -> None:
    v = role_vars(**over)
    found = _role.problems(v, _role.gpu_list(v["clean_slate_gpus"]), _role.lists(v), mode, "h", "")
    if says is None:
        assert found == ['clean_slate_users: every element must be a non-empty string, got "".']
    else:
        assert len(found) == 1 and found[0].startswith(says), found


SPEC = _role.argument_spec(str(ROOT))


def wrong(option: dict[str, t.Any]) -> t.Any:
    """A value the spec refuses for ``option`` (None when every value of its type is accepted: str, path, raw)."""
    kind, elements = option.get("type", "str"), option.get("elements")
    if "choices" in option:
        return ["no-such-choice"] if kind == "list" else "no-such-choice"
    return {"bool": "maybe", "int": "many", "float": "soon", "dict": "not a dict", "list": ["x"] if elements == "int" else None}.get(kind)


def test_the_argument_spec_is_the_roles_and_covers_every_public_variable() -> None:
    public = {k for k in DEFAULTS if k.startswith("clean_slate_")}
    assert set(SPEC) == public, set(SPEC) ^ public
    # The defaults pass it, as they pass Ansible's own check.
    assert _role.spec_problems(SPEC, role_vars()) == []
    assert _role.argument_spec(str(ROOT / "no-such-collection")) == {}


@pytest.mark.parametrize(("text", "options"), [("argument_specs: [unclosed\n", None), ("- a list\n", {}), ("argument_specs:\n  main: 3\n", {})])
def test_an_argument_spec_that_cannot_be_read_is_an_error_the_clean_step_records(tmp_path: Path, text: str, options: t.Any) -> None:
    spec = tmp_path / _role.ARGUMENT_SPECS
    spec.parent.mkdir(parents=True)
    spec.write_text(text)
    if options is None:
        with pytest.raises(ValueError, match=r"argument spec .* could not be parsed"):
            _role.argument_spec(str(tmp_path))
    else:
        assert _role.argument_spec(str(tmp_path)) == options
    assert _role.spec_problems({}, {"clean_slate_mode": "sideways"}) == []


@pytest.mark.parametrize("name", sorted(n for n, o in SPEC.items() if wrong(o) is not None))
def test_the_argument_spec_refuses_a_wrong_value_naming_its_variable(name: str) -> None:
    bad = _role.spec_problems(SPEC, role_vars(**{name: wrong(SPEC[name])}))
    assert len(bad) == 1 and name in bad[0] and bad[0].endswith("."), bad
    # What Ansible's own check says of it, word for word.
    from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

    ansible = ArgumentSpecValidator(SPEC).validate({name: wrong(SPEC[name])}, validate_role_argument_spec=True).error_messages
    assert [m.rstrip(".") for m in bad] == [m.rstrip(".") for m in ansible]


@pytest.mark.parametrize("given", ["compute_mode=default", '{"compute_mode": "default"}'])
def test_a_dictionary_given_as_text_is_read_as_the_spec_reads_it(given: str) -> None:
    v = role_vars(clean_slate_restore=given)
    bad, read = _role.spec_check(SPEC, v)
    assert bad == [] and _role.text_dicts(SPEC, v, read) == {"clean_slate_restore": {"compute_mode": "default"}}
    # A real dictionary, and text of other types, are left as they are.
    assert _role.text_dicts(SPEC, role_vars(clean_slate_restore={"mps": "stopped"}), read) == {}
    assert "clean_slate_grace_period" not in _role.text_dicts(SPEC, role_vars(clean_slate_grace_period="5"), read)


def test_refusals_put_the_specs_first_and_do_not_repeat_a_variable() -> None:
    spec_bad = ["argument 'clean_slate_grace_period' is of type str and we were unable to convert to float: no."]
    bad = ['clean_slate_grace_period must be a number >= 0, got "soon".', "clean_slate_kill_timeout must be >= 0, got -1."]
    assert _role.refusals(spec_bad, bad) == [spec_bad[0], bad[1]]
    assert _role.refusals([], bad) == bad


def test_a_wheels_dir_that_is_not_a_directory_is_refused(tmp_path: Path) -> None:
    v = role_vars(clean_slate_install_dependencies="yes", clean_slate_wheels_dir="w")
    missing = str(tmp_path / "w")
    assert _role.problems(v, [], _role.lists(v), "local", "h", missing) == [
        f'clean_slate_wheels_dir must be a directory on the controller holding the wheels to install, got "w" ({missing} is not a directory).'
    ]
    (tmp_path / "w").mkdir()
    assert _role.problems(v, [], _role.lists(v), "local", "h", missing) == []


def test_targets_local_and_through_the_hypervisor(tmp_path: Path) -> None:
    v = role_vars(clean_slate_hypervisor="pve1", clean_slate_vmid="129", clean_slate_report_dir="reports")
    local = _role.targets(v, [1], "local", "ct129", ["/dev/nvidia0"], str(tmp_path))
    assert (local["delegate"], local["label"], local["containers"], local["kill_gpus"], local["verify_gpus"]) == ("ct129", "ct129", [], [1], [1])
    assert local["report_path"] == str(tmp_path / "reports" / "ct129.json")
    ct = _role.targets(v, [], "hypervisor", "ct129", ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia3"], str(tmp_path))
    # In container scope the kill covers what the container touches; verification covers its GPU devices.
    assert (ct["delegate"], ct["label"], ct["containers"], ct["kill_gpus"], ct["verify_gpus"]) == (
        "pve1",
        "pve1/ct129",
        [129],
        [],
        ["/dev/nvidia0", "/dev/nvidia3"],
    )
    assert _role.targets(role_vars(clean_slate_report_dir="/abs"), [], "local", "h", [], "/cwd")["report_path"] == "/abs/h.json"
    # No hypervisor (a refused variable): the host itself, where the refusal is recorded.
    alone = _role.targets(role_vars(clean_slate_vmid=129), [], "hypervisor", "ct129", [], "/")
    assert (alone["delegate"], alone["label"], alone["containers"]) == ("ct129", "ct129", [129])


def test_node_args_in_check_mode_wait_for_nothing_and_fail_on_nothing() -> None:
    v = role_vars(clean_slate_expected_gpus="8", clean_slate_residue_enabled="false", clean_slate_restore={"compute_mode": "default"})
    tg = _role.targets(v, [], "local", "h", [], "/")
    args = _role.node_args(v, tg, _role.lists(v), True, 1000.0)
    assert args["phases"] == ["preflight", "kill", "restore", "verify"]
    assert args["verify"]["timeout"] == 0 and args["verify"]["fail_on_dirty"] is False and args["verify"]["expected_count"] == 8
    assert args["verify"]["since"] == 1000.0 and args["residue"]["fail_on"] == [] and args["kill"]["where"] is None
    # Only what was declared: the restore phase's own spec accepts it (a None mps is none of its choices).
    assert args["restore"] == {"gpus": [], "compute_mode": "default", "mps_timeout": 10}
    assert _node.phase_params("restore", _restore.argument_spec(), args["restore"])["mps"] is None
    for declared in ({"mps": "stopped"}, {"compute_mode": "prohibited", "mps": "stopped", "gpus": [1]}):
        r = _role.node_args(role_vars(clean_slate_restore=declared), tg, _role.lists(v), False, 1000.0)["restore"]
        want = {"probe_timeout": 10, "gpus": [], "compute_mode": None, "mps": None, "mps_timeout": 10, **declared}
        assert _node.phase_params("restore", _restore.argument_spec(), r) == want
    real = _role.node_args(role_vars(clean_slate_health_since="2026-12-01T00:00:00Z"), tg, _role.lists(v), False, 1000.0)
    assert real["verify"]["timeout"] == 30 and real["verify"]["fail_on_dirty"] is True and real["verify"]["since"] == "2026-12-01T00:00:00Z"
    assert real["phases"] == ["preflight", "kill", "residue", "verify"] and real["verify"]["expected_count"] is None


def test_a_run_refused_before_any_phase_is_the_failure_of_the_refused_phase() -> None:
    refused = {"failed": True, "phase": "kill", "reason": "bad_arguments", "msg": "grace_period: must be >= 0"}
    ph = _role.phase_results(refused, "local")
    assert ph["kill"] is refused and ph["before"] == {}
    args = {"failed": True, "phase": "arguments", "reason": "bad_arguments", "msg": "gpus: bad"}
    assert _role.phase_results(args, "local")["before"] is args
    res = _result.result(_role.steps({}, _role.phase_results(refused, "local")), {"host": "h", "option_vars": _role.OPTION_VARS})
    assert (res["phase"], res["reason"], res["msg"]) == ("kill", "bad_arguments", "clean_slate_grace_period: must be >= 0")


def test_missing_dependencies_are_not_the_preflights_failure() -> None:
    run = {"failed": True, "reason": "missing_library", "python": {"missing": ["psutil"]}, "before": {"failed": True, "reason": "missing_library"}}
    assert _role.deps_needed(run)
    assert _role.phase_results(run, "local")["before"]["failed"] is False
    down = {"unreachable": True, "msg": "no route"}
    assert _role.phase_results(down, "local")["before"] is down


def test_the_metrics_text_parses_as_prometheus_reads_it() -> None:
    gpu = {"index": 0, "uuid": "GPU-1", "pci_bus_id": "0000:18:00.0", "minor": 4, "name": 'H200 "SXM"', "used_mib": 3}
    r = {"clean": False, "ended": 2, "phase": "verify", "reason": "busy", "after": [3], "targets": [1], "gpus": [gpu], "health": {"verdict": "reboot"}}
    fams = {f.name: f for f in text_string_to_metric_families(_role.metrics_text(r, 'h"1', 100.0, 101.5))}
    assert fams["clean_slate_last_run_success"].samples[0].value == 0
    assert fams["clean_slate_last_run_duration_seconds"].samples[0].value == 1.5
    assert fams["clean_slate_last_run_info"].samples[0].labels == {"host": 'h"1', "phase": "verify", "reason": "busy"}
    assert fams["clean_slate_last_run_health"].samples[0].value == 3
    [used] = fams["clean_slate_gpu_used_mib"].samples
    assert used.labels["device"] == "nvidia4" and used.labels["modelName"] == 'H200 "SXM"' and used.value == 3
    assert _role.metrics_path(role_vars(clean_slate_metrics_dir="/m/"), "a b") == "/m/clean_slate_a_b.prom"


def test_what_is_published_leaves_the_long_lists_out() -> None:
    assert _role.published("h", {"clean": True, "gpus": [1], "targets": [2], "summary": "s"}) == {"h": {"clean": True, "summary": "s"}}
