"""Where the subject is: a subject whose text occurs twice is refused in one line naming both
occurrences, and ``occurrence=`` picks one (pipatch._experiments._inputs.subject_positions)."""

from __future__ import annotations

import pytest

from pipatch._experiments._inputs import subject_positions
from pipatch._model.models import PipatchError

PROMPT = "Paris is in France, and Paris is a city"
WORDS = ["Paris", " is", " in", " France", ",", " and", " Paris", " is", " a", " city"]


def offsets(words: list[str]) -> list[tuple[int, int]]:
    out, at = [], 0
    for word in words:
        out.append((at, at + len(word)))
        at += len(word)
    return out


def locate(subject, occurrence=None):
    return subject_positions(subject, PROMPT, WORDS, offsets(WORDS), occurrence)


def test_a_subject_that_occurs_once_needs_no_occurrence():
    assert locate("France") == [3]
    assert locate("France", "first") == locate("France", "last") == locate("France", 0) == [3]


def test_an_ambiguous_subject_is_refused_in_one_line_naming_both_occurrences():
    with pytest.raises(PipatchError) as refused:
        locate("Paris")
    line = str(refused.value)
    assert "\n" not in line and "occurs 2 times" in line
    assert "token 0 'Paris'" in line and "token 6 ' Paris'" in line
    assert "occurrence=0" in line and "'first' / 'last'" in line


@pytest.mark.parametrize(("occurrence", "want"), [(0, [0]), (1, [6]), ("1", [6]), ("first", [0]), ("last", [6])])
def test_occurrence_picks_one(occurrence, want):
    assert locate("Paris", occurrence) == want


@pytest.mark.parametrize(("occurrence", "words"), [(2, "occurrence=2, but subject 'Paris' occurs 2 times"),
                                                   (-1, "occurrence"), ("middle", "not an occurrence"),
                                                   (True, "occurrence")])
def test_a_bad_occurrence_is_one_line(occurrence, words):
    with pytest.raises(PipatchError, match=words):
        locate("Paris", occurrence)


def test_occurrence_with_token_indices_is_refused():
    assert locate([0, 6]) == [0, 6]
    with pytest.raises(PipatchError, match="with token indices, leave it out"):
        locate([0], occurrence=0)
