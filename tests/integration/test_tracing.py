"""Causal tracing on the real embedded model: the acceptance picture and the protocol's parts."""

from __future__ import annotations

import pytest
import torch

import pipatch
from pipatch._experiments.tracing import AUTO_SCALES, COLLAPSE_FRACTION, noise_draws
from pipatch._model.models import adapter_for
from tests.conftest import EIFFEL


def test_two_sites_on_the_embedded_default(eiffel_trace):
    r = eiffel_trace
    assert r.status == "done"
    assert r.tokens[2] == " Eiffel" and r.tokens[-1] == " of"
    grid = r.grid
    L = grid.shape[0]
    eiffel, last = grid[:, 2], grid[:, -1]
    # " Eiffel": above 0.5 somewhere in the first half, below 0.1 in the last quarter.
    assert eiffel[: L // 2].max() > 0.5
    assert eiffel[L - L // 4 :].max() < 0.1
    # The last position: above 0.8 somewhere in the last third, below 0.1 in the first third.
    assert last[L - L // 3 :].max() > 0.8
    assert last[: L // 3].max() < 0.1


def test_two_sites_hold_in_bfloat16(eiffel_trace, eiffel_patch):
    """The embedded model loaded in bfloat16: the same two sites, and a patching grid within
    bfloat16's rounding of the float32 one (noise, writes and readouts follow the model's dtype)."""
    from tests.conftest import COLOSSEUM

    model = pipatch.load_model(dtype="bfloat16")
    assert next(model._module.parameters()).dtype == torch.bfloat16
    r = pipatch.trace(model, EIFFEL, subject="Eiffel Tower", answer=" Paris", seeds=3)
    assert r.meta["dtype"] == "bfloat16"
    L = r.grid.shape[0]
    eiffel, last = r.grid[:, 2], r.grid[:, -1]
    assert eiffel[: L // 2].max() > 0.5 and eiffel[L - L // 4 :].max() < 0.1
    assert last[L - L // 3 :].max() > 0.8 and last[: L // 3].max() < 0.1
    p = pipatch.patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome")
    assert float((p.grid - eiffel_patch.grid).abs().max()) < 0.05
    # bfloat16 keeps 8 mantissa bits: a logit near ±15 moves by ~0.06 per rounding, so the clean
    # logit difference (3.996 in float32) lands within 5 % of it (3.875 measured here).
    assert p.clean == pytest.approx(eiffel_patch.clean, rel=0.05)


def test_result_keeps_per_seed_grids_and_their_spread(eiffel_trace):
    r = eiffel_trace
    assert r.per_seed.shape == (10, 18, 9)
    # Recovery from the stored raw metric and the baselines, by the definition (not through
    # the Result's own recovery()/mean(), which grid and per_seed both are).
    raw, corrupt = r.raw["resid"], r.corrupt_seeds.view(-1, 1, 1)
    by_hand = (raw - corrupt) / (r.clean - corrupt)
    assert not torch.isnan(raw).any() and torch.isfinite(by_hand).all()
    # The same numbers through the same definition: only float32 rounding differs, a few ulps
    # of a recovery (|recovery| < 2 here: ~1e-7), inside 1e-5.
    assert float(by_hand.abs().max()) < 2
    assert torch.allclose(r.per_seed, by_hand, atol=1e-5)
    assert torch.allclose(r.grid, by_hand.mean(0), atol=1e-5)
    # Each seed's own corrupt run normalizes it: restoring the clean last state at the last
    # layer gives 1 for every seed, though the seeds' corrupt baselines differ. Derived: that
    # cell's probability is the clean run's within the metric's 1e-5, the baselines shared, so
    # recovery 1 within 1e-5 / (clean − corrupt) per seed (tests/_tolerance.py): < 1e-4, as
    # every seed's corrupt probability is at most a tenth of the clean one (the auto scale).
    from tests._tolerance import normalized_tolerance

    spans = [normalized_tolerance(r.clean, float(c), r.clean, 1e-5, baselines_shared=True) for c in r.corrupt_seeds]
    assert max(spans) < 1e-4
    assert float((r.per_seed[:, -1, -1] - 1).abs().max()) < 1e-4
    assert float(r.corrupt_seeds.max() - r.corrupt_seeds.min()) > 0
    assert r.std().shape == (18, 9) and float(r.std()[:12, 2].max()) > 0  # seeds differ
    assert r.meta["seeds"] == 10 and r.corrupt_seeds.shape == (10,)


def test_subject_span_comes_from_offsets(eiffel_trace, model):
    assert eiffel_trace.meta["subject_positions"] == [2, 3]
    r = pipatch.trace(model, "The Colosseum is in the city of", subject="Colosseum", answer=" Rome",
                      seeds=1, scale=3.0, sites="resid")
    # BPE pieces " Col" + "osseum" are both part of the subject.
    assert r.meta["subject_positions"] == [2, 3]


def test_sigma_is_the_spread_of_the_subjects_embedding_outputs(eiffel_trace, model):
    ids = model.tokenizer(EIFFEL, return_tensors="pt").input_ids
    embedded = model._module.model.embed_tokens(ids)  # Gemma scales by sqrt(d) in here
    expected = float(embedded[0, [2, 3]].std())
    assert eiffel_trace.meta["sigma"] == pytest.approx(expected, rel=1e-5)
    assert expected > 2 * float(model._module.model.embed_tokens.weight.std())


def test_auto_scale_is_the_smallest_whose_worst_seed_collapses(eiffel_trace):
    meta = eiffel_trace.meta
    threshold = COLLAPSE_FRACTION * meta["clean_prob"]
    tried = meta["scales"]
    assert [t["scale"] for t in tried] == list(AUTO_SCALES[: len(tried)])
    assert tried[-1]["worst"] <= threshold and meta["scale"] == tried[-1]["scale"]
    assert all(t["worst"] > threshold for t in tried[:-1])
    # The chosen scale's record is the corrupt runs the grid is normalized by, seed by seed.
    probs = torch.tensor(meta["corrupt_prob"])
    assert tried[-1]["worst"] == pytest.approx(float(probs.max()), rel=1e-6)
    assert tried[-1]["mean"] == pytest.approx(float(probs.mean()), rel=1e-6)


def test_noise_is_fixed_per_seed_and_reproduces_the_corrupt_run(eiffel_trace, model):
    meta = eiffel_trace.meta
    a = adapter_for(model)
    draws = noise_draws(3, 2, a.d_model, meta["scale"], meta["sigma"])
    assert torch.equal(draws, noise_draws(3, 2, a.d_model, meta["scale"], meta["sigma"]))
    ids = model.tokenizer(EIFFEL, return_tensors="pt").input_ids
    paris = meta["answer_id"]
    with model.trace(ids):
        model.model.embed_tokens.output[:, [2, 3]] += draws[1]
        p = model.output.logits[0, -1].softmax(-1)[paris].save()
    assert float(p) == pytest.approx(meta["corrupt_prob"][1], abs=1e-5)


def test_control_restoring_the_corrupt_runs_own_states_changes_nothing(model):
    r = pipatch.trace(model, EIFFEL, subject="Eiffel Tower", answer=" Paris", seeds=2, control=True)
    assert r.meta["engine"]["noop_cells"] == 0  # every cell really ran
    # Derived: every cell's probability is the corrupt run's within the metric's 1e-5 (a rerun
    # batched otherwise), the baselines shared: recovery 0 within 1e-5 / (clean − corrupt) per
    # seed (tests/_tolerance.py), which is below 1e-3 (clean − corrupt > 0.01).
    from tests._tolerance import recovery_tolerance

    assert float(recovery_tolerance(r, 1e-5, baselines_shared=True).max()) < 1e-3
    assert float(r.grid.abs().max()) < 1e-3


def test_explicit_scale_is_honoured_and_a_weak_seed_is_flagged(model):
    r = pipatch.trace(model, EIFFEL, subject="Eiffel Tower", answer=" Paris", seeds=3, scale=0.5,
                      sites="resid")
    assert r.meta["scale"] == 0.5 and len(r.meta["scales"]) == 1
    assert any("did not corrupt" in w for w in r.warnings)


def test_windowed_sublayer_traces_separate_the_two_sites(model):
    r = pipatch.trace(model, EIFFEL, subject="Eiffel Tower", answer=" Paris", seeds=3, sites="mlp,attn")
    assert r.views == ["mlp", "attn"]
    mlp, attn = r.mean("mlp"), r.mean("attn")
    assert mlp.shape == attn.shape == (18, 9)
    # MLPs at the subject early; attention at the last token late, not at the subject late.
    assert float(mlp[:6, 2:4].max()) > float(mlp[12:, 2:4].max())
    assert float(attn[6:15, -1].max()) > float(attn[:, 2:4][12:].max())


def test_fast_path_equals_the_straightforward_one(model):
    kw = dict(subject="Eiffel Tower", answer=" Paris", seeds=2, scale=3.0, sites="resid,mlp")
    fast = pipatch.trace(model, EIFFEL, **kw)
    slow = pipatch.trace(model, EIFFEL, fast=False, **kw)
    for view in fast.views:
        assert torch.allclose(fast.raw[view], slow.raw[view], atol=1e-4)
    assert fast.meta["engine"]["noop_cells"] > 0 and slow.meta["engine"]["fast"] is False


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt="", subject="x", answer=" Paris"), "empty"),
        (dict(subject="Big Ben", answer=" Paris"), "not in the prompt"),
        (dict(subject=[0, 40], answer=" Paris"), "out of range"),
        (dict(subject="Eiffel Tower", answer=""), "answer is empty"),
        (dict(subject="Eiffel Tower", answer=" Paris", seeds=0), "seeds"),
        (dict(subject="Eiffel Tower", answer=" Paris", scale=-1.0), "positive"),
        (dict(subject="Eiffel Tower", answer=" Paris", kind="mlpp"), "unknown site"),
    ],
)
def test_bad_input_is_one_clear_line(model, kwargs, match):
    kwargs = {"prompt": EIFFEL, **kwargs}
    prompt = kwargs.pop("prompt")
    with pytest.raises(pipatch.PipatchError, match=match) as info:
        pipatch.trace(model, prompt, **kwargs)
    assert "\n" not in str(info.value)
