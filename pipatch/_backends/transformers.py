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
  4-D attention mask (every family here but ALiBi's BLOOM), a batch's cells are laid one
  after another in one sequence, each from its own first written position, and a mask keeps
  each to what its own run would see (:class:`_Packed`): no cell recomputes positions before
  its own because another cell of its batch writes earlier. A 10-seed causal trace then
  computes a third fewer positions.
* **Unembed one position.** The metric needs the last position only (the last few for a
  multi-token answer), and a logit difference needs two rows of the unembedding, not 262k: the
  invoke reads the unembedding's *input* at those positions and skips the unembedding; :meth:`TransformersBackend.logits` computes
  just the rows the metric reads.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch

from .._cells import Base, Capture, Cell, Metric
from .._models import _get, adapter_for, dispatched, first
from .._sites import RESID, Site
from ._described import Described

__all__ = ["TransformersBackend"]

# Positions per packed trace (:class:`_Packed`). Packed cells attend through one mask over
# every cell's positions and cached keys, so attention grows with the square of the pack
# while the rest of a block grows with it: 256 positions of Gemma 3 270M cost about 10 %
# more attention than 256 separate positions would, and run the block's matrix products
# near this CPU's peak.
PACK_TOKENS = 512


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
        """Run ``i`` of one trace: ``prompts[i]`` ([1, T]) plus, given ``noise``, draw ``i``."""
        model, adapter = self.model, self.adapter
        n = len(prompts)
        T, m = prompts[0].shape[1], metric.n_read
        keep = sorted({s for s in sites if s is not RESID}, key=lambda s: s.order)
        layers = range(adapter.n_layers)
        cache = self._new_cache()
        kwargs = {adapter.cache_kwarg: cache, "use_cache": True} if cache is not None else {}
        with torch.no_grad(), model.trace(**adapter.trace_kwargs(m), **kwargs) as tracer:
            runs = list().save()
            for i in range(n):
                with tracer.invoke(metric.inputs(prompts[i])):
                    embedded = adapter.embedding(model).output
                    if noise is not None:
                        embedded[:, noise_positions] += noise[i].to(embedded.dtype)
                    embedded_copy = embedded[:1, :T].clone()
                    blocks = []
                    values = {s.name: [] for s in keep}
                    for layer in layers:
                        for s in keep:
                            values[s.name].append(s.value(adapter, model, layer)[:1, :T].clone())
                        out = adapter.block(model, layer).output
                        blocks.append(tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in out)
                                      if isinstance(out, tuple) else out.clone())
                    logits = model.output.logits[:, -m:].float()
                    runs.append((blocks, values, logits, embedded_copy))
        blocks = [_cat([r[0][layer] for r in runs]) for layer in layers]
        values = {s.name: [torch.cat([r[1][s.name][layer] for r in runs]) for layer in layers] for s in keep}
        values[RESID.name] = [first(b)[:: metric.n_inputs, :T] for b in blocks]
        logits = torch.stack([r[2] for r in runs])  # [n, inputs, n_read, vocab]
        keys = None
        if cache is not None and len(cache.layers) == adapter.n_layers:
            # One row per run (the inputs share the prompt), prompt positions only.
            keys = [(layer.keys[:: metric.n_inputs, :, :T], layer.values[:: metric.n_inputs, :, :T])
                    for layer in cache.layers]
        return Capture(blocks=blocks, sites=values, metric=metric.score(logits),
                       embedded=torch.cat([r[3] for r in runs]), prob=metric.answer_prob(logits),
                       inputs=metric.n_inputs, keys=keys)

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

    def pack_tokens(self, base: Base, metric: Metric) -> int:
        """How many positions a packed trace holds (:class:`_Packed`: each cell from its own
        first written position), or 0 where this model's batches are not packed (then a
        batch's cells start at the smallest first position among them)."""
        if not (self.pack and self.prefix_reuse(base) and metric.n_inputs == 1 and self._masks is not None):
            return 0
        return PACK_TOKENS

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
                    final = unembed.input
                    outs.append(final[:, -m:])
                    # The logits are computed from ``final`` outside the trace, for the read
                    # positions and the metric's rows only; the module returns a placeholder.
                    unembed.skip(torch.zeros(final.shape[0], L - start, 1, dtype=final.dtype, device=final.device))
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

        Packed cells share one attention: a masked-out key still enters the product, with
        weight 0, and 0 × NaN is NaN, so a NaN in one cell's states reaches every cell beside
        it. Rerun unpacked, in batches of one ``start`` each (no cell then computes blocks below
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
        """:meth:`_trace` (``fast``, one input per cell) with the cells packed into one sequence,
        each from its own first written position and its own ``start`` layer (:class:`_Packed`)."""
        model, adapter = self.model, self.adapter
        unembed = adapter.unembedding(model)
        windows, eager = self._masks
        pack = _Packed(cells, base, metric, windows, self.dtype if eager else None)
        below = min(cell.start for cell in cells)
        ops = sorted(((op, i) for i, cell in enumerate(cells) for op in cell.sorted_ops()), key=lambda pair: pair[0].key)
        by_layer: dict[int, list[tuple[Any, int]]] = {}
        for op, i in ops:
            by_layer.setdefault(op.layer, []).append((op, i))
        # The mask and positions go to the forward as they are (a trace's keyword arguments;
        # an invoke's would be batched by nnsight, which takes no dict of masks).
        kwargs = {"position_ids": pack.position_ids, "attention_mask": pack.mask}
        if pack.n_cached:
            kwargs.update({adapter.cache_kwarg: pack.cache(), "use_cache": True})
        with torch.no_grad(), model.trace(**kwargs) as tracer:
            outs = list().save()
            recorded = list().save()
            with tracer.invoke(input_ids=pack.input_ids):
                if base.noise is not None and below == 0 and pack.noise_at:
                    embedded = adapter.embedding(model).output
                    embedded[:, pack.noise_at] += pack.noise.to(embedded.dtype)
                reads: list[list[Any]] = [[] for _ in cells]
                for layer in range(adapter.n_layers):
                    block = adapter.block(model, layer)
                    # The block runs the cells that start at or below it: the sequence's last
                    # ``n_positions - active`` positions; the rest take the base run's output.
                    active = pack.active_from(layer)
                    if active == pack.n_positions:
                        block.skip(pack.base_states(layer, active, whole=True))
                    elif active:
                        args, kw = block.inputs
                        block.inputs = pack.narrowed(args, active), pack.narrowed(kw, active)
                    values: dict[str, Any] = {}
                    for op, i in by_layer.get(layer, ()):
                        inside = op.site.where != "block"  # a site the block computes: narrowed
                        if op.site.name not in values:
                            values[op.site.name] = (pack.widen(block, layer, active)
                                                    if not inside and 0 < active < pack.n_positions else op.site.value(adapter, model, layer))
                        span = pack.spans[i]
                        shift = active if inside else 0
                        rows = values[op.site.name][:, span.start - shift : span.stop - shift]
                        if op.value is None:
                            reads[i].append(rows[op.index_from(pack.starts[i])].clone())
                        else:
                            rows[op.index_from(pack.starts[i])] = op.value
                    if 0 < active < pack.n_positions and RESID.name not in values:
                        pack.widen(block, layer, active)
                recorded.extend(reads)
                final = unembed.input
                outs.append(final[0, pack.read_at])
                unembed.skip(torch.zeros(1, pack.n_positions, 1, dtype=final.dtype, device=final.device))
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


def _cat(parts: list[Any], dim: int = 0) -> Any:
    """Block outputs (a tensor, or a tuple whose first item is the hidden states) joined along
    ``dim``: batch rows (0) or positions (1). A tuple's items that are not per position
    (``dim`` 1) are the first part's."""
    if isinstance(parts[0], tuple):
        hidden = parts[0][0]
        return tuple(
            torch.cat([p[i] for p in parts], dim) if isinstance(item, torch.Tensor)
            and (dim == 0 or item.shape[:2] == hidden.shape[:2]) else item
            for i, item in enumerate(parts[0])
        )
    return torch.cat(parts, dim)


class _Packed:
    """Cells packed into one sequence, each from its own first written position and its own
    ``start`` layer.

    A batch of cells normally runs as rows of one width from one layer: every cell from the
    batch's first written position and lowest ``start``, so a cell that writes later or
    higher recomputes the base run's states below and before its own. Packed, cell ``i`` is
    positions ``starts[i] … L − 1`` of its run, laid one after another in a single batch row
    (``spans[i]``) with their own ``position_ids``, cells of higher ``start`` first. Block
    ``k`` runs only the cells whose ``start`` is at most ``k``: the sequence from
    :meth:`active_from` on (its inputs :meth:`narrowed`); the positions before take the base
    run's output of that block (:meth:`widen`). The cached keys and values hold each seed's
    base run before the latest start among its cells, and the attention mask lets a position
    see its own seed's cached positions before its cell's start and its own cell's positions
    up to itself, within the layer's sliding window where it has one — what the cell's run
    alone would see. A cell then costs exactly the layers above its patch at the positions
    from its patch on.
    """

    def __init__(self, cells: list[Cell], base: Base, metric: Metric, windows: dict[str, int | None],
                 additive: torch.dtype | None):
        run_ids = metric.inputs(base.input_ids)[0]
        L, m = run_ids.shape[0], metric.n_read
        device = run_ids.device
        self.base, self.cells = base, cells
        self.starts = [min(cell.first_position, L - m) for cell in cells]
        # Cells of higher ``start`` first: the cells a block runs are always the sequence's end.
        self.order = sorted(range(len(cells)), key=lambda i: -cells[i].start)
        self.spans: list[slice] = [slice(0)] * len(cells)
        at = 0
        for i in self.order:
            self.spans[i] = slice(at, at + L - self.starts[i])
            at = self.spans[i].stop
        self.n_positions = at
        self.input_ids = torch.cat([run_ids[self.starts[i]:] for i in self.order])[None]
        positions = torch.cat([torch.arange(self.starts[i], L) for i in self.order])
        self.position_ids = positions[None].to(device)
        self.read_at = [self.spans[i].stop - m + j for i in range(len(cells)) for j in range(m)]
        # Each seed's cached positions: up to the latest start among its cells.
        seeds = [cell.seed for cell in cells]
        self.cached = {seed: max(b for s, b in zip(seeds, self.starts) if s == seed) for seed in dict.fromkeys(seeds)}
        self.n_cached = sum(self.cached.values())
        cached_seed = torch.cat([torch.full((n,), seed) for seed, n in self.cached.items()])
        cached_position = torch.cat([torch.arange(n) for n in self.cached.values()])
        cell_of = torch.cat([torch.full((self.spans[i].stop - self.spans[i].start,), i) for i in self.order])
        seed_of, start_of = torch.tensor(seeds)[cell_of], torch.tensor(self.starts)[cell_of]
        sees_cached = (cached_seed[None] == seed_of[:, None]) & (cached_position[None] < start_of[:, None])
        sees_own = (cell_of[None] == cell_of[:, None]) & (positions[None] <= positions[:, None])
        sees = torch.cat([sees_cached, sees_own], 1)
        key_position = torch.cat([cached_position, positions])
        masks = {}
        for kind, window in windows.items():
            allowed = sees if window is None else sees & (positions[:, None] - key_position[None] < window)
            allowed = allowed[None, None].to(device)
            # SDPA takes the mask as booleans; eager attention adds it to the scores.
            masks[kind] = allowed if additive is None else torch.zeros(
                allowed.shape, dtype=additive, device=device).masked_fill(~allowed, torch.finfo(additive).min)
        self.mask = masks[""] if "" in masks else masks
        # Noise of causal tracing's corrupted runs, at the noised positions of each cell's span.
        self.noise_at, rows = [], []
        for i, (cell, begin) in enumerate(zip(cells, self.starts)):
            for j, q in enumerate(base.noise_positions or []):
                if q >= begin:
                    self.noise_at.append(self.spans[i].start + q - begin)
                    rows.append(base.noise[cell.seed, j])
        self.noise = torch.stack(rows)[None] if rows else None

    def cache(self) -> Any:
        """The cached keys and values: each seed's base run before :attr:`cached` positions."""
        from transformers import DynamicCache

        return DynamicCache(ddp_cache_data=[
            (torch.cat([k[seed : seed + 1, :, :n] for seed, n in self.cached.items()], 2),
             torch.cat([v[seed : seed + 1, :, :n] for seed, n in self.cached.items()], 2))
            for k, v in self.base.capture.keys])

    def active_from(self, layer: int) -> int:
        """Where the cells block ``layer`` runs (``start`` ≤ ``layer``) begin in the sequence
        (:attr:`n_positions`: none)."""
        return min((self.spans[i].start for i, cell in enumerate(self.cells) if cell.start <= layer),
                   default=self.n_positions)

    def base_states(self, layer: int, upto: int, *, whole: bool = False) -> Any:
        """The base runs' output of block ``layer`` at the sequence's first ``upto`` positions
        (the hidden states; ``whole``: in the block's own output structure)."""
        parts = [self.base.capture.block_for(layer, self.cells[i].seed, self.starts[i])
                 for i in self.order if self.spans[i].start < upto]
        return _cat(parts, dim=1) if whole else torch.cat([first(part) for part in parts], 1)

    def narrowed(self, value: Any, active: int) -> Any:
        """A block's inputs (args or kwargs, nested) for the sequence from ``active`` on: every
        per-position tensor cut, and the attention mask's rows and its own-position columns."""
        if isinstance(value, dict):
            return {key: self.narrowed(item, active) for key, item in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)(self.narrowed(item, active) for item in value)
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            return value
        n, k = self.n_positions, self.n_cached
        if value.dim() == 4 and value.shape[-2:] == (n, k + n):
            return torch.cat([value[..., active:, :k], value[..., active:, k + active:]], -1)
        return value[:, active:] if value.shape[1] == n else value

    def widen(self, block: Any, layer: int, active: int) -> Any:
        """Block ``layer``'s output (inside the trace) for the whole sequence: the base runs'
        before ``active``, the block's own after; returns the hidden states, writable."""
        out = block.output
        hidden = torch.cat([self.base_states(layer, active), first(out)], 1)
        block.output = (hidden, *out[1:]) if isinstance(out, tuple) else hidden
        return hidden
