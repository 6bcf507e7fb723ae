# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this doc fragment is PRIVATE to the collection; it may change without notice.

from __future__ import annotations


class ModuleDocFragment:
    # The attributes every module of the collection documents.
    DOCUMENTATION = r"""
options: {}
attributes:
  check_mode:
    description: Can run in check mode and return a prediction of what would change, without changing the target.
  diff_mode:
    description: Returns details of what changed (or would change in check mode) when run in diff mode.
  idempotent:
    description:
      - When run twice in a row with the same arguments, the second run reports no change.
      - Check mode reports the same as a real run would.
  platform:
    description: Target operating system families the module works on.
    support: full
    platforms: posix
"""
