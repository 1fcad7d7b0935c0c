"""The notebook experience in Notebook 7 (``jupyter notebook``) + Chromium, as in JupyterLab.

Notebook 7 is its own front end (its own page, shell and plugins) over JupyterLab's notebook
and output code, with the pipatch lab extension loaded the same way. One notebook on the
embedded model, run top to bottom:

1. ``%load_ext pipatch``
2. a ``%%trace`` (3 seeds): rows stream in, a click during the run gets the kernel's top-5;
   after the run the same grid stays live (another click, another answer; a seed switch)
   and its saved copy below it stays hidden;
3. a long ``%%trace`` (10 seeds, three kinds): Stop ends it ``stopped`` with the partial grid;

then the notebook is saved, the kernel shut down and the page reloaded: both grids are drawn
from their saved copies with the one-line hint, and no "Error displaying widget" is visible.
"""

from __future__ import annotations

import json
import re

import pytest

from .conftest import (
    cell_point,
    code_cell,
    grid_cell,
    live_grid,
    open_notebook7,
    run_cells,
    run_command,
    saved_copy,
    shot,
    wait_kernel_idle,
    wait_rows_streaming,
    wait_top5_for_layer,
)

pytestmark = pytest.mark.e2e

PROMPT = "The Eiffel Tower is in the city of"
OPTS = '--scale 3 --subject "Eiffel Tower" --answer " Paris"'
CELLS = [
    "%load_ext pipatch",
    f"%%trace --seeds 3 {OPTS} -o eiffel\n{PROMPT}",
    f"%%trace --seeds 10 --kind resid,mlp,attn {OPTS} -o long\n{PROMPT}",
    "print('STATUS', eiffel.status, long.status)",
]


def _top5(grid) -> list[str]:
    tokens = grid.locator("table.pipatch-top .pipatch-top-token")
    return [tokens.nth(i).text_content() for i in range(tokens.count())]


def test_notebook7_live_grid_clicks_stop_and_saved_copy(page, notebook_server):
    name = notebook_server.write_notebook("nb7.ipynb", [code_cell(src) for src in CELLS])
    open_notebook7(page, notebook_server, name)
    assert "/notebooks/" in page.url and page.locator("#jp-top-panel, .jp-NotebookPanel").count() >= 1
    run_cells(page, range(2))  # the rest once the first grid is done: the kernel is free for clicks

    # -- rows stream in; a click while running is answered by the kernel --------------------
    wait_rows_streaming(page, 1, timeout=300_000)
    running = live_grid(grid_cell(page, 1), "running")
    shot(page, "nb7-trace-running")
    page.mouse.click(*cell_point(running, 17, 3))  # the last layer's row: the first to finish
    running.locator("table.pipatch-top .pipatch-top-token").first.wait_for(timeout=120_000)
    assert len(_top5(running)) == 5
    assert running.get_attribute("data-status") == "running"  # answered mid-run (comm subshell)

    # -- after the run: the same grid, still live; its copy hidden -------------------------
    done = live_grid(grid_cell(page, 1), "done")
    done.wait_for(timeout=300_000)
    copy = saved_copy(grid_cell(page, 1))
    copy.wait_for(state="attached", timeout=60_000)
    assert not copy.is_visible()
    page.mouse.click(*cell_point(done, 15, 8))
    # The detail pane names the clicked cell and shows the kernel's answer for it.
    wait_top5_for_layer(page, done, 15)
    checksum = done.get_attribute("data-checksum")
    done.locator("select.pipatch-seed").select_option("1")
    page.wait_for_function("([g, c]) => g.getAttribute('data-checksum') !== c",
                           arg=[done.element_handle(), checksum], timeout=10_000)
    shot(page, "nb7-trace-done-live")

    # -- Stop on the long trace keeps the partial grid --------------------------------------
    run_cells(page, range(2, 4))
    wait_rows_streaming(page, 2, timeout=300_000)
    grid_cell(page, 2).locator("button.pipatch-stop").click()
    stopped = live_grid(grid_cell(page, 2), "stopped")
    stopped.wait_for(timeout=120_000)
    rows_done, total = map(int, re.search(r"(\d+) / (\d+) rows",
                                          stopped.locator(".pipatch-status").text_content()).groups())
    assert 1 <= rows_done < total == 54
    printed = grid_cell(page, 3).locator(".jp-RenderedText").filter(has_text="STATUS")
    printed.first.wait_for(timeout=120_000)
    assert printed.first.text_content().split()[:3] == ["STATUS", "done", "stopped"]
    wait_kernel_idle(page)

    # -- save, shut the kernel down, reload: the saved copies, with the hint ----------------
    run_command(page, "docmanager:save")
    page.wait_for_timeout(1000)
    saved = json.loads((notebook_server.root / name).read_text())
    for index in (1, 2):
        outputs = saved["cells"][index]["outputs"]
        docs = [o["data"]["application/vnd.pipatch.grid+json"] for o in outputs
                if "application/vnd.pipatch.grid+json" in o.get("data", {})]
        views = [o["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] for o in outputs
                 if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
        assert [d["live_id"] for d in docs] == views and len(views) == 1, (docs, views)
    for kernel in notebook_server.api("GET", "/api/kernels"):
        notebook_server.api("DELETE", f"/api/kernels/{kernel['id']}")
    page.reload()
    page.wait_for_selector(".pipatch-mime .pipatch-grid[data-status='stopped']", timeout=90_000)
    page.wait_for_selector(".pipatch-mime .pipatch-grid[data-status='done']")
    wait_kernel_idle(page, timeout=120_000)
    page.wait_for_timeout(2000)
    for index in (1, 2):
        hint = saved_copy(grid_cell(page, index)).locator(".pipatch-saved-hint")
        assert hint.is_visible() and "Run the cell again" in hint.text_content()
    errors = page.locator("text=Error displaying widget")
    assert all(not errors.nth(i).is_visible() for i in range(errors.count()))
    shot(page, "nb7-reloaded")
    # Notebook 7.6's own core throws one TypeError ("reading 'schema'") while loading settings,
    # on any notebook, pipatch or not; every other page error fails the test.
    others = [s for s in page.error_stacks if "/static/notebook/notebook_core." not in s]
    assert page.dialogs == [] and others == [], (page.dialogs, others)
