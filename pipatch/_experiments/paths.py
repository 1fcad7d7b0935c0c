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
  residual. :meth:`pipatch._model.models.Adapter.qkv_columns` says which columns those are in each
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

The sender and receivers are patched at every position of the prompt. With a multi-token answer
(read teacher-forced after the prompt: :class:`~pipatch._model.cells.Metric`) the freezing of run 2
also covers the prompt's positions only; the answer's own positions are computed from them, so
a sender's effect reaches the answer's positions through them by every route.

**A sweep over senders.** As in the IOI paper's figures, the default sender is *every* head:
the result is a grid of layers × heads, one path-patched run per sender, batched as invokes
like any other grid (``sender="mlp"``: layers × one MLP column). One sender, ``("head", 12, 2)``
or ``("mlp", 12)``, is a grid of one cell. With q/k/v receivers a sender must sit below the
first receiver's layer; the sweep leaves later senders empty (NaN). Values are normalized
recovery on the same scale as :func:`pipatch.patch` (0 the corrupt run, 1 the clean run);
``result.raw`` keeps the path-patched metric itself.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._base.checks import flag, whole_number
from .._engine import Plan, Sweep, check_batch_size
from .._model.cells import Base, Capture, Cell, Op
from .._model.declare import PAIR, Experiment, Param
from .._model.graph import LOGITS_NAME
from .._model.models import Adapter, PipatchError
from .._model.sites import ATTN, HEAD, MLP, QKV, Site, projection
from .._model.sites import site as site_named
from .._programs.capture import captures
from .._results import code as _code
from .._results.result import Result
from ._inputs import (
    BATCH_SIZE,
    FAST,
    METRIC,
    PAIR_PARAMS,
    check_choice,
    model_meta,
    pair_title,
    undefined_recovery_warning,
)
from ._paths_code import path_code
from .patching import pair_inputs

__all__ = ["plan_path_patch", "DIRECTIONS"]

DIRECTIONS = ("denoise", "noise")
#: What a sender can be: one head's slice of ``z``, or one MLP's output.
SENDER_SITES = (HEAD, MLP)
#: The column axis of a grid over MLP senders: one column, the layer's whole MLP.
COMPONENT_AXIS = "component"


@dataclass(frozen=True)
class _Sender:
    """One sender: site ``site`` at ``layer``, and which head (``None``: the whole MLP)."""

    site: Site
    layer: int
    head: int | None = None


@dataclass
class _Receiver:
    """One receiver: the output columns ``lo:hi`` of projection ``site`` at ``layer``, read
    there and written to each of ``copies`` (``lo:hi`` itself, and where tensor parallelism
    keeps copies of a key/value head, theirs: :meth:`Adapter.qkv_copies`)."""

    layer: int
    site: Site
    lo: int
    hi: int
    copies: tuple[tuple[int, int], ...] = ()

    def index(self, prompt: slice, columns: tuple[int, int] | None = None) -> tuple:
        """Columns ``lo:hi`` (or ``columns``) at the prompt's positions."""
        lo, hi = columns or (self.lo, self.hi)
        return self.site.index(prompt, width=slice(lo, hi))

    def writes(self, prompt: slice, value: torch.Tensor) -> list[Op]:
        """The ops that write ``value`` (what ``lo:hi`` held in run 2) into every copy."""
        return [Op(self.site, self.layer, self.index(prompt, columns), value) for columns in self.copies or [None]]


