# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""The module class, and the one ending every module's ``main()`` shares.

Every failure of every module has the shape :mod:`._reasons` documents
(``reason``, ``msg``, the details), whatever went wrong:

* Ansible's own argument checks (a wrong type, a missing option) fail inside
  :class:`Module`'s constructor: ``bad_arguments``;
* a library the module needs is missing: ``missing_library``, with the import
  traceback;
* a :class:`._errors.CleanSlateError`: its reason, message and details;
* anything else is a bug: ``internal_error``, with a sentence for the
  operator and the traceback kept in ``exception`` (which Ansible returns when
  asked for error tracebacks: ``ANSIBLE_DISPLAY_TRACEBACK=error``).

Every string of every result, failures included, is valid UTF-8 text
(:func:`text`): a name read from the system (a file name in /dev/shm, a
process name or command line, pct's output) may hold bytes that are not
UTF-8, which Ansible refuses to carry back ("Refusing to deserialize an
invalid UTF8 string value"), losing the result. Each such byte appears as
``\\xNN``, as Python's ``backslashreplace`` writes it.

The helpers never call ``fail_json``; only :func:`finish` does.
"""

from __future__ import annotations

import traceback
import typing as t
from dataclasses import dataclass

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _reasons
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError


class Module(AnsibleModule):
    """AnsibleModule whose every failure carries a machine-readable ``reason``.

    Failures raised by Ansible itself while it checks the arguments (a wrong
    type, a missing or conflicting option) happen inside ``__init__``, before
    the module's own code runs; they are argument errors. Any other failure
    that forgot its reason is an internal error.
    """

    _clean_slate_ready = False

    def fail_json(self, msg: str, **kwargs: t.Any) -> t.NoReturn:
        kwargs.setdefault("reason", _reasons.INTERNAL_ERROR if self._clean_slate_ready else _reasons.BAD_ARGUMENTS)
        super().fail_json(msg, **kwargs)
        # fail_json exits; ansible-core ships no type information that would tell mypy so.
        raise SystemExit(1)

    def ready(self) -> Module:
        """Mark the arguments as checked by Ansible; returns the module."""
        self._clean_slate_ready = True
        return self


@dataclass
class Library:
    """A Python library a module imports on the target, and whether the import worked."""

    package: str  # what to pip install
    present: bool
    error: str | None = None  # the import's traceback


#: What a module's body returns: the result for ``exit_json``.
Body = t.Callable[[Module], t.Dict[str, t.Any]]
#: Keys every failure of a module carries besides the contract's, given the failure's reason.
Details = t.Callable[[str], t.Dict[str, t.Any]]


def outcome(module: t.Any, body: Body, name: str, libraries: t.Sequence[Library] = (), details: Details | None = None) -> dict[str, t.Any]:
    """Run ``body`` and return its result, or its failure in the one failure shape with ``failed: True``.

    ``details(reason)`` gives the keys this module's failures always carry
    (for example ``targets: []``); a :class:`CleanSlateError`'s own details
    override them, and ``msg`` and ``reason`` override both. The umbrella
    module (:mod:`._node`) runs several bodies in one process through this,
    so that each phase's result is what the phase's own module would return.
    """

    def extra(reason: str) -> dict[str, t.Any]:
        return details(reason) if details is not None else {}

    for lib in libraries:
        if not lib.present:
            traceback_of = {"exception": lib.error} if lib.error else {}
            return {
                **extra(_reasons.MISSING_LIBRARY),
                **traceback_of,
                "msg": missing_required_lib(lib.package),
                "reason": _reasons.MISSING_LIBRARY,
                "failed": True,
            }
    try:
        return t.cast(t.Dict[str, t.Any], text(body(module)))
    except CleanSlateError as exc:
        return t.cast(t.Dict[str, t.Any], text({**extra(exc.reason), **exc.result(), "failed": True}))
    except Exception as exc:  # pylint: disable=broad-exception-caught
        # A bug must still reach the operator as a sentence, with the traceback kept for ANSIBLE_DISPLAY_TRACEBACK=error.
        bug: dict[str, t.Any] = {
            **extra(_reasons.INTERNAL_ERROR),
            "msg": f"{name} failed unexpectedly: {exc}. This is a bug: report it with the traceback (ANSIBLE_DISPLAY_TRACEBACK=error shows it).",
            "exception": traceback.format_exc(),
            "reason": _reasons.INTERNAL_ERROR,
            "failed": True,
        }
        return t.cast(t.Dict[str, t.Any], text(bug))


def text(value: t.Any) -> t.Any:
    """``value`` with every string in it (dictionary keys included) valid UTF-8: a byte that was not (held as a
    surrogate escape, as Python decodes file names and Ansible command output) becomes ``\\xNN``."""
    if isinstance(value, str):
        if value.isascii():
            return value
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:
            try:
                return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            except UnicodeEncodeError:  # a lone surrogate that no undecodable byte made
                return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {text(k): text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [text(v) for v in value]
    return value


def end(module: Module, result: dict[str, t.Any]) -> t.NoReturn:
    """``exit_json`` with ``result``, or ``fail_json`` when it says ``failed``."""
    if result.pop("failed", False):
        module.fail_json(**result)
    module.exit_json(**result)
    raise SystemExit(0)  # exit_json exits; as for fail_json, mypy is not told so


def finish(module: Module, body: Body, name: str, libraries: t.Sequence[Library] = (), details: Details | None = None) -> t.NoReturn:
    """Run ``body`` and end the module: ``exit_json`` with its result, or ``fail_json`` in the one failure shape."""
    end(module, outcome(module, body, name, libraries, details))
