"""What a program is: an intervention written once, and the view a backend runs it through.

A :class:`Program` is a body of intervention code (a function of a :class:`View` and the
program's data) with a name, a version and what it needs of a backend (:class:`Needs`: forward
reads and writes, a backward pass, generation, module calls), as data. A backend runs it
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

**One path for every program.** A program that declares its inputs (:attr:`Program.inputs`:
a dataclass of typed fields, :mod:`._inputs`) runs on every backend the same way: its body,
``body(view, request)``, runs inside one trace of ``request.ids`` (``[rows, T]``: one run per
row) through the backend's view of it — an nnsight trace in this process, the same trace sent
through nnsight's remote path to NDIF, one engine request per row in a vLLM worker (its rows
apart, :attr:`Needs.each_row`), or the same requests built by ``pipatch serve`` from the
program's name and its declared inputs. A body that treats its rows apart returns one output
per row (a list); the backend joins the rows' outputs. No backend names the program.

The base class serves places from one cache per trace (a site's holder is fetched once per
layer, whatever number of jobs write it) and offers the defaults of a trace whose jobs are
batch rows side by side, from position 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .._base.errors import PipatchError
from .._model.models import Adapter
from .._model.sites import Place, Site
from ._inputs import check_inputs

__all__ = ["Needs", "Program", "View", "PROGRAMS", "register_program", "load_programs", "ENTRY_POINTS",
           "in_forward_order"]


@dataclass(frozen=True)
class Needs:
    """What a program needs of the backend that runs it, declared once, as data.

    A backend compares it with its :class:`~pipatch._backends._contract.Capabilities` and
    refuses, in one line, a program it cannot run (:func:`pipatch._backends._contract.refusal`):
    nothing about a program is read from its name.

    Attributes
    ----------
    writes
        It writes into the forward pass (patches, noise); ``False``: it only reads.
    backward
        It runs a backward pass (gradients): backends with the capability ``gradients``.
    generation
        It generates tokens after the prompt (capability ``generates``).
    module_calls
        It calls the model's modules on values of its own, away from the forward (a circuit's
        runs feed each receiver its own input): capability ``circuit_runs``.
    shortcut
        The name of a backend shortcut it is written for (a capability flag, such as
        ``"pools_unembedding"``), or ``""``.
    logits
        The last positions whose logits the body reads (0: none): a backend computes those only.
    each_row
        The body treats each row of its request's ``ids`` on its own and returns one output per
        row, so a backend whose requests are single sequences (vLLM, a server) may run the rows
        apart and join their outputs; ``False``: the rows are one computation (a backward over
        their sum), one request.
    instead
        What to do where a backend cannot run it: the end of its refusal's line (else a default
        naming ``backend='transformers'``).
    """

    writes: bool = False
    backward: bool = False
    generation: bool = False
    module_calls: bool = False
    shortcut: str = ""
    logits: int = 0
    each_row: bool = True
    instead: str = ""

    def lacks(self, capabilities: Any) -> str | None:
        """What of these needs ``capabilities`` lacks, as the words of a refusal, or ``None``."""
        if self.backward and not capabilities.gradients:
            return "backward passes (gradients)"
        if self.generation and not getattr(capabilities, "generates", False):
            return "generation"
        if self.module_calls and not capabilities.circuit_runs:
            return "calls of the model's modules on values of its own"
        if self.shortcut and not getattr(capabilities, self.shortcut, False):
            return f"the shortcut {self.shortcut}"
        return None


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
        What it needs of a backend (:class:`Needs`).
    body
        ``body(view, *data) -> output``: the code that runs inside the trace.
    summary
        One line on what it computes.
    inputs
        The type of its per-request data: a dataclass whose fields are typed
        (:mod:`._inputs`), its field ``ids`` the runs of its trace. A program with inputs runs
        on every backend through one path (``body(view, request)``, the module docstring); one
        without (``None``) only where a backend has a routine of its own for it.
    answers
        The named tuples its output may hold (what a served client lets its answer's load build).
    """

    name: str
    version: int
    needs: Needs
    body: Callable[..., Any]
    summary: str
    inputs: type | None = None
    answers: tuple[type, ...] = ()

    def __post_init__(self) -> None:
        if self.inputs is not None:
            check_inputs(self.inputs)

    def __repr__(self) -> str:
        return f"<program {self.name} v{self.version}>"

    def refusal(self, backend: Any, instead: str = "") -> str | None:
        """The one line ``backend`` refuses this program with, read from what it needs
        (:attr:`needs`) and what the backend can do (its capabilities), or ``None`` where it
        can run it. ``instead`` (else :attr:`Needs.instead`, else a default naming
        ``backend='transformers'`` and ``scores=``) is what to do."""
        lacks = self.needs.lacks(backend.capabilities)
        if lacks is None:
            return None
        name = getattr(backend, "backend_name", type(backend).__name__)
        advice = instead or self.needs.instead or (
            "load the model with backend='transformers' (the default) for it, or pass what it computes there "
            "to the experiment (scores=result)")
        return f"the {name} backend cannot run the {self.name} program, which needs {lacks}: {advice}"

    def check(self, backend: Any, instead: str = "") -> None:
        """Raise :meth:`refusal`'s line (a :class:`~pipatch.PipatchError`) where ``backend``
        cannot run this program: an experiment asks before its first run."""
        why = self.refusal(backend, instead)
        if why is not None:
            raise PipatchError(why)


#: Every program by name.
PROGRAMS: dict[str, Program] = {}


#: The entry-point group another package names its program modules in (``pipatch serve``
#: imports them: each module's import registers its programs).
ENTRY_POINTS = "pipatch.programs"


def load_programs(modules: Sequence[str] = (), *, entry_points: bool = True) -> list[str]:
    """Import the program modules ``modules`` names (``pipatch serve --programs MODULE``) and,
    with ``entry_points``, those other installed packages declare (:data:`ENTRY_POINTS`): each
    registers its programs on import. Returns the names of the programs added. A module that
    does not import is one :class:`~pipatch.PipatchError` line."""
    import importlib
    import importlib.metadata

    before = set(PROGRAMS)
    named = list(modules)
    if entry_points:
        named += [point.value.split(":")[0] for point in importlib.metadata.entry_points(group=ENTRY_POINTS)]
    for name in named:
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - whatever the module raised, one line
            raise PipatchError(f"the program module {name!r} did not import ({type(error).__name__}: "
                               f"{str(error).splitlines()[0][:160] if str(error) else ''}): check --programs "
                               "and that the module is on the server's PYTHONPATH") from None
    return sorted(set(PROGRAMS) - before)


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

    # -- a circuit's view of the same trace ---------------------------------------------------
    def circuit_view(self, rows: int) -> Any:
        """The trace as a circuit's bodies see it (:class:`~pipatch._programs.circuit.CircuitView`:
        values read live, the model's modules called on values of their own), its ``rows``
        the run inputs."""
        raise NotImplementedError


def in_forward_order(jobs: Iterable[Sequence[Any]]) -> list[tuple[Any, int]]:
    """Every job's ops as ``(op, job)`` pairs, sorted in forward order (nnsight serves a
    module's values only in the order the forward pass computes them); a job's own ops keep
    their order among equals."""
    return sorted(((op, j) for j, ops in enumerate(jobs) for op in ops), key=lambda item: item[0].key)
