"""The package's shape: no import cycles between specdecode's modules, lazy imports included
(a lazy import must never be what hides a cycle), and the deprecated paths still resolve."""

from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest

import specdecode

ROOT = Path(specdecode.__file__).parent
DEPRECATED = ("specdecode.spec", "specdecode.models.gguf_export")  # aliases of moved modules, kept one release


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """specdecode modules a file imports, at module level or inside functions (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for child in node.body for n in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    files = {m: p for m, p in files.items() if not any(m == d or m.startswith(d + ".") for d in DEPRECATED)}
    known = set(files)
    edges = {m: imported_modules(p, known) - {m} for m, p in files.items()}
    # Importing specdecode.a.b runs specdecode/a/__init__ first (the root package's own
    # __init__, the public API, is loading already whenever a submodule is imported).
    # A module's own enclosing packages are loading already too.
    for m in list(edges):
        parents = {parent for dep in edges[m] for parent in _parents(dep) if parent in known} - set(_parents(m))
        edges[m] = (parents | edges[m]) - {m}
    return edges


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def test_no_import_cycles():
    edges = graph()
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(edges.get(m, ())):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_the_three_parts_of_speculative_depend_downwards():
    """verify/ is pure (no proposer or policy code); propose/ knows nothing of the policy."""
    edges = graph()
    for m, deps in edges.items():
        if m.startswith("specdecode.speculative.verify"):
            assert not {d for d in deps if d.startswith(("specdecode.speculative.propose.drafters",
                                                          "specdecode.speculative.policy"))}, m
        if m.startswith("specdecode.speculative.propose"):
            assert not {d for d in deps if d.startswith("specdecode.speculative.policy")}, m


@pytest.mark.parametrize("old, name", [
    ("specdecode.spec.proposer", "PROPOSERS"), ("specdecode.spec.verify", "verify"),
    ("specdecode.spec.tree", "StaticTree"), ("specdecode.spec.tree", "compact_accepted"),
    ("specdecode.spec.depth", "MeasuredGuard"), ("specdecode.spec.cost_model", "load_or_profile"),
    ("specdecode.spec.metrics", "SpecStats"), ("specdecode.spec.drafters.eagle", "export_speculators"),
    ("specdecode.spec.drafters.dflash", "DFlashProposer"), ("specdecode.models.gguf_export", "export_gguf"),
    ("specdecode.config", "SpeculativeConfig"),
])
def test_moved_names_resolve_from_their_old_path(old, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert getattr(importlib.import_module(old), name) is not None


@pytest.mark.parametrize("statement", ["import specdecode.spec.drafters.eagle", "import specdecode.models.gguf_export",
                                       "from specdecode.config import SpeculativeConfig"])
def test_old_paths_warn_that_they_moved(statement):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", statement], capture_output=True, text=True)
    assert run.returncode != 0 and "DeprecationWarning" in run.stderr and "specdecode" in run.stderr
