"""The site contract (``pipatch/_model/sites.py``): a site that encodes and decodes is one subclass,
in a module of its own, and every experiment over sites takes it.

The toy site (:mod:`tests._toy_site`) reads the residual stream times two and writes back
halved; its patch grid is the residual stream's, checked against the plain-hook reference
(:func:`tests._reference.patch_grid`) on three families. The vLLM backend's check of the
same site is in ``tests/integration/test_vllm.py``."""

from __future__ import annotations

import pytest
import torch

import pipatch
from pipatch._backends import backend_for
from pipatch._model.cells import Base, Cell, Metric, Op
from pipatch._model.models import adapter_for
from pipatch._programs import PatchRequest, capture, patch
from tests._reference import patch_grid
from tests._tiny import tiny_model
from tests._toy_site import toy_site

CLEAN, CORRUPT = "The Colosseum is in the city of", "The Kremlin is in the city of"


@pytest.fixture(scope="module")
def doubled(tmp_path_factory):
    return toy_site(tmp_path_factory.mktemp("site"))


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3"])
def test_a_patch_grid_over_an_encoding_site_equals_the_hook_reference(family, doubled):
    model = tiny_model(family)
    tok = model.tokenizer
    ids = [tok(text, return_tensors="pt").input_ids for text in (CLEAN, CORRUPT)]
    answer, foil = (tok(t, add_special_tokens=False).input_ids[0] for t in (" Rome", " Moscow"))
    result = pipatch.patch(model, clean=CLEAN, corrupt=CORRUPT, answer=" Rome", foil=" Moscow", site=doubled)
    assert result.meta["site"] == "doubled" and result.status == "done"
    want = patch_grid(model, "resid", ids[0], ids[1], answer, foil)
    got = result.raw["doubled"][0]
    assert got.shape == want.shape == (adapter_for(model).n_layers, ids[0].shape[1])
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    # Not a grid of the base run's metric: the writes reach the logits.
    assert (got - result.corrupt).abs().max() > 1e-2


def test_an_unedited_write_through_an_encoding_site_is_the_plain_run(doubled):
    """Writing back the value already there (a recording op, or the base run's own value)
    adds ``decode(v) − decode(v) = 0``: the run is the plain run of its batch (a cell with no
    op), and a recording op reads the encoded value the capture kept."""
    model = tiny_model("llama")
    ids = model.tokenizer(CORRUPT, return_tensors="pt").input_ids
    metric = Metric("logprob", model.tokenizer(" Paris", add_special_tokens=False).input_ids[:1])
    backend = backend_for(model)
    run = capture(backend, ids, metric, [doubled])
    layer = 1
    own = run.sites["doubled"][layer][:, [2]]
    cells = [Cell(0, 0, 0, start=0, ops=[Op(doubled, layer, (slice(None), [2]), own)]),
             Cell(0, 1, 0, start=0, ops=[Op(doubled, layer, (slice(None), [2]))]),
             Cell(0, 2, 0, start=0)]
    (values,), (reads,) = patch(backend, PatchRequest.of(Base(ids, run), [cells], metric, fast=False))
    assert torch.equal(values[0], values[2]) and torch.equal(values[1], values[2])
    assert torch.allclose(values, run.metric.expand(3), atol=1e-6, rtol=0)
    assert torch.allclose(reads[1][0], own, atol=1e-6, rtol=0) and not reads[0] and not reads[2]
