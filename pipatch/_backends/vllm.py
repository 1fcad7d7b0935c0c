"""The vLLM backend: nnsight's ``VLLM`` model, an in-process vLLM engine.

Same programs, same numbers, another runtime. Under vLLM an nnsight *invoke* is one
*request*: a batch of cells is one ``model.trace()`` whose requests (one per cell and input of
its run) vLLM's scheduler packs into as few forward steps as fit. Each request runs a program's
body through :class:`~._vllm_worker.RequestView` in the engine's worker
(:mod:`._vllm_worker`: shapes, the residual stream as a ``(hidden, residual)`` pair, the
embedding at block 0's input, the logits); this module builds the requests and reads their
answers. What it adds:

* **No values across invokes.** Each invoke is its own request, so a donor is never read from
  another invoke: every cell's donor values and noise draw are shipped with its request (they
  are small: a position's or a head's slice), and worker-side code keeps nothing from one
  request to the next.
* **Blocks below a patch are skipped** (``fast``; :meth:`VLLMBackend._run`): every request of
  a trace skips the blocks below the batch's lowest ``start`` with nnsight's ``.skip()``, the
  last skipped block's output being the base run's states of the cell's seed (with the cell's
  writes there applied here, before the request goes). nnsight's batched skip has to cover
  every request of the engine's step: in process this trace is all the engine runs, and a
  ``pipatch serve`` server admits requests of one skip at a time (:attr:`VLLMBackend.skips_blocks`,
  the capability the engine reads). Positions before a patch are still computed (a request is
  a whole sequence).
* **The model's tree goes by reference** (:func:`~._vllm_engine.tree_by_reference`): nnsight
  pickles each invoke for the workers, and by default the whole envoy tree with it.
* **The head alone.** A cell that starts past the last block (a residual sweep's top row: it
  writes the last block's output) runs no block at all: with ``fast`` its states, the base run's with its
  writes, go through the model's own final norm and ``compute_logits`` in one request for the
  whole batch (:func:`~._vllm_worker.head_request`), instead of one forward each.
* **Any program, one path.** A program that declares its inputs (the lens, a circuit's
  runs, a program of your own) runs as one request per row of its runs, each the program's
  body on the worker's :class:`~._vllm_worker.RequestView` (:func:`~._vllm_worker.program_request`):
  the lens reads every block's output and unembeds it with the engine's own head, in the
  prompt's one request.
* **No gradients.** vLLM runs inference only: a program that needs a backward pass
  (attribution's, a circuit's scores) is refused in one line, from what it declares. A
  circuit's runs (its faithfulness curve: each receiver fed its own input) go through the one
  path, one request per run input carrying every mask of a batch, grouped-query attention
  ungrouped in the request (:class:`~._vllm_worker.RequestCircuitView`).
* **Interrupts.** Kernel ▸ Interrupt can land while the engine still holds this trace's
  requests; they are aborted before the ``KeyboardInterrupt`` propagates, so the engine is idle
  and the next sweep in the same kernel runs normally.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .._base.known import known
from .._compat import vllm as vllm_compat
from .._compat.nnsight import torch_module
from .._model.cells import Base, Capture, Cell, Metric, Op
from .._model.models import Adapter, PipatchError, dispatched
from .._model.sites import RESID, Site, TensorPlace
from .._programs._inputs import rows_apart, rows_of
from .._programs.capture import CAPTURE, CaptureRequest
from .._programs.patch import PATCH, PatchRequest
from ._contract import Capabilities, refuse
from ._described import Described
from ._vllm_engine import LocalEngine, vllm_adapter
from ._vllm_worker import (
    _HEAD_CELLS,
    CaptureOut,
    PatchOut,
    _compute_logits,
    _worker_memory,
    capture_request,
    head_request,
    patch_request,
    program_request,
)

__all__ = ["VLLMBackend"]



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
        self.engine = LocalEngine(self.model)
        vllm_compat.check_engine(self._engine)
        self.adapter = vllm_adapter(self.model)

    # -- what the model is ------------------------------------------------------------------
    @property
    def _engine(self) -> Any:
        return self.engine.llm_engine

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


    # -- the transport ----------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        """Blocks below a patch skipped (:attr:`skips_blocks`), a circuit's runs; no gradients."""
        return Capabilities(circuit_runs=True, skips_blocks=self.skips_blocks,
                            device_kind="cuda" if self.runs_on.startswith("cuda") else "cpu",
                            position_flops=self.position_flops if self.skips_blocks else 0)

    def run(self, program: Any, request: Any) -> Any:
        """Run ``program`` as requests of this engine; one it cannot run (a backward pass:
        vLLM runs inference only) is refused in one line, from what the program needs."""
        if program.refusal(self) is not None:
            raise refuse(self, program)
        routines: dict[str, Callable[[Any], Any]] = {CAPTURE.name: self._capture, PATCH.name: self._patch}
        routine = routines.get(program.name)
        if routine is None and program.inputs is None:
            raise refuse(self, program)
        return routine(request) if routine is not None else self._run_program(program, request)

    def _run_program(self, program: Any, request: Any) -> Any:
        """Any program with declared inputs, the one path: one request per row of
        ``request.ids`` (its rows apart, :func:`~pipatch._programs._inputs.rows_apart`), each
        running the body in the engine's worker (:func:`~._vllm_worker.program_request`), all
        in one trace; the rows' outputs joined. A program whose rows are one computation takes
        one row here (a request is one sequence)."""
        if program.needs.each_row:
            parts = rows_apart(request)
        elif rows_of(request) == 1:
            parts = [request]
        else:
            raise PipatchError(f"the {self.backend_name} backend runs one sequence per request, and the "
                               f"{program.name} program reads its {rows_of(request)} rows as one: send one row at a time")
        outs = self._invokes(program_request, [([int(i) for i in part.ids[0].tolist()], (self.adapter, program.name, part))
                                               for part in parts])
        return [row for out in outs for row in out] if program.needs.each_row else outs[0]

    def _capture(self, request: CaptureRequest) -> list[Capture]:
        """The request's captures, all as requests of one trace: one engine step (one request
        to a server) for a pair's clean and corrupt runs, not one each."""
        if request.ops is not None:
            return self._captured([(request.prompts[0], request.runs)], request.metric, request.keep)
        return self._captured([(ids, [[]]) for ids in request.prompts], request.metric, request.keep)

    def _captured(self, prompts: list[tuple[torch.Tensor, list[list[Op]]]], metric: Metric,
                  keep: list[Site]) -> list[Capture]:
        """The :class:`Capture` of each ``(input_ids, runs)``, their requests all in one trace:
        a run's first input keeps the states, its further inputs read the metric only."""
        adapter = self.adapter
        jobs: list[tuple[list[int], tuple]] = []
        counts: list[tuple[int, int]] = []  # each capture's requests, and its inputs per run
        for input_ids, runs in prompts:
            inputs = _inputs(metric, input_ids)
            T = input_ids.shape[1]
            jobs += [(ids, (adapter, metric, keep if c == 0 else None, [op.compact() for op in run], T))
                     for run in runs for c, ids in enumerate(inputs)]
            counts.append((len(runs) * len(inputs), len(inputs)))
        outs: list[CaptureOut] = self._invokes(capture_request, jobs)
        layers = range(adapter.n_layers)
        captures, at = [], 0
        for count, n in counts:
            runs_out, at = outs[at : at + count], at + count
            heads = runs_out[::n]  # each run's first input: the one that kept its states
            blocks = [r.blocks for r in heads if r.blocks is not None]
            kept = [r.values for r in heads if r.values is not None]
            resid = [torch.cat([b[layer] for b in blocks]) for layer in layers]
            values = {s.name: [torch.cat([v[s.name][layer] for v in kept]) for layer in layers] for s in keep}
            values[RESID.name] = resid
            captures.append(Capture(blocks=resid, sites=values, metric=metric.combine(_by_run([r.pieces for r in runs_out], n)),
                                    embedded=torch.cat([r.embedded for r in heads if r.embedded is not None]),
                                    prob=torch.cat([r.prob for r in heads]),
                                    top1=torch.stack([r.top1 for r in heads if r.top1 is not None]),
                                    block_pairs=heads[0].pairs))
        return captures

    def _patch(self, request: PatchRequest) -> tuple[list[torch.Tensor], list[list[list[torch.Tensor]]]]:
        """Each batch as requests of one trace (:meth:`_run`); no states (the metric is read
        in the worker)."""
        return request.each_batch(
            lambda base, cells, metric, fast, next_logits: self._run(base, cells, metric, fast=fast,
                                                                     full_logits=next_logits),
            "the vLLM backend reads each cell's metric in its request: it returns no states")

    def _run(self, base: Base, cells: list[Cell], metric: Metric, *, fast: bool = True,
             full_logits: bool = False) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """Run ``cells`` on ``base`` as invokes (requests) of one trace.

        Returns the metric per cell ([len(cells)], float32) — or, with ``full_logits``, the
        last prompt position's logits per cell ([len(cells), vocab]) — and, per cell, the values
        its recording ops read (in op order). A cell is ``metric.n_inputs`` requests (the prompt
        and each answer continuation), combined here. With ``fast``, cells that run no block
        (a residual sweep's top row) go through the model's head only (:meth:`_head_only`); every other
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
            jobs += [(ids, (self.adapter, metric, [op.compact() for op in ops], full_logits, skip)) for ids in inputs]
        outs: list[PatchOut] = self._invokes(patch_request, jobs, skip=below)
        n = len(inputs)
        reads = [local + o.reads for local, o in zip(local_reads, outs[::n])]
        if not outs:
            return torch.zeros(0), reads
        if full_logits:
            return torch.cat([o.out for o in outs]).float(), reads
        return metric.combine(_by_run([o.out for o in outs], n)), reads

    @functools.cached_property
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
        place = TensorPlace(state)
        reads = [read for op in local if (read := op.site.apply(op, place, slice(None), op.index)) is not None]
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
            place = TensorPlace(state)
            for op in cell.sorted_ops():
                op.site.apply(op, place, slice(None), op.index)
            states.append(state[0, -metric.n_read :])
        jobs = [(base.input_ids[0, :1].tolist(), (self.adapter, metric, torch.stack(states[i : i + _HEAD_CELLS]).cpu()))
                for i in range(0, len(states), _HEAD_CELLS)]
        pieces = torch.cat(self._invokes(head_request, jobs))  # [cells, n_read, n_sequences]
        return metric.combine(pieces.unsqueeze(1))

    def logits(self, hidden: torch.Tensor, token_ids: list[int] | None = None) -> torch.Tensor:
        """Logits from the unembedding's input (final-normed states), [batch, d] → [batch, vocab or
        len(token_ids)], computed by the engine's own ``compute_logits`` (soft-capping included)."""
        rows = self.engine.collective_rpc(_compute_logits, args=(hidden.detach().cpu(),))
        out = rows[0].float()
        return out if token_ids is None else out[:, token_ids]

    def rank_memory(self) -> list[dict[str, Any]]:
        """Each tensor-parallel rank's resident memory, asked of its worker (``collective_rpc``):
        ``[{"rank": 0, "pid": ..., "rss_gb": ...}, ...]`` in rank order. On the CPU a rank holds
        its shard of the weights and its own KV cache (pipatch sets 1 GiB)."""
        return self.engine.collective_rpc(_worker_memory)

    # -- the engine ---------------------------------------------------------------------------
    def _invokes(self, body: Any, jobs: list[tuple[list[int], tuple]], skip: int = 0) -> list:
        """``body(model, *args)`` for each job ``(ids, args)``, each in its own invoke (request)
        of one trace on the token list ``ids``; what each returned, in order. The one place this
        backend opens a trace (:meth:`~._vllm_engine.LocalEngine.invokes`; the served backend
        sends the same invokes over HTTP instead). ``skip``: how many blocks every invoke skips."""
        self.log.add("requests", invokes=len(jobs), skip=skip)
        return self.engine.invokes(body, jobs)

    def abort_unfinished(self) -> int:
        """Abort every request the engine still holds; returns how many there were."""
        return self.engine.abort_unfinished()


# --------------------------------------------------------------------------------------------
# Helpers on the client side
# --------------------------------------------------------------------------------------------


def _inputs(metric: Metric, input_ids: torch.Tensor) -> list[list[int]]:
    """The prompt's ids [1, T] → the token list of each request a run takes (the prompt and each
    answer continuation: :meth:`Metric.inputs`; no re-tokenization, no BOS added)."""
    return [[int(i) for i in row] for row in metric.inputs(input_ids).tolist()]


def _by_run(pieces: list[torch.Tensor], n: int) -> torch.Tensor:
    """Each request's metric pieces, ``n`` requests (a run's inputs) after another →
    ``[runs, n, n_read, n_sequences]`` for :meth:`Metric.combine`."""
    return torch.stack([torch.stack(pieces[i : i + n]) for i in range(0, len(pieces), n)])
