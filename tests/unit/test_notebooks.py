"""The tutorial notebooks are committed without outputs (outputs belong to a run).

Running them top to bottom on the embedded model: ``tests/integration/test_notebooks.py``.
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
