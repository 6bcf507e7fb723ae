"""The tests tree as tests/README.md maps it: every folder says its room, the gate rooms are exactly what
tools/run-gates (what CI runs) runs, tests/ holds tests and their kit only (the tooling lives in tools/), and no
file patches sys.path (make setup installs the test kit)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
ROOMS = ("gate", "simulation kit")
TOOLS = ROOT / "tools"
# Build outputs and caches, not part of the tree (.gitignore).
NOT_FOLDERS = {TESTS / "output", TESTS / "sim" / "build"}
# Run outside the venv, so they cannot rely on the .pth make setup installs: the hardware harness runs with the
# GPU machine's python3, and gpusim's driver daemon is started with `python -I` so that it runs from there too.
# test__pyc.py puts a zip of its own on sys.path for one import and takes it off again: that is how Ansible's payload
# is imported on the target, the thing under test, not a way around the test kit.
MAY_PATCH_SYS_PATH = {
    TOOLS / "gpu" / "validate.py",
    TOOLS / "gpu" / "startable.py",
    TOOLS / "gpu" / "peers.py",
    TESTS / "sim" / "gpusim" / "node.py",
    TESTS / "unit" / "plugins" / "module_utils" / "test__pyc.py",
}


def folders() -> list[Path]:
    """The folders directly under tests/ and under tests/sim (the simulation kit's parts and its tests)."""
    out = []
    for parent in (TESTS, TESTS / "sim"):
        for d in sorted(parent.iterdir()):
            if d.is_dir() and not d.name.startswith((".", "__")) and d not in NOT_FOLDERS:
                out.append(d)
    return out


def room(folder: Path) -> str | None:
    readme = folder / "README.md"
    if not readme.is_file():
        return None
    m = re.search(r"^Room: (" + "|".join(ROOMS) + r")\b", readme.read_text(), re.M)
    return m.group(1) if m else None


def gate_folders() -> set[Path]:
    """Every tests/ folder a gate of run-gates names, in its command or in the tools script it runs."""
    run_gates = TOOLS / "run-gates"
    named: set[Path] = set()
    for line in run_gates.read_text().splitlines():
        if not line.startswith("gate "):
            continue
        argv = shlex.split(line)
        texts = [line]
        script = ROOT / argv[2]
        if argv[2].startswith("tools/") and script.is_file():
            texts += [s for s in script.read_text().splitlines() if not s.lstrip().startswith("#")]
        for text in texts:
            for token in re.findall(r"\btests/[a-z_/]+", text):
                path = ROOT / token.rstrip("/")
                if path.is_dir():
                    named.add(path)
    return named


def test_every_folder_names_its_room() -> None:
    missing = [str(d.relative_to(ROOT)) for d in folders() if room(d) is None]
    assert not missing, f"these folders need a README.md with a 'Room: {' | '.join(ROOMS)}' line: {missing}"


def test_the_gate_rooms_are_what_run_gates_runs() -> None:
    gates = {d for d in folders() if room(d) == "gate"}
    ran = gate_folders()
    assert gates, "no gate room found"
    assert ran == gates, (
        f"run by run-gates but not a gate room: {sorted(str(p.relative_to(ROOT)) for p in ran - gates)}; "
        f"gate rooms run-gates does not run: {sorted(str(p.relative_to(ROOT)) for p in gates - ran)}"
    )


def test_the_map_lists_every_folder_in_its_room() -> None:
    table = (TESTS / "README.md").read_text()
    rows = {}
    for m in re.finditer(r"^\| (" + "|".join(ROOMS) + r") \| `([^`]+)/`", table, re.M):
        rows[m.group(2)] = m.group(1)
    for d in folders():
        rel = str(d.relative_to(TESTS))
        if d.parent == TESTS / "sim" and room(d) != "gate":
            continue  # the simulation kit's parts are listed on sim/'s row
        assert rows.get(rel) == room(d), f"tests/README.md's table must list {rel}/ as {room(d)!r}"


def test_nothing_patches_sys_path() -> None:
    patch = re.compile(r"sys\.path(\.insert|\.append|\.extend|\[:0\]\s*=|\s*\+?=)")
    offenders = [
        str(p.relative_to(ROOT))
        for p in sorted([*TESTS.rglob("*.py"), *TOOLS.rglob("*.py")])
        if p not in MAY_PATCH_SYS_PATH and "__pycache__" not in p.parts and p != Path(__file__).resolve()
        if NOT_FOLDERS.isdisjoint(p.parents) and patch.search(p.read_text())
    ]
    assert not offenders, f"import through the test kit make setup installs, not sys.path: {offenders}"


def test_tests_holds_no_tooling_and_tools_says_what_each_folder_is() -> None:
    """Benchmarks, the demo, the hardware harness and the gate scripts live in tools/, each folder with a README."""
    for d in folders():
        assert room(d) in ROOMS, f"{d.relative_to(ROOT)} is not a test folder nor the simulation kit: tooling goes under tools/"
    subdirs = [d for d in sorted(TOOLS.iterdir()) if d.is_dir() and not d.name.startswith((".", "__"))]
    assert {d.name for d in subdirs} >= {"bench", "demo", "gpu"}
    missing = [str(d.relative_to(ROOT)) for d in [TOOLS, *subdirs] if not (d / "README.md").is_file()]
    assert not missing, f"these tools/ folders need a README.md: {missing}"
