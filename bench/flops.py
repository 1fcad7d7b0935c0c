"""How much arithmetic a sweep needs, and how fast this machine can do it.

A sweep's *limit* is the time a perfect implementation would take: the matrix-multiply FLOPs
the answer cannot be had without, divided by the best matmul rate this machine reaches
(:func:`matmul_peak`). ``bench/run.py`` reports pipatch's time as a multiple of that limit.

Counting (only matrix multiplies; norms, activations, softmax and the embedding lookup are
a few per cent and left out):

* a **linear layer** of ``n_in × n_out`` weights applied to ``t`` tokens costs
  ``2 × n_in × n_out × t`` FLOPs (one multiply and one add per weight per token). One block
  of the model has ``d × (n_heads + 2 n_kv_heads) × head_dim`` weights in its query/key/value
  projections, ``n_heads × head_dim × d`` in its output projection and
  ``mlp_matrices × d × intermediate`` in its MLP (3 for a gated MLP: gate, up, down);
* **attention** with ``q`` query positions over ``k`` key positions costs
  ``2 × 2 × q × k × n_heads × head_dim`` FLOPs per block: ``QKᵀ`` and ``(scores) V``, both
  dense, as the kernels compute them (a causal mask would halve it; a sliding window, as in
  Gemma 3's local layers, only matters past the window);
* the **unembedding** costs ``2 × d × rows`` per position it is read at: the full vocabulary
  for a probability (the softmax needs every logit), two rows for a logit difference.

One *full run* (:func:`forward_flops`) is every block at every position plus the unembedding
at the last position. The *limit* of one patched cell (:func:`cell_flops`) counts only what
the patch can change: in a causal model, patching a state at layer ``l``, position ``p``
changes the blocks after it at positions ``p`` and later, nothing else. Those blocks cost the
linear layers on ``T − p`` tokens and attention from ``T − p`` queries over all ``T`` keys
(the earlier positions' keys and values are the base run's, computed once); then the rows of
the unembedding the metric reads, at the last position. A cell whose patch writes back the
base run's own value costs nothing (its answer is the base metric).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

# Families whose MLP is two matrices (up, down) rather than a gated three (gate, up, down).
_UNGATED = {"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon"}


@dataclass(frozen=True)
class Sizes:
    """The sizes of a decoder-only transformer that its matmul FLOPs depend on."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    mlp_matrices: int = 3

    @classmethod
    def from_config(cls, config) -> Sizes:
        """Read the sizes from a Hugging Face config (its text config for a multimodal one)."""
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        n_heads = config.num_attention_heads
        return cls(
            n_layers=config.num_hidden_layers,
            d_model=config.hidden_size,
            n_heads=n_heads,
            n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // n_heads,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            mlp_matrices=2 if config.model_type in _UNGATED else 3,
        )

    @property
    def block_weights(self) -> int:
        """Weights in one block's matmuls: q, k, v, output projection and the MLP."""
        qkv = self.d_model * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        out = self.n_heads * self.head_dim * self.d_model
        return qkv + out + self.mlp_matrices * self.d_model * self.intermediate


def block_flops(s: Sizes, queries: int, keys: int) -> int:
    """One block computed at ``queries`` positions that attend over ``keys`` positions."""
    return 2 * s.block_weights * queries + 2 * 2 * queries * keys * s.n_heads * s.head_dim


def forward_flops(s: Sizes, n_tokens: int, logit_rows: int | None = None) -> int:
    """One full run of an ``n_tokens`` prompt: every block at every position, then
    ``logit_rows`` rows of the unembedding at the last position (default: the vocabulary)."""
    rows = s.vocab if logit_rows is None else logit_rows
    return s.n_layers * block_flops(s, n_tokens, n_tokens) + 2 * s.d_model * rows


def cell_flops(s: Sizes, n_tokens: int, first_layer: int, first_position: int, logit_rows: int) -> int:
    """The limit of one patched run: only what the patch can change.

    ``first_layer`` is the first block whose computation the patch changes (``l + 1`` for a
    patch of block ``l``'s output; ``l`` for a patch inside block ``l``) and ``first_position``
    the first patched position ``p``. Blocks ``first_layer ..`` run on positions ``p ..`` only;
    the unembedding's ``logit_rows`` rows run at the last position, unless nothing there
    changed (a patch of the last block's output before the last position).
    """
    changed = n_tokens - first_position
    blocks = max(0, s.n_layers - first_layer) * block_flops(s, changed, n_tokens)
    reaches_last = first_layer < s.n_layers or first_position == n_tokens - 1
    return blocks + (2 * s.d_model * logit_rows if reaches_last else 0)


def sweep_flops(s: Sizes, n_tokens: int, cells: Iterable[tuple[int, int]], logit_rows: int,
                baselines: int) -> dict[str, int]:
    """FLOPs of a sweep whose computed cells patch ``(layer, position)`` block outputs.

    ``cells`` lists the cells that must be computed (no-op cells left out); ``baselines`` is
    the number of full runs the sweep needs before its cells (clean and corrupt: 2; a causal
    trace: the clean run and one noised run per seed). Returns ``full`` (each cell a full run)
    and ``limit`` (each cell only what its patch changes), both with the baselines included.
    """
    base = baselines * forward_flops(s, n_tokens)
    full = limit = base
    for layer, position in cells:
        full += forward_flops(s, n_tokens, logit_rows)
        limit += cell_flops(s, n_tokens, layer + 1, position, logit_rows)
    return {"full": full, "limit": limit}


def matmul_peak(n: int = 2048, repeats: int = 10) -> float:
    """This machine's float32 matmul rate in FLOP/s: the best of ``repeats`` timed
    ``n × n @ n × n`` products (``2 n³`` FLOPs each) on torch's current thread count."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    torch.matmul(a, b, out=out)  # warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best
