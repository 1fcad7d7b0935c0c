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

Every program that declares its inputs (the lens, gradients, a circuit's and a feature
circuit's programs, one of your own) runs through one path, :meth:`TransformersBackend._run_program`:
its body in one trace of its runs through a :class:`~._hf_views.RowsView`; the capture, the
patched runs and their pooled metrics keep their routines here, where the shortcuts above
live. This module runs the traces; :mod:`._packing` lays packed traces out (rows, masks, caches)
and :mod:`._unembedding` holds the arithmetic after them. The engine reads the shortcuts
through :class:`TransformersHints`. Base ops (causal tracing's noise at
:data:`~pipatch._model.sites.EMBED`) are applied as cells' writes are, in the same op loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch

from .._base.known import known
from .._compat import nnsight as nnsight_compat
from .._compat import transformers as transformers_compat
from .._model.cells import Base, Capture, Cell, Metric, Op
from .._model.models import Adapter, _get, adapter_for, dispatched, first
from .._model.sites import RESID, Site
from .._programs._inputs import moved
from .._programs._program import Program
from .._programs.capture import CAPTURE, CaptureRequest, capture_body
from .._programs.patch import METRICS, PATCH, PatchRequest, patch_body
from ._contract import Capabilities, refuse
from ._described import Described
from ._hf_views import PackedView, RowsView
from ._packing import NO_BOUND, PACK_TOKENS, ROW_TOKENS, Packed, layout, with_hidden
from ._unembedding import Unembedding, unembedding_input

__all__ = ["TransformersBackend"]

# Re-exported: tests and benchmarks read the packing's sizes and layout here.
_layout, _Packed, _with_hidden = layout, Packed, with_hidden
__all__ += ["PACK_TOKENS", "NO_BOUND", "ROW_TOKENS"]

#: How many of a study's facts run as one (:class:`~pipatch._engine.Chain`), committed
#: together: their cells' metrics take one pass over the unembedding per ~1,000 read
#: positions, where a fact alone takes seven (a 3-kind trace), each reading all 262k rows
#: (``bench/study.py`` measures the gain). A kill loses at most these.
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

    # -- the transport ----------------------------------------------------------------------
    @functools.cached_property
    def capabilities(self) -> Capabilities:
        """Every shortcut (the module docstring), gradients and a circuit's runs; packing where
        the model takes a 4-D mask and ``position_ids`` (:attr:`_masks`)."""
        packs = self.pack and self.reuse_prefix and self._masks is not None
        return Capabilities(
            gradients=True, circuit_runs=True, skips_blocks=True, reuses_prefix=self.reuse_prefix,
            pack_tokens=PACK_TOKENS.get(self.device.type, NO_BOUND) if packs else 0, packs_prompts=True,
            pools_unembedding=True, device_kind="cuda" if self.device.type == "cuda" else "cpu",
            position_flops=self.position_flops, plans_together=PLANS_TOGETHER, torch_threads=self.device.type == "cpu")

    def run(self, program: Program, request: Any) -> Any:
        """Run ``program`` on ``request`` in this process: through :meth:`_run_program` where it
        declares its inputs, else its routine (:meth:`_routines`)."""
        routine = self._routines().get(program.name)
        if program.refusal(self) is not None or (routine is None and program.inputs is None):
            raise refuse(self, program)
        self.log.add("program", name=program.name)
        return routine(request) if routine is not None else self._run_program(program, request)

    def _run_program(self, program: Program, request: Any) -> Any:
        """Any program with declared inputs, the one path: its body in one trace of
        ``request.ids`` (one run per batch row) through a :class:`~._hf_views.RowsView`,
        with gradients where it needs a backward pass, the logits of the positions it reads
        only. The NDIF backend sends this very trace (:meth:`_sent`)."""
        import nnsight

        model, adapter = self.model, self.adapter
        request = moved(request, self.device)
        grad = torch.enable_grad() if program.needs.backward else torch.no_grad()
        # The logits of the last positions it reads: its needs', or its request's metric's.
        metric = getattr(request, "metric", None)
        kwargs = {**adapter.trace_kwargs(max(1, program.needs.logits, getattr(metric, "n_read", 0))), "use_cache": False}
        self.log.add("forward", program=program.name, rows=int(request.ids.shape[0]), positions=int(request.ids.shape[1]))
        self._ship(program)
        with self._transport_errors(), grad, model.trace(request.ids, **kwargs, **self._sent()) as tracer:
            out = nnsight.save(program.body(RowsView(adapter, model), request))
            tracer.stop()  # the body has read all it reads: the forward need not go on
        return out

    # -- what a trace sends (nothing here: the NDIF backend sends it) ---------------------------
    def _sent(self) -> dict[str, Any]:
        """``model.trace``'s extra arguments: none in this process."""
        return {}

    def _ship(self, program: Program) -> None:
        """Make ``program``'s code reach where its trace runs: here it is already."""

    def _transport_errors(self) -> Any:
        """Where a trace's failures are put in one line: here they are the trace's own."""
        return contextlib.nullcontext()

    def _routines(self) -> dict[str, Any]:
        return {CAPTURE.name: self._capture, PATCH.name: self._patch, METRICS.name: self._metrics}

    def _capture(self, request: CaptureRequest) -> list[Capture]:
        """The request's runs as one trace (:meth:`_captured`): one capture whose rows are the
        runs of one prompt under ops, or one capture per prompt."""
        runs = request.runs
        both = self._captured([request.prompt_of(i) for i in range(len(runs))], request.metric, request.keep, runs)
        return [both] if request.ops is not None else [both.run(i) for i in range(len(runs))]

    def _captured(self, prompts: list[torch.Tensor], metric: Metric, keep: list[Site],
                  runs: list[list[Op]]) -> Capture:
        """Run ``i`` of one trace: ``prompts[i]`` ([1, T]) under ``runs[i]``, all of them one
        batch of one invoke (one intervention per layer, however many runs).

        A metric that reads a softmax (and causal tracing's P(answer)) is read off the model's
        own logits; a logit difference, off the two rows of the unembedding it needs
        (:meth:`metric_from_hidden`, as a patched run's is): the 262k-row unembedding is then
        not read at all, and the run has no ``prob``."""
        model, adapter = self.model, self.adapter
        n, k = len(prompts), metric.n_inputs
        T, m = prompts[0].shape[1], metric.n_read
        softmax = metric.token_ids is None
        unembed = adapter.unembedding(model)
        cache = self._new_cache()
        kwargs: dict[Any, Any] = {adapter.cache_kwarg: cache, "use_cache": True} if cache is not None else {}
        with torch.no_grad(), model.trace(**adapter.trace_kwargs(m), **kwargs) as tracer:
            saved = list().save()  # type: ignore[attr-defined]  # nnsight's
            with tracer.invoke(torch.cat([metric.inputs(prompt) for prompt in prompts])):
                view = RowsView(adapter, model, rows_per_job=k)
                embedded, blocks, values = capture_body(view, runs, keep, T, slice(None, None, k))
                if softmax:
                    read = model.output.logits[:, -m:].float()
                else:
                    read = unembedding_input(unembed, (slice(None), slice(-m, None)))
                saved.append((blocks, values, read, embedded))
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

    def _patch(self, request: PatchRequest) -> tuple[list[torch.Tensor], list[list[list[torch.Tensor]]]]:
        """Each batch as one trace (packed where :meth:`Capabilities.packed` says so, and
        always where it holds several bases); with ``fast`` and ``out="metric"`` the metric of
        every batch's cells in one go from their read positions' states: one product with the
        unembedding for all of them."""
        if not request.batches:
            return [], []
        metric, fast, out = request.metric, request.fast, request.out
        if out == "states" and not fast:
            raise ValueError("states are the fast path's: pass fast=True")
        self.log.add("patch", batches=len(request.batches), out=out)
        outs, reads = [], []
        for batch in request.batches:
            value, read = self._trace(batch, fast=fast, full_logits=out == "next_logits")
            outs.append(value)
            reads.append(read)
        if out == "next_logits":
            return [o.float() for o in outs], reads
        if out == "metric":
            if fast:
                outs = list(self.metric_from_hidden(metric, torch.cat(outs)).split([len(o) for o in outs]))
            else:
                outs = [metric.score(o) for o in outs]
        return outs, reads

    def _metrics(self, items: Sequence[tuple[Metric, torch.Tensor]]) -> list[torch.Tensor]:
        """The metric per cell of each ``(metric, states)`` item, the probabilities' in one pass
        over the unembedding for all (:meth:`Unembedding.metrics`)."""
        return self.unembedding.metrics(items)

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
    def position_flops(self) -> int:
        """Two FLOPs per weight of a block (a multiply and an add) for each position it runs."""
        return 2 * sum(p.numel() for p in _get(self._hf, self.adapter.blocks)[0].parameters())

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

    def _trace(self, entries: Sequence[tuple[Base, Cell, Metric]], *, fast: bool, full_logits: bool = False,
               pack: bool = True) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """One trace of ``(base, cell, metric)`` entries (one base unless packed): per cell,
        the unembedding's input at the read positions ([cells, inputs, n_read, d]; ``fast``),
        or the last prompt position's logits (``full_logits``), or the logits at the read
        positions; and the recorded values. Packed (:meth:`_trace_packed`) where the
        capabilities say so for its base, and always for several bases; ``pack=False``: not
        packed."""
        base, _, metric = entries[0]
        last_only = fast and not full_logits
        several = any(other is not base for other, _, _ in entries)
        if last_only and pack and (several or self.capabilities.packed(base, metric)):
            return self._isolate_nonfinite(entries, *self._trace_packed(entries))
        model, adapter = self.model, self.adapter
        cells = [cell for _, cell, _ in entries]
        unembed = adapter.unembedding(model)
        run_ids = metric.inputs(base.input_ids)
        n, L, m = metric.n_inputs, run_ids.shape[1], metric.n_read
        # Prefix reuse: start every cell at the batch's first written position.
        start = min(cell.first_position for cell in cells) if last_only and self.capabilities.prefix(base) else 0
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
        # Each cell's seed's base ops (noise) first, where the run computes what they feed:
        # from position ``start`` on (the positions before are the base run's, already under
        # them), and only when the block they feed is not skipped (a skipped block's output is
        # the base run's, already under them).
        jobs = [self._base_ops(base, cell, start, below) + cell.sorted_ops() for cell in cells]
        self.log.add("trace", cells=len(cells), start=start, below=below)
        skipped = [_cat([base.capture.block_for(layer, seed, start) for seed in seeds]) for layer in range(below)]
        with torch.no_grad(), model.trace(**kwargs) as tracer:
            outs = list().save()  # type: ignore[attr-defined]  # nnsight's
            recorded = list().save()  # type: ignore[attr-defined]  # nnsight's
            with tracer.invoke(**invoke):
                view = RowsView(adapter, model, rows_per_job=n, start=start, below=below, skipped=skipped)
                recorded.extend(patch_body(view, jobs))
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
            values, again_reads = self._trace([entries[i] for i in again], fast=True, pack=False)
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
        assert self._masks is not None  # packed only where the capabilities say so
        windows, eager = self._masks
        pack = Packed(entries, windows, self.dtype if eager else None)
        # Each cell's ops, its seed's base ops first, from its own start on; the embedding's
        # only where some row runs block 0.
        below = 0 if pack.active[0] < pack.n_rows else 1
        jobs = [self._base_ops(base, cell, pack.starts[i], below) + cell.sorted_ops()
                for i, (base, cell, _) in enumerate(entries)]
        self.log.add("packed", cells=len(entries), bases=len(pack.runs.bases), starts=[cell.start for _, cell, _ in entries],
                     lengths=[length - first for length, first in zip(pack.run_lengths, pack.starts)])
        # The masks and positions go to the forward as they are (a trace's keyword arguments;
        # an invoke's would be batched by nnsight, which takes no dict of masks).
        kwargs: dict[Any, Any] = {"position_ids": pack.position_ids, "attention_mask": pack.mask}
        if pack.n_cached:
            kwargs.update({adapter.cache_kwarg: pack.cache(), "use_cache": True})
        with torch.no_grad(), model.trace(**kwargs) as tracer:
            outs = list().save()  # type: ignore[attr-defined]  # nnsight's
            recorded = list().save()  # type: ignore[attr-defined]  # nnsight's
            with tracer.invoke(input_ids=pack.input_ids):
                recorded.extend(patch_body(PackedView(adapter, model, pack), jobs))
                outs.append(unembedding_input(unembed, pack.read_at))
        return outs[0].reshape(len(entries), 1, pack.runs.n_read, -1), list(recorded)

    # -- the unembedding arithmetic (:mod:`._unembedding`) ------------------------------------
    @property
    def unembedding(self) -> Unembedding:
        """The unembedding's weights and the model's soft-cap, for metrics outside a trace."""
        return Unembedding(_get(self._hf, self.adapter.unembed), self.adapter.softcap, self.log)

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


def _cat(parts: list[Any]) -> Any:
    if isinstance(parts[0], tuple):
        return tuple(
            torch.cat([p[i] for p in parts]) if isinstance(parts[0][i], torch.Tensor) else parts[0][i]
            for i in range(len(parts[0]))
        )
    return torch.cat(parts)
