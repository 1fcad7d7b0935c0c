"""A feature circuit's graph in a real JupyterLab + Chromium, on the tiny random-weight Llama
with random SAEs after its first two blocks.

One notebook:

0. the tiny model, two random SAEs (``tests._saes.sae_folder``) and the pair;
1. ``PatchGrid(pipatch.feature_circuit(...))``: its view pings the kernel, so the live run below
   stays live, clickable, after it ends;
2. ``PatchGrid.run(model, "feature_circuit", ..., verify=30)``: the graph is seen running, its
   nodes drawn before the exact checks end, then done; the threshold control filters the
   nodes; hovering a node and an edge checked exactly shows their estimates and exact values;
   a click on a node the checks left out runs its exact ablation in the kernel and shows it on
   the node; shift-clicks and Group make a supernode;
3. the kernel's own numbers: the clicked node's exact value and the supernodes, as JSON;

then the notebook is saved (the saved copy holds the supernode), the kernel shut down and the
page reloaded: the saved copy draws the graph, the supernode and filters without a kernel.
"""

from __future__ import annotations

import json
from pathlib import Path
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

GROUP = "<i>towers</i>"  # a user's name: text, never HTML
CELLS = [
    "import json\nimport pipatch\nfrom pipatch import PatchGrid\nfrom tests._tiny import tiny_model, D_MODEL\n"
    "from tests._saes import sae_folder\nfrom tests._experiments import TINY_PAIR\n"
    "model = tiny_model('llama')\n"
    "ARGS = dict(**TINY_PAIR, saes=[sae_folder(D_MODEL, 0), sae_folder(D_MODEL, 1)])",
    "first = pipatch.feature_circuit(model, **ARGS, verify=0)\nPatchGrid(first)",
    "graph = PatchGrid.run(model, 'feature_circuit', **ARGS, verify=30, top_nodes=20)",
    "part = graph.to_state()['feature_graph']\nshown = part['nodes'][:41]\n"
    "k, edge = next((k, e) for k, e in enumerate(part['edges']) if e['exact'] is not None)\n"
    "print('KERNEL', json.dumps({'scores': [n['score'] for n in shown if n['kind'] != 'metric'],\n"
    "    'edge': [k, part['nodes'][edge['up']]['name'], part['nodes'][edge['down']]['name'], edge['exact']],\n"
    "    'checked': sum(n['exact'] is not None for n in shown if n['kind'] != 'metric'),\n"
    "    'click': next(n['name'] for n in shown if n['kind'] == 'latent' and n['exact'] is None),\n"
    "    'pair': [n['name'] for n in shown if n['kind'] != 'metric'][:2]}))",
    "print('AFTER', json.dumps({'nodes': graph.nodes()[['node', 'exact']].dropna().values.tolist(),\n"
    "                          'groups': graph.supernodes()}))",
]
SETUP, FIRST, LIVE, KERNEL, AFTER = range(5)

#: Records each feature view's status and checked count as the page sees them.
OBSERVE = """() => {
    window.__fc = [];
    const record = (g) => window.__fc.push({live: !g.closest('.pipatch-mime'), status: g.getAttribute('data-status'),
                                           nodes: +g.getAttribute('data-nodes'), checked: +g.getAttribute('data-checked')});
    new MutationObserver((muts) => {
        for (const m of muts) {
            if (m.type === 'attributes' && m.target.classList.contains('pipatch-features')) record(m.target);
            for (const n of m.addedNodes || []) {
                if (n.nodeType === 1) (n.classList.contains('pipatch-features') ? [n] : n.querySelectorAll('.pipatch-features')).forEach(record);
            }
        }
    }).observe(document.body, {subtree: true, childList: true, attributes: true,
                               attributeFilter: ['data-status', 'data-checked', 'data-nodes']});
}"""


def _shown(value: float, digits: int = 4) -> str:
    """A number as the view writes it (``formatValue`` in js/format.ts)."""
    a = abs(value)
    if a != 0 and (a < 1e-3 or a >= 1e5):
        mantissa, exponent = f"{value:.{2}e}".split("e")
        return f"{mantissa}e{'+' if int(exponent) >= 0 else '-'}{abs(int(exponent))}"
    return f"{value:.{digits}f}"


