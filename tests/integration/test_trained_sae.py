"""The SAE pipatch ships for the embedded model (``pipatch/data/sae/``, trained by
``scripts/train_sae.py`` with SAELens's trainer), loaded onto the embedded Gemma 3 270M:

* it maps to the layer and place its config names (block 6's output, 2,048 latents);
* an unedited write through its latent site is the plain run within 1e-6;
* it explains most of the variance of block 6's output on known facts' prompts (a floor
  measured when it was trained, with margin; the variance is computed here, by forward hooks).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import pipatch
from pipatch._backends import backend_for
from pipatch._model.cells import Base, Cell, Metric, Op
from pipatch._programs import PatchRequest, capture, patch
from tests._reference import record

SHIPPED = Path(pipatch.embedded_sae().folder)
LAYER = 6
#: Explained variance of block 6's output on the held-out facts below, at least: 0.90 measured
#: on the shipped SAE (0.91 on all held-out tokens, scripts/train_sae.py); the margin allows a
#: retrained SAE's spread, not an SAE that reconstructs nothing (0 is the mean's own).
EV_FLOOR = 0.80
FACTS = 12


@pytest.fixture(scope="module")
def site(model):
    return pipatch.load_sae(SHIPPED, model)


def test_the_shipped_sae_maps_to_block_6s_output(site):
    assert (site.layer, site.reads.kind, site.reads.path, site.n_latents) == (LAYER, "resid_post", "", 2048)
    assert site.sae.activation == "topk" and site.sae.d_in == 640
    metrics = json.loads((SHIPPED / "metrics.json").read_text())
    assert metrics["hook"] == "model.layers.6.output" and metrics["d_sae"] == site.n_latents
    size = sum(f.stat().st_size for f in SHIPPED.iterdir())
    assert size <= 20 * 2**20, size


def test_an_unedited_write_is_the_plain_run(model, site):
    ids = model.tokenizer("The Eiffel Tower is in the city of", return_tensors="pt").input_ids
    metric = Metric("logprob", model.tokenizer(" Paris", add_special_tokens=False).input_ids[:1])
    backend = backend_for(model)
    run = capture(backend, ids, metric, [site])
    own = run.sites[site.name][LAYER]
    x = record(model, "resid", ids)[LAYER]
    assert torch.equal(own, site.sae.encode(x))
    # Each cell a batch of one, the capture's shape: a batch of two rounds the model's own
    # matmuls differently (~1e-5 on this model, with or without a write).
    cells = [[Cell(0, 0, 0, start=0, ops=[Op(site, LAYER, (slice(None),), own)])],  # every latent, every position
             [Cell(0, 1, 0, start=0, ops=[Op(site, LAYER, site.cell(3, [0, 5]), own[:, [3]][..., [0, 5]])])]]
    values, _ = patch(backend, PatchRequest.of(Base(ids, run), cells, metric, fast=False))
    values = torch.cat(values)
    assert torch.allclose(values, run.metric.expand(2), atol=1e-6, rtol=0), values - run.metric


def test_it_explains_block_6_on_known_facts(model, site):
    records = json.loads(pipatch.known_facts().read_text())[::10][:FACTS]  # every 10th: held out in training
    xs = []
    for record_ in records:
        ids = model.tokenizer(record_["prompt"], return_tensors="pt").input_ids
        xs.append(record(model, "resid", ids)[LAYER][0, 1:])  # BOS left out, as in training
    x = torch.cat(xs)
    with torch.no_grad():
        latents = site.sae.encode(x)
        residual = (x - site.sae.decode(latents)).pow(2).sum()
    explained = float(1 - residual / (x - x.mean(0)).pow(2).sum())
    print(f"explained variance on {FACTS} held-out facts: {explained:.4f}")
    assert explained > EV_FLOOR, explained
    assert (latents > 0).sum(-1).max() <= site.sae.k
