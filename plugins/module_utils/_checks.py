# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Option checks the modules share; each refusal is ``bad_arguments`` and names the option.

Ansible's ``float`` type accepts ``nan`` and ``inf``, and its ``int`` type any
size; a deadline built from them hangs a poll loop, busy-loops or overflows
``poll(2)``'s millisecond argument after signals were already sent. So every
number an operator can give is checked to be finite and within a documented
range, and every path that must exist is checked, before anything runs.
"""

from __future__ import annotations

import math
import os
import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _reasons
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError

#: The longest wait any option may ask for: one day, in seconds.
MAX_SECONDS = 86400
#: Proxmox VE's range of guest ids (PVE::JSONSchema, pve-vmid).
VMID_MIN = 100
VMID_MAX = 999_999_999


def number(name: str, value: t.Any, low: float, high: float, low_open: bool = False, unit: str = "") -> None:
    """Refuse ``value`` unless it is a finite number in [low, high] (or (low, high] with ``low_open``)."""
    if value is None:
        return
    suffix = f" {unit}" if unit else ""
    span = f"more than {_fmt(low)} and at most {_fmt(high)}{suffix}" if low_open else f"from {_fmt(low)} to {_fmt(high)}{suffix}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CleanSlateError(f"{name} must be a finite number {span}, got {value!r}.", reason=_reasons.BAD_ARGUMENTS, option=name)
    if value < low or (low_open and value <= low) or value > high:
        raise CleanSlateError(f"{name} must be {span}, got {_fmt(value)}.", reason=_reasons.BAD_ARGUMENTS, option=name)


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def existing_dir(name: str, path: str) -> None:
    """Refuse a directory option that names nothing, or something that is not a directory."""
    if not os.path.exists(path):
        raise CleanSlateError(
            f"{name}: {path} does not exist on this host; give the directory that holds the nvidia* device files.", reason=_reasons.BAD_ARGUMENTS, option=name
        )
    if not os.path.isdir(path):
        raise CleanSlateError(
            f"{name}: {path} is not a directory; give the directory that holds the nvidia* device files.", reason=_reasons.BAD_ARGUMENTS, option=name
        )


def executable(name: str, path: str | None) -> None:
    """Refuse a program option that names nothing, or a file that cannot be run."""
    if path is None:
        return
    if not os.path.exists(path):
        raise CleanSlateError(
            f"{name}: {path} does not exist on this host; give the path of the program, or leave {name} unset to look it up.",
            reason=_reasons.BAD_ARGUMENTS,
            option=name,
        )
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise CleanSlateError(f"{name}: {path} is not an executable file.", reason=_reasons.BAD_ARGUMENTS, option=name)


def vmid(name: str, value: t.Any) -> int:
    """Refuse anything but a Proxmox VE guest id (an integer from 100 to 999999999); returns it.

    ``name`` is how the operator gave it: ``vmid``, or ``containers`` for an element of that list.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise CleanSlateError(
            f"{name}: {value!r} is not a valid Proxmox vmid (an integer from {VMID_MIN} to {VMID_MAX}).", reason=_reasons.BAD_ARGUMENTS, option=name
        )
    if not VMID_MIN <= value <= VMID_MAX:
        raise CleanSlateError(f"{name}: {value} is not a valid Proxmox vmid ({VMID_MIN}-{VMID_MAX}).", reason=_reasons.BAD_ARGUMENTS, option=name, vmid=value)
    return value
