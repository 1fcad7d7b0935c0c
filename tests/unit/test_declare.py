"""An experiment declared once reaches every front end: a toy experiment kept in a temporary
module (its protocol and its declaration, nothing else) runs through the Python API, the CLI's
``--json``, a cell magic in a real Jupyter kernel and ``PatchGrid.run``, with no file of
pipatch changed; and the old spellings of renamed parameters still work, with a warning."""

from __future__ import annotations

import inspect
import textwrap

import pytest

import pipatch
from pipatch import _declare
from pipatch._models import PipatchError


def test_registering_refuses_a_taken_name_unless_replacing(toy):
    import dataclasses

    other = dataclasses.replace(toy, kind="other_kind")
    with pytest.raises(PipatchError, match="registered already"):
        _declare.register(other)
    assert _declare.register(toy) is toy  # the same declaration again: nothing changes


def test_the_docstring_and_signature_teach_every_parameter():
    text = textwrap.dedent(pipatch.trace.__doc__)
    assert text.startswith("Causal tracing (ROME)") and "Returns\n-------" in text
    params = inspect.signature(pipatch.trace).parameters
    assert params["seeds"].default == 10 and params["window"].default == 10 and params["sites"].default == "resid"
    assert params["subject"].default is inspect.Parameter.empty
