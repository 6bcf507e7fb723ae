"""Line counts of plugins/: the largest files and the largest functions, at a git revision or in the work tree.

    python3 tools/plugin_sizes.py [--rev REV] [--top N]

A function's size is its lines from ``def`` to its last line (docstring and comments included), as
Python's ast reports them; nested functions count within their parent and again on their own. Used to
write down the before and after of a refactoring (issue 15): run it with ``--rev`` at the base and
without it on the result.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def files(rev: str | None) -> dict[str, str]:
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in sorted((ROOT / "plugins").rglob("*.py"))}
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", rev, "plugins"], check=True, capture_output=True, text=True)
    out = {}
    for name in names.stdout.split():
        if name.endswith(".py"):
            out[name] = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{name}"], check=True, capture_output=True, text=True).stdout
    return out


def functions(path: str, text: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(text, path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((node.end_lineno - node.lineno + 1, f"{path}:{node.lineno} {node.name}"))
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", help="a git revision (default: the work tree)")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    texts = files(args.rev)
    sizes = sorted(((len(t.splitlines()), p) for p, t in texts.items()), reverse=True)
    print(f"plugins/ at {args.rev or 'the work tree'}: {len(sizes)} files, {sum(n for n, _path in sizes)} lines")
    print("\nlargest files (lines):")
    for n, p in sizes[: args.top]:
        print(f"  {n:5d}  {p}")
    funcs = sorted((f for p, t in texts.items() for f in functions(p, t)), reverse=True)
    print("\nlargest functions (lines):")
    for n, where in funcs[: args.top]:
        print(f"  {n:5d}  {where}")
    print("\nmodules: lines of code after their documentation strings")
    for p, t in sorted(texts.items()):
        if p.startswith("plugins/modules/"):
            tree = ast.parse(t, p)
            docs = [n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") in ("DOCUMENTATION", "EXAMPLES", "RETURN")]
            docs_end = max(n.end_lineno or n.lineno for n in docs)
            print(f"  {len(t.splitlines()) - docs_end:5d}  {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
