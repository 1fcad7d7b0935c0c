"""The experiments as Python functions, derived from their declarations.

For every registered experiment (:mod:`pipatch._experiments._registry`) this module offers

* ``pipatch.<name>(model, ..., on_row=None, stop=None, progress=True) -> Result``: the public
  function, with the declaration's signature and docstring (so ``help(pipatch.trace)`` and
  Jupyter's Shift-Tab show every parameter and its default); it shows a progress bar per
  stage of the run (:mod:`pipatch._base.progress`) unless ``progress=False``;
* ``plan_<name>(model, ...) -> Plan``: the same without running it (the baselines are run,
  the sweep is not). ``plan.run(on_row=..., stop=...)`` fills the result.

Both go through :func:`plan`: it finds the backend for ``model``, fills in the declaration's
defaults (a missing or unknown argument is one :class:`PipatchError` line), and hands the
protocol's planner one example, or, for lists of prompts (or of clean/corrupt pairs), every
example to :func:`pipatch._experiments.dataset.plan_dataset`, which averages them over named
positions.

``model`` is what a researcher naturally has at hand: a model from :func:`pipatch.load_model`,
an nnsight model built by hand, or anything ``load_model`` takes (``None`` for the embedded
default, a hub id, a local folder), loaded once per process.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

from .._backends import backend_for
from .._backends._load import shared_model
from .._base.progress import run_with_progress
from .._engine import Plan
from .._model.declare import Experiment
from .._model.models import PipatchError
from .._results.result import Result
from ._registry import EXPERIMENTS, experiment
from .dataset import plan_dataset

__all__ = ["plan", "function", "functions", "backend_of", "OnRow"]

OnRow = Callable[[Result, str, int], None]


def backend_of(model: Any) -> Any:
    """The backend for ``model``: a loaded model or backend as is; ``None``, a name or a folder
    through :func:`pipatch._backends._load.shared_model` (each loaded once per process)."""
    if model is None or isinstance(model, (str, os.PathLike)):
        model = shared_model(None if model is None else os.fspath(model))
    elif not hasattr(model, "trace") and not hasattr(model, "run"):
        raise PipatchError(
            f"model must be a loaded model (pipatch.load_model(...)) or a hub id / local folder, "
            f"got {type(model).__name__}"
        )
    return backend_for(model)


def plan(declaration: Experiment | str, model: Any, /, *args: Any, **kwargs: Any) -> Plan:
    """The :class:`Plan` of experiment ``declaration`` (or its name) on ``model``: its
    function's arguments, without ``on_row`` / ``stop`` / ``progress``. A positional argument
    after the model is the first prompt field (``trace(model, prompt, ...)``). The seconds it
    took (the model loaded where it is named, the baselines run) are its
    :attr:`~pipatch._engine.Plan.planning`, part of the result's ``meta["elapsed"]``."""
    started = time.perf_counter()
    entry = experiment(declaration) if isinstance(declaration, str) else declaration
    if args:
        fields = entry.prompts.fields
        if len(args) > 1 or len(fields) > 1:
            raise PipatchError(f"{entry.name}() takes the model and then keyword arguments only: "
                               f"{', '.join(f + '=' for f in fields)}...")
        if fields[0] in kwargs:
            raise PipatchError(f"{entry.name}() got {fields[0]} twice: pass it once")
        kwargs[fields[0]] = args[0]
    keywords = entry.bind(kwargs)
    backend = backend_of(model)
    examples = entry.examples(keywords)
    if examples is None or entry.whole_dataset:
        made = entry.planner(backend, **keywords)
    else:
        made = plan_dataset(backend, entry.planner, examples)
    made.planning = time.perf_counter() - started
    return made


def function(name: str) -> Callable[..., Result]:
    """The public function of experiment ``name``: plan it, run it, return the Result."""
    return _function(EXPERIMENTS[name])


def planner(name: str) -> Callable[..., Plan]:
    """``plan_<name>``: the :class:`Plan` of :func:`function` ``(name)``, not yet run."""
    return _planner(EXPERIMENTS[name])


@functools.cache  # per declaration (compared by identity): a replaced one gets a new function
def _function(entry: Experiment) -> Callable[..., Result]:
    def run_experiment(*args: Any, on_row: OnRow | None = None, stop: Any = None, progress: bool = True,
                       **kwargs: Any) -> Result:
        planned = plan(entry, *_with_model(entry, args, kwargs), **kwargs)
        return run_with_progress(planned, entry.name, on_row=on_row, stop=stop, progress=progress)

    run_experiment.__name__ = run_experiment.__qualname__ = entry.name
    run_experiment.__module__ = "pipatch"
    run_experiment.__doc__ = entry.docstring()
    run_experiment.__signature__ = entry.signature()  # type: ignore[attr-defined]
    return run_experiment


@functools.cache
def _planner(entry: Experiment) -> Callable[..., Plan]:
    def plan_experiment(*args: Any, **kwargs: Any) -> Plan:
        return plan(entry, *_with_model(entry, args, kwargs), **kwargs)

    plan_experiment.__name__ = plan_experiment.__qualname__ = f"plan_{entry.name}"
    plan_experiment.__doc__ = (f"The :class:`Plan` of :func:`pipatch.{entry.name}` (same parameters, without on_row / "
                               "stop / progress).")
    return plan_experiment


def _with_model(entry: Experiment, args: tuple, kwargs: dict) -> tuple:
    """The positional arguments with the model first, whether it came by position or as
    ``model=`` (taken out of ``kwargs``)."""
    if "model" in kwargs:
        return (kwargs.pop("model"), *args)
    if not args:
        raise PipatchError(f"{entry.name}() needs a model: pipatch.{entry.name}(model, ...), where model is "
                           "pipatch.load_model(...), a hub id, a folder, or None for the embedded default")
    return args


def functions() -> dict[str, Callable[..., Result]]:
    """Every registered experiment's public function, by name."""
    return {name: function(name) for name in EXPERIMENTS}


def __getattr__(name: str) -> Any:
    # ``_api.trace``, ``_api.plan_trace``: derived on first use, for every registered experiment.
    if name in EXPERIMENTS:
        return function(name)
    if name.startswith("plan_") and name[5:] in EXPERIMENTS:
        return planner(name[5:])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
