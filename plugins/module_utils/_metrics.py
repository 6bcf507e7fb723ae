# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""node_exporter textfile metrics of a host's last clean slate, written on the GPU node.

node_exporter's textfile collector reads every ``*.prom`` file of its directory at each scrape, so the file is
written whole: a temporary file beside it (a name that does not end in ``.prom``), renamed over it.

Names, for joins with dcgm-exporter (the guide's "Joins with dcgm-exporter" gives the PromQL, each query tested against
Prometheus): ``host`` is the inventory name; the per-GPU series carry dcgm-exporter's own GPU labels and values
(``gpu``, ``UUID``, ``pci_bus_id``, ``device``, ``modelName``), camelCase included, which promtool's lint reports as
it reports dcgm-exporter's; there is no copy of dcgm-exporter's host label (``Hostname``, or ``hostname`` on its main
branch), whose value is dcgm-exporter's view of the machine, not an inventory name.
"""

from __future__ import annotations

import os
import re
import tempfile
import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _health


def path(directory: str, host: str) -> str:
    """The host's textfile in ``directory`` ("" when no directory is given)."""
    return f"{directory.rstrip('/')}/clean_slate_{re.sub(r'[^A-Za-z0-9_.-]', '_', host)}.prom" if directory else ""


def _label(value: t.Any) -> str:
    # The exposition format escapes backslash, double quote and newline in label values.
    return re.sub(r'([\\"])', r"\\\1", str(value)).replace("\n", "\\n")


def text(r: t.Mapping[str, t.Any], host: str, seconds: float, now: float) -> str:
    """The metrics of result ``r`` (see _outcome.result), labelled host=<inventory name>; the per-GPU series carry
    dcgm-exporter's GPU labels (gpu, UUID, pci_bus_id, device, modelName) so that the two join."""
    h = f'host="{_label(host)}"'
    residual = (r.get("gpus") or []) if (r.get("after") or not r.get("targets")) else []
    lines = [
        "# HELP clean_slate_last_run_timestamp_seconds Unix time at which the last gpuops.clean_slate run for this host ended.",
        "# TYPE clean_slate_last_run_timestamp_seconds gauge",
        f"clean_slate_last_run_timestamp_seconds{{{h}}} {now:.3f}",
        "# HELP clean_slate_last_run_success 1 when the last run proved every selected GPU clean, else 0.",
        "# TYPE clean_slate_last_run_success gauge",
        f"clean_slate_last_run_success{{{h}}} {1 if r.get('clean') else 0}",
        "# HELP clean_slate_last_run_duration_seconds Wall time of the last run's work on the node.",
        "# TYPE clean_slate_last_run_duration_seconds gauge",
        f"clean_slate_last_run_duration_seconds{{{h}}} {max(seconds, 0.0):.3f}",
        "# HELP clean_slate_last_run_processes_ended Processes ended (SIGTERM or SIGKILL) by the last run.",
        "# TYPE clean_slate_last_run_processes_ended gauge",
        f"clean_slate_last_run_processes_ended{{{h}}} {r.get('ended', 0)}",
        '# HELP clean_slate_last_run_info Phase and reason of the last run (phase done and reason "" when clean).',
        "# TYPE clean_slate_last_run_info gauge",
        f'clean_slate_last_run_info{{{h},phase="{_label(r.get("phase", ""))}",reason="{_label(r.get("reason", ""))}"}} 1',
        "# HELP clean_slate_last_run_health Health verdict of the last run: 0 ok, 1 restart_app, 2 fix_config, 3 reset_gpu, 4 reboot, 5 drain"
        " (no sample when not judged).",
        "# TYPE clean_slate_last_run_health gauge",
    ]
    health = r.get("health")
    if isinstance(health, t.Mapping) and health.get("verdict") in _health.VERDICTS:
        lines.append(f'clean_slate_last_run_health{{{h},verdict="{health["verdict"]}"}} {_health.VERDICTS.index(health["verdict"])}')
    lines += [
        "# HELP clean_slate_gpu_used_mib GPU memory in use after the last run, in MiB (reserved memory excluded), per GPU.",
        "# TYPE clean_slate_gpu_used_mib gauge",
    ]
    for g in residual:
        if not isinstance(g, t.Mapping):
            continue
        labels = (
            f'{h},gpu="{g.get("index")}",UUID="{_label(g.get("uuid") or "")}",pci_bus_id="{_label(g.get("pci_bus_id") or "")}",'
            f'device="nvidia{g.get("minor", g.get("index"))}",modelName="{_label(g.get("name") or "")}"'
        )
        lines.append(f"clean_slate_gpu_used_mib{{{labels}}} {g.get('used_mib', 0)}")
    # The advisory reset plan, a series per GPU it names (none when no reset is due): an alert joins on UUID.
    lines += [
        "# HELP clean_slate_gpu_reset_advised 1 for each GPU the last run's reset plan says to reset (advisory: the collection never resets).",
        "# TYPE clean_slate_gpu_reset_advised gauge",
    ]
    plan = r.get("reset_plan")
    for g in (plan.get("gpus") or []) if isinstance(plan, t.Mapping) else []:
        labels = (
            f'{h},gpu="{g.get("index")}",UUID="{_label(g.get("uuid") or "")}",pci_bus_id="{_label(g.get("pci_bus_id") or "")}",'
            f'why="{_label(",".join(g.get("why") or []))}"'
        )
        lines.append(f"clean_slate_gpu_reset_advised{{{labels}}} 1")
    return "\n".join(lines) + "\n"


def directory_problem(directory: str) -> str:
    """Why metrics cannot be written into ``directory`` ("" when they can): checked before anything runs, so that a
    mistyped directory stops the host before its processes are ended, not after."""
    if not directory.startswith("/"):
        return f"must be an absolute path on the GPU node (node_exporter's --collector.textfile.directory), got {directory!r}."
    if not os.path.isdir(directory):
        return (
            f"{directory} does not exist on this host (node_exporter's textfile collector reads a directory that exists: create it, or"
            " give the one its --collector.textfile.directory names). Nothing was done."
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{directory} is not writable by this user. Nothing was done."
    return ""


def write(target: str, content: str) -> None:
    """Write ``content`` to ``target`` whole (a temporary file beside it, mode 0644, renamed over it); OSError when it cannot."""
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(target) + ".", dir=os.path.dirname(target))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(content)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
        tmp = ""
    finally:
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass
