"""Feature patching (:func:`pipatch.feature_patch`, issue #46): rows are an SAE's latents and its
error, screened by attribution and patched exactly, on tiny random models of three families
with random SAEs (:mod:`tests._saes`) and on the embedded model.

* the screening score of every (latent, position) cell and of the error row equals a gradient
  computed by hand (torch autograd through hooks written here) within 1e-4;
* every exact patch the sweep runs — latents and the error row — equals a hand-written hook
  reference (encode, edit, decode + error) within 1e-5;
* ``frame()`` has one line per (latent, position) cell; bad ids and sizes are one line.
"""

from __future__ import annotations

import pytest
import torch

import pipatch
from tests._reference import first, hooked, logits_of
from tests._saes import D_SAE
from tests.integration.test_features import (
    CLEAN,
    CORRUPT,
    FAMILIES,
    LAYER,
    hand_decode,
    hand_encode,
    hand_patched_logits,
    hand_skip,
    modules_of,
    saelens_folder,
)

ANSWER, FOIL = " Rome", " Moscow"


def ids_of(model, text):
    return model.tokenizer(text, return_tensors="pt").input_ids


def token(model, text):
    return model.tokenizer(text, add_special_tokens=False).input_ids[0]


def logit_diff(model, logits):
    return logits[0, -1, token(model, ANSWER)] - logits[0, -1, token(model, FOIL)]


def hand_run(model, weights, kind, ids, grad=False):
    """One run with the written module's output rebuilt as ``decode(f) + skip + e`` from a
    latent leaf ``f`` and an error leaf ``e`` (the same value as the plain run's); returns
    ``(f, e, dM/df, dM/de)`` at :data:`LAYER` (gradients ``None`` unless ``grad``)."""
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

    handles = [written.register_forward_hook(put)]
    if kind == "transcoder":
        handles.insert(0, read.register_forward_pre_hook(lambda m, args: store.__setitem__("x", args[0])))
    try:
        with torch.enable_grad():
            metric = logit_diff(model, model._module(ids).logits)
            grads = torch.autograd.grad(metric, [store["f"], store["e"]]) if grad else (None, None)
    finally:
        for handle in handles:
            handle.remove()
    return store["f"].detach(), store["e"].detach(), *grads


def hand_error_logits(model, weights, kind, ids, position, clean_error):
    """Logits of the ``ids`` run with the SAE's error at ``position`` set to ``clean_error``
    there: the written output becomes decode(f) + skip + the edited error."""
    read, written = modules_of(model, kind)
    store = {}

    def put(module, args, output):
        out = first(output).clone()
        x = store.get("x", out)
        latents = hand_encode(weights, kind, x)
        error = out - hand_decode(weights, latents) - hand_skip(weights, x)
        error[:, position] = clean_error[:, position]
        new = hand_decode(weights, latents) + hand_skip(weights, x) + error
        return (new,) + tuple(output[1:]) if isinstance(output, tuple) else new

    hooks = [(written, "post", put)]
    if kind == "transcoder":
        hooks.insert(0, (read, "pre", lambda m, args: store.__setitem__("x", args[0].detach().clone())))
    return hooked(hooks, lambda: logits_of(model, ids))


def hand_error_patch(model, weights, kind, ids, position, clean_error):
    """The metric (logit difference) of :func:`hand_error_logits`' run."""
    return float(logit_diff(model, hand_error_logits(model, weights, kind, ids, position, clean_error)))


def checked(result):
    """``{(row, col): exact value}`` of the cells the sweep patched exactly."""
    return {(e["layer"], e["col"]): e["actual"] for e in result.meta["verified_values"]}


