"""Activation patching on the real embedded model, checked against a one-forward-per-cell
PyTorch hook loop (the reference every faster method must reproduce)."""

from __future__ import annotations

import pytest
import torch

import pipatch
from tests._reference import patch_grid
from tests._tolerance import assert_recovery_close, normalized_tolerance, recovery_tolerance
from tests.conftest import COLOSSEUM, EIFFEL

PARIS, ROME = 9079, 13706


def hook_loop(model, site: str) -> torch.Tensor:
    """Denoising logit difference per (layer, position or head), one forward per cell."""
    tok = model.tokenizer
    clean = tok(EIFFEL, return_tensors="pt").input_ids
    corrupt = tok(COLOSSEUM, return_tensors="pt").input_ids
    return patch_grid(model, site, clean, corrupt, PARIS, ROME)


@pytest.mark.parametrize("site", ["resid", "attn", "mlp", "head"])
def test_grid_equals_a_hook_loop(model, site):
    r = pipatch.patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome", site=site)
    reference = hook_loop(model, site)
    assert r.raw[site].shape == (1, *reference.shape)
    assert torch.allclose(r.raw[site][0], reference, atol=1e-4), (r.raw[site][0] - reference).abs().max()
    normalized = (reference - r.corrupt) / (r.clean - r.corrupt)
    # Derived: the baselines are shared, the raw metric within 1e-4 + 1e-5·|raw| (allclose's
    # rtol), so recovery within that over |clean − corrupt| (tests/_tolerance.py); ~2e-5 here.
    assert_recovery_close(r.grid, normalized, recovery_tolerance(r, 1e-4, 1e-5, baselines_shared=True))


def test_baselines_and_raw_values_are_kept(eiffel_patch):
    r = eiffel_patch
    assert r.metric == "logit_diff" and r.clean > 0 > r.corrupt
    assert r.meta["engine"]["max_invokes"] <= r.meta["engine"]["batch_size"]
    # Last layer, last position reproduces the clean run; earlier positions there cannot matter.
    # Recovery 1 (or 0) within 1e-4: the cell's metric is the clean (corrupt) run's within the
    # metric's 1e-4 (test_grid_equals_a_hook_loop), over |clean − corrupt| > 1: within 1e-4.
    assert r.clean - r.corrupt > 1
    assert r.grid[-1, -1] == pytest.approx(1.0, abs=1e-4)
    assert float(r.grid[-1, :-1].abs().max()) < 1e-4
    assert r.frame().shape[0] == 18 * 9


def test_positions_subset_with_negative_index(model, eiffel_patch):
    r = pipatch.patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome", positions=[2, -1])
    assert r.columns == [" Eiffel", " of"]
    # Recovery within 1e-4 (and allclose's 1e-5 relative): the same cells batched otherwise,
    # their metrics and baselines within 1e-5 (the project's net) over |clean − corrupt| > 1:
    # at most 4e-5 (tests/_tolerance.py), inside it.
    assert (recovery_tolerance(eiffel_patch, 1e-5) < 1e-4).all()
    assert torch.allclose(r.grid, eiffel_patch.grid[:, [2, 8]], atol=1e-4)


def test_batch_size_caps_invokes_per_trace(model):
    r = pipatch.patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome", batch_size=3)
    stats = r.meta["engine"]
    assert stats["max_invokes"] == 3
    assert stats["traces"] >= (stats["cells"] - stats["noop_cells"]) / 3


def test_noising_is_the_mirror_direction(model):
    r = pipatch.patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome", direction="noise")
    # Pasting the corrupt last-position state at the last layer gives the corrupt run exactly.
    # Recovery 0 (1) within 1e-4: the metric the corrupt (clean) run's within 1e-4, over
    # |clean − corrupt| > 1 (the bound of test_baselines_and_raw_values_are_kept).
    assert r.clean - r.corrupt > 1
    assert r.grid[-1, -1] == pytest.approx(0.0, abs=1e-4)
    # Positions the two prompts share (<bos>, The) carry nothing of the difference.
    assert float((r.grid[:, :2] - 1).abs().max()) < 1e-4


