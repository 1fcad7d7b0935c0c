"""A circuit's graph in a real JupyterLab + Chromium, on the tiny random-weight Llama.

One notebook:

0. the tiny model (``tests/_tiny.py``) and the IOI-style pair;
1. ``PatchGrid(pipatch.circuit(...))``: a circuit shown as a widget (its view pings the kernel,
   so the live run below stays live, clickable, after it ends);
2. ``PatchGrid.run(model, "circuit", ..., verify=10)``: the live view draws the graph (as many
   edges as the faithful circuit has, of all of them), the slider changes how many are drawn, hovering an edge shows its
   estimate and exact change, a click on it gets its exact edge patch (the change over every
   pair, the top-5) from the kernel, the SVG button saves the graph as drawn, and the faithfulness curve is drawn beside it;
3. the kernel's own numbers for the same edge: the ranking (``Result.graph``), the exact
   change and the top-5 of the edge's exact patch (the plan's predictor), printed as JSON;

then the notebook is saved, the kernel shut down and the page reloaded: the saved copy draws
the same graph without a kernel, and its slider and hover still work.
"""

from __future__ import annotations

import json
from xml.etree import ElementTree

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
    "import json\nimport pipatch\nfrom pipatch import PatchGrid\nfrom tests._tiny import tiny_model\n"
    "model = tiny_model('llama')\n"
    "PAIR = dict(clean='When Mary and John went to the store, John gave a book to',\n"
    "            corrupt='When Mary and John went to the store, Mary gave a book to', answer=' Mary', foil=' John')",
    "first = pipatch.circuit(model, **PAIR, verify=0, curve=0)\nPatchGrid(first)",
    "circ = PatchGrid.run(model, 'circuit', **PAIR, verify=10)",
    "from pipatch._notebook.live import _predictor\n"
    "top = circ.graph(top=1)['edges'][0]\n"
    "row, col = circ.layers.index(top['receiver']), circ.columns.index(top['sender'])\n"
    "tokens = [t for t, _ in _predictor(circ)('edges', row, col, 0, 5)]\n"
    "print('KERNEL', json.dumps({'top': top, 'row': row, 'col': col, 'tokens': tokens, 'edges': len(circ.edges()),\n"
    "                           'size': circ.meta['faithfulness']['size']}))",
]
SETUP, FIRST, LIVE, KERNEL = range(4)


def _shown(value: float, digits: int = 4) -> str:
    """A number as the view writes it (``formatValue`` in js/format.ts)."""
    a = abs(value)
    if a != 0 and (a < 1e-3 or a >= 1e5):
        mantissa, exponent = f"{value:.2e}".split("e")
        return f"{mantissa}e{'+' if int(exponent) >= 0 else '-'}{abs(int(exponent))}"
    return f"{value:.{digits}f}"


def _edge_point(page, view, rank: int) -> tuple[float, float]:
    """Page coordinates of the middle of the drawn edge of ``rank`` (0: the largest |score|)."""
    edge = view.locator(f"g.pipatch-edge[data-rank='{rank}']")
    edge.scroll_into_view_if_needed()
    return tuple(edge.evaluate(
        """(g) => {
            const p = g.querySelector('.pipatch-edge-hit');
            const at = p.getPointAtLength(p.getTotalLength() / 2);
            const m = p.getScreenCTM();
            return [at.x * m.a + at.y * m.c + m.e, at.x * m.b + at.y * m.d + m.f];
        }"""))


def _drawn(view) -> int:
    return view.locator("g.pipatch-edge").count()


def _slide_to(page, view, n: int) -> None:
    """Move the top-n slider with the keyboard, as a user would: Home (1), then right n − 1 times."""
    slider = view.locator("input.pipatch-top-n")
    slider.focus()
    page.keyboard.press("Home")
    for _ in range(n - 1):
        page.keyboard.press("ArrowRight")


