"""The one whole-number / yes-no validator (pipatch._base.checks) and the parameters that use it."""

from __future__ import annotations

import re

import pytest

import pipatch
from pipatch._model.models import PipatchError

# --------------------------------------------------------------------------------------------
# The parameters that use them (a tiny random model: the checks run before any forward)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    from tests._tiny import tiny_model

    return tiny_model("llama")


TRACE = {"subject": "Colosseum", "answer": " Paris"}
PAIR = {"clean": "The Colosseum is in the city of", "corrupt": "The Kremlin is in the city of",
        "answer": " Paris", "foil": " Rome"}  # the same length in the tiny tokenizer


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: pipatch.trace(m, PAIR["clean"], **TRACE, seeds=True), "seeds must be a whole number ≥ 1, got True"),
        (lambda m: pipatch.trace(m, PAIR["clean"], **TRACE, window=2.0), "window must be a whole number ≥ 1, got 2.0"),
        (lambda m: pipatch.trace(m, PAIR["clean"], **TRACE, fast="maybe"), "fast must be True or False, got 'maybe'"),
        (lambda m: pipatch.trace(m, PAIR["clean"], **TRACE, control=1), "control must be True or False, got 1"),
        (lambda m: pipatch.patch(m, **PAIR, batch_size=0), "batch_size must be a whole number ≥ 1, got 0"),
        (lambda m: pipatch.patch(m, **PAIR, fast=None), "fast must be True or False, got None"),
        (lambda m: pipatch.patch(m, **PAIR, positions=[1.0]), "position must be a whole number, got 1.0"),
        (lambda m: pipatch.attribute(m, **PAIR, verify=-1),
         "verify (the cells to check with real patches) must be a whole number ≥ 0, got -1"),
        (lambda m: pipatch.path_patch(m, **PAIR, sender=("head", 0, 9)), "sender head 9 is out of range: use 0..3"),
        (lambda m: pipatch.path_patch(m, **PAIR, sender=("head", False, 0)),
         re.compile(r"sender layer must be a whole number in 0\.\.\d+, got False")),
    ],
)
def test_bad_parameters_are_refused_in_one_line(tiny, call, message):
    with pytest.raises(PipatchError) as info:
        call(tiny)
    if isinstance(message, re.Pattern):
        assert message.fullmatch(str(info.value)), str(info.value)
    else:
        assert str(info.value) == message


def test_text_numbers_are_taken_where_ints_are(tiny):
    """Text that reads as a number is the number (as on the command line): seeds='2' runs 2 seeds."""
    result = pipatch.trace(tiny, PAIR["clean"], **TRACE, seeds="2", window="1", kind="resid")
    assert result.n_seeds == 2 and result.meta["window"] == 1


def test_a_malformed_click_is_answered_with_an_error(tiny):
    from pipatch._notebook.live import answer_selection

    result = pipatch.patch(tiny, **PAIR, positions=[-1])
    detail = answer_selection(None, result, {"view": "resid", "seed": -1, "row": "x", "col": 0})
    assert detail["error"] == "not a cell: row must be a whole number, got 'x'"
    detail = answer_selection(None, result, {"view": "resid", "seed": -1, "row": 9, "col": 0})
    assert detail["error"] == "no cell (row 9, col 0, seed -1) in this grid"