@pytest.mark.parametrize("kind", ["jumprelu", "topk", "transcoder"])
@pytest.mark.parametrize("family", FAMILIES)
def test_exhaustive_screening_and_patches_equal_the_hand_references(family, kind, tmp_path):
    """``exhaustive=True``: every latent × position cell screened and patched. The screening
    is the hand gradient's (clean − corrupt) · dM/df, the error row's summed over the width;
    every exact value is the hook reference's."""
    model, weights, folder = saelens_folder(tmp_path, family, kind)
    site = pipatch.load_sae(folder, model)
    result = pipatch.feature_patch(model, clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL, site=site,
                                   exhaustive=True, progress=False)
    clean, corrupt = ids_of(model, CLEAN), ids_of(model, CORRUPT)
    f_clean, e_clean, _, _ = hand_run(model, weights, kind, clean)
    f_corrupt, e_corrupt, df, de = hand_run(model, weights, kind, corrupt, grad=True)
    want_latents = ((f_clean - f_corrupt) * df)[0].T  # [D_SAE, T]
    want_error = ((e_clean - e_corrupt) * de)[0].sum(-1)  # [T]
    got = result.raw[site.name][0] - result.corrupt
    assert result.meta["latents"] == [*range(D_SAE), "error"]
    assert torch.allclose(got[:D_SAE], want_latents, atol=1e-4, rtol=0), (got[:D_SAE] - want_latents).abs().max()
    assert torch.allclose(got[D_SAE], want_error, atol=1e-4, rtol=0), (got[D_SAE] - want_error).abs().max()
    assert want_latents.abs().max() > 1e-3 and want_error.abs().max() > 1e-3  # the scores are not all zero

    exact = checked(result)
    T = clean.shape[1]
    assert len(exact) == (D_SAE + 1) * T and None not in exact.values()
    for (row, col), value in exact.items():
        if row == D_SAE:
            want = hand_error_patch(model, weights, kind, corrupt, col, e_clean)
        else:
            want = float(logit_diff(model, hand_patched_logits(model, weights, kind, corrupt, col, row,
                                                               float(f_clean[0, col, row]))))
        assert abs(value - want) < 1e-5, (row, col, value - want)
    assert -1 <= result.meta["agreement"]["spearman"] <= 1


