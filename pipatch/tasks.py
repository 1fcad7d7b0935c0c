"""Task generators for circuit discovery: datasets of clean/corrupt pairs from two papers.

Each function returns a :class:`TaskSet`, a small read-only mapping with exactly the keys
``clean``, ``corrupt``, ``answer`` and ``foil`` (lists of ``n`` strings), so it splats straight
into any pair experiment, which averages over the list as a dataset::

    task = pipatch.tasks.ioi(8, seed=0, tokenizer=model.tokenizer)
    pipatch.patch(model, site="head", **task)       # which heads restore the answer
    pipatch.attribute(model, site="head", **task)   # the same, by attribution patching
    pipatch.path_patch(model, sender=("head", 9, 9), **task)
    pipatch.circuit(model, **task)                   # the circuit: every edge scored, the top ones checked

* :func:`ioi`, Indirect Object Identification (Wang et al. 2022, "Interpretability in the
  Wild"): "Then, Mary and John went to the store. John gave a book to" → " Mary". Mary is the
  indirect object (IO), John the subject (S), named twice (S1, then S2 before the verb). Half
  the pairs are ABBA (IO first), half BABA (S first). The corruption is a name flip: S2 becomes
  the IO ("... Mary gave a book to"), so the right completion becomes " John".
* :func:`greater_than` (Hanna et al. 2023, "How does GPT-2 compute greater-than?"): "The war
  lasted from the year 1732 to the year 17" → a year after 32. The corruption ends the start
  year in "01", which leaves every two-digit year possible.

``answer`` is the clean prompt's right completion and ``foil`` the rival one; both stay the
clean pair's in the corrupt run. The metric ``logit_diff`` (answer − foil) is then positive on
the clean prompt and low (for IOI negative) on the corrupt one, and a patch's recovery says
how much of the clean behaviour a site brings back. :meth:`TaskSet.records` adds each pair's
fields (template, order, names, year) for grouping results.

Pass ``tokenizer=`` (a Hugging Face tokenizer, e.g. ``model.tokenizer``) to keep only the
words whose use gives the clean and corrupt prompts the same number of tokens, and answers and
IOI's answers and foils of one known token each; generation is deterministic for a given ``seed``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, ItemsView, Iterator, KeysView, Mapping, ValuesView
from typing import Any

from ._base.checks import whole_number
from ._model.models import PipatchError

__all__ = ["TaskSet", "greater_than", "ioi"]

_KEYS = ("clean", "corrupt", "answer", "foil")

# {A} is named first, {B} second; {S2} is the subject's second mention, right before the verb.
_IOI_TEMPLATES = [
    "Then, {A} and {B} went to the {place}. {S2} gave a {object} to",
    "When {A} and {B} went to the {place}, {S2} gave a {object} to",
    "After {A} and {B} went to the {place}, {S2} gave a {object} to",
    "Before {A} and {B} went to the {place}, {S2} gave a {object} to",
    "Then, {A} and {B} had a long day at the {place}. {S2} gave a {object} to",
    "When {A} and {B} got a {object} at the {place}, {S2} decided to give it to",
    "After the lunch, {A} and {B} went to the {place}. {S2} gave a {object} to",
    "Then, {A} and {B} were working at the {place}. {S2} decided to give a {object} to",
    "While {A} and {B} were at the {place}, {S2} gave a {object} to",
    "Friends {A} and {B} found a {object} at the {place}. {S2} gave it to",
    "Then, {A} and {B} were thinking about going to the {place}. {S2} wanted to give a {object} to",
    "When {A} and {B} arrived at the {place}, {S2} handed a {object} to",
    "Before {A} and {B} left the {place}, {S2} gave a {object} to",
    "Then, {A} and {B} had a lot of fun at the {place}. {S2} gave a {object} to",
    "After {A} and {B} spent the day at the {place}, {S2} offered a {object} to",
]
_NAMES = ["Mary", "John", "Tom", "Anna", "Alice", "Bob", "James", "Sarah", "David", "Emma",
          "Michael", "Laura", "Daniel", "Kate", "Paul", "Lisa", "Mark", "Susan", "Peter", "Linda"]
_PLACES = ["store", "school", "park", "office", "hospital", "kitchen", "city", "station",
           "restaurant", "garden", "library", "house", "beach", "museum"]
_OBJECTS = ["book", "ball", "banana", "guitar", "basketball", "football", "drink", "ring",
            "necklace", "snack", "computer", "bottle", "gift", "letter"]  # no vowel: "a {object}"
_NOUNS = ["war", "dynasty", "expedition", "empire", "reign", "occupation", "drought", "plague",
          "famine", "revolution", "siege", "conflict", "rebellion", "crisis", "pilgrimage"]
_GT_TEMPLATE = "The {noun} lasted from the year {XX}{YY} to the year {XX}"


class TaskSet(Mapping):
    """``n`` clean/corrupt pairs with their answers and foils, read-only.

    As a mapping it has exactly the keys ``clean``, ``corrupt``, ``answer``, ``foil`` (each a
    fresh list of ``n`` strings), so ``pipatch.patch(model, **task)`` works; ``len(task)`` is
    ``n``, the number of pairs (not the number of keys), and :meth:`records` gives one dict
    per pair with the task's own fields too.
    """

    __slots__ = ("_name", "_records")

    def __init__(self, name: str, records: list[dict[str, Any]]):
        if not all(isinstance(r.get(key), str) for r in records for key in _KEYS):
            raise PipatchError(f"every record of a TaskSet needs the text fields {', '.join(_KEYS)}")
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_records", tuple(dict(r) for r in records))

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("a TaskSet is read-only: build a new one")

    @property
    def name(self) -> str:
        """The task's name: ``"ioi"`` or ``"greater_than"``."""
        return self._name

    def __getitem__(self, key: str) -> list[str]:
        if key not in _KEYS:
            raise KeyError(key)
        return [r[key] for r in self._records]

    def __iter__(self) -> Iterator[str]:
        return iter(_KEYS)

    def __len__(self) -> int:
        return len(self._records)

    def keys(self) -> KeysView[str]:
        return dict.fromkeys(_KEYS).keys()

    def items(self) -> ItemsView[str, list[str]]:
        return {key: self[key] for key in _KEYS}.items()

    def values(self) -> ValuesView[list[str]]:
        return {key: self[key] for key in _KEYS}.values()

    def __reduce__(self) -> tuple[Any, ...]:
        return TaskSet, (self._name, self.records())

    def records(self) -> list[dict[str, Any]]:
        """One dict per pair: clean, corrupt, answer, foil and the task's own fields."""
        return [dict(r) for r in self._records]

    def __repr__(self) -> str:
        if not self._records:
            return f"TaskSet({self._name!r}, n=0)"
        first = self._records[0]
        return (f"TaskSet({self._name!r}, n={len(self)})\n  clean:   {first['clean']!r}\n"
                f"  corrupt: {first['corrupt']!r}\n  answer:  {first['answer']!r}  foil: {first['foil']!r}")


