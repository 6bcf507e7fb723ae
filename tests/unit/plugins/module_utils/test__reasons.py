"""_reasons: every reason any module can fail with is a constant of that one file, each module's documentation lists
exactly its own, and the user guide's reason table ("What a red run means") lists every module and role reason.

Read statically, from the sources: the plugins' Python (with ast), the modules' RETURN documentation, the guide,
and the role's own reasons (_reasons.ROLE, and the default reason of each step of module_utils/_outcome.py). The code read
is every Python file of plugins/ but the inventory plugin (modules, module_utils, plugin_utils, action and filter plugins).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _node, _outcome, _reasons

ROOT = Path(__file__).resolve().parents[4]
PLUGINS = ROOT / "plugins"
# The inventory plugin is left out: its words are Proxmox's (a node "unreachable" in the cluster's status).
CODE = sorted(
    p
    for folder in ("modules", "module_utils", "plugin_utils", "action", "filter")
    for p in (PLUGINS / folder).rglob("*.py")
    if p.name != "_reasons.py" and "__pycache__" not in p.parts
)
GUIDE = ROOT / "docs" / "docsite" / "rst" / "guide_clean_slate.rst"

CONSTANTS = {name: value for name, value in vars(_reasons).items() if name.isupper() and isinstance(value, str)}
VALUES = set(CONSTANTS.values())
MODULE_REASONS = {r for reasons in _reasons.MODULES.values() for r in reasons}
# Reason values that are ordinary words elsewhere too: an option and a command (timeout), a result key (clean),
# a process outcome (unkillable), an NVLink fabric state (not_supported, NVML_GPU_FABRIC_STATE_NOT_SUPPORTED), a
# service's state (not_running: nvidia-fabricmanager in the health verdict). They may appear as text; where a reason
# is given or compared they are checked like every other reason.
# Ansible's own result key for a host that did not answer (unreachable) is the role's reason for it, too.
ALSO_WORDS = {"timeout", "clean", "unkillable", "not_supported", "not_running", "unreachable"}


def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def documentation_strings(tree: ast.Module) -> set[int]:
    """ids of docstrings and of the modules' DOCUMENTATION/EXAMPLES/RETURN strings: prose, not code."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and body and isinstance(body[0], ast.Expr):
            out.add(id(body[0].value))
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in ("DOCUMENTATION", "EXAMPLES", "RETURN") for t in node.targets):
            out.add(id(node.value))
    return out


def literals(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def reason_positions(tree: ast.Module) -> list[tuple[int, ast.AST]]:
    """Expressions that give or compare a reason: ``reason=``, ``{"reason": ...}``, ``_fail(reason, ...)``, ``x.reason == ...``."""
    out: list[tuple[int, ast.AST]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            out.extend((node.lineno, kw.value) for kw in node.keywords if kw.arg == "reason")
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "_fail" and node.args:
                out.append((node.lineno, node.args[0]))
            if name == "CleanSlateError" and len(node.args) > 1:
                out.append((node.lineno, node.args[1]))
        elif isinstance(node, ast.Dict):
            # An option named reason in an argument spec has a dictionary for its value, never a reason.
            out.extend(
                (node.lineno, v) for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant) and k.value == "reason" and not isinstance(v, ast.Dict)
            )
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any((isinstance(s, ast.Attribute) and s.attr == "reason") or (isinstance(s, ast.Name) and s.id == "reason") for s in sides):
                out.extend((node.lineno, s) for s in sides)
    return out


@pytest.mark.parametrize("path", CODE, ids=lambda p: p.name)
def test_no_reason_is_spelled_out_outside_reasons(path: Path) -> None:
    tree = parsed(path)
    prose = documentation_strings(tree)
    where = path.relative_to(ROOT)
    given = [f"{where}:{line}: {text!r}" for line, expr in reason_positions(tree) for text in literals(expr)]
    assert given == [], "reasons given or compared as text instead of a _reasons constant"
    spelled = [
        f"{where}:{n.lineno}: {n.value!r}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in prose and n.value in VALUES - ALSO_WORDS
    ]
    assert spelled == [], "a reason spelled out as text: use its _reasons constant"


def referenced() -> set[str]:
    """Names of _reasons used anywhere in plugins/ (as ``_reasons.NAME``)."""
    return {
        n.attr for path in CODE for n in ast.walk(parsed(path)) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "_reasons"
    }


def test_every_reason_is_used_and_every_use_is_a_reason() -> None:
    used = referenced()
    unknown = used - set(vars(_reasons))
    assert unknown == set(), f"_reasons has no {sorted(unknown)}"
    unused = {name for name in CONSTANTS if name not in used}
    assert unused == set(), f"constants no plugin uses: {sorted(unused)}"


def test_every_reason_the_code_gives_belongs_to_a_module() -> None:
    """What the code gives is failure reasons (MODULES) or per-GPU diagnoses; every module reason is given somewhere."""
    used = {CONSTANTS[name] for name in referenced() if name in CONSTANTS}
    assert used - MODULE_REASONS <= set(_reasons.DIAGNOSES) | set(_reasons.ROLE)
    assert MODULE_REASONS - used == set(), "module reasons no code gives"
    assert set(_reasons.NVML) | set(_reasons.CONTAINERS) | set(_reasons.DIAGNOSES) <= VALUES


def documented_reasons(module: str) -> set[str]:
    text = (PLUGINS / "modules" / f"{module}.py").read_text(encoding="utf-8")
    tree = ast.parse(text)
    ret = next(n.value.value for n in tree.body if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "RETURN" for t in n.targets))
    doc = yaml.safe_load(ret)["reason"]
    assert doc["returned"] == "failure"
    description = " ".join(doc["description"] if isinstance(doc["description"], list) else [doc["description"]])
    return set(re.findall(r"(?<![A-Z])V\(([a-z_]+)\)", description))


