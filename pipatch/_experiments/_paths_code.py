"""Path patching's part of ``Result.code()``'s script: ``path_patch``, the three runs of
:mod:`pipatch._experiments.paths` written out with plain nnsight.

For a clean/corrupt pair the script

1. runs both prompts once and keeps, at every layer, ``z`` (each head's output before the
   attention output projection), the attention output and the MLP output. The base run is the
   corrupt prompt for ``denoise`` and the clean one for ``noise``; the other is the donor;
2. for each sender layer (a grid row) runs the base prompt once per sender (a column: a head's
   slice of ``z``, or the layer's MLP), all of a row as invokes of one trace, with the sender's
   output swapped for the donor's and every later attention and MLP output frozen to the base
   run's, and records what the receivers read;
3. with receivers (later heads' query, key or value columns), runs the base prompt again with
   only those inputs replaced by what run 2 recorded. Without them (the direct path to the
   logits) run 2's metric is the cell.

A sender at or above the first receiver's layer has no path to it: its cell is NaN, as in
pipatch. The grid is normalized recovery.

The receivers enter the script as ``{layer: [(projection, [(lo, hi), ...]), ...]}``: the
output columns of the q/k/v projection module each head reads (one fused module on GPT-2,
three on Llama), from the family's layout (:meth:`pipatch._model.models.Adapter.qkv_columns`).
The template sits here rather than in :mod:`pipatch._experiments.paths` so that module stays the
protocol's.
"""

from __future__ import annotations

from string import Template
from typing import Any

from .._model.models import Adapter
from .._model.sites import ATTN, HEAD, MLP, Site, projection

__all__ = ["path_code"]

_PATH = Template('''

DIRECTION = $direction  # denoise: base run corrupt, donor clean; noise: the other way round
SENDER_LAYERS = $sender_layers  # grid rows
SENDER_HEADS = $sender_heads  # grid columns (None: the layer's MLP)
# Receivers by layer: (q/k/v projection under the attention, [(lo, hi) output columns]);
# empty: the direct path to the logits.
RECEIVERS = $receivers
FIRST_RECEIVER = min(RECEIVERS, default=n_layers)


def path_patch(clean_prompt, corrupt_prompt, answer, foil):
    """Path patching: each sender's effect on the metric through the receivers only.
    Returns ({view: metric [1, senders' layers, senders]}, clean metric, corrupt metric [1])."""
    runs = {}
    for name, text in (("clean", clean_prompt), ("corrupt", corrupt_prompt)):
        ids = tokens(text)
        with model.trace(ids, **LAST_ONLY):
            cache = nnsight.save({"z": [], "attn": [], "mlp": []})
            for layer in range(n_layers):
                cache["z"].append(site("head", layer).clone())
                cache["attn"].append(site("attn", layer).clone())
                cache["mlp"].append(site("mlp", layer).clone())
            value = metric(model.output.logits[0, -1], answer, foil).save()
        runs[name] = (ids, cache, value)
    base_ids, base, _ = runs["corrupt" if DIRECTION == "denoise" else "clean"]
    _, donor, _ = runs["clean" if DIRECTION == "denoise" else "corrupt"]

    raw = torch.full((1, len(SENDER_LAYERS), len(SENDER_HEADS)), float("nan"))
    for row, layer in enumerate(SENDER_LAYERS):
        if layer >= FIRST_RECEIVER:
            continue  # a receiver must read what the sender wrote: no path (NaN)
        # Run 2: the sender's output swapped for the donor's, every later attention and MLP
        # output frozen to the base run's; record what the receivers read.
        with model.trace(**LAST_ONLY) as tracer:
            values, recorded = nnsight.save([]), nnsight.save([])
            for head in SENDER_HEADS:
                with tracer.invoke(base_ids):
                    reads = []
                    for later in range(layer, n_layers):
                        for projection, spans in RECEIVERS.get(later, []):
                            out = site(projection, later)
                            reads += [out[:, :, lo:hi].clone() for lo, hi in spans]
                        if later == layer and head is not None:
                            cols = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
                            site("head", layer)[:, :, cols] = donor["z"][layer][:, :, cols]
                        if later > layer:
                            site("attn", later)[:] = base["attn"][later]
                        sender_mlp = later == layer and head is None
                        site("mlp", later)[:] = (donor if sender_mlp else base)["mlp"][later]
                    recorded.append(reads)
                    values.append(metric(model.output.logits[0, -1], answer, foil))
        if RECEIVERS:
            # Run 3: the base run with only the receivers' inputs replaced by what run 2 recorded.
            with model.trace(**LAST_ONLY) as tracer:
                values = nnsight.save([])
                for reads in recorded:
                    with tracer.invoke(base_ids):
                        reads = iter(reads)
                        for later in sorted(RECEIVERS):
                            for projection, spans in RECEIVERS[later]:
                                out = site(projection, later)
                                for lo, hi in spans:
                                    out[:, :, lo:hi] = next(reads)
                        values.append(metric(model.output.logits[0, -1], answer, foil))
        raw[0, row] = torch.stack(list(values))
    return {$view: raw}, runs["clean"][2], runs["corrupt"][2].reshape(1)
''')


def path_code(result: Any, adapter: Adapter) -> tuple[str, str, list[Site], str]:
    """Path patching's part of ``Result.code()``'s script (assembled by
    :func:`pipatch._results.code.script`): the name of the script's function, its code, the sites it
    reads (z, the sublayer outputs and the q/k/v projections) and a summary for the script's
    docstring. The senders come from the result's rows and columns, the receivers from
    ``meta["receivers"]``.
    """
    meta = result.meta
    code = _PATH.substitute(direction=repr(meta.get("direction", "denoise")),
                            sender_layers=repr([int(x) for x in result.layers]),
                            sender_heads=repr(_sender_heads(result)), receivers=_receivers(meta, adapter),
                            view=repr(result.views[0]))
    summary = ("path patching, one run per sender with every later attention and MLP output frozen\n"
               "(and one more writing only the receivers' inputs), as normalized recovery.")
    projections = [projection(module, order) for order, module in enumerate(adapter.qkv)]
    return "path_patch", code, [HEAD, ATTN, MLP, *projections], summary


def _sender_heads(result: Any) -> list[int | None]:
    """The script's ``SENDER_HEADS``: each grid column's head, or ``[None]`` for a grid over MLPs."""
    if result.col_axis == "component":
        return [None]
    return [int(label[1:]) for label in result.columns]  # "H3" → 3


def _receivers(meta: dict, adapter: Adapter) -> str:
    """``{layer: [(projection, [(lo, hi), ...]), ...]}`` in forward order, as a literal."""
    receivers = meta.get("receivers", "logits")
    if isinstance(receivers, str) or not receivers:
        return "{}"
    by_layer: dict[int, dict[str, list[tuple[int, int]]]] = {}
    for _, layer, head, which in receivers:
        module, lo, hi = adapter.qkv_columns(which, int(head))
        by_layer.setdefault(int(layer), {}).setdefault(module, []).append((lo, hi))
    order = {name: i for i, name in enumerate(adapter.qkv)}
    return repr({layer: sorted(modules.items(), key=lambda item: order[item[0]])
                 for layer, modules in sorted(by_layer.items())})
