"""%%feature_patch in a real JupyterLab + Chromium: a feature grid fills live, hovering a latent
row shows its label and top contexts, a click shows the patched run's top-5, and the saved copy
renders after a kernel shutdown.

One notebook on the embedded model with a random SAE after layer 6 (a copy of
``tests._saes.sae_folder(640, 6)``, so the contexts written next to it stay this test's):

1. load the model and the SAE, write a labels file (labels holding markup: text, never HTML),
   and store the SAE's top contexts over a few texts (:func:`pipatch.feature_contexts`);
2. ``%%feature_patch --labels ... --top-k 2`` on two positions: the grid is seen running, then
   done, its rows the latents and the error;
3. ``PatchGrid(feats)``: a click on a finished feature grid gets the top-5;
4. a print of the row that has contexts.

Then hover, click, save, shut the kernel down and reload: the saved copy is drawn, and its
tooltip still shows the label and a context line (the notes are in the saved document).
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests._saes import D_SAE, sae_folder

from .conftest import (
    code_cell,
    grid_cell,
    hover_text,
    open_notebook,
    run_all,
    run_command,
    saved_copy,
    shot,
    wait_kernel_idle,
)
from .test_experiments_browser import OBSERVE, _click_top5, _history

pytestmark = pytest.mark.e2e

LABEL = "<b>label</b> of latent {}"
TEXTS = ["The Eiffel Tower is in Paris.", "The Colosseum is in Rome.", "Big Ben is in London."]
RUN, FEATS, AGAIN, PRINT = 1, 2, 3, 4


def cells(folder: str, labels: str) -> list[str]:
    return [
        "%load_ext pipatch",
        "import pipatch\nmodel = pipatch.load_model()\n"
        f"site = pipatch.load_sae({folder!r}, model)\n"
        f"pipatch.feature_contexts(model, site, {TEXTS!r}, k=2).k",
        f'%%feature_patch --model model --site {folder} --labels {labels} --answer " Paris" --foil " Rome" '
        "--top-k 2 --positions 4,-1 -o feats\n"
        "clean: The Eiffel Tower is in the city of\ncorrupt: The Colosseum is in the city of",
        "from pipatch import PatchGrid\nPatchGrid(feats)",
        "noted = [r for r, i in enumerate(feats.latents) if i != 'error' and feats.contexts(i)]\n"
        "print('NOTED', noted[0], feats.latents[noted[0]], feats.status, len(feats.latents))",
    ]


def test_feature_grid_hover_click_and_saved_copy(page, lab_server, tmp_path):
    folder = tmp_path / "L6"
    shutil.copytree(sae_folder(640, 6), folder)
    labels = tmp_path / "labels.json"
    labels.write_text(json.dumps({str(i): LABEL.format(i) for i in range(D_SAE)}))
    name = lab_server.write_notebook("features.ipynb", [code_cell(s) for s in cells(str(folder), str(labels))])
    open_notebook(page, lab_server, name)
    page.evaluate(OBSERVE)
    run_all(page)

    # -- the feature grid: seen running, then done; rows are latents and the error ------------
    printed = grid_cell(page, PRINT).locator(".jp-RenderedText").filter(has_text="NOTED")
    printed.first.wait_for(timeout=300_000)
    _, row, latent, status, n_rows = printed.first.text_content().split()
    row, n_rows = int(row), int(n_rows)
    assert status == "done" and 2 <= n_rows <= 3, printed.first.text_content()
    seen = [h for h in _history(page, FEATS) if h["live"]]
    assert any(h["status"] == "running" for h in seen), f"the feature grid was never seen running: {seen}"
    done = grid_cell(page, FEATS).locator(".pipatch-grid[data-status='done']").first
    done.wait_for(timeout=60_000)
    assert done.get_attribute("data-rows") == str(n_rows) and done.get_attribute("data-cols") == "2"

    # -- hover: the latent's label and a context line, as text --------------------------------
    tip = hover_text(page, done, row, 0)
    assert f"latent: L6 #{latent}" in tip and LABEL.format(latent) in tip, tip
    assert "«" in tip, tip  # a context window, its token marked
    assert "SAE's error" in hover_text(page, done, n_rows - 1, 1)
    assert page.locator(".pipatch-tooltip b").count() == 0
    shot(page, "features-hover")

    # -- a click on the finished grid: the patched run's top-5 --------------------------------
    again = grid_cell(page, AGAIN).locator(".pipatch-grid[data-status='done']").first
    again.wait_for(timeout=120_000)
    _click_top5(page, again, row, 1)
    shot(page, "features-top5")
    wait_kernel_idle(page, timeout=120_000)

    # -- save, shut the kernel down, reload: the saved copy, notes included -------------------
    page.evaluate(f"() => {{ window.jupyterapp.shell.currentWidget.content.activeCellIndex = {AGAIN}; }}")
    run_command(page, "notebook:clear-cell-output")
    run_command(page, "docmanager:save")
    page.wait_for_timeout(1000)
    saved = json.loads((lab_server.root / name).read_text())
    copies = [o["data"]["application/vnd.pipatch.grid+json"] for o in saved["cells"][FEATS]["outputs"]
              if "application/vnd.pipatch.grid+json" in o.get("data", {})]
    assert len(copies) == 1 and copies[0]["row_axis"] == "latent" and len(copies[0]["row_notes"]) == n_rows
    for kernel in lab_server.api("GET", "/api/kernels"):
        lab_server.api("DELETE", f"/api/kernels/{kernel['id']}")
    page.reload()
    page.wait_for_selector(".pipatch-mime .pipatch-grid[data-status='done']", timeout=90_000)
    wait_kernel_idle(page)
    page.wait_for_timeout(2000)
    copy = saved_copy(grid_cell(page, FEATS))
    assert copy.is_visible()
    grid = copy.locator(".pipatch-grid").first
    tip = hover_text(page, grid, row, 0)
    assert LABEL.format(latent) in tip and "«" in tip, tip
    errors = page.locator("text=Error displaying widget")
    assert all(not errors.nth(i).is_visible() for i in range(errors.count()))
    shot(page, "features-reloaded")
    assert page.dialogs == []