@pytest.mark.parametrize("module", sorted(_reasons.MODULES))
def test_each_module_documents_exactly_its_reasons(module: str) -> None:
    assert (PLUGINS / "modules" / f"{module}.py").exists()
    documented = documented_reasons(module)
    assert documented - set(_reasons.MODULES[module]) == set(), "documented but not among the module's reasons"
    assert set(_reasons.MODULES[module]) - documented == set(), "the module's reasons its RETURN does not document"


def docs_only(path: Path) -> bool:
    """A module file that holds only its documentation (an action plugin does the work), as ansible-test reads it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return all(
        isinstance(n, ast.Assign)
        or (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str))
        or (isinstance(n, ast.ImportFrom) and n.module == "__future__")
        for n in tree.body
    )


def test_every_module_is_in_the_contract() -> None:
    modules = [p for p in (PLUGINS / "modules").glob("*.py") if not docs_only(p)]
    assert {p.stem for p in modules} == set(_reasons.MODULES)
    # No module is documentation only: every public module does its work on the host (the reader above must see code).
    assert [p.stem for p in (PLUGINS / "modules").glob("*.py") if docs_only(p)] == []


def role_reasons() -> set[str]:
    """The role's own reasons: its table (_reasons.ROLE) and the default reason of each step of a host's outcome
    (_outcome.steps, the fourth column: what a failed step without a reason of its own is called)."""
    phases = _outcome.phase_results({}, "local")
    return {str(step[3]) for step in _outcome.steps(phases)} | set(_reasons.ROLE)


def test_the_role_reasons_are_read() -> None:
    reasons = role_reasons()
    # The reader above must see what the role is known to give, or the guide's check below proves nothing.
    assert {"bad_variable", "unreachable", "not_verified", "too_few_gpus", "kill_failed", "report_not_written"} <= reasons, reasons
    # Every step's default reason is in the role's table.
    assert reasons - set(_reasons.MODULES["clean_slate_node"]) <= set(_reasons.ROLE) | {_reasons.NOT_CLEAN}
    assert reasons.isdisjoint({"verify", "preflight", "kill"}), "phase names read as reasons"
    assert set(_node.UNREADABLE) <= set(_reasons.NVML), "the kill waits for NVML reasons the modules do not give"


def guide_reason_column() -> set[str]:
    """The ``reason`` literals of the Reason column of the guide's table in "What a red run means"."""
    text = GUIDE.read_text(encoding="utf-8")
    section = text.split("\nWhat a red run means\n", 1)[1].split("\nRecords\n", 1)[0]
    table = section[section.index(".. list-table::") :]
    rows = re.split(r"\n   \* - ", table)[2:]  # the header row first
    column = [re.split(r"\n     - ", row)[1] for row in rows]
    assert len(column) >= 20, "the table was not read"
    return {word for cell in column for word in re.findall(r"``([a-z_]+)``", cell)}


def test_the_guide_lists_every_module_and_role_reason() -> None:
    listed = guide_reason_column()
    expected = MODULE_REASONS | (set(_reasons.DIAGNOSES) - {_reasons.CLEAN}) | role_reasons()
    assert expected - listed == set(), "reasons the guide's table does not list"
    assert listed - expected == set(), "reasons the guide's table lists that nothing gives"
