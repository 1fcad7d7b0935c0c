"""The engine's row stream: rows in order, stop between batches, partial results kept."""

from __future__ import annotations

import threading

import torch

import pipatch
from tests.conftest import COLOSSEUM, EIFFEL


def test_rows_arrive_in_order_while_the_sweep_runs(model):
    seen = []

    def on_row(result, view, layer):
        # The row just finished is filled, the next one not yet.
        seen.append((view, layer, result.status))
        assert torch.isfinite(result.raw[view][:, layer]).all()
        if layer + 1 < 18:
            assert torch.isnan(result.raw[view][:, layer + 1]).any()

    r = pipatch.patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome", on_row=on_row)
    assert seen == [("resid", layer, "running") for layer in range(18)]
    assert r.status == "done" and r.rows_done == {"resid": 18}


def test_stop_keeps_the_finished_rows(model):
    stop = threading.Event()

    def on_row(result, view, layer):
        if layer == 2:
            stop.set()

    r = pipatch.patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome", on_row=on_row,
                      stop=stop, batch_size=4)
    assert r.status == "stopped" and r.rows_done["resid"] == 3
    assert torch.isfinite(r.raw["resid"][:, :3]).all()
    assert torch.isnan(r.raw["resid"][:, 4:]).all()
