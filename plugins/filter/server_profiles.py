# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The server_profiles filter: the server profiles a host applies, as the options they add to the kill and the residue
phases (plugin_utils/_profiles; the documentation is in server_profiles.yml beside this file)."""

from __future__ import annotations

import copy
import functools
import json
import typing as t

from ansible.errors import AnsibleFilterError

from ansible_collections.gpuops.clean_slate.plugins.plugin_utils import _profiles


def _plain(value: t.Any) -> t.Any:
    """Ansible's tagged values as plain Python (for the cache key and for YAML-shaped data)."""
    return json.loads(json.dumps(value, default=str))


@functools.lru_cache(maxsize=16)
def _resolved(key: str) -> dict[str, t.Any]:
    names, role_path, definitions, ports, roots = json.loads(key)
    return _profiles.resolve(names, role_path, definitions, ports, roots)


def server_profiles(names: t.Any, role_path: t.Any, definitions: t.Any = None, ports: t.Any = None, roots: t.Any = None) -> dict[str, t.Any]:
    """The options the profiles ``names`` add (see server_profiles.yml). A task names the result once per option, and
    Ansible templates the variable anew each time: the same inputs are resolved once per process."""
    if not isinstance(role_path, str) or not role_path:
        raise AnsibleFilterError("server_profiles: role_path must be the role's directory (role_path)")
    key = json.dumps([_plain(names), role_path, _plain(definitions or {}), _plain(ports or {}), _plain(roots)], sort_keys=True)
    return copy.deepcopy(_resolved(key))


class FilterModule:
    def filters(self) -> dict[str, t.Callable[..., t.Any]]:
        return {"server_profiles": server_profiles}
