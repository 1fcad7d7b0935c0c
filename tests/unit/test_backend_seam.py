"""The backend seam: the tables in ``pipatch._backends``' docstring list exactly the core
members of :class:`~pipatch._backends._contract.Backend` and the capability flags of its
:class:`~pipatch._backends._contract.Capabilities`; the protocol names no experiment (a
backend is a transport: what runs is a program); every real backend has the core; and a
backend that offers the core alone, with the default capabilities (no shortcut), runs every
experiment with the same numbers."""

from __future__ import annotations

import inspect
import re

import pipatch._backends as backends_package
from pipatch._backends._contract import CAPABILITIES, CORE, Backend
from pipatch._experiments._registry import EXPERIMENTS


def _tables(doc: str) -> list[list[str]]:
    """Each reST simple table of ``doc`` → the names in its first column (``meta()`` →
    ``meta``; continuation lines and the header row left out)."""
    tables, rows, rules = [], [], 0
    for line in doc.splitlines():
        if re.fullmatch(r"\s*=+(\s+=+)*\s*", line):
            rules += 1
            if rules == 3:  # a table's closing rule
                tables.append(rows)
                rows, rules = [], 0
            continue
        if rules == 2:  # the body: between the header's rule and the closing one
            cell = re.match(r"\s*``([A-Za-z_]\w*)", line)
            if cell:
                rows.append(cell.group(1))
    return tables


def test_the_docstring_tables_list_the_protocol_and_the_capabilities():
    core, capabilities = _tables(backends_package.__doc__)
    assert sorted(core) == CORE and len(core) == len(set(core))
    assert sorted(capabilities) == sorted(CAPABILITIES) and len(capabilities) == len(set(capabilities))
    assert not set(CORE) & set(CAPABILITIES)


def test_the_protocol_names_no_experiment():
    """No core member, nor any of its parameters, is named for an experiment (its name, command
    or result kind) or for gradients, edges or circuits: those are programs and capability
    flags (which may name them: a backend says what it can run)."""
    experiments = {word for e in EXPERIMENTS.values() for word in (e.name, e.command, e.kind)}
    words = ("gradient", "edge", "circuit")
    names = list(CORE)
    for member in CORE:
        value = getattr(Backend, member)
        function = value.fget if isinstance(value, property) else value
        names += [p for p in inspect.signature(function).parameters if p != "self"]
    for name in names:
        assert name not in experiments and not any(w in name.lower() for w in words), name
    assert any(w in flag for flag in CAPABILITIES for w in words)  # ... where the flags do


def _has(cls: type, name: str) -> bool:
    """A class attribute (method, property) or an instance attribute the class declares."""
    return hasattr(cls, name) or any(name in getattr(k, "__annotations__", {}) for k in cls.__mro__)


def test_every_backend_class_has_the_core():
    """Checked on the classes: no vLLM engine built, and the vLLM and served modules import
    without vLLM installed."""
    from pipatch._backends.ndif import NDIFBackend
    from pipatch._backends.served import ServedBackend
    from pipatch._backends.transformers import TransformersBackend
    from pipatch._backends.vllm import VLLMBackend

    for cls in (TransformersBackend, VLLMBackend, ServedBackend, NDIFBackend):
        missing = [name for name in CORE if not _has(cls, name)]
        assert not missing, (cls.__name__, missing)


# --------------------------------------------------------------------------------------------
# Worker-side code keeps nothing across requests
# --------------------------------------------------------------------------------------------

_MUTATORS = {"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "clear", "add", "discard",
             "remove", "__setitem__"}


def _state_written_by_functions(source: str) -> list[str]:
    """Where a function of ``source`` writes a module-level mutable container (a dict, list or
    set made at the top level) or declares a ``global``: ``["name:line", ...]``."""
    import ast

    tree = ast.parse(source)
    mutable = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        value = getattr(node, "value", None)
        containers = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
        made = isinstance(value, containers) or (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                                                 and value.func.id in {"dict", "list", "set", "defaultdict", "OrderedDict"})
        if made:
            mutable |= {t.id for t in targets if isinstance(t, ast.Name)}
    found = []
    for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for node in ast.walk(function):
            if isinstance(node, ast.Global):
                found += [f"global {name}:{node.lineno}" for name in node.names]
            written = None
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                for target in getattr(node, "targets", None) or [node.target]:
                    while isinstance(target, (ast.Subscript, ast.Attribute)):
                        target = target.value
                    written = target.id if isinstance(target, ast.Name) else written
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
                holder = node.func.value
                while isinstance(holder, ast.Subscript):
                    holder = holder.value
                written = holder.id if isinstance(holder, ast.Name) else None
            if written in mutable:
                found.append(f"{written}:{node.lineno}")
    return found


def test_the_vllm_worker_keeps_no_state_across_requests():
    """What runs in the engine's worker (every function of ``_vllm_worker``: the request bodies
    and what they call) writes no module-level table: a request never hands a value to another
    (a circuit's runs ungroup grouped-query attention instead), so requests need not share an
    engine step. The hand-over table and the step budget it relied on are gone. The check
    itself finds the pattern it forbids."""
    import pipatch._backends._vllm_worker as worker
    import pipatch._backends.vllm as vllm_backend

    assert _state_written_by_functions(inspect.getsource(worker)) == []
    for module in (worker, vllm_backend):
        assert not hasattr(module, "_CIRCUITS") and not hasattr(module, "_STEP_TOKENS"), module.__name__
    handed_over = (
        "_CIRCUITS: dict[str, dict] = {}\n"
        "def body(key, z):\n"
        "    shared = _CIRCUITS.setdefault(key, {})\n"
        "    _CIRCUITS[key]['z'] = z\n"
        "    _CIRCUITS.pop(key, None)\n"
        "def other():\n"
        "    global _COUNT\n"
    )
    assert sorted(_state_written_by_functions(handed_over)) == ["_CIRCUITS:3", "_CIRCUITS:4", "_CIRCUITS:5",
                                                                "global _COUNT:7"]
