"""An SAE's latent site in a program request: sent as data, checked and rebuilt by the server.

A :class:`~pipatch._model.features.site.LatentSite` (or its :class:`~pipatch._model.features.site.ErrorSite`,
or its latents and error side by side, :class:`~pipatch._model.features.site.NodeValues`: ``part``)
has no name a server knows: the SAE is the client's. So it travels as its description (the
architecture, ``k``, the two SAELens flags, the layer, kind and module it reads and writes, the
dtype) and its tensors (``W_enc``, ``b_enc``, ``W_dec``, ``b_dec``, and ``threshold`` and ``W_skip``
where it has them); ``torch.save`` writes a tensor once per request, however many invokes name
the site. The server (:func:`decode_latent`) checks every field against its model: a kind and
module pipatch reads in this model family, a layer it has, shapes that fit each other and the
model's width, float tensors; and rebuilds the site with pipatch's own classes, never code the
client names. A rebuilt site is kept by its content's hash (:data:`_BUILT`, the last few), so a
sweep's requests do not rebuild it each time.

The weights travel with every request that names the site: one too large for the server's
``--max-request-bytes`` is refused on the client in one line naming the flag
(:meth:`pipatch._backends.served.ServedBackend._fitted`).
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from typing import Any

import torch

from .._model.features.hooks import ORDER, Hook, _literal_kind
from .._model.features.sae import SAE
from .._model.features.site import ErrorSite, LatentSite, NodeValues, latent_site
from .._model.models import Adapter, PipatchError

__all__ = ["encode_latent", "decode_latent", "LATENT_FIELDS"]

#: The description's fields (each checked by :func:`decode_latent`).
LATENT_FIELDS = ("part", "name", "sae_name", "activation", "k", "apply_b_dec_to_input", "rescale_by_decoder_norm",
                 "reads", "writes", "hook", "hook_out", "tensors")
_TENSORS = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip")
_ACTIVATIONS = ("relu", "jumprelu", "topk")
#: Which of an SAE's sites a description names: its latents, its error, or both side by side.
_PARTS = {"latents": "", "error": " error", "nodes": " nodes"}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Rebuilt sites by content hash: a sweep's requests name the same SAE again and again.
_BUILT: OrderedDict[str, LatentSite] = OrderedDict()
_KEEP = 4


class _Refused(ValueError):
    """A malformed latent site: the caller words it as its own 400 line."""


def encode_latent(site: LatentSite) -> dict[str, Any]:
    """The data of ``site`` (a latent, error or node-values site) for a request."""
    sae = site.sae
    part = "error" if isinstance(site, ErrorSite) else "nodes" if isinstance(site, NodeValues) else "latents"
    return {"part": part, "name": site.name.removesuffix(_PARTS[part]), "sae_name": sae.name, "activation": sae.activation,
            "k": sae.k, "apply_b_dec_to_input": sae.apply_b_dec_to_input,
            "rescale_by_decoder_norm": sae.rescale_by_decoder_norm,
            "reads": [site.reads.layer, site.reads.kind, site.reads.path, site.reads.reads_in],
            "writes": [site.writes.layer, site.writes.kind, site.writes.path, site.writes.reads_in],
            "hook": sae.hook, "hook_out": sae.hook_out,
            "tensors": {n: None if getattr(sae, n) is None else getattr(sae, n).detach().cpu() for n in _TENSORS}}


def decode_latent(value: dict, adapter: Adapter, what: str) -> LatentSite:
    """The site ``value`` describes, checked against the server's model (``adapter``) and
    rebuilt; :class:`PipatchError` (one line naming ``what`` and the field) when it does not fit."""
    try:
        description = _check(value, adapter)
    except _Refused as refused:
        raise PipatchError(f"{what}: {refused}: send latent sites from pipatch's served backend of this version, "
                           "with an SAE of the model this server serves") from None
    key = _digest(value)
    site = _BUILT.get(key)
    if site is None:
        site = _build(description, adapter)
        _BUILT[key] = site
        while len(_BUILT) > _KEEP:
            _BUILT.popitem(last=False)
    _BUILT.move_to_end(key)
    return {"latents": site, "error": site.error_site, "nodes": site.nodes_site}[value["part"]]


def _text(value: Any, field: str, most: int = 200) -> str:
    if type(value) is not str or re.fullmatch(rf"[^\x00-\x1f\x7f-\x9f]{{1,{most}}}", value) is None:
        raise _Refused(f"{field} is not a name of 1 to {most} printable characters")
    return value


def _hook(value: Any, field: str, adapter: Adapter) -> Hook:
    """A place pipatch reads in this model: a known kind at a layer the model has, held by the
    module this model family keeps that kind in (no other path: a request names no module)."""
    if type(value) is not list or len(value) != 4:
        raise _Refused(f"{field} is not [layer, kind, path, reads_in]")
    layer, kind, path, reads_in = value
    if type(layer) is not int or not 0 <= layer < adapter.n_layers:
        raise _Refused(f"{field} layer {str(layer)[:20]} is not in [0, {adapter.n_layers})")
    if kind not in ORDER or type(path) is not str or type(reads_in) is not bool \
            or _literal_kind(path, reads_in, adapter) != kind:
        raise _Refused(f"{field} {str(kind)[:20]!r} at {str(path)[:60]!r} is no place pipatch reads in this "
                       f"{adapter.family} model")
    return Hook(layer, kind, path, reads_in)


def _check(value: Any, adapter: Adapter) -> dict[str, Any]:
    if type(value) is not dict or set(value) != set(LATENT_FIELDS):
        raise _Refused(f"the SAE's description is not {{{', '.join(LATENT_FIELDS)}}}")
    if value["activation"] not in _ACTIVATIONS:
        raise _Refused(f"activation {str(value['activation'])[:20]!r} is not one of {', '.join(_ACTIVATIONS)}")
    if value["part"] not in _PARTS:
        raise _Refused(f"part {str(value['part'])[:20]!r} is not one of {', '.join(_PARTS)}")
    for flag in ("apply_b_dec_to_input", "rescale_by_decoder_norm"):
        if type(value[flag]) is not bool:
            raise _Refused(f"{flag} is not True or False")
    reads, writes = _hook(value["reads"], "reads", adapter), _hook(value["writes"], "writes", adapter)
    transcoder = value["hook_out"] is not None
    if transcoder and ((reads.kind, writes.kind) != ("mlp_input", "mlp_output") or reads.layer != writes.layer):
        raise _Refused("a transcoder reads a layer's MLP input and writes that layer's MLP output")
    if not transcoder and reads != writes:
        raise _Refused("an SAE writes where it reads")
    tensors = value["tensors"]
    if type(tensors) is not dict or set(tensors) != set(_TENSORS):
        raise _Refused(f"tensors is not {{{', '.join(_TENSORS)}}}")
    for name, tensor in tensors.items():
        if tensor is None and name in ("threshold", "W_skip"):
            continue
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided or tensor.dtype not in _FLOATS:
            raise _Refused(f"tensor {name} is not a dense float tensor")
    d_in, d_out = reads.width(adapter), writes.width(adapter)
    w_enc = tensors["W_enc"]
    d_sae = int(w_enc.shape[-1]) if w_enc.dim() == 2 else -1
    shapes = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_out), "b_dec": (d_out,),
              "threshold": (d_sae,), "W_skip": (d_out, d_in)}
    for name, shape in shapes.items():
        tensor = tensors[name]
        if tensor is not None and (tuple(tensor.shape) != shape or tensor.dtype != w_enc.dtype):
            raise _Refused(f"tensor {name} is {list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}, not "
                           f"{list(shape)} {str(w_enc.dtype).removeprefix('torch.')} (this model's "
                           f"{reads.kind} is {d_in} wide)")
    if d_sae < 1:
        raise _Refused("W_enc has no latents")
    if (value["activation"] == "jumprelu") != (tensors["threshold"] is not None):
        raise _Refused("a JumpReLU SAE, and only one, has a threshold")
    if value["activation"] == "topk":
        if type(value["k"]) is not int or not 1 <= value["k"] <= d_sae:
            raise _Refused(f"k is not a whole number in [1, {d_sae}]")
    elif value["k"] is not None:
        raise _Refused("k is for TopK SAEs only")
    if tensors["W_skip"] is not None and not transcoder:
        raise _Refused("only a transcoder has an affine skip")
    for name in ("name", "sae_name", "hook"):
        _text(value[name], name)
    if transcoder:
        _text(value["hook_out"], "hook_out")
    return {**value, "reads": reads, "writes": writes}


def _digest(value: dict) -> str:
    """The hash of a latent site's whole content: its description and its tensors' bytes."""
    digest = hashlib.sha256(repr({k: v for k, v in value.items() if k not in ("tensors", "part")}).encode())
    for name in _TENSORS:
        tensor = value["tensors"][name]
        digest.update(name.encode())
        if tensor is not None:
            digest.update(str(tensor.dtype).encode())
            digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _build(description: dict[str, Any], adapter: Adapter) -> LatentSite:
    tensors: dict[str, Any] = {name: None if t is None else t.clone() for name, t in description["tensors"].items()}
    try:
        sae = SAE(activation=description["activation"], k=description["k"], hook=description["hook"],
                  hook_out=description["hook_out"], apply_b_dec_to_input=description["apply_b_dec_to_input"],
                  rescale_by_decoder_norm=description["rescale_by_decoder_norm"], name=description["sae_name"],
                  **tensors)
        site = latent_site(sae, description["reads"], description["writes"], description["name"])
        site.check(adapter)
    except PipatchError as error:
        raise PipatchError(f"latent site {description['name']!r}: {error}") from None
    return site
