"""Path patching: the effect of one component on another, through one route only.

Activation patching a node (a head, an MLP) measures *everything* downstream of it: its direct
write to the logits and every later component that reads what it wrote. Path patching
(Wang et al. 2022, "Interpretability in the Wild", the IOI circuit; Goldowsky-Dill et al.
2023) isolates one *edge*: the effect of a **sender** on the output that flows only through
chosen **receivers**. Everything else is frozen at the base run's values, so the sender's new
output can reach the metric by no other route.

With ``direction="denoise"`` the base run is the corrupt prompt and the donor the clean one
(``"noise"``: the other way round). Three runs:

1. **Base run**, cached: every attention output, MLP output and ``z`` (each head's output
   before the attention output projection), at every layer.
2. **Sender run**: the base prompt with the sender's output replaced by the donor's — a head's
   slice of ``z``, or an MLP's output — and *every* attention and MLP output downstream of the
   sender frozen to its base value. The residual stream downstream is now
   ``base residual + (donor − base) contribution of the sender``, nothing more. Record what the
   receivers read.
3. **Receiver run**: the base prompt with only the receivers' inputs replaced by what run 2
   recorded; everything else recomputes normally. Its metric is the path effect.

Receivers:

* ``"logits"`` — the **direct path**: the sender's change reaches the final residual and goes
  through the final norm (recomputed, not frozen) and the unembedding. Run 2's own output is
  exactly ``unembed(norm(base final residual + donor contribution − base contribution))``, so
  no third run is needed.
* ``[("head", layer, h, "q" | "k" | "v"), ...]`` — the input of that head's query, key or value
  computation: the normed residual that feeds ``q_proj`` / ``k_proj`` / ``v_proj`` (or the
  fused projection of GPT-2, GPT-NeoX, Phi-3, Falcon). Only the receiving head's columns of the
  projection's output are patched (which equals feeding the recorded normed residual through
  that head's rows of the projection), so the other heads of that layer keep reading the base
  residual. :meth:`pipatch._models.Adapter.qkv_columns` says which columns those are in each
  family's layout. All receivers are patched together in run 3.

**Grouped-query attention.** Keys and values have ``n_kv_heads`` heads, each shared by a group
of ``n_heads / n_kv_heads`` query heads (Gemma 3 270M: one key/value head for all four query
heads). A ``"k"`` or ``"v"`` receiver ``("head", layer, h, "k")`` patches key head
``h // (n_heads / n_kv_heads)``, so every query head of that group reads the patched keys:
on a GQA model a key/value path cannot be narrowed to one query head.

**What "the sender's contribution" means.** For a head it is the change in the attention
sublayer's write to the residual when only that head's ``z`` slice is swapped. Without a norm
after attention this is ``W_O[:, head] (z_donor − z_base)``; in families that normalize the
attention output before adding it (Gemma 2/3's ``post_attention_layernorm``) it is that norm
applied to the whole attention output, recomputed — the head's write is not separable there.

The sender and receivers are patched at every position. The result is a :class:`PathResult`:
one number, with both baselines and normalized recovery on the same scale as
:func:`pipatch.patch` (0 the corrupt run, 1 the clean run).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._engine import METRICS, capture
from .._models import PipatchError, _get, adapter_for, first
from ._inputs import check_choice, model_meta
from .patching import pair_inputs

__all__ = ["path_patch", "PathResult"]

DIRECTIONS = ("denoise", "noise")
_QKV = ("q", "k", "v")


@dataclass
class PathResult:
    """The outcome of one path patch.

    Attributes
    ----------
    sender
        ``("head", layer, h)`` or ``("mlp", layer)``.
    receivers
        ``"logits"`` or the list of ``("head", layer, h, "q" | "k" | "v")``.
    metric, direction
        As passed.
    value
        The metric of the path-patched run (run 3; run 2 for ``"logits"``).
    clean, corrupt
        The metric of the clean and the corrupt run.
    meta
        Prompts, tokens, model, ...
    """

    sender: tuple
    receivers: Any
    metric: str
    direction: str
    value: float
    clean: float
    corrupt: float
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def base(self) -> float:
        """The metric of the run the path was patched into (corrupt for denoising)."""
        return self.corrupt if self.direction == "denoise" else self.clean

    @property
    def effect(self) -> float:
        """``value − base``: how far the path alone moved the metric."""
        return self.value - self.base

    @property
    def recovery(self) -> float:
        """Normalized ``(value − corrupt) / (clean − corrupt)``; NaN when clean ≈ corrupt."""
        span = self.clean - self.corrupt
        if abs(span) <= 1e-6 + 1e-3 * max(abs(self.clean), abs(self.corrupt)):
            return float("nan")
        return (self.value - self.corrupt) / span

    def __repr__(self) -> str:
        return (f"<pipatch.PathResult {self.direction} {self.sender} → {self.receivers}: {self.metric} "
                f"{self.value:.4g} (corrupt {self.corrupt:.4g}, clean {self.clean:.4g}), "
                f"recovery {self.recovery:.3f}>")


def path_patch(
    model,
    *,
    clean: str,
    corrupt: str,
    answer: str,
    foil: str | None = None,
    sender: Sequence,
    receivers: str | Sequence[Sequence] = "logits",
    metric: str = "logit_diff",
    direction: str = "denoise",
) -> PathResult:
    """Patch the path from ``sender`` to ``receivers`` only, everything else frozen.

    Parameters
    ----------
    clean, corrupt
        Prompts of equal token length.
    answer, foil
        Single tokens; ``foil`` is required for ``metric="logit_diff"``.
    sender
        ``("head", layer, h)`` (query head ``h``'s slice of ``z``) or ``("mlp", layer)``.
    receivers
        ``"logits"`` (the direct path) or a list of ``("head", layer, h, "q" | "k" | "v")`` at
        layers after the sender's: that head's columns of the query, key or value projection
        (separate ``q_proj``/``k_proj``/``v_proj``, or a fused projection as in GPT-2, GPT-NeoX,
        Phi-3 and Falcon; the adapter knows each layout). On GQA models a k/v receiver patches
        the key/value head its query head shares (see the module docstring).
    metric
        ``"logit_diff"``, ``"prob"`` or ``"logprob"``.
    direction
        ``"denoise"`` (base corrupt, donor clean) or ``"noise"`` (base clean, donor corrupt).

    Returns
    -------
    PathResult
        ``.value`` (the path-patched metric), ``.clean``, ``.corrupt``, ``.effect``
        (value − base) and ``.recovery`` ((value − corrupt) / (clean − corrupt)).

    Examples
    --------
    >>> pipatch.path_patch(model, clean="The Eiffel Tower is in the city of",
    ...                    corrupt="The Colosseum is in the city of", answer=" Paris", foil=" Rome",
    ...                    sender=("head", 12, 2), receivers="logits").recovery
    """
    check_choice(metric, METRICS, "metric")
    check_choice(direction, DIRECTIONS, "direction")
    adapter = adapter_for(model)
    adapter.site_module(model, "head", 0)  # refuses families whose sublayers include the residual
    kind, sender_layer, sender_head = _parse_sender(sender, adapter)
    receiver_list = _parse_receivers(receivers, sender_layer, adapter)
    pair = pair_inputs(model, clean, corrupt, answer, foil, metric)
    clean_ids, clean_tokens, corrupt_ids, corrupt_tokens = pair.clean_ids, pair.clean_tokens, pair.corrupt_ids, pair.corrupt_tokens
    answer_id, foil_id = pair.metric.answer, pair.metric.foil
    scorer = pair.metric

    clean_run = capture(model, clean_ids, scorer, sites=("attn", "mlp", "head"))
    corrupt_run = capture(model, corrupt_ids, scorer, sites=("attn", "mlp", "head"))
    if direction == "denoise":
        base, base_ids, donor = corrupt_run, corrupt_ids, clean_run
    else:
        base, base_ids, donor = clean_run, clean_ids, corrupt_run

    hd = adapter.head_dim
    # {layer: [(projection, [(receiver index, lo, hi), ...]), ...]} in q, k, v order: nnsight
    # serves a module's output only in the order the forward pass computes them. A fused
    # projection is one module serving all three.
    reads: dict[int, list[tuple[str, list[tuple[int, int, int]]]]] = {}
    for i, (_, layer, head, which) in enumerate(receiver_list):
        proj, lo, hi = adapter.qkv_columns(which, head)
        per_layer = reads.setdefault(layer, [(name, []) for name in adapter.qkv])
        next(part for name, part in per_layer if name == proj).append((i, lo, hi))
    reads = {layer: [(name, part) for name, part in parts if part] for layer, parts in reads.items()}

    # Run 2: the sender swapped, everything downstream of it frozen; record what receivers read.
    with torch.no_grad(), model.trace(**adapter.trace_kwargs) as tracer:
        recorded = list().save()
        with tracer.invoke(base_ids):
            for layer in range(sender_layer, adapter.n_layers):
                block = adapter.block(model, layer)
                attn = _get(block, adapter.attn)
                if layer == sender_layer and kind == "head":
                    lo = sender_head * hd
                    z = _get(attn, adapter.out_proj).input
                    z[:, :, lo : lo + hd] = donor.sites["head"][layer][:, :, lo : lo + hd]
                if layer > sender_layer:
                    for proj, part in reads.get(layer, []):
                        out = _get(attn, proj).output
                        for i, lo, hi in part:
                            recorded.append((i, out[:, :, lo:hi].clone()))
                    first(attn.output)[:] = base.sites["attn"][layer]
                mlp_value = donor.sites["mlp"][layer] if (layer == sender_layer and kind == "mlp") \
                    else base.sites["mlp"][layer]
                first(_get(block, adapter.mlp).output)[:] = mlp_value
            sender_logits = model.output.logits[:, -1].float().save()
    if not receiver_list:
        value = float(scorer.from_logits(sender_logits)[0])
    else:
        # Run 3: the base run with only the receivers' q/k/v slices replaced.
        values = dict(list(recorded))
        with torch.no_grad(), model.trace(**adapter.trace_kwargs) as tracer:
            with tracer.invoke(base_ids):
                for layer in sorted(reads):
                    attn = _get(adapter.block(model, layer), adapter.attn)
                    for proj, part in reads[layer]:
                        out = _get(attn, proj).output
                        for i, lo, hi in part:
                            out[:, :, lo:hi] = values[i]
                logits = model.output.logits[:, -1].float().save()
        value = float(scorer.from_logits(logits)[0])

    meta = model_meta(model)
    meta.update({"clean_prompt": clean, "corrupt_prompt": corrupt, "clean_tokens": clean_tokens,
                 "corrupt_tokens": corrupt_tokens, "answer": answer, "foil": foil,
                 "answer_id": answer_id, "foil_id": foil_id})
    return PathResult(
        sender=tuple(sender), receivers="logits" if not receiver_list else [tuple(r) for r in receiver_list],
        metric=metric, direction=direction, value=value, clean=float(clean_run.metric[0]),
        corrupt=float(corrupt_run.metric[0]), meta=meta,
    )


def _check_index(value: Any, limit: int, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
        raise PipatchError(f"{what} {value!r} is out of range: use 0..{limit - 1}")
    return value


def _parse_sender(sender: Any, adapter) -> tuple[str, int, int | None]:
    if isinstance(sender, (tuple, list)) and len(sender) == 3 and sender[0] == "head":
        return ("head", _check_index(sender[1], adapter.n_layers, "sender layer"),
                _check_index(sender[2], adapter.n_heads, "sender head"))
    if isinstance(sender, (tuple, list)) and len(sender) == 2 and sender[0] == "mlp":
        return "mlp", _check_index(sender[1], adapter.n_layers, "sender layer"), None
    raise PipatchError(f"sender {sender!r} is not ('head', layer, head) or ('mlp', layer)")


def _parse_receivers(receivers: Any, sender_layer: int, adapter) -> list[tuple]:
    if isinstance(receivers, str):
        if receivers != "logits":
            raise PipatchError(f"receivers {receivers!r}: use 'logits' or a list of ('head', layer, head, 'q'|'k'|'v')")
        return []
    out = []
    for receiver in receivers:
        if not (isinstance(receiver, (tuple, list)) and len(receiver) == 4 and receiver[0] == "head"
                and receiver[3] in _QKV):
            raise PipatchError(f"receiver {receiver!r} is not ('head', layer, head, 'q'|'k'|'v')")
        layer = _check_index(receiver[1], adapter.n_layers, "receiver layer")
        _check_index(receiver[2], adapter.n_heads, "receiver head")
        if layer <= sender_layer:
            raise PipatchError(
                f"receiver {tuple(receiver)} is at layer {layer}, not after the sender's layer {sender_layer}: "
                "a receiver must read the residual stream after the sender wrote to it"
            )
        adapter.qkv_columns(receiver[3], receiver[2])  # refuses a family whose q/k/v layout is unknown
        out.append(tuple(receiver))
    if not out:
        raise PipatchError("receivers is empty: pass 'logits' or at least one ('head', layer, head, 'q'|'k'|'v')")
    return out
