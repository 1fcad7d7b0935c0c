"""The vLLM backend: nnsight's ``VLLM`` model, an in-process vLLM engine.

Same cells, same numbers, another runtime. Each cell is an nnsight *invoke*, and under vLLM
an invoke is one *request*: a batch of cells is one ``model.trace()`` whose requests vLLM's
scheduler packs into as few forward steps as fit. What differs from the transformers backend,
and is handled here and nowhere else:

* **Shapes.** vLLM packs every request's tokens into one flat buffer; inside an invoke a
  module's value is that request's rows, ``[T, width]``, with no batch dimension. pipatch's
  site values are ``[1, T, width]``: the backend reads and writes through ``value.unsqueeze(0)``
  (a view), so an op's index (``(slice(None), position)``, ...) means the same on both.
* **The residual stream.** A vLLM decoder layer returns ``(hidden, residual)``, and the stream
  after the block is their sum (the next layer's fused add-norm adds them). Reading ``resid``
  reads the sum; writing it writes the value into ``residual`` and zeros into ``hidden`` at the
  written positions, so the sum is the written value exactly.
* **Embeddings.** Some vLLM models scale the embedding *after* the embedding module (Gemma:
  ``× √d``), where transformers scales inside it. The embedding site
  (:data:`~pipatch._sites.EMBED`, where causal tracing's noise is added) is the embedding
  output as transformers defines it, so here it is block 0's input (:func:`_site_tensor`); σ
  is measured at the same place, so the same seeds give the same corrupted runs on both
  backends.
* **No values across invokes.** Each invoke is its own request, so a donor is never read from
  another invoke (a circuit's runs excepted, below): every cell's donor values and noise
  draw are tensors shipped with its request (they are small: a position's or a head's
  slice). Saved values come back one per invoke; a name saved in several invokes comes back
  as a list.
* **Shortcuts.** vLLM computes logits at the last position only, so the "unembed one
  position" shortcut is built in, and the metric is read off ``model.logits``.
  - *Blocks below a patch are skipped* (``fast``; :meth:`VLLMBackend.run`): every request of
    a trace skips the blocks below the batch's lowest ``start`` with nnsight's ``.skip()``,
    the last skipped block's output being the base run's states of the cell's seed (with the
    cell's writes there applied here, before the request goes). nnsight's batched skip has to
    cover every request of the engine's step: in process this trace is all the engine runs,
    and a ``pipatch serve`` server admits requests of one skip at a time
    (:attr:`VLLMBackend.skips_blocks`). The engine then runs a sweep's rows from the last
    layer down and lets rows of a few cells share a trace (:class:`VLLMHints`), as on the
    transformers backend. Positions before a patch are still computed (a request is a whole
    sequence).
  - *The model's tree goes by reference* (:meth:`VLLMBackend._tree_by_reference`): nnsight
    pickles each invoke for the workers, and by default the whole envoy tree with it.
  - A cell that starts past the last block (the logit lens: it writes the last block's
    output) runs no block at all: with ``fast`` its states, the base run's with its writes,
    go through the model's own final norm and ``compute_logits`` in one request for the whole
    batch (:func:`_head_run`), instead of one forward each. The numbers are the engine's own
    head on the same states.
* **No gradients.** vLLM runs inference only: attribution and a circuit's scores are refused
  in one line. A circuit's runs (its faithfulness curve: each receiver fed its own input) are
  invokes (:meth:`VLLMBackend.circuit_metrics`), whose requests of one engine step hand each
  other a grouped-query group's head outputs in the worker: the one place values cross
  invokes, each trace's under its own key.
* **Interrupts.** Kernel ▸ Interrupt can land while the engine still holds this trace's
  requests; they are aborted before the ``KeyboardInterrupt`` propagates, so the engine is idle
  and the next sweep in the same kernel runs normally.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from .._cells import Base, Capture, Cell, Metric, Op
from .._compat import vllm as vllm_compat
from .._compat.nnsight import name_worker_tree, persistent_id, torch_module
from .._graph import graph
from .._known import known
from .._models import TREE_ID, Adapter, PipatchError, _get, adapter_for, dispatched, first
from .._sites import EMBED, HEAD, QKV, RESID, Site
from ._contract import Hints
from ._described import Described
from ._edges import head_writes

__all__ = ["VLLMBackend", "is_vllm_model", "register_tree", "tree_by_reference"]

#: Every pipatch run is one prefill and one greedy step; nothing is generated, and the one
#: sampled token is never read as text (pipatch's invoke bodies save what they read).
_SAMPLING = {"temperature": 0.0, "max_tokens": 1, "detokenize": False}

#: Invokes per request to a server, and per trace where a trace's requests must share an
#: engine step (a circuit's masks): a batch of cells is one request as a rule (a grid's
#: batches hold up to a few dozen), which the server starts in one engine step
#: (:func:`pipatch._serve._together`); a batch split over requests that arrive apart runs as
#: more steps (measured: 16 a request put the resid grid's two 28-cell batches 50 ms each above
#: the in-process engine's).
INVOKES_PER_REQUEST = 64
#: Prompt tokens a trace that must run as one engine step holds at most: the scheduler's
#: budget per step is at least the context length (pipatch leaves chunked prefill off).
_STEP_TOKENS = 2048


def is_vllm_model(model: Any) -> bool:
    """Whether ``model`` is nnsight's ``VLLM`` (checked without importing vLLM)."""
    return any(cls.__module__.startswith("nnsight.modeling.vllm") and cls.__name__ == "VLLM"
               for cls in type(model).__mro__)


