"""The layering of ARCHITECTURE.md holds: each package imports only from the layers under it, and no
kiln module imports itself back through others (an import cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

KILN = Path(__file__).resolve().parents[1] / "kiln"
OPEN = {"errors", "constants", "__init__"}  # modules every layer may import
ALLOWED = {
    "kernels": set(),
    "hub": {"kernels"},
    "data": {"hub", "kernels"},
    "models": {"hub", "data", "kernels"},
    "engine": {"models", "hub", "data", "kernels"},
    "parallel": {"models", "hub", "kernels"},
    "train": {"engine", "parallel", "models", "data", "hub", "kernels"},
    "interop": {"engine", "models", "hub", "kernels"},
    "pipelines": {"engine", "models", "hub", "kernels"},
    "serve": {"engine", "models", "data", "hub", "kernels"},
    "cli": {"hub", "data", "models", "engine", "parallel", "train", "interop", "pipelines", "serve", "kernels"},
}


def _imports(path: Path) -> set[str]:
    """The kiln top-level packages a file imports (at module level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
        for name in names:
            parts = name.split(".")
            if parts[0] == "kiln" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_every_package_imports_only_from_the_layers_below():
    bad = []
    for path in sorted(KILN.rglob("*.py")):
        rel = path.relative_to(KILN)
        top = rel.parts[0].removesuffix(".py")
        if top in OPEN:
            continue
        assert top in ALLOWED, f"{rel}: package {top!r} has no layer in ARCHITECTURE.md / this test"
        for imported in _imports(path) - OPEN - {top}:
            if imported not in ALLOWED[top]:
                bad.append(f"kiln/{rel} imports kiln.{imported}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_the_check_can_fail(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from kiln.train import Trainer\nimport kiln.cli.main\n")
    assert _imports(f) == {"train", "cli"}


# ---- import cycles ------------------------------------------------------------------------------
# Every import statement that can run counts wherever it sits (module level, inside a function): a cycle
# hidden in a function still ties the two modules together. An import under `if TYPE_CHECKING:` never runs:
# it names a type for the checker (a floor block naming the model class built on it), so it is no edge.


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `root` (a package: `root.name` is its top name)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _targets(node: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The known modules one import statement inside `module` loads. `from p import m` counts as the
    submodule p.m where m is one, else as p; `import a.b.c` counts as a.b.c (the module named, not
    its parent packages, whose own imports are their own edges)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:  # relative: from the package holding `module` (itself, if it is a package)
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[:len(package) - (node.level - 1)] if node.level > 1 else package
        base = ".".join([*anchor, *([base] if base else [])])
    found = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in known:
            found.add(sub)
        elif base in known:
            found.add(base)
    return found


def _type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): a block only a type checker reads."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the modules of the same package tree it imports anywhere in its file."""
    modules = _modules(root)
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        edges = set()
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        typing_only = {id(n) for block in ast.walk(tree) if _type_checking(block)
                       for stmt in block.body for n in ast.walk(stmt)}  # (the else branch runs)
        for node in ast.walk(tree):
            if id(node) not in typing_only:
                edges |= _targets(node, name, path.name == "__init__.py", known)
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, and in each
    one shortest cycle through its first module, to show in the message."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:  # the graph has a few hundred nodes: recursion depth is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(components)


def shortest_cycle(graph: dict[str, set[str]], start: str) -> list[str]:
    """start -> ... -> start, fewest imports first (breadth first)."""
    paths = {w: [start, w] for w in sorted(graph[start])}
    frontier = list(paths)
    while frontier:
        nxt = []
        for v in frontier:
            if v == start:
                return paths[v]
            for w in sorted(graph.get(v, ())):
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    return []


def _describe(graph: dict[str, set[str]], components: list[list[str]]) -> str:
    return "\n".join(f"{' -> '.join(shortest_cycle(graph, c[0]))}   (cycle among {len(c)} modules: {', '.join(c)})"
                     for c in components)


def test_no_import_cycles():
    graph = import_graph(KILN)
    assert len(graph) > 100 and "kiln.train.trainer" in graph  # the walk found the package
    found = cycles(graph)
    assert not found, "import cycles among kiln modules:\n" + _describe(graph, found)


def test_the_cycle_check_can_fail(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")          # relative, package-level
    (pkg / "a.py").write_text("def f():\n    from pkg.sub.b import g\n")   # inside a function
    (pkg / "sub" / "b.py").write_text("from ..c import h\n")                 # relative, two levels up
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("import pkg.c\nfrom pkg import sub\n")       # into the cycle, not part of it
    graph = import_graph(pkg)
    assert graph["pkg.sub"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg.d"] == {"pkg.c", "pkg.sub"}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert shortest_cycle(graph, "pkg.a") == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    (pkg / "c.py").write_text("import os\n")  # the control: the cycle broken, nothing is found
    assert cycles(import_graph(pkg)) == []


# ---- models/common is a floor ---------------------------------------------------------------------
# The blocks every family builds on import nothing of kiln.models outside common (not the families, the
# task registry, the Auto loaders), so a family sits on them and never under them. Every import counts.

COMMON = "kiln.models.common"


def upward_from_common(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for each kiln/models/common module `a` importing a kiln.models module `b` outside common."""
    inside = (COMMON, COMMON + ".")
    return [f"{a} -> {b}" for a in sorted(graph) if a.startswith(inside)
            for b in sorted(graph[a]) if b.startswith("kiln.models") and not b.startswith(inside)]


def test_models_common_imports_nothing_above_it():
    graph = import_graph(KILN)
    assert sum(m.startswith(COMMON + ".") for m in graph) > 30  # the walk found the floor
    bad = upward_from_common(graph)
    assert not bad, "kiln/models/common imports kiln.models modules outside common:\n" + "\n".join(bad)


def test_the_floor_check_can_fail(tmp_path):
    pkg = tmp_path / "kiln"
    (pkg / "models" / "common").mkdir(parents=True)
    for f in ("__init__.py", "models/__init__.py", "models/common/__init__.py", "models/tasks.py"):
        (pkg / f).write_text("")
    (pkg / "models" / "common" / "a.py").write_text("def f():\n    from kiln.models.tasks import BASE\n")
    (pkg / "models" / "common" / "b.py").write_text("from . import a\nfrom ..tasks import x\n")
    (pkg / "models" / "llama.py").write_text("from kiln.models.common import a\n")  # downward: fine
    graph = import_graph(pkg)
    assert upward_from_common(graph) == ["kiln.models.common.a -> kiln.models.tasks",
                                         "kiln.models.common.b -> kiln.models.tasks"]
    (pkg / "models" / "common" / "a.py").write_text("import os\n")
    (pkg / "models" / "common" / "b.py").write_text("from . import a\n")
    assert upward_from_common(import_graph(pkg)) == []
