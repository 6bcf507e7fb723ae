"""The layout of plugins/module_utils: imports run one way, the architecture's map says who imports whom, and only
the shared ending leaves a module (fail_json, exit_json)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
UTILS = ROOT / "plugins" / "module_utils"
ARCHITECTURE = ROOT / "docs" / "docsite" / "rst" / "architecture.rst"


def imports(path: Path) -> set[str]:
    """The collection's module_utils a file imports, by name."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ansible_collections.gpuops.clean_slate.plugins.module_utils"):
            if node.module.endswith(".module_utils"):
                out |= {a.name for a in node.names}
            else:
                out.add(node.module.rsplit(".", 1)[1])
    return out


GRAPH = {p.stem: imports(p) for p in UTILS.glob("*.py")}


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
    for name in ("_procs", "_kill", "_residue", "_verify"):
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
        name = re.fullmatch(r"``(\w+)``", cells[0].strip())
        assert name, cells[0]
        documented[name.group(1)] = set(re.findall(r"``(\w+)``", cells[2])) if "nothing" not in cells[2] else set()
    assert documented == GRAPH


def test_only_the_shared_ending_leaves_the_module() -> None:
    callers = sorted(
        f"{p.name}:{n.lineno} {n.func.attr}"
        for p in UTILS.glob("*.py")
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("fail_json", "exit_json") and p.name != "_module.py"
    )
    assert callers == [], "helpers raise CleanSlateError; only _module.finish ends a module"
    for module in (ROOT / "plugins" / "modules").glob("*.py"):
        if module.stem == "clean_slate_host":
            continue  # documentation only: its action plugin runs on the controller
        calls = [n for n in ast.walk(ast.parse(module.read_text(encoding="utf-8"))) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
        assert [n.func.attr for n in calls if n.func.attr in ("fail_json", "exit_json")] == [], module.name
        assert "finish" in [n.func.attr for n in calls], f"{module.name} does not end through _module.finish"
