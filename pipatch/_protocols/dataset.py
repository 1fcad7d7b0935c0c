"""Averages over many prompts: a dataset of facts rather than one cherry-picked example.

Prompts of different token lengths cannot be averaged position by position: position 3 is the
subject in one prompt and a verb in the next. Following ROME's averaged figures, each prompt's
columns are first mapped to **named positions** —

========================  =============================================================
``before``                tokens before the subject (or the changed span)
``first subject``         its first token
``middle subject``        tokens strictly inside it (absent for one- and two-token subjects)
``last subject``          its last token (a one-token subject is both first and last)
``first after``           the first token after it, unless that is the last token
``further``               tokens between that and the last token
``last``                  the last token, where the prediction is read
========================  =============================================================

— averaging the raw metric within a group, and then every (prompt, seed) becomes one row of
the result's seed axis, each normalized against *its own* clean and corrupt baselines. The
mean over those rows is the dataset's normalized recovery and their standard deviation the
spread over prompts and seeds. A prompt without some group (no middle subject tokens, say)
contributes NaN there, which the mean skips.

For activation patching the "subject" is the span where the clean and corrupt tokens differ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._models import PipatchError
from .._result import Result

GROUPS = ("before", "first {s}", "middle {s}", "last {s}", "first after", "further", "last")


def named_groups(span: list[int], T: int, noun: str = "subject") -> tuple[list[str], list[list[int]]]:
    """Column names and, for each, the positions of a ``T``-token prompt that fall in it."""
    a, b = min(span), max(span)
    last = T - 1
    groups = [
        [p for p in range(0, a)],
        [a],
        [p for p in range(a + 1, b)],
        [b],
        [b + 1] if b + 1 < last else [],
        [p for p in range(b + 2, last)],
        [last] if last > b else [],
    ]
    return [g.format(s=noun) for g in GROUPS], groups


def _grouped(raw: torch.Tensor, groups: list[list[int]]) -> torch.Tensor:
    """[S, L, T] → [S, L, len(groups)]: mean over each group's positions (NaN when empty)."""
    S, L, _ = raw.shape
    out = torch.full((S, L, len(groups)), float("nan"))
    for k, positions in enumerate(groups):
        if positions:
            out[:, :, k] = raw[:, :, positions].mean(-1)
    return out


def combine(results: list[Result], spans: list[list[int]] | None, noun: str) -> Result:
    """Stack per-prompt results into one dataset result (see the module docstring)."""
    first = results[0]
    head_grid = first.meta.get("site") == "head" and first.kind == "patch"
    raws: dict[str, list[torch.Tensor]] = {view: [] for view in first.views}
    clean_rows, corrupt_rows = [], []
    columns = first.columns
    for index, result in enumerate(results):
        if result.views != first.views:
            raise PipatchError("every prompt of a dataset must be swept over the same views")
        S = result.n_seeds
        for view in result.views:
            if head_grid:
                raws[view].append(result.raw[view])
            else:
                columns, groups = named_groups(spans[index], len(result.tokens), noun)
                raws[view].append(_grouped(result.raw[view], groups))
        clean_rows.append(torch.full((S,), float(result.clean)))
        corrupt_rows.append(result.corrupt.float())
    meta = dict(first.meta)
    meta.update({
        "dataset": True,
        "prompts": [r.meta.get("prompt") or r.meta.get("clean_prompt") for r in results],
        "rows_per_prompt": [r.n_seeds for r in results],
        "per_prompt_clean": [float(r.clean) for r in results],
        "per_prompt_corrupt": [r.corrupt.tolist() for r in results],
        "elapsed": sum(float(r.meta.get("elapsed", 0.0)) for r in results),
    })
    statuses = [r.status for r in results]
    status = next((s for s in statuses if s != "done"), "done")
    warnings = [f"prompt {i}: {w}" for i, r in enumerate(results) for w in r.warnings]
    return Result(
        kind=first.kind, tokens=list(columns), columns=list(columns), layers=first.layers, metric=first.metric,
        raw={view: torch.cat(parts) for view, parts in raws.items()}, clean=torch.cat(clean_rows),
        corrupt=torch.cat(corrupt_rows), meta=meta,
        rows_done={view: min(r.rows_done.get(view, 0) for r in results) for view in first.views},
        status=status, message=next((r.message for r in results if r.message), ""), warnings=warnings,
    )


def _per_prompt(value: Any, n: int, what: str) -> list[Any]:
    if isinstance(value, (list, tuple)) and not (what == "subject" and value and isinstance(value[0], int)):
        if len(value) != n:
            raise PipatchError(f"{len(value)} {what}s for {n} prompts: pass one {what} per prompt, or one for all")
        return list(value)
    return [value] * n


def trace_many(model, prompts: Sequence[str], *, subject, answer, on_row: Callable | None = None,
               stop: Any = None, **kwargs) -> Result:
    """Causal tracing averaged over ``prompts`` (``subject`` / ``answer``: one, or one per prompt)."""
    from .tracing import trace

    if not prompts:
        raise PipatchError("the list of prompts is empty: pass at least one prompt")
    subjects, answers = _per_prompt(subject, len(prompts), "subject"), _per_prompt(answer, len(prompts), "answer")
    results: list[Result] = []
    for prompt, subj, ans in zip(prompts, subjects, answers):
        result = trace(model, prompt, subject=subj, answer=ans, stop=stop, **kwargs)
        results.append(result)
        _notify(on_row, combine(results, [r.meta["subject_positions"] for r in results], "subject"))
        if result.status != "done":
            break
    return combine(results, [r.meta["subject_positions"] for r in results], "subject")


def patch_many(model, pairs: Sequence[tuple[str, str]], *, answer, foil=None, on_row: Callable | None = None,
               stop: Any = None, **kwargs) -> Result:
    """Activation patching averaged over ``(clean, corrupt)`` pairs (``answer``/``foil``: one or one per pair)."""
    from .patching import patch

    if not pairs:
        raise PipatchError("the list of prompt pairs is empty: pass at least one (clean, corrupt) pair")
    answers, foils = _per_prompt(answer, len(pairs), "answer"), _per_prompt(foil, len(pairs), "foil")
    results, spans = [], []
    for pair, ans, fl in zip(pairs, answers, foils):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise PipatchError(f"{pair!r} is not a (clean, corrupt) pair")
        clean, corrupt = pair
        result = patch(model, clean=clean, corrupt=corrupt, answer=ans, foil=fl, stop=stop, **kwargs)
        changed = [i for i, (a, b) in enumerate(zip(result.meta["clean_tokens"], result.meta["corrupt_tokens"]))
                   if a != b]
        spans.append(changed or [len(result.tokens) - 1])
        results.append(result)
        _notify(on_row, combine(results, spans, "changed"))
        if result.status != "done":
            break
    return combine(results, spans, "changed")


def _notify(on_row: Callable | None, partial: Result) -> None:
    if on_row is None:
        return
    for view in partial.views:
        for layer in range(len(partial.layers)):
            on_row(partial, view, layer)
