"""An experiment declared once reaches every front end: a toy experiment kept in a temporary
module (its protocol and its declaration, nothing else) runs through the Python API, the CLI's
``--json``, a cell magic in a real Jupyter kernel and ``PatchGrid.run``, with no file of
pipatch changed; and the old spellings of renamed parameters still work, with a warning."""

from __future__ import annotations

import inspect
import textwrap

import pytest

import pipatch
from pipatch._model import declare as _declare
from pipatch._model.models import PipatchError


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


def test_a_pair_or_one_prompt_reaches_every_front_end():
    """feature_circuit takes a pair or one prompt (PromptForm.alternative): the signature, the
    CLI's flags, a magic's body and the keywords bound all offer either, one form at a time."""
    from pipatch._experiments._registry import EXPERIMENTS
    from pipatch.cli import build_parser

    entry = EXPERIMENTS["feature_circuit"]
    form = entry.prompts
    params = inspect.signature(pipatch.feature_circuit).parameters
    assert all(params[f].default is None for f in ("clean", "corrupt", "prompt"))
    assert "prompt : str, optional" in pipatch.feature_circuit.__doc__
    # A magic's body: clean/corrupt lines are a pair, anything else one prompt.
    assert form.from_body("clean: a b\ncorrupt: c d") == {"clean": "a b", "corrupt": "c d"}
    assert form.from_body("The Eiffel Tower is in\n") == {"prompt": "The Eiffel Tower is in"}
    # The CLI: --clean / --corrupt or --prompt, neither required alone.
    flags = build_parser().commands["feature-circuit"]._option_string_actions
    assert not flags["--clean"].required and not flags["--corrupt"].required and not flags["--prompt"].required
    assert form.collect({"clean": None, "corrupt": None, "prompt": ["The Eiffel"]}) == {"prompt": "The Eiffel"}
    bound = entry.bind({"prompt": "p", "saes": "x"})
    assert bound["clean"] is None and bound["corrupt"] is None and bound["prompt"] == "p"
    assert entry.examples(bound) is None
    assert entry.examples(entry.bind({"clean": ["a", "b"], "corrupt": ["c", "d"], "saes": "x"}))[1]["clean"] == "b"
    for given, words in [({"clean": "a", "corrupt": "b", "prompt": "p", "saes": "x"}, "not both"),
                         ({"saes": "x"}, "needs clean= (or prompt=)"), ({"clean": "a", "saes": "x"}, "corrupt=")]:
        with pytest.raises(PipatchError, match=words.replace("(", r"\(").replace(")", r"\)")):
            entry.bind(given)
    with pytest.raises(PipatchError, match="not both"):
        form.collect({"clean": ["a"], "corrupt": ["b"], "prompt": ["p"]})
