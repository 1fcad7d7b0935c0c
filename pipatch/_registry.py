"""The experiments pipatch runs, by name: what the magics, the CLI and ``PatchGrid.run`` read.

Each :class:`Experiment` says everything a front end needs to offer it:

* ``name``: the Python function, the magic (``%%trace``) and ``PatchGrid.run``'s ``kind``;
  ``command``: the shell command (``pipatch path-patch``);
* its planner (from :mod:`pipatch._api`), which checks the inputs and returns a Plan;
* how prompts are given (:class:`PromptForm`): one prompt (``trace``) or clean/corrupt pairs;
  several prompts or pairs make a dataset;
* its options (:class:`Option`): flag, Python keyword, parser from text, default, help.

=============  ==============  ======================================================
name           command         what it does
=============  ==============  ======================================================
``trace``      ``trace``       ROME causal tracing: noise the subject, restore states
``patch``      ``patch``       activation patching between a clean and a corrupt prompt
``attribute``  ``attribute``   attribution patching: first-order estimate of ``patch``
``path_patch`` ``path-patch``  path patching: one sender's direct effect on receivers
=============  ==============  ======================================================

Adding an experiment is one entry in :data:`EXPERIMENTS` plus its protocol module: the
magics, the CLI and ``PatchGrid.run`` are built from this table and never name an
experiment themselves.

A front end only ever passes the options the user gave: everything else takes the
planner's own default, so a magic, a command and a Python call with the same inputs
plan the same sweep.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import _api
from ._models import PipatchError

__all__ = ["EXPERIMENTS", "Experiment", "Option", "PromptForm", "PROMPT", "PAIR", "experiment", "add_options"]


# --------------------------------------------------------------------------------------------
# Parsers: text → value, a one-line PipatchError when the text is malformed
# --------------------------------------------------------------------------------------------


def text(value: str) -> str:
    """The text as given (``" Paris"`` keeps its leading space)."""
    return value


def _whole_number(value: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise PipatchError(f"{value!r} is not a whole number") from None
    if number < minimum:
        raise PipatchError(f"must be at least {minimum}, got {number}" if minimum else f"must be 0 or more, got {number}")
    return number


def positive_int(value: str) -> int:
    """A whole number ≥ 1."""
    return _whole_number(value, 1)


def count(value: str) -> int:
    """A whole number ≥ 0."""
    return _whole_number(value, 0)


def scale(value: str) -> float | str:
    """A positive number, or ``auto``."""
    if value == "auto":
        return value
    try:
        number = float(value)
    except ValueError:
        raise PipatchError(f"{value!r} is neither a number nor 'auto'") from None
    if not number > 0:  # also refuses NaN
        raise PipatchError(f"must be positive, got {value}")
    return number


def positions(value: str) -> list[int]:
    """Comma-separated token positions, negative ones counting from the end: ``2,-1``."""
    parts = [p.strip() for p in value.split(",")]
    try:
        out = [int(p) for p in parts if p]
    except ValueError:
        raise PipatchError(f"{value!r} is not a comma-separated list of integers such as 2,-1") from None
    if not out:
        raise PipatchError("no positions given: use a comma-separated list of integers such as 2,-1")
    return out


_HEAD = re.compile(r"^(\d+)\.(\d+)$")
_MLP = re.compile(r"^mlp\.?(\d+)$", re.IGNORECASE)
_RECEIVER = re.compile(r"^(\d+)\.(\d+)\.([qkv])$", re.IGNORECASE)


def sender(value: str) -> tuple | None:
    """``12.2`` (head 2 of layer 12), ``mlp12`` (layer 12's MLP), ``all`` (sweep every head) or ``mlp``
    (sweep every MLP)."""
    value = value.strip()
    if value.lower() == "all":
        return None
    if value.lower() == "mlp":
        return "mlp"
    if match := _HEAD.match(value):
        return ("head", int(match[1]), int(match[2]))
    if match := _MLP.match(value):
        return ("mlp", int(match[1]))
    raise PipatchError(f"{value!r} is not a sender: use LAYER.HEAD (e.g. 12.2), mlpLAYER (e.g. mlp12), all or mlp")


def receivers(value: str) -> str | list[tuple]:
    """``logits``, or comma-separated ``LAYER.HEAD.q|k|v``: ``13.4.q,14.1.k``."""
    value = value.strip()
    if value.lower() == "logits":
        return "logits"
    out = []
    for part in (p.strip() for p in value.split(",")):
        match = _RECEIVER.match(part)
        if not match:
            raise PipatchError(f"{part!r} is not a receiver: use logits or LAYER.HEAD.q|k|v such as 13.4.q,14.1.k")
        out.append(("head", int(match[1]), int(match[2]), match[3].lower()))
    return out


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------

_UNSET = object()


@dataclass(frozen=True)
class Option:
    """One option of an experiment, as a command-line flag and as a Python keyword.

    Attributes
    ----------
    flag
        ``--subject``; the magic and the CLI spell it the same.
    keyword
        The planner's keyword argument, ``subject``.
    parse
        Text → value; raises a one-line :class:`PipatchError` for malformed text.
    default
        The planner's default, for the help text only (an option not given is not passed).
    help
        One line, without the default.
    required
        The planner has no default.
    per_prompt
        May be given once, or once per prompt (or pair) of a dataset: several values become a
        list in prompt order.
    many
        May be given several times; the value is always a list (``--mean-prompt``).
    switch
        A flag without a value (``--control``): given means ``True``.
    """

    flag: str
    keyword: str
    parse: Callable[[str], Any] = text
    default: Any = None
    help: str = ""
    required: bool = False
    per_prompt: bool = False
    many: bool = False
    switch: bool = False

    @property
    def help_text(self) -> str:
        """``help``, then whether it repeats and its default: ``...; once or once per prompt; default: 10``."""
        bits = [self.help]
        if self.per_prompt:
            bits.append("once, or once per prompt")
        elif self.many:
            bits.append("repeatable")
        if not (self.required or self.switch):
            bits.append(f"default: {'none' if self.default is None else self.default}")
        return "; ".join(b for b in bits if b)

    def argparse_type(self) -> Callable[[str], Any]:
        """``parse`` with a malformed value reported the argparse way (``argument --x: ...``)."""
        parse = self.parse

        def convert(value: str) -> Any:
            try:
                return parse(value)
            except PipatchError as error:
                raise argparse.ArgumentTypeError(str(error)) from None

        convert.__name__ = parse.__name__
        return convert


# --------------------------------------------------------------------------------------------
# Prompt forms
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptForm:
    """How an experiment takes its prompts.

    ``fields`` are the planner's keywords (``prompt``; ``clean`` and ``corrupt``). One value
    per field is one example; several (the same number for each field, paired in order) are
    a dataset, passed to the planner as lists.
    """

    name: str
    fields: tuple[str, ...]
    body_help: str

    def collect(self, values: Mapping[str, Sequence[str]]) -> dict[str, str | list[str]]:
        """``{field: [texts]}`` → the planner's keywords: a string each, or lists of equal length."""
        counts = {f: len(values.get(f) or ()) for f in self.fields}
        for field_name, n in counts.items():
            if n == 0:
                raise PipatchError(f"no {field_name} prompt given")
        if len(set(counts.values())) > 1:
            said = ", ".join(f"{n} {f}" for f, n in counts.items())
            raise PipatchError(f"{said} prompts: give them in pairs (the n-th {self.fields[0]} goes with the n-th "
                               f"{self.fields[1]})")
        return {f: (list(values[f]) if counts[f] > 1 else values[f][0]) for f in self.fields}

    def from_body(self, body: str) -> dict[str, str | list[str]]:
        """A magic's cell body → the planner's prompt keywords (see ``body_help``)."""
        lines = [(number, line.strip()) for number, line in enumerate(body.splitlines(), 1)]
        lines = [(number, line) for number, line in lines if line]
        if len(self.fields) == 1:
            (field_name,) = self.fields
            tagged = [_tagged(line, self.fields) for _, line in lines]
            if lines and all(tag == field_name for tag, _ in tagged):
                return self.collect({field_name: [value for _, value in tagged]})
            whole = body.strip()
            if not whole:
                raise PipatchError(f"the cell body must hold the {field_name} (or '{field_name}: ...' lines)")
            return {field_name: whole}
        values: dict[str, list[str]] = {f: [] for f in self.fields}
        for number, line in lines:
            if line.startswith("#"):
                continue
            tag, value = _tagged(line, self.fields)
            if tag is None:
                wanted = " or ".join(f"'{f}: <prompt>'" for f in self.fields)
                raise PipatchError(f"line {number}: expected {wanted}, got {line[:60]!r}")
            values[tag].append(value)
        for field_name in self.fields:
            if not values[field_name]:
                raise PipatchError(f"the cell body needs a '{field_name}: <prompt>' line")
        return self.collect(values)


def _tagged(line: str, fields: Sequence[str]) -> tuple[str | None, str]:
    key, sep, value = line.partition(":")
    key = key.strip().lower()
    return (key, value.strip()) if sep and key in fields else (None, line)


PROMPT = PromptForm(
    "prompt", ("prompt",),
    "The cell body is the prompt. Several 'prompt: <text>' lines are a dataset (averaged over named "
    "positions); then --subject / --answer are given once or once per prompt.",
)
PAIR = PromptForm(
    "pair", ("clean", "corrupt"),
    "The cell body holds 'clean: <prompt>' and 'corrupt: <prompt>' lines of equal token length. Several "
    "pairs (paired in order) are a dataset; then --answer / --foil are given once or once per pair.",
)


# --------------------------------------------------------------------------------------------
# Experiments
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Experiment:
    """One experiment: its names, its planner, how it takes prompts and its options."""

    name: str
    command: str
    summary: str
    planner: Callable[..., Any]
    prompts: PromptForm
    options: tuple[Option, ...]
    example: str

    def plan(self, model: Any, **kwargs: Any) -> Any:
        """The planner's Plan for ``model`` (a loaded model, or anything ``load_model`` takes)."""
        return self.planner(model, **kwargs)

    def keywords(self, given: Mapping[str, Any], prompts: Mapping[str, str | list[str]]) -> dict[str, Any]:
        """The planner's keywords from parsed options (only those given) and prompt keywords.

        A ``per_prompt`` option given several times must be given once per prompt.
        """
        n = max((len(v) if isinstance(v, list) else 1) for v in prompts.values())
        out: dict[str, Any] = dict(prompts)
        for option in self.options:
            if option.keyword not in given:
                continue
            value = given[option.keyword]
            if option.per_prompt:
                value = list(value)
                if len(value) == 1:
                    value = value[0]
                elif len(value) != n:
                    unit = "pair" if len(self.prompts.fields) > 1 else "prompt"
                    raise PipatchError(f"{option.flag} is given {len(value)} times for {n} {unit}(s): give it once "
                                       f"or once per {unit}")
            out[option.keyword] = value
        return out


def add_options(parser: argparse.ArgumentParser, experiment: Experiment) -> None:
    """Add ``experiment``'s options to ``parser``; an option not given is absent from the namespace."""
    for option in experiment.options:
        if option.switch:
            parser.add_argument(option.flag, dest=option.keyword, action="store_true", default=argparse.SUPPRESS,
                                help=option.help_text)
            continue
        parser.add_argument(
            option.flag, dest=option.keyword, type=option.argparse_type(), default=argparse.SUPPRESS,
            action="append" if (option.per_prompt or option.many) else "store", required=option.required,
            metavar=option.keyword.upper(), help=option.help_text,
        )


def given_options(namespace: argparse.Namespace, experiment: Experiment) -> dict[str, Any]:
    """The options the user gave, by keyword."""
    return {o.keyword: getattr(namespace, o.keyword) for o in experiment.options if hasattr(namespace, o.keyword)}


def experiment(kind: str) -> Experiment:
    """The experiment called ``kind`` (its name or its command); one line listing them otherwise."""
    for entry in EXPERIMENTS.values():
        if kind in (entry.name, entry.command):
            return entry
    raise PipatchError(f"unknown experiment kind {kind!r}: use {', '.join(EXPERIMENTS)}")


# Shared options, one object each.
_ANSWER = Option("--answer", "answer", required=True, per_prompt=True,
                 help="the expected continuation, e.g. ' Paris' or ' New York' (quote a leading space)")
_FOIL = Option("--foil", "foil", per_prompt=True,
               help="the corrupt prompt's answer, e.g. ' Rome' (needed by logit_diff)")
_PAIR_METRIC = Option("--metric", "metric", default="logit_diff",
                      help="logit_diff (answer − foil), prob, logprob or logprob_diff")
_DIRECTION = Option("--direction", "direction", default="denoise",
                    help="denoise (clean into corrupt) or noise (corrupt into clean)")
_SITE = Option("--site", "site", default="resid", help="resid, attn, mlp or head")
_POSITIONS = Option("--positions", "positions", parse=positions, default="all",
                    help="token positions to sweep, e.g. 2,-1 (for --site head: where heads are patched)")
_BATCH_SIZE = Option("--batch-size", "batch_size", parse=positive_int, default="auto",
                     help="invokes per nnsight trace (auto: about 4,096 token positions per batch)")

EXPERIMENTS: dict[str, Experiment] = {
    entry.name: entry
    for entry in (
        Experiment(
            name="trace", command="trace",
            summary="Causal tracing (ROME): noise the subject's embeddings, restore clean states layer by layer.",
            planner=_api.plan_trace, prompts=PROMPT,
            options=(
                Option("--subject", "subject", required=True, per_prompt=True,
                       help="the subject's text as it appears in the prompt (noised)"),
                _ANSWER,
                Option("--seeds", "seeds", parse=positive_int, default=10, help="noise draws averaged over"),
                Option("--scale", "scale", parse=scale, default="auto", help="noise scale in units of σ, or auto"),
                Option("--kind", "kind", default="resid", help="resid, mlp, attn or a comma-separated list"),
                Option("--window", "window", parse=positive_int, default=10,
                       help="layers restored together for mlp / attn"),
                Option("--metric", "metric", default="prob", help="prob or logprob of the answer"),
                Option("--control", "control", switch=True, default=False,
                       help="restore from the corrupt run itself (a control that must give 0)"),
                _BATCH_SIZE,
            ),
            example='%%trace --subject "Eiffel Tower" --answer " Paris" -o eiffel\n'
                    "The Eiffel Tower is in the city of",
        ),
        Experiment(
            name="patch", command="patch",
            summary="Activation patching: paste one run's activations into another's, site by site.",
            planner=_api.plan_patch, prompts=PAIR,
            options=(
                _ANSWER, _FOIL,
                _SITE,
                _PAIR_METRIC,
                Option("--direction", "direction", default="denoise",
                       help="denoise (clean into corrupt), noise (corrupt into clean), zero or mean ablation"),
                _POSITIONS,
                Option("--mean-prompt", "mean_prompts", many=True, default="the clean and corrupt prompts",
                       help="for --direction mean: a prompt of the same token length to average over"),
                _BATCH_SIZE,
            ),
            example='%%patch --answer " Paris" --foil " Rome" --site head -o heads\n'
                    "clean: The Eiffel Tower is in the city of\n"
                    "corrupt: The Colosseum is in the city of",
        ),
        Experiment(
            name="attribute", command="attribute",
            summary="Attribution patching: a first-order estimate of every patch from 2 forwards and 1 backward.",
            planner=_api.plan_attribute, prompts=PAIR,
            options=(
                _ANSWER, _FOIL,
                _SITE,
                _PAIR_METRIC,
                Option("--verify", "verify", parse=count, default=0,
                       help="check the N largest estimates with real patches"),
                _POSITIONS,
                _BATCH_SIZE,
            ),
            example='%%attribute --answer " Paris" --foil " Rome" --site head --verify 5 -o attr\n'
                    "clean: The Eiffel Tower is in the city of\n"
                    "corrupt: The Colosseum is in the city of",
        ),
        Experiment(
            name="path_patch", command="path-patch",
            summary="Path patching: a sender's effect through the receivers only, everything else frozen.",
            planner=_api.plan_path_patch, prompts=PAIR,
            options=(
                _ANSWER, _FOIL,
                Option("--sender", "sender", parse=sender, default="all",
                       help="LAYER.HEAD (12.2), mlpLAYER (mlp12), all (every head: layers × heads) or mlp (every MLP)"),
                Option("--receivers", "receivers", parse=receivers, default="logits",
                       help="logits (the direct path) or LAYER.HEAD.q|k|v, comma-separated (13.4.q,14.1.k)"),
                _PAIR_METRIC, _DIRECTION, _BATCH_SIZE,
            ),
            example='%%path_patch --answer " Paris" --foil " Rome" --sender 12.2 -o path\n'
                    "clean: The Eiffel Tower is in the city of\n"
                    "corrupt: The Colosseum is in the city of",
        ),
    )
}
