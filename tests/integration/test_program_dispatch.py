"""One way a program reaches a model: a new program is one module, and every backend runs it.

The toy program (:mod:`tests._toy_program`: a site's norm at every layer and position, in a
module of its own written to a temporary folder) declares its inputs and needs and registers
itself; the transformers backend runs it through its one generic trace and the NDIF backend
through nnsight's remote path (``remote="local"``: serialised, rebuilt with this machine's
modules hidden — the toy module travels by value), each equal to the hand-written hook
reference. The vLLM and served backends run it in ``tests/integration/test_vllm.py`` and
``test_served.py`` (their engines are shared per file).

Tolerances: the same trace on the same weights in this process (transformers, NDIF simulated)
computes the same floats, so equal within 1e-5 of a norm's float32 rounding (norms here are
below 100: an ulp is under 1e-5)."""

from __future__ import annotations

import pytest
import torch

from pipatch._backends import backend_for
from pipatch._base.known import remember
from pipatch._model.sites import site as site_named
from tests._tiny import tiny_model
from tests._toy_program import hook_norms, toy_program

PROMPTS = ["The Eiffel Tower is in the city of", "The Colosseum is in the city of Rome"]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return toy_program(tmp_path_factory.mktemp("program"))


def _ids(model, n_words: int = 7) -> torch.Tensor:
    """Two prompts of one length (the runs of one trace), ``[2, T]``."""
    rows = [model.tokenizer(text, return_tensors="pt").input_ids[0, :n_words] for text in PROMPTS]
    return torch.stack(rows)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("where", ["transformers", "ndif"])
@pytest.mark.parametrize("site", ["resid", "mlp"])
def test_a_toy_program_runs_on_transformers_and_ndif_as_the_hook_reference(toy, family, where, site):
    model = tiny_model(family)
    if where == "ndif":
        remember(model, remote="local")
    backend = backend_for(model)
    assert backend.backend_name == where
    ids = _ids(model)
    requests = getattr(backend, "requests", 0)
    got = backend.run(toy.SITE_NORMS, toy.NormsRequest(ids, site_named(site)))
    if where == "ndif":
        assert backend.requests == requests + 1  # one request, rebuilt with the toy module hidden
    want = hook_norms(tiny_model(family) if where == "ndif" else model, ids, site)
    assert len(got) == len(want) == 2
    for mine, theirs in zip(got, want):
        assert mine.shape == theirs.shape == (backend.adapter.n_layers, ids.shape[1])
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
