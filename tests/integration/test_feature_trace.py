"""Feature tracing (:func:`pipatch.feature_trace`) and feature patching's other directions
(``direction="noise" | "zero" | "mean"``), issue #46, on tiny random models of three families
with random SAEs (:mod:`tests._saes`) and on the embedded model with its shipped SAE.

* every exact restoration of a feature trace — latents and the error row, every seed — equals
  a hand-written hook reference (the subject's embeddings noised by a seeded draw made here,
  then encode, edit, decode + error on the Hugging Face module) within 1e-5, and its
  screening the hand gradient of each noised run;
* the noise is :func:`pipatch.trace`'s, and a feature trace reproduces with fixed seeds;
* every exact patch of the noise, zero and mean directions equals its hook reference, and
  their screening the hand gradient at the clean run.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import pipatch
from pipatch._model.models import _get, adapter_for
from tests._reference import first, hooked, logits_of
from tests._saes import D_SAE
from tests.integration.test_feature_patch import ANSWER as PAIR_ANSWER
from tests.integration.test_feature_patch import (
    FOIL,
    checked,
    hand_error_logits,
    hand_error_patch,
    hand_run,
    ids_of,
    logit_diff,
    token,
)
from tests.integration.test_features import (
    CLEAN,
    CORRUPT,
    FAMILIES,
    hand_decode,
    hand_encode,
    hand_latents,
    hand_patched_logits,
    hand_skip,
    modules_of,
    saelens_folder,
)

PROMPT, SUBJECT, ANSWER = "The Eiffel Tower is in the city of", "Eiffel Tower", " Paris"
SEEDS, SCALE = 2, 3.0


# -- by hand: the subject's noise ------------------------------------------------------------------
def embedding_of(model):
    return _get(model._module, adapter_for(model).embed)


def hand_noise(model, ids, subject: list[int], seeds: int, scale: float) -> tuple[float, torch.Tensor]:
    """σ of the clean embedding outputs on the subject's tokens, and each seed's draw
    ``randn(len(subject), d) × scale × σ`` from ``torch.Generator().manual_seed(seed)``."""
    store = {}
    hooked([(embedding_of(model), "post", lambda m, a, out: store.__setitem__("e", out.detach().clone()))],
           lambda: logits_of(model, ids))
    sigma = float(store["e"][0, subject].float().std())
    d = store["e"].shape[-1]
    draws = [torch.randn(len(subject), d, generator=torch.Generator().manual_seed(s)) * (scale * sigma)
             for s in range(seeds)]
    return sigma, torch.stack(draws)


def noised(model, subject, draw, run):
    """``run()`` with ``draw`` added to the embedding output on the subject's rows."""
    def add(module, args, out):
        out = out.clone()
        out[:, subject] += draw.to(out.device, out.dtype)
        return out
    return hooked([(embedding_of(model), "post", add)], run)


def prob(model, logits, answer=ANSWER):
    return float(logits[0, -1].double().softmax(-1)[token(model, answer)])


def logprob(model, logits, answer=ANSWER):
    return float(logits[0, -1].double().log_softmax(-1)[token(model, answer)])


def hand_gradient(model, weights, kind, ids, subject, draw, answer):
    """``(f, e, dM/df, dM/de)`` of the noised run at the SAE's layer: the written output rebuilt
    from a latent leaf and an error leaf (as :func:`test_feature_patch.hand_run`), M = log P(answer)."""
    read, written = modules_of(model, kind)
    store = {}

    def put(module, args, output):
        out = first(output)
        x = store.get("x", out).detach()
        skip = hand_skip(weights, x)
        f = hand_encode(weights, kind, x).requires_grad_(True)
        e = (out.detach() - hand_decode(weights, f.detach()) - skip).requires_grad_(True)
        store.update(f=f, e=e)
        new = hand_decode(weights, f) + skip + e
        return (new,) + tuple(output[1:]) if isinstance(output, tuple) else new

    def add(module, args, out):
        out = out.clone()
        out[:, subject] += draw.to(out.device, out.dtype)
        return out

    hooks = [(embedding_of(model), "post", add), (written, "post", put)]
    if kind == "transcoder":
        hooks.insert(1, (read, "pre", lambda m, args: store.__setitem__("x", args[0])))
    handles = [m.register_forward_hook(h) if when == "post" else m.register_forward_pre_hook(h) for m, when, h in hooks]
    try:
        with torch.enable_grad():
            p = model._module(ids).logits[0, -1].double().log_softmax(-1)[token(model, answer)]
            df, de = torch.autograd.grad(p, [store["f"], store["e"]])
    finally:
        for handle in handles:
            handle.remove()
    return store["f"].detach(), store["e"].detach(), df, de


