"""What every backend says the same way about its model: the result's metadata, token text,
and how many invokes one trace holds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ._sizing import auto_batch_size

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


class Described:
    """The shared implementation of three core members (:class:`~._contract.Backend`):
    ``meta``, ``decode`` and ``batch_size``, for a backend with ``name``, ``adapter``,
    ``backend_name``, ``dtype``, ``tokenizer``, ``device`` and ``runs_on`` (where the forward
    passes run: ``"cpu"``, ``"cuda:0"``, ...)."""

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
