"""The import graph of asr/ (DESIGN.md): no circle, and the imports run one way.

Every import of one of our modules counts, wherever it stands: at the top, inside a function,
under `if TYPE_CHECKING:`, absolute or relative. `from asr.model import X` is an edge to the
package asr.model (asr/model/__init__.py), `from asr import x` / `from . import x` an edge to the
module x when there is one. The graph is read from the source with ast: nothing is imported.
"""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# DESIGN.md: "config, metrics, tokenizer and audio import nothing of ours", nor do the leaves they
# may use (the token ids and the standard-library file helpers); "features uses audio".
LEAVES = ("asr.tokens", "asr.fileio")
ALLOWED = {
    "asr.tokens": set(),
    "asr.fileio": set(),
    "asr.config": set(LEAVES),
    "asr.metrics": set(LEAVES),
    "asr.tokenizer": set(LEAVES),
    "asr.audio": set(LEAVES),
    "asr.features": {"asr.audio", *LEAVES},
}


def module_name(path: Path, root: Path) -> str:
    """asr/x.py -> asr.x; asr/model/__init__.py -> asr.model."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(tree: ast.AST, name: str, is_package: bool) -> list[tuple[str, str | None]]:
    """Every import in `tree` (module `name`), anywhere in it: (module, None) for `import module`,
    (module, n) for `from module import n`, relative forms resolved to absolute names."""
    package = name if is_package else name.rpartition(".")[0]
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # 1: this package, 2: its parent, ...
                parts = package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.extend((base, alias.name) for alias in node.names)
    return found


def import_graph(root: Path, package: str = "asr") -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (`root` holds the package's folder).
    `from P import n` is an edge to P.n when that is a module, else to P."""
    paths = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        targets = set()
        for module, member in imports(tree, name, path.name == "__init__.py"):
            if member is not None and f"{module}.{member}" in paths:
                targets.add(f"{module}.{member}")
            elif module in paths:
                targets.add(module)
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Circles (the first module repeated at the end) that together pass through every module
    of every strongly connected group: empty when the graph has none."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    circles = []
    for group in sorted(groups):
        covered: set[str] = set()
        for start in group:
            if start not in covered:
                circles.append(_circle(graph, start, set(group)))
                covered.update(circles[-1])
    return circles


