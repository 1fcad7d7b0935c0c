"""SAE and transcoder latents as sites (``pipatch/_features``, issue #46), on tiny random models
of three families with random SAEs of each architecture (:mod:`tests._saes`).

* pipatch's ``encode`` / ``decode`` equal SAELens's own ``SAE`` (loaded by SAELens from the
  same folder, and handed to :func:`pipatch.load_sae` as an object) within 1e-6;
* both folder formats load to the same SAE at the same place;
* an unedited write through a latent site is the plain run within 1e-6;
* every latent patch (latent × position) equals a hand-written hook reference — encode,
  edit, decode plus the SAE's error, by hand, on the Hugging Face module — within 1e-5;
* a wrong width, model, layer or hook is refused in one line.
"""

from __future__ import annotations

import pytest
import torch

import pipatch
from pipatch._backends import backend_for
from pipatch._model.cells import Base, Cell, Metric, Op
from pipatch._model.models import _get, adapter_for
from pipatch._programs import PatchRequest, capture, patch
from tests._reference import first, hooked, logits_of
from tests._saes import KINDS, TOP_K, random_weights, save_gemma_scope, save_saelens
from tests._tiny import tiny_model

FAMILIES = ["llama", "gpt2", "gemma3"]
CLEAN, CORRUPT = "The Colosseum is in the city of", "The Kremlin is in the city of"
LAYER = 1


def hooks_of(family: str, kind: str) -> tuple[str, str | None]:
    """TransformerLens hook names of a ``kind`` SAE at :data:`LAYER` (a transcoder: in, out)."""
    if kind == "transcoder":
        return f"blocks.{LAYER}.hook_mlp_in", f"blocks.{LAYER}.hook_mlp_out"
    return f"blocks.{LAYER}.hook_resid_post", None


def hf_hooks_of(adapter, kind: str) -> tuple[str, str | None]:
    """The same places as Hugging Face module paths (Gemma Scope 2's spelling)."""
    block = f"{adapter.blocks}.{LAYER}"
    if kind == "transcoder":
        return f"{block}.{adapter.mlp_norm}.output", f"{block}.{adapter.mlp_post_norm or adapter.mlp}.output"
    return f"{block}.output", None


def saelens_folder(tmp_path, family: str, kind: str, seed: int = 0):
    model = tiny_model(family)
    d = adapter_for(model).d_model
    weights = random_weights(kind, d, d, seed=seed)
    hook, hook_out = hooks_of(family, kind)
    return model, weights, save_saelens(tmp_path / f"{family}-{kind}", kind, weights, hook, f"tiny-{family}", hook_out)


