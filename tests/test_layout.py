"""The package's layout: no import cycles between its modules (lazy imports inside functions count; imports for
type checking only do not), no module reaching into another's private names, no runtime patching of the codec."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "higgs_rt"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path) -> set[str]:
    """The package modules `path` imports at run time (anywhere but under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for child in node.body for n in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + (node.module.split(".") if node.module else []))
            if not node.level and not mod.startswith("higgs_rt"):
                continue
            found.add(mod)
            for alias in node.names:  # `from . import ops`: a submodule
                found.add(f"{mod}.{alias.name}")
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("higgs_rt")}
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in runtime_imports(p) if m in files and m != name} for name, p in files.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_no_import_cycles_between_modules():
    edges = graph()
    # a package's __init__ re-exports its modules; a module importing its own package is importing those
    for name in list(edges):
        edges[name] = {m for m in edges[name] if not name.startswith(m + ".")}
    assert cycles(edges) == []


def test_shared_types_come_from_the_leaf_module():
    edges = graph()
    assert edges["higgs_rt.types"] <= {"higgs_rt.params"}
    for name in ("higgs_rt.voices", "higgs_rt.speech_api"):
        assert "higgs_rt.engine" not in edges[name], name


def private_reaches(tree: ast.Module) -> list[str]:
    """Private names a module takes from elsewhere: `from m import _x`, and `obj._x` on anything but self/cls where
    the module itself defines no `_x` (a def, a class, or an assignment to a name or attribute `_x`)."""
    own = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            own.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            own.add(n.id)
        elif isinstance(n, ast.arg):
            own.add(n.arg)
    private = lambda name: name.startswith("_") and not name.startswith("__")  # noqa: E731
    found = [f"from {n.module} import {a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
             for a in n.names if private(a.name)]
    found += [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and private(n.attr)
              and ast.unparse(n.value) not in ("self", "cls") and n.attr not in own]
    return found


def test_no_private_cross_module_calls_or_codec_patching():
    for path in [*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "tools").rglob("*.py")]:
        text = path.read_text()
        reaches = private_reaches(ast.parse(text))
        if path.name == "torch_compat.py":  # torch's private APIs: this module's whole job
            reaches = [r for r in reaches if not r.startswith("torch.")]
        assert reaches == [], path
        assert "_bundled_codec" not in text, path
        assert not re.search(r"codec\.decode\s*=", text), path


def test_the_private_name_check_finds_a_reach():
    tree = ast.parse("from a import _x\nimport b\nclass C:\n    def f(self, o):\n        self._own = o._theirs\n"
                     "        return b._hidden(self._own)\n")
    assert private_reaches(tree) == ["from a import _x", "o._theirs", "b._hidden"]