_MEAN_RUNS: dict = {}


def _mean_over_the_clean_prompt(model, fast: bool):
    key = (id(model), fast)
    if key not in _MEAN_RUNS:  # the unpruned run is 162 forwards: run it once for both tests
        _MEAN_RUNS[key] = pipatch.patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome",
                                        direction="mean", mean_prompts=[EIFFEL], fast=fast)
    return _MEAN_RUNS[key]


def test_mean_ablation_over_the_clean_prompt_alone_changes_nothing(model):
    """The mean over the clean prompt alone is the clean activation: writing it into the clean
    run, really run (``fast=False``: no pruning), gives the clean metric in every cell."""
    r = _mean_over_the_clean_prompt(model, fast=False)
    stats = r.meta["engine"]
    assert stats["cells"] == 18 * 9 and stats["noop_cells"] == 0  # every cell went through the model
    assert stats["traces"] >= stats["cells"] / stats["batch_size"] > 0
    raw = r.raw["resid"][0]
    assert not torch.isnan(raw).any()
    assert float((raw - r.clean).abs().max()) < 1e-4  # the clean run's logit difference ...
    assert float((r.grid - 1).abs().max()) < 1e-4  # ... which is recovery 1
    # and 1 is not 0/0 or a flat pair of baselines; it also derives the 1e-4 above: recovery −
    # 1 is (raw − clean) / (clean − corrupt), within 1e-4 / |clean − corrupt| < 1e-4.
    assert r.clean > r.corrupt + 1


def test_mean_ablation_pruned_equals_run(model):
    """The default path fills these no-op cells from the clean run without a forward; that
    shortcut gives what running them gives."""
    fast, slow = _mean_over_the_clean_prompt(model, fast=True), _mean_over_the_clean_prompt(model, fast=False)
    assert fast.meta["engine"]["noop_cells"] == fast.meta["engine"]["cells"] == 18 * 9
    assert slow.meta["engine"]["noop_cells"] == 0
    assert torch.allclose(fast.raw["resid"], slow.raw["resid"], atol=1e-4, rtol=0)


def test_zero_ablation_runs_and_hurts_somewhere(model):
    r = pipatch.patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome",
                      direction="zero", site="resid", positions=[-1])
    # Zero is a specific off-distribution point, not "no information": it moves the answer
    # (here down to about half the clean logit difference at layer 12) without erasing it.
    assert torch.isfinite(r.grid).all() and float(r.grid.min()) < 0.75


def test_prob_and_logprob_metrics(model):
    for metric in ("prob", "logprob"):
        r = pipatch.patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", metric=metric, positions=[-1])
        # The last layer's clean state is the clean run: its metric within the project's 1e-5,
        # so recovery 1 within 1e-5 / |clean − corrupt| (tests/_tolerance.py), inside 1e-4.
        assert normalized_tolerance(r.clean, r.corrupt, r.clean, 1e-5, baselines_shared=True) < 1e-4
        assert r.metric == metric and r.grid[-1, 0] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(corrupt="The big old Colosseum is in the city of"), r"same length.*'<bos>'"),
        (dict(answer=""), "answer is empty"),
        (dict(foil=""), "foil is empty"),
        (dict(foil=None), "needs a foil"),
        (dict(site="neuron"), "unknown site"),
        (dict(metric="kl"), "unknown metric"),
        (dict(direction="sideways"), "unknown direction"),
        (dict(positions=[9]), "out of range"),
        (dict(clean=""), "empty"),
    ],
)
def test_bad_input_is_one_clear_line(model, kwargs, match):
    args = dict(clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome")
    args.update(kwargs)
    with pytest.raises(pipatch.PipatchError, match=match) as info:
        pipatch.patch(model, **args)
    assert "\n" not in str(info.value)