# -- feature tracing -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["jumprelu", "topk", "transcoder"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_restoration_and_score_equals_the_hand_reference(family, kind, tmp_path):
    """``exhaustive=True``, two seeds, log P(answer) (a random model's P is tiny): each seed's
    screening is the hand gradient's (clean − noised) · dM/df, and every restored cell of every
    seed equals the hook reference."""
    model, weights, folder = saelens_folder(tmp_path, family, kind)
    site = pipatch.load_sae(folder, model)
    result = pipatch.feature_trace(model, PROMPT, subject=SUBJECT, answer=ANSWER, site=site, seeds=SEEDS, scale=SCALE,
                                   metric="logprob", exhaustive=True, progress=False)
    assert type(result).__name__ == "FeatureTraceResult" and result.status == "done"
    ids = ids_of(model, PROMPT)
    T, subject = ids.shape[1], result.meta["subject_positions"]
    sigma, draws = hand_noise(model, ids, subject, SEEDS, SCALE)
    assert abs(result.meta["sigma"] - sigma) < 1e-6 and result.meta["scale"] == SCALE
    f_clean, e_clean, _, _ = hand_run(model, weights, kind, ids)
    latents = result.meta["latents"]
    assert latents == [*range(D_SAE), "error"] and result.raw[site.name].shape == (SEEDS, D_SAE + 1, T)

    for seed in range(SEEDS):
        f_noised, e_noised, df, de = hand_gradient(model, weights, kind, ids, subject, draws[seed], ANSWER)
        corrupt = logprob(model, noised(model, subject, draws[seed], lambda: logits_of(model, ids)))
        assert abs(float(result.corrupt_seeds[seed]) - corrupt) < 1e-6
        got = result.raw[site.name][seed] - float(result.corrupt_seeds[seed])
        want_latents = ((f_clean - f_noised) * df)[0].T.float()
        want_error = ((e_clean - e_noised) * de)[0].sum(-1).float()
        assert torch.allclose(got[:D_SAE], want_latents, atol=1e-4, rtol=0), (got[:D_SAE] - want_latents).abs().max()
        assert torch.allclose(got[D_SAE], want_error, atol=1e-4, rtol=0)

    exact = {(e["layer"], e["col"], e["seed"]): e["actual"] for e in result.meta["verified_values"]}
    assert len(exact) == (D_SAE + 1) * T * SEEDS and None not in exact.values()
    moved = 0.0
    for (row, col, seed), value in exact.items():
        if row == D_SAE:
            def run(col=col):
                return hand_error_logits(model, weights, kind, ids, col, e_clean)
        else:
            def run(row=row, col=col):
                return hand_patched_logits(model, weights, kind, ids, col, row, float(f_clean[0, col, row]))
        want = logprob(model, noised(model, subject, draws[seed], run))
        assert abs(value - want) < 1e-5, (row, col, seed, value - want)
        moved = max(moved, abs(want - float(result.corrupt_seeds[seed])))
    assert moved > 1e-2  # the restorations reach the answer's log-probability
    frame = result.frame()
    assert len(frame) == (D_SAE + 1) * T and frame["exact"].notna().all()


