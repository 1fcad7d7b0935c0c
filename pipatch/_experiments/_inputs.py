"""Checking and tokenizing what a researcher passes in; every problem is one clear line."""

from __future__ import annotations

import functools
import os
import unicodedata
from collections.abc import Sequence
from typing import Any

import torch

from .._base.checks import whole_number
from .._base.errors import warn
from .._model.cells import Metric
from .._model.declare import Param, positive_int
from .._model.declare import positions as parse_positions
from .._model.models import PipatchError
from .._results.result import load_result, recovery_undefined


def scored_elsewhere(value: Any, experiment: str, result_type: type) -> Any:
    """``scores=``: the result of ``pipatch.<experiment>`` computed on a model that takes
    gradients (a result of ``result_type``, or the file it was saved to), for a backend that
    takes none (vLLM, served, NDIF) to check by exact patches. Anything else is one line."""
    found = load_result(value) if isinstance(value, (str, os.PathLike)) else value
    if not isinstance(found, result_type) or found.kind != experiment:
        raise PipatchError(f"scores={type(value).__name__}: give the result of pipatch.{experiment} (or the file it "
                           "was saved to) computed on a model that takes gradients (backend='transformers')")
    return found


def _refuse_surrogates(text: str, what: str) -> None:
    """A lone surrogate is not text a tokenizer can read (nor UTF-8): refuse it here, in one
    line, rather than with the tokenizer's ``TypeError``."""
    lone = next((i for i, ch in enumerate(text) if 0xD800 <= ord(ch) <= 0xDFFF), None)
    if lone is not None:
        raise PipatchError(
            f"the {what} holds the surrogate code point U+{ord(text[lone]):04X} at character {lone}, which is "
            "not text (it cannot be encoded as UTF-8): remove it, or replace it with U+FFFD"
        )


def encode(backend, text: str, what: str = "prompt") -> tuple[torch.Tensor, list[str], list[tuple[int, int]]]:
    """Tokenize ``text`` → (ids [1, T] on the model's device, token strings, character offsets)."""
    if not isinstance(text, str):
        raise PipatchError(f"the {what} must be text (a str), got {type(text).__name__}: pass e.g. "
                           "'The Eiffel Tower is in the city of'")
    if not text.strip():
        raise PipatchError(f"the {what} is empty: pass the text to run, e.g. 'The Eiffel Tower is in the city of'")
    _refuse_surrogates(text, what)
    tok = backend.tokenizer
    try:
        enc = tok(text, return_offsets_mapping=True)
        offsets = [tuple(o) for o in enc["offset_mapping"]]
    except (NotImplementedError, TypeError, ValueError):
        enc = tok(text)
        offsets = []
    ids = list(enc["input_ids"])
    limit = backend.context_length
    if limit and len(ids) > limit:
        raise PipatchError(
            f"the {what} is {len(ids)} tokens, longer than the model's context of {limit}: shorten it"
        )
    tokens = backend.decode(ids)
    return torch.tensor([ids], device=backend.device), tokens, offsets


def answer_ids(backend, text: str, role: str, prompt: str | None = None) -> tuple[int, ...]:
    """The token ids of an answer or foil: one token (" Paris") or several (" New York").

    A multi-token answer is read teacher-forced (:class:`~pipatch._model.cells.Metric`); the text is
    tokenized on its own, without special tokens, as it would follow the prompt. Given the
    ``prompt`` it follows, an answer that looks like a word missing its leading space is
    warned about (:func:`word_start_warning`).
    """
    if not isinstance(text, str):
        raise PipatchError(f"the {role} must be text (a str), got {type(text).__name__}: e.g. ' Paris'")
    if text == "":
        raise PipatchError(f"the {role} is empty: pass the text that follows the prompt, e.g. ' Paris' "
                           "(mind the leading space)")
    _refuse_surrogates(text, role)
    ids = backend.tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise PipatchError(f"the {role} {text!r} is no token at all for this tokenizer: pass visible text, e.g. ' Paris'")
    line = None if prompt is None else word_start_warning(backend, text, role, prompt, len(ids))
    if line is not None:
        warn(line)
    return tuple(int(i) for i in ids)


#: How a tokenizer marks a token that starts a word (SentencePiece ``▁``, GPT-2's byte ``Ġ``).
WORD_START_MARKS = ("▁", "Ġ")