@dataclass
class _PathSweep(Sweep):
    """Cell ``(row, col)``: the path from sender ``senders[row][col]`` to the receivers.

    Run 2 of the module docstring is the cell's ops: the sender's value swapped for the
    donor's, every later attention / MLP output frozen to the base run's, the receivers'
    inputs recorded. With receivers, ``then`` builds run 3: the base run with only those
    recorded columns written.
    """

    adapter: Adapter | None = None
    donor: Capture | None = None
    senders: list[list[_Sender]] = field(default_factory=list)
    receivers: list[_Receiver] = field(default_factory=list)

    def cell(self, row: int, col: int, seed: int) -> Cell:
        sender = self.senders[row][col]
        layer = sender.layer
        base = self.base.capture
        prompt = slice(0, self.base.input_ids.shape[1])  # writes and freezes: prompt positions only
        ops = []
        if sender.head is not None:
            index = HEAD.head_index(self.adapter, sender.head, prompt)
            ops.append(Op(HEAD, layer, index, self.donor.sites[HEAD.name][layer][index]))
        for later in range(layer, self.adapter.n_layers):
            # The sender's own layer keeps its attention output: it carries a head sender's
            # write (and comes before an MLP sender's). Every later one is frozen.
            if later > layer:
                ops.append(Op(ATTN, later, ATTN.index(prompt), base.sites[ATTN.name][later]))
            mlp = self.donor if (later == layer and sender.site is MLP) else base
            ops.append(Op(MLP, later, MLP.index(prompt), mlp.sites[MLP.name][later]))
        ops += [Op(r.site, r.layer, r.index(prompt)) for r in self.receivers]
        then = None
        if self.receivers:
            receivers = self.receivers
            start = min(r.site.start_layer(r.layer) for r in receivers)

            def then(recorded: list[torch.Tensor], row=row, col=col, seed=seed) -> Cell:
                ordered = sorted(receivers, key=lambda r: (r.layer, r.site.order))
                return Cell(row, col, seed, start=start,
                            ops=[op for r, value in zip(ordered, recorded) for op in r.writes(prompt, value)])

        return Cell(row, col, seed, start=sender.site.start_layer(layer), ops=ops, then=then)


def plan_path_patch(
    backend,
    *,
    clean: str,
    corrupt: str,
    answer: str,
    foil: str | None,
    sender: Any,
    receivers: str | Sequence[Sequence],
    metric: str,
    direction: str,
    batch_size: int | None,
    fast: bool,
) -> Plan:
    """Check the inputs and run the clean and corrupt baselines; return the sender sweep's Plan.

    ``backend`` runs the model; the other parameters are :func:`pipatch.path_patch`'s (their
    defaults are :data:`DECLARATION`'s).
    """
    check_choice(direction, DIRECTIONS, "direction")
    fast = flag(fast, "fast")
    adapter = backend.adapter
    HEAD.check(adapter)  # refuses families whose sublayers include the residual
    sender_site, senders, rows, columns = _parse_sender(sender, adapter)
    view = sender_site.name
    receiver_list = _parse_receivers(receivers, adapter)
    first_receiver = min((r[1] for r in receiver_list), default=adapter.n_layers)
    if sender is not None and not isinstance(sender, str) and receiver_list and senders[0][0].layer >= first_receiver:
        late = next(r for r in receiver_list if r[1] <= senders[0][0].layer)
        raise PipatchError(
            f"receiver {tuple(late)} is at layer {late[1]}, not after the sender's layer {senders[0][0].layer}: "
            "a receiver must read the residual stream after the sender wrote to it"
        )
    pair = pair_inputs(backend, clean, corrupt, answer, foil, metric)
    batch = check_batch_size(batch_size, pair.clean_ids.shape[1], backend)
    scorer = pair.metric

    sites = [HEAD, ATTN, MLP]
    clean_run, corrupt_run = captures(backend, [pair.clean_ids, pair.corrupt_ids], scorer, sites)
    if direction == "denoise":
        base, base_ids, donor = corrupt_run, pair.corrupt_ids, clean_run
    else:
        base, base_ids, donor = clean_run, pair.clean_ids, corrupt_run

    only = {(row, col) for row in range(len(senders)) for col in range(len(senders[row]))
            if senders[row][col].layer < first_receiver}
    meta = model_meta(backend)
    meta.update({**pair.meta(backend), "site": view, "col_axis": sender_site.axis if sender_site.per_head else COMPONENT_AXIS,
                 "direction": direction,
                 "sender": list(sender) if isinstance(sender, (tuple, list)) else sender,
                 "receivers": "logits" if not receiver_list else [list(r) for r in receiver_list]})
    clean_value, corrupt_value = float(clean_run.metric[0]), float(corrupt_run.metric[0])
    result = Result(
        kind="path", tokens=pair.clean_tokens, columns=columns, layers=rows, metric=scorer.label,
        raw={view: torch.full((1, len(rows), len(columns)), float("nan"))}, clean=clean_value,
        corrupt=torch.tensor([corrupt_value]), meta=meta,
        warnings=undefined_recovery_warning(scorer.label, clean_value, corrupt_value),
    )
    sweep = _PathSweep(view=view, base=Base(base_ids, base), metric=scorer, n_rows=len(rows), n_cols=len(columns),
                       only=None if len(only) == len(rows) * len(columns) else only, adapter=adapter, donor=donor,
                       senders=senders, receivers=_receivers(receiver_list, adapter))
    return Plan(backend, result, [sweep], batch, fast)


