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

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .._base.scales import mixed_scales
from .._engine import Plan, Predictor, SiteSweep, Sweep
from .._model.cells import Cell
from .._model.models import PipatchError
from .._results.result import Result
from ._inputs import model_meta

__all__ = ["plan_dataset", "named_groups", "per_prompt", "prompt_groups", "group_means", "position_axis"]

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


def group_means(raw: torch.Tensor, groups: list[list[int]] | None) -> torch.Tensor:
    """[S, L, C] → [S, L, len(groups)]: mean over each group's columns (NaN when empty).
    ``groups=None`` (a head or sender grid): the columns as they are."""
    if groups is None:
        return raw
    S, L, _ = raw.shape
    out = torch.full((S, L, len(groups)), float("nan"))
    for k, positions in enumerate(groups):
        if positions:
            out[:, :, k] = raw[:, :, positions].mean(-1)
    return out


def per_prompt(value: Any, n: int, what: str) -> list[Any]:
    """One value per prompt: a list of ``n`` as is, anything else repeated ``n`` times."""
    if isinstance(value, (list, tuple)) and not (what == "subject" and value and isinstance(value[0], int)):
        if len(value) != n:
            raise PipatchError(f"{len(value)} {what}s for {n} prompts: pass one {what} per prompt, or one for all")
        return list(value)
    return [value] * n


def _span(result: Result) -> tuple[list[int], str]:
    """The positions a prompt's named groups are built around, and what to call them."""
    if "subject_positions" in result.meta:
        return result.meta["subject_positions"], "subject"
    if "clean_tokens" not in result.meta:
        raise PipatchError(f"a list of prompts is averaged over named positions around the subject: pass subject= "
                           f"(once, or once per prompt) to {result.kind}")
    clean, corrupt = result.meta["clean_tokens"], result.meta["corrupt_tokens"]
    changed = [i for i, (a, b) in enumerate(zip(clean, corrupt)) if a != b]
    return changed or [len(clean) - 1], "changed"


def prompt_groups(result: Result) -> tuple[list[str], list[list[int]], list[list[int]]]:
    """One prompt's named positions: their names, the token positions in each (of those swept),
    and the result columns holding them (a ``positions=`` subset sweeps only some)."""
    span, noun = _span(result)
    names, groups = named_groups(span, len(result.tokens), noun)
    swept = result.meta.get("positions") or range(len(result.tokens))
    where = {position: column for column, position in enumerate(swept)}
    groups = [[p for p in group if p in where] for group in groups]
    return names, groups, [[where[p] for p in group] for group in groups]


def position_axis(plan: Plan) -> bool:
    """Whether ``plan``'s columns are token positions (a dataset then averages named groups of
    them), not heads or senders."""
    sweep = plan.sweeps[0]
    return isinstance(sweep, SiteSweep) and sweep.site.per_position