@pytest.mark.parametrize("kind", ["jumprelu", "transcoder"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_top_k_cells_are_patched_exactly_with_the_error_row(family, kind, tmp_path):
    """The default sweep: the ``top_k`` cells of largest |screening score| are patched (and
    the error row at every position), each equal to its hook reference; rows are the latents
    those cells hold, ordered by their largest score, then the error."""
    model, weights, folder = saelens_folder(tmp_path, family, kind)
    site = pipatch.load_sae(folder, model)
    every = pipatch.feature_patch(model, clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL, site=site,
                                  exhaustive=True, progress=False)
    result = pipatch.feature_patch(model, clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL, site=site,
                                   top_k=6, progress=False)
    scores = (every.raw[site.name][0, :D_SAE] - every.corrupt).abs()
    top = scores.flatten().argsort(descending=True, stable=True)[:6].tolist()
    T = scores.shape[1]
    want_cells = {(i // T, i % T) for i in top}
    latents = result.meta["latents"]
    assert latents[-1] == "error" and set(latents[:-1]) == {i for i, _ in want_cells}
    assert result.layers[-1] == f"L{LAYER} error"
    exact = checked(result)
    assert {(latents[row], col) for row, col in exact if latents[row] != "error"} == want_cells
    assert sum(latents[row] == "error" for row, _ in exact) == T
    for (row, col), value in exact.items():  # the same cell's exact value as the exhaustive sweep's
        twin = D_SAE if latents[row] == "error" else latents[row]
        assert abs(value - checked(every)[(twin, col)]) < 1e-5
    assert result.meta["agreement"]["n"] == 6 + T

    frame = result.frame()
    assert list(frame.columns) == ["latent", "position", "value", "exact"]
    assert len(frame) == len(latents) * T
    assert int(frame["exact"].notna().sum()) == 6 + T
    assert set(frame["latent"]) == set(latents)
    error_rows = frame[frame["latent"] == "error"]
    assert list(error_rows["position"]) == list(range(T)) and error_rows["exact"].notna().all()


@pytest.mark.parametrize("kind", ["jumprelu", "transcoder"])
def test_chosen_latents_are_patched_at_every_position(kind, tmp_path):
    model, weights, folder = saelens_folder(tmp_path, "llama", kind)
    site = pipatch.load_sae(folder, model)
    result = pipatch.feature_patch(model, clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL, site=site,
                                   latents=[7, 3], positions=[-2, -1], progress=False)
    assert result.meta["latents"] == [7, 3, "error"] and len(checked(result)) == 6
    corrupt = ids_of(model, CORRUPT)
    T = corrupt.shape[1]
    f_clean, _, _, _ = hand_run(model, weights, kind, ids_of(model, CLEAN))
    for (row, col), value in checked(result).items():
        if row < 2:
            latent, position = (7, 3)[row], T - 2 + col
            want = logit_diff(model, hand_patched_logits(model, weights, kind, corrupt, position, latent,
                                                         float(f_clean[0, position, latent])))
            assert abs(value - float(want)) < 1e-5


def test_the_result_saves_and_reads_back_with_its_frame(tmp_path):
    model, _, folder = saelens_folder(tmp_path, "gpt2", "jumprelu")
    result = pipatch.feature_patch(model, clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL, site=str(folder),
                                   top_k=3, progress=False)
    again = pipatch.load_result(result.save(tmp_path / "feats.safetensors"))
    assert type(again) is type(result)
    assert again.frame().fillna(-9).equals(result.frame().fillna(-9))


def test_bad_latents_top_k_and_sites_are_one_line(tmp_path):
    model, _, folder = saelens_folder(tmp_path, "llama", "jumprelu")
    site = pipatch.load_sae(folder, model)
    cases = [
        (dict(latents=[3, D_SAE]), f"ids from 0 to {D_SAE - 1}"),
        (dict(latents=[-1]), "is not a latent"),
        (dict(latents=[2, 2]), "twice"),
        (dict(latents=[]), "latents is empty"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(latents=[1], exhaustive=True), "pass one of them"),
        (dict(site="resid"), "no latent site"),
        (dict(site=site.error_site), "no latent site"),
    ]
    for options, says in cases:
        kwargs = dict(clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL, site=site, progress=False) | options
        with pytest.raises(pipatch.PipatchError, match=says) as error:
            pipatch.feature_patch(model, **kwargs)
        assert "\n" not in str(error.value), options


def test_a_screening_given_as_scores_is_patched_here_as_there(tmp_path):
    """``scores=``: another run takes a screening's rows, estimates and checked cells (what a
    backend without gradients does) and its exact patches equal the screening run's; a
    screening of another SAE or other positions is one line."""
    model, _, folder = saelens_folder(tmp_path, "llama", "jumprelu")
    site = pipatch.load_sae(folder, model)
    pair = dict(clean=CLEAN, corrupt=CORRUPT, answer=ANSWER, foil=FOIL, progress=False)
    screened = pipatch.feature_patch(model, **pair, site=site, top_k=5)
    saved = screened.save(tmp_path / "screened.json")
    again = pipatch.feature_patch(model, **pair, site=site, scores=str(saved))
    assert again.meta["latents"] == screened.meta["latents"] and checked(again).keys() == checked(screened).keys()
    assert all(abs(checked(again)[cell] - value) < 1e-6 for cell, value in checked(screened).items())
    assert torch.allclose(again.raw[site.name], screened.raw[site.name], atol=1e-6)
    with pytest.raises(pipatch.PipatchError, match="screen the same SAE and positions") as error:
        pipatch.feature_patch(model, **pair, site=site, scores=screened, positions=[-1])
    assert "\n" not in str(error.value)
    with pytest.raises(pipatch.PipatchError, match="give the result of pipatch.feature_patch"):
        pipatch.feature_patch(model, **pair, site=site, scores=pipatch.lens(model, CLEAN, answer=ANSWER, progress=False))
