"""Programs by name: what a served client sends ``pipatch serve``, and how the server checks it.

A served client (:mod:`.served`) sends no code. A request names a program and carries its
jobs' *data*: per invoke, the token ids and the program's inputs, the blocks its invokes skip,
and the pipatch version and :data:`PROGRAM_FORMAT` it was written with.

* **A program with declared inputs** (every program of :data:`pipatch._programs.PROGRAMS` that
  has :attr:`~pipatch._programs.Program.inputs`, and those of the modules the server's
  operator names, ``pipatch serve --programs MODULE``): the request names it and its version,
  and each invoke carries one row of its request, every field encoded by its declared type
  (:func:`encode_typed`) and decoded and checked by the server from its own copy of the
  declaration (:func:`decode_typed`): there is no table of argument kinds to keep beside the
  program. The server runs it as the vLLM backend does in process, through the one generic
  request body (:func:`~._vllm_worker.program_request`).
* **The vLLM backend's own request bodies** (:data:`PROGRAMS`: the capture, the patched run
  and its head-only shortcut, which carry the engine's layout of a sweep — a skip's states, a
  run's inputs apart): named by function, their arguments checked by kind (:data:`_KINDS`).

The server checks every field (:func:`decode`: the version, the program's name, each field's
type, token ids within the vocabulary, layers within the model, sites among the model's,
tensor widths) before anything runs, and then builds the nnsight trace itself (:func:`build`),
as the vLLM backend builds it in process.

The wire format is data only: ``torch.save`` of plain containers (dicts, lists, tuples,
strings, numbers, booleans, ``None``) and tensors, read by ``torch.load`` with ``weights_only=True``
and no extra allowed classes, so loading a request builds no object the sender names. Sites
travel by name (``"resid"``, ``"q_proj"``), an SAE's latent site as data (its description and
tensors, checked against the model and rebuilt with pipatch's own classes: :mod:`._served_latents`);
pipatch's own types (:class:`~pipatch._model.cells.Metric`, :class:`~pipatch._model.cells.Op`, a declared
named tuple or dataclass such as :class:`~pipatch._programs.circuit.Baselines`) are rebuilt
from their fields on the server. The adapter (where the model keeps its modules) is the
server's own: a request never names a module.

Failures: a request the server cannot read or that fails a check raises :class:`BadRequest`,
one line naming the field and the fix (``pipatch serve`` answers it as HTTP 400; over the
server's invoke or prompt-token limit, :class:`OverLimit`, HTTP 413 naming the flag); a site
that has no name here and is no SAE's (a site of your own) is refused on the client, in one
line, before anything is sent.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._model.cells import Metric, Op
from .._model.features.site import LatentSite
from .._model.models import Adapter, PipatchError
from .._model.sites import EMBED, LOGITS, MLP_IN, SITES, Site, projection
from .._programs import PROGRAMS as PROGRAMS_BY_NAME
from .._programs._inputs import Floats, _Layer, _Position, _TokenIds, declared
from ._served_latents import decode_latent, encode_latent
from ._vllm_engine import INVOKES_PER_REQUEST, SAMPLING
from ._vllm_worker import (
    capture_request,
    head_request,
    patch_request,
    program_request,
)
from ._wire import Limits

__all__ = ["PROGRAM_FORMAT", "PROGRAMS", "BadRequest", "OverLimit", "Bounds", "ProgramRequest", "encode", "decode", "build",
           "check_versions", "pipatch_version", "sites_of"]

#: The version of this request format: a client and a server of one pipatch version share it;
#: it changes whenever what a request carries does.
PROGRAM_FORMAT = 3

#: Metric names a request may carry (:class:`~pipatch._model.cells.Metric`).
_METRIC_NAMES = ("logit_diff", "prob", "logprob", "logprob_diff", "rank")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class BadRequest(PipatchError):
    """A program request the server refuses before anything runs (HTTP 400, one line)."""


class OverLimit(BadRequest):
    """A request over one of the server's limits (HTTP 413, one line naming its flag)."""


