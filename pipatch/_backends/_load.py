"""Loading a model: :func:`load_model` (public) and :func:`shared_model` (once per process).

Where a model comes from (the embedded default, a local folder, the Hugging Face hub), which
runtime holds it (transformers in this process, a vLLM engine in this process, a ``pipatch
serve`` server) and the checks that make a bad choice one line before any second is spent.
The pieces (the embedded model's cache, dtype and device names, building nnsight's ``VLLM``)
live in :mod:`pipatch._model.models`; the server's client in :mod:`pipatch._backends.served`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .._base.checks import whole_number
from .._base.known import remember
from .._compat import warn_untested
from .._model.models import (
    PipatchError,
    _check_backend,
    _hub_reachable,
    _model_path,
    _resolve_device,
    _resolve_dtype,
    no_progress_bar,
)
from ._vllm_load import build_vllm

__all__ = ["load_model", "shared_model"]


def load_model(name: str | os.PathLike | None = None, *, dtype: Any = None, device: Any = None,
               backend: str = "transformers", engine_args: dict[str, Any] | None = None,
               serve: str | None = None, api_key: str | None = None, timeout: float = 600.0,
               verify: bool | str | os.PathLike = True, remote: bool | str = False):
    """Load a causal language model as an nnsight ``TransformersModel`` (or ``VLLM``).

    Parameters
    ----------
    name
        ``None`` for the embedded default (Gemma 3 270M, offline), a local folder holding a
        transformers checkpoint, or a Hugging Face id such as ``"gpt2"`` (needs the hub or a
        filled Hugging Face cache).
    dtype
        ``torch.float32`` (default), ``torch.bfloat16``, ... or their names.
    device
        ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...; default: ``"cuda"`` when torch sees a GPU,
        else ``"cpu"``. Inputs, noise and patched values follow the model's device; results
        always come back to the CPU.
    backend
        ``"transformers"`` (default): the model in this process through transformers.
        ``"vllm"``: nnsight's ``VLLM``, a vLLM engine in this process (``pip install
        'pipatch[vllm]'``; on the CPU through :mod:`pipatch._backends._vllm_cpu_worker`).
        Every experiment but attribution (vLLM computes no gradients) runs on either, with
        the same results.
    engine_args
        ``backend="vllm"`` only: extra ``vllm.LLM`` arguments, over pipatch's defaults
        (``max_model_len=2048``, ``kv_cache_memory_bytes=1 GiB``).
    serve
        The URL of a ``pipatch serve`` server (``"http://gpu-box:6677"``): every experiment
        runs there, on its vLLM engine; this process holds a weightless copy of the module
        tree (needs ``pipatch[vllm]`` installed, no GPU). ``name`` must be the model the
        server serves (``None``: the embedded one); ``dtype`` is the server's.
    api_key
        With ``serve``: a key the server accepts (one of its key file's); default: the
        ``PIPATCH_API_KEY`` environment variable. A refused key fails here, in one line.
    timeout
        With ``serve``: seconds to wait for one batch's answer before giving up.
    verify
        With an ``https://`` ``serve``: ``True`` (default) checks the server's certificate
        against the system's CAs; a path trusts that PEM file (the server's self-signed
        certificate, or a team's CA); ``False`` checks nothing (a test server only). A
        certificate not trusted fails here, in one line.
    remote
        ``True``: every experiment runs on NDIF, nnsight's remote service, as requests through
        nnsight's own remote path (:mod:`pipatch._backends.ndif`); ``name`` is the hub id NDIF
        hosts, this process holds its module tree without weights, and the key comes from
        ``NDIF_API_KEY`` or nnsight's config. ``"local"``: the same requests through
        nnsight's offline simulation of NDIF, on the weights loaded here (any model pipatch
        loads). Attribution's gradients run remotely too.

    Returns
    -------
    nnsight.modeling.transformers.TransformersModel or nnsight.modeling.vllm.VLLM
        Dispatched and ready; ``model.tokenizer`` is its tokenizer.
    """
    _check_backend(backend)
    warn_untested()
    if remote is not False:
        return _load_remote(name, remote, dtype=dtype, device=device, backend=backend, serve=serve,
                            engine_args=engine_args, api_key=api_key)
    if serve is None and (api_key is not None or verify is not True):
        raise PipatchError(f"{'api_key' if api_key is not None else 'verify'} is for a server: pass it with "
                           "serve='http://host:port'")
    if serve is not None and (backend != "transformers" or engine_args is not None or device is not None):
        raise PipatchError("serve= runs the model on the server, which chose its backend, engine and device: "
                           "drop backend=, engine_args= and device=")
    if engine_args is not None and backend != "vllm":
        raise PipatchError("engine_args are vLLM engine arguments: pass them with backend='vllm'")
    torch_dtype = _resolve_dtype(dtype)
    device = _resolve_device(device)  # before the load: a bad device costs no seconds
    if serve is not None:
        from .served import connect

        return connect(name, serve, api_key=api_key, dtype=dtype, timeout=timeout, verify=verify)
    if backend == "vllm":
        return build_vllm(name, dtype=dtype, device=device, engine_args=engine_args)
    path, label = _model_path(name)

    from nnsight import TransformersModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(**kwargs):
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        with no_progress_bar():  # a "Loading weights" bar for a load of seconds is noise in a cell
            return tokenizer, AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kwargs)

    try:
        try:
            # The local Hugging Face cache first: no network, no retries.
            tokenizer, hf_model = load(local_files_only=True)
        except OSError:
            if Path(path).expanduser().is_dir() or not _hub_reachable(path):
                raise
            tokenizer, hf_model = load()
    except (OSError, ValueError) as error:
        reason = "not in the local Hugging Face cache and the hub is unreachable (offline)"
        if Path(path).expanduser().is_dir() or _hub_reachable(path):
            text = str(error).strip()
            reason = text.splitlines()[0][:160] if text else type(error).__name__
        raise PipatchError(
            f"cannot load model {label!r}: {reason}; pass a local folder holding a transformers "
            "checkpoint, or omit the name for the embedded default"
        ) from None
    hf_model.eval()
    hf_model.to(device)
    hf_model.name_or_path = label  # shown in results; the checkpoint path is an implementation detail
    # Result.code()'s script loads ``path`` (the embedded default's converted folder).
    return remember(TransformersModel(hf_model, tokenizer=tokenizer), name=label, path=path)


def _load_remote(name: Any, remote: Any, **others: Any) -> Any:
    """:func:`load_model` with ``remote=``: the checks (one line each), then the model,
    remembered as remote (:mod:`pipatch._base.known`), which sends it to the NDIF backend."""
    from .ndif import REMOTES, check_service

    if remote not in REMOTES:
        raise PipatchError(f"remote={remote!r}: pass remote=True (NDIF) or remote='local' (nnsight's offline "
                           "simulation of NDIF)")
    given = [key for key in ("serve", "engine_args", "api_key") if others[key] is not None]
    if others["backend"] != "transformers" or given:
        raise PipatchError(f"remote= runs the model through nnsight's remote path: drop {', '.join(given) or 'backend'}= "
                           "(the key comes from NDIF_API_KEY)")
    if remote == "local":
        model = load_model(name, dtype=others["dtype"], device=others["device"])
    else:
        if name is None or Path(str(name)).expanduser().exists():
            raise PipatchError("remote=True runs a model NDIF hosts: pass its hub id (print(nnsight.status()) lists "
                               "them), or remote='local' for the embedded or a local model")
        if others["device"] is not None:
            raise PipatchError("remote=True runs on NDIF's devices: drop device=")
        check_service(str(name))
        from nnsight import LanguageModel

        model = remember(LanguageModel(str(name), dtype=_resolve_dtype(others["dtype"])),  # the module tree, no weights
                         name=str(name))
    return remember(model, remote=remote)


_SHARED: dict[tuple, Any] = {}

#: ``--remote``'s values (the magics and the CLI) → ``load_model``'s ``remote=``.
REMOTE_FLAGS: dict[str, bool | str] = {"ndif": True, "local": "local"}


def shared_model(name: str | None = None, *, dtype: Any = None, device: Any = None,
                 backend: str = "transformers", serve: str | None = None, api_key: str | None = None,
                 tensor_parallel_size: int | None = None, remote: str | None = None):
    """:func:`load_model`, but each (name, dtype, device, backend or server, tensor-parallel
    size) is loaded once per process.

    The magics and the CLI use this so a notebook kernel loads the embedded model once (and
    starts at most one vLLM engine, or one client per server, per model).
    ``tensor_parallel_size`` (``--tensor-parallel-size``) is the vLLM engine's; a served model's
    is the server's (``pipatch serve ... --tensor-parallel-size``). ``remote`` is ``--remote``:
    ``"ndif"`` (``remote=True``) or ``"local"`` (nnsight's simulation of NDIF).
    """
    if remote is not None:
        if remote not in REMOTE_FLAGS:
            raise PipatchError(f"--remote {remote}: pass --remote (NDIF) or --remote local (nnsight's offline "
                               "simulation of NDIF)")
        if serve or tensor_parallel_size is not None or backend != "transformers":
            raise PipatchError("--remote runs the model through nnsight's remote path: drop --serve, --backend "
                               "and --tensor-parallel-size")
        key = ("remote", None if name is None else str(name), str(_resolve_dtype(dtype)), remote)
        if key not in _SHARED:
            _SHARED[key] = load_model(name, dtype=dtype, device=device, remote=REMOTE_FLAGS[remote])
        return _SHARED[key]
    ranks = None if tensor_parallel_size is None else whole_number(tensor_parallel_size, "--tensor-parallel-size",
                                                                     minimum=1)
    if ranks is not None and (serve or _check_backend(backend) != "vllm"):
        raise PipatchError("--tensor-parallel-size splits a vLLM engine: add --backend vllm, or (with --serve) "
                           "start the server with pipatch serve ... --tensor-parallel-size N")
    where = ("serve", serve, api_key) if serve else (str(_resolve_device(device)), ranks or 1, _check_backend(backend))
    key = (None if name is None else str(name), str(_resolve_dtype(dtype)), *where)
    if key not in _SHARED:
        engine_args = {"tensor_parallel_size": ranks} if ranks and ranks > 1 else None
        _SHARED[key] = load_model(name, dtype=dtype, device=device, backend=backend, serve=serve, api_key=api_key,
                                  engine_args=engine_args)
    return _SHARED[key]
