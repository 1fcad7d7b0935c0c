"""A comparison (``pipatch.compare``) in a real JupyterLab + Chromium: the a / b / a − b toggle
redraws the cells, the tooltip shows all three values, in the live widget and in the saved
renderer alike.

Two 3 × 4 results whose recovery is known exactly are compared; for each mode the colour at
the centre of every cell is read back from the canvas and checked against the one colour map
applied to the values the kernel sent: a − b on ±max|a − b|, the sides on ±max over both.
"""

from __future__ import annotations

import numpy as np
import pytest

from .conftest import code_cell, grid_cell, hover_text, live_grid, open_notebook, run_all, shot
from .test_views_browser import READ_CELLS

pytestmark = pytest.mark.e2e

A = [[0.9, 0.1, 0.5, 0.0], [0.2, 0.0, 0.7, 1.0], [0.3, 0.3, 0.3, 0.3]]
B = [[0.5, 0.3, 0.5, 0.0], [0.6, -0.1, 0.7, 0.2], [0.3, 0.1, 0.4, 0.3]]
SOURCE = f"""
import torch
import pipatch
from pipatch._notebook.live import PatchGrid
from pipatch._results.result import Result

def side(values, model):
    raw = torch.tensor(values).unsqueeze(0)  # one seed; clean 1, corrupt 0: recovery = raw
    return Result(kind="trace", tokens=list("wxyz"), columns=list("wxyz"), layers=["0", "1", "2"],
                  metric="prob", raw={{"resid": raw}}, clean=1.0, corrupt=torch.zeros(1),
                  meta={{"model": model, "dtype": "float32", "prompt": "<b>wxyz</b>"}}, rows_done={{"resid": 3}})

c = pipatch.compare(side({A}, "m-a"), side({B}, "m-b"))
"""


def _expected(mode: str) -> np.ndarray:
    from pipatch._results.views import diverging_rgb

    a, b = np.array(A, dtype=np.float32), np.array(B, dtype=np.float32)
    values = {"diff": a - b, "a": a, "b": b}[mode]
    vmax = float(np.abs(values if mode == "diff" else np.concatenate([a, b])).max())
    return np.array([[diverging_rgb(float(v), vmax) for v in row] for row in values])



def test_the_toggle_redraws_a_b_and_a_minus_b_and_the_tooltip_shows_both_values(page, lab_server):
    name = lab_server.write_notebook("compare.ipynb", [code_cell(SOURCE), code_cell("PatchGrid(c)"), code_cell("c")])
    open_notebook(page, lab_server, name)
    run_all(page)
    grids = {
        "live": live_grid(grid_cell(page, 1), "done"),
        "saved": grid_cell(page, 2).locator(".pipatch-mime .pipatch-grid[data-status='done']"),
    }
    for grid in grids.values():
        grid.wait_for(timeout=120_000)
    for which, grid in grids.items():
        select = grid.locator("select.pipatch-mode")
        assert select.locator("option").evaluate_all("(os) => os.map((o) => o.value)") == ["diff", "a", "b"], which
        sides = grid.locator(".pipatch-side").all_text_contents()
        assert sides[0].startswith("a: m-a float32 · '<b>wxyz</b>'") and sides[1].startswith("b: m-b"), sides
        drawn = {}
        for mode in ("diff", "a", "b"):
            select.select_option(mode)
            drawn[mode] = np.array(grid.evaluate(READ_CELLS))
            assert np.array_equal(drawn[mode], _expected(mode)), (which, mode, drawn[mode], _expected(mode))
        assert not np.array_equal(drawn["a"], drawn["b"]) and not np.array_equal(drawn["a"], drawn["diff"])
        # Equal cells are the white centre in a − b; b higher is blue, a higher red.
        assert tuple(drawn["diff"][0][2]) == (247, 247, 247)
        assert drawn["diff"][1][0][2] > drawn["diff"][1][0][0] and drawn["diff"][0][0][0] > drawn["diff"][0][0][2]
        tip = hover_text(page, grid, 1, 0)
        assert "a − b: -0.400 (normalized recovery)" in tip and "a: 0.200" in tip and "b: 0.600" in tip, tip
        shot(page, f"compare-{which}")
    assert page.console_errors == []
