"""Every view of one result shows the same cell at the same place, in a real browser too.

A 4 × 5 result with recovery +1 in one cell, −1 in another and 0 elsewhere is shown as the
live widget (``PatchGrid(result)``) and as the saved renderer (the result's MIME bundle,
drawn by the lab extension without the kernel's help). The colour at the centre of every
cell of both canvases is read back and compared with the one colour map applied to the
state, and with the same cells of the PNG that ``Result.plot`` / the CLI / the bundle draw
(tests/unit/test_views.py checks the PNG, text and state half on its own).
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from .conftest import code_cell, grid_cell, open_notebook, run_all, shot

pytestmark = pytest.mark.e2e

HOT, COLD = (0, 1), (3, 4)
RESULT_SRC = f"""
import torch
from pipatch._notebook.live import PatchGrid
from pipatch._results.result import Result

raw = torch.zeros(2, 4, 5)
raw[:, {HOT[0]}, {HOT[1]}] = 1.0
raw[:, {COLD[0]}, {COLD[1]}] = -1.0
r = Result(kind="trace", tokens=[f"t{{i}}" for i in range(5)], columns=[f"t{{i}}" for i in range(5)],
           layers=[str(i) for i in range(4)], metric="prob", raw={{"resid": raw}}, clean=1.0,
           corrupt=torch.zeros(2), meta={{"model": "m"}}, rows_done={{"resid": 4}})
"""

READ_CELLS = """(grid) => {
    const canvas = grid.querySelector('canvas.pipatch-heatmap');
    const rows = +grid.getAttribute('data-rows'), cols = +grid.getAttribute('data-cols');
    const ctx = canvas.getContext('2d');
    const out = [];
    for (let r = 0; r < rows; r++) {
        const line = [];
        for (let c = 0; c < cols; c++) {
            const x = Math.floor((c + 0.5) * canvas.width / cols), y = Math.floor((r + 0.5) * canvas.height / rows);
            line.push(Array.from(ctx.getImageData(x, y, 1, 1).data.slice(0, 3)));
        }
        out.push(line);
    }
    return out;
}"""


def _expected():
    """The state's mean, the colours the one map gives it, and the PNG's cell colours."""
    import matplotlib.image
    import torch

    from pipatch._results.result import Result
    from pipatch._results.views import decode_array, diverging_rgb, figure, png
    from tests.unit.test_views import _cell_pixels

    raw = torch.zeros(2, 4, 5)
    raw[:, HOT[0], HOT[1]] = 1.0
    raw[:, COLD[0], COLD[1]] = -1.0
    r = Result(kind="trace", tokens=[f"t{i}" for i in range(5)], columns=[f"t{i}" for i in range(5)],
               layers=[str(i) for i in range(4)], metric="prob", raw={"resid": raw}, clean=1.0,
               corrupt=torch.zeros(2), meta={"model": "m"}, rows_done={"resid": 4})
    state = r.to_state()
    mean = decode_array(state["arrays"]["resid/mean"])
    colours = np.array([[diverging_rgb(float(v), 1.0) for v in row] for row in mean])
    fig = figure(state, dpi=80)
    fig.canvas.draw()
    png_cells = _cell_pixels(fig, matplotlib.image.imread(io.BytesIO(png(state, dpi=80))), 4, 5)
    text_rows = r.text().splitlines()[2:6]
    return mean, colours, png_cells, text_rows


def test_live_grid_saved_renderer_png_and_text_put_the_same_cell_in_the_same_place(page, lab_server):
    name = lab_server.write_notebook(
        "views.ipynb", [code_cell(RESULT_SRC), code_cell("PatchGrid(r)"), code_cell("r")])
    open_notebook(page, lab_server, name)
    run_all(page)
    live_grid = grid_cell(page, 1).locator(".pipatch-grid[data-status='done']")
    saved_grid = grid_cell(page, 2).locator(".pipatch-mime .pipatch-grid[data-status='done']")
    live_grid.wait_for(timeout=120_000)
    saved_grid.wait_for(timeout=120_000)
    assert grid_cell(page, 1).locator(".pipatch-mime").count() == 0  # cell 1 is the widget, cell 2 the document
    shot(page, "views-same-cell")
    live = np.array(live_grid.evaluate(READ_CELLS))
    saved = np.array(saved_grid.evaluate(READ_CELLS))
    mean, colours, png_cells, text_rows = _expected()
    assert mean[HOT] == 1.0 and mean[COLD] == -1.0
    # Both browser views: the exact colours of the one map, row 0 (layer 0) at the top.
    assert np.array_equal(live, colours), (live, colours)
    assert np.array_equal(saved, colours), (saved, colours)
    # The PNG: the same colours at the same places (matplotlib samples the map: ±3 per channel).
    assert np.abs(png_cells - colours).max() <= 3, (png_cells, colours)
    # The text grid: the hot cell's block in the first row, the hot column.
    assert "█" in text_rows[HOT[0]] and all("█" not in line for i, line in enumerate(text_rows) if i != HOT[0])
    assert page.console_errors == []
