"""Latent sites: an SAE's or transcoder's latents as a :class:`~pipatch._model.sites.Site`.

A :class:`LatentSite` is the encoding site :mod:`pipatch._model.sites` describes: its value is the
SAE's latents ``encode(x)`` (``[rows, T, d_sae]``) of the module value ``x`` it reads, and a
write of edited latents ``f'`` adds ``decode(f') − decode(f)`` to that value, so the SAE's error
``x − decode(encode(x))`` stays in the stream and an unedited write is the plain run. An op's
index is ``(rows, positions, latents)``: positions on the position dimension, latent ids on
the width (:meth:`LatentSite.cell`).

A **transcoder** reads its latents from the MLP's input and writes at the MLP's output: its
holder is the pair of them (:class:`InOut`), read in forward order (input first), so the
site encodes the input and adds ``decode(f') − decode(f)`` to the output: the MLP is
replaced by the transcoder plus its error, and the error keeps the run the plain one.

A latent site lives at one layer (:attr:`LatentSite.layer`): the SAE was trained there. Its
name is its SAE's (``"L3 resid_post"``; results and captures key values by it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..models import Adapter, _get, first
from ..sites import Site
from .hooks import Hook
from .sae import SAE

__all__ = ["LatentSite", "ErrorSite", "NodeValues", "InOut"]

_LATENT = "latent"  # the holder of a latent site inside a block (a block output's is "block")


class InOut:
    """A transcoder's holder: the live MLP input it reads and the live MLP output it writes,
    indexed together (``pair[rows]`` is the pair of both at ``rows``); ``+=`` adds to the
    output only, in place."""

    def __init__(self, input: Any, output: Any):
        self.input, self.output = input, output

    def __getitem__(self, rows: Any) -> InOut:
        return InOut(self.input[rows], self.output[rows])

    def __iadd__(self, delta: torch.Tensor) -> InOut:
        self.output += delta
        return self

    def unsqueeze(self, dim: int) -> InOut:
        return InOut(self.input.unsqueeze(dim), self.output.unsqueeze(dim))

    @property
    def dtype(self) -> torch.dtype:
        return self.output.dtype

    @property
    def grad(self) -> Any:
        """The output's gradient (inside a backward): what the transcoder's writes change."""
        return self.output.grad


@dataclass(frozen=True, repr=False)
class LatentSite(Site):
    """The latents of one SAE (or transcoder) at one layer (see the module docstring).

    Attributes
    ----------
    sae
        The :class:`~pipatch._model.features.sae.SAE` whose ``encode`` / ``decode`` it applies.
    reads, writes
        Where it reads and (a transcoder) writes in this model (:class:`~.hooks.Hook`);
        ``writes`` is ``reads`` for an SAE.
    """

    sae: SAE = field(default=None, compare=False)  # type: ignore[assignment]
    reads: Hook = field(default=None, compare=False)  # type: ignore[assignment]
    writes: Hook = field(default=None, compare=False)  # type: ignore[assignment]

    @property
    def layer(self) -> int:
        """The layer the SAE reads (and writes) at."""
        return self.reads.layer

    @property
    def transcoder(self) -> bool:
        return self.sae.transcoder

    @property
    def n_latents(self) -> int:
        return self.sae.d_sae

    # -- where it is ------------------------------------------------------------------------
    def window_layers(self, row: int, window: int, n_layers: int) -> range:
        """The SAE's own layer, for a grid row whose window covers it; no layer for any other
        row (an SAE reads one layer: a layer-by-layer grid over its site, such as
        :func:`pipatch.patch`'s, writes its latents in its own layer's row only)."""
        return range(self.layer, self.layer + 1) if row <= self.layer < row + window else range(0)

    def module_path(self, adapter: Adapter) -> str:
        return self.writes.path

    @property
    def place_key(self) -> tuple:
        """Latent sites reading and writing the same modules share their holder's place: at a
        layer, SAEs trained at other layers read the same module values (a trace serves each
        once, in forward order), so the key names the block's values, not the SAE's layer."""
        return ("latent", self.reads.module_value, self.writes.module_value)

    @property
    def reads_input(self) -> bool:
        return self.writes.reads_in

    def value(self, adapter: Adapter, model: Any, layer: int) -> Any:
        """The module value the SAE reads at ``layer`` (for a transcoder, the
        :class:`InOut` pair of the MLP's input and output, the input fetched first)."""
        if not self.transcoder:
            return self._at(self.reads, adapter, model, layer)
        return InOut(self._at(self.reads, adapter, model, layer), self._at(self.writes, adapter, model, layer))

    @staticmethod
    def _at(hook: Hook, adapter: Adapter, model: Any, layer: int) -> Any:
        block = adapter.block(model, layer)
        module = _get(block, hook.path) if hook.path else block
        return module.input if hook.reads_in else first(module.output)

    # -- reading and writing ----------------------------------------------------------------
    def encode(self, raw: Any) -> torch.Tensor:
        """The latents of the value read (``[rows, T, d_sae]``)."""
        return self.sae.encode(raw.input if isinstance(raw, InOut) else raw)

    def decode(self, value: torch.Tensor) -> torch.Tensor:
        return self.sae.decode(value)

    def error(self, raw: Any) -> torch.Tensor:
        """What the SAE misses of the value it stands for: ``x − decode(encode(x))`` (a
        transcoder: the MLP's output less its reconstruction, the affine skip included)."""
        if isinstance(raw, InOut):
            return raw.output.to(self.sae.dtype) - self.sae.reconstruct(raw.input)
        return raw.to(self.sae.dtype) - self.sae.reconstruct(raw)

    def cell(self, position: int, latent: int | list[int]) -> tuple:
        """An op's index of latent(s) ``latent`` at prompt position ``position``."""
        width = slice(latent, latent + 1) if isinstance(latent, int) else list(latent)
        return self.index([position], width=width)

    def describe(self) -> dict[str, Any]:
        """This site as results record it (``meta["saes"]``, plain JSON): its name, layer,
        hook, width and folder, and ``recipe``: what ``Result.code()``'s script needs to redo
        its math (:meth:`SAE.recipe` with the layer and the modules it reads and writes, each
        ``[path under the block, is the module's input]``; ``None``: an SAE not read from a
        folder)."""
        recipe = self.sae.recipe()
        if recipe is not None:
            recipe.update(layer=self.layer, order=self.reads.order, transcoder=self.transcoder,
                          reads=[self.reads.path, self.reads.reads_in], writes=[self.writes.path, self.writes.reads_in])
        return {"name": self.name, "layer": self.layer, "hook": self.sae.hook, "d_sae": self.n_latents,
                "folder": None if self.sae.folder is None else str(self.sae.folder), "recipe": recipe}

    @property
    def error_site(self) -> ErrorSite:
        """This SAE's error term as a site of its own (:class:`ErrorSite`)."""
        return ErrorSite(f"{self.name} error", order=self.order, holder=self.holder, sublayer=self.sublayer,
                         about=f"what {self.sae.name} misses of the value it reads", sae=self.sae, reads=self.reads,
                         writes=self.writes)

    @property
    def nodes_site(self) -> NodeValues:
        """This SAE's latents and error side by side as one site (:class:`NodeValues`)."""
        return NodeValues(f"{self.name} nodes", order=self.order, holder=self.holder, sublayer=self.sublayer,
                          about=f"{self.sae.name}'s latents and error side by side", sae=self.sae, reads=self.reads,
                          writes=self.writes)

    def __repr__(self) -> str:
        return f"<latent site {self.name}: {self.sae!r}>"


@dataclass(frozen=True, repr=False)
class ErrorSite(LatentSite):
    """The error node of a latent site: ``x − decode(encode(x))``, what the SAE misses.

    Its value is the error itself (``[rows, T, d_out]``), read where its latent site reads;
    a write of an edited error ``e'`` adds ``e' − e`` where the latent site writes (its
    decode is the identity), so patching the clean run's error into the corrupt run at a
    position moves exactly the part of the stream the SAE does not explain there. A
    feature sweep (:func:`pipatch.feature_patch`) gives it a row, ``"L12 error"``: how much
    of the effect the SAE misses. Latent ids mean nothing here: :meth:`cell` takes
    positions only.
    """

    def encode(self, raw: Any) -> torch.Tensor:
        return self.error(raw)

    def decode(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def cell(self, position: int, latent: Any = None) -> tuple:
        """An op's index of the whole error at prompt position ``position``."""
        return self.index([position])

    def __repr__(self) -> str:
        return f"<error site {self.name}: {self.sae!r}>"


@dataclass(frozen=True, repr=False)
class NodeValues(LatentSite):
    """An SAE's latents and its error side by side as one site value, ``[rows, T, d_sae +
    d_out]``: a write of edited ``[f', e']`` adds ``decode(f') − decode(f) + e' − e``, so the
    SAE's output becomes ``decode(f') + e'`` (a transcoder's skip stays live). Index ``j <
    d_sae`` is latent ``j``; the rest is the error vector. A feature circuit's faithfulness
    curve writes a whole SAE's nodes at a position at once through it
    (:mod:`pipatch._experiments._feature_checks`)."""

    def encode(self, raw: Any) -> torch.Tensor:
        return torch.cat([super().encode(raw), self.error(raw)], dim=-1)

    def decode(self, value: torch.Tensor) -> torch.Tensor:
        d_sae = self.n_latents
        return self.sae.decode(value[..., :d_sae]) + value[..., d_sae:]

    def __repr__(self) -> str:
        return f"<node values {self.name}: {self.sae!r}>"


def latent_site(sae: SAE, reads: Hook, writes: Hook, name: str) -> LatentSite:
    """The :class:`LatentSite` of ``sae`` reading at ``reads`` and writing at ``writes``."""
    block_output = writes.kind == "resid_post" and not sae.transcoder
    return LatentSite(name, order=reads.order, holder="block" if block_output else _LATENT, sublayer=not block_output,
                      about=f"the latents of {sae.name} ({sae.d_sae} of them)", sae=sae, reads=reads, writes=writes)