@dataclass(frozen=True)
class Bounds:
    """What the server checks a request's values against: its model's sizes and sites."""

    vocab: int
    n_layers: int
    d_model: int
    max_len: int  # the engine's context: a prompt and the one token generated after it
    sites: dict[str, Site]
    limits: Limits | None = None  # the server's per-request limits (``pipatch serve --max-...``)
    adapter: Adapter | None = None  # the model's (a latent site's places are checked against it)

    @classmethod
    def of(cls, adapter: Adapter, vocab: int, max_len: int, limits: Limits | None = None) -> Bounds:
        return cls(int(vocab), adapter.n_layers, adapter.d_model, int(max_len), sites_of(adapter), limits, adapter)


@dataclass
class ProgramRequest:
    """A checked request: the program's name and body, the blocks its invokes skip, and per
    invoke ``(token ids, arguments after the adapter)``."""

    program: str
    body: Callable[..., Any]
    skip: int
    jobs: list[tuple[list[int], tuple]]


def sites_of(adapter: Adapter) -> dict[str, Site]:
    """The sites a request may name, by name: the grid's, the embedding, the MLP's input, the
    logits' stream, and the model's query/key/value projections."""
    named = {site.name: site for site in (*SITES.values(), EMBED, MLP_IN, LOGITS)}
    named.update({module: projection(module, order) for order, module in enumerate(adapter.qkv)})
    return named


