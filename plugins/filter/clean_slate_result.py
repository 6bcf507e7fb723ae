# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The clean_slate_result filter: the role's per-host result, built in Python (plugins/plugin_utils/_result.py says how)."""

from __future__ import annotations

import typing as t

from ansible.errors import AnsibleFilterError

from ansible_collections.gpuops.clean_slate.plugins.plugin_utils import _result


def _check(steps: t.Any, context: t.Any) -> None:
    if not isinstance(steps, (list, tuple)) or not all(isinstance(s, (list, tuple)) and len(s) == 4 for s in steps):
        raise AnsibleFilterError("clean_slate_result: the input must be a list of [phase, name, result, default reason]")
    if not isinstance(context, dict):
        raise AnsibleFilterError("clean_slate_result: the context must be a dictionary")


def clean_slate_result(steps: t.Any, context: t.Any) -> dict[str, t.Any]:
    """The role's per-host result (clean_slate_result) from its phases' registered results."""
    _check(steps, context)
    return _result.result(steps, context)


class FilterModule:
    def filters(self) -> dict[str, t.Callable[..., t.Any]]:
        return {"clean_slate_result": clean_slate_result}
