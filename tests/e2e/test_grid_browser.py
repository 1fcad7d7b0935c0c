"""PatchGrid in a real JupyterLab + Chromium, fed by hand-made states (no model)."""

from __future__ import annotations

import json

import pytest

from .conftest import (
    cell_point,
    code_cell,
    grid_cell,
    hover_text,
    live_grid,
    open_notebook,
    run_all,
    run_command,
    saved_copy,
    shot,
    wait_kernel_idle,
)
from .fake_state import FAKE_STATE_SRC

pytestmark = pytest.mark.e2e

GRID = ".jp-OutputArea-output .pipatch-grid"


def _hover_cell(page, grid, row: int, col: int) -> None:
    page.mouse.move(*cell_point(page.locator(grid).first, row, col))  # scrolled into view first


def test_widget_grid_hover_and_text_only_labels(page, lab_server):
    name = lab_server.write_notebook(
        "widget.ipynb",
        [code_cell(FAKE_STATE_SRC), code_cell("w = PatchGrid.from_state(fake_state())\nw")],
    )
    open_notebook(page, lab_server, name)
    run_all(page)
    page.wait_for_selector(f"{GRID}[data-status='done']")
    grid = page.locator(GRID).first
    assert grid.get_attribute("data-rows") == "6"
    assert grid.get_attribute("data-cols") == "7"
    # Token text is text: no <img> created from the label, no alert fired.
    labels = grid.locator(".pipatch-collabel")
    assert labels.first.text_content().startswith("<img src")
    assert labels.first.get_attribute("title") == "<img src=x onerror=alert(1)>"
    assert page.locator(".jp-OutputArea img[src='x']").count() == 0
    assert grid.locator("img, b, i, script").count() == 0
    titles = [labels.nth(i).get_attribute("title") for i in range(labels.count())]
    assert "⟨U+202E⟩evil" in titles and "a⟨U+0000⟩b" in titles
    assert any(t.endswith("…") and len(t) <= 400 for t in titles)  # the 10,000-char token
    assert grid.locator(".pipatch-title").text_content() == "fake trace <b>bold?</b>"
    # Hover shows layer, token, value ± std and the raw metric.
    _hover_cell(page, GRID, 1, 1)
    tip = grid.locator(".pipatch-tooltip")
    tip.wait_for(state="visible")
    text = tip.text_content()
    assert "layer: 1" in text and "Eiffel" in text and "recovery:" in text and "±" in text
    assert "raw p( Paris)" in text
    shot(page, "widget-hover")
    # NaN cell and long-label tooltip.
    _hover_cell(page, GRID, 0, 0)
    assert "NaN" in tip.text_content()
    # Switching view writes the trait back to the kernel.
    grid.locator("select.pipatch-view").select_option("mlp")
    page.wait_for_timeout(300)
    assert page.dialogs == []
    assert page.console_errors == []


def _cell_pixel(grid, row: int, col: int) -> list[int]:
    """The heatmap canvas's colour at the centre of cell ``(row, col)``."""
    return grid.locator("canvas.pipatch-heatmap").evaluate(
        """(c, [row, col]) => {
            const g = c.closest('.pipatch-grid');
            const rows = +g.getAttribute('data-rows'), cols = +g.getAttribute('data-cols');
            const x = Math.floor((col + 0.5) * c.width / cols), y = Math.floor((row + 0.5) * c.height / rows);
            return Array.from(c.getContext('2d').getImageData(x, y, 1, 1).data.slice(0, 3));
        }""",
        [row, col],
    )


def test_rows_that_run_from_the_last_layer_up_fill_the_grid_from_the_bottom(page, lab_server):
    """A running state whose rows run from the last layer (``row_order`` -1): the two finished
    rows are the bottom two, drawn as in a finished grid of the same values; the rows above are
    pending (hatched, not drawn as the NaN the finished grid holds there)."""
    name = lab_server.write_notebook("order.ipynb", [
        code_cell(FAKE_STATE_SRC),
        code_cell("PatchGrid.from_state({**fake_state(status='running', done=2), 'row_order': {'resid': -1}})"),
        # The same values, finished, with rows 0-3 NaN: the same colour scale as the running grid's.
        code_cell("s = fake_state()\nfor a in s['arrays'].values():\n    a[..., :4, :] = np.nan\nPatchGrid.from_state(s)"),
    ])
    open_notebook(page, lab_server, name)
    run_all(page)
    running = grid_cell(page, 1).locator(".pipatch-grid[data-status='running']").first
    done = grid_cell(page, 2).locator(".pipatch-grid[data-status='done']").first
    running.wait_for()
    done.wait_for()
    assert running.get_attribute("data-rows-done") == "2"
    for row in (4, 5):
        assert "recovery:" in hover_text(page, running, row, 2)
        assert _cell_pixel(running, row, 2) == _cell_pixel(done, row, 2)
    for row in (0, 3):
        assert "pending" in hover_text(page, running, row, 2)
        assert _cell_pixel(running, row, 2) != _cell_pixel(done, row, 2)
    assert "2 / 12 rows" in running.locator(".pipatch-status").text_content()
    shot(page, "widget-rows-from-the-last-layer")
    assert page.console_errors == []


