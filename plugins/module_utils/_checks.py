# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Option checks the modules share, and the module class that gives every failure a ``reason``.

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

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError

#: The longest wait any option may ask for: one day, in seconds.
MAX_SECONDS = 86400
#: Reason for a module refused before it did anything (also Ansible's own argument checks).
BAD_ARGUMENTS = "bad_arguments"


def number(name: str, value: t.Any, low: float, high: float, low_open: bool = False, unit: str = "") -> None:
    """Refuse ``value`` unless it is a finite number in [low, high] (or (low, high] with ``low_open``)."""
    if value is None:
        return
    suffix = f" {unit}" if unit else ""
    span = f"more than {_fmt(low)} and at most {_fmt(high)}{suffix}" if low_open else f"from {_fmt(low)} to {_fmt(high)}{suffix}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CleanSlateError(f"{name} must be a finite number {span}, got {value!r}.", reason=BAD_ARGUMENTS, option=name)
    if value < low or (low_open and value <= low) or value > high:
        raise CleanSlateError(f"{name} must be {span}, got {_fmt(value)}.", reason=BAD_ARGUMENTS, option=name)


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def existing_dir(name: str, path: str) -> None:
    """Refuse a directory option that names nothing, or something that is not a directory."""
    if not os.path.exists(path):
        raise CleanSlateError(
            f"{name}: {path} does not exist on this host; give the directory that holds the nvidia* device files.", reason=BAD_ARGUMENTS, option=name
        )
    if not os.path.isdir(path):
        raise CleanSlateError(f"{name}: {path} is not a directory; give the directory that holds the nvidia* device files.", reason=BAD_ARGUMENTS, option=name)


def executable(name: str, path: str | None) -> None:
    """Refuse a program option that names nothing, or a file that cannot be run."""
    if path is None:
        return
    if not os.path.exists(path):
        raise CleanSlateError(
            f"{name}: {path} does not exist on this host; give the path of the program, or leave {name} unset to look it up.", reason=BAD_ARGUMENTS, option=name
        )
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise CleanSlateError(f"{name}: {path} is not an executable file.", reason=BAD_ARGUMENTS, option=name)


class Module(AnsibleModule):
    """AnsibleModule whose every failure carries a machine-readable ``reason``.

    Failures raised by Ansible itself while it checks the arguments (a wrong
    type, a missing or conflicting option) happen inside ``__init__``, before
    the module's own code runs; they are argument errors. Any other failure
    that forgot its reason is an internal error.
    """

    _clean_slate_ready = False

    def fail_json(self, msg: str, **kwargs: t.Any) -> t.NoReturn:
        kwargs.setdefault("reason", "internal_error" if self._clean_slate_ready else BAD_ARGUMENTS)
        super().fail_json(msg, **kwargs)
        # fail_json exits; ansible-core ships no type information that would tell mypy so.
        raise SystemExit(1)

    def ready(self) -> Module:
        """Mark the arguments as checked by Ansible; returns the module."""
        self._clean_slate_ready = True
        return self
