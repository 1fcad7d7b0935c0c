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
  (:class:`_Packed`): no cell recomputes positions before its own, or blocks below its own,
  because another cell of its batch writes earlier or lower. A 10-seed causal trace then
  computes a third fewer positions, and rows of several grid rows share one trace.
* **Unembed one position.** The metric needs the last position only (the last few for a
  multi-token answer), and a logit difference needs two rows of the unembedding, not 262k: the
  invoke reads the unembedding's *input* at those positions and skips the unembedding; :meth:`TransformersBackend.logits` computes
  just the rows the metric reads.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Sequence
from typing import Any

import torch

from .._cells import Base, Capture, Cell, Metric
from .._models import _get, adapter_for, dispatched, first
from .._sites import RESID, Site
from ._described import Described

__all__ = ["TransformersBackend"]

# Positions per packed trace (:class:`_Packed`), all its rows together, by the device type the
# model runs on. On the CPU, enough to run each block's matrix products near its peak, and
# more only adds to the working set. A device not listed (a GPU) sets no bound of its own
# (:data:`NO_BOUND`): a packed trace then holds what any batch holds, the engine's batch size
# in cells, which on a GPU is sized from its free memory (``pipatch._engine.auto_batch_size``),
# and at most a prompt's positions each.
PACK_TOKENS = {"cpu": 1024}
NO_BOUND = sys.maxsize
# Positions per row of a packed trace (:func:`_layout`): a row's attention runs over all its
# positions, so a row of 64 costs Gemma 3 270M about 3 % of its block.
ROW_TOKENS = 64


