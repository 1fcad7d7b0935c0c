"""The grid follows JupyterLab's light and dark themes."""

from __future__ import annotations

import pytest

from .conftest import code_cell, open_notebook, run_all, run_command, shot
from .fake_state import FAKE_STATE_SRC

pytestmark = pytest.mark.e2e

GRID = ".jp-OutputArea-output .pipatch-grid"


def _luminance(page) -> float:
    rgb = page.evaluate(
        "(sel) => getComputedStyle(document.querySelector(sel)).backgroundColor", GRID)
    r, g, b = [float(x) for x in rgb[rgb.index("(") + 1 : rgb.index(")")].split(",")[:3]]
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def test_grid_follows_light_and_dark_themes(page, lab_server):
    name = lab_server.write_notebook(
        "theme.ipynb", [code_cell(FAKE_STATE_SRC), code_cell("w = PatchGrid.from_state(fake_state())\nw")])
    open_notebook(page, lab_server, name)
    run_command(page, "apputils:change-theme", {"theme": "JupyterLab Light"})
    page.wait_for_function("document.body.dataset.jpThemeLight === 'true'", timeout=30_000)
    run_all(page)
    page.wait_for_selector(f"{GRID}[data-status='done']")
    light = _luminance(page)
    shot(page, "theme-light")
    run_command(page, "apputils:change-theme", {"theme": "JupyterLab Dark"})
    page.wait_for_function("document.body.dataset.jpThemeLight === 'false'", timeout=30_000)
    page.wait_for_timeout(500)
    dark = _luminance(page)
    shot(page, "theme-dark")
    assert light > 200 and dark < 80, (light, dark)
    run_command(page, "apputils:change-theme", {"theme": "JupyterLab Light"})