def _counter(tokenizer: Any) -> Callable[[str], list[int]] | None:
    if tokenizer is None:
        return None
    if not callable(tokenizer):
        raise PipatchError(f"tokenizer must be a Hugging Face tokenizer (e.g. model.tokenizer), got {tokenizer!r}")
    return lambda text: list(tokenizer(text, add_special_tokens=False).input_ids)


def _one_token(ids: Callable[[str], list[int]] | None, unk: int | None, text: str) -> bool:
    if ids is None:
        return True
    found = ids(text)
    return len(found) == 1 and found[0] != unk


def _known(ids: Callable[[str], list[int]] | None, unk: int | None, word: str) -> bool:
    return ids is None or unk is None or unk not in ids(" " + word)


def _sample(n: int, seed: int, what: str, draw: Callable[[random.Random, int], dict[str, Any]],
            fits: Callable[[dict[str, Any]], bool], possible: int, fix: str) -> list[dict[str, Any]]:
    """``n`` distinct pairs by drawing at random and keeping those that fit the tokenizer."""
    if possible < n:
        raise PipatchError(f"{what}: only {possible} distinct pairs can be built, {n} asked: {fix}")
    rng, out, seen = random.Random(seed), [], set()
    for _ in range(50 * n + 2000):
        if len(out) == n:
            break
        record = draw(rng, len(out))
        if record["clean"] in seen:
            continue
        seen.add(record["clean"])
        if fits(record):
            out.append(record)
    if len(out) < n:
        raise PipatchError(f"{what}: found only {len(out)} of {n} pairs that tokenize alike: {fix}")
    return out


