"""Packing: a batch of cells laid side by side in rows, each from its own position and layer.

Unpacked, a batch of cells runs as rows of one width from one layer: every cell from the
batch's first written position and lowest ``start``. Packed (:class:`Packed`), each cell runs
only the positions from its own first written one and the blocks from its own ``start``,
beside other cells in a row of about :data:`ROW_TOKENS` positions, with ``position_ids`` and
a 4-D attention mask that keep it to what its own run would see. This module lays the cells
out and builds the masks and caches; the transformers backend
(:meth:`~pipatch._backends.transformers.TransformersBackend._trace_packed`) runs the trace.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from .._compat import transformers as transformers_compat
from .._model.cells import Base, Cell, Metric
from .._model.models import first

__all__ = ["Packed", "PACK_TOKENS", "NO_BOUND", "ROW_TOKENS", "layout", "with_hidden"]

# Positions per packed trace (:class:`Packed`), all its rows together, by the device type the
# model runs on. On the CPU, enough to run each block's matrix products near its peak, and
# more only adds to the working set. A device not listed (a GPU) sets no bound of its own
# (:data:`NO_BOUND`): a packed trace then holds what any batch holds, the engine's batch size
# in cells, which on a GPU is sized from its free memory (``pipatch._engine.auto_batch_size``),
# and at most a prompt's positions each.
PACK_TOKENS = {"cpu": 1024}
NO_BOUND = sys.maxsize
# Positions per row of a packed trace (:func:`layout`): a row's attention runs over all its
# positions, so a row of 64 costs Gemma 3 270M about 3 % of its block.
ROW_TOKENS = 64



class Packed:
    """Cells packed into rows, each cell from its own first written position and its own
    ``start`` layer.

    Unpacked, a batch of cells runs as rows of one width from one layer: every cell from the
    batch's first written position and lowest ``start``, so a cell that writes later or
    higher recomputes base-run states below and before its own. Packed, cell ``i`` is
    positions ``starts[i] … L − 1`` of its run, laid beside other cells in one row
    (``spans[i]``: its row and columns) with their own ``position_ids``. A row holds cells of
    one ``start`` (:func:`layout`), rows of higher ``start`` first, so block ``k`` runs the
    rows from ``active[k]`` on (its inputs :meth:`narrowed` to them) and the rows before take
    the base runs' output of the block (:meth:`widen`). Each row's cached keys and values are
    its cells' seeds' base runs before their starts, and the attention mask lets a position
    see its own seed's cached positions before its cell's start and its own cell's positions
    up to itself, within the layer's sliding window where it has one: what the cell's run
    alone would see. A cell then costs the layers above its patch at the positions from its
    patch on, and its attention the keys its own run has; a row's padding (at most a few
    per cent for the rows of a grid) is the only extra work.

    ``entries`` are ``(base, cell, metric)``: the cells of one prompt's batch, or of several
    prompts' (a study's facts run as one, :meth:`~pipatch._backends.transformers.TransformersBackend.states_packed`),
    each cell on its own base's runs (:class:`_Runs`), every metric reading as many positions.
    """

    def __init__(self, entries: Sequence[tuple[Base, Cell, Metric]], windows: dict[str, int | None],
                 additive: torch.dtype | None):
        runs = self.runs = _Runs(entries)
        cells = [cell for _, cell, _ in entries]
        m, device = runs.n_read, runs.ids.device
        ends = self.run_lengths = [runs.length[runs.base_of(base)] for base, _, _ in entries]  # each cell's run's
        self.starts = [min(cell.first_position, L - m) for cell, L in zip(cells, ends)]
        rows = layout([cell.start for cell in cells], [L - b for L, b in zip(ends, self.starts)])
        self.n_rows, width = len(rows), max(sum(ends[i] - self.starts[i] for i in row) for row in rows)
        # What each slot of the [rows, width] layout holds: its cell (-1: padding, which sees
        # only padding), run (a base's seed, numbered over the bases) and run position.
        seeds = [runs.run(base, cell.seed) for base, cell, _ in entries]
        cell_at = torch.full((self.n_rows, width), -1)
        seed_at = torch.zeros(self.n_rows, width, dtype=torch.long)
        pos_at = torch.zeros(self.n_rows, width, dtype=torch.long)
        start_at = torch.zeros(self.n_rows, width, dtype=torch.long)
        self.spans: list[tuple[int, slice]] = [(0, slice(0))] * len(cells)
        for r, row in enumerate(rows):
            at = 0
            for i in row:
                span = slice(at, at + ends[i] - self.starts[i])
                self.spans[i] = (r, span)
                cell_at[r, span], seed_at[r, span], start_at[r, span] = i, seeds[i], self.starts[i]
                pos_at[r, span] = torch.arange(self.starts[i], ends[i])
                at = span.stop
        # Rows of higher ``start`` first: block ``k`` runs rows ``active[k]`` on.
        row_start = [cells[row[0]].start for row in rows]
        self.active = [next((r for r, s in enumerate(row_start) if s <= layer), self.n_rows)
                       for layer in range(runs.n_layers)]
        self.seed_at, self.pos_at = seed_at.to(device), pos_at.to(device)
        self.input_ids = runs.ids[self.seed_at, self.pos_at]
        self.position_ids = self.pos_at
        reads = [(self.spans[i][0], self.spans[i][1].stop - m + j) for i in range(len(cells)) for j in range(m)]
        self.read_at = tuple(torch.tensor(index, device=device) for index in zip(*reads))
        # Each row's cached positions: per run among its cells, up to the latest start of them.
        cached: list[dict[int, int]] = [{} for _ in rows]
        for r, row in enumerate(rows):
            for i in row:
                cached[r][seeds[i]] = max(cached[r].get(seeds[i], 0), self.starts[i])
        self.n_cached = max(sum(row.values()) for row in cached)
        K = self.n_cached
        cache_seed = torch.zeros(self.n_rows, K, dtype=torch.long)
        cache_pos = torch.zeros(self.n_rows, K, dtype=torch.long)
        cache_used = torch.zeros(self.n_rows, K, dtype=torch.bool)
        for r, per_seed in enumerate(cached):
            at = 0
            for seed, n in per_seed.items():
                cache_seed[r, at : at + n], cache_pos[r, at : at + n] = seed, torch.arange(n)
                cache_used[r, at : at + n] = True
                at += n
        self.cache_seed, self.cache_pos = cache_seed.to(device), cache_pos.to(device)
        # [rows, width, K + width]: a slot sees a cached position of its own run before its
        # cell's start, and its own cell's positions up to its own.
        sees_cached = (cache_used[:, None] & (cache_seed[:, None] == seed_at[:, :, None])
                       & (cache_pos[:, None] < start_at[:, :, None]) & (cell_at[:, :, None] >= 0))
        sees_own = (cell_at[:, :, None] == cell_at[:, None]) & (pos_at[:, None] <= pos_at[:, :, None])
        sees = torch.cat([sees_cached, sees_own], -1)
        key_pos = torch.cat([cache_pos, pos_at], -1)
        masks = {}
        for kind, window in windows.items():
            allowed = sees if window is None else sees & (pos_at[:, :, None] - key_pos[:, None] < window)
            allowed = allowed[:, None].to(device)
            # SDPA takes the mask as booleans; eager attention adds it to the scores.
            masks[kind] = allowed if additive is None else torch.zeros(
                allowed.shape, dtype=additive, device=device).masked_fill(~allowed, torch.finfo(additive).min)
        self.mask = masks[""] if "" in masks else masks

    def cache(self) -> Any:
        """The cached keys and values, per layer for the rows its block runs: each row's
        runs before their cells' starts (zeros, masked, to the longest row's)."""
        layers = []
        for layer in range(self.runs.n_layers):
            k, v = self.runs.keys(layer)
            rows = slice(self.active[layer], None)
            seeds, positions = self.cache_seed[rows], self.cache_pos[rows]
            # [rows, K, kv_heads, head_dim] → [rows, kv_heads, K, head_dim]
            layers.append((k[seeds, :, positions].transpose(1, 2), v[seeds, :, positions].transpose(1, 2)))
        return transformers_compat.filled_cache(layers)

    def base_states(self, layer: int, upto: int | None = None) -> torch.Tensor:
        """The base runs' hidden states out of block ``layer`` in the layout's first ``upto``
        rows (all of them by default): [rows, width, d]."""
        return self.runs.states(layer)[self.seed_at[:upto], self.pos_at[:upto]]

    def base_output(self, layer: int) -> Any:
        """:meth:`base_states` of every row in block ``layer``'s own output structure (what
        the block is skipped with)."""
        return with_hidden(self.runs.template(layer), self.base_states(layer))

    def narrowed(self, value: Any, active: int) -> Any:
        """A block's inputs (args or kwargs, nested) for rows ``active`` on: every tensor with
        a row per layout row cut (the hidden states, position embeddings and masks)."""
        if isinstance(value, dict):
            return {key: self.narrowed(item, active) for key, item in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)(self.narrowed(item, active) for item in value)
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == self.n_rows:
            return value[active:]
        return value

    def widen(self, block: Any, layer: int) -> torch.Tensor:
        """Block ``layer``'s output (inside the trace) for every row: the base runs' before
        the rows it ran, its own after; returns the hidden states, writable."""
        out = block.output
        hidden = torch.cat([self.base_states(layer, self.active[layer]), first(out)], 0)
        block.output = with_hidden(out, hidden)
        return hidden


class _Runs:
    """The base runs a packed trace's cells build on, numbered over their bases: run ``r`` is
    seed ``r − offset`` of the base whose seeds start at ``offset``. One base (a batch of one
    prompt's cells) reads its capture as is; several (cells of several prompts, a study's
    facts run as one) read it stacked, each run's positions padded to the longest (a padded
    position is never read: no cell runs or caches past its own run's end)."""

    def __init__(self, entries: Sequence[tuple[Base, Cell, Metric]]):
        self.bases: list[Base] = []
        metrics: list[Metric] = []
        for base, _, metric in entries:
            if not any(seen is base for seen in self.bases):
                self.bases.append(base)
                metrics.append(metric)
        reads = {metric.n_read for metric in metrics}
        assert len(reads) == 1, "a packed trace reads one number of positions per cell"
        self.n_read = reads.pop()
        ids = [metric.inputs(base.input_ids)[0] for base, metric in zip(self.bases, metrics)]
        self.length = [len(run) for run in ids]
        self.n_seeds = [first(base.capture.blocks[0]).shape[0] for base in self.bases]
        self.offset = [sum(self.n_seeds[:b]) for b in range(len(self.bases))]
        self.n_layers = len(self.bases[0].capture.blocks)
        self.ids = self._stacked([run[None].expand(n, -1) for run, n in zip(ids, self.n_seeds)], 1)
        self._states: dict[int, torch.Tensor] = {}

    def base_of(self, base: Base) -> int:
        """``base``'s number among :attr:`bases` (the same object: bases do not compare by value)."""
        return next(b for b, seen in enumerate(self.bases) if seen is base)

    def run(self, base: Base, seed: int) -> int:
        return self.offset[self.base_of(base)] + seed

    def _stacked(self, tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
        """Each base's tensor, its positions (``dim``) padded with zeros to the longest, stacked."""
        if len(tensors) == 1:
            return tensors[0]
        width = max(t.shape[dim] for t in tensors)
        padded = []
        for t in tensors:
            shape = list(t.shape)
            shape[dim] = width - t.shape[dim]
            padded.append(torch.cat([t, t.new_zeros(shape)], dim) if shape[dim] else t)
        return torch.cat(padded)

    def states(self, layer: int) -> torch.Tensor:
        """Every run's hidden states out of block ``layer``: [runs, positions, d]."""
        if layer not in self._states:
            self._states[layer] = self._stacked([first(base.capture.blocks[layer]) for base in self.bases], 1)
        return self._states[layer]

    def template(self, layer: int) -> Any:
        """Block ``layer``'s output structure (a tensor, or a tuple around one)."""
        return self.bases[0].capture.blocks[layer]

    def keys(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every run's attention keys and values at ``layer``: [runs, kv_heads, positions, head_dim]."""
        pairs = []
        for base in self.bases:
            assert base.capture.keys is not None  # packed only on a capture with its keys
            pairs.append(base.capture.keys[layer])
        return self._stacked([k for k, _ in pairs], 2), self._stacked([v for _, v in pairs], 2)


def layout(starts: list[int], lengths: list[int], width: int = 0) -> list[list[int]]:
    """Cells (their ``start`` layers and lengths in positions) → the rows of a packed trace:
    lists of cell indices, rows of higher ``start`` first, each row one ``start``.

    A row is about ``width`` positions (:data:`ROW_TOKENS`; the longest cell's length where
    that is more): wide enough to run each block's matrix products as one, narrow enough that
    the attention, which a row computes over all its positions before the mask, stays a few
    per cent of a block. Each ``start``'s cells go to ``ceil(total / width)`` rows, longest
    first, each to the row with the fewest positions so far: rows of about equal length, so
    padding the layout to its longest row adds little.
    """
    width = max(width or ROW_TOKENS, max(lengths))
    rows: list[list[int]] = []
    for start in sorted(set(starts), reverse=True):
        group = sorted((i for i, s in enumerate(starts) if s == start), key=lambda i: -lengths[i])
        n = -(-sum(lengths[i] for i in group) // width)
        fill: list[int] = [0] * n
        members: list[list[int]] = [[] for _ in range(n)]
        for i in group:
            least = min(range(n), key=fill.__getitem__)
            members[least].append(i)
            fill[least] += lengths[i]
        rows.extend(members)
    return rows


def with_hidden(template: Any, hidden: torch.Tensor) -> Any:
    """``hidden`` in the structure of a block's output ``template``: itself, or the tuple with
    its hidden states replaced (the other items, attention weights, are read by nothing)."""
    return (hidden, *template[1:]) if isinstance(template, tuple) else hidden