def word_start_warning(backend, text: str, role: str, prompt: str, n_tokens: int) -> str | None:
    """The one line warning that ``text`` (``n_tokens`` tokens on its own) is a word missing
    its leading space, else ``None``. Tokenizers read ``"Paris"`` as the inside of a word and
    ``" Paris"`` as the word after a space, which is what a model predicts after
    ``"... the city of"``; the metric of the bare spelling reads another token, silently. The
    check is the tokenizer's alone (no forward pass): the text starts with a letter or digit,
    the prompt does not end in whitespace, and the spaced spelling is no more tokens than the
    bare one (so it is the tokenizer's usual word; ``" 1945"`` split into more pieces is not).
    Wide (CJK) characters are left alone: their scripts are written without spaces."""
    if (not text[0].isalnum() or text[0] in WORD_START_MARKS or not prompt or prompt[-1].isspace()
            or unicodedata.east_asian_width(text[0]) in ("W", "F")):
        return None
    spaced = " " + text
    if len(backend.tokenizer(spaced, add_special_tokens=False)["input_ids"]) > n_tokens:
        return None
    return (f"the {role} {text!r} has no leading space: a model predicts the next word with its space "
            f"({spaced!r}), so {text!r} scores a word piece; pass {role}={spaced!r} (or end the prompt with a space)")


def check_run_length(backend, input_ids: torch.Tensor, metric: Metric) -> None:
    """Refuse a prompt + answer that does not fit the model's context, in one line."""
    limit = backend.context_length
    total = input_ids.shape[1] + metric.n_read - 1
    if limit and total > limit:
        raise PipatchError(f"the prompt and the answer's tokens make {total} tokens, longer than the model's "
                           f"context of {limit}: shorten the prompt or the answer")


def answer_meta(backend, role: str, ids: tuple[int, ...] | None) -> dict[str, Any]:
    """What a result records of an answer or foil's tokens: ids, their text, and (one token)
    the id alone, as results always have."""
    if ids is None:
        return {f"{role}_id": None, f"{role}_ids": None, f"{role}_tokens": None}
    return {f"{role}_id": ids[0] if len(ids) == 1 else None, f"{role}_ids": list(ids),
            f"{role}_tokens": backend.decode(list(ids))}


def subject_positions(subject: str | Sequence[int], prompt: str, tokens: list[str],
                      offsets: list[tuple[int, int]], occurrence: int | str | None = None) -> list[int]:
    """Token positions of the subject: every token overlapping its text, or explicit indices.

    A subject whose text occurs more than once in the prompt is refused in one line naming
    each occurrence's tokens, unless ``occurrence`` picks one: a 0-based index among them, or
    ``"first"`` / ``"last"``."""
    T = len(tokens)
    if isinstance(subject, str):
        if not subject.strip():
            raise PipatchError("the subject is empty: pass the subject's text as it appears in the prompt")
        starts = [i for i in range(len(prompt)) if prompt.startswith(subject, i)]
        if not starts:
            raise PipatchError(f"subject {subject!r} is not in the prompt {prompt!r}: pass text that appears in it verbatim")
        if not offsets:
            raise PipatchError("this tokenizer gives no character offsets: pass the subject as token indices")
        spans = [[i for i, (a, b) in enumerate(offsets) if a < start + len(subject) and b > start and b > a]
                 for start in starts]
        if len(spans) > 1 and occurrence is None:
            where = " and ".join(_span_text(span, tokens) for span in spans)
            raise PipatchError(f"subject {subject!r} occurs {len(spans)} times in the prompt ({where}): pass "
                               f"occurrence=0 for the first, up to {len(spans) - 1}, or 'first' / 'last'")
        found = spans[pick_occurrence(occurrence, len(spans), subject)]
        if not found:
            raise PipatchError(f"subject {subject!r} covers no token of the prompt: pass token indices instead")
        return found
    if occurrence is not None:
        raise PipatchError("occurrence= picks one of the places the subject's text occurs: with token indices, "
                           "leave it out")
    try:
        positions = [int(i) for i in subject]
    except (TypeError, ValueError):
        raise PipatchError("subject must be text or a list of token indices") from None
    if not positions:
        raise PipatchError("the subject's token list is empty: pass at least one index")
    return normalize_positions(positions, T, "subject token index")


def _span_text(span: list[int], tokens: list[str]) -> str:
    """``tokens 3–4 ('ĠEiff', 'el')``: where one occurrence of a subject is."""
    if not span:
        return "no token"
    where = f"token {span[0]}" if len(span) == 1 else f"tokens {span[0]}–{span[-1]}"
    return f"{where} {''.join(tokens[i] for i in span)!r}"


def pick_occurrence(occurrence: int | str | None, n: int, subject: str) -> int:
    """The index of the occurrence ``occurrence`` names among ``n`` (``None``: the only one)."""
    if occurrence is None or occurrence == "first":
        return 0
    if occurrence == "last":
        return n - 1
    if isinstance(occurrence, str):
        try:
            occurrence = int(occurrence)
        except ValueError:
            raise PipatchError(f"occurrence={occurrence!r} is not an occurrence: pass a 0-based index, "
                               "'first' or 'last'") from None
    index = whole_number(occurrence, "occurrence", minimum=0)
    if index >= n:
        times = "once" if n == 1 else f"{n} times"
        raise PipatchError(f"occurrence={index}, but subject {subject!r} occurs {times} in the prompt: pass "
                           f"0{f' to {n - 1}' if n > 1 else ''}, 'first' or 'last'")
    return index