# -- by hand: the SAE's math and the modules it reads, spelled out ----------------------------------
def hand_encode(weights, kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "relu":
        x = x - weights["b_dec"]
    pre = x @ weights["W_enc"] + weights["b_enc"]
    if kind == "topk":
        values, indices = pre.topk(TOP_K, dim=-1)
        return torch.zeros_like(pre).scatter(-1, indices, values.relu())
    acts = pre.relu()
    return acts * (pre > weights["threshold"]) if "threshold" in weights else acts


def hand_decode(weights, latents: torch.Tensor) -> torch.Tensor:
    return latents @ weights["W_dec"] + weights["b_dec"]


def hand_skip(weights, x: torch.Tensor) -> torch.Tensor:
    return x @ weights["W_skip"].T if "W_skip" in weights else 0


def modules_of(model, kind: str):
    """``(module read, module written)``: the block (an SAE of the residual stream), or the
    MLP (its input read) and the module whose output the MLP adds (a transcoder)."""
    hf, a = model._module, adapter_for(model)
    block = _get(hf, a.blocks)[LAYER]
    if kind != "transcoder":
        return block, block
    return _get(block, a.mlp), _get(block, a.mlp_post_norm or a.mlp)


def hand_latents(model, weights, kind: str, ids: torch.Tensor) -> torch.Tensor:
    """The SAE's latents at :data:`LAYER` on one plain run, by forward hooks."""
    read, _ = modules_of(model, kind)
    store = {}
    if kind == "transcoder":
        hook = (read, "pre", lambda m, args: store.__setitem__("x", args[0].detach().clone()))
    else:
        hook = (read, "post", lambda m, args, out: store.__setitem__("x", first(out).detach().clone()))
    hooked([hook], lambda: logits_of(model, ids))
    return hand_encode(weights, kind, store["x"])


def hand_patched_logits(model, weights, kind: str, ids, position: int, latent, value):
    """Logits of the ``ids`` run with latent(s) ``latent`` (an id, or a slice) at ``position``
    set to ``value``: the written module's output becomes decode(edited latents) + skip + the
    SAE's error."""
    read, written = modules_of(model, kind)
    store = {}

    def edit(x_in, out):
        latents = hand_encode(weights, kind, x_in)
        edited = latents.clone()
        edited[:, position, latent] = value
        error = out - hand_decode(weights, latents) - hand_skip(weights, x_in)
        return hand_decode(weights, edited) + hand_skip(weights, x_in) + error

    def put(m, args, output):
        out = first(output).clone()
        new = edit(store.get("x", out), out)
        return (new,) + tuple(output[1:]) if isinstance(output, tuple) else new

    hooks = [(written, "post", put)]
    if kind == "transcoder":
        hooks.insert(0, (read, "pre", lambda m, args: store.__setitem__("x", args[0].detach().clone())))
    return hooked(hooks, lambda: logits_of(model, ids))


# -- SAELens ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_encode_and_decode_equal_saelens(family, kind, tmp_path):
    from sae_lens import SAE as LensSAE  # installed by the test extra: this comparison must run

    model, weights, folder = saelens_folder(tmp_path, family, kind)
    lens = LensSAE.load_from_disk(folder)
    ids = model.tokenizer(CLEAN, return_tensors="pt").input_ids
    x = torch.randn(2, ids.shape[1], adapter_for(model).d_model, generator=torch.Generator().manual_seed(1))
    for site in (pipatch.load_sae(folder, model), pipatch.load_sae(lens, model)):
        with torch.no_grad():
            latents = site.encode(x)
            assert torch.allclose(latents, lens.encode(x), atol=1e-6, rtol=0)
            assert torch.allclose(site.decode(latents), lens.decode(latents), atol=1e-6, rtol=0)
            assert torch.allclose(site.sae.reconstruct(x), lens(x), atol=1e-6, rtol=0)
        assert 0 < int((latents > 0).sum(-1).min()) < latents.shape[-1]  # some latents fire, not all
    assert site.layer == LAYER and site.n_latents == lens.cfg.d_sae


@pytest.mark.parametrize("kind", ["jumprelu", "transcoder"])
@pytest.mark.parametrize("family", FAMILIES)
def test_both_folder_formats_load_the_same_sae_at_the_same_place(family, kind, tmp_path):
    model, weights, folder = saelens_folder(tmp_path, family, kind)
    hook, hook_out = hf_hooks_of(adapter_for(model), kind)
    scope = save_gemma_scope(tmp_path / "scope", weights, hook, f"tiny-{family}", hook_out)
    ours, theirs = pipatch.load_sae(folder, model), pipatch.load_sae(scope, model)
    assert (ours.reads, ours.writes, ours.name) == (theirs.reads, theirs.writes, theirs.name)
    x = torch.randn(3, 64)
    assert torch.equal(ours.encode(x), theirs.encode(x))
    assert torch.equal(ours.sae.reconstruct(x), theirs.sae.reconstruct(x))


# -- the site --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_an_unedited_write_is_the_plain_run(family, kind, tmp_path):
    model, weights, folder = saelens_folder(tmp_path, family, kind)
    site = pipatch.load_sae(folder, model)
    ids = model.tokenizer(CORRUPT, return_tensors="pt").input_ids
    metric = Metric("logprob", model.tokenizer(" Paris", add_special_tokens=False).input_ids[:1])
    backend = backend_for(model)
    run = capture(backend, ids, metric, [site])
    own = run.sites[site.name][LAYER]
    assert torch.allclose(own, hand_latents(model, weights, kind, ids), atol=1e-5, rtol=0)
    cells = [Cell(0, 0, 0, start=0, ops=[Op(site, LAYER, (slice(None),), own)]),  # every latent, every position
             Cell(0, 1, 0, start=0, ops=[Op(site, LAYER, site.cell(2, [0, 3]))]),  # a recording op
             Cell(0, 2, 0, start=0)]
    (values,), (reads,) = patch(backend, PatchRequest.of(Base(ids, run), [cells], metric, fast=False))
    # a logprob near −ln(vocab) (≈ −10.8 on a random GPT-2): its float32 spacing is ~1e-6, and
    # the write recomposes the stream (decoded + error) within a rounding of it, so the plain
    # run's value within the project's 1e-6 plus 4 ulps of its size (1.43e-6 was seen on 2 threads)
    ulps = 4 * torch.finfo(torch.float32).eps
    assert torch.allclose(values, run.metric.expand(3), atol=1e-6, rtol=ulps), values - run.metric
    assert torch.allclose(reads[1][0], own[:, [2]][..., [0, 3]], atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_latent_patch_equals_the_hook_reference(family, kind, tmp_path):
    """Denoising: each cell writes one clean latent value at one position into the corrupt
    run, through pipatch's patch program (its fast paths on), against the hand-made hook run."""
    model, weights, folder = saelens_folder(tmp_path, family, kind)
    site = pipatch.load_sae(folder, model)
    tok = model.tokenizer
    clean, corrupt = (tok(text, return_tensors="pt").input_ids for text in (CLEAN, CORRUPT))
    answer, foil = (tok(t, add_special_tokens=False).input_ids[0] for t in (" Rome", " Moscow"))
    metric = Metric("logit_diff", [answer], [foil])
    backend = backend_for(model)
    clean_run = capture(backend, clean, metric, [site])
    corrupt_run = capture(backend, corrupt, metric, [site])
    donor = clean_run.sites[site.name][LAYER]
    T = clean.shape[1]
    latents = donor[0].abs().sum(0).argsort(descending=True)[:2].tolist()  # the clean run's busiest
    cells = [Cell(row, p, 0, start=site.start_layer(LAYER),
                  ops=[Op(site, LAYER, site.cell(p, i), donor[:, [p], i:i + 1])])
             for row, i in enumerate(latents) for p in range(T)]
    (values,), _ = patch(backend, PatchRequest.of(Base(corrupt, corrupt_run), [cells], metric))
    want = torch.tensor([(lambda lg: lg[0, -1, answer] - lg[0, -1, foil])(
        hand_patched_logits(model, weights, kind, corrupt, p, i, float(donor[0, p, i])))
        for i in latents for p in range(T)])
    assert torch.allclose(values, want, atol=1e-5, rtol=0), (values - want).abs().max()
    assert (values - float(corrupt_run.metric[0])).abs().max() > 1e-4  # the writes reach the logits


@pytest.mark.parametrize("kind", ["jumprelu", "transcoder"])
@pytest.mark.parametrize("family", FAMILIES)
def test_pipatch_patch_over_a_latent_site_writes_its_own_layer(family, kind, tmp_path):
    """``pipatch.patch(site=<latent site>)``: the layer × position grid of the existing
    experiment; the SAE's row writes every clean latent at one position (the corrupt run's
    error kept), the other rows write nothing (an SAE reads one layer)."""
    model, weights, folder = saelens_folder(tmp_path, family, kind)
    site = pipatch.load_sae(folder, model)
    result = pipatch.patch(model, clean=CLEAN, corrupt=CORRUPT, answer=" Rome", foil=" Moscow", site=site)
    assert result.meta["site"] == site.name and result.status == "done"
    got = result.raw[site.name][0]
    tok = model.tokenizer
    clean, corrupt = (tok(text, return_tensors="pt").input_ids for text in (CLEAN, CORRUPT))
    answer, foil = (tok(t, add_special_tokens=False).input_ids[0] for t in (" Rome", " Moscow"))
    donor = hand_latents(model, weights, kind, clean)
    want = torch.tensor([(lambda lg: lg[0, -1, answer] - lg[0, -1, foil])(
        hand_patched_logits(model, weights, kind, corrupt, p, slice(None), donor[0, p])) for p in range(clean.shape[1])])
    assert torch.allclose(got[LAYER], want, atol=1e-5, rtol=0), (got[LAYER] - want).abs().max()
    others = [layer for layer in range(got.shape[0]) if layer != LAYER]
    assert torch.allclose(got[others], result.corrupt_seeds[0].expand(len(others), got.shape[1]), atol=1e-5, rtol=0)
    assert (got[LAYER] - result.corrupt).abs().max() > 1e-3


# -- refusals --------------------------------------------------------------------------------------
def test_a_wrong_width_model_layer_or_hook_is_one_line(tmp_path):
    model = tiny_model("llama")
    cases = {
        "wide": (random_weights("jumprelu", 32), "blocks.1.hook_resid_post", "tiny-llama", "32-wide"),
        "model": (random_weights("jumprelu", 64), "blocks.1.hook_resid_post", "google/gemma-3-270m", "trained on"),
        "layer": (random_weights("jumprelu", 64), "blocks.7.hook_resid_post", "tiny-llama", "has 3 layers"),
        "hook": (random_weights("jumprelu", 64), "blocks.1.hook_resid_mid", "tiny-llama", "not one pipatch reads"),
        "module": (random_weights("jumprelu", 64), "model.layers.1.feed_forward_norm.output", "tiny-llama",
                   "names no value"),
    }
    for label, (weights, hook, model_name, says) in cases.items():
        folder = save_saelens(tmp_path / label, "jumprelu", weights, hook, model_name)
        with pytest.raises(pipatch.PipatchError, match=says) as error:
            pipatch.load_sae(folder, model)
        assert "\n" not in str(error.value) and ":" in str(error.value)
    # The same model under another name loads when asked to.
    folder = save_saelens(tmp_path / "renamed", "jumprelu", random_weights("jumprelu", 64),
                          "blocks.1.hook_resid_post", "google/gemma-3-270m")
    assert pipatch.load_sae(folder, model, check_model=False).layer == 1


def test_a_transcoder_must_replace_one_mlp(tmp_path):
    model = tiny_model("gpt2")
    folder = save_saelens(tmp_path / "tc", "transcoder", random_weights("transcoder", 64, 64),
                          "blocks.1.hook_mlp_in", "tiny-gpt2", hook_out="blocks.2.hook_mlp_out")
    with pytest.raises(pipatch.PipatchError, match="MLP input and write that layer's MLP output"):
        pipatch.load_sae(folder, model)


def test_load_saes_places_one_site_per_layer(tmp_path):
    model = tiny_model("gemma3")
    folders = [save_saelens(tmp_path / f"l{layer}", "topk", random_weights("topk", 64, seed=layer),
                            f"blocks.{layer}.hook_resid_post", "tiny-gemma3") for layer in range(3)]
    sites = pipatch.load_saes(folders, model)
    assert [s.layer for s in sites] == [0, 1, 2]
    assert [s.name for s in sites] == ["L0 resid_post", "L1 resid_post", "L2 resid_post"]
    with pytest.raises(pipatch.PipatchError, match="several SAEs are called 'L0 resid_post'"):
        pipatch.load_saes([folders[0], folders[0]], model)
