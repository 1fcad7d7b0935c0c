"""What another package (or a notebook) uses to add to pipatch: experiments, programs and sites.

pipatch grows in three places, each declared in one module of your own and touching no
pipatch file (``docs/extending.md`` walks through each):

* **An experiment** (a sweep of cells: a planner and its parameters): an :class:`Experiment`
  of :class:`Param` s, prompts read by a :data:`PROMPT` or :data:`PAIR` form, given to
  :func:`register` in a session, or named by a ``pipatch.experiments`` entry point in an
  installed package. Its Python function, ``pipatch`` command, cell magic and
  ``PatchGrid.run`` kind follow from the declaration.
* **A program** (what runs inside the model on one trace): a :class:`Program` with its
  :class:`Needs` (writes, a backward pass, generation...), a body ``body(view, request)`` that
  reads and writes through the :class:`View`, and its inputs as a dataclass of typed fields
  (:data:`TokenIds` for the runs, :class:`Site`, :data:`Layer`, :data:`Position`,
  :data:`Floats`, tensors, numbers), given to :func:`register_program` (or a
  ``pipatch.programs`` entry point: what ``pipatch serve`` loads). Every backend carries it,
  and one that lacks a need refuses it in one line.
* **A site** (a place in the model that is read and written): a :class:`Site` whose
  ``encode`` and ``decode`` turn the module's raw value into the value patched and back.

Example::

    from pipatch.extend import PROMPT, Experiment, Param, register

    register(Experiment(name="ablate", kind="ablation", summary="Zero-ablate each layer.",
                        planner=plan_ablate, prompts=PROMPT, params=(Param("answer"),)))
"""

from __future__ import annotations

from ._model.declare import PAIR, PROMPT, Experiment, Param, register, unregister
from ._model.sites import Site
from ._programs import Floats, Layer, Needs, Position, Program, TokenIds, View, register_program

__all__ = ["Experiment", "Param", "PROMPT", "PAIR", "register", "unregister",
           "Program", "Needs", "View", "register_program", "TokenIds", "Layer", "Position", "Floats",
           "Site"]
