# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this doc fragment is PRIVATE to the collection; it may change without notice.

from __future__ import annotations


class ModuleDocFragment:
    # How the modules with a containers option find each container's init (plugins/module_utils/_pct.py, scopes()).
    DOCUMENTATION = r"""
options:
  pct_path:
    description:
      - Path of the C(pct) command used to resolve O(containers). Found on E(PATH) and in C(/usr/sbin) by default;
        C(lxc-info) is used when there is no C(pct).
      - When set, it must name an executable file, or the module fails with RV(reason=bad_arguments).
    type: path
"""
