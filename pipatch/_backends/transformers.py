"""The transformers backend: an nnsight ``TransformersModel`` (or ``LanguageModel``) in this process.

A batch of cells is one ``model.trace()`` with one invoke whose batch holds every cell's
rows, so the model runs a real batch instead of one forward per cell, and nnsight serves each
module's value once per batch, not once per cell (:meth:`TransformersBackend.run`). Inside the
invoke the batch's ops are applied in forward order (nnsight serves a module's values only in
the order the forward pass computes them), each on its cell's rows.

Four exact shortcuts, used when the engine asks for ``fast=True`` (tests compare them with
``fast=False``, with ``reuse_prefix=False`` and with ``pack=False`` within 1e-4):

* **Reuse below the patch.** Blocks below a cell's ``start`` layer see exactly the base run's
  inputs, so their outputs are the base run's cached ones: the block is ``skip()``\\ ped with
  the cached value instead of recomputed.
* **Start at the first written position (prefix reuse).** Attention is causal, so a patch at
  position ``p`` cannot change anything before ``p``: those states, keys and values are the
  base run's. The base run's keys and values are kept (:attr:`Capture.keys`), and a batch
  whose cells all write at ``p`` or later runs only the positions ``p …`` of its input,
  attending to the base run's keys and values (per noise seed) for the positions before
  it, through the model's own key/value cache (:attr:`Adapter.cache_kwarg`); positions in
  the ops are shifted by ``−p``. Together with the reuse below the patch, a cell computes
  only the layers above its patch at the positions from its patch on. Which cells share a
  batch (and so its ``p``: the smallest of theirs) is the engine's choice
  (:func:`pipatch._engine.batches`).
* **Pack each cell from its own position.** Where the model takes ``position_ids`` and a
  4-D attention mask (every family here but ALiBi's BLOOM), a batch's cells are laid side by
  side in rows of about :data:`ROW_TOKENS` positions, each from its own first written
  position, one ``start`` layer a row, and a mask keeps each to what its own run would see
  (:class:`~._packing.Packed`): no cell recomputes positions before its own, or blocks below its own,
  because another cell of its batch writes earlier or lower. A 10-seed causal trace then
  computes a third fewer positions, and rows of several grid rows share one trace.
* **Unembed one position.** The metric needs the last position only (the last few for a
  multi-token answer), and a logit difference needs two rows of the unembedding, not 262k: the
  invoke reads the unembedding's *input* at those positions and skips the unembedding;
  :class:`~._unembedding.Unembedding` computes just the rows the metric reads.

This module runs the traces; :mod:`._packing` lays packed traces out (rows, masks, caches)
and :mod:`._unembedding` holds the arithmetic after them. The engine reads the shortcuts
through :class:`TransformersHints`. Base ops (causal tracing's noise at
:data:`~pipatch._sites.EMBED`) are applied as cells' writes are, in the same op loop.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch

from .._cells import Base, Capture, Cell, Metric, Op
from .._compat import nnsight as nnsight_compat
from .._compat import transformers as transformers_compat
from .._known import known
from .._models import Adapter, _get, adapter_for, dispatched, first
from .._sites import EMBED, RESID, Site
from ._contract import Hints
from ._described import Described
from ._edges import (
    ReceiverGradients,
    SenderWrites,
    check_circuit_family,
    circuit_metrics,
    mean_cache,
    receiver_gradients,
    sender_writes,
)
from ._packing import NO_BOUND, PACK_TOKENS, ROW_TOKENS, Packed, layout, with_hidden
from ._unembedding import Unembedding, unembedding_input

__all__ = ["TransformersBackend", "TransformersHints"]

# Re-exported: tests and benchmarks read the packing's sizes and layout here.
_layout, _Packed, _with_hidden = layout, Packed, with_hidden
__all__ += ["PACK_TOKENS", "NO_BOUND", "ROW_TOKENS"]

#: How many of a study's facts run as one (:class:`~pipatch._engine.Chain`), committed
#: together: their cells' metrics take one pass over the unembedding per ~1,000 read
#: positions, where a fact alone takes seven (a 3-kind trace), each costing 60 ms of reading
#: the 262k rows. A kill loses at most these.
PLANS_TOGETHER = 4

class TransformersBackend(Described):
    """Runs cells on an nnsight model of a transformers checkpoint, in this process."""

    adapter: Adapter
    model: Any

    backend_name = "transformers"

    def __init__(self, model: Any, *, reuse_prefix: bool = True, pack: bool = True):
        """``reuse_prefix=False`` switches prefix reuse off (every run starts at position 0),
        ``pack=False`` packing (:class:`~._packing.Packed`: a batch's cells then start at the smallest
        first position among them): the same numbers, slower; for comparing."""
        self.model = dispatched(model)
        self.adapter = adapter_for(self.model)
        self.reuse_prefix = reuse_prefix
        self.pack = pack
        self._means: tuple[Any, dict[str, Any]] | None = None  # mean ablation's last baseline

    # -- what the model is ------------------------------------------------------------------
    @property
    def _hf(self) -> Any:
        return nnsight_compat.torch_module(self.model)

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def device(self) -> torch.device:
        try:
            return next(self._hf.parameters()).device
        except StopIteration:
            return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        try:
            return next(self._hf.parameters()).dtype
        except StopIteration:
            return torch.float32

    @property
    def name(self) -> str:
        """What results call the model: the name it was loaded by, else its checkpoint's."""
        label = known(self.model).name
        if label:
            return label
        hf = self._hf
        return str(getattr(hf, "name_or_path", "") or getattr(hf.config, "name_or_path", "") or type(hf).__name__)

    @property
    def context_length(self) -> int | None:
        config = getattr(self._hf, "config", None)
        config = getattr(config, "text_config", None) or config
        for key in ("max_position_embeddings", "n_positions", "seq_length"):
            value = getattr(config, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    @property
    def runs_on(self) -> str:
        return str(self.device)

    @property
    def path(self) -> str:
        """Where the model loads from: the folder or hub id it was loaded from, else its checkpoint's."""
        hf = self._hf
        return str(known(self.model).path or getattr(hf.config, "name_or_path", "")
                   or getattr(hf, "name_or_path", ""))

    def meta(self) -> dict[str, Any]:
        """What a result records about the model (:meth:`Described.meta`), plus where it loads
        from (``model_path``) and where the adapter found each site (``adapter``), which
        ``Result.code()`` reads."""
        return {**super().meta(), "model_path": self.path, "adapter": dataclasses.asdict(self.adapter)}

    # -- runs -------------------------------------------------------------------------------
    def capture(self, input_ids: torch.Tensor, metric: Metric, sites: Sequence[Site] = (), *,
                ops: Sequence[Sequence[Op]] | None = None) -> Capture:
        """Run ``input_ids`` ([1, T]) once per list of ``ops`` and keep every block output and site.

        ``ops[i]`` are run ``i``'s writes (causal tracing's corrupted runs: seed ``i``'s noise,
        added at :data:`~pipatch._sites.EMBED`), applied as a patched run applies a cell's;
        ``None`` is one clean run. ``sites`` lists the site values to keep besides the block
        outputs.
        """
        runs = [[]] if ops is None else [list(run) for run in ops]
        return self._capture([input_ids] * len(runs), metric, sites, ops=runs)

    def captures(self, prompts: Sequence[torch.Tensor], metric: Metric, sites: Sequence[Site] = ()) -> list[Capture]:
        """Several prompts' runs ([1, T] each, one length), each kept as :meth:`capture` keeps one,
        in one trace: the model's weights are read once for all of them (a run of a few tokens
        costs mostly that read on a CPU: two 9-token runs of Gemma 3 270M 0.11 s, one 0.09 s)."""
        both = self._capture(list(prompts), metric, sites)
        return [both.run(i) for i in range(len(prompts))]

    def _capture(self, prompts: list[torch.Tensor], metric: Metric, sites: Sequence[Site] = (), *,
                 ops: list[list[Op]] | None = None) -> Capture:
        """Run ``i`` of one trace: ``prompts[i]`` ([1, T]) under ``ops[i]`` (none by default);
        all of them one batch of one invoke (one intervention per layer, however many runs).

        A metric that reads a softmax (and causal tracing's P(answer)) is read off the model's
        own logits; a logit difference, off the two rows of the unembedding it needs
        (:meth:`metric_from_hidden`, as a patched run's is): the 262k-row unembedding is then
        not read at all, and the run has no ``prob``."""
        model, adapter = self.model, self.adapter
        n, k = len(prompts), metric.n_inputs
        T, m = prompts[0].shape[1], metric.n_read
        keep = sorted({s for s in sites if not s.is_block_output}, key=lambda s: s.order)  # blocks: always kept
        # Each run's writes by (site, layer), in forward order; run ``i`` is rows ``i·k …``.
        writes: dict[tuple[str, int], list[tuple[Op, int]]] = {}
        for i, run in enumerate(ops or []):
            for op in sorted(run, key=lambda op: op.key):
                writes.setdefault((op.site.name, op.layer), []).append((op, i))
        written = {op.site for pairs in writes.values() for op, _ in pairs}
        inside = sorted(set(keep) | {s for s in written if not (s.is_embedding or s.is_block_output)},
                        key=lambda s: s.order)
        layers = range(adapter.n_layers)
        softmax = metric.token_ids is None
        unembed = adapter.unembedding(model)
        cache = self._new_cache()
        kwargs: dict[Any, Any] = {adapter.cache_kwarg: cache, "use_cache": True} if cache is not None else {}

        def apply(site: Site, layer: int, value: Any) -> None:
            for op, i in writes.get((site.name, layer), ()):
                op.apply(value[i * k : (i + 1) * k])

        with torch.no_grad(), model.trace(**adapter.trace_kwargs(m), **kwargs) as tracer:
            saved = list().save()  # type: ignore[attr-defined]  # nnsight's
            with tracer.invoke(torch.cat([metric.inputs(prompt) for prompt in prompts])):
                embedded = EMBED.value(adapter, model, 0)
                apply(EMBED, 0, embedded)
                embedded_copy = embedded[::k, :T].clone()
                blocks = []
                values: dict[str, list[Any]] = {s.name: [] for s in keep}
                for layer in layers:
                    for s in inside:
                        value = s.value(adapter, model, layer)
                        apply(s, layer, value)
                        if s in keep:
                            values[s.name].append(value[::k, :T].clone())
                    out = adapter.block(model, layer).output
                    apply(RESID, layer, first(out))
                    blocks.append(tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in out)
                                  if isinstance(out, tuple) else out.clone())
                if softmax:
                    read = model.output.logits[:, -m:].float()
                else:
                    read = unembedding_input(unembed, (slice(None), slice(-m, None)))
                saved.append((blocks, values, read, embedded_copy))
        blocks, values, read, embedded = saved[0]
        values[RESID.name] = [first(b)[::k, :T] for b in blocks]
        keys = None
        if cache is not None and len(cache.layers) == adapter.n_layers:
            # One row per run (the inputs share the prompt), prompt positions only.
            keys = [(layer.keys[::k, :, :T], layer.values[::k, :, :T]) for layer in cache.layers]
        read = read.reshape(n, k, m, -1)  # [runs, inputs, n_read, vocab] (softmax) or [..., d]
        top1 = None
        if softmax:
            score, prob = metric.score(read), metric.answer_prob(read)
            top1 = read[:, 0, 0].argmax(-1)  # first input, first read position: the last prompt token
        else:
            score, prob = self.metric_from_hidden(metric, read), None
        return Capture(blocks=blocks, sites=values, metric=score, embedded=embedded, prob=prob, inputs=k, keys=keys,
                       top1=top1)

    def _new_cache(self) -> Any:
        """An empty key/value cache for a base run, or ``None`` where the model takes none.

        A plain ``DynamicCache`` (no config) keeps every position of every layer, sliding-window
        layers included: a later run may start anywhere, and the model's masks (built from its
        config, not from the cache) keep the window."""
        if self.adapter.cache_kwarg is None:
            return None
        from transformers import DynamicCache

        return DynamicCache()

    def _prefix_cache(self, base: Base, seeds: list[int], inputs: int, start: int) -> Any:
        """The base runs' keys and values before position ``start``, one batch row per input
        of each cell (its seed's run), as the model's cache."""
        keys = base.capture.keys
        assert keys is not None  # prefix reuse only runs on a capture with its keys
        rows = torch.tensor(seeds, device=keys[0][0].device).repeat_interleave(inputs)
        return transformers_compat.filled_cache([(k[:, :, :start].index_select(0, rows),
                                                  v[:, :, :start].index_select(0, rows)) for k, v in keys])

    @staticmethod
    def _base_ops(base: Base, cell: Cell, start: int, below: int) -> list[Op]:
        """``cell``'s seed's base ops for a run from position ``start`` whose blocks below
        ``below`` are skipped: those whose positions from ``start`` on feed a block that runs
        (:meth:`Op.from_position`, :meth:`Site.start_layer`)."""
        kept = (op.from_position(start) for op in base.ops_of(cell.seed) if op.site.start_layer(op.layer) >= below)
        return [op for op in kept if op is not None]

    @functools.cached_property
    def hints(self) -> TransformersHints:
        """What the engine may schedule by (:class:`TransformersHints`)."""
        return TransformersHints(self)

    def prefix_reuse(self, base: Base) -> bool:
        """Whether :meth:`run` can start cells of ``base`` at their first written position."""
        return self.reuse_prefix and base.capture.keys is not None

    @functools.cached_property
    def position_flops(self) -> int:
        """Two FLOPs per weight of a block (a multiply and an add) for each position it runs."""
        return 2 * sum(p.numel() for p in _get(self._hf, self.adapter.blocks)[0].parameters())

    def pack_tokens(self, base: Base, metric: Metric) -> int:
        """How many positions a packed trace holds (:class:`~._packing.Packed`: each cell from its own
        first written position), or 0 where this model's batches are not packed (then a
        batch's cells start at the smallest first position among them). By the device
        (:data:`PACK_TOKENS`): 1,024 on the CPU; on a GPU, :data:`NO_BOUND`, the batch size
        alone bounds a packed trace."""
        if not (self.pack and self.prefix_reuse(base) and metric.n_inputs == 1 and self._masks is not None):
            return 0
        return PACK_TOKENS.get(self.device.type, NO_BOUND)

    @functools.cached_property
    def _masks(self) -> tuple[dict[str, int | None], bool] | None:
        """The attention masks a packed run hands the model, by layer type: each type's
        sliding window (``None``: full attention), one entry, ``""``, where every layer
        attends alike; and whether the attention is eager (which adds the mask to the scores
        where SDPA takes booleans). ``None`` where the model cannot run packed: it takes no
        ``position_ids`` (ALiBi: BLOOM, whose biases come from a 2-D mask), an attention
        implementation that takes no 4-D mask, or layer types other than full and sliding."""
        config = self._hf.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        parameters = inspect.signature(self._hf.forward).parameters
        implementation = transformers_compat.attention_implementation(text, config)
        if ("position_ids" not in parameters or self.adapter.cache_kwarg is None or getattr(text, "alibi", False)
                or implementation not in ("sdpa", "eager")):
            return None
        window = getattr(text, "sliding_window", None)
        types = set(getattr(text, "layer_types", None) or ())
        if not types:
            return {"": window}, implementation == "eager"
        if not types <= {"full_attention", "sliding_attention"}:
            return None
        masks = {kind: window if kind == "sliding_attention" else None for kind in types}
        return (masks if len(set(masks.values())) > 1 else {"": next(iter(masks.values()))}), implementation == "eager"

    def run(self, base: Base, cells: list[Cell], metric: Metric, *, fast: bool = True,
            full_logits: bool = False) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """Run ``cells`` on ``base`` as one batched forward: one trace, one invoke.

        Cell ``i`` is batch rows ``i·n … i·n + n − 1`` (``n = metric.n_inputs``: the prompt and
        each answer continuation); its ops write and read those rows only, its writes cover
        each of them. Every op of the batch is applied in forward order (nnsight serves a
        module's values only in the order the forward pass computes them), so each site is
        fetched once per batch, not once per cell. With ``fast``, blocks below the cells'
        smallest ``start`` are skipped with the base runs' outputs, and (when the backend
        reuses prefixes) the run starts at the cells' smallest first written position.

        Returns the metric per cell ([len(cells)], float32) — or, with ``full_logits``, the
        last prompt position's logits per cell ([len(cells), vocab]) — and, per cell, the values
        its recording ops read (in op order).
        """
        out, reads = self._trace(base, cells, metric, fast=fast, full_logits=full_logits)
        if full_logits:
            return out.float(), reads
        if fast:
            return self.metric_from_hidden(metric, out), reads
        return metric.score(out), reads

    def shares_unembedding(self, metric: Metric) -> bool:
        """A probability reads every row of the unembedding (:meth:`logsumexp`), a pass that
        costs about as much for 210 positions as for 70 on this CPU; a logit difference reads
        two rows."""
        return metric.token_ids is None and not metric.needs_vocab

    def run_many(self, base: Base, batches: Sequence[list[Cell]], metric: Metric, *,
                 fast: bool = True) -> list[torch.Tensor]:
        """Several batches, one trace each, as :meth:`run`; with ``fast``, the metric of every
        batch's cells in one go from their read positions' states: one product with the
        unembedding for all of them (70 positions run ~1.3× faster per position than 35 here)."""
        if not fast:
            return [self.run(base, cells, metric, fast=False)[0] for cells in batches]
        hidden = self.states_many(base, batches, metric)
        return list(self.metric_from_hidden(metric, torch.cat(hidden)).split([len(h) for h in hidden]))

    def states_many(self, base: Base, batches: Sequence[list[Cell]], metric: Metric) -> list[torch.Tensor]:
        """:meth:`run_many`'s traces (``fast``) without their metric: per batch, the
        unembedding's input at the read positions, [cells, inputs, n_read, d]."""
        return [self._trace(base, cells, metric, fast=True)[0] for cells in batches]

    def states_packed(self, traces: Sequence[Sequence[tuple[Base, Cell, Metric]]]) -> list[torch.Tensor]:
        """Cells of several prompts (a study's facts run as one), each trace of ``traces`` one
        packed trace of ``(base, cell, metric)`` entries whose metrics read as many positions:
        per trace, the unembedding's input at its cells' read positions, [cells, 1, n_read, d]
        (as :meth:`states_many`'s; the cells of a row share its attention, each masked to
        its own run and its own base's cached positions)."""
        return [self._isolate_nonfinite(trace, *self._trace_packed(trace))[0] for trace in traces]

    def metrics_many(self, items: Sequence[tuple[Metric, torch.Tensor]]) -> list[torch.Tensor]:
        """The metric per cell of each ``(metric, states)`` item of :meth:`states_many`, the
        probabilities' in one pass over the unembedding for all (:meth:`Unembedding.metrics`)."""
        return self.unembedding.metrics(items)

    def _trace(self, base: Base, cells: list[Cell], metric: Metric, *, fast: bool,
               full_logits: bool = False, pack: bool = True) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """The trace of :meth:`run`: per cell, the unembedding's input at the read positions
        ([cells, inputs, n_read, d]; ``fast``), or the last prompt position's logits
        (``full_logits``), or the logits at the read positions; and the recorded values.
        ``pack=False``: not packed, even where :meth:`pack_tokens` would pack."""
        model, adapter = self.model, self.adapter
        unembed = adapter.unembedding(model)
        run_ids = metric.inputs(base.input_ids)
        n, L, m = metric.n_inputs, run_ids.shape[1], metric.n_read
        last_only = fast and not full_logits
        if last_only and pack and self.pack_tokens(base, metric):
            entries = [(base, cell, metric) for cell in cells]
            return self._isolate_nonfinite(entries, *self._trace_packed(entries))
        # Prefix reuse: start every cell at the batch's first written position.
        start = min(cell.first_position for cell in cells) if last_only and self.prefix_reuse(base) else 0
        below = min(cell.start for cell in cells) if fast else 0
        seeds = [cell.seed for cell in cells]
        kwargs: dict[Any, Any] = {}
        invoke = {"input_ids": run_ids.repeat(len(cells), 1)}
        if start:
            kwargs = {adapter.cache_kwarg: self._prefix_cache(base, seeds, n, start), "use_cache": True}
            # The mask covers the cached positions too (ALiBi reads it; nnsight would make one
            # of the input's width only).
            invoke = {"input_ids": invoke["input_ids"][:, start:],
                      "attention_mask": torch.ones(len(cells) * n, L, dtype=torch.long, device=run_ids.device)}
        # Every op of the batch in forward order, each with its index in this run's positions;
        # a cell's ops keep their own order. Its seed's base ops (noise) come first, where the
        # run computes what they feed: from position ``start`` on (the positions before are
        # the base run's, already under them), and only when the block they feed is not
        # skipped (a skipped block's output is the base run's, already under them).
        ops = sorted(((op, i, op.index_from(start)) for i, cell in enumerate(cells)
                      for op in self._base_ops(base, cell, start, below) + cell.sorted_ops()),
                     key=lambda item: item[0].key)
        with torch.no_grad(), model.trace(**kwargs) as tracer:
            outs = list().save()  # type: ignore[attr-defined]  # nnsight's
            recorded = list().save()  # type: ignore[attr-defined]  # nnsight's
            with tracer.invoke(**invoke):
                for layer in range(below):
                    adapter.block(model, layer).skip(_cat([base.capture.block_for(layer, seed, start) for seed in seeds]))
                values: dict[tuple[str, int], Any] = {}
                reads: list[list[Any]] = [[] for _ in cells]
                for op, i, index in ops:
                    key = (op.site.name, op.layer)
                    if key not in values:
                        values[key] = op.site.value(adapter, model, op.layer)
                    read = op.apply(values[key][i * n : (i + 1) * n], index)
                    if read is not None:
                        reads[i].append(read)
                recorded.extend(reads)
                if last_only:
                    outs.append(unembedding_input(unembed, (slice(None), slice(-m, None))))
                elif full_logits:
                    outs.append(model.output.logits[::n, -m])  # the next token after the prompt
                else:
                    outs.append(model.output.logits[:, -m:])
        if full_logits:
            return outs[0], list(recorded)
        return outs[0].reshape(len(cells), n, *outs[0].shape[1:]), list(recorded)  # [cells, inputs, n_read, d or vocab]

    def _isolate_nonfinite(self, entries: Sequence[tuple[Base, Cell, Metric]], out: torch.Tensor,
                           reads: list[list[torch.Tensor]]) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """A packed trace's result, with the cells whose states came out NaN/Inf rerun unpacked.

        Packed cells of a row share one attention: a masked-out key still enters the product,
        with weight 0, and 0 × NaN is NaN, so a NaN in one cell's states reaches every cell of
        its row. Rerun unpacked, in batches of one prompt and one ``start`` each (no cell then
        computes blocks below its own), a cell's NaN is its own, as in a run of its own; the
        others come out finite.
        """
        bad = [i for i in range(len(entries)) if not torch.isfinite(out[i]).all()]
        if len(entries) == 1 or not bad:
            return out, reads
        for key in sorted({(entries[i][1].start, id(entries[i][0])) for i in bad}):
            again = [i for i in bad if (entries[i][1].start, id(entries[i][0])) == key]
            base, _, metric = entries[again[0]]
            values, again_reads = self._trace(base, [entries[i][1] for i in again], metric, fast=True, pack=False)
            out[again] = values.to(out.dtype)
            for i, recorded in zip(again, again_reads):
                reads[i] = recorded
        return out, reads

    def _trace_packed(self, entries: Sequence[tuple[Base, Cell, Metric]]) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """:meth:`_trace` (``fast``, one input per cell) of the ``(base, cell, metric)`` entries
        (one prompt's cells, or several prompts'), the cells packed into rows, each from its
        own first written position and its own ``start`` layer (:class:`~._packing.Packed`)."""
        model, adapter = self.model, self.adapter
        unembed = adapter.unembedding(model)
        assert self._masks is not None  # packed only where pack_tokens says so
        windows, eager = self._masks
        pack = Packed(entries, windows, self.dtype if eager else None)
        cells = [cell for _, cell, _ in entries]
        # Each cell's ops (its seed's base ops first, from its own start on) by layer, in
        # forward order, with their index in the cell's span; the embedding's before block 0,
        # and only where some row runs block 0.
        below = 0 if pack.active[0] < pack.n_rows else 1
        embedding: list[tuple[Op, int, tuple]] = []
        ops: dict[int, list[tuple[Op, int, tuple]]] = {}
        every = sorted(((op, i, op.index_from(pack.starts[i])) for i, (base, cell, _) in enumerate(entries)
                        for op in self._base_ops(base, cell, pack.starts[i], below) + cell.sorted_ops()),
                       key=lambda item: item[0].key)
        for item in every:
            (embedding if item[0].site.is_embedding else ops.setdefault(item[0].layer, [])).append(item)
        # The masks and positions go to the forward as they are (a trace's keyword arguments;
        # an invoke's would be batched by nnsight, which takes no dict of masks).
        kwargs: dict[Any, Any] = {"position_ids": pack.position_ids, "attention_mask": pack.mask}
        if pack.n_cached:
            kwargs.update({adapter.cache_kwarg: pack.cache(), "use_cache": True})
        with torch.no_grad(), model.trace(**kwargs) as tracer:
            outs = list().save()  # type: ignore[attr-defined]  # nnsight's
            recorded = list().save()  # type: ignore[attr-defined]  # nnsight's
            with tracer.invoke(input_ids=pack.input_ids):
                reads: list[list[Any]] = [[] for _ in cells]
                if embedding:
                    embedded = EMBED.value(adapter, model, 0)
                    for op, i, index in embedding:
                        row, span = pack.spans[i]
                        op.apply(embedded[row : row + 1, span], index)
                for layer in range(adapter.n_layers):
                    block = adapter.block(model, layer)
                    # The block runs the rows whose cells start at or below it: rows ``active``
                    # on; the rows before take the base runs' output of the block.
                    active = pack.active[layer]
                    partly = 0 < active < pack.n_rows
                    if active == pack.n_rows:
                        block.skip(pack.base_output(layer))
                    elif partly:
                        args, kw = block.inputs
                        block.inputs = pack.narrowed(args, active), pack.narrowed(kw, active)
                    values: dict[str, Any] = {}
                    for op, i, index in ops.get(layer, ()):
                        inside = not op.site.is_block_output  # a site the block computes: its rows only
                        if op.site.name not in values:
                            values[op.site.name] = (pack.widen(block, layer) if partly and not inside
                                                    else op.site.value(adapter, model, layer))
                        row, span = pack.spans[i]
                        row -= active if inside else 0
                        read = op.apply(values[op.site.name][row : row + 1, span], index)
                        if read is not None:
                            reads[i].append(read)
                    if partly and not any(op.site.is_block_output for op, _, _ in ops.get(layer, ())):
                        pack.widen(block, layer)
                recorded.extend(reads)
                outs.append(unembedding_input(unembed, pack.read_at))
        return outs[0].reshape(len(cells), 1, pack.runs.n_read, -1), list(recorded)

    # -- the unembedding arithmetic (:mod:`._unembedding`) ------------------------------------
    @property
    def unembedding(self) -> Unembedding:
        """The unembedding's weights and the model's soft-cap, for metrics outside a trace."""
        return Unembedding(_get(self._hf, self.adapter.unembed), self.adapter.softcap)

    def metric_from_hidden(self, metric: Metric, hidden: torch.Tensor) -> torch.Tensor:
        """The metric from the unembedding's input at the read positions, [batch, inputs,
        n_read, d] → [batch] (:meth:`Unembedding.metric`)."""
        return self.unembedding.metric(metric, hidden)

    def logits(self, hidden: torch.Tensor, token_ids: list[int] | None = None) -> torch.Tensor:
        """Logits from the unembedding's input, [..., d] → [..., vocab or len(token_ids)]."""
        return self.unembedding.logits(hidden, token_ids)

    def logsumexp(self, hidden: torch.Tensor, budget: int = 1 << 20) -> torch.Tensor:
        """The log-sum-exp of every logit at each position, [..., d] → [...], in slices."""
        return self.unembedding.logsumexp(hidden, budget)

    def gradients(self, input_ids: torch.Tensor, metric: Metric, site: Site):
        """One forward with gradient tracking and one backward on ``input_ids``.

        Returns (site value per layer [1, T, width], d metric / d value per layer, metric).
        The embedding output is swapped for a detached leaf and the backward is restricted to
        it (``inputs=[leaf]``), so autograd walks every activation between the embedding and
        the metric but never computes a parameter gradient: no ``.grad`` is left on the
        model, and a frozen model (``requires_grad=False``) works too.
        """
        model, adapter = self.model, self.adapter
        T, m = input_ids.shape[1], metric.n_read
        with torch.enable_grad(), model.trace(**adapter.trace_kwargs(m)) as tracer:
            values = list().save()  # type: ignore[attr-defined]  # nnsight's
            grads = list().save()  # type: ignore[attr-defined]  # nnsight's
            with tracer.invoke(metric.inputs(input_ids)):
                embedding = adapter.embedding(model)
                leaf = embedding.output.detach().requires_grad_(True)
                embedding.output = leaf
                acts = []
                for layer in range(adapter.n_layers):
                    act = site.value(adapter, model, layer)
                    acts.append(act)
                    values.append(act[:1, :T].detach().clone())
                score = metric.score(model.output.logits[:, -m:].unsqueeze(0))[0]
                value = score.detach().save()  # type: ignore[attr-defined]  # nnsight's
                # nnsight serves .grad in the reverse of the forward order. A prompt position's
                # activation is shared by every input of the run: its gradients add up.
                with score.backward(inputs=[leaf]):
                    for act in reversed(acts):
                        grads.append(act.grad[:, :T].sum(0, keepdim=True).detach().clone())
        return list(values), list(reversed(list(grads))), float(value)


    def edge_terms(self, clean_ids: torch.Tensor, corrupt_ids: torch.Tensor, metric: Metric, clean: Capture,
                   corrupt: Capture, steps: int) -> tuple[SenderWrites, ReceiverGradients]:
        """The two factors of every circuit edge's score (:mod:`pipatch._backends._edges`):
        each sender's write, clean minus corrupt, from the captures ``clean`` and ``corrupt``
        (sites ``head`` and ``mlp``), and each receiver's gradient, averaged over ``steps``
        points from the corrupt input embeddings towards the clean ones (EAP-IG; ``steps=1``:
        the corrupt run alone, EAP)."""
        adapter, hf = self.adapter, self._hf
        check_circuit_family(adapter)
        embedding = adapter.embedding(hf)
        with torch.no_grad():
            e_clean = embedding(metric.inputs(clean_ids).to(self.device))
            e_corrupt = embedding(metric.inputs(corrupt_ids).to(self.device))
        points = [e_corrupt + (k / steps) * (e_clean - e_corrupt) for k in range(steps)]
        return (sender_writes(hf, adapter, clean, corrupt),
                receiver_gradients(self.model, hf, adapter, metric, points, corrupt_ids.to(self.device)))


    def circuit_metrics(self, clean_ids: torch.Tensor, corrupt_ids: torch.Tensor, metric: Metric,
                        keep: torch.Tensor, mean_of: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """The clean prompt's metric run as each circuit of ``keep`` ([P, receivers, senders]:
        which edges carry their sender's value; the others the corrupt run's, or with
        ``mean_of`` (run input ids of one length) their mean over those prompts), [P]
        (:func:`pipatch._backends._edges.circuit_metrics`). The means of the last ``mean_of``
        are kept: a faithfulness curve asks for the same ones at every point."""
        check_circuit_family(self.adapter)
        ablated = None
        if mean_of is not None:
            key = tuple(tuple(ids.flatten().tolist()) for ids in mean_of)
            if self._means is None or self._means[0] != key:
                self._means = None  # the old means go before the new ones are computed
                self._means = (key, mean_cache(self._hf, self.adapter, [ids.to(self.device) for ids in mean_of]))
            ablated = self._means[1]
        return circuit_metrics(self._hf, self.adapter, metric, clean_ids.to(self.device), corrupt_ids.to(self.device),
                               keep, ablated)


def _cat(parts: list[Any]) -> Any:
    if isinstance(parts[0], tuple):
        return tuple(
            torch.cat([p[i] for p in parts]) if isinstance(parts[0][i], torch.Tensor) else parts[0][i]
            for i in range(len(parts[0]))
        )
    return torch.cat(parts)


class TransformersHints(Hints):
    """The transformers backend's shortcuts, as the engine reads them: each a member of the
    backend (:meth:`TransformersBackend.prefix_reuse`, ...), which tests may replace."""

    backend: TransformersBackend

    @property
    def starts_at_layer(self) -> bool:
        return True

    @property
    def position_flops(self) -> int:
        return self.backend.position_flops

    def prefix_reuse(self, base: Base) -> bool:
        return self.backend.prefix_reuse(base)

    def pack_tokens(self, base: Base, metric: Metric) -> int:
        return self.backend.pack_tokens(base, metric)

    def shares_unembedding(self, metric: Metric) -> bool:
        return self.backend.shares_unembedding(metric)

    def run_many(self, base: Base, batches: Sequence[list[Cell]], metric: Metric, *,
                 fast: bool = True) -> list[torch.Tensor]:
        return self.backend.run_many(base, batches, metric, fast=fast)

    def states_many(self, base: Base, batches: Sequence[list[Cell]], metric: Metric) -> list[torch.Tensor] | None:
        return self.backend.states_many(base, batches, metric)

    @property
    def packs_plans(self) -> bool:
        return True

    def states_packed(self, traces: Sequence[Sequence[tuple[Base, Cell, Metric]]]) -> list[torch.Tensor]:
        return self.backend.states_packed(traces)

    def metrics_many(self, items: Sequence[tuple[Metric, torch.Tensor]]) -> list[torch.Tensor]:
        return self.backend.metrics_many(items)

    @property
    def plans_together(self) -> int:
        return PLANS_TOGETHER
