"""Random SAEs and transcoders for the tiny models, written to disk in the two folder formats
pipatch reads itself: SAELens's (``cfg.json`` + ``sae_weights.safetensors``, the config as
SAELens 6.54's ``SAE.save_model`` writes it) and Gemma Scope 2's (``config.json`` +
``params.safetensors``, the tensor names its releases use).

Kinds: ``jumprelu``, ``topk``, ``relu`` (SAELens ``standard``, which subtracts ``b_dec`` from its
input) and ``transcoder`` (JumpReLU with an affine skip, Gemma Scope 2's transcoder). Weights
are scaled so that a few latents fire at every position of a tiny model's activations.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

__all__ = ["KINDS", "D_SAE", "random_weights", "save_saelens", "save_gemma_scope", "sae_folder"]

KINDS = ["jumprelu", "topk", "relu", "transcoder"]
D_SAE = 40
TOP_K = 5
_ARCHITECTURE = {"jumprelu": "jumprelu", "topk": "topk", "relu": "standard", "transcoder": "jumprelu_skip_transcoder"}


def random_weights(kind: str, d_in: int, d_out: int | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """SAELens-named tensors of a random ``kind`` SAE: ``W_enc [d_in, D_SAE]``, ``b_enc``,
    ``W_dec [D_SAE, d_out]``, ``b_dec`` (and ``threshold``, ``W_skip [d_out, d_in]``)."""
    g = torch.Generator().manual_seed(seed)
    d_out = d_out or d_in
    weights = {
        "W_enc": torch.randn(d_in, D_SAE, generator=g) / d_in**0.5,
        "b_enc": torch.randn(D_SAE, generator=g) * 0.1,
        "W_dec": torch.randn(D_SAE, d_out, generator=g) / D_SAE**0.5,
        "b_dec": torch.randn(d_out, generator=g) * 0.1,
    }
    if kind in ("jumprelu", "transcoder"):
        weights["threshold"] = torch.rand(D_SAE, generator=g) * 0.3
    if kind == "transcoder":
        weights["W_skip"] = torch.randn(d_out, d_in, generator=g) * 0.05
    return weights


def save_saelens(folder: Path, kind: str, weights: dict[str, torch.Tensor], hook: str, model_name: str,
                 hook_out: str | None = None) -> Path:
    """``weights`` as an SAELens 6.54 folder reading ``hook`` (a transcoder writing ``hook_out``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    d_in, d_sae = weights["W_enc"].shape
    cfg = {"architecture": _ARCHITECTURE[kind], "d_in": int(d_in), "d_sae": int(d_sae), "dtype": "float32",
           "device": "cpu", "apply_b_dec_to_input": kind == "relu", "normalize_activations": "none",
           "reshape_activations": "none",
           "metadata": {"model_name": model_name, "hook_name": hook, "sae_lens_version": "6.54.12"}}
    if kind == "topk":
        cfg.update(k=TOP_K, rescale_acts_by_decoder_norm=False)
    if kind == "transcoder":
        cfg["d_out"] = int(weights["W_dec"].shape[1])
        cfg["metadata"]["hook_name_out"] = hook_out
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder


def save_gemma_scope(folder: Path, weights: dict[str, torch.Tensor], hook: str, model_name: str,
                     hook_out: str | None = None) -> Path:
    """JumpReLU ``weights`` (a transcoder's with its skip) in Gemma Scope 2's own format."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    params = {"w_enc": weights["W_enc"], "w_dec": weights["W_dec"], "b_enc": weights["b_enc"],
              "b_dec": weights["b_dec"], "threshold": weights["threshold"]}
    config = {"architecture": "jump_relu", "model_name": model_name, "hf_hook_point_in": hook}
    if hook_out is not None:
        config.update(hf_hook_point_out=hook_out, affine_connection="W_skip" in weights)
        if "W_skip" in weights:
            params["affine_skip_connection"] = weights["W_skip"].T
    save_file({k: v.contiguous() for k, v in params.items()}, str(folder / "params.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


_FOLDERS: dict[tuple, Path] = {}


def sae_folder(d_model: int, layer: int, seed: int = 0) -> str:
    """A random JumpReLU SAE of a ``d_model``-wide model's block ``layer`` output, written once
    per process to a temporary folder (SAELens's format, naming no model: any model of that
    width takes it). The experiments' examples (:mod:`tests._experiments`) read features with it."""

    key = (d_model, layer, seed)
    if key not in _FOLDERS:
        folder = Path(tempfile.mkdtemp(prefix="pipatch-sae-")) / f"L{layer}"
        save_saelens(folder, "jumprelu", random_weights("jumprelu", d_model, d_model, seed=seed),
                     f"blocks.{layer}.hook_resid_post", "")
        _FOLDERS[key] = folder
    return str(_FOLDERS[key])
