"""The layers of ``pipatch/`` and ``js/``, read from their imports.

pipatch's packages are layers, bottom first (:data:`LAYERS`): a module imports only from its
own package or from a lower one, lazy imports inside functions included (they are
dependencies all the same, only later). Over the packages' import graph there is no cycle, and
the top level holds the public API and its front ends alone (:data:`TOP`). In ``js/``, no
module imports another in a cycle.

Each failure lists the offending imports as ``file:line → target``. ``python
tests/unit/test_layers.py`` prints the layers with their modules and what each imports.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tests.unit.test_imports import module_files, strongly_connected

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pipatch"
JS = ROOT / "js"

#: pipatch's packages, bottom layer first: a module may import from its own package and from
#: the packages before it in this list, never from one after it (nor from the top level).
LAYERS = (
    "_base",         # errors, value checks, model bookkeeping, threads, progress, tables, scales
    "_compat",       # third-party internals, one module per library
    "_model",        # models and adapters, sites, cells, graph, declarations, feature primitives
    "_programs",     # what runs inside a model, written once
    "_backends",     # transports: transformers, vLLM, served, NDIF; loading a model
    "_engine",       # any plan's cells as batched invokes, rows streamed
    "_results",      # result classes, files, comparison, code export, plots, views
    "_experiments",  # the experiments, their registry and API, the feature analyses
    "_notebook",     # the widget and live runs
    "_studies",      # one experiment over many facts, stored
    "_serving",      # pipatch serve and its guard
)
#: The top level: the public API (``__init__``), the public ``tasks`` and ``extend`` modules and
#: the two front ends (the CLI, the magics). Above every layer.
TOP = ("__init__", "cli", "_magics", "tasks", "extend")


@dataclass(frozen=True)
class Import:
    """One import of a pipatch module by another: where it is and what it names."""

    source: str  # the importing module, dotted
    path: str  # its file, relative to the repository
    line: int
    target: str  # the imported module (or package), dotted

    def __str__(self) -> str:
        return f"{self.path}:{self.line} → {self.target}"


def imports(package: Path) -> list[Import]:
    """Every import of one of ``package``'s modules by another, anywhere in a file (a lazy one
    inside a function too): ``from .x import y`` names ``x`` (and ``x.y`` where that is a
    module), ``from . import y`` the package and its module ``y``."""
    found = module_files(package)
    out = []
    for name, path in found.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                named = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in found]
                # ``from pkg import module``: the module is what is used, not the package's own code
                targets = named if named and len(named) == len(node.names) else [target, *named]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            rel = str(path.relative_to(package.parent))
            out += [Import(name, rel, node.lineno, t) for t in targets if t in found and t != name]
    return out


def layer_of(module: str) -> int:
    """``module``'s layer: its index in :data:`LAYERS`, or ``len(LAYERS)`` for the top level."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return len(LAYERS)


def package_of(module: str, path: Path) -> str:
    """The package ``module`` belongs to (a package's ``__init__`` belongs to the package)."""
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def up_imports(package: Path) -> list[Import]:
    """The imports that run up a layer (a lower layer's module importing a higher one's)."""
    return [i for i in imports(package) if layer_of(i.target) > layer_of(i.source)]


def package_cycles(package: Path) -> list[str]:
    """Cycles between ``package``'s packages (``pipatch._model`` and ``pipatch._model.features``
    are two), each with the imports that make it."""
    paths = module_files(package)
    graph: dict[str, set[str]] = defaultdict(set)
    why: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for i in imports(package):
        a, b = package_of(i.source, paths[i.source]), package_of(i.target, paths[i.target])
        if a != b:
            graph[a].add(b)
            why[a, b].append(i)
    out = []
    for component in strongly_connected(graph):
        edges = [str(i) for a in component for b in component if (a, b) in why for i in why[a, b]]
        out.append(" ↔ ".join(component) + ":\n    " + "\n    ".join(edges))
    return out


def stray_top_level(package: Path) -> list[str]:
    """What sits at ``package``'s top level beyond :data:`TOP` and the :data:`LAYERS`: a
    module, or a package that is no layer (``pipatch/data`` and other folders without Python
    are data, not code)."""
    out = [f"{path.relative_to(package.parent)}: a module at the top level (move it into its layer's package)"
           for path in sorted(package.glob("*.py")) if path.stem not in TOP]
    out += [f"{path.relative_to(package.parent)}/: a package that is no layer (add it to LAYERS, or move it into one)"
            for path in sorted(package.iterdir())
            if path.is_dir() and path.name not in LAYERS and any(path.rglob("*.py"))]
    return out


# ------------------------------------------------------------------------------------------
# js/
# ------------------------------------------------------------------------------------------

_TS_IMPORT = re.compile(r"""^\s*(?:import|export)\b[^;]*?\bfrom\s*['"](\.[^'"]+)['"]|^\s*import\s*['"](\.[^'"]+)['"]""",
                        re.MULTILINE | re.DOTALL)


