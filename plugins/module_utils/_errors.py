# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""The collection's error type.

Helpers raise :class:`CleanSlateError` with a sentence an operator can act on
and structured details; each module converts it exactly once, in ``main()``,
into ``fail_json(msg=..., **details)``. No traceback reaches the operator.
"""

from __future__ import annotations

import typing as t


class CleanSlateError(Exception):
    """An error with an actionable message and structured details for the result."""

    def __init__(self, msg: str, reason: str = "error", **details: t.Any) -> None:
        super().__init__(msg)
        self.msg = msg
        self.reason = reason
        self.details = details

    def result(self) -> dict[str, t.Any]:
        """Keyword arguments for ``fail_json``."""
        return {"msg": self.msg, "reason": self.reason, **self.details}
