"""Program requests for ``pipatch serve``'s checks: one good request and a table of bad ones.

The unit tests decode them against a hand-made model's bounds (no model); the served tests
post them to a real server. Each bad request is the good one with one field broken, or its
bytes broken, and names the words its one-line refusal must hold.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch

from pipatch._backends._served_programs import encode
from pipatch._backends._vllm_worker import patch_request
from pipatch._model.cells import Metric, Op
from pipatch._model.models import Adapter
from pipatch._model.sites import RESID


def good_request(adapter: Adapter, ids: list[int], answer: int, foil: int) -> bytes:
    """One patched invoke of ``ids`` recording the residual stream at layer 1's last position:
    the request the served backend sends for one cell."""
    metric = Metric("logit_diff", (answer,), (foil,))
    ops = [Op(RESID, 1, (slice(None), -1))]
    return encode(patch_request, [(ids, (adapter, metric, ops, False, None))], 0, adapter)


def _edit(change: Callable[[dict], Any]) -> Callable[[bytes], bytes]:
    """The request with ``change`` applied to its loaded envelope (in place, or returning a new one)."""
    def edited(blob: bytes) -> bytes:
        sent = torch.load(io.BytesIO(blob), weights_only=True)
        sent = change(sent) or sent
        buffer = io.BytesIO()
        torch.save(sent, buffer)
        return buffer.getvalue()
    return edited


def _job(change: Callable[[list[int], list], tuple]) -> Callable[[bytes], bytes]:
    """The request with its first job ``(ids, args)`` replaced by ``change(ids, args)``."""
    def edit(sent: dict) -> None:
        ids, args = sent["jobs"][0]
        sent["jobs"][0] = change(list(ids), list(args))
    return _edit(edit)


def _op(field: str, value: Any) -> Callable[[bytes], bytes]:
    """The request with its first op's ``field`` set to ``value``."""
    def change(ids: list[int], args: list) -> tuple:
        args[1] = [{**args[1][0], field: value}]
        return ids, args
    return _job(change)


def _with_class(blob: bytes) -> bytes:
    """The envelope with a pipatch object in it (pickled by class): a loader that builds
    objects the sender names would accept it."""
    sent = torch.load(io.BytesIO(blob), weights_only=True)
    sent["jobs"][0][1][0] = Metric("prob", (1,))
    buffer = io.BytesIO()
    torch.save(sent, buffer)
    return buffer.getvalue()


#: (what is wrong, the good request's bytes → the bad one's, words its refusal holds)
BAD_REQUESTS: list[tuple[str, Callable[[bytes], bytes], str]] = [
    ("truncated body", lambda blob: blob[: len(blob) // 2], "no pipatch program request"),
    ("not a request at all", lambda blob: b"import os; os.system('id')", "no pipatch program request"),
    ("an object pickled by class", _with_class, "no pipatch program request"),
    ("a list, not an envelope", _edit(lambda sent: [sent]), "not a program request"),
    ("another pipatch version", _edit(lambda sent: sent.update(pipatch="0.0.1")), "pipatch 0.0.1"),
    ("another program format", _edit(lambda sent: sent.update(format=99)), "program format 99"),
    ("unknown program", _edit(lambda sent: sent.update(program="os.system")), "unknown program 'os.system'"),
    ("program name not a string", _edit(lambda sent: sent.update(program=["patch_request"])), "unknown program"),
    ("negative token id", _job(lambda ids, args: ([-1, *ids[1:]], args)), "token ids in [0,"),
    ("huge token id", _job(lambda ids, args: ([*ids[:-1], 10**12], args)), "token ids in [0,"),
    ("token ids as text", _job(lambda ids, args: ("The Eiffel Tower", args)), "token ids"),
    ("a prompt longer than the context", _job(lambda ids, args: (ids * 100_000, args)), "token ids has"),
    ("no token ids", _job(lambda ids, args: ([], args)), "token ids"),
    ("an argument missing", _job(lambda ids, args: (ids, args[:-1])), "has 3 arguments"),
    ("layer as text", _op("layer", "1"), "layer is '1'"),
    ("negative layer", _op("layer", -1), "layer is -1"),
    ("huge layer", _op("layer", 10**9), "layer is 1000000000"),
    ("unknown site", _op("site", "embed_tokens.weight"), "no site of this model"),
    ("op value not a tensor", _op("value", "1.0"), "value is '1.0'"),
    ("op value of integers", _op("value", torch.ones(1, 1, 4, dtype=torch.int64)), "dense"),
    ("index part unknown", _op("index", [("eval", "1")]), "index part"),
    ("add not a flag", _op("add", 1), "add is 1"),
    ("unknown metric", _job(lambda ids, args: (ids, [{**args[0], "name": "exec"}, *args[1:]])), "no metric"),
    ("negative skip", _edit(lambda sent: sent.update(skip=-1)), "skip is -1"),
    ("skip the invokes do not", _edit(lambda sent: sent.update(skip=3)), "skips 3 blocks"),
    ("no jobs", _edit(lambda sent: sent.update(jobs=[])), "no jobs"),
    ("too many invokes", _edit(lambda sent: sent.update(jobs=sent["jobs"] * 65)), "65 items, more than 64"),
]
