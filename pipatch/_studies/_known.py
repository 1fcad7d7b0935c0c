"""ROME's known-fact rule: does the model's top-1 next token after the prompt start the answer?

A study runs (with ``known_only=True``, the default) only the facts the model knows: its
top-1 next token after the prompt is the first token of the answer. The check costs nothing
where it can ride along: every planner starts with a clean run of the prompt, and
:class:`KnownCheck` hands a planner the backend with that first capture watched. Where the
backend read the logits (``Capture.top1``), the top-1 is read off it; with ``stop_unknown``
a fact the model does not know raises :class:`UnknownFact` right there, before the
corrupted runs, and is stored as ``unknown`` with the model's actual top-1.

Where the planner read no logits (a logit difference, or a backend that reports no
``top1``), :func:`known_fact` runs the check itself: one forward, and a second for a fact it
fails (to name the top-1 token).

How it fails: nothing here catches. An answer that is not text or encodes to no token is a
:class:`~pipatch.PipatchError` in one line (from ``answer_ids``), and a backend's own error
(a prompt it refuses, a failed run) passes through unchanged: the study stores either as
that fact's one-line error and goes on. :class:`UnknownFact` is raised on purpose, and the
study catches it.
"""

from __future__ import annotations

from typing import Any

from .._experiments._inputs import answer_ids, encode
from .._model.cells import Base, Cell, Metric
from .._programs.capture import CAPTURE
from .._programs.capture import capture as capture_run
from .._programs.lens import LENS
from .._programs.patch import PatchRequest, patch

__all__ = ["known_fact", "KnownCheck", "UnknownFact"]


class UnknownFact(Exception):
    """Raised out of a planner by :class:`KnownCheck`: the clean run's top-1 is not the answer."""

    def __init__(self, top1: int):
        super().__init__(top1)
        self.top1 = top1


class KnownCheck:
    """The backend as one fact's planner sees it: its first capture, the clean run every
    planner starts with, is also ROME's known-fact check.

    Everything is the backend's own (attributes are looked up on it), so the plan and its
    result are what the planner makes on the backend itself. The first capture's ``top1``
    (the model's top next token after the clean prompt, where the backend read the logits) is
    kept in :attr:`top1`; with ``stop_unknown`` a top-1 other than ``first`` (the answer's
    first token) raises :class:`UnknownFact` there, before the corrupted runs.
    """

    def __init__(self, backend: Any, first: int | None, *, stop_unknown: bool):
        self._backend, self._first, self._stop_unknown = backend, first, stop_unknown
        self._seen = False
        self.top1: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def run(self, program: Any, request: Any) -> Any:
        """The backend's own run; the first capture's clean run (the clean prompt comes
        first; runs under ops are noised, never checked), or the lens's read, is the check."""
        out = self._backend.run(program, request)
        if program is CAPTURE:
            self._check(out[0] if request.ops is None else None)
        elif program is LENS:  # the lens's one run of the prompt
            self._check(out)
        return out

    def _check(self, run: Any) -> None:
        if self._seen:
            return
        self._seen = True
        if run is None or getattr(run, "top1", None) is None:
            return
        self.top1 = int(run.top1[0])
        if self._stop_unknown and self._first is not None and self.top1 != self._first:
            raise UnknownFact(self.top1)


def known_fact(backend: Any, prompt: str, answer: str | None) -> tuple[bool | None, str]:
    """ROME's rule: whether the model's top-1 next token after ``prompt`` is the first token of
    ``answer``, and that top-1 token's text (``None``, unknown, without an answer).

    One forward, which reads the top-1 off the logits where the backend reports it
    (``Capture.top1``); elsewhere it reads the answer's rank (0: no token above it), and a
    fact it fails costs a second, which reads every logit for the top-1's text. A study calls
    this only when the experiment's own clean run read no logits (:class:`KnownCheck`).
    """
    ids, _, _ = encode(backend, prompt)
    first = 0 if answer is None else answer_ids(backend, answer, "answer")[0]
    capture = capture_run(backend, ids, Metric("prob", (first,)))
    if getattr(capture, "top1", None) is not None:
        top = int(capture.top1[0])
        return (None if answer is None else top == first), backend.decode([top])[0]
    metric = Metric("rank", (first,))
    capture = capture_run(backend, ids, metric)
    if answer is not None and float(capture.metric[0]) == 0:
        return True, backend.decode([first])[0]
    (logits,), _ = patch(backend, PatchRequest.of(Base(ids, capture), [[Cell(0, 0, 0, start=0)]], metric, fast=False,
                                                  out="next_logits"))
    top = int(logits.float().reshape(-1, logits.shape[-1])[0].argmax())
    return (None if answer is None else top == first), backend.decode([top])[0]
