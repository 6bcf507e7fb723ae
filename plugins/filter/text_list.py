# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The text_list filter: a list given as text (an AWX survey answer, ``-e name=value``) read as a list."""

from __future__ import annotations

import re
import typing as t

import yaml  # type: ignore[import-untyped]  # no stubs installed


def text_list(value: t.Any, split: bool = True) -> list[t.Any]:
    """A list stays a list; None and "" are []; text such as ``[0, 1]`` is read as YAML; other text is split at its
    commas when ``split`` (``0,1``), else one element (a regular expression or a command may hold a comma). With
    ``split``, elements made only of digits become integers (GPU indices)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        items = list(value)
    elif isinstance(value, str):
        text = value.strip()
        if re.match(r"^\[.*\]$", text, re.S):
            try:
                # A plain str: PyYAML's C loader refuses Ansible's tagged strings (variables carry their origin).
                parsed = yaml.safe_load(str(text))
            except yaml.YAMLError:
                parsed = [text]
            items = list(parsed) if isinstance(parsed, list) else [parsed]
        elif split:
            items = [p.strip() for p in text.split(",")]
        else:
            items = [value]
        items = [i for i in items if i != ""]
    else:
        items = [value]
    if not split:
        return items
    return [int(i.strip()) if isinstance(i, str) and re.fullmatch(r"\s*[0-9]+\s*", i) else i for i in items]


class FilterModule:
    def filters(self) -> dict[str, t.Callable[..., t.Any]]:
        return {"text_list": text_list}
