"""What every backend says the same way about its model: the result's metadata, token text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["Described"]


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
    def capture(self, input_ids: Any, metric: Any, sites: Sequence[Any] = ()) -> Any: ...


class Described:
    """The shared implementation of three core members (:class:`~._contract.Backend`):
    ``meta``, ``captures`` and ``decode``, for a backend with ``name``, ``adapter``, ``backend_name``,
    ``dtype``, ``tokenizer`` and ``runs_on`` (where the forward passes run: ``"cpu"``,
    ``"cuda:0"``, ...) and a ``capture``. It takes no shortcut: the engine's scheduling hints
    are :class:`~._contract.Hints`, apart."""

    def meta(self: _Describable) -> dict[str, Any]:
        """What a result records about the model."""
        return {"model": self.name, "family": self.adapter.family, "backend": self.backend_name,
                "dtype": str(self.dtype).replace("torch.", ""), "device": self.runs_on}

    def captures(self: _Describable, prompts: Sequence[Any], metric: Any, sites: Sequence[Any] = ()) -> list[Any]:
        """Each prompt's :meth:`capture` ([1, T] ids each, one length). A backend may run them
        together: the transformers backend runs them in one trace."""
        return [self.capture(ids, metric, sites) for ids in prompts]

    def decode(self: _Describable, ids: Sequence[int]) -> list[str]:
        """Each token id's text, alone."""
        return [self.tokenizer.decode([int(i)]) for i in ids]
