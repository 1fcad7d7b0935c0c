"""What a program's request holds, declared as typed fields: the one source of its wire format.

A program's per-request data is a dataclass (:attr:`~._program.Program.inputs`) whose fields
say what each is, in plain type hints: ``torch.Tensor``, ``int``, ``float``, ``bool``, ``str``,
pipatch's :class:`~pipatch._model.cells.Metric`, :class:`~pipatch._model.cells.Op` and
:class:`~pipatch._model.sites.Site`, a named tuple or dataclass of such fields, ``list[...]``,
``tuple[...]`` and ``... | None`` of them. A few markers, in ``typing.Annotated``, say more where
a server checks more (:data:`TokenIds`, :data:`Layer`, :data:`Position`, :class:`Floats`), and
:func:`per_row` marks a field that holds one item per row of the runs.

Every request has one field ``ids`` (:data:`TokenIds`: ``[rows, T]`` token ids): the runs of
the program's trace, one per row. A backend whose requests are one sequence each (vLLM,
``pipatch serve``) runs a request row by row (:func:`rows_apart`: ``ids`` and the
:func:`per_row` fields cut to each row, the other fields as they are) where the program treats
its rows apart (:attr:`~._program.Needs.each_row`).

The served backend encodes a request from these declarations and ``pipatch serve`` decodes and
checks it from its own copy of them (:mod:`pipatch._backends._wire`): what a program takes is
said once, here, and read by every transport.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any

import torch

__all__ = ["TokenIds", "Layer", "Position", "Floats", "per_row", "is_per_row", "declared", "rows_of", "rows_apart",
           "moved", "on_device", "check_inputs"]


@dataclass(frozen=True)
class _TokenIds:
    """``[rows, T]`` token ids (int64), each row one run of the trace: within the vocabulary."""


@dataclass(frozen=True)
class _Layer:
    """A block's index: ``0 … n_layers − 1``."""


@dataclass(frozen=True)
class _Position:
    """A position in a run, from either end: ``−T … T − 1``."""


@dataclass(frozen=True)
class Floats:
    """A float tensor of ``dims`` dimensions (any, where empty), the model's width last where
    ``width``; ``masks``: bool tensors too (a circuit's kept edges)."""

    dims: tuple[int, ...] = ()
    width: bool = False
    masks: bool = False


#: The runs of a program's trace: ``[rows, T]`` token ids, one run per row.
TokenIds = Annotated[torch.Tensor, _TokenIds()]
#: A block's index.
Layer = Annotated[int, _Layer()]
#: A position in a run (negative: from its end).
Position = Annotated[int, _Position()]

_PER_ROW = "pipatch_per_row"


def per_row(**kwargs: Any) -> Any:
    """A dataclass field holding one item per row of ``ids`` (a list: row ``i``'s is item ``i``;
    or a tensor: row ``i``'s is its row ``i``)."""
    return field(metadata={_PER_ROW: True}, **kwargs)


def is_per_row(item: dataclasses.Field) -> bool:
    return bool(item.metadata.get(_PER_ROW))


def declared(cls: type) -> dict[str, Any]:
    """Each field of ``cls`` (a dataclass or named tuple) by name, with its declared type
    (``Annotated`` markers kept). (Not memoized: a memo is no function, and NDIF's requests
    carry pipatch's functions by value, which a memo would not let them.)"""
    hints = typing.get_type_hints(cls, include_extras=True)
    if dataclasses.is_dataclass(cls):
        return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}
    return {name: hints[name] for name in cls._fields}  # a named tuple


def check_inputs(cls: type) -> None:
    """Refuse (``TypeError``) a request type that is no dataclass with an ``ids`` field of
    :data:`TokenIds`, or whose per-row fields are not lists: said once, when a program is made."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"a program's inputs are a dataclass, not {cls!r}")
    hints = declared(cls)
    if hints.get("ids") != TokenIds:
        raise TypeError(f"{cls.__name__} needs a field ids: TokenIds (the runs of the trace, one per row)")
    for item in dataclasses.fields(cls):
        if is_per_row(item) and typing.get_origin(_bare(hints[item.name])) is not list and \
                _bare(hints[item.name]) is not torch.Tensor:
            raise TypeError(f"{cls.__name__}.{item.name} is per row, so a list or a tensor (one item or row per row)")


def _bare(hint: Any) -> Any:
    """``hint`` without its ``Annotated`` markers."""
    return typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint


def rows_of(request: Any) -> int:
    """The runs in ``request``: the rows of its ``ids``."""
    return int(request.ids.shape[0])


def rows_apart(request: Any) -> list[Any]:
    """``request`` as one request per row: ``ids`` and each :func:`per_row` field cut to the
    row, every other field as it is."""
    each = [item.name for item in dataclasses.fields(request) if is_per_row(item)]

    def cut(value: Any, i: int) -> Any:
        return value[i : i + 1] if isinstance(value, torch.Tensor) else [value[i]]

    return [dataclasses.replace(request, ids=request.ids[i : i + 1], **{name: cut(getattr(request, name), i) for name in each})
            for i in range(rows_of(request))]


def on_device(value: Any, device: Any) -> Any:
    """``value``'s tensors on ``device``, through lists, tuples (named too) and dicts; the rest
    as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(on_device(v, device) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: on_device(v, device) for k, v in value.items()}
    return value


def moved(request: Any, device: Any) -> Any:
    """``request`` with every tensor among its fields (:func:`on_device`) on ``device``: where
    the trace that reads it runs."""
    return dataclasses.replace(request, **{item.name: on_device(getattr(request, item.name), device)
                                          for item in dataclasses.fields(request) if item.init})
