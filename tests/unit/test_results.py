"""Results: derived grids, files (safetensors + JSON header, never pickle), exports."""

from __future__ import annotations

import json

import torch

from pipatch._results.result import Result


def _small(**overrides) -> Result:
    raw = torch.tensor([[[0.0, 0.5], [1.0, 0.25]], [[0.0, 0.7], [1.0, 0.75]]])
    fields = dict(kind="trace", tokens=["a", "b"], columns=["a", "b"], layers=["0", "1"], metric="prob",
                  raw={"resid": raw}, clean=1.0, corrupt=torch.tensor([0.0, 0.5]), meta={"model": "m"})
    fields.update(overrides)
    return Result(**fields)


def test_recovery_mean_and_spread():
    r = _small()
    rec = r.recovery()
    # Ratios of exact small numbers in float32: allclose's default 1e-5 relative is a few ulps.
    assert torch.allclose(rec[0], torch.tensor([[0.0, 0.5], [1.0, 0.25]]))
    assert torch.allclose(rec[1], torch.tensor([[-1.0, 0.4], [1.0, 0.5]]))
    assert torch.allclose(r.grid, torch.tensor([[-0.5, 0.45], [1.0, 0.375]]))
    assert torch.allclose(r.std(), torch.tensor([[0.5, 0.05], [0.0, 0.125]]))


def test_a_vanishing_denominator_gives_nan_and_keeps_raw_values():
    r = _small(corrupt=torch.tensor([1.0, 1.0 - 1e-9]), clean=1.0)
    assert torch.isnan(r.grid).all()
    assert torch.isfinite(r.raw_mean()).all()
    assert "nan" not in json.dumps(r.to_json()).lower().replace("null", "")
