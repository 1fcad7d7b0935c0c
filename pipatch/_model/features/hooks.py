"""Where an SAE reads and writes: its config's hook name, mapped through the model's adapter.

SAEs name the activation they were trained on in one of two spellings:

* **TransformerLens / SAELens hook names**: ``blocks.12.hook_resid_post``, ``hook_resid_pre``,
  ``hook_attn_out``, ``hook_mlp_out``, ``hook_mlp_in`` (or ``ln2.hook_normalized``),
  ``attn.hook_z``;
* **Hugging Face module paths** with ``.output`` / ``.input`` (Gemma Scope 2's
  ``hf_hook_point_in``, SAELens's ``hf_hook_name``): ``model.layers.12.output``,
  ``model.layers.12.self_attn.o_proj.input``, ``model.layers.12.pre_feedforward_layernorm.output``.

Either becomes a :class:`Hook`: a layer, a *kind* (what the value is, whatever the family calls
its modules) and the module under the block that holds it in *this* model. The kinds:

==============  ================================================================  =====
kind            the value                                                         order
==============  ================================================================  =====
``z``           the attention output projection's input (heads side by side)      3
``attn_out``    what the attention adds to the stream (after Gemma's post-norm)   4
``mlp_input``   the MLP's input (its normed residual)                             5
``mlp_output``  what the MLP adds to the stream (after Gemma's post-norm)         6
``resid_post``  the block's output: the residual stream after it                  7
==============  ================================================================  =====

A Hugging Face path of another family's spelling (``self_attn`` on GPT-2) is read by meaning
(its sublayer names looked up among the adapter's candidates); a path that names no module of
this model, a layer it does not have, or a value pipatch does not read is refused in one line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..._base.errors import PipatchError
from ..models import _ATTN, _BLOCKS, _MLP, _OUT_PROJ, Adapter

__all__ = ["Hook", "locate", "ORDER"]

#: Where each kind comes in a block's forward pass (:attr:`pipatch._model.sites.Site.order`).
ORDER = {"z": 3, "attn_out": 4, "mlp_input": 5, "mlp_output": 6, "resid_post": 7}

_TL = re.compile(r"^blocks\.(\d+)\.(.+)$")
_TL_KINDS = {"hook_resid_post": "resid_post", "hook_attn_out": "attn_out", "hook_mlp_out": "mlp_output",
             "hook_mlp_in": "mlp_input", "ln2.hook_normalized": "mlp_input", "attn.hook_z": "z"}


@dataclass(frozen=True)
class Hook:
    """One place in one layer of one model: ``kind`` (see the module docstring), the module
    holding it under the block (``path``, ``""``: the block) and whether the value is that
    module's input (``reads_in``) or its output."""

    layer: int
    kind: str
    path: str
    reads_in: bool

    @property
    def order(self) -> int:
        return ORDER[self.kind]

    @property
    def module_value(self) -> tuple[str, bool]:
        """Which value of a block it is, whatever the layer: ``(path, reads_in)``."""
        return self.path, self.reads_in

    def width(self, adapter: Adapter) -> int:
        """The value's width in this model: every head's output side by side for ``z``, the
        hidden size otherwise."""
        return adapter.n_heads * adapter.head_dim if self.kind == "z" else adapter.d_model


def _kind_path(kind: str, adapter: Adapter) -> tuple[str, bool]:
    """The module under a block holding a value of ``kind`` in this family, and whether it is
    that module's input."""
    if kind == "resid_post":
        return "", False
    if kind == "z":
        return f"{adapter.attn}.{adapter.out_proj}", True
    if kind == "mlp_input":
        return adapter.mlp, True
    if kind == "attn_out":
        return adapter.attn_post_norm or adapter.attn, False
    return adapter.mlp_post_norm or adapter.mlp, False  # mlp_output


