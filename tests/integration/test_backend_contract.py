"""The backend seam: the tables in ``pipatch._backends``' docstring list exactly the core
members of :class:`~pipatch._backends._contract.Backend` and the capability flags of its
:class:`~pipatch._backends._contract.Capabilities`; the protocol names no experiment (a
backend is a transport: what runs is a program); every real backend has the core; and a
backend that offers the core alone, with the default capabilities (no shortcut), runs every
experiment with the same numbers."""

from __future__ import annotations

import pytest
import torch

import pipatch
from pipatch._backends import backend_for
from pipatch._backends._contract import CORE, Backend, Capabilities
from tests._tiny import tiny_model

CLEAN = "The Eiffel Tower is in the city of"
PAIR_CLEAN, PAIR_CORRUPT = "The Colosseum is in the city of", "The Kremlin is in the city of"


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
