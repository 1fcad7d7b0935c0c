"""The four experiments as Python functions, and the planners behind them.

Each public function is ``plan_<name>(model, ...).run(on_row=..., stop=...)``: the planner
checks the inputs (one :class:`PipatchError` line each), runs the baselines and returns a
:class:`~pipatch._engine.Plan`; running it fills the :class:`~pipatch.Result`. The magics, the
CLI and ``PatchGrid.run`` call the same planners through :mod:`pipatch._registry`.

``model`` is what a researcher naturally has at hand: a model from :func:`pipatch.load_model`,
an nnsight model built by hand, or anything ``load_model`` takes (``None`` for the embedded
default, a hub id, a local folder), loaded once per process. A list of prompts (or of
clean/corrupt pairs) makes a dataset (:mod:`pipatch._protocols.dataset`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from ._backends import backend_for
from ._engine import Plan
from ._load import shared_model
from ._models import PipatchError
from ._protocols.attribution import plan_attribute as _plan_attribute
from ._protocols.dataset import per_prompt, plan_dataset
from ._protocols.patching import plan_patch as _plan_patch
from ._protocols.paths import plan_path_patch as _plan_path_patch
from ._protocols.tracing import plan_trace as _plan_trace
from ._result import Result

__all__ = ["trace", "patch", "attribute", "path_patch", "plan_trace", "plan_patch", "plan_attribute",
           "plan_path_patch", "backend_of"]

OnRow = Callable[[Result, str, int], None]


def backend_of(model: Any) -> Any:
    """The backend for ``model``: a loaded model or backend as is; ``None``, a name or a folder
    through :func:`pipatch._load.shared_model` (each loaded once per process)."""
    if model is None or isinstance(model, (str, os.PathLike)):
        model = shared_model(None if model is None else os.fspath(model))
    elif not hasattr(model, "trace") and not hasattr(model, "run"):
        raise PipatchError(
            f"model must be a loaded model (pipatch.load_model(...)) or a hub id / local folder, "
            f"got {type(model).__name__}"
        )
    return backend_for(model)


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def _pairs(clean: Any, corrupt: Any) -> int | None:
    """How many clean/corrupt pairs (``None``: one pair, not a list)."""
    if not _is_list(clean) and not _is_list(corrupt):
        return None
    if not (_is_list(clean) and _is_list(corrupt) and len(clean) == len(corrupt)):
        raise PipatchError("for many prompts pass clean and corrupt as lists of the same length (pairs in order)")
    return len(clean)


def _pair_items(n: int, clean, corrupt, answer, foil, options: dict) -> list[dict]:
    answers, foils = per_prompt(answer, n, "answer"), per_prompt(foil, n, "foil")
    return [{"clean": c, "corrupt": x, "answer": a, "foil": f, **options}
            for c, x, a, f in zip(clean, corrupt, answers, foils)]


# --------------------------------------------------------------------------------------------
# Planners
# --------------------------------------------------------------------------------------------


def plan_trace(model: Any, prompt: str | Sequence[str], *, subject: Any, answer: Any, **options: Any) -> Plan:
    """The :class:`Plan` of :func:`trace` (same parameters, without ``on_row`` / ``stop``)."""
    backend = backend_of(model)
    if not _is_list(prompt):
        return _plan_trace(backend, prompt, subject=subject, answer=answer, **options)
    subjects, answers = per_prompt(subject, len(prompt), "subject"), per_prompt(answer, len(prompt), "answer")
    return plan_dataset(backend, _plan_trace, [{"prompt": p, "subject": s, "answer": a, **options}
                                               for p, s, a in zip(prompt, subjects, answers)])


def plan_patch(model: Any, *, clean: Any, corrupt: Any, answer: Any, foil: Any = None, **options: Any) -> Plan:
    """The :class:`Plan` of :func:`patch` (same parameters, without ``on_row`` / ``stop``)."""
    backend = backend_of(model)
    n = _pairs(clean, corrupt)
    if n is None:
        return _plan_patch(backend, clean=clean, corrupt=corrupt, answer=answer, foil=foil, **options)
    return plan_dataset(backend, _plan_patch, _pair_items(n, clean, corrupt, answer, foil, options))


def plan_attribute(model: Any, *, clean: Any, corrupt: Any, answer: Any, foil: Any = None, **options: Any) -> Plan:
    """The :class:`Plan` of :func:`attribute` (same parameters, without ``on_row`` / ``stop``)."""
    backend = backend_of(model)
    n = _pairs(clean, corrupt)
    if n is None:
        return _plan_attribute(backend, clean=clean, corrupt=corrupt, answer=answer, foil=foil, **options)
    if options.get("verify"):
        raise PipatchError("verify checks cells of one clean/corrupt pair: pass one pair, or verify=0 for a list")
    return plan_dataset(backend, _plan_attribute, _pair_items(n, clean, corrupt, answer, foil, options))


def plan_path_patch(model: Any, *, clean: Any, corrupt: Any, answer: Any, foil: Any = None, **options: Any) -> Plan:
    """The :class:`Plan` of :func:`path_patch` (same parameters, without ``on_row`` / ``stop``)."""
    backend = backend_of(model)
    n = _pairs(clean, corrupt)
    if n is None:
        return _plan_path_patch(backend, clean=clean, corrupt=corrupt, answer=answer, foil=foil, **options)
    return plan_dataset(backend, _plan_path_patch, _pair_items(n, clean, corrupt, answer, foil, options))


# --------------------------------------------------------------------------------------------
# The public functions
# --------------------------------------------------------------------------------------------


def trace(
    model: Any,
    prompt: str | Sequence[str],
    *,
    subject: str | Sequence[int] | Sequence[Any],
    answer: str | Sequence[str],
    seeds: int = 10,
    scale: float | str = "auto",
    kind: str | Sequence[str] = "resid",
    window: int = 10,
    metric: str = "prob",
    control: bool = False,
    batch_size: int | None = None,
    fast: bool = True,
    on_row: OnRow | None = None,
    stop: Any = None,
) -> Result:
    """Causal tracing of ``answer`` on ``prompt`` with the ``subject`` noised (ROME).

    Parameters
    ----------
    model
        A loaded model (:func:`pipatch.load_model`, or an nnsight model), or anything
        ``load_model`` takes: ``None`` (the embedded default), a hub id, a local folder.
    prompt
        The text whose next token should be ``answer``; or a list of prompts, averaged over
        named positions (see :mod:`pipatch._protocols.dataset`), with ``subject`` and
        ``answer`` given once or once per prompt.
    subject
        The subject's text as it appears in ``prompt`` (every token overlapping it is noised,
        BPE pieces included) or a list of token indices.
    answer
        The text that follows the prompt: one token (``" Paris"``) or several (``" New York"``,
        read teacher-forced: P of the whole sequence, the sum of its tokens' log-probabilities).
    seeds
        Number of noise draws; recovery is averaged over them.
    scale
        Noise scale in units of σ, or ``"auto"`` (see :mod:`pipatch._protocols.tracing`).
    kind
        ``"resid"``, ``"mlp"``, ``"attn"`` or several (``"resid,mlp,attn"``): one grid each.
    window
        Layers restored together for ``mlp`` / ``attn``.
    metric
        ``"prob"`` (ROME) or ``"logprob"``.
    control
        Restore from the corrupt run's own states (must give recovery 0 everywhere).
    batch_size
        Invokes per trace (default: sized to about 4,096 token positions per batch).
    fast
        Use the engine's exact shortcuts (skip cells that cannot change anything, reuse the
        base run below the patch, unembed one position). ``False`` runs every cell in full.
    on_row
        Called as ``on_row(result, view, layer)`` after each finished row.
    stop
        A ``threading.Event`` or function; when set the sweep stops after the current batch.

    Returns
    -------
    Result
        ``result.grid`` is tensor[layers, tokens] of mean normalized recovery.
    """
    return plan_trace(model, prompt, subject=subject, answer=answer, seeds=seeds, scale=scale, kind=kind,
                      window=window, metric=metric, control=control, batch_size=batch_size,
                      fast=fast).run(on_row=on_row, stop=stop)


def patch(
    model: Any,
    *,
    clean: str | Sequence[str],
    corrupt: str | Sequence[str],
    answer: str | Sequence[str],
    foil: str | Sequence[str] | None = None,
    site: str = "resid",
    metric: str = "logit_diff",
    direction: str = "denoise",
    positions: Sequence[int] | None = None,
    mean_prompts: Sequence[str] | None = None,
    batch_size: int | None = None,
    fast: bool = True,
    on_row: OnRow | None = None,
    stop: Any = None,
) -> Result:
    """Activation patching of ``site`` at every layer × position (or × head).

    Parameters
    ----------
    model
        As for :func:`trace`.
    clean, corrupt
        Prompts of equal token length; or two lists of such prompts (pairs, in order),
        averaged over named positions, with ``answer`` / ``foil`` given once or once per pair.
    answer, foil
        One token each (``" Paris"``, ``" Rome"``) or several (``" New York"``, read
        teacher-forced; ``logit_diff`` then becomes the sequences' log-probability difference,
        ``"logprob_diff"``). ``foil`` is required for ``logit_diff`` and ``logprob_diff``.
    site
        ``"resid"``, ``"attn"``, ``"mlp"`` or ``"head"``.
    metric
        ``"logit_diff"``, ``"prob"``, ``"logprob"`` or ``"logprob_diff"`` (log P(answer) − log
        P(foil), for a dataset mixing one-token and multi-token answers).
    direction
        ``"denoise"``, ``"noise"``, ``"zero"`` or ``"mean"`` (see
        :mod:`pipatch._protocols.patching`).
    positions
        Positions to sweep (negative indices allowed); default all. For ``site="head"`` the
        positions at which each head is patched.
    mean_prompts
        For ``direction="mean"``: prompts of the same token length whose activations are
        averaged (default: the clean and corrupt prompts).
    batch_size, fast, on_row, stop
        As for :func:`trace`.

    Returns
    -------
    Result
        ``result.grid``: tensor[layers, positions] (or [layers, heads]) of normalized recovery.
    """
    return plan_patch(model, clean=clean, corrupt=corrupt, answer=answer, foil=foil, site=site, metric=metric,
                      direction=direction, positions=positions, mean_prompts=mean_prompts,
                      batch_size=batch_size, fast=fast).run(on_row=on_row, stop=stop)


def attribute(
    model: Any,
    *,
    clean: str | Sequence[str],
    corrupt: str | Sequence[str],
    answer: str | Sequence[str],
    foil: str | Sequence[str] | None = None,
    site: str = "resid",
    metric: str = "logit_diff",
    verify: int = 0,
    positions: Sequence[int] | None = None,
    batch_size: int | None = None,
    on_row: OnRow | None = None,
    stop: Any = None,
) -> Result:
    """Estimate every cell of a denoising patching grid from two forwards and one backward.

    See :mod:`pipatch._protocols.attribution` for the method and its limits.

    Parameters
    ----------
    model, clean, corrupt, answer, foil, metric, batch_size, on_row, stop
        As for :func:`patch` (lists of pairs make a dataset; ``verify`` needs one pair).
    site
        ``"resid"``, ``"attn"``, ``"mlp"`` or ``"head"``; the gradient is taken at this site.
    verify
        Run real patches for the ``verify`` cells with the largest ``|estimated change|`` and
        keep both numbers. ``0``: estimate only.
    positions
        The positions (columns) to estimate, default all; ``site="head"``: the positions
        summed over for each head.

    Returns
    -------
    Result
        ``kind="attribution"``; ``raw[site]`` is tensor[1, layers, columns] of
        ``corrupt metric + estimated change`` and ``result.grid`` its normalized recovery,
        comparable cell by cell with ``pipatch.patch(..., site=site).grid``. With
        ``verify=k``: ``meta["verified"][site]`` (a [layers, columns] 0/1 mask),
        ``meta["verified_values"]`` (``{"layer", "col", "estimate", "actual"}`` in raw metric
        units, largest estimated effect first) and ``meta["agreement"]`` (``spearman``,
        ``max_abs_error``, ``max_abs_error_recovery``, ``n``).

    Examples
    --------
    >>> r = pipatch.attribute(model, clean="The Eiffel Tower is in the city of",
    ...                       corrupt="The Colosseum is in the city of",
    ...                       answer=" Paris", foil=" Rome", site="head", verify=5)
    >>> r.meta["agreement"]
    """
    return plan_attribute(model, clean=clean, corrupt=corrupt, answer=answer, foil=foil, site=site, metric=metric,
                          verify=verify, positions=positions, batch_size=batch_size).run(on_row=on_row, stop=stop)


def path_patch(
    model: Any,
    *,
    clean: str | Sequence[str],
    corrupt: str | Sequence[str],
    answer: str | Sequence[str],
    foil: str | Sequence[str] | None = None,
    sender: Any = None,
    receivers: str | Sequence[Sequence] = "logits",
    metric: str = "logit_diff",
    direction: str = "denoise",
    batch_size: int | None = None,
    fast: bool = True,
    on_row: OnRow | None = None,
    stop: Any = None,
) -> Result:
    """Path patching: each sender's effect through ``receivers`` only, everything else frozen.

    See :mod:`pipatch._protocols.paths` for the three runs and what they isolate.

    Parameters
    ----------
    model, clean, corrupt, answer, foil, metric, batch_size, fast, on_row, stop
        As for :func:`patch`.
    sender
        ``None`` / ``"head"``: sweep every head (grid layers × heads); ``"mlp"``: every MLP
        (layers × 1); ``("head", layer, h)`` or ``("mlp", layer)``: one cell.
    receivers
        ``"logits"`` (the direct path) or a list of ``("head", layer, h, "q" | "k" | "v")``:
        that head's columns of the query, key or value projection (separate or fused; the
        adapter knows each layout). Senders must sit below the first receiver's layer.
    direction
        ``"denoise"`` (base corrupt, donor clean) or ``"noise"`` (base clean, donor corrupt).

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
    """
    return plan_path_patch(model, clean=clean, corrupt=corrupt, answer=answer, foil=foil, sender=sender,
                           receivers=receivers, metric=metric, direction=direction, batch_size=batch_size,
                           fast=fast).run(on_row=on_row, stop=stop)
