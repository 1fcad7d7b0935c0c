"""pipatch.tasks: IOI and greater-than pair datasets, with and without a tokenizer (no weights)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

import pipatch
from pipatch.tasks import TaskSet, greater_than, ioi
from tests._tiny import WORDS, tiny_tokenizer

KEYS = {"clean", "corrupt", "answer", "foil"}


class WordTokenizer:
    """A fake Hugging Face tokenizer: one token per known word or punctuation mark, else <unk> (0).

    Numbers split into two-digit chunks ("1733" → "17", "33"), except that a chunk of 90 or more
    splits into single digits, so years ending 89..98 tokenize longer than their "01" corruption.
    """

    unk_token_id = 0

    def __init__(self, words):
        self.vocab = {w: i + 1 for i, w in enumerate(dict.fromkeys(words))}

    def _id(self, piece):
        return self.vocab.setdefault(piece, len(self.vocab) + 1) if piece.isdigit() else self.vocab.get(piece, 0)

    def __call__(self, text, add_special_tokens=True):
        ids = []
        for piece in re.findall(r"\d+|\w+|[^\w\s]", text):
            if piece.isdigit():
                chunks = [piece[i : i + 2] for i in range(0, len(piece), 2)]
                ids += [self._id(d) for c in chunks for d in (c if int(c) >= 90 else [c])]
            else:
                ids.append(self._id(piece))
        return SimpleNamespace(input_ids=ids)


def words_of(text):
    return [w.strip(".,") for w in text.split()]


def test_a_taskset_is_a_read_only_mapping_of_four_lists():
    task = ioi(6, seed=0)
    assert isinstance(task, TaskSet) and set(task) == KEYS and set(task.keys()) == KEYS and len(task) == 6
    assert set(dict(**task)) == KEYS and all(len(v) == 6 and all(isinstance(s, str) for s in v)
                                             for v in task.values())
    task["clean"].append("x")  # a fresh list each time
    assert len(task["clean"]) == 6 and dict(task.items()) == {k: task[k] for k in KEYS}
    with pytest.raises(AttributeError):
        task.name = "other"
    with pytest.raises(KeyError):
        task["template"]
    rows = task.records()
    assert [r["clean"] for r in rows] == task["clean"] and {"template", "order", "io", "s"} <= set(rows[0])
    text = repr(task)
    assert "ioi" in text and "n=6" in text and repr(rows[0]["clean"]) in text and repr(rows[0]["answer"]) in text


@pytest.mark.parametrize("make", [ioi, greater_than])
def test_deterministic_per_seed_and_different_across_seeds(make):
    assert make(10, seed=3) == make(10, seed=3) and make(10, seed=3).records() == make(10, seed=3).records()
    assert make(10, seed=3)["clean"] != make(10, seed=4)["clean"]
    for n in (1, 7, 40):
        task = make(n, seed=1)
        assert len(task) == n and all(len(task[k]) == n for k in KEYS)
        assert len(set(task["clean"])) == n  # distinct pairs


def test_ioi_is_balanced_and_corrupts_only_s2_with_the_io():
    task = ioi(40, seed=2)
    orders = [r["order"] for r in task.records()]
    assert orders.count("ABBA") == orders.count("BABA") == 20
    assert ioi(7).records()[-1]["order"] == "ABBA" and [r["order"] for r in ioi(7).records()].count("BABA") == 3
    for r in task.records():
        io, s = r["io"], r["s"]
        assert io != s and r["answer"] == " " + io and r["foil"] == " " + s
        clean, corrupt = words_of(r["clean"]), words_of(r["corrupt"])
        assert len(clean) == len(corrupt)
        changed = [i for i, (a, b) in enumerate(zip(clean, corrupt, strict=True)) if a != b]
        s_at = [i for i, w in enumerate(clean) if w == s]
        assert len(s_at) == 2 and changed == [s_at[1]]  # only S2, the subject's second mention
        assert clean[changed[0]] == s and corrupt[changed[0]] == io
        first = clean.index(io) < clean.index(s)
        assert first == (r["order"] == "ABBA")
        assert r["template"].format(A=io, B=s, place=r["place"], object=r["object"]) == r["clean"]


def test_greater_than_corrupts_the_start_year_and_answers_the_next_year():
    for r in greater_than(50, seed=5).records():
        xx, yy = divmod(r["year"], 100)
        assert 11 <= xx <= 17 and 2 <= yy <= 98
        assert r["clean"] == f"The {r['noun']} lasted from the year {r['year']} to the year {xx}"
        assert r["corrupt"] == r["clean"].replace(str(r["year"]), f"{xx}01")
        assert r["answer"] == f"{yy + 1:02d}" and r["foil"] == f"{yy - 1:02d}" and int(r["answer"]) > int(r["foil"])
        assert not r["answer"].startswith(" ") and isinstance(r["year"], int)


@pytest.mark.parametrize("make", [ioi, greater_than])
@pytest.mark.parametrize("n", [0, -1, 2.5, True, "many", None])
def test_bad_n_is_one_line(make, n):
    with pytest.raises(pipatch.PipatchError) as caught:
        make(n)
    assert "\n" not in str(caught.value) and "n " in str(caught.value)


def test_bad_seed_is_one_line():
    with pytest.raises(pipatch.PipatchError, match="seed") as caught:
        ioi(3, seed="x")
    assert "\n" not in str(caught.value)
    assert ioi(3, seed="5") == ioi(3, seed=5)


def test_with_the_tiny_tokenizer_prompts_align_and_answers_are_one_known_token():
    tok = tiny_tokenizer()
    task = ioi(30, seed=0, tokenizer=tok)
    for r in task.records():
        ids = tok(r["clean"], add_special_tokens=False).input_ids
        assert len(ids) == len(tok(r["corrupt"], add_special_tokens=False).input_ids)
        for word in (r["answer"], r["foil"]):
            one = tok(word, add_special_tokens=False).input_ids
            assert len(one) == 1 and one[0] != tok.unk_token_id
        assert {r["io"], r["s"], r["place"], r["object"]} <= set(WORDS)  # unknown words were dropped
    assert ioi(30, seed=0, tokenizer=tok) == task


def test_a_tokenizer_that_cannot_fit_is_one_line():
    # The tiny vocabulary has no years and none of the nouns.
    with pytest.raises(pipatch.PipatchError, match="greater_than: the tokenizer keeps 0 nouns") as caught:
        greater_than(4, tokenizer=tiny_tokenizer())
    assert "\n" not in str(caught.value)
    # Two names, one place, one object: 15 templates × 2 orders × 2 name orders = 60 prompts.
    few = WordTokenizer(["Tom", "Bob", "store", "book", "Then", "and", "the", "to", "a", "gave", ",", "."])
    assert len(ioi(60, tokenizer=few)) == 60
    with pytest.raises(pipatch.PipatchError, match="ioi: only 60 distinct pairs can be built, 61 asked") as caught:
        ioi(61, tokenizer=few)
    assert "\n" not in str(caught.value)
    with pytest.raises(pipatch.PipatchError, match="keeps 1 names") as caught:
        ioi(2, tokenizer=WordTokenizer(["Tom", "store", "book"]))
    assert "\n" not in str(caught.value)


def test_greater_than_keeps_only_years_that_tokenize_alike():
    tok = WordTokenizer(["The", "war", "plague", "lasted", "from", "the", "year", "to"])
    task = greater_than(60, seed=0, tokenizer=tok)
    assert {r["noun"] for r in task.records()} <= {"war", "plague"}
    for r in task.records():
        assert len(tok(r["clean"]).input_ids) == len(tok(r["corrupt"]).input_ids)
        assert r["year"] % 100 <= 89  # 90..98: the start year splits into digits, the corrupt "01" does not
