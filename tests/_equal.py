"""One result against another within a tolerance: what the backend suites assert."""

from __future__ import annotations

import torch

ATOL = 1e-4


def assert_close(got: torch.Tensor, want: torch.Tensor, atol: float = ATOL) -> None:
    assert got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    diff = float((got - want).nan_to_num().abs().max())
    assert diff <= atol, f"max |Δ| {diff:.3g} > {atol}"


def assert_same(got, want, atol: float = ATOL, backend: str = "vllm") -> None:
    """Two results of one experiment, ``got`` on ``backend`` and ``want`` on transformers: same
    axes, same raw values and grid within ``atol``."""
    assert got.status == want.status == "done"
    assert (got.kind, got.tokens, got.columns, got.layers, got.views) == (
        want.kind, want.tokens, want.columns, want.layers, want.views)
    assert_close(got._clean_rows(), want._clean_rows(), atol)
    assert_close(got.corrupt, want.corrupt, atol)
    for view in want.views:
        assert_close(got.raw[view], want.raw[view], atol)
        assert_close(got.mean(view), want.mean(view), atol)
    assert (got.meta.get("backend"), want.meta.get("backend")) == (backend, "transformers")


def assert_same_click(got_model, want_model, pair: dict) -> None:
    """A click (resid at " is", layer 6) shows the same top-5 tokens and probabilities (1e-5)."""
    import pytest

    from pipatch._api import plan_patch

    got = plan_patch(got_model, **pair, site="resid", positions=[4]).predictor()("resid", 6, 0, k=5)
    want = plan_patch(want_model, **pair, site="resid", positions=[4]).predictor()("resid", 6, 0, k=5)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [p for _, p in got] == pytest.approx([p for _, p in want], abs=1e-5)