class DatasetPlan(Plan):
    """Many prompts' plans run as one: row by row across prompts, into one combined result.

    Row ``r`` of every prompt runs before the next row (:meth:`Plan.rows`) of any, so the
    combined grid fills in one row at a time like a single prompt's. Each (prompt, seed) is one row of the result's seed
    axis, normalized against its own baselines.
    """

    def __init__(self, backend: Any, plans: list[Plan]):
        first = plans[0]
        views = first.result.views
        for plan in plans:
            if plan.result.views != views:
                raise PipatchError("every prompt of a dataset must be swept over the same views")
        metrics = sorted({plan.result.metric for plan in plans})
        if metrics == ["logit_diff", "logprob_diff"]:
            raise PipatchError("the prompts mix one-token and multi-token answers, so logit_diff would average "
                               "logit differences with log-prob differences: pass metric='logprob_diff'")
        self.plans = plans
        # Per prompt: each named group's token positions (what a click patches) and the result
        # columns holding them (what is averaged; a ``positions=`` subset sweeps only some).
        self.groups: list[list[list[int]] | None] = []
        self._group_columns: list[list[list[int]] | None] = []
        columns = first.result.columns
        for plan in plans:
            if position_axis(plan):
                columns, groups, group_columns = prompt_groups(plan.result)
                self.groups.append(groups)
                self._group_columns.append(group_columns)
            else:
                self.groups.append(None)
                self._group_columns.append(None)
        self.offsets = [0]
        for plan in plans:
            self.offsets.append(self.offsets[-1] + plan.result.n_seeds)
        self._owner = [(sweep, i) for i, plan in enumerate(plans) for sweep in plan.sweeps]  # sweeps compare by value
        results = [p.result for p in plans]
        meta = dict(first.result.meta)
        shared = set(model_meta(backend))
        meta.update({
            "dataset": True,
            "prompts": [r.meta.get("prompt") or r.meta.get("clean_prompt") for r in results],
            "rows_per_prompt": [r.n_seeds for r in results],
            "per_prompt_clean": [float(r.clean) for r in results],
            "per_prompt_corrupt": [r.corrupt_seeds.tolist() for r in results],
            # Each prompt's own inputs (what Result.code() replays) and the columns of its named positions.
            "items": [{**{k: v for k, v in r.meta.items() if k not in shared}, "group_columns": g}
                      for r, g in zip(results, self._group_columns)],
        })
        result = Result(
            kind=first.result.kind, tokens=list(columns), columns=list(columns), layers=first.result.layers,
            metric=first.result.metric,
            raw={view: torch.cat([group_means(p.result.raw[view], g) for p, g in zip(plans, self._group_columns)])
                 for view in views},
            clean=torch.cat([torch.full((r.n_seeds,), float(r.clean)) for r in results]),
            corrupt=torch.cat([r.corrupt_seeds for r in results]), meta=meta,
            rows_done={view: min(r.rows_done.get(view, 0) for r in results) for view in views},
            warnings=[f"prompt {i}: {w}" for i, r in enumerate(results) for w in r.warnings]
            + [line for line in [mixed_scales([(f"prompt {i}", r.meta.get("scale")) for i, r in enumerate(results)],
                                              "the prompts")] if line is not None],
        )
        super().__init__(backend, result, [s for p in plans for s in p.sweeps], first.batch_size, first.fast)
        self.narrow = first.narrow

    def tasks(self) -> Iterator[tuple[Sweep, int]]:
        for index in range(len(self.plans[0].sweeps)):
            for row in self.rows(self.plans[0].sweeps[index]):
                for plan in self.plans:
                    yield plan.sweeps[index], row

    def begin(self) -> None:
        for plan in self.plans:
            plan.begin()
        super().begin()

    def _plan_of(self, sweep: Sweep) -> int:
        """The number of the prompt's plan that ``sweep`` belongs to."""
        return next(i for each, i in self._owner if each is sweep)

    def store(self, sweep: Sweep, cell: Cell, value: float) -> None:
        sweep.store(self.plans[self._plan_of(sweep)].result, cell, value)

    def row_done(self, sweep: Sweep, row: int) -> None:
        i = self._plan_of(sweep)
        plan = self.plans[i]
        plan.row_done(sweep, row)
        lo, hi = self.offsets[i], self.offsets[i + 1]
        self.result.raw[sweep.view][lo:hi, row] = group_means(plan.result.raw[sweep.view][:, row : row + 1],
                                                           self._group_columns[i])[:, 0]
        if i == len(self.plans) - 1 and sweep.tracks_rows:
            self.result.rows_done[sweep.view] += 1

    def finish(self) -> None:
        for plan in self.plans:
            plan.finish()

    def predictor(self) -> Predictor:
        """A click on row ``seed`` of the seed axis runs that prompt's cell; a named-position
        column patches every position of its group at once (seed −1: the first prompt)."""
        sweeps = [{s.view: dataclasses.replace(s, only=None) for s in plan.sweeps} for plan in self.plans]
        offsets, groups, names = list(self.offsets), list(self.groups), list(self.result.columns)

        def locate(view: str, row: int, col: int, seed: int) -> tuple[Sweep, Cell]:
            flat = max(seed, 0)
            i = max(k for k in range(len(sweeps)) if offsets[k] <= flat)
            sweep = sweeps[i][view]
            if groups[i] is None:
                return sweep, sweep.cell(row, col, flat - offsets[i])
            positions = groups[i][col]
            if not positions:
                raise PipatchError(f"prompt {i} has no token in the column {names[col]!r}")
            grouped = dataclasses.replace(sweep, columns=[positions])
            return grouped, grouped.cell(row, 0, flat - offsets[i])

        return Predictor(self.backend, sweeps[0], locate)


def plan_dataset(backend, planner: Callable[..., Plan], items: Sequence[dict[str, Any]]) -> DatasetPlan:
    """Plan each prompt with ``planner(backend, **item)`` and combine them (see the module docstring)."""
    if not items:
        raise PipatchError("the list of prompts is empty: pass at least one prompt (or clean/corrupt pair)")
    return DatasetPlan(backend, [planner(backend, **item) for item in items])