def _receivers(receiver_list: list[tuple], adapter: Adapter) -> list[_Receiver]:
    """Each receiver's projection site and output columns (see :meth:`Adapter.qkv_columns`)."""
    out = []
    for _, layer, head, which in receiver_list:
        module, lo, hi = adapter.qkv_columns(which, head)
        out.append(_Receiver(layer, projection(module, adapter.qkv.index(module)), lo, hi,
                             tuple(adapter.qkv_copies(which, head))))
    return out


def _check_index(value: Any, limit: int, what: str) -> int:
    return whole_number(value, what, minimum=0, maximum=limit - 1)


def _site_called(name: Any) -> Site | None:
    """The site ``name`` names (``"head"``, ``"mlp"``, ...), or ``None`` for anything else."""
    try:
        return site_named(name) if isinstance(name, str) else None
    except PipatchError:
        return None


def _parse_sender(sender: Any, adapter: Adapter) -> tuple[Site, list[list[_Sender]], list[str], list[str]]:
    """``(sender site, senders[row][col], row labels, column labels)``.

    ``sender`` is ``None`` or a sender site's name (a sweep: every head of every layer, or
    every layer's MLP), or one sender: ``(name, layer)``, and its head for a head.
    """
    if sender is None or isinstance(sender, str):
        found = _site_called(HEAD.name if sender is None else sender)
        if found in SENDER_SITES:
            layers = range(adapter.n_layers)
            heads = list(range(adapter.n_heads)) if found.per_head else [None]
            return (found, [[_Sender(found, layer, h) for h in heads] for layer in layers],
                    [str(layer) for layer in layers], _sender_labels(heads))
    elif isinstance(sender, (tuple, list)) and sender:
        found = _site_called(sender[0])
        if found in SENDER_SITES and len(sender) == (3 if found.per_head else 2):
            layer = _check_index(sender[1], adapter.n_layers, "sender layer")
            head = _check_index(sender[2], adapter.n_heads, "sender head") if found.per_head else None
            return found, [[_Sender(found, layer, head)]], [str(layer)], _sender_labels([head])
    raise PipatchError(f"sender {sender!r} is not None/'head' (every head), 'mlp' (every MLP), "
                       "('head', layer, head) or ('mlp', layer)")


def _sender_labels(heads: list[int | None]) -> list[str]:
    """Column labels: ``H0, H1, ...`` for head senders, ``MLP`` for the layer's MLP."""
    return [HEAD.head_label(h) if h is not None else "MLP" for h in heads]


def _parse_receivers(receivers: Any, adapter: Adapter) -> list[tuple]:
    if isinstance(receivers, str):
        if receivers != LOGITS_NAME:
            raise PipatchError(f"receivers {receivers!r}: use 'logits' or a list of ('head', layer, head, 'q'|'k'|'v')")
        return []
    out = []
    for receiver in receivers:
        if not (isinstance(receiver, (tuple, list)) and len(receiver) == 4 and _site_called(receiver[0]) is HEAD
                and receiver[3] in QKV):
            raise PipatchError(f"receiver {receiver!r} is not ('head', layer, head, 'q'|'k'|'v')")
        _check_index(receiver[1], adapter.n_layers, "receiver layer")
        _check_index(receiver[2], adapter.n_heads, "receiver head")
        adapter.qkv_columns(receiver[3], receiver[2])  # refuses a family whose q/k/v layout is unknown
        out.append(tuple(receiver))
    if not out:
        raise PipatchError("receivers is empty: pass 'logits' or at least one ('head', layer, head, 'q'|'k'|'v')")
    return out