def _literal_kind(path: str, reads_in: bool, adapter: Adapter) -> str | None:
    """The kind of the value at ``path`` (input or output) in this family, if pipatch reads it."""
    if path == "" and not reads_in:
        return "resid_post"
    if reads_in:
        if path == f"{adapter.attn}.{adapter.out_proj}":
            return "z"
        return "mlp_input" if path == adapter.mlp else None
    named = {adapter.attn: "attn_out", adapter.mlp: "mlp_output", adapter.mlp_norm: "mlp_input",
             adapter.attn_post_norm: "attn_out", adapter.mlp_post_norm: "mlp_output"}
    return named.get(path) if path else None


def _by_meaning(path: str, adapter: Adapter) -> str:
    """``path`` with another family's sublayer names (``self_attn``, ``o_proj``) replaced by
    this family's, where they are among the adapter's candidates."""
    parts = path.split(".") if path else []
    if parts and parts[0] in _ATTN:
        parts[0] = adapter.attn
        if len(parts) > 1 and parts[1] in _OUT_PROJ:
            parts[1] = adapter.out_proj
    elif parts and parts[0] in _MLP:
        parts[0] = adapter.mlp
    return ".".join(parts)


def _hf_hook(name: str, adapter: Adapter) -> tuple[int, str, bool] | None:
    """``(layer, path under the block, reads_in)`` of a Hugging Face module path, or ``None``
    when ``name`` is not one."""
    for blocks in sorted({adapter.blocks, *_BLOCKS}, key=len, reverse=True):
        match = re.fullmatch(rf"{re.escape(blocks)}\.(\d+)(?:\.(.+))?", name)
        if match is None:
            continue
        rest = match.group(2) or ""
        io = re.fullmatch(r"(?:(.+)\.)?(input|output)", rest)
        path, reads_in = (io.group(1) or "", io.group(2) == "input") if io else (rest, False)
        return int(match.group(1)), path, reads_in
    return None


def locate(name: str, adapter: Adapter, what: str = "SAE") -> Hook:
    """The :class:`Hook` an SAE's hook name ``name`` means in the model ``adapter`` maps.

    Raises
    ------
    PipatchError
        A name pipatch cannot read (one line with the names it reads), a layer the model does
        not have, or a module path this model does not hold.
    """
    tl = _TL.match(name or "")
    if tl is not None:
        layer, hook = int(tl.group(1)), tl.group(2)
        if hook == "hook_resid_pre":
            if layer == 0:
                raise PipatchError(f"{what} hook {name!r} reads the embedding output, which pipatch does not "
                                   "patch through an SAE: use an SAE of a block's output (hook_resid_post)")
            layer, hook = layer - 1, "hook_resid_post"
        kind = _TL_KINDS.get(hook)
        if kind is None:
            raise PipatchError(f"{what} hook {name!r} is not one pipatch reads: use an SAE of "
                               f"blocks.N.{{{', '.join(_TL_KINDS)}}} or hook_resid_pre")
        path, reads_in = _kind_path(kind, adapter)
    else:
        found = _hf_hook(name or "", adapter)
        if found is None:
            raise PipatchError(f"{what} hook {name!r} is neither a TransformerLens hook name (blocks.N.hook_resid_post) "
                               f"nor a module path of this {adapter.family} model ({adapter.blocks}.N.output): "
                               "pass an SAE whose config names where it reads")
        layer, path, reads_in = found
        path = path if _literal_kind(path, reads_in, adapter) else _by_meaning(path, adapter)
        kind = _literal_kind(path, reads_in, adapter)
        if kind is None:
            raise PipatchError(f"{what} hook {name!r} names no value pipatch reads in this {adapter.family} model: use an "
                               f"SAE of a block's output, the attention or MLP output, the MLP input or z "
                               f"({adapter.blocks}.N.output, {adapter.blocks}.N.{adapter.attn}.{adapter.out_proj}.input, ...)")
        if kind == "mlp_input":  # the MLP norm's output is the MLP's input: one place, read one way
            path, reads_in = _kind_path(kind, adapter)
    if not 0 <= layer < adapter.n_layers:
        raise PipatchError(f"{what} hook {name!r} reads layer {layer}, but this {adapter.family} model has "
                           f"{adapter.n_layers} layers (0–{adapter.n_layers - 1}): load an SAE trained on this model")
    return Hook(layer, kind, path, reads_in)
