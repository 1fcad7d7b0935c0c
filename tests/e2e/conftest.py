"""Real JupyterLab + real Chromium fixtures for the PatchGrid browser tests.

Nothing is installed here: Chromium must be at /usr/bin/chromium (the Makefile installs it
with apt-get) and the front end must be built (`npm run build`). The kernel imports
pipatch from this checkout (PYTHONPATH); the lab extension is taken from the installed
location if present, otherwise from this checkout's build through JUPYTER_PATH.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

# Never let Playwright fetch a browser of its own.
os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _labextension_installed() -> bool:
    return (Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "pipatch").exists()


class LabServer:
    def __init__(self, url: str, root: Path, proc: subprocess.Popen, log: Path) -> None:
        self.url = url
        self.root = root
        self.proc = proc
        self.log = log

    def api(self, method: str, path: str) -> Any:
        req = urllib.request.Request(f"{self.url}{path}", method=method)
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
        return json.loads(body) if body else None

    def write_notebook(self, name: str, cells: list[dict]) -> str:
        nb = {
            "cells": cells,
            "metadata": {
                "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                "language_info": {"name": "python"},
            },
            "nbformat": 4,
            "nbformat_minor": 5,
        }
        (self.root / name).write_text(json.dumps(nb, indent=1))
        return name


def code_cell(source: str, outputs: list[dict] | None = None) -> dict:
    return {
        "cell_type": "code",
        "execution_count": None,
        "id": os.urandom(4).hex(),
        "metadata": {},
        "outputs": outputs or [],
        "source": source,
    }


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    """``jupyter lab`` on a free port, serving a temporary folder."""
    yield from _serve(tmp_path_factory, "jupyterlab")


@pytest.fixture(scope="session")
def notebook_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    """``jupyter notebook`` (Notebook 7) on a free port, serving a temporary folder."""
    yield from _serve(tmp_path_factory, "notebook")


def _serve(tmp_path_factory: pytest.TempPathFactory, app: str) -> Iterator[LabServer]:
    """Start ``python -m <app>`` (``jupyterlab`` or ``notebook``) with the galata test settings
    (the app object exposed as ``window.jupyterapp``), wait for it, stop it at the end."""
    if not (REPO / "pipatch" / "static" / "widget.js").exists() or not (
        REPO / "pipatch" / "labextension" / "package.json"
    ).exists():
        pytest.fail("front end not built: run `npm ci && npm run build` first", pytrace=False)
    base = tmp_path_factory.mktemp(app)
    root = base / "root"
    root.mkdir()
    cfg_dir = base / "config"
    cfg_dir.mkdir()
    port = _free_port()
    (cfg_dir / "jupyter_server_config.py").write_text(
        "from jupyterlab.galata import configure_jupyter_server\n"
        "configure_jupyter_server(c)\n"
        f"c.ServerApp.port = {port}\n"
        "c.ServerApp.ip = '127.0.0.1'\n"
        f"c.ServerApp.root_dir = {str(root)!r}\n"
        "c.ServerApp.open_browser = False\n"
        "c.ServerApp.allow_root = True\n"
        "c.LabApp.extension_manager = 'readonly'\n"
        "c.LabApp.news_url = None\n"
        "c.LabApp.check_for_updates_class = 'jupyterlab.NeverCheckForUpdate'\n"
        "c.JupyterNotebookApp.expose_app_in_browser = True\n"
    )
    env = dict(os.environ)
    env["JUPYTER_CONFIG_DIR"] = str(cfg_dir)
    env["JUPYTER_RUNTIME_DIR"] = str(base / "runtime")
    env["JUPYTERLAB_SETTINGS_DIR"] = str(base / "settings")
    env["JUPYTERLAB_WORKSPACES_DIR"] = str(base / "workspaces")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PIPATCH_E2E"] = "1"
    if not _labextension_installed():
        data = base / "data"
        (data / "labextensions").mkdir(parents=True)
        (data / "labextensions" / "pipatch").symlink_to(REPO / "pipatch" / "labextension")
        env["JUPYTER_PATH"] = os.pathsep.join([str(data), env.get("JUPYTER_PATH", "")]).rstrip(
            os.pathsep
        )
    log = base / f"{app}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", app, f"--config={cfg_dir / 'jupyter_server_config.py'}"],
            cwd=root,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/api/status", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{app} did not start:\n{log.read_text()[-3000:]}", pytrace=False)
        time.sleep(0.5)
    server = LabServer(url, root, proc, log)
    yield server
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(log, ARTIFACTS / f"{app}.log")


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium); "
            "the e2e tests never download a browser.",
            pytrace=False,
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
    pg = context.new_page()
    pg.set_default_timeout(60_000)
    pg.dialogs = []  # type: ignore[attr-defined]

    def on_dialog(d: Any) -> None:
        pg.dialogs.append(d.message)  # type: ignore[attr-defined]
        d.dismiss()

    pg.on("dialog", on_dialog)
    pg.console_errors = []  # type: ignore[attr-defined]
    pg.error_stacks = []  # type: ignore[attr-defined]

    def on_error(e: Any) -> None:
        pg.console_errors.append(str(e))  # type: ignore[attr-defined]
        pg.error_stacks.append(e.stack or str(e))  # type: ignore[attr-defined]

    pg.on("pageerror", on_error)
    yield pg
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        pg.screenshot(path=str(ARTIFACTS / f"{request.node.name}-final.png"), full_page=True)
    except Exception:  # noqa: BLE001, S110 - a missing screenshot must not hide the real failure
        pass
    context.close()


def _wait_notebook_open(page: Any) -> None:
    """Until the page's app shows a notebook whose session is set up (JupyterLab or Notebook 7)."""
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell", timeout=90_000)
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=90_000)
    page.wait_for_function(
        """() => {
            const w = window.jupyterapp.shell.currentWidget;
            return !!(w && w.sessionContext && w.sessionContext.isReady !== undefined);
        }"""
    )


