"""%%attribute, %%path_patch and a %%patch dataset in a real JupyterLab + Chromium.

One notebook, run top to bottom on the embedded model (it loads once):

1. ``%load_ext pipatch``
2. ``%%path_patch`` sweeping every sender head (18 layers × 4 heads), a row per trace: rows
   stream in, a click during the run gets the patched run's top-5 from the kernel;
3. ``%%attribute --site head --verify 5``: the estimate grid shows at once, the status stays
   ``running`` while the verification patches run row by row, then ``done`` with the five
   verified cells marked ("verified by a real patch" in their tooltip);
4. ``%%patch`` on two clean/corrupt pairs (a dataset, columns are named positions): rows
   stream in, a click during the run gets a top-5;
5. ``PatchGrid(attr)``: a click on the finished attribution gets the real patched run's top-5,
   and its verified cells are marked there too;
6. a print of every bound result: kind, status, shape, verified cells.

The path cell runs first: a grid stays live (clickable) after its run once the kernel has
heard from a view of any grid, and the click during the path run proves it has, so the
attribution's own grid, which the test clicks after its run, stays live however fast that
run ends.

A MutationObserver installed before the run records every status / rows-done change of every
grid, so a state that lasts only a moment (attribution's verification) is still seen.
"""

from __future__ import annotations

import pytest

from .conftest import (
    cell_point,
    code_cell,
    grid_cell,
    hover_text,
    live_grid,
    open_notebook,
    run_all,
    shot,
    wait_kernel_idle,
    wait_rows_streaming,
)

pytestmark = pytest.mark.e2e

PAIR = "clean: The Eiffel Tower is in the city of\ncorrupt: The Colosseum is in the city of"
PAIR2 = "clean: The Louvre is in the city of\ncorrupt: The Vatican is in the city of"
OPTS = '--answer " Paris" --foil " Rome"'
CELLS = [
    "%load_ext pipatch",
    # Traces of at most 4 cells (one row of 4 heads): 18 runs, so a click lands mid-run
    # however fast the sweep (the whole grid takes about 0.7 s in larger traces).
    f"%%path_patch {OPTS} --batch-size 4 -o paths\n{PAIR}",
    f"%%attribute {OPTS} --site head --verify 5 -o attr\n{PAIR}",
    f"%%patch {OPTS} -o ds\n{PAIR}\n{PAIR2}",
    "from pipatch import PatchGrid\nPatchGrid(attr)",
    "for r in (paths, attr, ds):\n"
    "    print('BOUND', r.kind, r.status, *r.raw[r.views[0]].shape)\n"
    "print('VERIFIED', *[f\"{v['layer']},{v['col']}\" for v in attr.meta['verified_values']])\n"
    "print('COLUMNS', *[c.replace(' ', '_') for c in ds.columns])",
]
PATH, ATTR, DATASET, AGAIN, PRINT = 1, 2, 3, 4, 5

# Every change of a grid's data-status / data-rows-done, per notebook cell, in order.
OBSERVE = """() => {
    window.__pp = {};
    const cells = () => Array.from(document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell'));
    const record = (g) => {
        const i = cells().indexOf(g.closest('.jp-CodeCell'));
        if (i < 0) return;
        const st = g.querySelector('.pipatch-status');
        (window.__pp[i] = window.__pp[i] || []).push({
            live: !g.closest('.pipatch-mime'),
            status: g.getAttribute('data-status'),
            done: +g.getAttribute('data-rows-done'),
            rows: +g.getAttribute('data-rows'),
            text: st ? st.textContent : '',
        });
    };
    new MutationObserver((muts) => {
        for (const m of muts) {
            if (m.type === 'attributes' && m.target.classList.contains('pipatch-grid')) record(m.target);
            for (const n of m.addedNodes || []) {
                if (n.nodeType !== 1) continue;
                const gs = n.classList.contains('pipatch-grid') ? [n] : n.querySelectorAll('.pipatch-grid');
                gs.forEach(record);
            }
        }
    }).observe(document.body, {subtree: true, childList: true, attributes: true,
                               attributeFilter: ['data-status', 'data-rows-done']});
}"""


def _history(page, cell_index: int) -> list[dict]:
    return page.evaluate("(i) => (window.__pp || {})[i] || []", cell_index)


def _click_top5(page, grid, row: int, col: int, timeout: float = 120_000) -> list[str]:
    """Click a cell; wait for the kernel's top-5 in the grid's detail pane; return the tokens."""
    page.mouse.click(*cell_point(grid, row, col))
    tokens = grid.locator("table.pipatch-top .pipatch-top-token")
    tokens.first.wait_for(timeout=timeout)
    texts = [tokens.nth(i).text_content() for i in range(tokens.count())]
    assert len(texts) == 5, texts
    assert all(isinstance(t, str) and t.strip() for t in texts), texts
    probs = grid.locator("table.pipatch-top .pipatch-top-prob")
    assert probs.count() == 5 and all(probs.nth(i).text_content().strip() for i in range(5))
    return texts



