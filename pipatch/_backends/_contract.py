"""The backend seam, typed: what every backend offers (:class:`Backend`), and what it may
tell the engine to schedule its work better (:class:`Hints`).

A new backend starts from the core alone: the engine reads a backend's scheduling hints
through :func:`hints_of`, which hands it the defaults (:class:`Hints`: no shortcut taken) where
the backend has no ``hints``. A backend that takes shortcuts (the transformers backend starts a
cell at its layer and position, packs cells, pools the unembedding) says so in a :class:`Hints`
subclass of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # types only: the seam imports no model code
    import torch

    from .._cells import Base, Capture, Cell, Metric, Op
    from .._models import Adapter
    from .._sites import Site

__all__ = ["Backend", "Hints", "hints_of", "CORE", "HINTS"]


@runtime_checkable
class Backend(Protocol):
    """What every backend must offer: the engine and the protocols call nothing else.

    Shapes are :mod:`pipatch._cells`': token ids ``[1, T]``, site values ``[batch, T, width]``.
    """

    @property
    def adapter(self) -> Adapter:
        """The family's :class:`~pipatch._models.Adapter`: where each site lives."""

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (prompts are encoded with it)."""

    @property
    def device(self) -> torch.device:
        """Where inputs, noise and donors go."""

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype (a batch's memory is sized by it)."""

    @property
    def name(self) -> str:
        """What results call the model."""

    @property
    def runs_on(self) -> str:
        """Where the forward passes run: ``"cpu"``, ``"cuda:0"``, ..."""

    @property
    def context_length(self) -> int | None:
        """The longest run the model takes, or ``None``: no limit known."""

    def meta(self) -> dict[str, Any]:
        """What a result records about the model."""

    def capture(self, input_ids: torch.Tensor, metric: Metric, sites: Sequence[Site] = (), *,
                ops: Sequence[Sequence[Op]] | None = None) -> Capture:
        """One run per list of ``ops`` (one clean run for ``None``), keeping every block output
        and the named sites."""

    def captures(self, prompts: Sequence[torch.Tensor], metric: Metric, sites: Sequence[Site] = ()) -> list[Capture]:
        """Each prompt's :meth:`capture` (one length)."""

    def run(self, base: Base, cells: list[Cell], metric: Metric, *, fast: bool = True,
            full_logits: bool = False) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """A batch of patched runs of ``base`` → (metric per cell, or with ``full_logits`` the
        logits after the prompt; each cell's recorded values)."""

    def decode(self, ids: Sequence[int]) -> list[str]:
        """Each token id's text, alone."""

    def gradients(self, input_ids: torch.Tensor, metric: Metric, site: Site) -> tuple[list[Any], list[Any], float]:
        """d metric / d site at every layer: (values, gradients, metric)."""

    def edge_terms(self, clean_ids: torch.Tensor, corrupt_ids: torch.Tensor, metric: Metric, clean: Capture,
                   corrupt: Capture, steps: int) -> tuple[Any, Any]:
        """A circuit's two factors: each sender's write and each receiver's gradient
        (:mod:`pipatch._backends._edges`), or one line refusing them."""

    def circuit_metrics(self, clean_ids: torch.Tensor, corrupt_ids: torch.Tensor, metric: Metric,
                        keep: torch.Tensor, mean_of: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """The clean prompt's metric run as each circuit of ``keep`` ([P, receivers, senders]), [P];
        the edges not kept carry the corrupt run's values, or with ``mean_of`` their mean over
        those prompts (run input ids of one length)."""


class Hints:
    """A backend's scheduling hints, with the defaults a new backend starts from: none of the
    shortcuts. The engine reads them only here (:func:`hints_of`), never off the backend.

    Parameters
    ----------
    backend
        The backend hinted about (the defaults run its batches one :meth:`Backend.run` each,
        and read its ``runs_on``).
    """

    def __init__(self, backend: Any):
        self.backend = backend

    @property
    def starts_at_layer(self) -> bool:
        """Whether ``run(..., fast=True)`` starts each cell at its ``start`` layer from the base
        run's states, so a sweep's higher rows cost less (the engine then runs them first)."""
        return False

    @property
    def position_flops(self) -> int:
        """The FLOPs of one position through one block, about (the engine bounds how much work
        rows that share their traces may hold by it); 0: not said."""
        return 0

    @property
    def device_kind(self) -> str:
        """``"cuda"`` or ``"cpu"``: which of the engine's per-device sizes apply."""
        return "cuda" if str(self.backend.runs_on).startswith("cuda") else "cpu"

    @property
    def plans_in_flight(self) -> int:
        """How many plans (a study's facts) to run at once, each from a thread of its own: 1
        unless the model runs elsewhere and batches what several send (a server)."""
        return 1

    @property
    def plans_together(self) -> int:
        """How many plans (a study's facts) may run as one (:class:`~pipatch._engine.Chain`),
        their metrics finished together (:meth:`states_many`): 1 where they gain nothing."""
        return 1

    def prefix_reuse(self, base: Base) -> bool:
        """Whether ``run`` starts a batch of cells of ``base`` at their first written position
        (the engine then groups cells by it)."""
        return False

    def pack_tokens(self, base: Base, metric: Metric) -> int:
        """How many positions one trace holds where ``run`` packs each cell of ``base`` from
        its own first written position (the engine then cuts a row's cells into traces of
        about that many), or 0: it does not pack."""
        return 0

    def shares_unembedding(self, metric: Metric) -> bool:
        """Whether the metric of many cells costs less computed in one :meth:`run_many` call
        than in several (the engine then lets rows finish together)."""
        return False

    def run_many(self, base: Base, batches: Sequence[list[Cell]], metric: Metric, *,
                 fast: bool = True) -> list[torch.Tensor]:
        """Several batches of cells, each run as ``run`` runs it (one trace each) → the metric
        per cell of each batch."""
        return [self.backend.run(base, cells, metric, fast=fast)[0] for cells in batches]

    def states_many(self, base: Base, batches: Sequence[list[Cell]], metric: Metric) -> list[torch.Tensor] | None:
        """Several batches run as :meth:`run_many` runs them (``fast``), but only up to what
        their metric is computed from: per batch, those states ([cells, ...]), which
        :meth:`metrics_many` then finishes together with other batches', of other prompts
        (a plan that pools its metrics: :class:`~pipatch._engine.Chain`). ``None``: the
        backend computes each batch's metric in its run (the engine then calls :meth:`run_many`)."""
        return None

    @property
    def packs_plans(self) -> bool:
        """Whether :meth:`states_packed` packs cells of several plans' prompts into one trace
        (the engine then hands a :class:`~pipatch._engine.Chain`'s packed rows to it together,
        instead of each plan's batches to :meth:`states_many`)."""
        return False

    def states_packed(self, traces: Sequence[Sequence[tuple[Base, Cell, Metric]]]) -> list[torch.Tensor]:
        """Each of ``traces`` (``(base, cell, metric)`` entries of several prompts, cut by the
        engine to :meth:`pack_tokens` positions) as one packed trace, up to the metric's states:
        per trace [cells, ...], which :meth:`metrics_many` finishes (:attr:`packs_plans`)."""
        raise NotImplementedError(f"{type(self.backend).__name__} packs one prompt's cells a trace (packs_plans: False)")

    def metrics_many(self, items: Sequence[tuple[Metric, torch.Tensor]]) -> list[torch.Tensor]:
        """The metric per cell of each ``(metric, states)`` item (states from :meth:`states_many`),
        in one go."""
        raise NotImplementedError(f"{type(self.backend).__name__} computes its metrics in its runs (states_many: None)")


def hints_of(backend: Any) -> Hints:
    """``backend.hints`` where it has them, else the defaults (:class:`Hints`)."""
    hints = getattr(backend, "hints", None)
    return hints if isinstance(hints, Hints) else Hints(backend)


def _members(cls: type) -> list[str]:
    return sorted(name for name in vars(cls) if not name.startswith("_"))


#: The names of the core members and of the hints (the backends package's table lists them).
CORE: list[str] = _members(Backend)
HINTS: list[str] = [name for name in _members(Hints) if name != "backend"]