def _circle(graph: dict[str, set[str]], start: str, members: set[str]) -> list[str]:
    """A shortest circle from `start` back to it inside `members` (breadth first)."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    following.append(w)
        frontier = following
    raise AssertionError(f"no circle through {start}")


def _foreign_roots() -> set[str]:
    """Top-level names under which recipes/ and tools/ code could be imported."""
    scripts = [*(ROOT / "tools").rglob("*.py"), *(ROOT / "recipes").rglob("*.py")]
    return {"recipes", "tools", *(p.stem for p in scripts)}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT)


# -- the checker itself ------------------------------------------------------------------------

def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_every_form_of_import_is_an_edge(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": """
            import os
            import pkg.b
            from pkg.sub import thing
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from pkg.c import C
            """,
        "pkg/b.py": "def f():\n    from . import c\n    from .sub.deep import g\n",
        "pkg/c.py": "from pkg import d\nfrom pkg import __version__\n",
        "pkg/d.py": "import numpy\n",
        "pkg/sub/__init__.py": "from .deep import g\nfrom ..d import x\n",
        "pkg/sub/deep.py": "from .. import d\n",
    })
    assert import_graph(tmp_path, "pkg") == {
        "pkg": set(),
        "pkg.a": {"pkg.b", "pkg.sub", "pkg.c"},
        "pkg.b": {"pkg.c", "pkg.sub.deep"},
        "pkg.c": {"pkg.d", "pkg"},
        "pkg.d": set(),
        "pkg.sub": {"pkg.sub.deep", "pkg.d"},
        "pkg.sub.deep": {"pkg.d"},
    }


def test_a_circle_is_found_and_named(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/search.py": "from pkg.ctc import prefix\nfrom pkg.model import M\n",
        "pkg/ctc.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.search import Selection\n",
        "pkg/lm.py": "def f():\n    from .search import Selection\n",
        "pkg/model/__init__.py": "from pkg.model.net import M\n",
        "pkg/model/net.py": "import torch\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert cycles(graph) == [["pkg.ctc", "pkg.search", "pkg.ctc"]]
    assert graph["pkg.lm"] == {"pkg.search"} and graph["pkg.search"] == {"pkg.ctc", "pkg.model"}
    graph["pkg.search"].add("pkg.lm")  # every module of the group is on a named circle
    assert cycles(graph) == [["pkg.ctc", "pkg.search", "pkg.ctc"], ["pkg.lm", "pkg.search", "pkg.lm"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


# -- the rules ---------------------------------------------------------------------------------

def test_no_import_circle(graph):
    found = cycles(graph)
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_leaves_import_only_leaves(graph):
    for name, allowed in ALLOWED.items():
        assert name in graph, f"{name} is gone: update ALLOWED"
        extra = graph[name] - allowed
        assert not extra, f"{name} imports {sorted(extra)}; DESIGN.md allows {sorted(allowed) or 'nothing'}"


def test_the_model_package_imports_only_itself_and_the_token_ids(graph):
    model = [name for name in graph if name == "asr.model" or name.startswith("asr.model.")]
    assert len(model) > 1
    for name in model:
        extra = {t for t in graph[name] if not (t == "asr.model" or t.startswith("asr.model.") or t == "asr.tokens")}
        assert not extra, f"{name} imports {sorted(extra)}: asr/model uses nothing of ours but asr.tokens"


def test_model_classes_are_reached_through_the_package(graph):
    """Outside asr/model, the network is imported from `asr.model`, never from its modules."""
    inside = {name for name in graph if name.startswith("asr.model.")}
    for name, targets in graph.items():
        if name != "asr.model" and name not in inside:
            assert not targets & inside, f"{name} imports {sorted(targets & inside)}: import from asr.model"


def test_nothing_in_asr_imports_recipes_or_tools():
    foreign = _foreign_roots()
    for path in sorted((ROOT / "asr").rglob("*.py")):
        name = module_name(path, ROOT)
        for module, _ in imports(ast.parse(path.read_text(encoding="utf-8")), name, path.name == "__init__.py"):
            assert module.split(".")[0] not in foreign, f"{name} imports {module} (recipes/ or tools/)"


def test_the_inference_contract_is_a_leaf():
    """asr.inference (the contract ASRModel and the exported model implement) imports torch, the
    standard library's typing helpers and at most the constants leaf: every import counts, those
    under TYPE_CHECKING too (it names other types by its own Protocols)."""
    path = ROOT / "asr" / "inference.py"
    found = {module for module, _ in imports(ast.parse(path.read_text(encoding="utf-8")), "asr.inference", False)}
    allowed = {"__future__", "collections.abc", "typing", "torch", "asr.tokens"}
    assert not found - allowed, f"asr.inference imports {sorted(found - allowed)}"


@pytest.mark.parametrize("module", ["decoding", "search"])
def test_decoding_holds_no_branch_on_the_model_kind(module):
    """decoding.py and search.py drive any asr.inference.InferenceModel: they name neither model
    class, import neither model module, and never ask a model what it is (isinstance, getattr or
    hasattr on anything called model)."""
    path = ROOT / "asr" / f"{module}.py"
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    assert not {"ASRModel", "OnnxModel", "onnx_model"} & {
        node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        for node in ast.walk(tree)}, f"asr/{module}.py names a model class"
    found = imports(tree, f"asr.{module}", False)
    assert not [m for m, name in found if "onnx" in m or name in ("ASRModel", "OnnxModel")]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "isinstance", "getattr", "hasattr"):
            subject = ast.unparse(node.args[0])
            assert "model" not in subject.lower(), f"asr/{module}.py:{node.lineno}: {ast.unparse(node)}"