def test_stop_button_reaches_a_running_cell(page, lab_server):
    """The Stop click (a comm message) is handled while another cell is still executing."""
    name = lab_server.write_notebook(
        "stop.ipynb",
        [
            code_cell(FAKE_STATE_SRC),
            code_cell(
                "import threading\n"
                "flag = threading.Event()\n"
                "w = PatchGrid.from_state(fake_state(done=2, status='running'))\n"
                "w.on_stop(flag.set)\n"
                "w"
            ),
            code_cell(
                "import time\n"
                "for i in range(600):\n"
                "    if flag.is_set():\n"
                "        break\n"
                "    time.sleep(0.1)\n"
                "w.update_state({'status': 'stopped', 'stoppable': False})\n"
                "print('STOPPED' if flag.is_set() else 'TIMEOUT', i)"
            ),
        ],
    )
    open_notebook(page, lab_server, name)
    run_all(page)
    stop = page.locator(f"{GRID} button.pipatch-stop")
    stop.wait_for(state="visible")
    page.wait_for_timeout(1500)  # the loop cell is now executing
    # The loop cell is still executing (its prompt shows [*]). kernel.status is no proof:
    # with subshells, the comm handling publishes busy/idle of its own.
    prompt = page.locator(".jp-NotebookPanel .jp-CodeCell").nth(2).locator(".jp-InputPrompt")
    assert "*" in prompt.text_content()
    stop.click()
    out = page.locator(".jp-RenderedText[data-mime-type='application/vnd.jupyter.stdout']").filter(
        has_text="STOPPED"
    )
    out.first.wait_for(timeout=30_000)
    loops = int(out.first.text_content().split()[-1])
    assert loops < 590  # the flag arrived while the loop was running, not after it
    page.wait_for_selector(f"{GRID}[data-status='stopped']")
    assert page.locator(f"{GRID} button.pipatch-stop").is_hidden()
    shot(page, "stop-button")


def test_final_bundle_survives_save_shutdown_reload(page, lab_server):
    name = lab_server.write_notebook(
        "saved.ipynb",
        [
            code_cell(FAKE_STATE_SRC),
            code_cell(
                "w = PatchGrid.from_state(fake_state(done=0, status='running'))\n"
                "h = w.display()\n"
                "for r in range(1, 7):\n"
                "    w.push({'rows_done': {'resid': r, 'mlp': r}, 'elapsed': r * 0.1})\n"
                "w.display_final(h, {'status': 'done', 'stoppable': False, 'eta': -1}, keep=True)\n"
                "None"
            ),
        ],
    )
    open_notebook(page, lab_server, name)
    run_all(page)
    # The widget stays live; its saved copy is the next output, hidden while the widget lives.
    live_grid(grid_cell(page, 1), "done").wait_for(timeout=60_000)
    copy = saved_copy(grid_cell(page, 1))
    copy.wait_for(state="attached", timeout=60_000)
    wait_kernel_idle(page)
    assert not copy.is_visible()
    run_command(page, "docmanager:save")
    page.wait_for_timeout(1000)
    saved = json.loads((lab_server.root / name).read_text())
    outputs = saved["cells"][1]["outputs"]
    kinds = [sorted(o.get("data", {})) for o in outputs]
    assert kinds[-1] == ["application/vnd.pipatch.grid+json", "image/png", "text/plain"], kinds
    assert any("application/vnd.jupyter.widget-view+json" in k for k in kinds[:-1]), kinds
    # Shut the kernel down, reload: the grid is drawn from the saved document alone, with its
    # one-line hint; the dead widget output above it says nothing.
    for k in lab_server.api("GET", "/api/kernels"):
        lab_server.api("DELETE", f"/api/kernels/{k['id']}")
    page.reload()
    page.wait_for_selector(".pipatch-mime .pipatch-grid[data-status='done']", timeout=90_000)
    wait_kernel_idle(page)
    page.wait_for_timeout(2000)
    assert saved_copy(grid_cell(page, 1)).locator(".pipatch-saved-hint").is_visible()
    errors = page.locator("text=Error displaying widget")
    assert all(not errors.nth(i).is_visible() for i in range(errors.count()))
    grid = page.locator(".pipatch-mime .pipatch-grid").first
    grid.locator("select.pipatch-view").select_option("mlp")
    grid.locator("select.pipatch-seed").select_option("1")
    grid.locator("select.pipatch-mode").select_option("raw")
    _hover_cell(page, ".pipatch-mime .pipatch-grid", 2, 3)
    tip = grid.locator(".pipatch-tooltip")
    tip.wait_for(state="visible")
    assert "seed 1" in tip.text_content()
    shot(page, "saved-reloaded")
    assert page.dialogs == []