def test_circuit_graph_draws_filters_hovers_clicks_and_renders_saved(page, lab_server):
    name = lab_server.write_notebook("circuit.ipynb", [code_cell(src) for src in CELLS])
    open_notebook(page, lab_server, name)
    run_cells(page, [SETUP, FIRST])
    first = grid_cell(page, FIRST).locator(".pipatch-circuit[data-status='done']").first
    first.wait_for(timeout=300_000)
    assert int(first.get_attribute("data-edges")) > 0
    wait_kernel_idle(page)
    page.wait_for_timeout(1500)  # the view has pinged its kernel: later grids stay live

    run_cells(page, [LIVE, KERNEL])
    printed = grid_cell(page, KERNEL).locator(".jp-RenderedText").filter(has_text="KERNEL")
    printed.first.wait_for(timeout=300_000)
    kernel = json.loads(printed.first.text_content().split("KERNEL", 1)[1])
    view = live_grid(grid_cell(page, LIVE), "done")
    view.wait_for(timeout=60_000)
    assert "pipatch-circuit" in view.get_attribute("class")

    # -- the graph: nodes by layer, as many edges as the faithful circuit has (else the top 50) --
    assert kernel["edges"] > 50
    assert view.get_attribute("data-edges-total") == str(kernel["edges"])
    start = kernel["size"] or 50
    assert view.get_attribute("data-edges") == str(start) and _drawn(view) == start
    rows = view.locator(".pipatch-rows text").all_text_contents()
    assert rows == ["embeddings", "layer 0", "layer 1", "layer 2", "logits"]
    assert view.locator(".pipatch-node").count() == 1 + 3 * 5 + 1
    assert "checked by exact patches" in view.locator(".pipatch-status").text_content()
    # Coloured on the grids' scale: the largest edge at its end (red or blue), not the white middle.
    colour = view.locator("g.pipatch-edge[data-rank='0'] .pipatch-edge-line").get_attribute("stroke")
    assert colour in ("rgb(103,0,31)", "rgb(5,48,97)"), colour
    # The faithfulness curve beside it, with the size that reaches the share.
    assert view.locator(".pipatch-faithfulness-chart .pipatch-curve").count() == 1
    assert view.locator(".pipatch-faithfulness-chart .pipatch-share").count() == 1
    if kernel["size"] is not None:
        assert f"with {kernel['size']} of" in view.locator(".pipatch-faithfulness-size").text_content()
    shot(page, "circuit-live")

    # -- the slider keeps the top n ------------------------------------------------------------
    _slide_to(page, view, 10)
    page.wait_for_function("(g) => g.getAttribute('data-edges') === '10'", arg=view.element_handle())
    assert _drawn(view) == 10
    assert "top 10 of" in view.locator(".pipatch-top-n-label").text_content()
    page.keyboard.press("End")
    page.wait_for_function("([g, n]) => g.getAttribute('data-edges') === String(n)", arg=[view.element_handle(), kernel["edges"]])
    assert _drawn(view) == kernel["edges"]
    _slide_to(page, view, 10)
    page.wait_for_function("(g) => g.getAttribute('data-edges') === '10'", arg=view.element_handle())
    # The SVG button saves the graph as drawn: a standalone SVG document with those ten edges.
    with page.expect_download() as download:
        view.locator("button.pipatch-svg").click()
    tree = ElementTree.parse(download.value.path())
    edges = [g for g in tree.iter("{http://www.w3.org/2000/svg}g") if g.get("class") == "pipatch-edge"]
    assert tree.getroot().tag == "{http://www.w3.org/2000/svg}svg" and len(edges) == 10
    assert download.value.suggested_filename.endswith(".svg")

    # -- hover: the estimate and the exact change, as the kernel has them ------------------------
    top = kernel["top"]
    assert top["exact"] is not None  # verify=10 checks the largest ten
    page.mouse.move(*_edge_point(page, view, 0))
    tip = view.locator(".pipatch-tooltip")
    tip.wait_for(state="visible")
    text = tip.text_content()
    assert f"{top['sender']} → {top['receiver']}" in text
    assert f"estimate: {_shown(top['score'])}" in text
    assert f"exact patch: {_shown(top['exact'])}" in text
    assert "rank 1 of" in text
    shot(page, "circuit-hover")

    # -- click: the edge's exact patch, answered by the kernel -----------------------------------
    page.mouse.click(*_edge_point(page, view, 0))
    tokens = view.locator("table.pipatch-top .pipatch-top-token")
    tokens.first.wait_for(timeout=120_000)
    assert [t.strip() for t in tokens.all_text_contents()] == [t.strip() for t in kernel["tokens"]]
    head = view.locator(".pipatch-detail-head").text_content()
    assert f"{top['sender']} → {top['receiver']}" in head and f"exact patch: {_shown(top['exact'])}" in head
    # The click ran the edge's exact patch over every pair: the same change as its check.
    ran = view.locator(".pipatch-detail-exact").text_content()
    assert f"run on this click: {_shown(top['exact'])}" in ran
    assert view.locator("g.pipatch-edge-selected").get_attribute("data-row") == str(kernel["row"])
    assert view.locator("g.pipatch-edge-selected").get_attribute("data-col") == str(kernel["col"])
    shot(page, "circuit-click")
    assert page.console_errors == [] and page.dialogs == []

    # -- save, shut the kernel down, reload: the saved copy draws the graph -----------------------
    saved_copy(grid_cell(page, LIVE)).wait_for(state="attached", timeout=60_000)
    wait_kernel_idle(page)
    run_command(page, "docmanager:save")
    page.wait_for_timeout(1000)
    saved = json.loads((lab_server.root / name).read_text())
    bundles = [o["data"] for o in saved["cells"][LIVE]["outputs"] if "application/vnd.pipatch.grid+json" in o.get("data", {})]
    assert len(bundles) == 1 and "image/png" in bundles[0]
    doc = bundles[0]["application/vnd.pipatch.grid+json"]
    assert doc["kind"] == "circuit" and len(doc["circuit"]["nodes"]) == 17 and doc["circuit"]["faithfulness"]["sizes"]
    for kernel_info in lab_server.api("GET", "/api/kernels"):
        lab_server.api("DELETE", f"/api/kernels/{kernel_info['id']}")
    page.reload()
    page.wait_for_selector(".pipatch-mime .pipatch-circuit[data-status='done']", timeout=90_000)
    copy = saved_copy(grid_cell(page, LIVE)).locator(".pipatch-circuit")
    copy.wait_for(state="visible", timeout=60_000)
    assert copy.get_attribute("data-edges") == str(start) and _drawn(copy) == start
    assert copy.get_attribute("data-edges-total") == str(kernel["edges"])
    assert copy.locator(".pipatch-faithfulness-chart .pipatch-curve").count() == 1
    _slide_to(page, copy, 3)
    page.wait_for_function("(g) => g.getAttribute('data-edges') === '3'", arg=copy.element_handle())
    assert _drawn(copy) == 3
    page.mouse.move(*_edge_point(page, copy, 0))
    tip = copy.locator(".pipatch-tooltip")
    tip.wait_for(state="visible")
    assert f"exact patch: {_shown(top['exact'])}" in tip.text_content()
    shot(page, "circuit-reloaded")
