"""The code's shape, checked: modules import without a circle, functions stay short, and the two
trainers differ only where the strategy does (issue: code shape)."""

import ast
import difflib
from pathlib import Path

from tests.trainer_utils import ROOT

PACKAGES = ("llama_train", "utils")
MAX_FUNCTION_LINES = 60
MAX_TWIN_DIFF = 120


def python_files() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))] + sorted(
        ROOT.glob("train_*.py")
    )


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in it (functions too): `from a.b import c` is
    a.b.c when that is a module, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                for a in node.names
            }
    return found & modules


def test_no_import_circle():
    files = {module_name(p): p for p in python_files()}
    graph = {m: imports_of(p, set(files)) - {m} for m, p in files.items()}
    state: dict[str, str] = {}

    def visit(m: str, trail: list[str]):
        state[m] = "open"
        for n in sorted(graph[m]):
            assert state.get(n) != "open", "import circle: " + " -> ".join(trail[trail.index(n) :] + [n])
            if n not in state:
                visit(n, trail + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def declares_flags(fn: ast.FunctionDef) -> bool:
    """A function that is mostly argparse declarations, one add_argument after another."""
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    return sum(c.func.attr == "add_argument" for c in calls) >= 8


def test_functions_are_short():
    long = []
    for path in python_files() + sorted((ROOT / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                if not declares_flags(node):
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_twin_trainers_differ_only_where_the_strategy_does():
    ddp, ds = ((ROOT / name).read_text().splitlines() for name in ("train_ddp.py", "train_deepspeed.py"))
    changed = [line for line in difflib.unified_diff(ddp, ds, lineterm="", n=0) if line[:1] in "+-"]
    changed = [line for line in changed if not line.startswith(("+++", "---"))]
    assert len(changed) < MAX_TWIN_DIFF, "\n".join(changed)
    main = {name: src[src.index("def main():") :] for name, src in (("ddp", ddp), ("ds", ds))}
    differ = [line for line in difflib.ndiff(main["ddp"], main["ds"]) if line[:1] in "+-"]
    assert len(differ) <= 10, "main() differs beyond the strategy's own lines:\n" + "\n".join(differ)