class VLLMBackend(Described):
    """Runs cells on an nnsight ``VLLM`` model (vLLM engine in this process)."""

    adapter: Adapter
    model: Any

    backend_name = "vllm"

    def __init__(self, model: Any):
        self.model = dispatched(model)
        if getattr(self.model, "vllm_entrypoint", None) is None:
            raise PipatchError("this VLLM model has no engine (built without dispatch, or an nnsight-serve client): "
                               "build it with dispatch=True, or use pipatch.load_model(name, backend='vllm')")
        vllm_compat.check_engine(self._engine)
        self.adapter = _vllm_adapter(self.model)

    # -- what the model is ------------------------------------------------------------------
    @property
    def _engine(self) -> Any:
        return self.model.vllm_entrypoint.llm_engine

    @property
    def _model_config(self) -> Any:
        return self._engine.model_config

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def device(self) -> torch.device:
        """Where pipatch puts inputs, noise and donors: the CPU (the engine moves each request)."""
        return torch.device("cpu")

    @property
    def runs_on(self) -> str:
        return str(getattr(self._engine.vllm_config.device_config, "device_type", "") or "cpu")

    @property
    def dtype(self) -> torch.dtype:
        return self._model_config.dtype

    @property
    def name(self) -> str:
        return known(self.model).name or str(self._model_config.model)

    @property
    def context_length(self) -> int | None:
        return int(self._model_config.max_model_len)


    # -- runs -------------------------------------------------------------------------------
    def capture(self, input_ids: torch.Tensor, metric: Metric, sites: Sequence[Site] = (), *,
                ops: Sequence[Sequence[Op]] | None = None) -> Capture:
        """Run ``input_ids`` ([1, T]) once per list of ``ops``, keeping every block output and site.

        Same contract as :meth:`TransformersBackend.capture`: run ``i`` (its invokes) applies
        ``ops[i]`` as a patched run applies a cell's (causal tracing's noise: added at block
        0's input, :data:`~pipatch._sites.EMBED`); ``None`` is one clean run.
        """
        return self._captured([(input_ids, ops)], metric, sites)[0]

    def captures(self, prompts: Sequence[torch.Tensor], metric: Metric, sites: Sequence[Site] = ()) -> list[Capture]:
        """Each prompt's :meth:`capture`, all as requests of one trace: one engine step (one
        request to a server) for a pair's clean and corrupt runs, not one each."""
        return self._captured([(ids, None) for ids in prompts], metric, sites)

    def _captured(self, prompts: list[tuple[torch.Tensor, Sequence[Sequence[Op]] | None]], metric: Metric,
                  sites: Sequence[Site]) -> list[Capture]:
        """The :class:`Capture` of each ``(input_ids, ops)``, their invokes all in one trace."""
        adapter = self.adapter
        keep = sorted({s for s in sites if not s.is_block_output}, key=lambda s: s.order)  # blocks: always kept
        jobs: list[tuple[list[int], tuple]] = []
        counts: list[tuple[int, int]] = []  # each capture's invokes, and its inputs per run
        for input_ids, ops in prompts:
            writes = [_shipped(run) for run in ([[]] if ops is None else ops)]
            inputs = _inputs(metric, input_ids)
            jobs += [(ids, (adapter, metric, keep if c == 0 else None, run)) for run in writes
                     for c, ids in enumerate(inputs)]
            counts.append((len(writes) * len(inputs), len(inputs)))
        outs = self._invokes(_capture_run, jobs)
        layers = range(adapter.n_layers)
        captures, at = [], 0
        for count, n in counts:
            runs, at = outs[at : at + count], at + count
            heads = runs[::n]
            resid = [torch.cat([r[0][layer] for r in heads]) for layer in layers]
            values = {s.name: [torch.cat([r[1][s.name][layer] for r in heads]) for layer in layers] for s in keep}
            values[RESID.name] = resid
            captures.append(Capture(blocks=resid, sites=values, metric=metric.combine(_by_run([r[2] for r in runs], n)),
                                    embedded=torch.cat([r[4] for r in heads]), prob=torch.cat([r[3] for r in heads]),
                                    top1=torch.stack([r[6] for r in heads]), block_pairs=heads[0][5]))
        return captures

    def run(self, base: Base, cells: list[Cell], metric: Metric, *, fast: bool = True,
            full_logits: bool = False) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """Run ``cells`` on ``base`` as invokes (requests) of one trace.

        Returns the metric per cell ([len(cells)], float32) — or, with ``full_logits``, the
        last prompt position's logits per cell ([len(cells), vocab]) — and, per cell, the values
        its recording ops read (in op order). A cell is ``metric.n_inputs`` requests (the prompt
        and each answer continuation), combined here. With ``fast``, cells that run no block
        (the logit lens) go through the model's head only (:meth:`_head_only`); every other
        cell runs its whole forward (see the module docstring).
        """
        if fast and not full_logits and (head := self._head_only(base, cells, metric)) is not None:
            return head, [[] for _ in cells]
        inputs = _inputs(metric, base.input_ids)[: 1 if full_logits else None]
        below = self._skipped_below(base, cells, metric) if fast and not full_logits else 0
        jobs: list[tuple[list[int], tuple]] = []
        local_reads: list[list[torch.Tensor]] = []
        for cell in cells:
            # The seed's base ops (noise) first, then the cell's: one forward order for both.
            ops = base.ops_of(cell.seed) + cell.sorted_ops()
            skip: tuple | None = None
            local: list[torch.Tensor] = []
            if below:
                skip, local, ops = self._skip_state(base, cell, below, ops)
            local_reads.append(local)
            jobs += [(ids, (self.adapter, metric, _shipped(ops), full_logits, skip)) for ids in inputs]
        outs = self._invokes(_patched_run, jobs, skip=below)
        n = len(inputs)
        reads = [local + o[1] for local, o in zip(local_reads, outs[::n])]
        if not outs:
            return torch.zeros(0), reads
        if full_logits:
            return torch.cat([o[0] for o in outs]).float(), reads
        return metric.combine(_by_run([o[0] for o in outs], n)), reads

    @functools.cached_property
    def hints(self) -> VLLMHints:
        """What the engine may schedule by (:class:`VLLMHints`)."""
        return VLLMHints(self)

    @property
    def position_flops(self) -> int:
        """Two FLOPs per weight of a block (a multiply and an add) for each position it runs
        (counted on this process's module tree, whose shapes are the engine's)."""
        return 2 * sum(p.numel() for p in torch_module(self.adapter.block(self.model, 0)).parameters())

    #: Whether :meth:`run` skips the blocks below a batch's lowest ``start`` (``fast``). A
    #: skip has to cover every request of the engine's step: here this process's trace is all
    #: the engine runs; a server admits one skip at a time (``pipatch serve``'s rooms).
    skips_blocks = True

    def _skipped_below(self, base: Base, cells: list[Cell], metric: Metric) -> int:
        """How many blocks a batch of ``cells`` skips: those below its lowest ``start``, where
        the base run's states cover every request (one input, the metric read at the last
        prompt position: the capture keeps the prompt's positions only); else 0. Never above
        a block one of the cells' own ops feeds (a ``start`` is a promise; this keeps it)."""
        if not (self.skips_blocks and cells and metric.n_inputs == 1 and metric.n_read == 1
                and base.capture.block_pairs is not None):
            return 0
        fed = (op.site.start_layer(op.layer) for cell in cells for op in cell.ops)
        return min(min(cell.start for cell in cells), min(fed, default=self.adapter.n_layers), self.adapter.n_layers)

    def _skip_state(self, base: Base, cell: Cell, below: int, ops: list[Op]) -> tuple[tuple, list, list[Op]]:
        """What a cell's request skips blocks ``0 … below − 1`` with: the last skipped block's
        output in the base run of its seed, with the cell's writes there applied here (and
        its reads there taken here, returned in op order); and the ops left for the engine,
        those feeding the blocks that run. The base ops of blocks skipped are in the base
        run's states already."""
        state = base.capture.block_for(below - 1, cell.seed).clone()  # [1, T, d]
        local = [op for op in ops if op.site.is_block_output and op.layer == below - 1]
        live = [op for op in ops if op.site.start_layer(op.layer) > below
                or (op.site.start_layer(op.layer) == below and not op.site.is_block_output)]
        reads = [read for op in local if (read := op.apply(state)) is not None]
        return (below, state[0].contiguous(), base.capture.block_pairs), reads, live

    def _head_only(self, base: Base, cells: list[Cell], metric: Metric) -> torch.Tensor | None:
        """The metric of ``cells`` that run no block (each starts past the last one and only
        writes the last block's output), from the model's head on the base run's last states
        with the cells' writes: [len(cells)]; ``None`` where any cell does more, or the metric
        reads more than the prompt's last position (the capture keeps the prompt's states only)."""
        last = self.adapter.n_layers - 1
        if metric.n_inputs != 1 or metric.n_read != 1 or not cells or not all(
                cell.start > last and all(op.site.is_block_output and op.layer == last and op.value is not None
                                          for op in cell.ops) for cell in cells):
            return None
        states = []
        for cell in cells:
            state = base.capture.block_for(last, cell.seed).clone()  # [1, T, d]
            for op in cell.sorted_ops():
                op.apply(state)
            states.append(state[0, -metric.n_read :])
        jobs = [(base.input_ids[0, :1].tolist(), (self.adapter, metric, torch.stack(states[i : i + _HEAD_CELLS]).cpu()))
                for i in range(0, len(states), _HEAD_CELLS)]
        pieces = torch.cat(self._invokes(_head_run, jobs))  # [cells, n_read, n_sequences]
        return metric.combine(pieces.unsqueeze(1))

    def logits(self, hidden: torch.Tensor, token_ids: list[int] | None = None) -> torch.Tensor:
        """Logits from the unembedding's input (final-normed states), [batch, d] → [batch, vocab or
        len(token_ids)], computed by the engine's own ``compute_logits`` (soft-capping included)."""
        rows = self.model.vllm_entrypoint.collective_rpc(_compute_logits, args=(hidden.detach().cpu(),))
        out = rows[0].float()
        return out if token_ids is None else out[:, token_ids]

    def rank_memory(self) -> list[dict[str, Any]]:
        """Each tensor-parallel rank's resident memory, asked of its worker (``collective_rpc``):
        ``[{"rank": 0, "pid": ..., "rss_gb": ...}, ...]`` in rank order. On the CPU a rank holds
        its shard of the weights and its own KV cache (pipatch sets 1 GiB)."""
        return list(self.model.vllm_entrypoint.collective_rpc(_worker_memory))

    def gradients(self, input_ids: torch.Tensor, metric: Metric, site: Site):
        raise PipatchError("attribution needs gradients, which vLLM does not compute: load the model with "
                           "backend='transformers' (the default) for attribute")

    def edge_terms(self, clean_ids: torch.Tensor, corrupt_ids: torch.Tensor, metric: Metric, clean: Capture,
                   corrupt: Capture, steps: int) -> tuple[Any, Any]:
        raise PipatchError("a circuit's edge scores need gradients, which vLLM does not compute: score it on "
                           "backend='transformers' (the default) and check those here, pipatch.circuit(..., scores=result)")

    def circuit_metrics(self, clean_ids: torch.Tensor, corrupt_ids: torch.Tensor, metric: Metric,
                        keep: torch.Tensor, mean_of: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """The metric of the clean prompt run as a circuit, once per mask of ``keep`` ([P,
        receivers, senders], bool): the transformers backend's
        :func:`~pipatch._backends._edges.circuit_metrics`, as invokes of this engine.

        Every receiver reads the corrupt run's value at its place (or, with ``mean_of``, the
        mean over those run inputs) plus its kept senders' writes in this run minus theirs
        there (:func:`_circuit_run`). A grouped-query model's query heads each read their own
        keys and values: a mask runs as one request per member of a group, member ``m``'s
        request feeding the keys and values of the heads ``h`` with ``h % group == m``, and
        each head's output is taken from its member's request, which the requests of one
        engine step hand each other in the worker (:data:`_CIRCUITS`). A trace holds whole
        masks and fits one step; its first invoke carries the baseline values for all. Returns
        ``[P]``."""
        adapter = self.adapter
        if adapter.tp_ranks > 1:
            raise PipatchError(f"a circuit's runs compute each receiver's input from the layer's whole weights, which "
                               f"this engine splits over {adapter.tp_ranks} ranks: measure the curve on one rank "
                               "(tensor_parallel_size=1) or on backend='transformers', or pass curve=0")
        inputs = _inputs(metric, clean_ids)
        k, group = len(inputs), adapter.n_heads // max(1, adapter.n_kv_heads)
        if mean_of is None:
            baselines = self._invokes(_circuit_cache, [(ids, (adapter,)) for ids in _inputs(metric, corrupt_ids)])
        else:
            runs = self._invokes(_circuit_cache, [(row.tolist(), (adapter,)) for ids in mean_of for row in ids])
            if not runs:
                raise PipatchError("mean ablation needs at least one prompt to average over")
            mean = {name: (sum(run[name].double() for run in runs) / len(runs)).float() for name in runs[0]}
            baselines = [mean] * k
        tokens = len(inputs[0]) * k * group  # one mask's requests
        budget = min(self.context_length or 2048, _STEP_TOKENS)
        per_trace = max(1, min(INVOKES_PER_REQUEST // (k * group), budget // tokens))
        values = []
        for lo in range(0, keep.shape[0], per_trace):
            masks = keep[lo : lo + per_trace]
            key = uuid.uuid4().hex
            jobs: list[tuple[list[int], tuple]] = [
                (inputs[i], (adapter, metric, masks[p], i, member, (key, p, len(masks) * k * group)))
                for p in range(len(masks)) for i in range(k) for member in range(group)]
            jobs[0] = (jobs[0][0], (*jobs[0][1], baselines))
            pieces = self._invokes(_circuit_run, jobs)[::group]  # every member's run ends the same
            values.append(metric.combine(_by_run(pieces, k)))
        return torch.cat(values)

    # -- the engine ---------------------------------------------------------------------------
    def _invokes(self, body: Any, jobs: list[tuple[list[int], tuple]], skip: int = 0) -> list:
        """``body(model, *args)`` for each job ``(ids, args)``, each in its own invoke (request)
        of one trace on the token list ``ids``; returns what each returned, in order. The one
        place this backend opens a trace (the served backend sends the same invokes over HTTP
        instead). ``skip``: how many blocks every invoke skips (here, where this trace is all
        the engine runs, nothing to arrange)."""
        import nnsight

        model = self.model
        with (self._requests_aborted_on_interrupt(), self._tree_by_reference(),
              vllm_compat.quiet_generate(model.vllm_entrypoint), torch.no_grad(), model.trace(**_SAMPLING) as tracer):
            for ids, args in jobs:
                with tracer.invoke(ids):
                    out = nnsight.save(body(model, *args))
        return _per_invoke(out, len(jobs))

    @contextlib.contextmanager
    def _tree_by_reference(self):
        """While pipatch's own traces are built, ship the model's envoy tree with each invoke
        by reference (:func:`tree_by_reference`), once each worker knows it by name
        (:func:`register_tree`, once per engine)."""
        model, facts = self.model, known(self.model)
        if not facts.tree_named:
            model.vllm_entrypoint.collective_rpc(register_tree)
            facts.tree_named = True
        with tree_by_reference(model):
            yield

    @contextlib.contextmanager
    def _requests_aborted_on_interrupt(self):
        """On any exception (Kernel ▸ Interrupt above all) abort the engine's unfinished requests.

        ``LLM.generate`` steps the engine until its requests finish; an interrupt between steps
        leaves them queued, and the next trace would run (and be handed the outputs of) them.
        """
        try:
            yield
        except BaseException:
            self.abort_unfinished()
            raise

    def abort_unfinished(self) -> int:
        """Abort every request the engine still holds (:func:`pipatch._compat.vllm.abort_unfinished`);
        returns how many there were."""
        return vllm_compat.abort_unfinished(self._engine)


class VLLMHints(Hints):
    """The vLLM backend's shortcut, as the engine reads it: a batch's cells start at their
    ``start`` layer (:attr:`VLLMBackend.skips_blocks`), so a sweep's higher rows cost less and
    rows of a few cells share their traces (every invoke of a trace skips the same blocks)."""

    backend: VLLMBackend

    @property
    def starts_at_layer(self) -> bool:
        return self.backend.skips_blocks

    @property
    def position_flops(self) -> int:
        return self.backend.position_flops if self.backend.skips_blocks else 0


# --------------------------------------------------------------------------------------------
# What runs inside an invoke (in the engine's worker): module-level functions, shipped by
# reference, taking the model and small per-cell data. Values are [T, width] there.
# --------------------------------------------------------------------------------------------


def _block_input(adapter: Adapter, model: Any) -> torch.Tensor:
    """Block 0's hidden-state input, [T, d]: the (scaled) embeddings every block builds on."""
    args, kwargs = adapter.block(model, 0).inputs
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.is_floating_point() and arg.dim() == 2:
            return arg
    raise RuntimeError("pipatch: found no hidden-state input to block 0 of this vLLM model")


def _stream(adapter: Adapter, model: Any, layer: int) -> Any:
    """Block ``layer``'s output: ``(hidden, residual)`` under vLLM, whose sum is the stream."""
    return adapter.block(model, layer).output


def _resid(out: Any) -> torch.Tensor:
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor):
        return out[0] + out[1]
    return first(out)


def _site_tensor(site: Site, adapter: Adapter, model: Any, layer: int) -> Any:
    """The site's live value at ``layer`` ([T, width]), or the block's ``(hidden, residual)``.

    The site's own module access (:meth:`Site.value`), but for two places where vLLM's
    modules differ from transformers': a block's output is the pair whose sum is the stream,
    and the embedding output as transformers defines it (:data:`~pipatch._sites.EMBED`) is
    block 0's input, after the scaling vLLM applies outside the embedding module."""
    if site.is_block_output:
        return _stream(adapter, model, layer)
    if site.is_embedding:
        return _block_input(adapter, model)
    return site.value(adapter, model, layer)


def _read(value: Any, index: tuple) -> torch.Tensor:
    if isinstance(value, tuple):
        value = _resid(value)
    return value.unsqueeze(0)[index].clone().cpu()


def _write(value: Any, index: tuple, new: torch.Tensor, add: bool = False) -> None:
    """Write ``new`` at ``index`` (or, ``add``, add it there): into a block's ``(hidden,
    residual)``, the residual takes the value and the hidden zeros (a sum of the two equal to
    the value), or the addend alone."""
    if isinstance(value, tuple):
        hidden, residual = value
        if add:
            residual.unsqueeze(0)[index] += new.to(residual.device, residual.dtype)
            return
        residual.unsqueeze(0)[index] = new.to(residual.device, residual.dtype)
        hidden.unsqueeze(0)[index] = 0
        return
    if add:
        value.unsqueeze(0)[index] += new.to(value.device, value.dtype)
        return
    value.unsqueeze(0)[index] = new.to(value.device, value.dtype)


def _apply(values: dict[tuple[str, int], Any], ops: list[tuple], adapter: Adapter, model: Any) -> list[torch.Tensor]:
    """Ops ``(site, layer, index, value, add)`` in forward order, each site fetched once into
    ``values``: writes (and adds) applied, recording ops' reads returned in op order."""
    reads = []
    for site, layer, index, value, add in ops:
        key = (site.name, layer)
        if key not in values:
            values[key] = _site_tensor(site, adapter, model, layer)
        if value is None:
            reads.append(_read(values[key], index))
        else:
            _write(values[key], index, value, add)
    return reads


def _read_logits(model: Any, adapter: Adapter, n_read: int) -> torch.Tensor:
    """The request's logits at its last ``n_read`` positions, [n_read, vocab] float32.

    vLLM computes logits at the last position only (``model.logits``); for more (a multi-token
    answer, read teacher-forced) the final norm's output at those positions goes through the
    model's own ``compute_logits`` (soft-capping included), in the worker.
    """
    if n_read == 1:
        return model.logits.float()
    assert adapter.final_norm is not None  # every family vLLM runs has one
    hidden = first(_get(model, adapter.final_norm).output)[-n_read:]
    return torch_module(model).compute_logits(hidden).float()


def _capture_run(model: Any, adapter: Adapter, metric: Metric, keep: list[Site] | None, ops: list[tuple]) -> tuple:
    """One baseline request under ``ops`` (the run's writes, in forward order: causal
    tracing's noise at the embedding): the metric's pieces and P(answer), with (``keep``
    given) the embedding, block and ``keep`` site values at the prompt's positions and the
    top next token after the prompt.
    ``keep is None``: a further input of the run (the foil's continuation), which only reads
    the pieces."""
    values: dict[tuple[str, int], Any] = {}

    def fetch(site: Site, layer: int) -> Any:
        if (site.name, layer) not in values:
            values[site.name, layer] = _site_tensor(site, adapter, model, layer)
        return values[site.name, layer]

    # The reads in forward order, each after the writes at its place (an op's key sorts a
    # write before a read of the same place: a read here is of the value as written).
    reads: list[tuple[Site, int, tuple | None]] = [(s, layer, None) for layer in range(adapter.n_layers)
                                                   for s in [*(keep or ()), RESID]]
    embedded = fetch(EMBED, 0)
    T = slice(0, embedded.shape[0] - metric.n_read + 1)  # the prompt's positions
    _apply(values, [op for op in ops if op[0].is_embedding], adapter, model)
    blocks: list[torch.Tensor] | None = None
    kept: dict[str, list[torch.Tensor]] | None = None
    embedded_copy = None
    if keep is not None:
        embedded_copy = embedded[T].unsqueeze(0).clone().cpu()
        blocks, kept = [], {s.name: [] for s in keep}
        places: list[tuple[Site, int, tuple | None]] = [(op[0], op[1], op) for op in ops if not op[0].is_embedding]
        later = sorted(places + reads,
                       key=lambda item: (item[1], item[0].order, item[2] is None))
        for site, layer, op in later:
            if op is not None:
                _apply(values, [op], adapter, model)
            elif site.is_block_output:
                blocks.append(_resid(fetch(site, layer))[T].unsqueeze(0).clone().cpu())
            else:
                kept[site.name].append(_read(fetch(site, layer), (slice(None), T)))
    else:
        _apply(values, [op for op in ops if not op[0].is_embedding], adapter, model)
    logits = _read_logits(model, adapter, metric.n_read)
    # Whether a block returns (hidden, residual), as a skip must (the blocks were all read).
    pairs = isinstance(values[RESID.name, adapter.n_layers - 1], tuple) if keep is not None else None
    # The model's top next token after the prompt (the first read position): a study's
    # known-fact check, read off the run every planner starts with.
    top1 = logits[0].argmax().cpu() if keep is not None else None
    return (blocks, kept, metric.pieces(logits).cpu(), metric.answer_prob(logits[None, None]).cpu(), embedded_copy,
            pairs, top1)


def _patched_run(model: Any, adapter: Adapter, metric: Metric, ops: list[tuple], full_logits: bool,
                 skip: tuple | None = None) -> tuple:
    """One patched request: the metric's pieces at the read positions (or, ``full_logits``, the
    logits after the prompt) and the values the recording ops read. ``ops`` are the cell's
    seed's base ops and its own, sorted in forward order by the caller. ``skip``, ``(below,
    state, pairs)``: blocks ``0 … below − 1`` do not run, and the last one's output is
    ``state`` ([T, d], the stream), as ``(0, state)`` where a block returns ``(hidden,
    residual)`` (``pairs``); every request of the engine's step skips the same blocks."""
    if skip is not None:
        below, state, pairs = skip
        state = _on_engine(torch_module(model), state)
        replacement = (torch.zeros_like(state), state) if pairs else state
        for layer in range(below):
            adapter.block(model, layer).skip(replacement)
    reads = _apply({}, ops, adapter, model)
    logits = _read_logits(model, adapter, metric.n_read)
    out = logits[:1] if full_logits else metric.pieces(logits)
    return out.cpu(), reads


#: Cells per head-only request: their logits, [cells · n_read, vocab] float32, are what it holds
#: (64 cells of Gemma 3's 262,144-token vocabulary: 64 MiB).
_HEAD_CELLS = 64


def _head_run(model: Any, adapter: Adapter, metric: Metric, states: torch.Tensor) -> torch.Tensor:
    """One request's body that runs no block of its own: ``states`` ([cells, n_read, d], last
    block outputs) through the model's final norm and ``compute_logits`` (soft-capping
    included) → the metric's pieces, [cells, n_read, n_sequences]."""
    assert adapter.final_norm is not None  # every family vLLM runs has one
    module = torch_module(model)
    cells, n_read, d = states.shape
    normed = first(_get(module, adapter.final_norm)(_on_engine(module, states.reshape(-1, d))))
    return metric.pieces(_own_logits(module, normed).reshape(cells, n_read, -1)).cpu()


def _stream_into(norm: Any) -> torch.Tensor:
    """The residual stream a norm reads: its input, or the sum of ``(hidden, residual)`` where
    vLLM fuses the add into the norm. Read at the norm's call, before the fused add updates
    its inputs in place."""
    args, kwargs = norm.inputs
    parts = [a for a in (*args, kwargs.get("residual")) if isinstance(a, torch.Tensor)]
    return (parts[0] + parts[1] if len(parts) > 1 else parts[0]).float().clone()


def _normed(envoy: Any, x: torch.Tensor) -> torch.Tensor:
    """The norm module of ``envoy`` on ``x`` ([..., d]), called outside the model's forward:
    vLLM's own ``forward_native`` where it has one (no fused add, no hook fires)."""
    module = torch_module(envoy)
    flat = _on_engine(module, x.reshape(-1, x.shape[-1]))
    out = module.forward_native(flat) if hasattr(module, "forward_native") else module(flat)
    return first(out).float().reshape(x.shape)


def _linear(envoy: Any, x: torch.Tensor) -> torch.Tensor:
    """The linear layer of ``envoy`` (one rank's whole weight) on ``x`` ([..., in]), bias
    included, float32: through the layer's own ``quant_method`` (vLLM's CPU path repacks the
    weight and empties ``weight``), outside the model's forward (no hook fires)."""
    module = torch_module(envoy)
    bias = None if getattr(module, "skip_bias_add", False) else getattr(module, "bias", None)
    flat = _on_engine(module, x.reshape(-1, x.shape[-1]))
    return module.quant_method.apply(module, flat, bias).float().reshape(*x.shape[:-1], -1)


def _circuit_cache(model: Any, adapter: Adapter) -> dict[str, torch.Tensor]:
    """One baseline request of a circuit's runs (the corrupt prompt, or a prompt of mean
    ablation's): the values an ablated edge carries, float32 on the CPU: the embeddings
    (``embedded`` [T, d]); per layer ([L, T, ...]) the stream into the attention's norm (``x``),
    the heads' outputs (``z``), the stream into the MLP's norm (``x_mid``) and the MLP's
    output (``mlp``); and the stream into the final norm (``x_final``)."""
    out: dict[str, Any] = {"embedded": _block_input(adapter, model).float().clone()}
    layers: dict[str, list[torch.Tensor]] = {"x": [], "z": [], "x_mid": [], "mlp": []}
    assert adapter.attn_norm and adapter.mlp_norm and adapter.final_norm  # check_circuit_family's promise
    for layer in range(adapter.n_layers):
        block = adapter.block(model, layer)
        attn = _get(block, adapter.attn)
        layers["x"].append(_stream_into(_get(block, adapter.attn_norm)))
        layers["z"].append(_get(attn, adapter.out_proj).input.float().clone())
        layers["x_mid"].append(_stream_into(_get(block, adapter.mlp_norm)))
        layers["mlp"].append(first(_get(block, adapter.mlp).output).float().clone())
    out["x_final"] = _stream_into(_get(model, adapter.final_norm))
    out.update({name: torch.stack(values) for name, values in layers.items()})
    return {name: value.cpu() for name, value in out.items()}


#: What the requests of one circuit trace hand each other in the worker, by the trace's key:
#: its baselines (sent once, with its first invoke) and each member's head outputs per layer.
#: All of a trace's requests run in one engine step, each module call taking them in invoke
#: order, so a member's ``z`` is here before any request reads it at the layer's MLP.
_CIRCUITS: dict[str, dict[str, Any]] = {}


def _circuit_run(model: Any, adapter: Adapter, metric: Metric, keep: torch.Tensor, row: int, member: int,
                 trace: tuple[str, int, int], baselines: list[dict[str, torch.Tensor]] | None = None) -> torch.Tensor:
    """One request of a circuit's run (:meth:`VLLMBackend.circuit_metrics`): input ``row`` of
    the run under mask ``keep`` ([receivers, senders]), as member ``member`` of its grouped-query
    groups; returns the metric's pieces.

    Each receiver reads its baseline value plus its kept senders' ``deltas`` (what each wrote
    in this run minus in the baseline). The request feeds the query, key and value columns of
    the heads of its member (``qkv_proj``'s output, whose attention then runs on them), leaves
    its heads' outputs for the other members' requests and takes theirs, feeds the MLP its
    input, and reads the logits off the final norm of its own fed stream. ``trace``: the
    trace's key, this mask's index in it and its number of requests."""
    key, mask, count = trace
    assert adapter.attn_norm and adapter.mlp_norm and adapter.final_norm  # check_circuit_family's promise
    while len(_CIRCUITS) > 8 and key not in _CIRCUITS:  # left by traces that failed
        _CIRCUITS.pop(next(iter(_CIRCUITS)))
    shared = _CIRCUITS.setdefault(key, {"z": {}, "done": 0})
    if baselines is not None:
        shared["baselines"] = baselines
    H, L = adapter.n_heads, adapter.n_layers
    group, edge_graph = H // max(1, adapter.n_kv_heads), graph(adapter)
    embedded = _block_input(adapter, model).float()  # [T, d]
    device = embedded.device
    base = {name: value.to(device) for name, value in shared["baselines"][row].items()}
    keep = keep.to(device, torch.float32)
    deltas = torch.zeros(keep.shape[1], *embedded.shape, device=device)  # [senders, T, d]
    deltas[edge_graph.emb] = embedded - base["embedded"]

    def fed(value: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return value[None] + torch.einsum("rs,std->rtd", rows, deltas)

    mine = [(head, which, *adapter.qkv_columns(which, head)) for head in range(H) if head % group == member
            for which in QKV]
    for layer in range(L):
        block = adapter.block(model, layer)
        attn = _get(block, adapter.attn)
        normed = _normed(_get(block, adapter.attn_norm),
                         fed(base["x"][layer], keep[[edge_graph.qkv(layer, head, which) for head, which, *_ in mine]]))
        for name in adapter.qkv:  # in forward order
            mine_here = [(i, lo, hi) for i, (_, _, module, lo, hi) in enumerate(mine) if module == name]
            if not mine_here:
                continue
            projection = _get(attn, name)
            out = first(projection.output)
            projected = _linear(projection, normed[[i for i, _, _ in mine_here]])
            for j, (_, lo, hi) in enumerate(mine_here):
                out[:, lo:hi] = projected[j, :, lo:hi].to(out.dtype)
        out_proj = _get(attn, adapter.out_proj)
        shared["z"][mask, row, layer, member] = out_proj.input.float().clone()
        mlp = _get(block, adapter.mlp)
        mlp_input = mlp.input  # every member's request has left its heads' outputs by now
        z = torch.empty_like(base["z"][layer])  # every head's output, each from its member's request
        for head in range(H):
            cut = HEAD.head_slice(adapter, head)
            theirs = shared["z"].get((mask, row, layer, head % group))
            if theirs is None:
                raise RuntimeError("pipatch: a circuit's requests ran in different engine steps; run fewer at once")
            z[:, cut] = theirs[:, cut]
        post = _get(block, adapter.attn_post_norm) if adapter.attn_post_norm else None
        write, each = head_writes(adapter, lambda x: _linear(out_proj, x),
                                  None if post is None else (lambda x: _normed(post, x)), z[None], base["z"][layer][None])
        deltas[edge_graph.heads(layer)] = each[0] - write
        x = fed(base["x_mid"][layer], keep[edge_graph.mlp_in(layer), None])[0]
        mlp.input = _normed(_get(block, adapter.mlp_norm), x).to(mlp_input.dtype)
        both = torch.stack([first(mlp.output).float(), base["mlp"][layer]])
        if adapter.mlp_post_norm:
            both = _normed(_get(block, adapter.mlp_post_norm), both)
        deltas[edge_graph.mlp(layer)] = both[0] - both[1]
    x = fed(base["x_final"], keep[edge_graph.logits, None])[0]
    normed = _normed(_get(model, adapter.final_norm), x[-metric.n_read :])
    pieces = metric.pieces(_own_logits(torch_module(model), normed)).cpu()
    shared["done"] += 1
    if shared["done"] == count:  # the trace's last request: its hand-overs are spent
        _CIRCUITS.pop(key, None)
    return pieces


def _compute_logits(worker: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Run on the engine's worker (``collective_rpc``): the model's own logits of ``hidden``."""
    with torch.no_grad():
        return _own_logits(worker.model_runner.get_model(), hidden).cpu()


@contextlib.contextmanager
def tree_by_reference(model: Any):
    """Within this block, a pickled invoke names ``model``'s envoy tree by :data:`TREE_ID`
    instead of carrying it.

    nnsight pickles every invoke for the engine's workers (``extra_args`` of its request), and
    an invoke body that names ``model`` carries the whole envoy tree with it: 264 envoys for
    Gemma 3 270M, about 8 ms an invoke here, a third of a resid grid. Each worker already
    holds the same tree over its own modules and interleaver, which a by-value copy is rebuilt
    into from persistent ids; with the tree named among each worker's persistent objects
    (:func:`register_tree`) and ``model`` tagged with the id, an invoke is a few hundred
    bytes. The tag comes off after the block (:func:`pipatch._compat.nnsight.persistent_id`):
    the user's own traces of the model stay nnsight's. (A ``pipatch serve`` server names its
    tree the same way, for its clients' requests and its engine's.)"""
    with persistent_id(model, TREE_ID):
        yield


def register_tree(worker: Any) -> None:
    """Run on each rank's worker (``collective_rpc``): name its nnsight model tree among the
    persistent objects its requests are unpickled with."""
    name_worker_tree(worker.model_runner, TREE_ID)


def _worker_memory(worker: Any) -> dict[str, Any]:
    """Run on each rank's worker (``collective_rpc``): its rank, process id and resident memory."""
    import os

    with open("/proc/self/statm") as statm:  # Linux: the resident pages are the second field
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"rank": int(getattr(worker, "rank", 0)), "pid": os.getpid(), "rss_gb": round(rss / 2**30, 2)}


def _on_engine(module: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` on the engine module's device, in its dtype."""
    param = next(module.parameters())
    return hidden.to(param.device, param.dtype)


def _own_logits(module: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The engine module's own logits (soft-capping included) of final-normed ``hidden``, float32."""
    return module.compute_logits(_on_engine(module, hidden)).float()


# --------------------------------------------------------------------------------------------
# Helpers on the client side
# --------------------------------------------------------------------------------------------


def _shipped(ops: Sequence[Op]) -> list[tuple]:
    """Ops as an invoke takes them, sorted in forward order: ``(site, layer, index, value,
    add)`` with the value on the CPU (the engine moves each request's tensors), in storage of its
    own (a donor slice is a view of its run's states, which would travel whole with it)."""
    return [(op.site, op.layer, op.index, None if op.value is None else op.value.detach().cpu().clone(), op.add)
            for op in sorted(ops, key=lambda op: op.key)]


def _inputs(metric: Metric, input_ids: torch.Tensor) -> list[list[int]]:
    """The prompt's ids [1, T] → the token list of each request a run takes (the prompt and each
    answer continuation: :meth:`Metric.inputs`; no re-tokenization, no BOS added)."""
    return [[int(i) for i in row] for row in metric.inputs(input_ids).tolist()]


def _by_run(pieces: list[torch.Tensor], n: int) -> torch.Tensor:
    """Each request's metric pieces, ``n`` requests (a run's inputs) after another →
    ``[runs, n, n_read, n_sequences]`` for :meth:`Metric.combine`."""
    return torch.stack([torch.stack(pieces[i : i + n]) for i in range(0, len(pieces), n)])


def _per_invoke(saved: Any, n: int) -> list:
    """nnsight hands back a name saved in ``n`` invokes as a list of ``n``, but a single one as is."""
    if n == 1:
        return [saved]
    if not isinstance(saved, list) or len(saved) != n:
        raise RuntimeError(f"pipatch: expected {n} values back from the vLLM engine, got "
                           f"{len(saved) if isinstance(saved, list) else 1}")
    return saved


def _tp_ranks(model: Any) -> int:
    """The engine's tensor-parallel size (1 for a model without an engine config)."""
    engine = getattr(getattr(model, "vllm_entrypoint", None), "llm_engine", None)
    parallel = getattr(getattr(engine, "vllm_config", None), "parallel_config", None)
    return int(getattr(parallel, "tensor_parallel_size", 1) or 1)


def _vllm_adapter(model: Any, ranks: int | None = None) -> Adapter:
    """The family adapter over vLLM's module tree.

    vLLM keeps transformers' module names for most families (``model.layers``, ``self_attn``,
    ``mlp``, ``o_proj``), so the transformers adapter's lookup finds them; what differs is the
    query/key/value projection: vLLM fuses it into ``qkv_proj``, always laid out
    ``[q × n_heads | k × n_kv | v × n_kv]`` (``QKVParallelLinear``) on each tensor-parallel
    rank, which nnsight gathers rank after rank (``"stacked_by_rank"`` from TP = 2 up).
    ``ranks``: the engine's tensor-parallel size where ``model`` has no engine (a served
    client's module tree; the server says its size).
    """
    adapter = adapter_for(model)
    if adapter.qkv == ("qkv_proj",):
        ranks = _tp_ranks(model) if ranks is None else ranks
        adapter = dataclasses.replace(adapter, qkv_layout="stacked" if ranks == 1 else "stacked_by_rank",
                                      tp_ranks=ranks)
    return dataclasses.replace(adapter, last_logits_only=False)
