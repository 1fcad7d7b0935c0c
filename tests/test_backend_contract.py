"""The backend seam: the table in ``pipatch._backends``' docstring lists exactly the core
members of :class:`~pipatch._backends._contract.Backend` and the members of its
:class:`~pipatch._backends._contract.Hints`; every real backend has the core; and a backend
that offers the core alone (no hints) runs every experiment, with the same numbers."""

from __future__ import annotations

import re

import pytest
import torch

import pipatch
import pipatch._backends as backends_package
from pipatch._backends import backend_for
from pipatch._backends._contract import CORE, HINTS, Backend, Hints, hints_of
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


def test_the_docstring_table_lists_the_protocol_and_the_hints():
    core, hints = _tables(backends_package.__doc__)
    assert sorted(core) == CORE and len(core) == len(set(core))
    assert sorted(hints) == HINTS and len(hints) == len(set(hints))
    # ... and the hints are what the engine may read: none is also a core member.
    assert not set(CORE) & set(HINTS)


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


def test_hints_default_to_no_shortcut_and_the_transformers_backend_says_its_own():
    backend = backend_for(tiny_model("llama"))
    assert isinstance(backend, Backend)
    hints = hints_of(backend)
    assert hints is backend.hints and hints.starts_at_layer and hints.position_flops > 0
    assert hints.device_kind == "cpu"

    class Core:  # the core alone
        runs_on = "cuda:0"

    default = hints_of(Core())
    assert type(default) is Hints and not default.starts_at_layer and default.position_flops == 0
    assert default.device_kind == "cuda" and not default.prefix_reuse(None) and not default.pack_tokens(None, None)
    assert not default.shares_unembedding(None)


class CoreOnly:
    """A backend offering the core members only: the transformers backend's, no hints."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        if name not in CORE:
            raise AttributeError(name)
        return getattr(self._inner, name)


@pytest.mark.parametrize("experiment", ["trace", "patch"])
def test_a_backend_with_the_core_alone_runs_an_experiment_with_the_same_numbers(experiment):
    """No hints: the engine takes no shortcut (rows from layer 0, no prefix reuse, no packing,
    one ``run`` per batch), and the numbers are the transformers backend's own."""
    backend = backend_for(tiny_model("llama"))
    core = CoreOnly(backend)
    assert backend_for(core) is core and not hasattr(core, "hints")
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
