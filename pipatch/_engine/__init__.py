"""The engine: run any experiment's cells as batched invokes on a backend, streaming rows.

Data flows one way: a protocol (:mod:`pipatch._experiments`) checks the researcher's question,
runs the baselines and builds a :class:`Plan` — the :class:`~pipatch._results.result.Result` to fill
and the :class:`Sweep`\\ s that fill it. A sweep is a grid of cells (:mod:`pipatch._model.cells`):
``sweep.cell(row, col, seed)`` is one patched run. The engine

* asks each sweep for one row's cells at a time (a head sweep over a long prompt never
  holds every cell at once), in the order the plan gives (:meth:`Plan.tasks`: from the last
  layer down where higher rows cost less, :attr:`Plan.row_order`);
* fills a cell whose writes put back the base run's own values (or write only where the run
  they come from agrees with the base run: :attr:`Sweep.agrees_before`), or that the metric
  cannot see (:func:`_is_unread`), with the base metric, without running the model (``fast``
  only);
* lets consecutive rows share their traces (:func:`_joins`): where the backend packs cells
  (each from its own layer and position: the transformers backend) while the rows hold at
  most ``batch_size`` cells, else for rows of few cells, each cell then starting at the
  lowest layer among them; and rows whose metric reads the whole unembedding finish
  together, one pass over it for all (:func:`_shares`); the first row always runs alone, to
  show soonest;
* cuts the rest into batches of at most ``batch_size`` invokes (:func:`batches`): packed,
  traces of about the backend's ``pack_tokens`` positions; otherwise batches that share
  their ``start`` layer (and, where the backend reuses prefixes, about the same first
  written position). Each batch is one nnsight trace (the transformers backend: one invoke
  holding every cell's rows; vLLM: one invoke per cell), and the backend gets a row's
  consecutive batches of at most ``batch_size`` cells in all as one ``patch`` request (the
  transformers backend then computes all their metrics in one product with the
  unembedding);
* stores each value where the sweep says (:meth:`Sweep.store`), calls ``on_row`` after each
  row so a front end can draw it live, and checks ``stop`` between batches;
* runs :class:`Work` rows, program requests rather than cells (a circuit's gradient passes
  and faithfulness curve), the same way: each as soon as its plan makes it, after the rows
  before it, so a plan may make a row from what the rows before it found;
* runs a :class:`Chain` (several plans in turn, each into its own result: a study's facts,
  never drawn row by row) with their metrics pooled (:class:`~._execute._Pool`): each batch
  runs up to its metric's states (``out="states"``), and the pool finishes a thousand read
  positions of them at once (the ``metrics`` program: one pass over the unembedding for all).

**The backend seam.** The engine and the protocols never touch a model: every run goes to
the backend object as a program (:mod:`pipatch._programs`: the patched run, the capture, the
metrics), which the backend runs as its kind of trace. What the engine schedules by (layer
order, prefix reuse, packing, pooled unembedding, the device's sizes) it reads only from the
backend's capabilities (:attr:`Plan.capabilities`, data: the defaults take no shortcut). A
new way of running models is one new module there; nothing here changes.


Its parts: :mod:`._sweeps` (grids of cells), :mod:`._plans` (plans, chains, clicks),
:mod:`._schedule` (which cells share a trace: pure, tested without a model), :mod:`._execute`
(running, storing, stopping), :mod:`._sizing` (the batch size: the caller's, or the
backend's) and :mod:`._cost` (what a run will cost: one line before one that takes minutes).
"""

from .._backends._sizing import auto_batch_size, batch_size_for_memory
from ._cost import LONG_SECONDS, device_name, duration, read_flops, sweep_flops, warn_if_long
from ._execute import EngineError, execute, stop_check
from ._plans import POOL_POSITIONS, Chain, Plan, Predictor
from ._schedule import JOIN_COST, RUN_FLOPS, SHARE_POSITIONS, SHARE_ROWS, TRACE_COST, batches
from ._sizing import check_batch_size
from ._sweeps import SiteSweep, Sweep, Work

__all__ = ["Sweep", "SiteSweep", "Work", "Plan", "Chain", "Predictor", "execute", "stop_check", "batches", "EngineError",
           "auto_batch_size", "batch_size_for_memory", "check_batch_size", "POOL_POSITIONS", "TRACE_COST", "JOIN_COST",
           "RUN_FLOPS", "SHARE_POSITIONS", "SHARE_ROWS", "LONG_SECONDS", "read_flops", "sweep_flops", "warn_if_long",
           "duration", "device_name"]
