"""Building nnsight's ``VLLM``: the one place pipatch starts a vLLM engine or a served
model's weightless tree. Here, with the backends, rather than with the other loading code in
:mod:`pipatch._model.models`: without CUDA it names pipatch's CPU worker
(:mod:`._vllm_cpu_worker`), a backend's module, and the model layer imports no backend."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .._base.errors import PipatchError
from .._base.known import remember
from .._compat import nnsight as nnsight_compat
from .._compat import warn_untested
from .._model.models import _model_path, _resolve_device, _resolve_dtype

__all__ = ["VLLM_DEFAULTS", "build_vllm", "bind_cpu_threads"]

#: vLLM engine arguments pipatch sets unless the caller gives its own. A prompt pipatch runs is
#: short; a 1 GiB KV cache holds ~28k tokens of Gemma 3 270M in float32, and an explicit size
#: keeps vLLM from reserving 90 % of the machine's memory (CPU) or GPU.
VLLM_DEFAULTS: dict[str, Any] = {"max_model_len": 2048, "kv_cache_memory_bytes": 1 << 30}


def build_vllm(name: str | os.PathLike | None = None, *, dtype: Any = None, device: Any = None,
               engine_args: dict[str, Any] | None = None, mode: str = "sync", dispatch: bool = True) -> Any:
    """nnsight's ``VLLM`` for ``name`` (``None``: the embedded model): the one place pipatch
    builds one — an in-process engine (:func:`load_model`), the server's async engine
    (:mod:`pipatch._serving.serve`) or, with ``dispatch=False``, a client's weightless module tree
    (:mod:`pipatch._backends.served`). Without CUDA the worker is pipatch's CPU adapter."""
    torch_dtype = _resolve_dtype(dtype)
    device = _resolve_device(device)
    path, label = _model_path(name)
    if device.type == "cuda" and device.index not in (None, 0):
        raise PipatchError(f"backend='vllm' runs on the GPUs CUDA_VISIBLE_DEVICES shows, from the first: "
                           f"set CUDA_VISIBLE_DEVICES={device.index} and pass device='cuda', not {str(device)!r}")
    if mode == "sync" and dispatch:
        # In-process engine: Kernel ▸ Interrupt reaches no engine subprocess (which would die and
        # leave later traces hanging), and the model lives in this process's memory only.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    elif dispatch and device.type == "cpu" and int((engine_args or {}).get("tensor_parallel_size") or 1) == 1:
        # The server's engine core (always a process of its own under the async engine) runs
        # its one CPU worker itself. Otherwise vLLM's CPU platform gives it a worker process,
        # which the core waits on by spinning (a shared-memory queue, busy a while after each
        # read): a core of its own taken from the worker's matrix products (bench/served.py
        # shows what it costs on a 2-core machine). Ranks of TP > 1 need theirs.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        from nnsight.modeling.vllm import VLLM

        if device.type == "cpu":
            from ._vllm_cpu_worker import WORKER_CLS
    except ImportError as error:
        raise PipatchError(f"backend='vllm' needs vLLM ({error.name or error}): pip install 'pipatch[vllm]' "
                           "(on a CUDA machine: pip install vllm), or use backend='transformers'") from None
    if Path(path).expanduser().is_dir():
        path = str(Path(path).expanduser())
    args = {**VLLM_DEFAULTS, "dtype": str(torch_dtype).replace("torch.", ""), **(engine_args or {})}
    ranks = int(args.get("tensor_parallel_size") or 1)
    if device.type == "cpu" and ranks > 1:
        bind_cpu_threads(ranks)
    if mode != "sync":
        args["mode"] = mode
    warn_untested()
    rng = torch.random.get_rng_state()  # the engine seeds torch's global generator; give it back
    try:
        with nnsight_compat.worker_class(VLLM, WORKER_CLS if device.type == "cpu" else None):
            model = VLLM(path, dispatch=dispatch, **args)  # undispatched: the same config, no weights
    except PipatchError:
        raise
    except Exception as error:  # noqa: BLE001 - one line naming the cause
        text = str(error).strip().splitlines()
        raise PipatchError(f"cannot start vLLM for {label!r}: {text[0][:200] if text else type(error).__name__}"
                           ) from error
    finally:
        torch.random.set_rng_state(rng)
    return remember(model, name=label)


def bind_cpu_threads(ranks: int) -> str:
    """Give each of ``ranks`` tensor-parallel CPU workers its own cores, unless the user chose.

    vLLM's CPU workers bind their OpenMP threads to the cores ``VLLM_CPU_OMP_THREADS_BIND``
    lists, one list per rank separated by ``|``. Its default, ``auto``, wants a NUMA node per
    rank, so on a one-node machine (a laptop, this CI box) TP=2 stops with "Not enough allowed
    NUMA nodes". pipatch splits the cores this process may use into ``ranks`` contiguous lists
    (``"0|1"`` on two cores; with fewer cores than ranks, ranks share them round-robin) and
    sets the variable before the engine starts. Returns the binding in force."""
    chosen = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if chosen:
        return chosen
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) >= ranks:
        per = len(cores) // ranks
        lists = [cores[r * per : (r + 1) * per] for r in range(ranks)]
    else:
        lists = [[cores[r % len(cores)]] for r in range(ranks)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding = "|".join(",".join(map(str, cpus)) for cpus in lists)
    return binding