# --------------------------------------------------------------------------------------------
# The declaration
# --------------------------------------------------------------------------------------------

_HEAD_TEXT = re.compile(r"^(\d+)\.(\d+)$")
_MLP_TEXT = re.compile(r"^mlp(?:\.?(\d+))?$", re.IGNORECASE)  # no layer: every MLP
_RECEIVER_TEXT = re.compile(r"^(\d+)\.(\d+)\.([qkv])$", re.IGNORECASE)


def parse_sender(value: str) -> tuple | str | None:
    """``12.2`` (head 2 of layer 12), ``mlp12`` (layer 12's MLP), ``all`` (sweep every head) or ``mlp``
    (sweep every MLP)."""
    value = value.strip()
    if value.lower() == "all":
        return None
    if match := _HEAD_TEXT.match(value):
        return ("head", int(match[1]), int(match[2]))
    if match := _MLP_TEXT.match(value):
        return ("mlp", int(match[1])) if match[1] else "mlp"
    raise PipatchError(f"{value!r} is not a sender: use LAYER.HEAD (e.g. 12.2), mlpLAYER (e.g. mlp12), all or mlp")


def parse_receivers(value: str) -> str | list[tuple]:
    """``logits``, or comma-separated ``LAYER.HEAD.q|k|v``: ``13.4.q,14.1.k``."""
    value = value.strip()
    if value.lower() == LOGITS_NAME:
        return LOGITS_NAME
    out = []
    for part in (p.strip() for p in value.split(",")):
        match = _RECEIVER_TEXT.match(part)
        if not match:
            raise PipatchError(f"{part!r} is not a receiver: use logits or LAYER.HEAD.q|k|v such as 13.4.q,14.1.k")
        out.append(("head", int(match[1]), int(match[2]), match[3].lower()))
    return out


def _title(meta: dict) -> str:
    receivers = meta.get("receivers", "logits")
    to = receivers if isinstance(receivers, str) else ", ".join(".".join(map(str, r[1:])) for r in receivers)
    return pair_title("Path patching", meta, f"{meta.get('direction', 'denoise')}, {meta.get('site', 'head')} → {to}")


DECLARATION = Experiment(
    name="path_patch", kind="path", noun="path patching",
    summary="Path patching: a sender's effect through the receivers only, everything else frozen.",
    planner=plan_path_patch, prompts=PAIR, title=_title,
    params=(
        *PAIR_PARAMS,
        Param("sender", None, "None / 'head': sweep every head (grid layers × heads); 'mlp': every MLP (layers × 1); "
              "('head', layer, h) or ('mlp', layer): one cell", "Any", parse=parse_sender, shown="all",
              flag_help="as a flag: LAYER.HEAD (12.2), mlpLAYER (mlp12), all or mlp"),
        Param("receivers", "logits", "'logits' (the direct path) or a list of ('head', layer, h, 'q' | 'k' | 'v'): "
              "that head's columns of the query, key or value projection; senders sit below the first receiver",
              "str | Sequence[Sequence]", parse=parse_receivers,
              flag_help="as a flag: logits or LAYER.HEAD.q|k|v, comma-separated (13.4.q,14.1.k)"),
        METRIC,
        Param("direction", "denoise", "denoise (base corrupt, donor clean) or noise (base clean, donor corrupt)",
              "str"),
        BATCH_SIZE, FAST,
    ),
    example='%%path_patch --answer " Paris" --foil " Rome" --sender 12.2 -o path\n'
            "clean: The Eiffel Tower is in the city of\n"
            "corrupt: The Colosseum is in the city of",
    doc="""
    See :mod:`pipatch._experiments.paths` for the three runs and what they isolate.

    Returns
    -------
    Result
        ``kind="path"``; ``raw[view]`` ([1, senders' layers, heads]) holds the path-patched
        metric and ``result.grid`` its normalized recovery.

    Examples
    --------
    >>> pipatch.path_patch(model, clean="The Eiffel Tower is in the city of",
    ...                    corrupt="The Colosseum is in the city of", answer=" Paris", foil=" Rome",
    ...                    sender=("head", 12, 2)).grid
    """,
    code=path_code, code_inputs=lambda meta: _code.pair_inputs(meta, positions=False),
)
