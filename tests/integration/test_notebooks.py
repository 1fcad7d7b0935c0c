"""The tutorial notebooks run top to bottom on the embedded model, in a kernel of this Python.

Each notebook is copied to a temporary folder and executed there with nbclient, so outputs (and
any files a notebook writes) never land in the repository. A cell that raises fails the test
with the cell's traceback. Every notebook asserts the claims its text makes, so a passing run
means the prose still matches the numbers.

The kernel: ``kernel_name="python3"`` could resolve to any ``python3`` kernelspec on the machine.
jupyter_client replaces a spec's bare ``python`` with ``sys.executable``, so the kernel is this
interpreter; a first cell injected into the copy checks that (``sys.prefix`` equal to ours), so
a stray global kernelspec cannot make the test run another environment's pipatch.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbclient
import nbformat
import pytest

from tests.unit.test_notebooks import NOTEBOOKS

CELL_TIMEOUT = 600


def _same_interpreter_cell():
    check = (
        "import sys\n"
        f"expected = {sys.prefix!r}\n"
        "assert sys.prefix == expected, f'the kernel runs {sys.executable}, not the environment {expected}'\n"
        "del expected"
    )
    return nbformat.v4.new_code_cell(check)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path: Path, tmp_path: Path):
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, _same_interpreter_cell())
    copy = tmp_path / path.name
    nbformat.write(nb, copy)

    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        allow_errors=False,
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    start = time.perf_counter()
    try:
        client.execute()
    finally:
        # Keep the executed copy beside the temporary input for a failing run's post-mortem.
        nbformat.write(nb, tmp_path / f"{path.stem}.executed.ipynb")
    elapsed = time.perf_counter() - start
    print(f"{path.name}: {elapsed:.0f} s")
    errors = [out for cell in nb.cells if cell.cell_type == "code"
              for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors, errors
