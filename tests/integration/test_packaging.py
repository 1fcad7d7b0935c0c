"""The wheel ships the front end, and JupyterLab sees the MIME-renderer extension."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.mark.slow
def test_wheel_ships_the_widget_bundle_and_the_labextension(tmp_path):
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = next(tmp_path.glob("pipatch-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "pipatch/static/widget.js" in names
    modules = {path.relative_to(REPO).as_posix() for path in (REPO / "pipatch").rglob("*.py")}
    assert modules <= set(names), sorted(modules - set(names))  # every layer's package, its modules
    assert {"pipatch/data/known_1000.json", "pipatch/data/known_1000.LICENSE"} <= set(names)  # ROME's facts, licensed
    shared = [n for n in names if "/data/share/jupyter/labextensions/pipatch/" in n]
    assert any(n.endswith("labextensions/pipatch/package.json") for n in shared)
    assert any("/static/remoteEntry." in n and n.endswith(".js") for n in shared)
    assert not any(n.endswith((".pkl", ".pt", ".bin")) for n in names)


def test_jupyter_labextension_list_shows_pipatch_ok():
    out = subprocess.run([str(BIN / "jupyter"), "labextension", "list"], capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    line = next((line for line in text.splitlines() if "pipatch" in line), "")
    assert "pipatch v0.1.0" in line and "enabled" in line and "OK" in line, text
