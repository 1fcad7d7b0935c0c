"""Attribution patching against real activation patching on the embedded model.

For each site the full ``pipatch.patch`` grid is computed once and compared with the
first-order estimate over every cell (rank correlation, printed with ``-s``); the cells that
``verify`` patches for real must equal ``patch``'s own numbers.

Measured on Gemma 3 270M (float32, CPU), Eiffel → Colosseum, logit difference, Spearman over
all cells: attn 0.83, mlp 0.93, head 0.97 (Pearson of the recovery grids: attn 0.98,
mlp 0.76, head 0.97). The bounds below sit just under those numbers.
"""

from __future__ import annotations

import pytest
import torch

import pipatch
from pipatch._experiments.attribution import spearman
from tests.conftest import COLOSSEUM, EIFFEL

# Lower bounds on the all-cell Spearman correlation, a little under what was measured. Not a
# rounding tolerance: float rounding can only swap near-tied cells, each swap moving the rank
# correlation by O(1/n²) over n ≥ 162 cells, far inside the 0.07-0.08 margins.
BOUNDS = {"attn": 0.75, "mlp": 0.85, "head": 0.9}
K = 5


@pytest.mark.parametrize("site", ["attn", "mlp", "head"])
def test_estimate_ranks_cells_like_real_patching(model, site):
    estimate = pipatch.attribute(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome",
                                 site=site, verify=K)
    actual = pipatch.patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome", site=site)
    assert estimate.kind == "attribution"
    assert estimate.raw[site].shape == actual.raw[site].shape
    assert estimate.clean == pytest.approx(actual.clean, abs=1e-4)
    assert estimate.corrupt == pytest.approx(actual.corrupt, abs=1e-4)

    rho = spearman(estimate.raw[site], actual.raw[site])
    agreement = estimate.meta["agreement"]
    print(f"\n{site}: spearman over all {actual.raw[site].numel()} cells {rho:.3f}; "
          f"top-{K} verified: spearman {agreement['spearman']:.3f}, "
          f"max |error| {agreement['max_abs_error']:.3f} logits "
          f"({agreement['max_abs_error_recovery']:.3f} recovery)")
    assert rho > BOUNDS[site]

    # Verified cells: the real patch equals patch()'s grid, and they are the top-|estimate| cells.
    rows = estimate.meta["verified_values"]
    assert len(rows) == K == agreement["n"]
    mask = torch.tensor(estimate.meta["verified"][site])
    assert mask.shape == actual.raw[site].shape[1:] and int(mask.sum()) == K
    change = (estimate.raw[site][0] - estimate.corrupt).abs()
    assert float(change[mask.bool()].min()) >= float(change[~mask.bool()].max())
    errors = []
    for row in rows:
        assert mask[row["layer"], row["col"]] == 1
        assert row["actual"] == pytest.approx(float(actual.raw[site][0, row["layer"], row["col"]]), abs=1e-4)
        assert row["estimate"] == pytest.approx(float(estimate.raw[site][0, row["layer"], row["col"]]), abs=1e-6)
        errors.append(abs(row["estimate"] - row["actual"]))
    assert agreement["max_abs_error"] == pytest.approx(max(errors), abs=1e-6)
    assert "verified" in " ".join(estimate.arrays())  # the widget gets the mask


def test_tiny_model_no_parameter_gradients_file_round_trip_and_errors(tmp_path):
    from tests._tiny import tiny_model

    tiny = tiny_model("llama")
    r = pipatch.attribute(tiny, clean="The Colosseum is in the city of", corrupt="The Kremlin is in the city of",
                          answer=" Paris", foil=" Rome", site="resid", positions=[-1])
    assert r.raw["resid"].shape == (1, 3, 1) and torch.isfinite(r.raw["resid"]).all()
    assert all(p.grad is None for p in tiny._module.parameters())
    heads = pipatch.attribute(tiny, clean="The Colosseum is in the city of", corrupt="The Kremlin is in the city of",
                              answer=" Paris", foil=" Rome", site="head", verify=2)
    loaded = pipatch.load_result(heads.save(tmp_path / "heads.safetensors"))
    assert loaded.kind == "attribution" and loaded.meta["agreement"] == heads.meta["agreement"]
    assert loaded.meta["verified"]["head"] == heads.meta["verified"]["head"]
    with pytest.raises(pipatch.PipatchError, match="verify"):
        pipatch.attribute(tiny, clean="The city", corrupt="The park", answer=" Paris", foil=" Rome", verify=-1)
    with pytest.raises(pipatch.PipatchError, match="foil"):
        pipatch.attribute(tiny, clean="The city", corrupt="The park", answer=" Paris")
