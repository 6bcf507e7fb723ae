"""Print the user guide's "What fixes each finding" table from plugins/module_utils/_findings.py (the one table; a unit
test, tests/unit/plugins/module_utils/test__findings.py, holds the guide to it).

    .venv/bin/python tools/findings_table.py     (paste over the table in docs/docsite/rst/guide_clean_slate.rst)
"""

from __future__ import annotations

import textwrap

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _findings


def main() -> None:
    print(".. list-table::\n   :header-rows: 1\n   :widths: 22 12 14 52\n")
    print("   * - Finding\n     - Verdict\n     - Where\n     - Fix")
    for name, f in _findings.FINDINGS.items():
        verdict = {_findings.NONE: "(not clean)", _findings.READING: "(the reading's)"}.get(f.verdict, f"``{f.verdict}``")
        fix = textwrap.wrap(f.fix, 110, break_on_hyphens=False)
        print(f"   * - ``{name}``\n     - {verdict}\n     - {f.where}\n     - {fix[0]}")
        for rest in fix[1:]:
            print(f"       {rest}")


if __name__ == "__main__":
    main()
