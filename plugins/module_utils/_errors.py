# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""The collection's error type.

Helpers raise :class:`CleanSlateError` with a sentence an operator can act on,
a ``reason`` (one of :mod:`._reasons`) and structured details; every module
converts it exactly once, in the ending all of them share
(:func:`._module.finish`), into ``fail_json(msg=..., reason=..., **details)``:
the failure shape :mod:`._reasons` documents. No traceback reaches the
operator, except in ``exception`` when Ansible is asked for tracebacks.
"""

from __future__ import annotations

import typing as t


class CleanSlateError(Exception):
    """An error with an actionable message, a reason and structured details for the result.

    The reason has no default: every failure says which one it is.
    """

    def __init__(self, msg: str, reason: str, **details: t.Any) -> None:
        super().__init__(msg)
        self.msg = msg
        self.reason = reason
        self.details = details

    def __reduce__(self) -> tuple[t.Any, ...]:
        # Errors cross a pipe from the NVML helper process (_probe); subclasses have their own
        # constructors, so rebuild from the state rather than calling them again.
        return (_restore, (type(self), self.msg, dict(self.__dict__)))

    def result(self) -> dict[str, t.Any]:
        """Keyword arguments for ``fail_json``: the details, then ``msg`` and ``reason``, which they cannot override."""
        return {**self.details, "msg": self.msg, "reason": self.reason}


def _restore(cls: type[CleanSlateError], msg: str, state: dict[str, t.Any]) -> CleanSlateError:
    """Unpickle a :class:`CleanSlateError` (or subclass) without calling its constructor."""
    error = cls.__new__(cls)
    Exception.__init__(error, msg)
    error.__dict__.update(state)
    return error
