"""What every backend says the same way about its model: the result's metadata, token text,
and how many invokes one trace holds."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from ._sizing import auto_batch_size

__all__ = ["Described", "CallLog"]


class CallLog:
    """What a backend ran, while someone listens: one dict per program run, trace or pass
    (``{"event": "packed", "cells": ..., ...}``), for tests and benchmarks that count work.
    Off by default (nothing is kept); :meth:`recording` turns it on for a block."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] | None = None

    def add(self, event: str, **data: Any) -> None:
        if self.events is not None:
            self.events.append({"event": event, **data})

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[dict[str, Any]]]:
        """Within the block, every event is kept in the list yielded."""
        before, self.events = self.events, []
        try:
            yield self.events
        finally:
            self.events = before

    def of(self, event: str) -> list[dict[str, Any]]:
        """The kept events of one kind."""
        return [e for e in self.events or () if e["event"] == event]


class _Describable(Protocol):
    """What :class:`Described`'s members read of the backend they are mixed into."""

    backend_name: str

    @property
    def name(self) -> str: ...
    @property
    def adapter(self) -> Any: ...
    @property
    def dtype(self) -> Any: ...
    @property
    def runs_on(self) -> str: ...
    @property
    def tokenizer(self) -> Any: ...


class Described:
    """The shared implementation of three core members (:class:`~._contract.Backend`):
    ``meta``, ``decode`` and ``batch_size``, for a backend with ``name``, ``adapter``,
    ``backend_name``, ``dtype``, ``tokenizer``, ``device`` and ``runs_on`` (where the forward
    passes run: ``"cpu"``, ``"cuda:0"``, ...)."""

    @property
    def log(self) -> CallLog:
        """What this backend ran (:class:`CallLog`), while recording."""
        found = self.__dict__.get("_log")
        if found is None:
            found = self.__dict__["_log"] = CallLog()
        return found

    def meta(self: _Describable) -> dict[str, Any]:
        """What a result records about the model."""
        return {"model": self.name, "family": self.adapter.family, "backend": self.backend_name,
                "dtype": str(self.dtype).replace("torch.", ""), "device": self.runs_on}

    def decode(self: _Describable, ids: Sequence[int]) -> list[str]:
        """Each token id's text, alone."""
        return [self.tokenizer.decode([int(i)]) for i in ids]

    def batch_size(self, n_tokens: int) -> int:
        """Invokes per trace for runs of ``n_tokens`` positions: a CPU's budget of positions,
        or what fits the device's free memory (:func:`~._sizing.auto_batch_size`)."""
        return auto_batch_size(n_tokens, backend=self)
