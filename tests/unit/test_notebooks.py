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

from pathlib import Path

import nbformat

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_notebooks_are_committed_without_outputs():
    """Outputs belong to a run, not to the repository: every committed code cell is clean."""
    assert NOTEBOOKS, "no notebooks found"
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        dirty = [i for i, cell in enumerate(nb.cells)
                 if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)]
        assert not dirty, f"{path.name}: cells {dirty} have outputs; clear them before committing"