def _printed(page, cell: int, tag: str) -> dict:
    text = grid_cell(page, cell).locator(".jp-RenderedText").filter(has_text=tag)
    text.first.wait_for(timeout=120_000)
    return json.loads(text.first.text_content().split(tag, 1)[1])


def _set_threshold(view, value: float) -> None:
    box = view.locator("input.pipatch-threshold")
    box.fill(repr(value))


def test_feature_circuit_fills_filters_ablates_groups_and_renders_saved(page, lab_server):
    name = lab_server.write_notebook("feature_circuit.ipynb", [code_cell(src) for src in CELLS])
    open_notebook(page, lab_server, name)
    run_cells(page, [SETUP, FIRST])
    first = grid_cell(page, FIRST).locator(".pipatch-features[data-status='done']").first
    first.wait_for(timeout=120_000)
    wait_kernel_idle(page)
    page.wait_for_timeout(1500)  # the view has pinged its kernel: later grids stay live

    page.evaluate(OBSERVE)
    run_cells(page, [LIVE, KERNEL])
    kernel = _printed(page, KERNEL, "KERNEL")
    view = live_grid(grid_cell(page, LIVE), "done")
    view.wait_for(timeout=60_000)
    assert "pipatch-features" in view.get_attribute("class")

    # -- live: the graph is drawn while the exact checks run, and they fill in ---------------------
    seen = [h for h in page.evaluate("() => window.__fc") if h["live"]]
    running = [h for h in seen if h["status"] == "running"]
    assert running and running[0]["nodes"] > 1, seen
    assert running[0]["checked"] < kernel["checked"] == 30, seen
    assert view.get_attribute("data-checked") == "30"
    top = len(kernel["scores"])
    assert view.get_attribute("data-nodes") == str(top + 1)  # the 40 largest and the metric
    assert view.locator(".pipatch-fnode-error").count() > 0 and view.locator(".pipatch-fnode-metric").count() == 1
    shot(page, "feature-circuit-live")

    # -- the threshold control filters nodes (and their edges) here, without the kernel ----------
    threshold = sorted(abs(s) for s in kernel["scores"])[top // 2]
    _set_threshold(view, threshold)
    want = sum(abs(s) >= threshold for s in kernel["scores"]) + 1
    page.wait_for_function("([g, n]) => g.getAttribute('data-nodes') === String(n)", arg=[view.element_handle(), want])
    assert view.locator(".pipatch-fnode").count() == want < top + 1
    _set_threshold(view, 0)
    page.wait_for_function("([g, n]) => g.getAttribute('data-nodes') === String(n)", arg=[view.element_handle(), top + 1])

    # -- hover: the node's name, estimate and exact value, as text --------------------------------
    node = view.locator(f".pipatch-fnode[data-name='{kernel['click']}']")
    node.hover()
    tip = view.locator(".pipatch-tooltip")
    tip.wait_for(state="visible")
    assert kernel["click"] in tip.text_content() and "exact: not checked" in tip.text_content()

    # -- hover on an edge checked exactly: its ends, estimate and exact value --------------------
    index, up, down, edge_exact = kernel["edge"]
    assert view.locator(f".pipatch-fedge[data-edge='{index}']").get_attribute("data-exact") != ""
    # A line's box has no width when it is upright: point at its middle instead.
    hit = view.locator(f".pipatch-fedge-hit[data-edge='{index}']")
    graph_box = view.locator("svg.pipatch-feature-graph")
    box = graph_box.bounding_box()
    scale = box["width"] / float(graph_box.get_attribute("width"))
    x, y = ((float(hit.get_attribute(a)) + float(hit.get_attribute(b))) / 2 for a, b in (("x1", "x2"), ("y1", "y2")))
    page.mouse.move(box["x"] + x * scale, box["y"] + y * scale)
    page.wait_for_function("t => t.textContent.includes('→')", arg=tip.element_handle())
    assert f"{up} → {down}" in tip.text_content() and f"exact: {_shown(edge_exact)}" in tip.text_content()

    # -- a click: the node's exact ablation, run in the kernel, shown on the node ----------------
    node.click()
    # Each redraw makes new node elements: wait on the selector, not on one element.
    view.locator(f".pipatch-fnode[data-name='{kernel['click']}']:not([data-exact=''])").wait_for(timeout=60_000)
    shown_exact = view.locator(".pipatch-detail-exact").text_content()
    assert view.locator(".pipatch-fnode-exact").count() == 1
    shot(page, "feature-circuit-click")

    # -- a supernode: the clicked node and two shift-clicked ones, named, Group -----------------
    members = [kernel["click"], *kernel["pair"]]
    for member in kernel["pair"]:
        view.locator(f".pipatch-fnode[data-name='{member}']").click(modifiers=["Shift"])
    view.locator("input.pipatch-group-name").fill(GROUP)
    view.locator("button.pipatch-group").click()
    view.locator(".pipatch-supernode").first.wait_for()
    assert view.locator(".pipatch-supernode").get_attribute("data-group") == GROUP
    assert view.locator(".pipatch-supernodes text").text_content() == GROUP
    assert view.locator("i").count() == 0

    # -- export: the graph as drawn (SVG, PNG) and its data (JSON, supernodes included) ------------
    with page.expect_download() as download:
        view.locator("button.pipatch-svg").click()
    tree = ElementTree.parse(download.value.path())
    drawn = [e for e in tree.iter() if "pipatch-fnode " in (e.get("class") or "") + " "]
    assert tree.getroot().tag == "{http://www.w3.org/2000/svg}svg" and len(drawn) == top + 1
    with page.expect_download() as download:
        view.locator("button.pipatch-png").click()
    assert Path(download.value.path()).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with page.expect_download() as download:
        view.locator("button.pipatch-json").click()
    exported = json.loads(Path(download.value.path()).read_text())
    assert exported["supernodes"] == [{"name": GROUP, "nodes": members}] and len(exported["nodes"]) > top

    run_cells(page, [AFTER])
    after = _printed(page, AFTER, "AFTER")
    exact = dict((n, v) for n, v in after["nodes"])[kernel["click"]]
    assert f"exact ablation: {_shown(exact)}" in shown_exact
    assert after["groups"] == {GROUP: members}
    assert page.console_errors == [] and page.dialogs == []

    # -- save: the saved copy holds the supernode; shut the kernel down, reload ------------------
    saved_copy(grid_cell(page, LIVE)).wait_for(state="attached", timeout=60_000)
    wait_kernel_idle(page)
    run_command(page, "docmanager:save")
    page.wait_for_timeout(1000)
    saved = json.loads((lab_server.root / name).read_text())
    docs = [o["data"]["application/vnd.pipatch.grid+json"] for o in saved["cells"][LIVE]["outputs"]
            if "application/vnd.pipatch.grid+json" in o.get("data", {})]
    assert len(docs) == 1 and docs[0]["kind"] == "feature_circuit"
    assert docs[0]["feature_graph"]["groups"] == [{"name": GROUP, "nodes": members}]
    for kernel_info in lab_server.api("GET", "/api/kernels"):
        lab_server.api("DELETE", f"/api/kernels/{kernel_info['id']}")
    page.reload()
    page.wait_for_selector(".pipatch-mime .pipatch-features[data-status='done']", timeout=90_000)
    copy = saved_copy(grid_cell(page, LIVE)).locator(".pipatch-features")
    copy.wait_for(state="visible", timeout=60_000)
    assert copy.get_attribute("data-nodes") == str(top + 1)
    assert copy.locator(".pipatch-supernode").get_attribute("data-group") == GROUP
    _set_threshold(copy, threshold)
    page.wait_for_function("([g, n]) => g.getAttribute('data-nodes') === String(n)", arg=[copy.element_handle(), want])
    shot(page, "feature-circuit-reloaded")