def open_notebook(page: Any, server: LabServer, name: str) -> None:
    # A fresh workspace per notebook: no tab of an earlier test is restored next to it.
    ws = f"w{os.urandom(4).hex()}"
    page.goto(f"{server.url}/lab/workspaces/{ws}/tree/{name}?reset")
    _wait_notebook_open(page)


def open_notebook7(page: Any, server: LabServer, name: str) -> None:
    """Open ``name`` in Notebook 7's own page (``/notebooks/<name>``)."""
    page.goto(f"{server.url}/notebooks/{name}")
    _wait_notebook_open(page)


def wait_kernel_idle(page: Any, timeout: float = 60_000) -> None:
    page.wait_for_function(
        """() => {
            const w = window.jupyterapp.shell.currentWidget;
            const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
            return !!k && k.status === 'idle';
        }""",
        timeout=timeout,
    )


def run_command(page: Any, command: str, args: dict | None = None) -> Any:
    return page.evaluate(
        "([c, a]) => window.jupyterapp.commands.execute(c, a)", [command, args or {}]
    )


def run_cells(page: Any, indices: Any) -> None:
    """Queue cells for execution, in order (each waits in the kernel for the one before)."""
    wait_kernel_idle(page, timeout=120_000)
    page.evaluate(
        """(indices) => {
            const panel = window.jupyterapp.shell.currentWidget;
            for (const i of indices) {
                panel.content.activeCellIndex = i;
                window.jupyterapp.commands.execute('notebook:run-cell');
            }
        }""",
        list(indices),
    )


def run_all(page: Any) -> None:
    wait_kernel_idle(page, timeout=120_000)
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


def shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


# -- grids in a notebook ------------------------------------------------------------------


def grid_cell(page, index: int):
    return page.locator(".jp-NotebookPanel .jp-CodeCell").nth(index)


_GRID = "contains(concat(' ', @class, ' '), ' pipatch-grid ')"
_COPY = "contains(concat(' ', @class, ' '), ' pipatch-mime ')"


def live_grid(cell, status: str | None = None):
    """The widget's grid in a cell (not its saved copy), optionally with a given status."""
    cond = f" and @data-status='{status}'" if status else ""
    return cell.locator(f"xpath=.//div[{_GRID}{cond} and not(ancestor::*[{_COPY}])]").first


def saved_copy(cell):
    """The saved copy (``application/vnd.pipatch.grid+json`` output) of a cell's live grid."""
    return cell.locator(".pipatch-mime").first


def cell_point(grid, row: int, col: int) -> tuple[float, float]:
    overlay = grid.locator("canvas.pipatch-overlay")
    overlay.scroll_into_view_if_needed()
    box = overlay.bounding_box()
    rows, cols = int(grid.get_attribute("data-rows")), int(grid.get_attribute("data-cols"))
    return box["x"] + (col + 0.5) * box["width"] / cols, box["y"] + (row + 0.5) * box["height"] / rows


def hover_text(page, grid, row: int, col: int) -> str:
    """Hover cell ``(row, col)`` of ``grid`` and return its tooltip's text once shown."""
    page.mouse.move(*cell_point(grid, row, col))
    tip = grid.locator(".pipatch-tooltip")
    tip.wait_for(state="visible")
    return tip.text_content()


def wait_top5_for_layer(page, grid, layer: int, timeout: float = 120_000) -> None:
    """Until the grid's detail pane names a clicked cell of ``layer`` and shows the kernel's top-5."""
    page.wait_for_function(
        """([g, label]) => {
            const head = g.querySelector('.pipatch-detail-head');
            const toks = g.querySelectorAll('table.pipatch-top .pipatch-top-token');
            return !!head && head.textContent.includes(label) && toks.length === 5;
        }""",
        arg=[grid.element_handle(), f"layer: {layer} ·"], timeout=timeout)


def wait_rows_streaming(page, cell_index: int, timeout: float) -> int:
    """Wait until the live grid of a cell shows 1 ≤ rows done < rows while running."""
    handle = page.wait_for_function(
        """(i) => {
            const cell = document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell')[i];
            const g = cell && cell.querySelector('.pipatch-grid[data-status="running"]');
            if (!g || g.closest('.pipatch-mime')) return false;
            const st = g.querySelector('.pipatch-status');
            const m = st && /(\\d+) \\/ (\\d+) rows/.exec(st.textContent || '');
            return m && +m[1] >= 1 && +m[1] < +m[2] ? st.textContent : false;
        }""",
        arg=cell_index,
        timeout=timeout,
    )
    text = handle.json_value()
    done, total = map(int, re.search(r"(\d+) / (\d+) rows", text).groups())
    assert text.startswith("running") and 1 <= done < total
    return done
