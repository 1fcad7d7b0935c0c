"""The transformers backend: an nnsight ``TransformersModel`` (or ``LanguageModel``) in this process.

A batch of cells is one ``model.trace()`` with one invoke whose batch holds every cell's
rows, so the model runs a real batch instead of one forward per cell, and nnsight serves each
module's value once per batch, not once per cell (:meth:`TransformersBackend.run`). Inside the
invoke the batch's ops are applied in forward order (nnsight serves a module's values only in
the order the forward pass computes them), each on its cell's rows.

Three exact shortcuts, used when the engine asks for ``fast=True`` (tests compare them with
``fast=False`` and with ``reuse_prefix=False`` within 1e-4):

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
* **Unembed one position.** The metric needs the last position only (the last few for a
  multi-token answer), and a logit difference needs two rows of the unembedding, not 262k: the
  invoke reads the unembedding's *input* at those positions and skips the unembedding; :meth:`TransformersBackend.logits` computes
  just the rows the metric reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from .._cells import Base, Capture, Cell, Metric
from .._models import _get, adapter_for, dispatched, first
from .._sites import RESID, Site
from ._described import Described

__all__ = ["TransformersBackend"]


class TransformersBackend(Described):
    """Runs cells on an nnsight model of a transformers checkpoint, in this process."""

    kind = "transformers"
    starts_at_layer = True

    def __init__(self, model: Any, *, reuse_prefix: bool = True):
        """``reuse_prefix=False`` switches prefix reuse off (every run starts at position 0):
        the same numbers, slower; for comparing."""
        self.model = dispatched(model)
        self.adapter = adapter_for(self.model)
        self.reuse_prefix = reuse_prefix

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
               full_logits: bool = False) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """The trace of :meth:`run`: per cell, the unembedding's input at the read positions
        ([cells, inputs, n_read, d]; ``fast``), or the last prompt position's logits
        (``full_logits``), or the logits at the read positions; and the recorded values."""
        model, adapter = self.model, self.adapter
        unembed = adapter.unembedding(model)
        run_ids = metric.inputs(base.input_ids)
        n, L, m = metric.n_inputs, run_ids.shape[1], metric.n_read
        last_only = fast and not full_logits
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


def _cat(parts: list[Any]) -> Any:
    if isinstance(parts[0], tuple):
        return tuple(
            torch.cat([p[i] for p in parts]) if isinstance(parts[0][i], torch.Tensor) else parts[0][i]
            for i in range(len(parts[0]))
        )
    return torch.cat(parts)
