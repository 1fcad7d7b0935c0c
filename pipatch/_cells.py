"""The vocabulary shared by protocols, the engine and the backends: metrics, runs and cells.

A **cell** is one patched forward pass: a *base run* (a prompt, maybe under noise) with a list
of **ops** — write this value at that site, layer and index; or record what is there — and one
number read off its last position, the **metric**. A protocol turns a researcher's question
into cells; the engine batches them; a backend runs a batch as invokes of one trace. Nothing
here touches a model.

Shapes: a site value is ``[batch, T, width]``; an op's ``index`` selects into one batch row's
value (``value[index]`` with the batch dimension kept, e.g. ``(slice(None), 4)`` for position
4, or ``(slice(None), [2, 3], slice(0, 64))`` for head 0's slice at positions 2 and 3).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ._sites import Site

__all__ = ["METRICS", "Metric", "Capture", "Base", "Op", "Cell"]

METRICS = ("logit_diff", "prob", "logprob")


@dataclass(frozen=True)
class Metric:
    """A number read off the last position's logits.

    ``prob`` and ``logprob`` of ``answer`` need the whole vocabulary (for the softmax);
    ``logit_diff`` (answer − foil) needs two rows of the unembedding only.
    """

    name: str
    answer: int
    foil: int | None = None

    @property
    def token_ids(self) -> list[int] | None:
        """Vocabulary rows the metric reads, or ``None`` for all of them."""
        return [self.answer, self.foil] if self.name == "logit_diff" else None

    def from_logits(self, logits: torch.Tensor, subset: bool = False) -> torch.Tensor:
        """``logits``: [batch, vocab] (or [batch, 2] when ``subset``) → [batch] float32."""
        logits = logits.float()
        if self.name == "logit_diff":
            if subset:
                return logits[:, 0] - logits[:, 1]
            return logits[:, self.answer] - logits[:, self.foil]
        logp = torch.log_softmax(logits, dim=-1)[:, self.answer]
        return logp.exp() if self.name == "prob" else logp


@dataclass
class Capture:
    """What one traced run (or a batch of ``n`` runs, e.g. one per noise seed) leaves behind.

    ``blocks[l]`` is block ``l``'s raw output (tensor or tuple) for the whole batch, as a
    backend must hand it back to skip the block. ``sites[name][l]`` is a site value,
    [n, T, width] (``"resid"`` always). ``metric`` and ``prob`` (of the answer) are [n];
    ``embedded`` is the embedding output, [n, T, d].
    """

    blocks: list[Any]
    sites: dict[str, list[torch.Tensor]]
    metric: torch.Tensor
    embedded: torch.Tensor
    prob: torch.Tensor

    def block_for(self, layer: int, row: int) -> Any:
        """Block ``layer``'s output for batch row ``row`` only, in the block's own structure."""
        value = self.blocks[layer]
        if isinstance(value, tuple):
            return (value[0][row : row + 1],) + tuple(
                v[row : row + 1] if isinstance(v, torch.Tensor) and v.shape[:1] == value[0].shape[:1] else v
                for v in value[1:]
            )
        return value[row : row + 1]

    def site(self, name: str, layer: int, row: int) -> torch.Tensor | None:
        """Site ``name``'s value at ``layer`` for batch row ``row`` ([1, T, width]), if kept."""
        values = self.sites.get(name)
        return None if values is None else values[layer][row : row + 1]


@dataclass
class Base:
    """The run a cell patches: token ids [1, T], its capture, and (causal tracing) its noise.

    Row ``seed`` of ``capture`` is the base run of cells with that seed. ``noise[seed]``
    ([len(noise_positions), d]) is added to the embedding output at ``noise_positions``.
    """

    input_ids: torch.Tensor
    capture: Capture
    noise: torch.Tensor | None = None
    noise_positions: list[int] | None = None

    @property
    def n_seeds(self) -> int:
        return int(self.capture.metric.shape[0])


@dataclass
class Op:
    """Write ``value`` at ``site[layer][index]``, or (``value is None``) record what is there."""

    site: Site
    layer: int
    index: tuple
    value: torch.Tensor | None = None

    @property
    def key(self) -> tuple[int, int, str]:
        """Forward order: ops run sorted by this."""
        return (self.layer, self.site.order, self.site.name)


@dataclass
class Cell:
    """One patched run of ``base`` (batch row ``seed``), filling grid cell ``(row, col)``.

    ``start`` is the first layer whose input can differ from the base run: blocks below it
    are the base run's, which a backend may reuse instead of recomputing. ``then``, when set,
    makes this a two-stage cell (path patching through q/k/v receivers): the ops' recorded
    values (in op order) are passed to ``then``, which returns the second stage's cell; its
    metric is this cell's value.
    """

    row: int
    col: int
    seed: int
    start: int
    ops: list[Op] = field(default_factory=list)
    then: Callable[[list[torch.Tensor]], Cell] | None = None

    def sorted_ops(self) -> list[Op]:
        return sorted(self.ops, key=lambda op: op.key)
