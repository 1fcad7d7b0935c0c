"""A sparse autoencoder's or transcoder's weights and math, read without SAELens.

:class:`SAE` holds the tensors and the architecture and computes ``encode`` / ``decode``
exactly as SAELens 6.54 does for the architectures pipatch supports:

* **ReLU** (SAELens ``standard``): ``f = ReLU((x − b_dec·[apply_b_dec_to_input]) W_enc + b_enc)``;
* **JumpReLU** (Gemma Scope's): the same pre-activation ``h``, ``f = ReLU(h) · [h > threshold]``;
* **TopK**: the ``k`` largest of ``h`` per position, through a ReLU, the rest zero (with
  ``rescale_acts_by_decoder_norm``, ``h`` is scaled by each latent's decoder norm before the
  choice and divided by it again in ``decode``);

and ``decode(f) = f W_dec + b_dec``. A **transcoder** reads one place (a layer's MLP input) and
writes another (the MLP's output): its ``W_dec`` maps to the output's width, and an optional
affine skip adds ``x W_skipᵀ`` to its reconstruction (:meth:`SAE.reconstruct`).

Readers (:func:`from_saelens`, :func:`read_folder`, :func:`from_release`) turn each source
format into an :class:`SAE`; what pipatch does not support (another architecture, activation
normalization not folded into the weights, a head-indexed hook) is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..._base.errors import PipatchError

__all__ = ["SAE", "from_saelens", "read_folder", "from_release", "ARCHITECTURES"]

#: SAELens's architecture names → ``(activation, transcoder, skip)``.
ARCHITECTURES: dict[str, tuple[str, bool, bool]] = {
    "standard": ("relu", False, False),
    "jumprelu": ("jumprelu", False, False),
    "topk": ("topk", False, False),
    "transcoder": ("relu", True, False),
    "skip_transcoder": ("relu", True, True),
    "jumprelu_transcoder": ("jumprelu", True, False),
    "jumprelu_skip_transcoder": ("jumprelu", True, True),
}

#: Gemma Scope 2's weights file, and its tensors' names for SAELens's (its affine skip is
#: stored ``[d_in, d_out]``, SAELens's ``W_skip`` transposed).
GEMMA_SCOPE_FILE = "params.safetensors"
GEMMA_SCOPE_NAMES = {"W_enc": "w_enc", "b_enc": "b_enc", "W_dec": "w_dec", "b_dec": "b_dec", "threshold": "threshold",
                     "W_skip": "affine_skip_connection"}

_FOLDERS = ("SAELens's cfg.json + sae_weights.safetensors, or Gemma Scope 2's config.json + params.safetensors")


class SAE:
    """One SAE's (or transcoder's) weights, where it reads, and its math.

    Attributes
    ----------
    activation
        ``"relu"``, ``"jumprelu"`` or ``"topk"``.
    W_enc, b_enc, W_dec, b_dec
        ``[d_in, d_sae]``, ``[d_sae]``, ``[d_sae, d_out]``, ``[d_out]`` (SAELens's layout).
    threshold
        JumpReLU's per-latent threshold ``[d_sae]``; ``None`` otherwise.
    k
        TopK's number of active latents per position; ``None`` otherwise.
    W_skip
        A transcoder's affine skip ``[d_out, d_in]`` (SAELens's layout), or ``None``.
    apply_b_dec_to_input
        Whether ``b_dec`` is subtracted from the input before encoding (SAELens's default for
        SAEs; never for transcoders or Gemma Scope).
    rescale_by_decoder_norm
        TopK's ``rescale_acts_by_decoder_norm``.
    hook, hook_out
        Where it reads (a TransformerLens hook name or a Hugging Face module path, see
        :mod:`pipatch._model.features.hooks`) and, for a transcoder, where it writes.
    model_name
        The model it was trained on, as its config names it (``None``: not named).
    name
        What to call it (its SAELens id, its folder's name).
    folder
        The folder it was read from (``None``: an SAELens object or release), where its labels
        and top contexts are kept (:mod:`pipatch._model.features.labels`, :mod:`pipatch._experiments._feature_contexts`).
    """

    folder: Path | None = None
    #: The safetensors file its weights were read from (``None``: not read from a folder).
    file: Path | None = None

    def __init__(self, *, activation: str, W_enc: torch.Tensor, b_enc: torch.Tensor, W_dec: torch.Tensor,
                 b_dec: torch.Tensor, hook: str, threshold: torch.Tensor | None = None, k: int | None = None,
                 W_skip: torch.Tensor | None = None, apply_b_dec_to_input: bool = False,
                 rescale_by_decoder_norm: bool = False, hook_out: str | None = None,
                 model_name: str | None = None, name: str = "sae"):
        self.activation = activation
        self.k = int(k) if activation == "topk" and k else None
        self.W_enc, self.b_enc, self.W_dec, self.b_dec = W_enc, b_enc, W_dec, b_dec
        self.threshold = threshold if activation == "jumprelu" else None
        self.W_skip = W_skip
        self.apply_b_dec_to_input, self.rescale_by_decoder_norm = apply_b_dec_to_input, rescale_by_decoder_norm
        self.hook, self.hook_out, self.model_name, self.name = hook, hook_out, model_name, name
        if activation == "jumprelu" and threshold is None:
            raise PipatchError(f"JumpReLU SAE {name!r} has no threshold: its weights need a 'threshold' tensor")
        if activation == "topk" and not k:
            raise PipatchError(f"TopK SAE {name!r} has no k: its config needs 'k'")
        shapes = (W_enc.shape, b_enc.shape, W_dec.shape, b_dec.shape)
        if (W_enc.ndim, W_dec.ndim) != (2, 2) or b_enc.shape != (self.d_sae,) or W_dec.shape[0] != self.d_sae \
                or b_dec.shape != (self.d_out,):
            raise PipatchError(f"SAE {name!r} has inconsistent shapes W_enc/b_enc/W_dec/b_dec {[tuple(s) for s in shapes]}: "
                               "expected [d_in, d_sae], [d_sae], [d_sae, d_out], [d_out]")

    # -- sizes --------------------------------------------------------------------------------
    @property
    def d_in(self) -> int:
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        """The number of latents."""
        return int(self.W_enc.shape[1])

    @property
    def d_out(self) -> int:
        return int(self.W_dec.shape[1])

    @property
    def transcoder(self) -> bool:
        """Whether it writes somewhere other than where it reads (a transcoder)."""
        return self.hook_out is not None

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    def to(self, device: Any = None, dtype: torch.dtype | None = None) -> SAE:
        """Move (and cast) every tensor, in place; returns ``self``."""
        for name in ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device=device, dtype=dtype))
        return self

    # -- the math -----------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents ``[..., d_sae]`` of activations ``x`` ``[..., d_in]`` (in the SAE's dtype)."""
        x = x.to(self.W_enc.device, self.dtype)
        if self.apply_b_dec_to_input:
            x = x - self.b_dec
        pre = x @ self.W_enc + self.b_enc
        if self.rescale_by_decoder_norm:
            pre = pre * self.W_dec.norm(dim=-1)
        if self.threshold is not None:  # JumpReLU
            return torch.relu(pre) * (pre > self.threshold).to(pre.dtype)
        if self.k is not None:  # TopK
            values, indices = torch.topk(pre, k=self.k, dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter_(-1, indices, values.relu())
        return torch.relu(pre)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """What ``latents`` ``[..., d_sae]`` stand for: ``f W_dec + b_dec`` (``[..., d_out]``)."""
        if self.rescale_by_decoder_norm:
            latents = latents * (1 / self.W_dec.norm(dim=-1))
        return latents @ self.W_dec + self.b_dec

    def reconstruct(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))``, plus a transcoder's affine skip ``x W_skipᵀ``."""
        out = self.decode(self.encode(x))
        if self.W_skip is not None:
            out = out + x.to(self.dtype) @ self.W_skip.T
        return out

    def recipe(self) -> dict[str, Any] | None:
        """What a script needs to redo this SAE's math without pipatch (``Result.code()``), as
        plain JSON: its weights file and the names of its tensors there (``transposed``: those
        stored the other way round), its dtype and architecture. ``None`` for an SAE not read
        from a folder (an SAELens object or release)."""
        if self.file is None:
            return None
        gemma = self.file.name == GEMMA_SCOPE_FILE
        ours = ["W_enc", "b_enc", "W_dec", "b_dec", *(["threshold"] if self.threshold is not None else []),
                *(["W_skip"] if self.W_skip is not None else [])]
        return {"file": str(self.file), "tensors": {n: GEMMA_SCOPE_NAMES[n] if gemma else n for n in ours},
                "transposed": ["W_skip"] if gemma and self.W_skip is not None else [],
                "dtype": str(self.dtype).removeprefix("torch."), "activation": self.activation, "k": self.k,
                "apply_b_dec_to_input": self.apply_b_dec_to_input,
                "rescale_by_decoder_norm": self.rescale_by_decoder_norm}

    def __repr__(self) -> str:
        kind = "transcoder" if self.transcoder else "SAE"
        where = f"{self.hook} → {self.hook_out}" if self.transcoder else self.hook
        return f"<{self.activation} {kind} {self.name!r}: {self.d_in} → {self.d_sae} latents at {where}>"


# --------------------------------------------------------------------------------------------
# SAELens's config (an SAE object's cfg.to_dict(), or a folder's cfg.json)
# --------------------------------------------------------------------------------------------

def _from_saelens_config(cfg: dict[str, Any], state: dict[str, torch.Tensor], name: str) -> SAE:
    """An :class:`SAE` from SAELens's config dict and state dict (its own tensor names)."""
    meta = {**cfg, **(cfg.get("metadata") or {})}  # pre-6.0 configs keep these at the top
    architecture = cfg.get("architecture") or "standard"
    if architecture == "standard" and cfg.get("activation_fn") == "topk":  # pre-6.0 TopK
        architecture = "topk"
    if architecture not in ARCHITECTURES:
        raise PipatchError(f"SAE {name!r} has architecture {architecture!r}, which pipatch does not read: "
                           f"use one of {', '.join(ARCHITECTURES)}")
    activation, transcoder, skip = ARCHITECTURES[architecture]
    norm = cfg.get("normalize_activations") or "none"
    if norm not in ("none", False):
        raise PipatchError(f"SAE {name!r} normalizes its input ({norm!r}), which pipatch does not apply: fold it "
                           "into the weights with SAELens first (fold_activation_norm_scaling_factor), or use an SAE without")
    if meta.get("hook_head_index") is not None:
        raise PipatchError(f"SAE {name!r} reads one attention head (hook_head_index={meta['hook_head_index']}), which "
                           "pipatch does not read: use an SAE of a whole hook")
    if cfg.get("finetuning_scaling_factor") or "finetuning_scaling_factor" in state:
        raise PipatchError(f"SAE {name!r} has a finetuning scaling factor, which pipatch does not apply: use an SAE without")
    hook = meta.get("hf_hook_name") or meta.get("hook_name") or meta.get("hook_point")
    hook_out = (meta.get("hf_hook_name_out") or meta.get("hook_name_out")) if transcoder else None
    if not hook or (transcoder and not hook_out):
        raise PipatchError(f"SAE {name!r} names no hook in its config ({'hook_name and hook_name_out' if transcoder else 'hook_name'}): "
                           "pass an SAE whose config says where it reads")
    missing = [key for key in ("W_enc", "b_enc", "W_dec", "b_dec") if key not in state]
    if missing:
        raise PipatchError(f"SAE {name!r} lacks the weights {', '.join(missing)}: its safetensors file needs "
                           "W_enc, b_enc, W_dec and b_dec")
    k = (cfg.get("activation_fn_kwargs") or {}).get("k") if cfg.get("k") is None else cfg.get("k")
    return SAE(activation=activation, W_enc=state["W_enc"], b_enc=state["b_enc"], W_dec=state["W_dec"],
               b_dec=state["b_dec"], threshold=state.get("threshold"), k=k,
               W_skip=state.get("W_skip") if skip else None,
               apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", not transcoder)),
               rescale_by_decoder_norm=bool(cfg.get("rescale_acts_by_decoder_norm", False)),
               hook=hook, hook_out=hook_out, model_name=meta.get("model_name"), name=name)


def from_saelens(sae: Any, name: str | None = None) -> SAE:
    """An :class:`SAE` from an SAELens ``SAE`` object (its config and tensors, detached and
    copied: later changes to the object do not reach it). SAELens itself is not imported."""
    cfg = sae.cfg.to_dict()
    state = {key: value.detach().clone() for key, value in sae.state_dict().items()}
    meta = cfg.get("metadata") or {}
    label = name or meta.get("sae_id") or meta.get("neuronpedia_id") or meta.get("hook_name") or type(sae).__name__
    return _from_saelens_config(cfg, state, str(label))


# --------------------------------------------------------------------------------------------
# Folders
# --------------------------------------------------------------------------------------------

def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _config(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise PipatchError(f"{path} is not valid JSON ({error.msg}, line {error.lineno}): "
                           "rewrite it or pass another SAE folder") from None


def _gemma_scope(folder: Path, name: str) -> SAE:
    """Gemma Scope 2's own format: ``config.json`` (``hf_hook_point_in``, for a transcoder
    ``hf_hook_point_out``, ``architecture: jump_relu``) + ``params.safetensors`` (``w_enc``,
    ``w_dec``, ``b_enc``, ``b_dec``, ``threshold``, optional ``affine_skip_connection``
    ``[d_in, d_out]``)."""
    cfg = _config(folder / "config.json")
    architecture = cfg.get("architecture", "jump_relu")
    if architecture not in ("jump_relu", "jumprelu"):
        raise PipatchError(f"Gemma Scope SAE {name!r} has architecture {architecture!r}: pipatch reads Gemma Scope's "
                           "JumpReLU SAEs and transcoders (architecture 'jump_relu')")
    hook = cfg.get("hf_hook_point_in") or cfg.get("hf_hook_point")
    if not hook:
        raise PipatchError(f"{folder / 'config.json'} names no hook (hf_hook_point_in): add the module path the SAE "
                           "reads, e.g. \"model.layers.12.output\"")
    state = _tensors(folder / GEMMA_SCOPE_FILE)
    missing = [key for key in ("w_enc", "w_dec", "b_enc", "b_dec", "threshold") if key not in state]
    if missing:
        raise PipatchError(f"{folder / 'params.safetensors'} lacks {', '.join(missing)}: Gemma Scope's params hold "
                           "w_enc, w_dec, b_enc, b_dec and threshold")
    skip = state.get(GEMMA_SCOPE_NAMES["W_skip"])
    return SAE(activation="jumprelu", W_enc=state["w_enc"], b_enc=state["b_enc"], W_dec=state["w_dec"],
               b_dec=state["b_dec"], threshold=state["threshold"], W_skip=None if skip is None else skip.T.contiguous(),
               hook=hook, hook_out=cfg.get("hf_hook_point_out"), model_name=cfg.get("model_name"), name=name)


def read_folder(folder: str | Path, name: str | None = None) -> SAE:
    """An :class:`SAE` from a folder in SAELens's format (``cfg.json`` +
    ``sae_weights.safetensors``) or Gemma Scope 2's (``config.json`` + ``params.safetensors``).

    Raises
    ------
    PipatchError
        A folder in neither format, or a config pipatch does not support (one line each).
    """
    folder = Path(folder).expanduser()
    label = name or folder.name
    if (folder / "cfg.json").is_file() and (folder / "sae_weights.safetensors").is_file():
        sae = _from_saelens_config(_config(folder / "cfg.json"), _tensors(folder / "sae_weights.safetensors"), label)
        sae.file = folder / "sae_weights.safetensors"
    elif (folder / "params.safetensors").is_file() and (folder / "config.json").is_file():
        sae = _gemma_scope(folder, label)
        sae.file = folder / GEMMA_SCOPE_FILE
    else:
        raise PipatchError(f"{folder} holds no SAE pipatch reads: expected {_FOLDERS}")
    sae.folder = folder
    return sae


def from_release(release: str, sae_id: str) -> SAE:
    """An :class:`SAE` of an SAELens release (``"gemma-scope-2-270m-pt-res"``) and id
    (``"layer_12_width_16k_l0_small"``), downloaded by SAELens.

    Raises
    ------
    PipatchError
        SAELens is not installed, the release or id is unknown to it, or the Hugging Face hub
        cannot be reached (offline): one line each, saying what to do.
    """
    try:
        from sae_lens import SAE as LensSAE  # type: ignore[import-not-found]
        from sae_lens.loading.pretrained_saes_directory import (  # type: ignore[import-not-found]
            get_pretrained_saes_directory,
        )
    except ImportError:
        raise PipatchError(f"loading the SAELens release {release!r} needs SAELens, which is not installed: "
                           f"pip install 'pipatch[sae]', or pass the SAE's folder ({_FOLDERS})") from None
    lookup = get_pretrained_saes_directory().get(release)
    if lookup is None:
        raise PipatchError(f"SAELens knows no release {release!r}: use a release of its pretrained_saes.yaml, "
                           "such as 'gemma-scope-2-270m-pt-res'")
    if sae_id not in lookup.saes_map:
        some = ", ".join(list(lookup.saes_map)[:3])
        raise PipatchError(f"release {release!r} has no SAE {sae_id!r}: use one of its ids, such as {some}")
    from ..models import _hub_reachable

    if not _hub_reachable(lookup.repo_id):
        raise PipatchError(f"the Hugging Face hub cannot be reached (offline, or HF_HUB_OFFLINE is set), so SAELens "
                           f"cannot download {release}/{sae_id}: connect to it, or download {lookup.repo_id}/"
                           f"{lookup.saes_map[sae_id]} elsewhere and pass that folder")
    return from_saelens(LensSAE.from_pretrained(release, sae_id, device="cpu"), name=sae_id)