def test_attribute_path_patch_and_dataset_stream_and_answer_clicks(page, lab_server):
    name = lab_server.write_notebook("experiments.ipynb", [code_cell(src) for src in CELLS])
    open_notebook(page, lab_server, name)
    page.evaluate(OBSERVE)
    run_all(page)

    # -- path patching over every sender head: rows stream in, click → top-5 mid-run --------
    wait_rows_streaming(page, PATH, timeout=300_000)
    path_live = grid_cell(page, PATH).locator(".pipatch-grid[data-status='running']").first
    assert path_live.get_attribute("data-rows") == "18" and path_live.get_attribute("data-cols") == "4"
    shot(page, "experiments-path-running")
    path_tokens = _click_top5(page, path_live, 17, 1)  # layer 17: rows run from the last layer down
    path_clicked_running = path_live.get_attribute("data-status") == "running"
    shot(page, "experiments-path-top5")
    path_done = live_grid(grid_cell(page, PATH), "done")
    path_done.wait_for(timeout=300_000)
    assert path_done.get_attribute("data-rows-done") == path_done.get_attribute("data-rows") == "18"

    # -- attribution: grid at once, running through the verification, then done ------------
    attr_done = live_grid(grid_cell(page, ATTR), "done")
    attr_done.wait_for(timeout=300_000)
    shot(page, "experiments-attribute-done")
    seen = _history(page, ATTR)
    live = [h for h in seen if h["live"] and h["status"] == "running"]
    assert live, f"the attribution's live grid was never seen running: {seen}"
    assert all(h["rows"] == 18 for h in live)  # the whole grid (layers × heads) from the start
    assert attr_done.get_attribute("data-rows") == attr_done.get_attribute("data-rows-done") == "18"
    assert attr_done.get_attribute("data-cols") == "4"
    assert attr_done.locator(".pipatch-status").text_content().startswith("done")

    # -- a dataset of two pairs: rows stream in, click → top-5 mid-run ----------------------
    wait_rows_streaming(page, DATASET, timeout=300_000)
    ds_live = grid_cell(page, DATASET).locator(".pipatch-grid[data-status='running']").first
    shot(page, "experiments-dataset-running")
    ds_tokens = _click_top5(page, ds_live, 17, int(ds_live.get_attribute("data-cols")) - 1)
    assert ds_live.get_attribute("data-status") == "running"
    shot(page, "experiments-dataset-top5")
    ds_done = live_grid(grid_cell(page, DATASET), "done")
    ds_done.wait_for(timeout=300_000)
    assert ds_done.get_attribute("data-rows-done") == ds_done.get_attribute("data-rows") == "18"
    labels = [
        ds_done.locator(".pipatch-collabel").nth(i).get_attribute("title")
        for i in range(ds_done.locator(".pipatch-collabel").count())
    ]
    assert "last" in labels and "first changed" in labels, labels

    # Every streaming grid was seen at 1 ≤ done < rows while running, and rows only grew.
    for index in (PATH, DATASET):
        running = [h for h in _history(page, index) if h["live"] and h["status"] == "running"]
        partial = [h["done"] for h in running if 1 <= h["done"] < h["rows"]]
        assert partial, (index, running)
        assert [h["done"] for h in running] == sorted(h["done"] for h in running), (index, running)
    assert path_clicked_running, "the path-patching top-5 came only after the run ended"

    # -- the bound results -----------------------------------------------------------------
    printed = grid_cell(page, PRINT).locator(".jp-RenderedText").filter(has_text="BOUND")
    printed.first.wait_for(timeout=300_000)
    lines = printed.first.text_content().splitlines()
    bound = [line.split() for line in lines if line.startswith("BOUND")]
    assert bound == [
        ["BOUND", "path", "done", "1", "18", "4"],
        ["BOUND", "attribution", "done", "1", "18", "4"],
        ["BOUND", "patch", "done", "2", "18", ds_done.get_attribute("data-cols")],
    ], lines
    verified = [
        tuple(map(int, c.split(","))) for c in next(li for li in lines if li.startswith("VERIFIED")).split()[1:]
    ]
    assert len(verified) == 5, lines
    columns = next(li for li in lines if li.startswith("COLUMNS")).split()[1:]
    assert [c.replace("_", " ") for c in columns] == labels, (columns, labels)

    # -- verified cells are marked in the final grid; others are not --------------------------
    for row, col in verified:
        assert "verified by a real patch" in hover_text(page, attr_done, row, col)
    others = [(r, c) for r in range(18) for c in range(4) if (r, c) not in verified]
    assert "verified by a real patch" not in hover_text(page, attr_done, *others[0])

    # -- PatchGrid(attr): a click after the run gets the real patched run's top-5 ------------
    again = grid_cell(page, AGAIN).locator(".pipatch-grid[data-status='done']").first
    again.wait_for(timeout=120_000)
    row, col = verified[0]
    assert "verified by a real patch" in hover_text(page, again, row, col)
    attr_tokens = _click_top5(page, again, row, col)
    # The run's own grid stays live after the run: the same click there, the same answer.
    assert _click_top5(page, attr_done, row, col) == attr_tokens
    shot(page, "experiments-attribute-top5")
    wait_kernel_idle(page, timeout=120_000)
    assert page.locator("text=Error displaying widget").count() == 0
    assert page.dialogs == [] and page.console_errors == [], (page.dialogs, page.console_errors)
    print("attribution states:", [(h["status"], h["done"]) for h in seen])
    print("top-5:", {"path": path_tokens, "dataset": ds_tokens, "attribute": attr_tokens})