def ioi(n: int, seed: int = 0, *, tokenizer: Any = None, template: int | None = None) -> TaskSet:
    """``n`` Indirect Object Identification pairs (Wang et al. 2022), half ABBA, half BABA.

    Pair ``i`` is ABBA ("Then, Mary and John went to the store. John gave a book to") when
    ``i`` is even and BABA ("Then, John and Mary went ...") when odd. The answer is the IO
    (" Mary"), the foil the subject (" John"); the corrupt prompt names the IO at S2 ("... Mary
    gave a book to"), so its right completion is the foil. With ``tokenizer``, only names that
    are one token with a leading space, known places and objects, and pairs whose clean and
    corrupt prompts have equal token counts are used. ``records()`` adds ``template`` (its
    ABBA or BABA form), ``order``, ``io``, ``s``, ``place`` and ``object``.

    ``template`` (0 – 14) puts every pair in one of Wang et al.'s templates instead of drawing
    one per pair; with ``tokenizer`` its places and objects are then one-token words too, so
    every prompt has one length in tokens (what ``circuit(..., ablation="mean")`` needs).

    Raises :class:`PipatchError` for a bad ``n``, ``seed`` or ``template``, or when the tokenizer
    leaves too few words for ``n`` distinct pairs.
    """
    n, seed = whole_number(n, "n", minimum=1), whole_number(seed, "seed", minimum=None)
    if template is not None:
        template = whole_number(template, f"template (an index into the {len(_IOI_TEMPLATES)} IOI templates)",
                                minimum=0)
        if template >= len(_IOI_TEMPLATES):
            raise PipatchError(f"template {template} is not one of the {len(_IOI_TEMPLATES)} IOI templates: pass 0 to "
                               f"{len(_IOI_TEMPLATES) - 1}, or None to draw one per pair")
    ids = _counter(tokenizer)
    unk = getattr(tokenizer, "unk_token_id", None)
    word = _known if template is None else (lambda ids, unk, w: _one_token(ids, unk, " " + w))
    names = [w for w in _NAMES if _one_token(ids, unk, " " + w)]
    places = [w for w in _PLACES if word(ids, unk, w)]
    objects = [w for w in _OBJECTS if word(ids, unk, w)]
    forms = _IOI_TEMPLATES if template is None else [_IOI_TEMPLATES[template]]
    if len(names) < 2 or not places or not objects:
        raise PipatchError(f"ioi: the tokenizer keeps {len(names)} names as one token, {len(places)} places and "
                           f"{len(objects)} objects as known words; need 2, 1 and 1: use the model's own tokenizer")

    def draw(rng: random.Random, i: int) -> dict[str, Any]:
        t = rng.randrange(len(forms))
        io, s = rng.sample(names, 2)
        place, obj = rng.choice(places), rng.choice(objects)
        order = "ABBA" if i % 2 == 0 else "BABA"
        form = forms[t] if order == "ABBA" else forms[t].replace("{A}", "{X}").replace(
            "{B}", "{A}").replace("{X}", "{B}")
        words = dict(A=io, B=s, place=place, object=obj)
        return dict(clean=form.format(S2=s, **words), corrupt=form.format(S2=io, **words), answer=" " + io,
                    foil=" " + s, template=form.replace("{S2}", "{B}"), order=order, io=io, s=s, place=place,
                    object=obj)

    def fits(r: dict[str, Any]) -> bool:
        return ids is None or len(ids(r["clean"])) == len(ids(r["corrupt"]))

    # Per order: ABBA pairs take the even slots, BABA the odd ones, so n fits when n ≤ 2 × this.
    per_order = len(forms) * len(names) * (len(names) - 1) * len(places) * len(objects)
    return TaskSet("ioi", _sample(n, seed, "ioi", draw, fits, 2 * per_order, "ask for fewer pairs, or use a "
                                  "tokenizer that keeps more names one token"))


def greater_than(n: int, seed: int = 0, *, tokenizer: Any = None) -> TaskSet:
    """``n`` greater-than pairs (Hanna et al. 2023): "The war lasted from the year 1732 to the year 17".

    XX is 11..17, YY 02..98; the corrupt prompt ends the start year in "01". The answer is the
    year after YY (``"33"``) and the foil the year before (``"31"``), with no leading space (they
    follow "17" directly): a two-sided stand-in for the paper's metric, the probability of every
    later year minus that of every earlier one, that fits ``logit_diff``. A tokenizer that
    splits numbers into digits (Gemma's) makes the answer two tokens, read teacher-forced (the
    metric is then ``logprob_diff``). With ``tokenizer``, only known nouns and years, and pairs
    whose clean and corrupt prompts have equal token counts are used. ``records()`` adds ``noun`` and ``year``
    (the full start year, an ``int``).

    Raises :class:`PipatchError` for a bad ``n`` or ``seed``, or when the tokenizer leaves too
    few nouns or years for ``n`` distinct pairs.
    """
    n, seed = whole_number(n, "n", minimum=1), whole_number(seed, "seed", minimum=None)
    ids = _counter(tokenizer)
    unk = getattr(tokenizer, "unk_token_id", None)
    nouns = [w for w in _NOUNS if _known(ids, unk, w)]
    endings = [y for y in range(2, 99) if ids is None or unk is None
               or all(unk not in ids(f"{y + d:02d}") for d in (1, -1))]
    if not nouns or not endings:
        raise PipatchError(f"greater_than: the tokenizer keeps {len(nouns)} nouns as known words and {len(endings)} "
                           f"years with known two-digit answers; need 1 of each: use the model's own tokenizer")

    def draw(rng: random.Random, i: int) -> dict[str, Any]:
        noun, xx, yy = rng.choice(nouns), rng.randrange(11, 18), rng.choice(endings)
        return dict(clean=_GT_TEMPLATE.format(noun=noun, XX=xx, YY=f"{yy:02d}"),
                    corrupt=_GT_TEMPLATE.format(noun=noun, XX=xx, YY="01"), answer=f"{yy + 1:02d}",
                    foil=f"{yy - 1:02d}", noun=noun, year=100 * xx + yy)

    def fits(r: dict[str, Any]) -> bool:
        return ids is None or len(ids(r["clean"])) == len(ids(r["corrupt"]))

    return TaskSet("greater_than", _sample(n, seed, "greater_than", draw, fits, len(nouns) * 7 * len(endings),
                                           "ask for fewer pairs, or use a tokenizer that splits more years alike"))