@functools.cache  # read from the installed metadata once: every request carries it
def pipatch_version() -> str:
    """This pipatch's installed version ("" where it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pipatch")
    except PackageNotFoundError:
        return ""


def check_versions(info: dict[str, Any], url: str) -> None:
    """One line where the server at ``url`` (its ``info``) runs another pipatch version or
    program format than this client."""
    mine, theirs = (pipatch_version(), PROGRAM_FORMAT), (info.get("pipatch"), info.get("program_format"))
    if mine != theirs:
        raise PipatchError(f"the server at {url} runs pipatch {theirs[0] or '?'} (program format {theirs[1] or '?'}), "
                           f"this client pipatch {mine[0]} (program format {mine[1]}): install the same pipatch "
                           "version on both sides")


# --------------------------------------------------------------------------------------------
# The arguments: each kind's encoding (client) and checked decoding (server)
# --------------------------------------------------------------------------------------------


def _bad(what: str, value: Any, want: str) -> BadRequest:
    shown = type(value).__name__ if not isinstance(value, (int, float, str, bool, type(None))) else repr(value)[:40]
    return BadRequest(f"{what} is {shown}, not {want}: send requests from pipatch's served backend of this version")


def _int(value: Any, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value < high:
        raise _bad(what, value, f"a whole number in [{low}, {high})")
    return value


def _bool(value: Any, what: str) -> bool:
    if type(value) is not bool:
        raise _bad(what, value, "True or False")
    return value


def _list(value: Any, what: str, most: int) -> list:
    if type(value) is not list:
        raise _bad(what, value, f"a list of at most {most}")
    if len(value) > most:
        raise BadRequest(f"{what} has {len(value)} items, more than {most}: send smaller requests")
    return value


def _tensor(value: Any, what: str, bounds: Bounds, *, dims: tuple[int, ...], width: bool = False,
            dtypes: tuple[torch.dtype, ...] = _FLOATS) -> torch.Tensor:
    """A dense CPU tensor of one of ``dtypes`` with a dimension count in ``dims`` (and, with
    ``width``, the model's width last)."""
    if (not isinstance(value, torch.Tensor) or type(value) is not torch.Tensor or value.layout != torch.strided
            or value.dtype not in dtypes or value.dim() not in dims):
        raise _bad(what, value, f"a dense {'/'.join(str(d).replace('torch.', '') for d in dtypes)} tensor of "
                                f"{' or '.join(map(str, dims))} dimensions")
    if width and value.shape[-1] != bounds.d_model:
        raise BadRequest(f"{what} is {value.shape[-1]} wide, not the model's {bounds.d_model}: send requests for "
                         "the model this server serves")
    return value


def _token_ids(value: Any, what: str, bounds: Bounds, most: int) -> list[int]:
    ids = _list(value, what, most)
    if not ids or any(type(i) is not int or not 0 <= i < bounds.vocab for i in ids):
        raise BadRequest(f"{what} must be 1 to {most} token ids in [0, {bounds.vocab}) (this model's vocabulary): "
                         "tokenize with the served model's tokenizer")
    return ids


def _encode_metric(metric: Metric) -> dict:
    return {"name": metric.name, "answer": list(metric.answer), "foil": None if metric.foil is None else list(metric.foil)}


def _decode_metric(value: Any, what: str, bounds: Bounds) -> Metric:
    if type(value) is not dict or set(value) != {"name", "answer", "foil"}:
        raise _bad(what, value, "a metric {name, answer, foil}")
    if value["name"] not in _METRIC_NAMES:
        raise BadRequest(f"{what}.name {str(value['name'])[:40]!r} is no metric: use one of {', '.join(_METRIC_NAMES)}")
    foil = None if value["foil"] is None else _token_ids(value["foil"], f"{what}.foil", bounds, bounds.max_len)
    return Metric(value["name"], tuple(_token_ids(value["answer"], f"{what}.answer", bounds, bounds.max_len)),
                  None if foil is None else tuple(foil))


def _encode_site(site: Site, sites: dict[str, Site]) -> str | dict:
    if isinstance(site, LatentSite):
        return encode_latent(site)
    if sites.get(site.name) != site:
        raise PipatchError(f"site {site.name!r} ({type(site).__name__}) has no name a pipatch server knows: a served "
                           "model patches the built-in sites (resid, attn, mlp, head, q/k/v) and SAE latents; load the model "
                           "in this process (backend='vllm' or 'transformers') for this site")
    return site.name


def _decode_site(value: Any, what: str, bounds: Bounds) -> Site:
    if type(value) is dict and bounds.adapter is not None:
        try:
            return decode_latent(value, bounds.adapter, what)
        except PipatchError as refused:
            raise BadRequest(str(refused)) from None
    if type(value) is not str or value not in bounds.sites:
        raise BadRequest(f"{what} {str(value)[:40]!r} is no site of this model: use one of {', '.join(bounds.sites)}")
    return bounds.sites[value]


def _encode_index_part(part: Any) -> tuple:
    if isinstance(part, slice):
        return ("slice", part.start, part.stop, part.step)
    if isinstance(part, torch.Tensor):
        return ("tensor", part.detach().cpu())
    if isinstance(part, (list, tuple)):
        return ("list" if isinstance(part, list) else "tuple", [int(i) for i in part])
    return ("int", int(part))


def _decode_index_part(value: Any, what: str, bounds: Bounds) -> Any:
    if type(value) is not tuple or not value or value[0] not in ("slice", "tensor", "list", "tuple", "int"):
        raise _bad(what, value, "an index part ('int' | 'slice' | 'list' | 'tuple' | 'tensor', ...)")
    kind, *rest = value
    reach = (-bounds.max_len, bounds.max_len + 1)  # positions or columns, either end
    if kind == "slice" and len(rest) == 3:
        for i, end in enumerate(rest):
            if end is not None:
                _int(end, f"{what} slice end {i}", -2**31, 2**31)
        if rest[2] is not None and rest[2] < 1:
            raise BadRequest(f"{what} has slice step {rest[2]}: a step is 1 or more")
        return slice(*rest)
    if kind == "tensor" and len(rest) == 1:
        return _tensor(rest[0], what, bounds, dims=(1, 2, 3, 4), dtypes=(torch.bool, torch.int64))
    if kind in ("list", "tuple") and len(rest) == 1:
        items = [_int(i, f"{what} item", *reach) for i in _list(rest[0], what, bounds.max_len)]
        return items if kind == "list" else tuple(items)
    if kind == "int" and len(rest) == 1:
        return _int(rest[0], what, -2**31, 2**31)
    raise _bad(what, value, f"a well-formed {kind!r} index part")


def _encode_ops(ops: list[Op], sites: dict[str, Site]) -> list:
    return [{"site": _encode_site(op.site, sites), "layer": op.layer, "index": [_encode_index_part(p) for p in op.index],
             "value": op.value, "add": op.add} for op in ops]


def _decode_ops(value: Any, what: str, bounds: Bounds) -> list[Op]:
    ops = []
    for i, op in enumerate(_list(value, what, 4096)):
        where = f"{what}[{i}]"
        if type(op) is not dict or set(op) != {"site", "layer", "index", "value", "add"}:
            raise _bad(where, op, "an op {site, layer, index, value, add}")
        parts = _list(op["index"], f"{where}.index", 4)
        ops.append(Op(_decode_site(op["site"], f"{where}.site", bounds),
                      _int(op["layer"], f"{where}.layer", 0, bounds.n_layers),
                      tuple(_decode_index_part(p, f"{where}.index[{j}]", bounds) for j, p in enumerate(parts)),
                      None if op["value"] is None else _tensor(op["value"], f"{where}.value", bounds, dims=(1, 2, 3, 4)),
                      _bool(op["add"], f"{where}.add")))
    return ops


def _encode_sites(sites: list[Site] | None, table: dict[str, Site]) -> list | None:
    return None if sites is None else [_encode_site(site, table) for site in sites]


def _decode_sites(value: Any, what: str, bounds: Bounds) -> list[Site] | None:
    if value is None:
        return None
    return [_decode_site(name, f"{what}[{i}]", bounds) for i, name in enumerate(_list(value, what, len(bounds.sites)))]


def _encode_skip(skip: tuple | None) -> dict | None:
    if skip is None:
        return None
    below, state, pairs = skip
    return {"below": below, "state": state, "pairs": pairs}


def _decode_skip(value: Any, what: str, bounds: Bounds) -> tuple | None:
    if value is None:
        return None
    if type(value) is not dict or set(value) != {"below", "state", "pairs"}:
        raise _bad(what, value, "a skip {below, state, pairs}")
    if value["pairs"] is not None:
        _bool(value["pairs"], f"{what}.pairs")
    return (_int(value["below"], f"{what}.below", 1, bounds.n_layers + 1),
            _tensor(value["state"], f"{what}.state", bounds, dims=(2,), width=True), value["pairs"])


# --------------------------------------------------------------------------------------------
# A program's declared inputs: each field encoded and checked by its declared type
# --------------------------------------------------------------------------------------------

#: Items a list of a request may hold (a batch's ops, a site list, a mask's rows...).
_MOST_ITEMS = 4096


def _unannotated(hint: Any) -> tuple[Any, tuple]:
    """``hint`` without ``Annotated``, and its markers."""
    if typing.get_origin(hint) is typing.Annotated:
        base, *marks = typing.get_args(hint)
        return base, tuple(marks)
    return hint, ()


def _optional(hint: Any) -> Any | None:
    """``X`` for ``X | None`` (``Optional[X]``), else ``None``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0]
    return None


def _fields_of(base: Any) -> dict[str, Any] | None:
    """The declared fields of a dataclass or named tuple type, else ``None``."""
    if isinstance(base, type) and (dataclasses.is_dataclass(base) or (issubclass(base, tuple) and hasattr(base, "_fields"))):
        return declared(base)
    return None


def encode_typed(value: Any, hint: Any, sites: dict[str, Site]) -> Any:
    """``value`` as plain data for the wire, by its declared type ``hint``
    (:mod:`pipatch._programs._inputs`): pipatch's types as their fields, sites by name (an
    SAE's latent site as its description), tensors on the CPU."""
    base, _ = _unannotated(hint)
    inner = _optional(base)
    if inner is not None:
        return None if value is None else encode_typed(value, inner, sites)
    origin = typing.get_origin(base)
    if base is torch.Tensor:
        return value.detach().cpu()
    if base in (int, float, bool, str):
        return value
    if base is Metric:
        return _encode_metric(value)
    if base is Op:
        return _encode_ops([value], sites)[0]
    if isinstance(base, type) and issubclass(base, Site):
        return _encode_site(value, sites)
    if origin in (list, Sequence):
        (item,) = typing.get_args(base)
        return [encode_typed(v, item, sites) for v in value]
    if origin is tuple:
        args = typing.get_args(base)
        items = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        return tuple(encode_typed(v, h, sites) for v, h in zip(value, items, strict=True))
    fields = _fields_of(base)
    if fields is not None:
        return {name: encode_typed(getattr(value, name), h, sites) for name, h in fields.items()}
    raise PipatchError(f"a program's input of type {base!r} cannot travel to a server: declare its fields with "
                       "tensors, numbers, strings, metrics, ops, sites, lists, tuples, named tuples or dataclasses")


def decode_typed(value: Any, hint: Any, what: str, bounds: Bounds) -> Any:
    """The value ``value`` (as sent) stands for, checked against its declared type ``hint`` and
    the model's ``bounds``; :class:`BadRequest` (one line naming ``what``) where it does not fit."""
    base, marks = _unannotated(hint)
    inner = _optional(base)
    if inner is not None:
        return None if value is None else decode_typed(value, inner, what, bounds)
    origin = typing.get_origin(base)
    if base is torch.Tensor:
        floats = next((m for m in marks if isinstance(m, Floats)), Floats())
        if any(isinstance(m, _TokenIds) for m in marks):
            return torch.tensor([_token_ids(row, f"{what}[{i}]", bounds, bounds.max_len)
                                 for i, row in enumerate(_list(value, what, _MOST_ITEMS))])
        dtypes = (torch.bool, *_FLOATS) if floats.masks else _FLOATS
        return _tensor(value, what, bounds, dims=floats.dims or (1, 2, 3, 4, 5, 6), width=floats.width, dtypes=dtypes)
    if base is bool:
        return _bool(value, what)
    if base is int:
        if any(isinstance(m, _Layer) for m in marks):
            return _int(value, what, 0, bounds.n_layers)
        if any(isinstance(m, _Position) for m in marks):
            return _int(value, what, -bounds.max_len, bounds.max_len)
        return _int(value, what, -2**31, 2**31)
    if base is float:
        if type(value) not in (int, float) or not math.isfinite(value):
            raise _bad(what, value, "a finite number")
        return float(value)
    if base is str:
        if type(value) is not str or re.fullmatch(r"[^\x00-\x1f\x7f-\x9f]{0,200}", value) is None:
            raise _bad(what, value, "a line of at most 200 printable characters")
        return value
    if base is Metric:
        return _decode_metric(value, what, bounds)
    if base is Op:
        return _decode_ops([value], what, bounds)[0]
    if isinstance(base, type) and issubclass(base, Site):
        return _decode_site(value, what, bounds)
    if origin in (list, Sequence):
        (item,) = typing.get_args(base)
        return [decode_typed(v, item, f"{what}[{i}]", bounds) for i, v in enumerate(_list(value, what, _MOST_ITEMS))]
    if origin is tuple:
        args = typing.get_args(base)
        if type(value) is not tuple:
            raise _bad(what, value, "a tuple")
        items = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(items) != len(value) or len(value) > _MOST_ITEMS:
            raise _bad(what, value, f"a tuple of {len(items)}")
        return tuple(decode_typed(v, h, f"{what}[{i}]", bounds) for i, (v, h) in enumerate(zip(value, items)))
    fields = _fields_of(base)
    if fields is not None:
        if type(value) is not dict or set(value) != set(fields):
            raise _bad(what, value, f"{base.__name__} {{{', '.join(fields)}}}")
        return base(**{name: decode_typed(value[name], h, f"{what}.{name}", bounds) for name, h in fields.items()})
    raise BadRequest(f"{what} is declared as {base!r}, which no request carries: this server's program differs from "
                     "the client's; install the same pipatch and programs on both sides")


def _encode_program(name: str, jobs: list[tuple[list[int], tuple]], sites: dict[str, Site]) -> tuple[int, list]:
    """A program's jobs (``(ids, (adapter, name, request))``, one row each) on the wire: each
    ``(ids, fields)``, its fields but ``ids`` encoded by their declared types; and the
    program's version."""
    program = PROGRAMS_BY_NAME.get(name)
    if program is None or program.inputs is None:
        raise PipatchError(f"{name} is no program with declared inputs: register it (pipatch._programs.register_program)")
    hints = {n: h for n, h in declared(program.inputs).items() if n != "ids"}
    wire = [(list(ids), {n: encode_typed(getattr(args[2], n), h, sites) for n, h in hints.items()}) for ids, args in jobs]
    return program.version, wire


def _decode_program(name: str, version: Any, jobs: Any, bounds: Bounds) -> list[tuple[list[int], tuple]]:
    """The checked jobs of program ``name`` (a program this server runs: :data:`PROGRAMS_BY_NAME`,
    the built-in ones and those of the modules its operator named), each ``(ids, (name,
    request))``, its request rebuilt from the program's own declared inputs."""
    program = PROGRAMS_BY_NAME[name]
    inputs = program.inputs
    assert inputs is not None  # served_programs() lists programs with declared inputs only
    if version != program.version:
        raise BadRequest(f"this server runs the {name} program version {program.version}, the request is for version "
                         f"{str(version)[:10]}: install the same program on both sides")
    hints = {n: h for n, h in declared(inputs).items() if n != "ids"}
    decoded = []
    for i, job in enumerate(_list(jobs, "jobs", INVOKES_PER_REQUEST)):
        if type(job) is not tuple or len(job) != 2:
            raise _bad(f"jobs[{i}]", job, "(token ids, fields)")
        ids = _token_ids(job[0], f"jobs[{i}] token ids", bounds, bounds.max_len - 1)
        fields = job[1]
        if type(fields) is not dict or set(fields) != set(hints):
            raise _bad(f"jobs[{i}] fields", fields, f"{name}'s fields {{{', '.join(hints)}}}")
        request = inputs(ids=torch.tensor([ids]), **{n: decode_typed(fields[n], h, f"jobs[{i}] {n}", bounds)
                                                     for n, h in hints.items()})
        decoded.append((ids, (name, request)))
    return decoded


def served_programs() -> dict[str, int]:
    """The programs this process runs by name with declared inputs, and their versions (a
    server's info lists them: a client checks its program is there before sending it)."""
    return {name: program.version for name, program in sorted(PROGRAMS_BY_NAME.items()) if program.inputs is not None}


def _kind(encode: Callable[..., Any], decode: Callable[[Any, str, Bounds], Any]) -> tuple:
    return encode, decode


def _same(value: Any, *_: Any) -> Any:
    return value


#: Each argument kind: (encode(value, sites), decode(value, what, bounds)).
_KINDS: dict[str, tuple] = {
    "metric": _kind(lambda m, _: _encode_metric(m), _decode_metric),
    "ops": _kind(_encode_ops, _decode_ops),
    "sites": _kind(_encode_sites, _decode_sites),
    "prompt": _kind(_same, lambda v, what, b: _int(v, what, 0, b.max_len + 1)),
    "flag": _kind(_same, lambda v, what, b: _bool(v, what)),
    "skip": _kind(lambda s, _: _encode_skip(s), _decode_skip),
    "states": _kind(_same, lambda v, what, b: _tensor(v, what, b, dims=(3,), width=True)),
}


@dataclass(frozen=True)
class _Program:
    body: Callable[..., Any]
    kinds: tuple[str, ...]  # its arguments after the model and the adapter


#: The vLLM backend's own request bodies a client may name (:mod:`._vllm_worker`), with their
#: arguments' kinds. (Every other program is named as itself, its inputs declared.)
PROGRAMS: dict[str, _Program] = {body.__name__: _Program(body, kinds) for body, kinds in (
    (capture_request, ("metric", "sites", "ops", "prompt")),
    (patch_request, ("metric", "ops", "flag", "skip")),
    (head_request, ("metric", "states")),
)}


# --------------------------------------------------------------------------------------------
# The request
# --------------------------------------------------------------------------------------------


def encode(body: Callable[..., Any], jobs: list[tuple[list[int], tuple]], skip: int, adapter: Adapter) -> bytes:
    """The request for ``body(model, *args)`` on each job ``(ids, args)`` (``args`` starting
    with ``adapter``, which stays here), whose invokes skip ``skip`` blocks. Raises
    :class:`~pipatch.PipatchError` for a body or a site no server knows by name."""
    sites = sites_of(adapter)
    if body is program_request:  # a program with declared inputs: named, its fields by their types
        name = jobs[0][1][1] if jobs else ""
        if any(args[1] != name for _, args in jobs):
            raise PipatchError("one request runs one program: send each program's jobs apart")
        version, wire = _encode_program(name, jobs, sites)
    else:
        program = PROGRAMS.get(body.__name__)
        if program is None or program.body is not body:
            raise PipatchError(f"{body.__name__} is no program a pipatch server runs: run it on a model in this process")
        name, version, wire = body.__name__, 1, []
        for ids, args in jobs:
            rest = args[1:]  # the adapter: the server uses its own
            wire.append((list(ids), [_KINDS[kind][0](arg, sites) for kind, arg in zip(program.kinds, rest, strict=True)]))
    buffer = io.BytesIO()
    torch.save({"pipatch": pipatch_version(), "format": PROGRAM_FORMAT, "program": name, "version": version,
                "skip": skip, "jobs": wire}, buffer)
    return buffer.getvalue()


def decode(blob: bytes, bounds: Bounds) -> ProgramRequest:
    """The checked request in ``blob``; :class:`BadRequest` (one line) for anything a served
    client of this version would not send."""
    try:
        sent = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - whatever the bytes are, one line
        said = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()  # torch colours its advice
        reason = (said.splitlines() or [type(error).__name__])[0].split(". ")[0][:120]
        raise BadRequest(f"the request is no pipatch program request ({reason}): send it from pipatch's served "
                         "backend (load_model(..., serve=URL))") from None
    if type(sent) is not dict or set(sent) != {"pipatch", "format", "program", "version", "skip", "jobs"}:
        raise _bad("the request", sent, "a program request {pipatch, format, program, version, skip, jobs}")
    mine = (pipatch_version(), PROGRAM_FORMAT)
    if (sent["pipatch"], sent["format"]) != mine:
        raise BadRequest(f"this server runs pipatch {mine[0]} (program format {mine[1]}), the request comes from "
                         f"pipatch {str(sent['pipatch'])[:40]} (program format {str(sent['format'])[:10]}): "
                         "install the same pipatch version on both sides")
    name = sent["program"] if type(sent["program"]) is str else None
    program = PROGRAMS.get(name) if name is not None else None
    if program is None and name not in served_programs():
        raise BadRequest(f"unknown program {str(sent['program'])[:60]!r}: this server runs "
                         f"{', '.join([*PROGRAMS, *served_programs()])} (pipatch serve --programs MODULE adds a module's)")
    skip = _int(sent["skip"], "skip", 0, bounds.n_layers + 1)
    if bounds.limits is not None:
        _check_limits(sent["jobs"], bounds)
    if program is None:  # a program with declared inputs
        assert name is not None  # served_programs() has it
        if skip:
            raise BadRequest(f"the request skips {skip} blocks but its invokes skip none: send requests from "
                             "pipatch's served backend of this version")
        jobs = _decode_program(name, sent["version"], sent["jobs"], bounds)
        if not jobs:
            raise BadRequest("the request has no jobs: send at least one invoke")
        return ProgramRequest(name, program_request, 0, jobs)
    jobs = []
    for i, job in enumerate(_list(sent["jobs"], "jobs", INVOKES_PER_REQUEST)):
        if type(job) is not tuple or len(job) != 2:
            raise _bad(f"jobs[{i}]", job, "(token ids, arguments)")
        ids = _token_ids(job[0], f"jobs[{i}] token ids", bounds, bounds.max_len - 1)
        args = _list(job[1], f"jobs[{i}] arguments", len(program.kinds))
        if len(args) != len(program.kinds):
            raise BadRequest(f"jobs[{i}] has {len(args)} arguments, {sent['program']} takes {len(program.kinds)}: "
                             "send requests from pipatch's served backend of this version")
        jobs.append((ids, tuple(_KINDS[kind][1](arg, f"jobs[{i}] {kind}", bounds)
                                for kind, arg in zip(program.kinds, args))))
    if not jobs:
        raise BadRequest("the request has no jobs: send at least one invoke")
    _check_skips(sent["program"], skip, jobs)
    return ProgramRequest(sent["program"], program.body, skip, jobs)


def _check_limits(jobs: Any, bounds: Bounds) -> None:
    """:class:`OverLimit` where ``jobs`` (as sent, before their checks) has more invokes or
    longer prompts than the server's limits allow; more than any request may have (the
    batch's invokes, the context) is malformed instead, answered by the checks after this,
    unless the server's prompt limit is below the context (then the limit is what to change)."""
    if type(jobs) is list and len(jobs) <= INVOKES_PER_REQUEST:
        below = bounds.limits is not None and bounds.limits.prompt_tokens < bounds.max_len - 1
        prompts = [{"prompt_token_ids": job[0]} if type(job) is tuple and len(job) == 2 and type(job[0]) is list
                   and (below or len(job[0]) < bounds.max_len) else {} for job in jobs]  # else its own check
        refusal = bounds.limits.refusal(prompts, None) if bounds.limits is not None else None
        if refusal is not None:
            raise OverLimit(refusal)


def _check_skips(name: str, skip: int, jobs: list[tuple[list[int], tuple]]) -> None:
    """A request's invokes skip the blocks its header says, and no other: the server lets it
    into the engine beside requests that skip as many (``pipatch serve``'s rooms), where a
    skip has to cover every request of a step."""
    skips = [args[-1] for _, args in jobs] if name == "patch_request" else []
    if any((0 if s is None else s[0]) != skip for s in skips) or (skip and not skips):
        raise BadRequest(f"the request skips {skip} blocks but its invokes skip others: send requests from "
                         "pipatch's served backend of this version")


# --------------------------------------------------------------------------------------------
# The server's trace
# --------------------------------------------------------------------------------------------


class _Prepared:
    """An nnsight backend that runs nothing: it prepares the trace's engine requests (their
    workers attached) and keeps ``(prompts, params, loras)``, as ``pipatch serve`` submits
    them."""

    requests: tuple = ((), (), None)

    def __init__(self, model: Any):
        self.model = model

    def __call__(self, tracer: Any) -> None:
        from .._compat.nnsight import prepare_request

        self.requests = prepare_request(self.model, tracer)


def build(model: Any, adapter: Adapter, request: ProgramRequest) -> tuple[list, list, list | None]:
    """The engine requests of ``request`` on the server's ``model``: one invoke per job, its
    body the server's own copy of the program, with the server's ``adapter``; returns
    ``(prompts, params, loras)``, one per invoke. Raises what the trace's build raised."""
    import nnsight

    from .._compat.nnsight import clear_invoke_scope

    body, jobs, prepared = request.body, request.jobs, _Prepared(model)
    clear_invoke_scope()
    with torch.no_grad(), model.trace(backend=prepared, **SAMPLING) as tracer:
        for ids, args in jobs:
            with tracer.invoke(ids):
                out = nnsight.save(body(model, adapter, *args))  # noqa: F841 - answered by this name
    return prepared.requests
