"""``Result.code()`` of the feature experiments: the plain nnsight script, run in a fresh process,
recomputes ``pipatch.features`` and ``pipatch.feature_patch`` results.

On tiny random models of three families with random SAEs of every architecture (JumpReLU,
TopK, ReLU, a transcoder with an affine skip; both folder formats), and on the embedded model
with the SAE pipatch ships for it (:func:`pipatch.embedded_sae`): the script, which imports
neither pipatch nor SAELens and reads the SAE's weights from the file it was loaded from,
writes a feature read's activations and latent ids, and a feature patch's screening and exact
patches, equal to the result's within 1e-5 in metric units (an exact patch: 1e-5 + 1e-5 of the
metric's size). Then: several SAEs read in one run, a result read back from its file gives the
same script, and an SAE the script cannot load is one line.
"""

from __future__ import annotations

import dataclasses

import pytest

import pipatch
from pipatch._model.features.sae import SAE
from pipatch._model.models import PipatchError, adapter_for
from tests._saes import random_weights, save_gemma_scope, save_saelens
from tests._tiny import save_tiny
from tests.conftest import COLOSSEUM, EIFFEL
from tests.integration.test_code import imports, max_difference, run_script

CLEAN, CORRUPT = "The Colosseum is in the city of", "The Kremlin is in the city of"
PAIR = {"clean": CLEAN, "corrupt": CORRUPT, "answer": " Rome", "foil": " Moscow"}
LAYER = 1
#: name → (tiny family, SAE kind, folder format): every architecture, three families, both formats.
TINY = {
    "llama jumprelu": ("llama", "jumprelu", "saelens"),
    "gpt2 topk": ("gpt2", "topk", "saelens"),
    "gemma3 relu": ("gemma3", "relu", "saelens"),
    "gemma3 transcoder (Gemma Scope)": ("gemma3", "transcoder", "gemma_scope"),
    "gpt2 transcoder": ("gpt2", "transcoder", "saelens"),
}
TOLERANCE = 1e-5
RTOL = 1e-5  # an exact patch's metric (a logit difference of several units) to 1e-5 of the metric's size


def tiny_site(tmp_path, family: str, kind: str, layout: str):
    """A tiny ``family`` model loaded from its saved folder (what the script loads) and a random
    ``kind`` SAE at :data:`LAYER` written in ``layout``, loaded onto it."""
    model = pipatch.load_model(save_tiny(family, tmp_path / family))
    adapter = adapter_for(model)
    weights = random_weights(kind, adapter.d_model, adapter.d_model)
    block = f"{adapter.blocks}.{LAYER}"
    if layout == "gemma_scope":  # Hugging Face module paths, as Gemma Scope 2's configs name them
        reads, writes = f"{block}.{adapter.mlp_norm}.output", f"{block}.{adapter.mlp_post_norm or adapter.mlp}.output"
        folder = save_gemma_scope(tmp_path / "sae", weights, reads, "", writes)
    else:
        reads, writes = ((f"blocks.{LAYER}.hook_mlp_in", f"blocks.{LAYER}.hook_mlp_out") if kind == "transcoder"
                         else (f"blocks.{LAYER}.hook_resid_post", None))
        folder = save_saelens(tmp_path / "sae", kind, weights, reads, "", writes)
    return model, pipatch.load_sae(folder, model)


def script_of(result, tmp_path) -> dict:
    """The result's script, checked to import no pipatch, run in a fresh process: its JSON."""
    code = result.code()
    assert imports(code) == {"json", "sys", "torch", "nnsight", "transformers", "safetensors"}
    assert "trust_remote_code" not in code
    data, seconds = run_script(code, tmp_path)
    print(f"{result.kind}: script {seconds:.0f}s")
    return data


def assert_same_read(result, tmp_path) -> None:
    """A feature read: the same activations (NaN where none fires) and latent ids."""
    data = script_of(result, tmp_path)
    assert set(data["grids"]) == set(result.views)
    for view in result.views:
        assert max_difference(data["grids"][view], result.mean(view)) <= TOLERANCE
    assert data["latents"] == result.meta["latents"]
    assert any(i is not None for ids in data["latents"].values() for row in ids for i in row)  # latents fire


