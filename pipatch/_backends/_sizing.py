"""Batch sizes: how many invokes one trace holds, by the device's memory or a CPU's budget.

A backend answers ``batch_size(n_tokens)`` (the engine asks it, never the device) from these
two rules: a CPU's budget of positions per trace, or what fits a GPU's free memory."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["auto_batch_size", "batch_size_for_memory"]


def batch_size_for_memory(free_bytes: int, n_tokens: int, d_model: int, n_layers: int, bytes_per_value: int, *,
                          n_heads: int = 0, vocab_rows: int = 0, cap: int = 256, fraction: float = 0.5,
                          work: int = 16) -> int:
    """Invokes per trace that fit in ``free_bytes`` of device memory (a GPU's free memory).

    Each invoke of a batch is one patched run of an ``n_tokens`` prompt, and the batch runs
    as one forward of ``batch × n_tokens`` positions. While it runs, one invoke holds about
    these many values of ``bytes_per_value`` bytes (2 for bfloat16, 4 for float32):

    * ``n_layers × n_tokens × d_model`` for the block outputs the trace keeps while it
      reads and writes sites across layers;
    * as many again for the cached base-run blocks it reuses: the fast path hands each
      invoke the base run's outputs of the blocks below its first patched layer instead of
      recomputing them, and the batch copies them into its rows;
    * ``work × n_tokens × d_model`` for the one block being computed: queries, keys and
      values, the MLP's hidden and gate (a few ``d_model`` wide each; 16 covers a 4× MLP);
    * ``n_heads × n_tokens²`` for that block's attention scores;
    * ``vocab_rows`` for the unembedding: the rows of logits the invoke reads (one
      position's full vocabulary for a probability or a click, 0 on the fast path, where
      the metric is computed outside the trace).

    Only ``fraction`` of the free memory is planned for: the rest is room for the base
    runs' captures, which a protocol makes after choosing the batch, the allocator's
    fragmentation, and what this estimate misses. A batch that still runs out of memory
    is halved and retried by the engine. The result is between 1 and ``cap``, and
    grows with ``free_bytes`` and shrinks with ``n_tokens``.
    """
    per_token = d_model * (2 * n_layers + work) + n_heads * n_tokens
    per_invoke = bytes_per_value * (n_tokens * per_token + vocab_rows)
    return max(1, min(cap, int(free_bytes * fraction) // max(1, per_invoke)))


def auto_batch_size(n_tokens: int, budget_tokens: int = 4096, cap: int = 256, *, backend: Any = None,
                    free_bytes: int | None = None) -> int:
    """Invokes per trace for an ``n_tokens`` prompt.

    On a CPU (no ``backend``, or one whose ``device`` is not CUDA, and no ``free_bytes``):
    so that one batch holds about ``budget_tokens`` token positions — the size at which a
    CPU forward stops getting faster per token. On a CUDA device: what fits in its free
    memory (``torch.cuda.mem_get_info``, or ``free_bytes`` when given) for the backend's
    model, by :func:`batch_size_for_memory`. Never more than ``cap``.
    """
    if free_bytes is None and torch.device(getattr(backend, "device", None) or "cpu").type == "cuda":
        free_bytes = torch.cuda.mem_get_info(backend.device)[0]
    if free_bytes is None:
        return max(1, min(cap, budget_tokens // max(1, n_tokens)))
    adapter = backend.adapter
    try:
        vocab = len(backend.tokenizer)
    except Exception:  # noqa: BLE001 - no tokenizer to count: leave the logits out
        vocab = 0
    return batch_size_for_memory(free_bytes, n_tokens, adapter.d_model, adapter.n_layers, backend.dtype.itemsize,
                                 n_heads=adapter.n_heads, vocab_rows=vocab, cap=cap)
