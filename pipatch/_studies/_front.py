"""What ``pipatch study`` and ``%study`` / ``%%study`` share: their flags, derived from the
experiment's declaration (:func:`pipatch._experiments._registry.add_options`), and how they read them."""

from __future__ import annotations

import argparse
from typing import Any

from .._experiments._registry import add_options, experiment, given_options
from .._model.declare import Experiment, count
from .._model.models import PipatchError

__all__ = ["add_study_arguments", "study_keywords", "probe_experiment", "parse_columns"]


def probe_experiment(argv: list[str]) -> Experiment:
    """The experiment ``--experiment NAME`` names in ``argv`` (default ``trace``), before the
    rest is parsed: its options are the parser's."""
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--experiment", default="trace")
    known, _ = probe.parse_known_args(argv)
    return experiment(known.experiment)


def _count(value: str) -> int:
    try:
        return count(value)
    except PipatchError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_study_arguments(parser: argparse.ArgumentParser, entry: Experiment, *, facts_required: bool = True) -> None:
    """``FILE --store PATH [--experiment NAME] [--limit N] [--all-facts] [--columns ...] [--in-flight N]``, then
    ``entry``'s options (a per-prompt one optional: each fact gives its own)."""
    parser.add_argument("facts", metavar="FILE", nargs=None if facts_required else "?", default=None,
                        help="the facts: .json (a list of records, ROME's known_1000.json), .jsonl, .csv, .parquet")
    parser.add_argument("--store", required=True, metavar="PATH", help="the study's SQLite file (resumed if it exists)")
    parser.add_argument("--experiment", default="trace", help="trace (default), patch, attribute, path_patch, lens")
    parser.add_argument("--limit", type=_count, default=None, metavar="N",
                        help="stop once N facts have a result (the facts the model knows; unknown ones do not count)")
    parser.add_argument("--all-facts", action="store_true",
                        help="run every fact, not only those the model knows (top-1 = the answer's first token)")
    parser.add_argument("--columns", default=None, metavar="FIELD=NAME,...",
                        help="other field names, e.g. prompt=text,attribute=target")
    parser.add_argument("--in-flight", type=_count, default=None, metavar="N",
                        help="facts run at once (default: the backend's; 1: one by one, each its single run "
                             "bit for bit); a kill loses at most these")
    add_options(parser, entry, per_fact=True)


def study_keywords(args: argparse.Namespace, entry: Experiment) -> dict[str, Any]:
    """:func:`pipatch.study`'s keywords (but the model and the facts) from the parsed flags."""
    return {"store": args.store, "known_only": not args.all_facts, "columns": parse_columns(args.columns),
            "limit": args.limit, "in_flight": args.in_flight, **given_options(args, entry)}


def parse_columns(text: str | None) -> dict[str, str] | None:
    """``prompt=text,attribute=target`` → ``{"prompt": "text", "attribute": "target"}``."""
    if not text:
        return None
    out = {}
    for part in text.split(","):
        field, sep, name = part.partition("=")
        if not (sep and field.strip() and name.strip()):
            raise PipatchError(f"--columns {text!r}: give FIELD=NAME pairs separated by commas, e.g. prompt=text")
        out[field.strip()] = name.strip()
    return out
