"""The backend seam, typed: a backend is a *transport* (:class:`Backend`), and what the
engine may rely on is data (:class:`Capabilities`).

A backend says *where and how* a batch of intervention bodies runs — in this process, on a
vLLM engine, over HTTP to ``pipatch serve``, on NDIF — and names no experiment. What runs is
a *program* (:mod:`pipatch._programs`): the capture, the patched run, the gradient pass, a
circuit's runs, each written once. ``backend.run(program, request)`` runs one; a backend
that cannot run a program refuses it in one line, read from what the program declares it
needs (:func:`refusal`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # types only: the seam imports no model code
    import torch

    from .._model.cells import Base, Metric
    from .._model.models import Adapter

__all__ = ["Backend", "Capabilities", "CORE", "CAPABILITIES", "refuse", "refusal"]


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, and what the engine may schedule by. The defaults are a new
    backend's: no shortcut taken, no gradient.

    Attributes
    ----------
    gradients
        It runs programs that need a backward pass (attribution's gradient pass, a
        circuit's edge scores).
    circuit_runs
        It runs a circuit's runs (each receiver fed its own input: the faithfulness curve).
    skips_blocks
        A patched run starts at its cells' ``start`` layer, the blocks below skipped with the
        base run's states: a sweep's higher rows cost less (the engine runs them first).
    reuses_prefix
        A patched run starts at its cells' first written position, the positions before it
        the base run's (its capture keeps the keys and values): the engine groups cells by it.
    pack_tokens
        Positions one packed trace holds, each cell from its own position and layer (the
        engine cuts a row's cells into traces of about that many); 0: no packing.
    packs_prompts
        A packed trace may hold cells of several prompts (a study's facts run as one).
    pools_unembedding
        A patched run can stop at the states its metric is read from, and the metric of many
        batches is then one pass over the unembedding (the ``metrics`` program).
    device_kind
        ``"cuda"`` or ``"cpu"``: which of the engine's per-device sizes apply.
    position_flops
        The FLOPs of one position through one block, about (the engine bounds how much work
        rows that share traces may hold by it); 0: not said.
    plans_in_flight
        A study runs this many facts at once, each from a thread of its own (a server that
        batches what several send).
    plans_together
        A study runs this many facts as one engine chain, their metrics finished together.
    generates
        It runs programs that generate tokens after the prompt (none does yet).
    torch_threads
        Its forward passes run on this process's torch CPU threads (the transformers backend on
        a CPU): the engine warns when they outnumber the cores other work leaves free.
    """

    gradients: bool = False
    circuit_runs: bool = False
    skips_blocks: bool = False
    reuses_prefix: bool = False
    pack_tokens: int = 0
    packs_prompts: bool = False
    pools_unembedding: bool = False
    device_kind: str = "cpu"
    position_flops: int = 0
    plans_in_flight: int = 1
    plans_together: int = 1
    generates: bool = False
    torch_threads: bool = False

    # -- what they mean for one base run and metric (the engine and the backends ask alike) ----
    def prefix(self, base: Base) -> bool:
        """Whether a patched run of ``base`` may start at its cells' first written position."""
        return self.reuses_prefix and base.capture.keys is not None

    def packed(self, base: Base, metric: Metric) -> int:
        """Positions per packed trace of ``base``'s cells reading ``metric``, or 0: not packed
        (packing starts each cell at its own position, so it needs the prefix; and one input
        per cell)."""
        return self.pack_tokens if self.prefix(base) and metric.n_inputs == 1 else 0

    def pooled(self, metric: Metric) -> bool:
        """Whether ``metric``'s cells gain by a pooled unembedding: a probability reads every
        row of it, a logit difference two, a rank every logit at once."""
        return self.pools_unembedding and metric.token_ids is None and not metric.needs_vocab


@runtime_checkable
class Backend(Protocol):
    """What every backend offers: the engine, the programs and the protocols call nothing else.

    Shapes are :mod:`pipatch._model.cells`': token ids ``[1, T]``, site values ``[batch, T, width]``.
    """

    @property
    def adapter(self) -> Adapter:
        """The family's :class:`~pipatch._model.models.Adapter`: where each site lives."""

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

    @property
    def capabilities(self) -> Capabilities:
        """What it can do and what the engine may schedule by."""

    def meta(self) -> dict[str, Any]:
        """What a result records about the model."""

    def decode(self, ids: Sequence[int]) -> list[str]:
        """Each token id's text, alone."""

    def batch_size(self, n_tokens: int) -> int:
        """Invokes per trace for runs of ``n_tokens`` positions: what fits the device."""

    def run(self, program: Any, request: Any) -> Any:
        """Run ``program`` (:mod:`pipatch._programs`) on ``request``, its own data; a program
        this backend cannot run is refused in one :class:`~pipatch.PipatchError` line."""


def refusal(backend: Any, program: Any, instead: str = "") -> str | None:
    """The one line a backend refuses ``program`` with, or ``None``
    (:meth:`~pipatch._programs._program.Program.refusal`: read from the program's declared needs
    and the backend's :class:`Capabilities`)."""
    return program.refusal(backend, instead)


def refuse(backend: Any, program: Any, why: str = "") -> Exception:
    """The one line a backend raises for a program it cannot run: which, and what to do
    (:func:`refusal`, else ``why``, else that it has no way to run it)."""
    from .._model.models import PipatchError

    name = getattr(backend, "backend_name", type(backend).__name__)
    return PipatchError(why or refusal(backend, program)
                        or f"the {name} backend has no way to run the {program.name} program: load the model with "
                           "backend='transformers' (the default)")


def _members(cls: type) -> list[str]:
    return sorted(name for name in vars(cls) if not name.startswith("_"))


#: The names of the core members (the backends package's table lists them).
CORE: list[str] = _members(Backend)
#: The capability flags (the backends package's second table lists them).
CAPABILITIES: list[str] = [f.name for f in fields(Capabilities)]
