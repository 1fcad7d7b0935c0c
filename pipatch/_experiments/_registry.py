"""The experiments pipatch offers, by name: what the magics, the CLI and ``PatchGrid.run`` read.

Each experiment is declared once, in its protocol module, as ``DECLARATION``
(:class:`pipatch._model.declare.Experiment`); this module lists pipatch's own and registers them,
then those of other packages:

=================  =================  =======================================================
**Another package's experiments** are found through the ``pipatch.experiments`` entry-point
group: each entry point names a module (its declaration is the module's ``DECLARATION``) or an
:class:`~pipatch._model.declare.Experiment` itself::

    [project.entry-points."pipatch.experiments"]
    ablate = "my_package.ablate"

A front end only ever passes the options the user gave: everything else takes the
declaration's default, so a magic, a command and a Python call with the same inputs plan the
same sweep.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import warnings
from typing import Any

from .._model.declare import EXPERIMENTS, PAIR, PROMPT, Experiment, Param, PromptForm, experiment, register
from .._model.models import PipatchError
from . import (
    attribution,
    circuits,
    feature_circuit,
    feature_patch,
    feature_trace,
    features,
    lens,
    patching,
    paths,
    tracing,
)

__all__ = ["EXPERIMENTS", "Experiment", "Param", "PromptForm", "PROMPT", "PAIR", "experiment", "register",
           "add_options", "given_options", "ENTRY_POINTS"]

#: The entry-point group other packages declare their experiments in.
ENTRY_POINTS = "pipatch.experiments"

for _module in (tracing, patching, attribution, paths, lens, circuits, features, feature_patch, feature_trace,
                feature_circuit):
    register(_module.DECLARATION)


def _load_entry_points() -> None:
    """Register the experiments other installed packages declare (:data:`ENTRY_POINTS`). One that
    fails to load is reported in one line, and the others still load."""
    for point in importlib.metadata.entry_points(group=ENTRY_POINTS):
        try:
            found = point.load()
            declaration = getattr(found, "DECLARATION", found)
            if not isinstance(declaration, Experiment):
                raise PipatchError(f"{point.value} holds no Experiment (DECLARATION = Experiment(...))")
            register(declaration)
        except Exception as error:  # noqa: BLE001 - another package's fault must not stop pipatch
            warnings.warn(f"pipatch: the experiment {point.name!r} ({point.value}) was not loaded: {error}",
                          stacklevel=2)


_load_entry_points()


def add_options(parser: argparse.ArgumentParser, entry: Experiment, *, per_fact: bool = False) -> None:
    """Add ``entry``'s options to ``parser``; an option not given is absent from the namespace.

    ``per_fact`` (a study, :mod:`pipatch._studies`): the per-prompt options come from each fact,
    so none is required, and one given holds for every fact (a single value)."""
    for option in entry.options:
        if per_fact and option.per_prompt:
            parser.add_argument(*[option.flag, *option.alias_flags], dest=option.keyword, type=option.argparse_type(),
                                default=argparse.SUPPRESS, metavar=option.keyword.upper(),
                                help=f"{option.help} (default: each fact's own)")
            continue
        flags = [option.flag, *option.alias_flags]
        if option.switch:
            parser.add_argument(*flags, dest=option.keyword, action="store_true", default=argparse.SUPPRESS,
                                help=option.help_text)
            continue
        parser.add_argument(
            *flags, dest=option.keyword, type=option.argparse_type(), default=argparse.SUPPRESS,
            action="append" if (option.per_prompt or option.many) else "store", required=option.required,
            metavar=option.keyword.upper(), help=option.help_text,
        )


def given_options(namespace: argparse.Namespace, entry: Experiment) -> dict[str, Any]:
    """The options the user gave, by keyword."""
    return {o.keyword: getattr(namespace, o.keyword) for o in entry.options if hasattr(namespace, o.keyword)}
