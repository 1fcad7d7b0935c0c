"""Batch sizes as the engine takes them: the caller's, checked, or the backend's own."""

from __future__ import annotations

from typing import Any

from .._backends._sizing import auto_batch_size
from .._base.checks import whole_number

__all__ = ["check_batch_size"]


def check_batch_size(batch_size: int | None, n_tokens: int, backend: Any = None) -> int:
    """``batch_size`` checked, or what ``backend`` says fits runs of ``n_tokens`` positions
    (its ``batch_size``; without one, :func:`~pipatch._backends._sizing.auto_batch_size`)."""
    if batch_size is not None:
        return whole_number(batch_size, "batch_size", minimum=1)
    sizer = getattr(backend, "batch_size", None)
    return sizer(n_tokens) if callable(sizer) else auto_batch_size(n_tokens, backend=backend)
