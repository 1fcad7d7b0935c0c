"""What a program is: an intervention written once, and the view a backend runs it through.

A :class:`Program` is a body of intervention code (a function of a :class:`View` and the
program's data) with a name, a version and the capability it needs. A backend runs it
(``backend.run(program, request)``) by opening its own kind of trace — one invoke holding
every job's rows in this process, one request per job on a vLLM engine, a request to NDIF —
and handing the body a view of that trace. The body never knows which it is.

A :class:`View` is the backend's side of that meeting. It gives the body

* **places** (:meth:`View.place`): a site's holder value at a layer, as a
  :class:`~pipatch._model.sites.Place` over all the trace's rows, which the site reads and writes
  through (:meth:`pipatch._model.sites.Site.apply`);
* **where a job is** (:meth:`View.rows`, :meth:`View.index`): one job's rows of a place (and
  in a packed trace its span of positions), and an op's index shifted to where the job's run
  starts;
* **layer boundaries** (:meth:`View.enter`, :meth:`View.leave`): where a backend skips a
  block with cached states, or narrows and widens a packed trace's rows;
* **what a run leaves** (:meth:`View.block_state`, :meth:`View.read_out`): what a later run
  skips a block with, and what the metric is read from (logits, the unembedding's input, or
  the metric itself where the backend computes it remotely);
* **the model's head** (:meth:`View.final_norm`, :attr:`View.unembedding`): the final norm
  and the unembedding called on given states, where the weights are (the lens read).

The base class serves places from one cache per trace (a site's holder is fetched once per
layer, whatever number of jobs write it) and offers the defaults of a trace whose jobs are
batch rows side by side, from position 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .._model.models import Adapter
from .._model.sites import Place, Site

__all__ = ["Program", "View", "PROGRAMS", "register_program", "in_forward_order"]


@dataclass(frozen=True)
class Program:
    """One intervention, written once.

    Attributes
    ----------
    name
        How backends (and a server, by name) know it.
    version
        Bumped when its data or its output changes shape.
    needs
        The capability flag a backend must have to run it (:class:`~pipatch._backends._contract.Capabilities`),
        or ``""`` where every backend runs it.
    body
        ``body(view, *data) -> output``: the code that runs inside the trace.
    summary
        One line on what it computes.
    """

    name: str
    version: int
    needs: str
    body: Callable[..., Any]
    summary: str

    def __repr__(self) -> str:
        return f"<program {self.name} v{self.version}>"


#: Every program by name.
PROGRAMS: dict[str, Program] = {}


def register_program(program: Program) -> Program:
    """Add ``program`` to :data:`PROGRAMS` (a name is taken once)."""
    if PROGRAMS.get(program.name, program) is not program:
        raise ValueError(f"a program {program.name!r} is registered already")
    PROGRAMS[program.name] = program
    return program


class View:
    """A backend's trace as a program's body sees it (the module docstring).

    Subclasses say how the holder's value of a site is fetched (:meth:`holder`) and what a
    run leaves (:meth:`block_state`, :meth:`read_out`); the defaults are a trace whose job
    ``j`` is batch rows ``j·n … j·n + n − 1`` (``n``: rows per job), from prompt position
    ``start`` on.
    """

    def __init__(self, adapter: Adapter, model: Any, rows_per_job: int = 1, start: int = 0):
        self.adapter = adapter
        self.model = model
        self.n = rows_per_job
        self.start = start
        self._places: dict[tuple[str, int], Place] = {}

    # -- places -----------------------------------------------------------------------------
    def place(self, site: Site, layer: int) -> Place:
        """``site``'s holder value at ``layer``, fetched once per trace."""
        key = (site.place_key, layer)
        if key not in self._places:
            self._places[key] = self.holder(site, layer)
        return self._places[key]

    def holder(self, site: Site, layer: int) -> Place:
        """A new :class:`~pipatch._model.sites.Place` over ``site``'s holder at ``layer``."""
        raise NotImplementedError

    def rows(self, job: int, site: Site) -> Any:
        """Job ``job``'s rows of ``site``'s place."""
        return slice(job * self.n, (job + 1) * self.n)

    def index(self, job: int, op: Any) -> tuple:
        """``op``'s index in job ``job``'s run (shifted where the run starts after position 0)."""
        return op.index_from(self.start)

    # -- layers -----------------------------------------------------------------------------
    def enter(self, layer: int) -> None:
        """Before the body touches block ``layer`` (a backend may skip it here)."""

    def leave(self, layer: int) -> None:
        """After the body is done with block ``layer``."""

    # -- what a run leaves --------------------------------------------------------------------
    def block_state(self, layer: int) -> Any:
        """What a later run skips block ``layer`` with (a capture keeps it)."""
        raise NotImplementedError

    def read_out(self, metric: Any) -> Any:
        """What ``metric`` is read from at the end of the run."""
        raise NotImplementedError

    # -- the model's head, on given states ------------------------------------------------------
    def final_norm(self, states: Any) -> Any:
        """The model's final norm on ``states`` ([N, d], block outputs), [N, d]."""
        raise NotImplementedError

    @property
    def unembedding(self) -> Any:
        """The unembedding (soft-cap included) on the final norm's outputs: ``metric(metric,
        hidden)`` ([batch, inputs, n_read, d] → [batch], as
        :meth:`~pipatch._backends._unembedding.Unembedding.metric`) and ``logits(hidden)``."""
        raise NotImplementedError


def in_forward_order(jobs: Iterable[Sequence[Any]]) -> list[tuple[Any, int]]:
    """Every job's ops as ``(op, job)`` pairs, sorted in forward order (nnsight serves a
    module's values only in the order the forward pass computes them); a job's own ops keep
    their order among equals."""
    return sorted(((op, j) for j, ops in enumerate(jobs) for op in ops), key=lambda item: item[0].key)
