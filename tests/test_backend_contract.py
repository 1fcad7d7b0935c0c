"""The backend seam: the tables in ``pipatch._backends``' docstring list exactly the core
members of :class:`~pipatch._backends._contract.Backend` and the capability flags of its
:class:`~pipatch._backends._contract.Capabilities`; the protocol names no experiment (a
backend is a transport: what runs is a program); every real backend has the core; and a
backend that offers the core alone, with the default capabilities (no shortcut), runs every
experiment with the same numbers."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import pipatch
import pipatch._backends as backends_package
from pipatch._backends import backend_for
from pipatch._backends._contract import CAPABILITIES, CORE, Backend, Capabilities
from pipatch._registry import EXPERIMENTS
from tests._tiny import tiny_model

CLEAN = "The Eiffel Tower is in the city of"
PAIR_CLEAN, PAIR_CORRUPT = "The Colosseum is in the city of", "The Kremlin is in the city of"


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


def test_capabilities_default_to_no_shortcut_and_the_transformers_backend_says_its_own():
    backend = backend_for(tiny_model("llama"))
    assert isinstance(backend, Backend)
    own = backend.capabilities
    assert own.skips_blocks and own.position_flops > 0 and own.gradients and own.pack_tokens
    assert own.device_kind == "cpu"
    default = Capabilities()
    assert not default.skips_blocks and default.position_flops == 0 and not default.gradients
    assert default.device_kind == "cpu" and not default.pack_tokens and not default.pools_unembedding


class CoreOnly:
    """A backend offering the core members only, the transformers backend's, with the default
    capabilities: the engine takes no shortcut."""

    capabilities = Capabilities()

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        if name not in CORE:
            raise AttributeError(name)
        return getattr(self._inner, name)


@pytest.mark.parametrize("experiment", ["trace", "patch"])
def test_a_backend_with_the_core_alone_runs_an_experiment_with_the_same_numbers(experiment):
    """No capability: the engine takes no shortcut (rows from layer 0, no prefix reuse, no
    packing, no pooled unembedding), and the numbers are the transformers backend's own."""
    backend = backend_for(tiny_model("llama"))
    core = CoreOnly(backend)
    assert backend_for(core) is core and core.capabilities == Capabilities()
    if experiment == "trace":
        args = dict(prompt=CLEAN, subject="Eiffel Tower", answer=" Paris", seeds=2, scale=3.0, kind="resid,mlp")
        run = pipatch.trace
    else:
        args = dict(clean=PAIR_CLEAN, corrupt=PAIR_CORRUPT, answer=" Rome", foil=" Moscow", site="mlp")
        run = pipatch.patch
    got, want = run(core, **args), run(backend, **args)
    assert got.meta["engine"]["traces"] > 0
    for view in want.raw:
        assert torch.allclose(got.raw[view], want.raw[view], atol=1e-4, rtol=0, equal_nan=True), view