def test_mime_renderer_without_kernel(page, lab_server):
    """A notebook written on disk with only the saved bundle renders with no kernel at all."""
    import base64
    import runpy
    import tempfile
    from pathlib import Path

    from pipatch._results.views import mime_bundle

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "fs.py"
        p.write_text(FAKE_STATE_SRC)
        fake_state = runpy.run_path(str(p))["fake_state"]
    bundle = mime_bundle(fake_state(n_layers=40, n_tokens=300))
    assert base64.b64decode(bundle["image/png"])[:4] == b"\x89PNG"
    output = {"output_type": "display_data", "data": bundle, "metadata": {}}
    nb = lab_server.write_notebook("mime_only.ipynb", [code_cell("# saved", outputs=[output])])
    open_notebook(page, lab_server, nb)
    page.wait_for_selector(".pipatch-mime .pipatch-grid[data-status='done']")
    grid = page.locator(".pipatch-mime .pipatch-grid").first
    assert grid.get_attribute("data-cols") == "300"
    assert page.locator(".jp-OutputArea img[src='x']").count() == 0
    shot(page, "mime-only")


SHORT_SRC = """
import torch
from pipatch._notebook.live import PatchGrid
from pipatch._results.result import Result

r = Result(kind="trace", tokens=["The", " Eiffel", " Tower", " is", " in"], columns=["The", " Eiffel", " Tower", " is", " in"],
           layers=["0", "1", "2"], metric="prob", raw={"resid": torch.rand(2, 3, 5)}, clean=1.0,
           corrupt=torch.zeros(2), meta={"model": "m", "seeds": 2}, rows_done={"resid": 3})
"""

INSIDE = """([tip, grid]) => {
    const t = tip.getBoundingClientRect(), g = grid.getBoundingClientRect();
    const clip = grid.closest('.jp-OutputArea-output').getBoundingClientRect();
    const within = (a, b) => a.top >= b.top - 0.5 && a.bottom <= b.bottom + 0.5 && a.left >= b.left - 0.5 && a.right <= b.right + 0.5;
    return {inGrid: within(t, g), inOutput: within(t, clip), height: t.height, gridHeight: g.height};
}"""


def test_the_tooltip_of_a_grid_of_three_rows_stays_inside_the_widget(page, lab_server):
    """A grid of three rows is shorter than the room its tooltip takes below the pointer: the
    tooltip stays inside the widget (and so inside the output area, which clips what passes its
    edges), on every row, in the live grid and in its saved copy."""
    name = lab_server.write_notebook("short.ipynb", [code_cell(SHORT_SRC), code_cell("PatchGrid(r)"), code_cell("r")])
    open_notebook(page, lab_server, name)
    run_all(page)
    live, saved = (grid_cell(page, i).locator(".pipatch-grid[data-status='done']") for i in (1, 2))
    live.wait_for(timeout=120_000)
    saved.wait_for(timeout=120_000)
    assert grid_cell(page, 2).locator(".pipatch-mime").count() == 1  # cell 2 is the document's renderer
    for grid in (live, saved):
        assert grid.get_attribute("data-rows") == "3"
        for row in range(3):
            text = hover_text(page, grid, row, 4)
            assert f"layer: {row}" in text
            where = page.evaluate(INSIDE, [grid.locator(".pipatch-tooltip").element_handle(), grid.element_handle()])
            assert where["inGrid"] and where["inOutput"], (row, where)
    shot(page, "short-grid-hover")
    assert page.console_errors == []
