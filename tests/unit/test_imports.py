"""No import cycle among pipatch's modules, counting imports inside functions and methods.

The package is read with :mod:`ast`, never imported. Every ``import`` / ``from … import`` of a
pipatch module counts wherever it stands (module level, a function, a method, a branch):
a lazy import is a dependency too. The rules:

* each module is a node, a package's ``__init__.py`` is the package's node (``pipatch`` is
  ``pipatch/__init__.py``);
* relative imports are resolved against the importing module's package (``from . import x``,
  ``from .._models import y``, ``from ._protocols.tracing import z``), absolute ones as written;
* ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, otherwise to
  ``pkg`` (its ``__init__``); ``import a.b.c`` is an edge to ``a.b.c``;
* importing ``pipatch.x.y`` also imports ``pipatch.x``: an edge to every package on the way,
  except the importer's own enclosing packages, which Python has already started before the
  importer runs (so ``from ._models import f`` in ``pipatch/_engine.py`` is no edge to
  ``pipatch``). Naming such a package explicitly (``from pipatch import patch``,
  ``from . import something_in_init``) is an edge to its ``__init__`` like any other.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "pipatch"


def module_files(package_dir: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` for every ``.py`` file under ``package_dir``."""
    package_dir = Path(package_dir).resolve()
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that module ``name`` (file ``path``) imports anywhere in its body."""
    is_package = path.name == "__init__.py"
    package = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()

    def add(target: str) -> None:
        if target not in modules:
            return
        found.add(target)
        own = set(_ancestors(name))
        for parent in _ancestors(target):
            if parent in modules and parent not in own:
                found.add(parent)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 > len(package):
                    raise AssertionError(f"{path}:{node.lineno}: relative import beyond the top package")
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target not in modules:
                continue
            named = [alias.name for alias in node.names]
            submodules = [f"{target}.{n}" for n in named if f"{target}.{n}" in modules]
            for sub in submodules:
                add(sub)
            if len(submodules) < len(named):  # some name comes from target's own namespace
                add(target)
    found.discard(name)
    return found


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    modules = module_files(package_dir)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or with a self-loop), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    components.append(sorted(component))
    return sorted(components)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle per strongly connected component, as a path ``[a, b, …, a]``."""
    return [_cycle_in(graph, component) for component in strongly_connected(graph)]


def _cycle_in(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, by breadth-first search."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in came_from:
                    came_from[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {component}")  # pragma: no cover


def describe(cycles: list[list[str]]) -> str:
    return "\n".join(" -> ".join(cycle) for cycle in cycles)


def report(graph: dict[str, set[str]]) -> str:
    """Each tangle as one cycle ``a -> b -> a``, and the other modules caught in it."""
    lines = []
    for component in strongly_connected(graph):
        cycle = _cycle_in(graph, component)
        rest = [m for m in component if m not in cycle]
        lines.append(" -> ".join(cycle) + (f"   (tangled with it: {', '.join(rest)})" if rest else ""))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------


def test_pipatch_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    assert "pipatch" in graph and "pipatch._engine" in graph  # the walk saw the package
    cycles = find_cycles(graph)
    assert not cycles, f"{len(cycles)} import cycle(s) in pipatch/ (lazy imports included):\n{report(graph)}"


def _write_package(root: Path, files: dict[str, str]) -> Path:
    package = root / "syn"
    for rel, text in files.items():
        path = package / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return package


def test_a_cycle_through_a_lazy_import_is_found(tmp_path):
    package = _write_package(tmp_path, {
        "__init__.py": "",
        "a.py": """
            def f():
                from . import b
                return b.g()
        """,
        "b.py": "import syn.a\n\ndef g():\n    return 1\n",
        "c.py": "from .a import f\n",  # depends on the cycle, is not part of it
    })
    cycles = find_cycles(import_graph(package))
    assert cycles == [["syn.a", "syn.b", "syn.a"]], describe(cycles)
    assert describe(cycles) == "syn.a -> syn.b -> syn.a"


def test_lazy_imports_in_functions_and_methods_are_seen(tmp_path):
    package = _write_package(tmp_path, {
        "__init__.py": "from .api import run\n",
        "api.py": """
            class Runner:
                def go(self):
                    if True:
                        from ._models import load
                    return load()

            def run():
                import syn.sub.deep
                from .sub import helper
        """,
        "_models.py": "def load():\n    from . import api\n",
        "sub/__init__.py": "",
        "sub/deep.py": "from .. import _models\nfrom ..api import run\n",
        "sub/helper.py": "",
    })
    graph = import_graph(package)
    # The method's import, and syn.sub (its __init__) implied by importing syn.sub.deep.
    assert graph["syn.api"] == {"syn._models", "syn.sub", "syn.sub.deep", "syn.sub.helper"}
    assert graph["syn._models"] == {"syn.api"}  # `from . import api` names the submodule
    assert graph["syn.sub.deep"] == {"syn._models", "syn.api"}  # no edge to its own packages
    assert graph["syn"] == {"syn.api"}
    # One tangle: _models <-> api, and sub.deep -> api -> (run) sub.deep.
    assert strongly_connected(graph) == [["syn._models", "syn.api", "syn.sub.deep"]]
    assert find_cycles(graph) == [["syn._models", "syn.api", "syn._models"]]
    assert report(graph) == "syn._models -> syn.api -> syn._models   (tangled with it: syn.sub.deep)"


def test_a_name_from_a_package_init_is_an_edge_to_it(tmp_path):
    package = _write_package(tmp_path, {
        "__init__.py": "from .core import patch\n",
        "core.py": "def patch():\n    from syn import VERSION\n",  # VERSION is no module: syn's __init__
        "leaf.py": "from . import core\n",  # a submodule only: no edge to syn
    })
    graph = import_graph(package)
    assert graph["syn.core"] == {"syn"} and graph["syn.leaf"] == {"syn.core"}
    assert find_cycles(graph) == [["syn", "syn.core", "syn"]]


def test_an_acyclic_package_passes(tmp_path):
    package = _write_package(tmp_path, {
        "__init__.py": "from .api import run\nfrom . import sub\n",
        "api.py": "from ._models import load\n\ndef run():\n    from .sub.deep import x\n",
        "_models.py": "import os\n",
        "sub/__init__.py": "from .deep import x\n",
        "sub/deep.py": "from .._models import load\nx = 1\n",
    })
    graph = import_graph(package)
    assert graph["syn.api"] == {"syn._models", "syn.sub", "syn.sub.deep"}
    assert find_cycles(graph) == []
