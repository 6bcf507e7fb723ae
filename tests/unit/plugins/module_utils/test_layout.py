"""The layout of plugins/module_utils: imports run one way, the architecture's map says who imports whom, every file
has its unit test file, and only the shared ending leaves a module (fail_json, exit_json).

A private package (``_residue/``) counts as its files, each named ``<package>.<file>`` (``_residue.walk``); its
``__init__.py`` holds its overview and imports nothing.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
UTILS = ROOT / "plugins" / "module_utils"
UNIT = ROOT / "tests" / "unit" / "plugins" / "module_utils"
ARCHITECTURE = ROOT / "docs" / "docsite" / "rst" / "architecture.rst"
PREFIX = "ansible_collections.gpuops.clean_slate.plugins.module_utils"


def name_of(path: Path) -> str:
    """``_checks`` for _checks.py, ``_residue.walk`` for _residue/walk.py."""
    rel = path.relative_to(UTILS).with_suffix("")
    return ".".join(rel.parts)


def files() -> list[Path]:
    """Every Python file of module_utils but the packages' __init__.py."""
    return sorted(p for p in UTILS.rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts)


def imports(path: Path) -> set[str]:
    """The collection's module_utils a file imports, by name (``_residue.walk`` for a file of a package)."""
    out = set()
    packages = {p.name for p in UTILS.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            assert not any(a.name.startswith(PREFIX) for a in node.names), f"{path.name}: import module_utils with 'from ... import'"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PREFIX):
            parts = node.module[len(PREFIX) :].lstrip(".").split(".") if node.module != PREFIX else []
            if not parts:
                names = {a.name for a in node.names}
                assert not names & packages, f"{path.name}: import a package's files by their full path, not the package ({names & packages})"
                out |= names
            elif parts[0] in packages and len(parts) == 1:
                out |= {f"{parts[0]}.{a.name}" for a in node.names}
            else:
                out.add(".".join(parts[:2]))
    return out


GRAPH = {name_of(p): imports(p) for p in files()}


def test_a_package_init_imports_nothing() -> None:
    for init in UTILS.glob("*/__init__.py"):
        tree = ast.parse(init.read_text(encoding="utf-8"))
        assert all(isinstance(n, ast.Expr) for n in tree.body), f"{init.relative_to(ROOT)} holds its overview only"


def test_every_file_has_its_unit_test_file() -> None:
    """_x.py is tested in test__x.py; a package's _p/y.py in _p/test_y.py."""
    expected = set()
    for path in files():
        rel = path.relative_to(UTILS)
        expected.add(str(rel.parent / f"test_{rel.name}") if len(rel.parts) > 1 else f"test_{rel.name}")
    found = {str(p.relative_to(UNIT)) for p in UNIT.rglob("test_*.py")} - {"test_layout.py"}
    assert expected - found == set(), "module_utils files without their unit test file"
    assert found - expected == set(), "unit test files for no module_utils file"


def test_imports_run_one_way() -> None:
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join((*path, name))}"
        if name in done:
            return
        for dep in GRAPH[name]:
            visit(dep, (*path, name))
        done.add(name)

    for name in GRAPH:
        visit(name, ())


def test_scope_is_pure_and_discovery_does_not_sit_on_pct() -> None:
    assert GRAPH["_scope"] == set()
    for name in ("_procs", "_protection", "_kill", "_residue.module", "_verify"):
        reach, todo = set(), [name]
        while todo:
            for dep in GRAPH[todo.pop()]:
                if dep not in reach:
                    reach.add(dep)
                    todo.append(dep)
        assert "_pct" not in reach, f"{name} depends on the pct runner"


def test_the_architecture_map_says_who_imports_whom() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    table = text.split("The map of plugins/module_utils\n", 1)[1].split("\n\n   * - File", 1)[1].split("\n\n", 1)[0]
    documented = {}
    for row in re.split(r"\n   \* - ", table)[1:]:
        cells = re.split(r"\n     - ", row)
        name = re.fullmatch(r"``([\w.]+)``", cells[0].strip())
        assert name, cells[0]
        documented[name.group(1)] = set(re.findall(r"``([\w.]+)``", cells[2])) if "nothing" not in cells[2] else set()
    assert documented == GRAPH


def test_only_the_shared_ending_leaves_the_module() -> None:
    callers = sorted(
        f"{p.name}:{n.lineno} {n.func.attr}"
        for p in files()
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("fail_json", "exit_json") and p.name != "_module.py"
    )
    assert callers == [], "helpers raise CleanSlateError; only _module.finish ends a module"
    for module in (ROOT / "plugins" / "modules").glob("*.py"):
        calls = [n for n in ast.walk(ast.parse(module.read_text(encoding="utf-8"))) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
        assert [n.func.attr for n in calls if n.func.attr in ("fail_json", "exit_json")] == [], module.name
        assert "finish" in [n.func.attr for n in calls], f"{module.name} does not end through _module.finish"
