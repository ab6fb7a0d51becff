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


def test_no_private_cross_module_calls_or_codec_patching():
    private = re.compile(r"\b(tts|engine|model|self\.tts|self\.model)\._[a-z]\w*\(")
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        assert not private.search(text), (path, private.search(text).group())
        assert "_bundled_codec" not in text, path
        assert not re.search(r"codec\.decode\s*=", text), path
