"""%%trace on the embedded model in a real JupyterLab + Chromium: live rows, hover, clicks, Stop.

One notebook, run top to bottom (the model loads once):

1. ``%load_ext pipatch``
2. a short ``%%trace`` (8 seeds): the grid shows rows before the run ends, hover shows a
   value, a click during the run gets the patched run's top-5 from the kernel; after the run
   the same grid stays live (a click on another cell is answered, a view switch redraws) and
   its saved copy below it stays hidden;
3. a long ``%%trace`` (10 seeds, three kinds) on a prompt holding ``<img src=x onerror=...>``:
   Stop ends it ``stopped`` with the partial grid, and the token text stays text;
4. ``PatchGrid(eiffel)``: a click on a finished result is answered too;

then the notebook is saved, the kernel shut down and the page reloaded: both grids are drawn
from their saved copies, each with its one-line hint, with no "Error displaying widget" in
sight (the dead widget outputs are still in the file, hidden by their copies).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from .conftest import (
    cell_point,
    code_cell,
    grid_cell,
    live_grid,
    open_notebook,
    run_cells,
    run_command,
    saved_copy,
    shot,
    wait_kernel_idle,
    wait_rows_streaming,
    wait_top5_for_layer,
)

pytestmark = pytest.mark.e2e

XSS = "<img src=x onerror=alert(1)>"
PROMPT = "The Eiffel Tower is in the city of"
CELLS = [
    "%load_ext pipatch",
    # 8 seeds: long enough (about 10 s here) that a click is answered before the run ends.
    f'%%trace --seeds 8 --scale 3 --subject "Eiffel Tower" --answer " Paris" -o eiffel\n{PROMPT}',
    '%%trace --seeds 10 --scale 3 --kind resid,mlp,attn --subject "Eiffel Tower" --answer " Paris" -o long\n'
    f"{XSS} {PROMPT}",
    "from pipatch import PatchGrid\nPatchGrid(eiffel)",
    "print('STATUS', eiffel.status, long.status, sum(long.rows_done.values()))",
    f'%%trace --subject "Colosseum" --answer " Paris" -o eiffel\n{PROMPT}',  # a bad cell, last
]


def test_trace_magic_live_grid_stop_and_saved_notebook(page, lab_server, tmp_path):
    name = lab_server.write_notebook("magics.ipynb", [code_cell(src) for src in CELLS])
    open_notebook(page, lab_server, name)
    run_cells(page, range(2))  # the rest once the first grid is done: the kernel is free for clicks

    # -- the short trace: rows stream in, hover, click → top-5 during the run ------------
    wait_rows_streaming(page, 1, timeout=180_000)
    live = grid_cell(page, 1).locator(".pipatch-grid[data-status='running']").first
    shot(page, "magic-trace-running")
    x, y = cell_point(live, 17, 3)  # the last layer's row: rows run from the last layer down
    page.mouse.move(x, y)
    tip = live.locator(".pipatch-tooltip")
    tip.wait_for(state="visible")
    assert "recovery:" in tip.text_content() and "layer" in tip.text_content()
    page.mouse.click(x, y)
    top = live.locator("table.pipatch-top .pipatch-top-token")
    top.first.wait_for(timeout=120_000)  # answered by the kernel between two rows
    assert top.count() == 5
    assert live.get_attribute("data-status") == "running"
    shot(page, "magic-trace-top5")
    # At the end the same grid stays live; its saved copy is added below it, hidden.
    done = live_grid(grid_cell(page, 1), "done")
    done.wait_for(timeout=240_000)
    assert done.get_attribute("data-rows-done") == done.get_attribute("data-rows") == "18"
    copy = saved_copy(grid_cell(page, 1))
    copy.wait_for(state="attached", timeout=60_000)
    assert copy.locator(".pipatch-grid").get_attribute("data-status") == "done"
    assert not copy.is_visible()
    page.mouse.click(*cell_point(done, 15, 8))  # last position, late layer: another answer
    # The detail pane names the clicked cell and shows the kernel's answer for it.
    wait_top5_for_layer(page, done, 15)
    assert "live kernel" not in done.locator(".pipatch-detail").text_content()
    before = done.get_attribute("data-checksum")
    done.locator("select.pipatch-seed").select_option("0")  # seed 0 of 2: another grid drawn
    page.wait_for_function("([g, b]) => g.getAttribute('data-checksum') !== b",
                           arg=[done.element_handle(), before], timeout=10_000)
    shot(page, "magic-trace-done-still-live")

    # -- the long trace: Stop keeps the partial grid; tokens are text ---------------------
    run_cells(page, range(2, 6))
    wait_rows_streaming(page, 2, timeout=180_000)
    stop = grid_cell(page, 2).locator("button.pipatch-stop")
    stop.click()
    stopped = live_grid(grid_cell(page, 2), "stopped")
    stopped.wait_for(timeout=120_000)
    saved_copy(grid_cell(page, 2)).wait_for(state="attached", timeout=60_000)
    assert not saved_copy(grid_cell(page, 2)).is_visible()
    status = stopped.locator(".pipatch-status").text_content()
    assert status.startswith("stopped")
    rows_done, total = map(int, re.search(r"(\d+) / (\d+) rows", status).groups())
    assert 1 <= rows_done < total == 54
    labels = [stopped.locator(".pipatch-collabel").nth(i).get_attribute("title")
              for i in range(stopped.locator(".pipatch-collabel").count())]
    assert "<" in "".join(labels) and "img" in "".join(labels)  # the prompt's tokens, as text
    assert page.locator("img[src='x']").count() == 0
    assert page.dialogs == []
    shot(page, "magic-trace-stopped")

    # -- PatchGrid(result) after the run answers a click ----------------------------------
    again = grid_cell(page, 3).locator(".pipatch-grid[data-status='done']").first
    again.wait_for(timeout=120_000)
    page.mouse.click(*cell_point(again, 2, 4))
    again.locator("table.pipatch-top .pipatch-top-token").first.wait_for(timeout=60_000)
    assert again.locator("table.pipatch-top .pipatch-top-token").count() == 5
    printed = grid_cell(page, 4).locator(".jp-RenderedText").filter(has_text="STATUS")
    printed.first.wait_for(timeout=60_000)
    assert printed.first.text_content().split()[:3] == ["STATUS", "done", "stopped"]
    # -- a bad cell: one error line, no traceback, the "preparing" line cleared ---------------
    bad = grid_cell(page, 5).locator(".jp-OutputArea-output")
    bad.filter(has_text="UsageError").first.wait_for(timeout=60_000)
    text = grid_cell(page, 5).locator(".jp-OutputArea").inner_text().strip()
    assert len(text.splitlines()) == 1 and "Colosseum" in text and "Traceback" not in text, text
    wait_kernel_idle(page)

    # -- save, shut the kernel down, reload ------------------------------------------------
    # A live widget needs its kernel; the magics' outputs do not. Clear the PatchGrid cell.
    page.evaluate("() => { window.jupyterapp.shell.currentWidget.content.activeCellIndex = 3; }")
    run_command(page, "notebook:clear-cell-output")
    run_command(page, "docmanager:save")
    page.wait_for_timeout(1000)
    saved = json.loads((lab_server.root / name).read_text())
    for index in (1, 2):
        kinds = [sorted(o.get("data", {})) for o in saved["cells"][index]["outputs"]]
        assert ["application/vnd.pipatch.grid+json", "image/png", "text/plain"] in kinds, kinds
        copy_doc = next(o["data"]["application/vnd.pipatch.grid+json"] for o in saved["cells"][index]["outputs"]
                        if "application/vnd.pipatch.grid+json" in o.get("data", {}))
        widget = [o["data"]["application/vnd.jupyter.widget-view+json"] for o in saved["cells"][index]["outputs"]
                  if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
        assert [w["model_id"] for w in widget] == [copy_doc["live_id"]], (widget, copy_doc["live_id"])
    # nbconvert's HTML of the saved file: each grid as its copy's PNG, no dead widget.
    subprocess.run([sys.executable, "-m", "nbconvert", "--to", "html", str(lab_server.root / name),
                    "--output-dir", str(tmp_path)], check=True, capture_output=True, timeout=120)
    html = (tmp_path / name.replace(".ipynb", ".html")).read_text("utf-8")
    assert html.count('src="data:image/png;base64,') == 2, html.count("data:image/png")
    assert "Error displaying widget" not in html
    for kernel in lab_server.api("GET", "/api/kernels"):
        lab_server.api("DELETE", f"/api/kernels/{kernel['id']}")
    page.reload()
    page.wait_for_selector(".pipatch-mime .pipatch-grid[data-status='stopped']", timeout=90_000)
    page.wait_for_selector(".pipatch-mime .pipatch-grid[data-status='done']")
    wait_kernel_idle(page)  # the new kernel is up: the widget manager has looked for the models
    page.wait_for_timeout(2000)
    for index in (1, 2):
        copy = saved_copy(grid_cell(page, index))
        assert copy.is_visible()
        hint = copy.locator(".pipatch-saved-hint")
        assert hint.is_visible() and "Run the cell again" in hint.text_content()
    errors = page.locator("text=Error displaying widget")
    assert all(not errors.nth(i).is_visible() for i in range(errors.count()))
    assert page.locator("img[src='x']").count() == 0
    shot(page, "magic-trace-reloaded")
    assert page.dialogs == []
