"""Every protocol follows the model's device and dtype.

The device is ``PIPATCH_TEST_DEVICE`` (default ``cpu``: CI has no GPU). A GPU session runs this
file with ``PIPATCH_TEST_DEVICE=cuda`` through ``bench/device_check.sh``.

Models come in through the public door: a tiny random-weight checkpoint is saved to a folder
and loaded with ``pipatch.load_model(folder, device=..., dtype=...)``. Every result is checked
against a reference computed on a *separate CPU float32 copy* of the same weights with plain
PyTorch hooks (tests/_reference.py). On the CPU that is pipatch against hand-written hooks;
on a GPU it is also CUDA against CPU. In bfloat16 the model rounds differently from the
float32 reference, so there the grids must agree to bfloat16 precision and rank the cells alike.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

import pipatch
from pipatch._experiments.tracing import noise_draws
from tests._reference import patch_grid, reference_path, trace_grid
from tests._tiny import save_tiny, tiny_model, tiny_tokenizer

DEVICE = torch.device(os.environ.get("PIPATCH_TEST_DEVICE", "cpu"))
CLEAN = "The Eiffel Tower is in the city of"
CORRUPT = "The Big Ben is in the city of"
# One family per layout: Gemma 3 (GQA, scaled embeddings, z wider than the stream), Llama
# (separate q/k/v), GPT-2 (Conv1D, fused QKV), Falcon (tuple blocks, multi-query fused QKV).
FAMILIES = ["gemma3", "llama", "gpt2", "falcon"]
SITES = ("resid", "attn", "mlp", "head")
ATOL = 1e-4

if DEVICE.type == "cuda":  # float32 on the GPU must really be float32 to meet 1e-4
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """``folder(family)``: a saved tiny checkpoint (weights + tokenizer files) of that family."""
    @functools.cache
    def save(family: str):
        return save_tiny(family, tmp_path_factory.mktemp(family))
    return save


@functools.cache
def reference_model(family: str):
    """The same weights, CPU float32: what the hooks run on."""
    return tiny_model(family)


def on_device(folder, family: str, dtype: str = "float32"):
    return pipatch.load_model(folder(family), device=DEVICE, dtype=dtype)


def ids(model, text: str) -> torch.Tensor:
    return model.tokenizer(text, return_tensors="pt").input_ids


def token(model, text: str) -> int:
    (i,) = model.tokenizer(text, add_special_tokens=False).input_ids
    return i


def subject_position(model) -> int:
    """The last token where clean and corrupt differ ("Tower" / "Ben")."""
    return int((ids(model, CLEAN)[0] != ids(model, CORRUPT)[0]).nonzero().max())


@functools.cache
def reference_patch(family: str, site: str) -> torch.Tensor:
    ref = reference_model(family)
    pos = subject_position(ref)
    return patch_grid(ref, site, ids(ref, CLEAN), ids(ref, CORRUPT), token(ref, " Paris"), token(ref, " Rome"),
                      head_pos=pos if site == "head" else None)


def patch(model, site: str, **kwargs):
    positions = [subject_position(model)] if site == "head" else None
    return pipatch.patch(model, clean=CLEAN, corrupt=CORRUPT, answer=" Paris", foil=" Rome", site=site,
                         positions=positions, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_load_model_puts_the_model_on_the_device(folder, family, capfd):
    from transformers.utils import logging as hf_logging

    model = on_device(folder, family)
    # Quietly: no "Loading weights" bar in a cell or the CLI, and the caller's setting is back.
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()
    params = list(model._module.parameters())
    assert {p.device.type for p in params} == {DEVICE.type}
    assert {p.dtype for p in params} == {torch.float32}
    # Same weights as the CPU reference copy: the comparisons below compare like with like.
    ref = dict(reference_model(family)._module.named_parameters())
    for name, p in model._module.named_parameters():
        assert torch.equal(p.detach().cpu(), ref[name].detach()), name
    result = patch(model, "resid")
    assert torch.device(result.meta["device"]).type == DEVICE.type
    assert result.grid.device.type == "cpu"  # results always come back to the CPU


def test_default_device_is_the_gpu_when_there_is_one(folder):
    model = pipatch.load_model(folder("llama"))
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert {p.device.type for p in model._module.parameters()} == {want}
    if not torch.cuda.is_available():
        # Asking for a GPU that is not there: one line that says so, before any loading.
        with pytest.raises(pipatch.PipatchError, match="sees no CUDA GPU") as info:
            pipatch.load_model(folder("llama"), device="cuda")
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("protocol", ["patch", "trace", "attribute", "path_patch"])
def test_a_lazily_built_nnsight_model_is_dispatched_first(folder, protocol):
    """``LanguageModel(name)`` / ``TransformersModel(name)`` hold meta tensors until their first
    trace (nnsight's default); every protocol loads the weights before it reads anything."""
    from nnsight.modeling.transformers import TransformersModel

    lazy = TransformersModel(str(folder("llama")), task="text-generation", tokenizer=tiny_tokenizer(add_bos=True))
    assert not lazy.dispatched and next(lazy._module.parameters()).device.type == "meta"
    pair = dict(clean=CLEAN, corrupt=CORRUPT, answer=" Paris", foil=" Rome")
    if protocol == "patch":
        got = pipatch.patch(lazy, **pair).raw["resid"][0]
        assert torch.allclose(got, reference_patch("llama", "resid"), atol=ATOL, rtol=0)
    elif protocol == "trace":
        result = pipatch.trace(lazy, CLEAN, subject="Eiffel Tower", answer=" Paris", seeds=1, scale=3.0)
        assert result.meta["sigma"] > 0 and torch.isfinite(result.raw["resid"]).all()
    elif protocol == "attribute":
        assert torch.isfinite(pipatch.attribute(lazy, site="mlp", **pair).raw["mlp"]).all()
    else:
        one = pipatch.path_patch(lazy, sender=("head", 0, 1), **pair)
        assert abs(float(one.raw["head"][0, 0, 0]) - one.corrupt) > 1e-6
    assert lazy.dispatched


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_every_site_equals_cpu_hooks(folder, family):
    model = on_device(folder, family)
    for site in SITES:
        got = patch(model, site).raw[site][0]
        want = reference_patch(family, site)
        assert got.shape == want.shape, site
        assert torch.allclose(got, want, atol=ATOL, rtol=0), (site, float((got - want).abs().max()))
        assert float(want.max() - want.min()) > 1e-3, site  # cells differ: a wrong cell would show


@pytest.mark.parametrize("family", FAMILIES)
def test_trace_equals_cpu_hooks(folder, family):
    """Same seeded noise on the same σ, one clean residual state restored per forward."""
    model = on_device(folder, family)
    result = pipatch.trace(model, CLEAN, subject="Eiffel Tower", answer=" Paris", seeds=2, scale=3.0,
                           metric="logprob")  # P(answer) of a random model is ~1e-3: too flat
    ref = reference_model(family)
    subject = result.meta["subject_positions"]
    assert [ref.tokenizer.decode(ids(ref, CLEAN)[0, p]).strip() for p in subject] == ["Eiffel", "Tower"]
    with torch.no_grad():
        embedded = ref._module.get_input_embeddings()(ids(ref, CLEAN))
    if family == "gemma3":  # Gemma scales inside its embedding module; the reference says so
        assert not torch.allclose(embedded, ref._module.get_input_embeddings().weight[ids(ref, CLEAN)])
    sigma = float(embedded[0, subject].std())
    assert result.meta["sigma"] == pytest.approx(sigma, rel=1e-5)
    noise = noise_draws(2, len(subject), embedded.shape[-1], 3.0, sigma)
    want = trace_grid(ref, ids(ref, CLEAN), subject, noise, token(ref, " Paris"))
    got = result.raw["resid"]
    assert torch.allclose(got, want, atol=ATOL, rtol=0), float((got - want).abs().max())
    assert float((want[0] - want[1]).abs().max()) > 1e-3  # the two seeds' corruptions differ


@pytest.mark.parametrize("family", FAMILIES)
def test_attribution_verified_cells_equal_cpu_hooks(folder, family):
    model = on_device(folder, family)
    result = pipatch.attribute(model, clean=CLEAN, corrupt=CORRUPT, answer=" Paris", foil=" Rome",
                               site="mlp", verify=4)
    want = reference_patch(family, "mlp")
    assert torch.isfinite(result.raw["mlp"]).all()
    checked = result.meta["verified_values"]
    assert len(checked) == 4
    for cell in checked:
        assert cell["actual"] == pytest.approx(float(want[cell["layer"], cell["col"]]), abs=ATOL), cell


@pytest.mark.parametrize("family", FAMILIES)
def test_path_patching_equals_cpu_hooks(folder, family):
    model = on_device(folder, family)
    sender, receivers = ("head", 0, 1), [("head", 2, 0, "q"), ("head", 1, 3, "k"), ("head", 2, 1, "v")]
    result = pipatch.path_patch(model, clean=CLEAN, corrupt=CORRUPT, answer=" Paris", foil=" Rome",
                                sender=sender, receivers=receivers)
    want = reference_path(reference_model(family), base_text=CORRUPT, donor_text=CLEAN, answer=" Paris",
                          foil=" Rome", sender=sender, receivers=receivers)
    value = float(result.raw[result.views[0]][0, 0, 0])
    assert value == pytest.approx(want, abs=ATOL)
    assert abs(value - result.corrupt) > 1e-6


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_bfloat16_model_runs_every_protocol_at_its_precision(folder, family):
    """A bfloat16 model: noise, patches, readouts and gradients follow its dtype."""
    model = on_device(folder, family, dtype="bfloat16")
    assert {p.dtype for p in model._module.parameters()} == {torch.bfloat16}
    for site in SITES:
        result = patch(model, site)
        got, want = result.raw[site][0], reference_patch(family, site)
        assert result.meta["dtype"] == "bfloat16"
        span = float(want.abs().max())
        # bfloat16 keeps 8 bits of mantissa; over a few layers the error stays within a few %.
        assert float((got - want).abs().max()) < 0.05 * span, (site, float((got - want).abs().max()), span)
    trace = pipatch.trace(model, CLEAN, subject="Eiffel Tower", answer=" Paris", seeds=2, scale=3.0,
                          metric="logprob")
    assert torch.isfinite(trace.raw["resid"]).all()
    attribution = pipatch.attribute(model, clean=CLEAN, corrupt=CORRUPT, answer=" Paris", foil=" Rome",
                                    site="attn", verify=2)
    assert torch.isfinite(attribution.raw["attn"]).all()


@pytest.mark.parametrize("family", ["gemma3", "falcon"])
def test_windows_ablations_datasets_and_clicks_follow_the_device(folder, family):
    """The remaining modes, on the device with the fast engine, against the CPU copy run
    the straightforward way (``fast=False``: every block recomputed, full logits)."""
    model, ref = on_device(folder, family), reference_model(family)
    tracing = dict(subject="Eiffel Tower", answer=" Paris", seeds=2, scale=3.0, sites=["mlp", "attn"], window=2,
                   metric="logprob")
    got, want = pipatch.trace(model, CLEAN, **tracing), pipatch.trace(ref, CLEAN, fast=False, **tracing)
    for kind in ("mlp", "attn"):
        assert torch.allclose(got.raw[kind], want.raw[kind], atol=ATOL, rtol=0), kind
    for direction, extra in (("zero", {}), ("mean", {"mean_prompts": [CLEAN, CORRUPT, "The Brandenburg Gate is in the city of"]})):
        kwargs = dict(clean=CLEAN, corrupt=CORRUPT, answer=" Paris", foil=" Rome", site="mlp", direction=direction,
                      **extra)
        got, want = pipatch.patch(model, **kwargs), pipatch.patch(ref, fast=False, **kwargs)
        assert torch.allclose(got.raw["mlp"], want.raw["mlp"], atol=ATOL, rtol=0), direction
        assert float(want.raw["mlp"].max() - want.raw["mlp"].min()) > 1e-3, direction
    pairs = dict(clean=[CLEAN, "The Colosseum is in the city of"], corrupt=[CORRUPT, "The Kremlin is in the city of"],
                 answer=" Paris", foil=" Rome", site="attn")
    got, want = pipatch.patch(model, **pairs), pipatch.patch(ref, fast=False, **pairs)
    # Raw metric values: a random model's clean − corrupt can be tiny, which magnifies recovery.
    assert torch.allclose(got.raw["attn"], want.raw["attn"], atol=ATOL, rtol=0, equal_nan=True)
    assert got.n_seeds == 2 and not torch.isnan(got.raw["attn"][:, :, -1]).any()
    # A click on a cell: the patched run's top-5 next tokens, from full logits on the device.
    from pipatch._experiments._api import plan_patch

    predictors = [plan_patch(m, clean=CLEAN, corrupt=CORRUPT, answer=" Paris", foil=" Rome").predictor()
                  for m in (model, ref)]
    (a_tokens, a_probs), (b_tokens, b_probs) = (
        zip(*predict("resid", 1, subject_position(m), 0, 5)) for m, predict in zip((model, ref), predictors))
    assert a_tokens == b_tokens
    assert a_probs == pytest.approx(b_probs, abs=1e-5)