def assert_same_patch(result, tmp_path) -> None:
    """A feature patch: every screened cell's metric and the baselines within :data:`TOLERANCE`,
    so the grid (normalized recovery) within what those move it by, cell by cell
    (:func:`tests._tolerance.recovery_tolerance`: ``2 TOLERANCE (1 + |recovery|) / (|clean −
    corrupt| − 2 TOLERANCE)``); every exact patch within :data:`TOLERANCE` + :data:`RTOL` of
    the metric's size (its largest |value| here)."""
    from tests._tolerance import assert_recovery_close, recovery_tolerance
    from tests.integration.test_code import as_grid

    data = script_of(result, tmp_path)
    span = abs(result.clean_value - result.corrupt_value)
    assert span > 1e-3
    assert_recovery_close(as_grid(data["grid"]), result.grid, recovery_tolerance(result, TOLERANCE))
    want = {(e["layer"], e["col"]): e["actual"] for e in result.meta["verified_values"]}
    got = {(row, col): value for row, col, value in data["exact"]}
    assert got.keys() == want.keys() and len(got) > len(result.meta["positions"])  # latents and the error row
    # pipatch runs the patched cells batched, from the block above the SAE's on; the script runs
    # each alone from the embedding: float32 rounding of ~1e-6 of the metric's size apart.
    size = max(abs(result.clean_value), abs(result.corrupt_value), *(abs(value) for value in want.values()))
    worst = max(abs(got[cell] - want[cell]) for cell in want)
    print(f"exact patches: max |Δ| {worst:.1e}, the metric's size {size:.2g}")
    assert worst <= TOLERANCE + RTOL * size


@pytest.mark.parametrize("name", list(TINY))
def test_the_script_recomputes_a_feature_read_and_patch_on_tiny_models(name, tmp_path):
    model, site = tiny_site(tmp_path, *TINY[name])
    assert_same_read(pipatch.features(model, CLEAN, saes=site, k=4, progress=False), tmp_path)
    assert_same_patch(pipatch.feature_patch(model, **PAIR, site=site, top_k=4, progress=False), tmp_path)


def test_the_script_reads_several_saes_in_forward_order(tmp_path):
    """Two SAEs given in reverse forward order (a transcoder of layer 1 before an SAE of layer
    0's output): one run reads both, each view its own SAE's latents."""
    model, transcoder = tiny_site(tmp_path, "gemma3", "transcoder", "saelens")
    weights = random_weights("jumprelu", adapter_for(model).d_model, seed=1)
    first = pipatch.load_sae(save_saelens(tmp_path / "L0", "jumprelu", weights, "blocks.0.hook_resid_post", ""), model)
    read = pipatch.features(model, CLEAN, saes=[transcoder, first], k=3, progress=False)
    assert read.views == [transcoder.name, first.name]
    assert_same_read(read, tmp_path)


def test_the_script_recomputes_features_of_the_embedded_sae(model, tmp_path):
    site = pipatch.embedded_sae(model)
    read = pipatch.features(model, EIFFEL, saes=site, k=5, positions=[2, 3, -1], progress=False)
    assert_same_read(read, tmp_path)
    patched = pipatch.feature_patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome", site=site,
                                    top_k=3, positions=[2, 3, -1], progress=False)
    assert_same_patch(patched, tmp_path)
    assert str(pipatch.embedded_sae().file) in patched.code()


def test_a_result_read_back_gives_the_same_script_and_an_sae_without_a_file_is_one_line(tmp_path):
    model, site = tiny_site(tmp_path, "llama", "topk", "saelens")
    for result in (pipatch.features(model, CLEAN, saes=site, k=3, progress=False),
                   pipatch.feature_patch(model, **PAIR, site=site, top_k=2, progress=False)):
        back = pipatch.load_result(result.save(tmp_path / f"{result.kind}.safetensors"))
        assert back.code() == result.code()
    sae = site.sae
    unfiled = SAE(activation=sae.activation, W_enc=sae.W_enc, b_enc=sae.b_enc, W_dec=sae.W_dec, b_dec=sae.b_dec,
                  k=sae.k, hook=sae.hook, name="in memory")
    result = pipatch.features(model, CLEAN, saes=pipatch.load_sae(unfiled, model), progress=False)
    with pytest.raises(PipatchError, match="'L1 resid_post' was not read from one") as error:
        result.code()
    assert "\n" not in str(error.value)
    bad = dataclasses.replace(result, meta={**result.meta, "saes": [{**result.meta["saes"][0], "recipe": {
        **site.describe()["recipe"], "reads": ["mlp;import os", True]}}]})
    with pytest.raises(PipatchError, match="dotted name"):
        bad.code()
