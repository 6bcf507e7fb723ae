"""_checks: numbers must be finite and in range, paths must exist, vmids in Proxmox's range; each refusal names its option."""

from __future__ import annotations

import math

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _checks
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "10", True, None])
def test_only_finite_numbers_pass(value) -> None:
    if value is None:
        _checks.number("timeout", value, 0, 10)  # an unset option is not checked
        return
    with pytest.raises(CleanSlateError) as err:
        _checks.number("timeout", value, 0, 10, unit="seconds")
    assert err.value.reason == "bad_arguments"
    assert err.value.msg == f"timeout must be a finite number from 0 to 10 seconds, got {value!r}."


def test_bounds_are_inclusive_unless_open() -> None:
    for ok in (0, 0.0, 5, 10, 10.0):
        _checks.number("grace_period", ok, 0, 10)
    for bad, text in ((-0.5, "-0.5"), (10.5, "10.5"), (2**31, str(2**31))):
        with pytest.raises(CleanSlateError, match=rf"^grace_period must be from 0 to 10, got {text}\.$"):
            _checks.number("grace_period", bad, 0, 10)
    with pytest.raises(CleanSlateError, match=r"^interval must be more than 0 and at most 60 seconds, got 0\.$"):
        _checks.number("interval", 0, 0, 60, low_open=True, unit="seconds")
    _checks.number("interval", 0.001, 0, 60, low_open=True)


def test_paths(tmp_path) -> None:
    _checks.existing_dir("device_dir", str(tmp_path))
    with pytest.raises(CleanSlateError, match=f"^device_dir: {tmp_path}/nope does not exist on this host"):
        _checks.existing_dir("device_dir", str(tmp_path / "nope"))
    (tmp_path / "file").write_text("")
    with pytest.raises(CleanSlateError, match=f"^device_dir: {tmp_path}/file is not a directory"):
        _checks.existing_dir("device_dir", str(tmp_path / "file"))
    _checks.executable("pct_path", None)
    _checks.executable("pct_path", "/bin/sh")
    with pytest.raises(CleanSlateError, match=f"^pct_path: {tmp_path}/pct does not exist on this host"):
        _checks.executable("pct_path", str(tmp_path / "pct"))
    for not_runnable in (tmp_path, tmp_path / "file"):
        with pytest.raises(CleanSlateError, match=f"^pct_path: {not_runnable} is not an executable file"):
            _checks.executable("pct_path", str(not_runnable))


@pytest.mark.parametrize("value", [100, 129, 999_999_999])
def test_vmids_in_proxmox_range_pass(value) -> None:
    assert _checks.vmid("containers", value) == value


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (99, "containers: 99 is not a valid Proxmox vmid (100-999999999)."),
        (0, "containers: 0 is not a valid Proxmox vmid (100-999999999)."),
        (-5, "containers: -5 is not a valid Proxmox vmid (100-999999999)."),
        (1_000_000_000, "containers: 1000000000 is not a valid Proxmox vmid (100-999999999)."),
        # Not an integer at all: a bool is an int to Python, and a string is what a template may leave.
        (True, "containers: True is not a valid Proxmox vmid (an integer from 100 to 999999999)."),
        ("129", "containers: '129' is not a valid Proxmox vmid (an integer from 100 to 999999999)."),
    ],
)
def test_vmids_outside_proxmox_range_are_refused_naming_the_option(value, message) -> None:
    with pytest.raises(CleanSlateError) as err:
        _checks.vmid("containers", value)
    assert (err.value.msg, err.value.reason, err.value.details["option"]) == (message, "bad_arguments", "containers")


def test_every_refusal_names_its_option(tmp_path) -> None:
    for call in (
        lambda: _checks.number("interval", math.nan, 0, 1),
        lambda: _checks.existing_dir("device_dir", str(tmp_path / "nope")),
        lambda: _checks.executable("pct_path", str(tmp_path / "nope")),
        lambda: _checks.vmid("vmid", 5),
    ):
        with pytest.raises(CleanSlateError) as err:
            call()
        assert err.value.reason == "bad_arguments"
        assert err.value.msg.startswith(err.value.details["option"]), err.value.msg
