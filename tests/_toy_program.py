"""A program built the way a new one is (the ``_programs`` contract), in a module of its own
written to a temporary folder: the norm of a site's value at every layer and position.

It declares its inputs (a dataclass: the runs' token ids and the site) and its needs (it only
reads), registers itself, and runs on every backend through the one generic path — the
transformers backend's trace, NDIF's remote trace (simulated), a vLLM worker's requests and a
``pipatch serve`` server that names its module (``--programs``) — with no pipatch file
changed. :func:`hook_norms` is the hand-written reference: plain PyTorch forward hooks on the
transformers model.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import torch

__all__ = ["SOURCE", "toy_program", "toy_module_name", "hook_norms"]

SOURCE = textwrap.dedent('''
    """A toy program: the norm of a site's value at every layer and position."""
    from __future__ import annotations

    from dataclasses import dataclass

    import torch

    from pipatch.extend import Needs, Program, Site, TokenIds, register_program


    @dataclass
    class NormsRequest:
        """The runs (one per row of ``ids``) and the site whose norms they read."""

        ids: TokenIds
        site: Site


    def site_norms(view, request):
        """Per run: ``|value|`` of ``request.site`` at every layer and position, ``[layers, T]``."""
        site, rows = request.site, request.ids.shape[0]
        norms = [[] for _ in range(rows)]
        for layer in range(view.adapter.n_layers):  # forward order: a layer's value once
            view.enter(layer)
            place = view.place(site, layer)
            for row in range(rows):
                norms[row].append(site.read(place, view.rows(row, site))[0].float().norm(dim=-1))
            view.leave(layer)
        return [torch.stack(each).cpu() for each in norms]


    SITE_NORMS = register_program(Program("site_norms", 1, Needs(), site_norms,
                                          "the norm of a site's value at every layer and position",
                                          inputs=NormsRequest))
''')


def toy_module_name(folder: Path) -> str:
    """The toy module's name in ``folder`` (one per folder, so a test's server and client agree)."""
    return f"toy_program_{abs(hash(str(folder))) % 10**8}"


def toy_program(folder: Path):
    """Write the toy program's module into ``folder``, import it (kept in ``sys.modules``)
    and return the module (``SITE_NORMS``, ``NormsRequest``). A process imports it once: a
    program's name is registered once (a second folder gets the module already imported)."""
    from pipatch._programs import PROGRAMS

    if "site_norms" in PROGRAMS:
        return sys.modules[PROGRAMS["site_norms"].body.__module__]
    from tests._toy_site import import_source

    return import_source(folder, toy_module_name(folder), SOURCE)


def hook_norms(model, ids: torch.Tensor, site_name: str) -> list[torch.Tensor]:
    """The reference: per row of ``ids`` ([rows, T]), ``|value|`` of the site at every layer and
    position ([layers, T]), read by plain forward hooks on the transformers model's blocks
    (``"resid"``: a block's output) or MLPs (``"mlp"``: the MLP's output)."""
    from pipatch._compat.nnsight import torch_module
    from pipatch._model.models import _get, adapter_for

    adapter = adapter_for(model)
    hf = torch_module(model)
    blocks = _get(hf, adapter.blocks)
    modules = [blocks[i] if site_name == "resid" else _get(blocks[i], adapter.mlp) for i in range(adapter.n_layers)]
    seen: list[torch.Tensor] = []
    handles = [m.register_forward_hook(lambda mod, args, out: seen.append(
        (out[0] if isinstance(out, tuple) else out).detach().float().norm(dim=-1))) for m in modules]
    try:
        with torch.no_grad():
            hf(ids)
    finally:
        for handle in handles:
            handle.remove()
    stacked = torch.stack(seen, dim=1)  # [rows, layers, T]
    return list(stacked.unbind(0))
