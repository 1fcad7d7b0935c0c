"""A study's live view in a real JupyterLab + Chromium: facts stream in, a click draws one fact, Stop.

One notebook on the embedded model, ROME's shipped facts (the first 40 records: about ten the
model knows), the residual kind, one seed at a fixed scale:

1. ``pipatch.study(..., show=True)``: the aggregate grid's status line counts facts done as
   they finish (``running: 1 done ...`` then ``2 done``), with facts per minute and time left;
2. choosing a fact in the fact list draws that fact's own grid (its causal trace's title and
   tokens), and the list's first entry brings the average back;
3. Stop ends the study ``stopped`` with the finished facts kept (a later cell reads the store:
   some done, some pending);

then the notebook is saved, the kernel shut down and the page reloaded: the aggregate is drawn
from its saved copy, without a kernel.
"""

from __future__ import annotations

import json
import re

import pytest

from .conftest import (
    code_cell,
    grid_cell,
    live_grid,
    open_notebook,
    run_cells,
    run_command,
    saved_copy,
    shot,
    wait_kernel_idle,
)

pytestmark = pytest.mark.e2e

CELLS = [
    "import json\nimport pipatch\nmodel = pipatch.load_model()\nfacts = json.loads(pipatch.known_facts().read_text())",
    "known = pipatch.study(model, facts[:40], store='study.sqlite', show=True, sites='resid', seeds=1, scale=3.0)",
    "counts = pipatch.load_study('study.sqlite').counts()\nprint('COUNTS', counts['done'], counts['pending'])",
]


def _status(page, cell: int, pattern: str, timeout: float) -> str:
    """Wait until the live grid of ``cell`` has a status line matching ``pattern``; return it."""
    handle = page.wait_for_function(
        """([i, pattern]) => {
            const cell = document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell')[i];
            const g = cell && cell.querySelector('.pipatch-grid');
            if (!g || g.closest('.pipatch-mime')) return false;
            const st = g.querySelector('.pipatch-status');
            const text = st ? st.textContent || '' : '';
            return new RegExp(pattern).test(text) ? text : false;
        }""",
        arg=[cell, pattern], timeout=timeout)
    return handle.json_value()


def test_study_view_streams_facts_draws_one_on_a_click_stops_and_renders_saved(page, lab_server):
    name = lab_server.write_notebook("study.ipynb", [code_cell(src) for src in CELLS])
    open_notebook(page, lab_server, name)
    run_cells(page, range(2))

    # -- facts stream into the aggregate ---------------------------------------------------
    first = _status(page, 1, r"^running: 1 done · \d+ known · 40 total", timeout=300_000)
    second = _status(page, 1, r"^running: [2-9] done · ", timeout=180_000)
    assert "facts/min" in second and first != second
    grid = live_grid(grid_cell(page, 1))
    assert "mean over" in grid.locator(".pipatch-title").text_content()
    shot(page, "study-running")

    # -- a click on a fact draws its own grid; the first entry brings the average back ------
    facts = grid_cell(page, 1).locator(".widget-select select")
    options = facts.locator("option").all_text_contents()  # ipywidgets draws spaces as no-break spaces
    labels = [t.replace("\xa0", " ").strip() for t in options]
    assert labels[0].startswith("average") and labels[1].startswith("fact ")
    facts.select_option(label=options[1])
    page.wait_for_function("(g) => g.querySelector('.pipatch-title').textContent.startsWith('Causal trace')",
                           arg=grid.element_handle(), timeout=60_000)
    subject = labels[1].split(": ", 1)[1]
    assert subject in grid.locator(".pipatch-title").text_content()
    shot(page, "study-one-fact")
    facts.select_option(label=options[0])
    page.wait_for_function("(g) => g.querySelector('.pipatch-title').textContent.includes('mean over')",
                           arg=grid.element_handle(), timeout=60_000)

    # -- Stop keeps what finished -------------------------------------------------------------
    grid_cell(page, 1).locator("button.pipatch-stop").click()
    stopped = live_grid(grid_cell(page, 1), "stopped")
    stopped.wait_for(timeout=180_000)
    status = stopped.locator(".pipatch-status").text_content()
    assert status.startswith("stopped") and "run again to resume" in status
    done = int(re.search(r"(\d+) done", status).group(1))
    assert done >= 2
    saved_copy(grid_cell(page, 1)).wait_for(state="attached", timeout=60_000)
    run_cells(page, [2])
    printed = grid_cell(page, 2).locator(".jp-RenderedText").filter(has_text="COUNTS")
    printed.first.wait_for(timeout=60_000)
    _, stored, pending = printed.first.text_content().split()[:3]
    assert int(stored) == done and int(pending) > 0
    shot(page, "study-stopped")
    wait_kernel_idle(page)

    # -- save, shut the kernel down, reload: the aggregate renders from its saved copy --------
    run_command(page, "docmanager:save")
    page.wait_for_timeout(1000)
    saved = json.loads((lab_server.root / name).read_text())
    kinds = [sorted(o.get("data", {})) for o in saved["cells"][1]["outputs"]]
    assert ["application/vnd.pipatch.grid+json", "image/png", "text/plain"] in kinds, kinds
    for kernel in lab_server.api("GET", "/api/kernels"):
        lab_server.api("DELETE", f"/api/kernels/{kernel['id']}")
    page.reload()
    page.wait_for_selector(".pipatch-mime .pipatch-grid[data-status='stopped']", timeout=90_000)
    copy = saved_copy(grid_cell(page, 1))
    assert copy.is_visible() and "mean over" in copy.locator(".pipatch-title").text_content()
    # The dead view (the grid and the fact list) above the copy says nothing once the page has
    # settled: neither "Loading widget..." nor "Error displaying widget".
    wait_kernel_idle(page)
    page.wait_for_timeout(2000)
    for text in ("Loading widget", "Error displaying widget"):
        dead = grid_cell(page, 1).locator(f"text={text}")
        assert all(not dead.nth(i).is_visible() for i in range(dead.count())), text
    shot(page, "study-reloaded")