class TransformersBackend(Described):
    """Runs cells on an nnsight model of a transformers checkpoint, in this process."""

    kind = "transformers"
    starts_at_layer = True

    def __init__(self, model: Any, *, reuse_prefix: bool = True, pack: bool = True):
        """``reuse_prefix=False`` switches prefix reuse off (every run starts at position 0),
        ``pack=False`` packing (:class:`_Packed`: a batch's cells then start at the smallest
        first position among them): the same numbers, slower; for comparing."""
        self.model = dispatched(model)
        self.adapter = adapter_for(self.model)
        self.reuse_prefix = reuse_prefix
        self.pack = pack

    # -- what the model is ------------------------------------------------------------------
    @property
    def _hf(self) -> Any:
        return getattr(self.model, "_module", self.model)

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
        label = getattr(self.model, "_pipatch_name", None)
        if label:
            return label
        hf = self._hf
        return str(getattr(hf, "name_or_path", "") or getattr(hf.config, "_name_or_path", "") or type(hf).__name__)

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
        return str(getattr(self.model, "_pipatch_path", None) or getattr(hf.config, "_name_or_path", "")
                   or getattr(hf, "name_or_path", ""))

    def meta(self) -> dict[str, Any]:
        """What a result records about the model (:meth:`Described.meta`), plus where it loads
        from (``model_path``) and where the adapter found each site (``adapter``), which
        ``Result.code()`` reads."""
        return {**super().meta(), "model_path": self.path, "adapter": dataclasses.asdict(self.adapter)}

    # -- runs -------------------------------------------------------------------------------
    def capture(
        self,
        input_ids: torch.Tensor,
        metric: Metric,
        sites: Sequence[Site] = (),
        *,
        noise: torch.Tensor | None = None,
        noise_positions: list[int] | None = None,
    ) -> Capture:
        """Run ``input_ids`` ([1, T]) once per noise draw and keep every block output and site.

        ``noise`` is [n, len(noise_positions), d]: invoke ``i`` adds draw ``i`` to the
        embedding output at ``noise_positions`` (causal tracing's corrupted runs); ``None``
        is one clean run. ``sites`` lists the site values to keep besides the block outputs.
        """
        n = 1 if noise is None else noise.shape[0]
        return self._capture([input_ids] * n, metric, sites, noise=noise, noise_positions=noise_positions)

    def captures(self, prompts: Sequence[torch.Tensor], metric: Metric, sites: Sequence[Site] = ()) -> list[Capture]:
        """Several prompts' runs ([1, T] each, one length), each kept as :meth:`capture` keeps one,
        in one trace: the model's weights are read once for all of them (a run of a few tokens
        costs mostly that read on a CPU: two 9-token runs of Gemma 3 270M 0.11 s, one 0.09 s)."""
        both = self._capture(list(prompts), metric, sites)
        return [both.run(i) for i in range(len(prompts))]

    def _capture(self, prompts: list[torch.Tensor], metric: Metric, sites: Sequence[Site] = (), *,
                 noise: torch.Tensor | None = None, noise_positions: list[int] | None = None) -> Capture:
        """Run ``i`` of one trace: ``prompts[i]`` ([1, T]) plus, given ``noise``, draw ``i``; all
        of them one batch of one invoke (one intervention per layer, however many runs).

        A metric that reads a softmax (and causal tracing's P(answer)) is read off the model's
        own logits; a logit difference, off the two rows of the unembedding it needs
        (:meth:`metric_from_hidden`, as a patched run's is): the 262k-row unembedding is then
        not read at all, and the run has no ``prob``."""
        model, adapter = self.model, self.adapter
        n, k = len(prompts), metric.n_inputs
        T, m = prompts[0].shape[1], metric.n_read
        keep = sorted({s for s in sites if s is not RESID}, key=lambda s: s.order)
        layers = range(adapter.n_layers)
        softmax = metric.token_ids is None
        unembed = adapter.unembedding(model)
        cache = self._new_cache()
        kwargs = {adapter.cache_kwarg: cache, "use_cache": True} if cache is not None else {}
        with torch.no_grad(), model.trace(**adapter.trace_kwargs(m), **kwargs) as tracer:
            saved = list().save()
            with tracer.invoke(torch.cat([metric.inputs(prompt) for prompt in prompts])):
                embedded = adapter.embedding(model).output
                if noise is not None:
                    embedded[:, noise_positions] += noise.repeat_interleave(k, dim=0).to(embedded.dtype)
                embedded_copy = embedded[::k, :T].clone()
                blocks = []
                values = {s.name: [] for s in keep}
                for layer in layers:
                    for s in keep:
                        values[s.name].append(s.value(adapter, model, layer)[::k, :T].clone())
                    out = adapter.block(model, layer).output
                    blocks.append(tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in out)
                                  if isinstance(out, tuple) else out.clone())
                if softmax:
                    read = model.output.logits[:, -m:].float()
                else:
                    read = _unembedding_input(unembed, (slice(None), slice(-m, None)))
                saved.append((blocks, values, read, embedded_copy))
        blocks, values, read, embedded = saved[0]
        values[RESID.name] = [first(b)[::k, :T] for b in blocks]
        keys = None
        if cache is not None and len(cache.layers) == adapter.n_layers:
            # One row per run (the inputs share the prompt), prompt positions only.
            keys = [(layer.keys[::k, :, :T], layer.values[::k, :, :T]) for layer in cache.layers]
        read = read.reshape(n, k, m, -1)  # [runs, inputs, n_read, vocab] (softmax) or [..., d]
        if softmax:
            score, prob = metric.score(read), metric.answer_prob(read)
        else:
            score, prob = self.metric_from_hidden(metric, read), None
        return Capture(blocks=blocks, sites=values, metric=score, embedded=embedded, prob=prob, inputs=k, keys=keys)

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
        from transformers import DynamicCache

        rows = torch.tensor(seeds, device=base.capture.keys[0][0].device).repeat_interleave(inputs)
        return DynamicCache(ddp_cache_data=[(k[:, :, :start].index_select(0, rows), v[:, :, :start].index_select(0, rows))
                                            for k, v in base.capture.keys])

    def prefix_reuse(self, base: Base) -> bool:
        """Whether :meth:`run` can start cells of ``base`` at their first written position."""
        return self.reuse_prefix and base.capture.keys is not None

    @functools.cached_property
    def position_flops(self) -> int:
        """Two FLOPs per weight of a block (a multiply and an add) for each position it runs."""
        return 2 * sum(p.numel() for p in _get(self._hf, self.adapter.blocks)[0].parameters())

    def pack_tokens(self, base: Base, metric: Metric) -> int:
        """How many positions a packed trace holds (:class:`_Packed`: each cell from its own
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
        implementation = getattr(text, "_attn_implementation", None) or getattr(config, "_attn_implementation", None)
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
        return metric.token_ids is None

    def run_many(self, base: Base, batches: Sequence[list[Cell]], metric: Metric, *,
                 fast: bool = True) -> list[torch.Tensor]:
        """Several batches, one trace each, as :meth:`run`; with ``fast``, the metric of every
        batch's cells in one go from their read positions' states: one product with the
        unembedding for all of them (70 positions run ~1.3× faster per position than 35 here)."""
        if not fast:
            return super().run_many(base, batches, metric, fast=fast)
        hidden = [self._trace(base, cells, metric, fast=True)[0] for cells in batches]
        return list(self.metric_from_hidden(metric, torch.cat(hidden)).split([len(h) for h in hidden]))

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
            return self._isolate_nonfinite(base, cells, metric, *self._trace_packed(base, cells, metric))
        # Prefix reuse: start every cell at the batch's first written position.
        start = min(cell.first_position for cell in cells) if last_only and self.prefix_reuse(base) else 0
        below = min(cell.start for cell in cells) if fast else 0
        seeds = [cell.seed for cell in cells]
        kwargs, invoke = {}, {"input_ids": run_ids.repeat(len(cells), 1)}
        if start:
            kwargs = {adapter.cache_kwarg: self._prefix_cache(base, seeds, n, start), "use_cache": True}
            # The mask covers the cached positions too (ALiBi reads it; nnsight would make one
            # of the input's width only).
            invoke = {"input_ids": invoke["input_ids"][:, start:],
                      "attention_mask": torch.ones(len(cells) * n, L, dtype=torch.long, device=run_ids.device)}
        noised = [i for i, q in enumerate(base.noise_positions or []) if q >= start]
        noise_at = [base.noise_positions[i] - start for i in noised]
        # Every op of the batch in forward order; a cell's ops keep their own order.
        ops = sorted(((op, i) for i, cell in enumerate(cells) for op in cell.sorted_ops()), key=lambda pair: pair[0].key)
        with torch.no_grad(), model.trace(**kwargs) as tracer:
            outs = list().save()
            recorded = list().save()
            with tracer.invoke(**invoke):
                if base.noise is not None and below == 0 and noised:
                    embedded = adapter.embedding(model).output
                    noise = base.noise[seeds][:, noised].repeat_interleave(n, dim=0)
                    embedded[:, noise_at] += noise.to(embedded.dtype)
                for layer in range(below):
                    adapter.block(model, layer).skip(_cat([base.capture.block_for(layer, seed, start) for seed in seeds]))
                values: dict[tuple[str, int], Any] = {}
                reads: list[list[Any]] = [[] for _ in cells]
                for op, i in ops:
                    key = (op.site.name, op.layer)
                    if key not in values:
                        values[key] = op.site.value(adapter, model, op.layer)
                    rows = values[key][i * n : (i + 1) * n]
                    if op.value is None:
                        reads[i].append(rows[op.index_from(start)].clone())
                    else:
                        rows[op.index_from(start)] = op.value
                recorded.extend(reads)
                if last_only:
                    outs.append(_unembedding_input(unembed, (slice(None), slice(-m, None))))
                elif full_logits:
                    outs.append(model.output.logits[::n, -m])  # the next token after the prompt
                else:
                    outs.append(model.output.logits[:, -m:])
        if full_logits:
            return outs[0], list(recorded)
        return outs[0].reshape(len(cells), n, *outs[0].shape[1:]), list(recorded)  # [cells, inputs, n_read, d or vocab]

    def _isolate_nonfinite(self, base: Base, cells: list[Cell], metric: Metric, out: torch.Tensor,
                           reads: list[list[torch.Tensor]]) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """A packed trace's result, with the cells whose states came out NaN/Inf rerun unpacked.

        Packed cells of a row share one attention: a masked-out key still enters the product,
        with weight 0, and 0 × NaN is NaN, so a NaN in one cell's states reaches every cell of
        its row. Rerun unpacked, in batches of one ``start`` each (no cell then computes blocks below
        its own), a cell's NaN is its own, as in a run of its own; the others come out finite.
        """
        bad = [i for i in range(len(cells)) if not torch.isfinite(out[i]).all()]
        if len(cells) == 1 or not bad:
            return out, reads
        for start in sorted({cells[i].start for i in bad}):
            again = [i for i in bad if cells[i].start == start]
            values, again_reads = self._trace(base, [cells[i] for i in again], metric, fast=True, pack=False)
            out[again] = values.to(out.dtype)
            for i, recorded in zip(again, again_reads):
                reads[i] = recorded
        return out, reads

    def _trace_packed(self, base: Base, cells: list[Cell], metric: Metric) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """:meth:`_trace` (``fast``, one input per cell) with the cells packed into rows, each
        from its own first written position and its own ``start`` layer (:class:`_Packed`)."""
        model, adapter = self.model, self.adapter
        unembed = adapter.unembedding(model)
        windows, eager = self._masks
        pack = _Packed(cells, base, metric, windows, self.dtype if eager else None)
        ops: dict[int, list[tuple[Any, int]]] = {}
        for op, i in sorted(((op, i) for i, cell in enumerate(cells) for op in cell.sorted_ops()),
                            key=lambda pair: pair[0].key):
            ops.setdefault(op.layer, []).append((op, i))
        # The masks and positions go to the forward as they are (a trace's keyword arguments;
        # an invoke's would be batched by nnsight, which takes no dict of masks).
        kwargs = {"position_ids": pack.position_ids, "attention_mask": pack.mask}
        if pack.n_cached:
            kwargs.update({adapter.cache_kwarg: pack.cache(), "use_cache": True})
        with torch.no_grad(), model.trace(**kwargs) as tracer:
            outs = list().save()
            recorded = list().save()
            with tracer.invoke(input_ids=pack.input_ids):
                if pack.noise is not None and pack.active[0] < pack.n_rows:  # rows from block 0 on
                    embedded = adapter.embedding(model).output
                    embedded[pack.noise_at] += pack.noise.to(embedded.dtype)
                reads: list[list[Any]] = [[] for _ in cells]
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
                    for op, i in ops.get(layer, ()):
                        inside = op.site.where != "block"  # a site the block computes: its rows only
                        if op.site.name not in values:
                            values[op.site.name] = (pack.widen(block, layer) if partly and not inside
                                                    else op.site.value(adapter, model, layer))
                        row, span = pack.spans[i]
                        row -= active if inside else 0
                        where = values[op.site.name][row : row + 1, span]
                        if op.value is None:
                            reads[i].append(where[op.index_from(pack.starts[i])].clone())
                        else:
                            where[op.index_from(pack.starts[i])] = op.value
                    if partly and RESID.name not in values:
                        pack.widen(block, layer)
                recorded.extend(reads)
                outs.append(_unembedding_input(unembed, pack.read_at))
        return outs[0].reshape(len(cells), 1, metric.n_read, -1), list(recorded)

    @torch.no_grad()
    def metric_from_hidden(self, metric: Metric, hidden: torch.Tensor) -> torch.Tensor:
        """The metric from the unembedding's input at the read positions,
        [batch, inputs, n_read, d] → [batch].

        A logit difference reads two rows of the unembedding. A probability needs every
        logit's share of the softmax, but not the logits themselves: the read tokens' logits
        and the log-sum-exp of all of them (:meth:`logsumexp`) — one pass over the
        unembedding, never the whole vocabulary's logits in memory at once.
        """
        if metric.token_ids is not None:
            return metric.score(self.logits(hidden, metric.token_ids), subset=True)
        lse = self.logsumexp(hidden)
        picked = self.logits(hidden, metric.read_ids)
        return metric.combine(metric.pieces(picked, lse=lse))

    def _unembedding(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        module = _get(self._hf, self.adapter.unembed)
        return module.weight, getattr(module, "bias", None)

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        """Float32 logits, soft-capped where the model caps them (Gemma 2)."""
        logits = logits.float()
        if self.adapter.softcap:
            logits = torch.tanh(logits / self.adapter.softcap) * self.adapter.softcap
        return logits

    def logits(self, hidden: torch.Tensor, token_ids: list[int] | None = None) -> torch.Tensor:
        """Logits from the input of the unembedding (final-normed states, [..., d] → [..., vocab]).

        ``token_ids=None`` gives the whole vocabulary; a list gives just those columns, which is
        all a logit difference needs and avoids multiplying by a 262k-row matrix.
        """
        weight, bias = self._unembedding()
        if token_ids is not None:
            index = torch.as_tensor(token_ids, device=weight.device)
            weight = weight.index_select(0, index)
            bias = bias.index_select(0, index) if bias is not None else None
        # ``weight @ hidden.T`` rather than ``linear``: for a few dozen positions against a
        # 262k-row matrix it runs 15-40 % faster on the CPU, with the same numbers.
        flat = hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype)
        out = torch.mm(weight, flat.T).T
        if bias is not None:
            out = out + bias
        return self._capped(out.reshape(*hidden.shape[:-1], weight.shape[0]))

    def logsumexp(self, hidden: torch.Tensor, budget: int = 1 << 20) -> torch.Tensor:
        """The log-sum-exp of every logit at each position, [..., d] → [...] (float32).

        The unembedding is read in slices of vocabulary rows, each slice's logits
        (``rows × positions``, about ``budget`` values: 4 MB) reduced at once and the slices
        combined with ``logaddexp``: the logits stay in the cache instead of 262k × positions
        of them going through memory twice (the product, then the softmax). Measured on this
        CPU for 70 positions: 0.23 s against 0.38 s for the full logits then ``log_softmax``.
        """
        weight, bias = self._unembedding()
        flat = hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype)
        rows = max(1, budget // max(1, flat.shape[0]))
        total = None
        for top in range(0, weight.shape[0], rows):
            part = torch.mm(weight[top : top + rows], flat.T)  # [rows, positions]
            if bias is not None:
                part = part + bias[top : top + rows, None]
            part = torch.logsumexp(self._capped(part), dim=0)
            total = part if total is None else torch.logaddexp(total, part)
        return total.reshape(hidden.shape[:-1])

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
            values = list().save()
            grads = list().save()
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
                value = score.detach().save()
                # nnsight serves .grad in the reverse of the forward order. A prompt position's
                # activation is shared by every input of the run: its gradients add up.
                with score.backward(inputs=[leaf]):
                    for act in reversed(acts):
                        grads.append(act.grad[:, :T].sum(0, keepdim=True).detach().clone())
        return list(values), list(reversed(list(grads))), float(value)


def _unembedding_input(unembed: Any, at: Any) -> Any:
    """Inside an invoke: the unembedding's input (the final-normed states, [batch, positions,
    d]) at ``at``, with the module itself skipped (its output a placeholder of one value per
    position, never read). The metric is then computed from these states outside the trace,
    for the read positions and the metric's rows of the unembedding only
    (:meth:`TransformersBackend.metric_from_hidden`)."""
    final = unembed.input
    read = final[at]
    unembed.skip(torch.zeros(*final.shape[:2], 1, dtype=final.dtype, device=final.device))
    return read


def _cat(parts: list[Any]) -> Any:
    if isinstance(parts[0], tuple):
        return tuple(
            torch.cat([p[i] for p in parts]) if isinstance(parts[0][i], torch.Tensor) else parts[0][i]
            for i in range(len(parts[0]))
        )
    return torch.cat(parts)


class _Packed:
    """Cells packed into rows, each cell from its own first written position and its own
    ``start`` layer.

    Unpacked, a batch of cells runs as rows of one width from one layer: every cell from the
    batch's first written position and lowest ``start``, so a cell that writes later or
    higher recomputes base-run states below and before its own. Packed, cell ``i`` is
    positions ``starts[i] … L − 1`` of its run, laid beside other cells in one row
    (``spans[i]``: its row and columns) with their own ``position_ids``. A row holds cells of
    one ``start`` (:func:`_layout`), rows of higher ``start`` first, so block ``k`` runs the
    rows from ``active[k]`` on (its inputs :meth:`narrowed` to them) and the rows before take
    the base runs' output of the block (:meth:`widen`). Each row's cached keys and values are
    its cells' seeds' base runs before their starts, and the attention mask lets a position
    see its own seed's cached positions before its cell's start and its own cell's positions
    up to itself, within the layer's sliding window where it has one: what the cell's run
    alone would see. A cell then costs the layers above its patch at the positions from its
    patch on, and its attention the keys its own run has; a row's padding (at most a few
    per cent for the rows of a grid) is the only extra work.
    """

    def __init__(self, cells: list[Cell], base: Base, metric: Metric, windows: dict[str, int | None],
                 additive: torch.dtype | None):
        run_ids = metric.inputs(base.input_ids)[0]
        L, m, device = run_ids.shape[0], metric.n_read, run_ids.device
        self.base = base
        self.starts = [min(cell.first_position, L - m) for cell in cells]
        rows = _layout([cell.start for cell in cells], [L - b for b in self.starts])
        self.n_rows, width = len(rows), max(sum(L - self.starts[i] for i in row) for row in rows)
        # What each slot of the [rows, width] layout holds: its cell (-1: padding, which sees
        # only padding), seed and run position.
        cell_at = torch.full((self.n_rows, width), -1)
        seed_at = torch.zeros(self.n_rows, width, dtype=torch.long)
        pos_at = torch.zeros(self.n_rows, width, dtype=torch.long)
        start_at = torch.zeros(self.n_rows, width, dtype=torch.long)
        self.spans: list[tuple[int, slice]] = [(0, slice(0))] * len(cells)
        for r, row in enumerate(rows):
            at = 0
            for i in row:
                span = slice(at, at + L - self.starts[i])
                self.spans[i] = (r, span)
                cell_at[r, span], seed_at[r, span], start_at[r, span] = i, cells[i].seed, self.starts[i]
                pos_at[r, span] = torch.arange(self.starts[i], L)
                at = span.stop
        # Rows of higher ``start`` first: block ``k`` runs rows ``active[k]`` on.
        row_start = [cells[row[0]].start for row in rows]
        n_layers = len(base.capture.blocks)
        self.active = [next((r for r, s in enumerate(row_start) if s <= layer), self.n_rows) for layer in range(n_layers)]
        self.seed_at, self.pos_at = seed_at.to(device), pos_at.to(device)
        self.input_ids = run_ids[self.pos_at]
        self.position_ids = self.pos_at
        reads = [(self.spans[i][0], self.spans[i][1].stop - m + j) for i in range(len(cells)) for j in range(m)]
        self.read_at = tuple(torch.tensor(index, device=device) for index in zip(*reads))
        # Each row's cached positions: per seed among its cells, up to the latest start of them.
        cached = [{} for _ in rows]
        for r, row in enumerate(rows):
            for i in row:
                seed = cells[i].seed
                cached[r][seed] = max(cached[r].get(seed, 0), self.starts[i])
        self.n_cached = max(sum(row.values()) for row in cached)
        K = self.n_cached
        cache_seed = torch.zeros(self.n_rows, K, dtype=torch.long)
        cache_pos = torch.zeros(self.n_rows, K, dtype=torch.long)
        cache_used = torch.zeros(self.n_rows, K, dtype=torch.bool)
        for r, row in enumerate(cached):
            at = 0
            for seed, n in row.items():
                cache_seed[r, at : at + n], cache_pos[r, at : at + n] = seed, torch.arange(n)
                cache_used[r, at : at + n] = True
                at += n
        self.cache_seed, self.cache_pos = cache_seed.to(device), cache_pos.to(device)
        # [rows, width, K + width]: a slot sees a cached position of its own seed before its
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
        # Causal tracing's noise, at the noised positions of each cell's span.
        at, rows_noise = [], []
        for i, cell in enumerate(cells):
            r, span = self.spans[i]
            for j, q in enumerate(base.noise_positions or []):
                if q >= self.starts[i]:
                    at.append((r, span.start + q - self.starts[i]))
                    rows_noise.append(base.noise[cell.seed, j])
        self.noise = torch.stack(rows_noise) if rows_noise else None
        self.noise_at = tuple(torch.tensor(index, device=device) for index in zip(*at)) if at else None

    def cache(self) -> Any:
        """The cached keys and values, per layer for the rows its block runs: each row's
        seeds' base runs before their cells' starts (zeros, masked, to the longest row's)."""
        from transformers import DynamicCache

        layers = []
        for layer, (k, v) in enumerate(self.base.capture.keys):
            rows = slice(self.active[layer], None)
            seeds, positions = self.cache_seed[rows], self.cache_pos[rows]
            # [rows, K, kv_heads, head_dim] → [rows, kv_heads, K, head_dim]
            layers.append((k[seeds, :, positions].transpose(1, 2), v[seeds, :, positions].transpose(1, 2)))
        return DynamicCache(ddp_cache_data=layers)

    def base_states(self, layer: int, upto: int | None = None) -> torch.Tensor:
        """The base runs' hidden states out of block ``layer`` in the layout's first ``upto``
        rows (all of them by default): [rows, width, d]."""
        hidden = first(self.base.capture.blocks[layer])
        return hidden[self.seed_at[:upto], self.pos_at[:upto]]

    def base_output(self, layer: int) -> Any:
        """:meth:`base_states` of every row in block ``layer``'s own output structure (what
        the block is skipped with)."""
        return _with_hidden(self.base.capture.blocks[layer], self.base_states(layer))

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
        block.output = _with_hidden(out, hidden)
        return hidden


def _layout(starts: list[int], lengths: list[int], width: int = 0) -> list[list[int]]:
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
        fill, members = [0] * n, [[] for _ in range(n)]
        for i in group:
            least = min(range(n), key=fill.__getitem__)
            members[least].append(i)
            fill[least] += lengths[i]
        rows.extend(members)
    return rows


def _with_hidden(template: Any, hidden: torch.Tensor) -> Any:
    """``hidden`` in the structure of a block's output ``template``: itself, or the tuple with
    its hidden states replaced (the other items, attention weights, are read by nothing)."""
    return (hidden, *template[1:]) if isinstance(template, tuple) else hidden