def test_the_noise_is_traces_and_fixed_seeds_reproduce(tmp_path):
    """The noised runs are :func:`pipatch.trace`'s (σ, scale and P(answer) per seed, ``scale="auto"``
    choosing alike); two runs with the same seeds give the same screening and exact values; the
    top-k cells are those of the largest mean screening score over the seeds."""
    model, _, folder = saelens_folder(tmp_path, "llama", "jumprelu")
    site = pipatch.load_sae(folder, model)
    common = dict(subject=SUBJECT, answer=ANSWER, seeds=3, progress=False)
    trace = pipatch.trace(model, PROMPT, **common, positions=[-1])
    first_run = pipatch.feature_trace(model, PROMPT, **common, site=site, top_k=5)
    again = pipatch.feature_trace(model, PROMPT, **common, site=site, top_k=5)
    for key in ("scale", "subject_positions"):
        assert first_run.meta[key] == trace.meta[key], key
    assert abs(first_run.meta["sigma"] - trace.meta["sigma"]) < 1e-7
    assert [s["scale"] for s in first_run.meta["scales"]] == [s["scale"] for s in trace.meta["scales"]]
    torch.testing.assert_close(first_run.corrupt, trace.corrupt, atol=1e-6, rtol=0)
    assert torch.equal(first_run.raw[site.name], again.raw[site.name])
    assert first_run.meta["verified_values"] == again.meta["verified_values"]
    assert first_run.meta["latents"] == again.meta["latents"] and first_run.warnings == again.warnings

    every = pipatch.feature_trace(model, PROMPT, **common, site=site, exhaustive=True)
    mean = (every.raw[site.name][:, :D_SAE] - every.corrupt_seeds.reshape(-1, 1, 1)).mean(0).abs()
    top = mean.flatten().argsort(descending=True, stable=True)[:5].tolist()
    T = mean.shape[1]
    want = {(i // T, i % T) for i in top}
    latents = first_run.meta["latents"]
    got = {(latents[e["layer"]], e["col"]) for e in first_run.meta["verified_values"] if latents[e["layer"]] != "error"}
    assert got == want
    assert len(first_run.meta["verified_values"]) == 3 * (5 + T)  # every seed: the top cells and the error row
    for entry in first_run.meta["verified_values"]:  # the same cell's exact value as the exhaustive sweep's
        latent = latents[entry["layer"]]
        twin = D_SAE if latent == "error" else latent
        match = [e for e in every.meta["verified_values"]
                 if (e["layer"], e["col"], e["seed"]) == (twin, entry["col"], entry["seed"])]
        assert abs(match[0]["actual"] - entry["actual"]) < 1e-6
    saved = pipatch.load_result(first_run.save(tmp_path / "trace.safetensors"))
    assert type(saved) is type(first_run) and saved.frame().fillna(-9).equals(first_run.frame().fillna(-9))


def test_bad_feature_trace_input_is_one_line(tmp_path):
    model, _, folder = saelens_folder(tmp_path, "gpt2", "jumprelu")
    site = pipatch.load_sae(folder, model)
    cases = [
        (dict(site="resid"), "no latent site"),
        (dict(latents=[D_SAE]), "is not a latent"),
        (dict(top_k=0), "top_k"),
        (dict(seeds=0), "seeds"),
        (dict(scale=-1.0), "scale must be positive"),
        (dict(metric="logit_diff"), "metric for tracing"),
        (dict(subject="Big Ben"), "Big Ben"),
    ]
    for options, says in cases:
        kwargs = dict(subject=SUBJECT, answer=ANSWER, site=site, progress=False) | options
        with pytest.raises(pipatch.PipatchError, match=says) as error:
            pipatch.feature_trace(model, PROMPT, **kwargs)
        assert "\n" not in str(error.value), options
    with pytest.raises(pipatch.PipatchError, match="feature_trace") as error:
        pipatch.trace(model, PROMPT, subject=SUBJECT, answer=ANSWER, sites=site, progress=False)
    assert "\n" not in str(error.value)


# -- feature patching: noise, zero and mean --------------------------------------------------------
@pytest.mark.parametrize("direction", ["noise", "zero", "mean"])
@pytest.mark.parametrize("kind", ["jumprelu", "transcoder"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_direction_patches_the_clean_run_as_the_hand_reference(family, kind, direction, tmp_path):
    """The clean run with one latent (or the error at one position) set to the corrupt run's
    value (noise), zero, or its mean over the clean and corrupt prompts (mean): every exact
    cell equals the hook reference, and the screening the hand gradient at the clean run."""
    model, weights, folder = saelens_folder(tmp_path, family, kind)
    site = pipatch.load_sae(folder, model)
    result = pipatch.feature_patch(model, clean=CLEAN, corrupt=CORRUPT, answer=PAIR_ANSWER, foil=FOIL, site=site,
                                   direction=direction, exhaustive=True, progress=False)
    assert result.meta["direction"] == direction
    clean, corrupt = ids_of(model, CLEAN), ids_of(model, CORRUPT)
    f_clean, e_clean, df, de = hand_run(model, weights, kind, clean, grad=True)
    f_corrupt, e_corrupt, _, _ = hand_run(model, weights, kind, corrupt)
    f_donor, e_donor = {"noise": (f_corrupt, e_corrupt), "zero": (0 * f_clean, 0 * e_clean),
                        "mean": ((f_clean + f_corrupt) / 2, (e_clean + e_corrupt) / 2)}[direction]
    clean_value = float(logit_diff(model, logits_of(model, clean)))
    got = result.raw[site.name][0] - clean_value
    want_latents = ((f_donor - f_clean) * df)[0].T
    want_error = ((e_donor - e_clean) * de)[0].sum(-1)
    assert torch.allclose(got[:D_SAE], want_latents, atol=1e-4, rtol=0), (got[:D_SAE] - want_latents).abs().max()
    assert torch.allclose(got[D_SAE], want_error, atol=1e-4, rtol=0)

    exact = checked(result)
    T = clean.shape[1]
    assert len(exact) == (D_SAE + 1) * T and None not in exact.values()
    moved = 0.0
    for (row, col), value in exact.items():
        if row == D_SAE:
            want = hand_error_patch(model, weights, kind, clean, col, e_donor)
        else:
            want = float(logit_diff(model, hand_patched_logits(model, weights, kind, clean, col, row,
                                                               float(f_donor[0, col, row]))))
        assert abs(value - want) < 1e-5, (row, col, value - want)
        moved = max(moved, abs(want - clean_value))
    assert moved > 1e-3


def test_mean_ablation_averages_the_mean_prompts(tmp_path):
    """``mean_prompts=``: a latent is replaced by its mean at that position over those prompts
    (patching's definition); a prompt of another length is one line."""
    model, weights, folder = saelens_folder(tmp_path, "llama", "jumprelu")
    site = pipatch.load_sae(folder, model)
    others = ["The Louvre is in the city of", "The Kremlin is in the city of", "The Vatican is in the city of"]
    result = pipatch.feature_patch(model, clean=CLEAN, corrupt=CORRUPT, answer=PAIR_ANSWER, foil=FOIL, site=site,
                                   direction="mean", mean_prompts=others, latents=[4, 9], progress=False)
    clean = ids_of(model, CLEAN)
    mean = torch.stack([hand_latents(model, weights, "jumprelu", ids_of(model, text)) for text in others]).mean(0)
    for (row, col), value in checked(result).items():
        if row < 2:
            latent = (4, 9)[row]
            want = logit_diff(model, hand_patched_logits(model, weights, "jumprelu", clean, col, latent,
                                                         float(mean[0, col, latent])))
            assert abs(value - float(want)) < 1e-5
    assert result.meta["mean_prompts"] == others
    with pytest.raises(pipatch.PipatchError, match="same token length") as error:
        pipatch.feature_patch(model, clean=CLEAN, corrupt=CORRUPT, answer=PAIR_ANSWER, foil=FOIL, site=site,
                              direction="mean", mean_prompts=["Rome"], progress=False)
    assert "\n" not in str(error.value)
    with pytest.raises(pipatch.PipatchError, match="direction"):
        pipatch.feature_patch(model, clean=CLEAN, corrupt=CORRUPT, answer=PAIR_ANSWER, foil=FOIL, site=site,
                              direction="sideways", progress=False)


# -- the embedded model ----------------------------------------------------------------------------
def test_a_feature_trace_on_the_embedded_model_equals_the_hand_reference(model):
    """The shipped SAE (TopK, k = 32, decoder-norm rescaled, block 6's output) on the embedded
    Gemma 3 270M: each restored cell of the top 4 and of the error row equals the hook
    reference, its SAE math spelled out from the weights file."""
    site = pipatch.embedded_sae(model)
    folder = site.sae.folder
    w = load_file(str(folder / "sae_weights.safetensors"))
    norms = w["W_dec"].norm(dim=-1)

    def encode(x):
        pre = ((x.float() - w["b_dec"]) @ w["W_enc"] + w["b_enc"]) * norms
        values, indices = pre.topk(32, dim=-1)
        return torch.zeros_like(pre).scatter(-1, indices, values.relu())

    def decode(f):
        return (f / norms) @ w["W_dec"] + w["b_dec"]

    result = pipatch.feature_trace(model, PROMPT, subject=SUBJECT, answer=ANSWER, site=site, seeds=1, scale=3.0,
                                   top_k=4, positions=[-1, *range(1, 5)], progress=False)
    ids = ids_of(model, PROMPT)
    subject = result.meta["subject_positions"]
    _, draws = hand_noise(model, ids, subject, 1, 3.0)
    block = _get(model._module, adapter_for(model).blocks)[6]
    clean = {}
    hooked([(block, "post", lambda m, a, out: clean.__setitem__("x", first(out).detach().clone()))],
           lambda: logits_of(model, ids))
    f_clean = encode(clean["x"])
    e_clean = clean["x"].float() - decode(f_clean)

    def edited(position, latent):
        def put(m, args, output):
            out = first(output).float()
            f = encode(out)
            error = out - decode(f)
            g = f.clone()
            if latent == "error":
                error[:, position] = e_clean[:, position]
            else:
                g[:, position, latent] = f_clean[:, position, latent]
            new = (decode(g) + error).to(first(output).dtype)
            return (new,) + tuple(output[1:]) if isinstance(output, tuple) else new
        return lambda: hooked([(block, "post", put)], lambda: logits_of(model, ids))

    latents = result.meta["latents"]
    positions = result.meta["positions"]
    done = [e for e in result.meta["verified_values"] if e["actual"] is not None]
    assert len(done) == 4 + len(positions) and latents[-1] == "error"
    for entry in done:
        latent, position = latents[entry["layer"]], positions[entry["col"]]
        want = prob(model, noised(model, subject, draws[0], edited(position, latent)))
        assert abs(entry["actual"] - want) < 1e-5, (latent, position, entry["actual"] - want)
    assert result.meta["agreement"]["n"] == len(done)