def normalize_positions(positions: Sequence[int], T: int, what: str = "position") -> list[int]:
    out = []
    for p in positions:
        p = whole_number(p, what, minimum=None)  # the range is checked below, with negative indexing spelled out
        if not -T <= p < T:
            raise PipatchError(f"{what} {p} is out of range for a prompt of {T} tokens: use 0..{T - 1} or -{T}..-1")
        out.append(p % T)
    return out


def sweep_positions(positions: Sequence[int] | None, T: int) -> list[int]:
    """The positions a sweep covers: all of a ``T``-token prompt by default, else the checked list."""
    if positions is None:
        return list(range(T))
    cols = normalize_positions(list(positions), T)
    if not cols:
        raise PipatchError("positions is empty: pass at least one position, or omit it for all")
    return cols


def check_choice(value: Any, choices: Sequence[str], what: str) -> str:
    if value not in choices:
        raise PipatchError(f"unknown {what} {value!r}: use one of {', '.join(choices)}")
    return value


def layer_labels(backend) -> list[str]:
    return [str(i) for i in range(backend.adapter.n_layers)]


@functools.cache
def _versions() -> tuple[tuple[str, str], ...]:
    import importlib.metadata as md

    out = []
    for name in ("pipatch", "torch", "nnsight", "transformers"):
        try:
            out.append((name, md.version(name)))
        except md.PackageNotFoundError:
            out.append((name, "?"))
    return tuple(out)


def library_versions() -> dict[str, str]:
    """The versions of pipatch and the libraries that run it (read from disk once per process)."""
    return dict(_versions())


def model_meta(backend) -> dict[str, Any]:
    """What every result records about the model and the libraries that ran it."""
    return {**backend.meta(), "versions": library_versions()}


def undefined_recovery_warning(metric: str, clean: float, corrupt: float) -> list[str]:
    """The warning a result carries when its baselines are (almost) equal, else nothing."""
    if not recovery_undefined(clean, corrupt):
        return []
    return [f"clean and corrupt give (almost) the same {metric} ({clean:.4g} vs {corrupt:.4g}): "
            "normalized recovery is undefined (NaN); raw values are kept — pick prompts that change the answer"]


# --------------------------------------------------------------------------------------------
# Parameters several experiments declare alike (:mod:`pipatch._model.declare`)
# --------------------------------------------------------------------------------------------

#: How cells are batched, and whether the engine takes its exact shortcuts: every experiment's last two.
BATCH_SIZE = Param("batch_size", None, "invokes per nnsight trace (default: about 4,096 token positions per batch)",
                   "int | None", parse=positive_int, shown="auto")
FAST = Param("fast", True, "use the engine's exact shortcuts (skip cells that cannot change anything, reuse the "
             "base run below the patch, unembed one position); False runs every cell in full", "bool",
             python_only=True)

#: ``answer``, ``foil`` and ``metric``, as every clean/corrupt experiment takes them.
PAIR_PARAMS = (
    Param("answer", help="the clean prompt's answer: one token (' Paris') or several (' New York', read "
          "teacher-forced)", annotation="str | Sequence[str]", per_prompt=True),
    Param("foil", None, "the corrupt prompt's answer, e.g. ' Rome' (needed by logit_diff)",
          "str | Sequence[str] | None", per_prompt=True),
)
METRIC = Param("metric", "logit_diff", "logit_diff (answer − foil; with a multi-token answer or foil the "
               "sequences' log-probability difference), prob, logprob or logprob_diff", "str")
SITE = Param("site", "resid", "resid, attn, mlp or head (the grid is then layers × heads)", "str")
OCCURRENCE = Param("occurrence", None, "which occurrence of a subject whose text occurs more than once: 0-based, "
                   "or first / last (refused while ambiguous)", "int | str | None", per_prompt=True, shown="the only one")
POSITIONS = Param("positions", None, "token positions to sweep, e.g. [2, -1] (for site head: where heads are patched)",
                  "Sequence[int] | None", parse=parse_positions, shown="all", flag_help="as a flag: 2,-1")


def pair_title(name: str, meta: dict, how: str) -> str:
    """``Activation patching (denoise, head) · model · ' Paris' vs ' Rome'``: a pair experiment's title."""
    foil = f" vs {meta.get('foil')!r}" if meta.get("foil") else ""
    return f"{name} ({how}) · {meta.get('model', '?')} · {meta.get('answer', '')!r}{foil}"