def ts_imports(folder: Path) -> dict[str, set[str]]:
    """Each ``.ts`` module of ``folder`` (its tests apart) → the modules of ``folder`` it imports,
    type-only imports included (a dependency of the code as written)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(folder.glob("*.ts")):
        text = path.read_text("utf-8")
        targets = set()
        for match in _TS_IMPORT.finditer(text):
            spec = match.group(1) or match.group(2)
            target = (path.parent / spec).resolve()
            target = target if target.suffix == ".ts" else target.with_suffix(".ts")
            if target.parent == folder.resolve() and target.exists():
                targets.add(target.name)
        graph[path.name] = targets
    return graph


# ------------------------------------------------------------------------------------------
# The tests
# ------------------------------------------------------------------------------------------


def test_every_layer_is_a_package():
    missing = [name for name in LAYERS if not (PACKAGE / name / "__init__.py").exists()]
    assert not missing, f"LAYERS names packages pipatch lacks: {missing}"


def test_no_import_runs_up_a_layer():
    found = up_imports(PACKAGE)
    assert not found, ("imports that run up a layer (a module imports only its own package or lower ones: "
                       f"{' < '.join(LAYERS)} < top level):\n" + "\n".join(
                           f"{i}   ({layer_of(i.source) < len(LAYERS) and LAYERS[layer_of(i.source)] or 'top'} "
                           f"imports {layer_of(i.target) < len(LAYERS) and LAYERS[layer_of(i.target)] or 'top'})"
                           for i in found))


def test_no_cycle_between_packages():
    found = package_cycles(PACKAGE)
    assert not found, "import cycles between packages:\n" + "\n".join(found)


def test_the_top_level_holds_the_public_api_and_the_front_ends_only():
    found = stray_top_level(PACKAGE)
    assert not found, "\n".join(found)


def test_no_js_module_imports_another_in_a_cycle():
    graph = ts_imports(JS)
    assert graph, "no .ts module found in js/"
    found = strongly_connected(graph)
    lines = [f"js/{a} → js/{b}" for component in found for a in component for b in sorted(graph[a]) if b in component]
    assert not found, "import cycles in js/:\n" + "\n".join(lines)


def test_the_scan_sees_an_up_import_a_cycle_and_a_stray_module(tmp_path):
    """The checks above can fail: a lazy import up a layer, a cycle between two packages and a
    module at the top level are each found, with the line they are on; a js cycle too."""
    package = tmp_path / "pipatch"
    for name in ("_base", "_model", "_results"):
        (package / name).mkdir(parents=True)
        (package / name / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from ._results import result\n")
    (package / "_base" / "errors.py").write_text("def f():\n    from .._model.models import X\n")
    (package / "_model" / "models.py").write_text("from .._base.errors import f\nX = 1\n")
    (package / "_results" / "result.py").write_text("from .._model import models\n")
    (package / "stray.py").write_text("")
    ups = [str(i) for i in up_imports(package)]
    assert ups == ["pipatch/_base/errors.py:2 → pipatch._model.models"]
    (found,) = package_cycles(package)
    assert found.startswith("pipatch._base ↔ pipatch._model:") and "pipatch/_model/models.py:1 → pipatch._base.errors" in found
    assert stray_top_level(package) == ["pipatch/stray.py: a module at the top level (move it into its layer's package)"]
    js = tmp_path / "js"
    js.mkdir()
    (js / "a.ts").write_text("import type { B } from './b';\nexport const a = 1;\n")
    (js / "b.ts").write_text("import {\n  a,\n} from './a';\nexport type B = number;\n")
    (js / "c.ts").write_text("import { a } from './a';\n")
    assert strongly_connected(ts_imports(js)) == [["a.ts", "b.ts"]]


if __name__ == "__main__":
    by_layer: dict[int, list[str]] = defaultdict(list)
    for name in module_files(PACKAGE):
        by_layer[layer_of(name)].append(name)
    everything = imports(PACKAGE)
    for layer in sorted(by_layer):
        title = LAYERS[layer] if layer < len(LAYERS) else "top level"
        uses = sorted({LAYERS[layer_of(i.target)] if layer_of(i.target) < len(LAYERS) else "top"
                       for i in everything if layer_of(i.source) == layer and layer_of(i.target) != layer})
        print(f"{layer:2} {title:13} {len(by_layer[layer]):3} modules; imports from: {', '.join(uses) or '-'}")
    print(f"{len(everything)} imports between pipatch's modules; {len(up_imports(PACKAGE))} up a layer; "
          f"{len(package_cycles(PACKAGE))} package cycles; top level: {len(stray_top_level(PACKAGE))} strays")
    js_cycles = strongly_connected(ts_imports(JS))
    print(f"js/: {len(ts_imports(JS))} modules, {len(js_cycles)} cycles {js_cycles or ''}")
