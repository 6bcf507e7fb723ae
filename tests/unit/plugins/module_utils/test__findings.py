"""_findings: the one table of what fixes each finding. Every finding the code names is in it, every verdict is on the
health scale, a configuration fault's fix is never a reset or a reboot, and the user guide's table ("What fixes each
finding") is this table, row for row."""

from __future__ import annotations

import re
from pathlib import Path

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _findings, _health, _reasons, _software, _xids

ROOT = Path(__file__).resolve().parents[4]
UTILS = ROOT / "plugins" / "module_utils"
GUIDE = ROOT / "docs" / "docsite" / "rst" / "guide_clean_slate.rst"
VERDICT_NAMES = "OK|RESTART_APP|FIX_CONFIG|RESET_GPU|REBOOT|DRAIN"


def test_every_verdict_is_on_the_scale_and_every_fix_is_a_sentence() -> None:
    for name, f in _findings.FINDINGS.items():
        assert f.verdict in (*_health.VERDICTS, _findings.READING, _findings.NONE), name
        assert f.fix.endswith(".") and f.fix[0].isupper() and f.where, name
    assert set(_findings.XID_BUCKETS) == set(_xids.BUCKETS) and set(_findings.XID_BUCKETS.values()) <= set(_health.VERDICTS)
    assert _health.BUCKET_VERDICTS is _findings.XID_BUCKETS


def test_a_configuration_faults_fix_is_never_a_reset_or_a_reboot() -> None:
    """What DCGM keeps apart (CONFIG is not RESET): a container's missing device file is fixed in its configuration."""
    config = [name for name, f in _findings.FINDINGS.items() if f.verdict == _findings.FIX_CONFIG]
    for reason in (_reasons.UVM_MISSING, _reasons.DEVICE_MISSING, _reasons.NO_LIBCUDA, _software.CUDA_ENV, _software.CAPS_MISSING):
        assert reason in config
    for name in config:
        fix = _findings.FINDINGS[name].fix.lower()
        assert "reset" not in fix and "reboot" not in fix and _findings.FINDINGS[name].where == _findings.CONFIG, name


def test_every_finding_the_code_names_is_in_the_table() -> None:
    """Read from the sources: each finding named where a judge builds it ((name, VERDICT, text) or {"name": ...}), every
    startability reason and every memory diagnosis but clean."""
    named: set[str] = set()
    for path in UTILS.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        named |= set(re.findall(rf'\(\s*"([a-z_]+)",\s*(?:{VERDICT_NAMES})\b', text))
        named |= set(re.findall(r'found\.append\(\s*\(\s*"([a-z_]+)"', text))
        named |= set(re.findall(r'"name":\s*"([a-z_]+)"', text))
    named |= {v for k, v in vars(_software).items() if k.isupper() and isinstance(v, str) and re.fullmatch(r"[a-z_]+", v)}
    named |= set(_reasons.STARTABILITY) | (set(_reasons.DIAGNOSES) - {_reasons.CLEAN})
    assert named - set(_findings.FINDINGS) == set()
    assert {"xid", "recovery_action", "fabric_incomplete", "gpus_not_listed"} <= named


def guide_rows() -> dict[str, tuple[str, str, str]]:
    """The guide's "What fixes each finding" table: name -> (verdict, where, fix), as written there."""
    text = GUIDE.read_text(encoding="utf-8")
    start = text.index(".. list-table::", text.index("What fixes each finding\n"))
    lines = []
    for line in text[start:].splitlines()[1:]:
        if line and not line.startswith(" "):
            break
        lines.append(line)
    rows: dict[str, tuple[str, str, str]] = {}
    cells: list[str] = []
    for line in [*lines, "   * - "]:
        if line.startswith("   * - "):
            if len(cells) == 4:
                rows[cells[0].strip("`")] = (cells[1].strip("`"), cells[2], cells[3])
            cells = [line[len("   * - ") :].strip()]
        elif line.startswith("     - "):
            cells.append(line[len("     - ") :].strip())
        elif cells and line.startswith("       "):
            cells[-1] += " " + line.strip()
    return rows


def test_the_guides_table_is_this_table() -> None:
    rows = guide_rows()
    assert set(rows) - {"Finding"} == set(_findings.FINDINGS)
    for name, f in _findings.FINDINGS.items():
        verdict = {_findings.NONE: "(not clean)", _findings.READING: "(the reading's)"}.get(f.verdict, f.verdict)
        assert rows[name] == (verdict, f.where, f.fix), name
