"""Experiments, declared once: what every front end derives its view of an experiment from.

An experiment is one :class:`Experiment` value, kept in its protocol module as
``DECLARATION``: its name, its parameters (:class:`Param`: keyword, default, help, how text
becomes a value, how the CLI and magics spell it), how it takes its prompts
(:class:`PromptForm`), its planner, its result's title and its ``code()`` template. From it
pipatch derives

* the public function (``pipatch.trace``, with a real signature and docstring:
  :func:`pipatch._experiments._api.function`), and its planner ``pipatch._experiments._api.plan_trace``;
* the CLI command (``pipatch trace``) and the cell magic (``%%trace``), whose flags and help
  are the parameters' (:func:`pipatch._experiments._registry.add_options`);
* ``PatchGrid.run(model, "trace", ...)``;
* ``Result.title`` and ``Result.code()`` of its results (looked up here by the result's
  kind: :func:`declared`).

So a new experiment is its protocol module (planner + declaration), registered once
(:func:`register`; pipatch's own are listed in :mod:`pipatch._experiments._registry`, others come from the
``pipatch.experiments`` entry-point group). This module is a leaf: it imports nothing of
pipatch but the error type and the one number check (:mod:`pipatch._base.checks`), so the result, the views and the code writer may read
declarations without importing the protocols.

Words: an **experiment** is what a researcher runs (``trace``, ``patch``, ...); its result's
**kind** (``Result.kind``: ``"trace"``, ``"attribution"``, ``"path"``) names the result type
it fills, which files record.
"""

from __future__ import annotations

import argparse
import inspect
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._base.checks import whole_number
from .models import PipatchError
from .sites import Site

__all__ = ["Param", "PromptForm", "Experiment", "PROMPT", "PAIR", "REQUIRED", "register", "experiment",
           "declared", "unregister", "EXPERIMENTS", "text", "positive_int", "count", "positions"]

#: A parameter without a default: the caller must give it.
REQUIRED = inspect.Parameter.empty


# --------------------------------------------------------------------------------------------
# Parsers: text (a flag's value) → value, one PipatchError line when the text is malformed
# --------------------------------------------------------------------------------------------


def text(value: str) -> str:
    """The text as given (``" Paris"`` keeps its leading space)."""
    return value


def positive_int(value: str) -> int:
    """A whole number ≥ 1 (:func:`pipatch._base.checks.whole_number`)."""
    return whole_number(value, "the value", 1)


def count(value: str) -> int:
    """A whole number ≥ 0 (:func:`pipatch._base.checks.whole_number`)."""
    return whole_number(value, "the value", 0)


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


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """One parameter of an experiment: a Python keyword, and (unless ``python_only``) a flag.

    Attributes
    ----------
    keyword
        The function's and the planner's keyword argument: ``subject``.
    default
        Its default (:data:`REQUIRED`: none, the caller must give it). The one place it is
        written: the function's signature, the help texts and the planner all read it here.
    help
        One line for the function's docstring and the flag's help, without the default, in
        words both read alike: values as Python spells them (``'head'``), no flags.
    annotation
        The type the signature shows.
    parse
        A flag's text → value; raises a one-line :class:`PipatchError` for malformed text.
    shown
        The default in words where the value says little (``None`` → ``"all"``).
    per_prompt
        May be given once, or once per prompt (or pair) of a dataset.
    many
        A flag given several times; its value is always a list (``--mean-prompt``).
    switch
        A flag without a value (``--control``): given means ``True``.
    python_only
        Offered by the function alone (``fast``: no flag, no magic option).
    single
        Refused with a dataset when set (not its default): the one-line reason.
    aliases
        Older keywords still accepted, with a :class:`DeprecationWarning` (``kind`` for
        ``sites``); each is a flag too.
    flag_name
        The flag when it is not ``--`` + the keyword with dashes (``--mean-prompt``).
    flag_help
        How a flag spells the value where that differs from Python (``LAYER.HEAD`` for
        ``("head", layer, h)``): appended to ``help`` in the CLI's and the magics' help only.
    """

    keyword: str
    default: Any = REQUIRED
    help: str = ""
    annotation: Any = Any
    parse: Callable[[str], Any] = text
    shown: str | None = None
    per_prompt: bool = False
    many: bool = False
    switch: bool = False
    python_only: bool = False
    single: str = ""
    aliases: tuple[str, ...] = ()
    flag_name: str = ""
    flag_help: str = ""

    @property
    def flag(self) -> str:
        """``--subject``; the magic and the CLI spell it the same."""
        return self.flag_name or "--" + self.keyword.replace("_", "-")

    @property
    def alias_flags(self) -> list[str]:
        return ["--" + alias.replace("_", "-") for alias in self.aliases]

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def default_text(self) -> str:
        """The default as help texts show it."""
        if self.shown is not None:
            return self.shown
        return "none" if self.default is None else str(self.default)

    @property
    def help_text(self) -> str:
        """The flag's help: ``help`` and ``flag_help``, then whether it repeats and its default:
        ``...; once or once per prompt; default: 10``."""
        bits = [self.help, self.flag_help]
        if self.per_prompt:
            bits.append("once, or once per prompt")
        elif self.many:
            bits.append("repeatable")
        if not (self.required or self.switch):
            bits.append(f"default: {self.default_text}")
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
    a dataset, passed to the planner one example at a time (:meth:`examples`). ``doc`` says so
    in the function's docstring, ``body_help`` in a magic's help (its cell body).
    """

    name: str
    fields: tuple[str, ...]
    doc: str
    body_help: str
    #: What one example is called in messages: ``prompt``, ``pair``.
    unit: str = "prompt"
    #: Another form the experiment takes instead (a feature circuit: a pair, or one prompt
    #: and its target). The planner gets every field of both, ``None`` where not given.
    alternative: PromptForm | None = None

    @property
    def every_field(self) -> tuple[str, ...]:
        """The fields of this form and of its alternative."""
        return self.fields + (self.alternative.fields if self.alternative else ())

    def given(self, values: Mapping[str, Any]) -> PromptForm:
        """The form whose fields ``values`` hold (this one where it has no alternative); one
        :class:`PipatchError` line when fields of both forms are given."""
        if self.alternative is None:
            return self
        theirs = [f for f in self.alternative.fields if values.get(f) not in (None, [], ())]
        if not theirs:
            return self
        if any(values.get(f) not in (None, [], ()) for f in self.fields):
            mine = " and ".join(f + "=" for f in self.fields)
            raise PipatchError(f"give {mine} ({self.unit}) or {' and '.join(f + '=' for f in theirs)} "
                               f"({self.alternative.unit}), not both")
        return self.alternative

    def collect(self, values: Mapping[str, Sequence[str]]) -> dict[str, str | list[str]]:
        """``{field: [texts]}`` → the planner's keywords: a string each, or lists of equal length."""
        form = self.given(values)
        if form is not self:
            return form.collect(values)
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
        if self.alternative is not None and not any(_tagged(line, self.fields)[0] for _, line in lines):
            return self.alternative.from_body(body)
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

    def n_examples(self, keywords: Mapping[str, Any]) -> int | None:
        """How many examples the prompt keywords hold: ``None`` for one (not a list)."""
        form = self.given(keywords)
        if form is not self:
            return form.n_examples(keywords)
        given = [keywords.get(f) for f in self.fields]
        lists = [isinstance(v, (list, tuple)) for v in given]
        if not any(lists):
            return None
        if len(self.fields) == 1:
            return len(given[0])
        if not (all(lists) and len({len(v) for v in given}) == 1):
            both = " and ".join(self.fields)
            raise PipatchError(f"for many prompts pass {both} as lists of the same length (pairs in order)")
        return len(given[0])


def _tagged(line: str, fields: Sequence[str]) -> tuple[str | None, str]:
    key, sep, value = line.partition(":")
    key = key.strip().lower()
    return (key, value.strip()) if sep and key in fields else (None, line)


PROMPT = PromptForm(
    "prompt", ("prompt",),
    "The prompt. A list of prompts is a dataset, averaged over named positions; then each parameter "
    "marked 'once per prompt' takes one value for all or a list of one per prompt.",
    "The cell body is the prompt. Several 'prompt: <text>' lines are a dataset (averaged over named "
    "positions); then --subject / --answer are given once or once per prompt.",
)
PAIR = PromptForm(
    "pair", ("clean", "corrupt"),
    "The clean and the corrupt prompt, of equal token length. Two lists of the same length are a dataset "
    "of pairs (paired in order), averaged over named positions; then each parameter marked 'once per pair' "
    "takes one value for all or a list of one per pair.",
    "The cell body holds 'clean: <prompt>' and 'corrupt: <prompt>' lines of equal token length. Several "
    "pairs (paired in order) are a dataset; then --answer / --foil are given once or once per pair.",
    unit="pair",
)


# --------------------------------------------------------------------------------------------
# Experiments
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)  # one declaration is one experiment: compared and hashed by identity
class Experiment:
    """One experiment, declared once (see the module docstring).

    Attributes
    ----------
    name
        The Python function, the magic (``%%path_patch``) and ``PatchGrid.run``'s experiment.
    summary
        One line: the first line of the function's docstring and of the command's help.
    planner
        ``planner(backend, **one_example) -> Plan``: checks the inputs (one
        :class:`PipatchError` line each), runs the baselines and returns the Plan. It is
        called with every parameter (defaults filled in here), one example at a time.
    prompts
        How it takes its prompts (:data:`PROMPT`, :data:`PAIR`).
    params
        Its parameters, in signature order.
    kind
        The kind of result it fills (``Result.kind``), by which results find their title and
        code template again, saved files included.
    title
        ``title(meta) -> str``: the result's title, from the metadata it records.
    example
        A magic cell that runs it, for the magic's help.
    doc
        The function's docstring after its parameters: what it returns, examples.
    noun
        What a result of it is called in a sentence (``"causal trace"``).
    command
        The shell command (``pipatch path-patch``); default the name with dashes.
    code
        ``code(result, adapter) -> (function, source, sites, summary)``, or ``None``: the
        experiment's part of :meth:`pipatch.Result.code`'s script, kept beside its protocol
        (:mod:`pipatch._results.code` assembles it).
    code_inputs
        ``code_inputs(meta) -> dict``: one example's inputs to the script's function.
    whole_dataset
        The planner takes a dataset's lists itself (a circuit averages edge scores over pairs),
        instead of one example at a time averaged over named positions.
    """

    name: str
    summary: str
    planner: Callable[..., Any]
    prompts: PromptForm
    params: tuple[Param, ...]
    kind: str
    title: Callable[[dict], str]
    example: str
    doc: str = ""
    noun: str = ""
    command: str = ""
    code: Callable[..., tuple[str, str, list[Site], str]] | None = None
    code_inputs: Callable[[dict], dict[str, Any]] | None = None
    whole_dataset: bool = False
    _by_keyword: dict[str, Param] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        if not self.command:
            object.__setattr__(self, "command", self.name.replace("_", "-"))
        keywords = [p.keyword for p in self.params]
        if len(keywords) != len(set(keywords)) or set(keywords) & set(self.prompts.every_field):
            raise ValueError(f"experiment {self.name!r}: parameter names must be unique and differ from the prompts'")
        self._by_keyword.update({p.keyword: p for p in self.params})

    @property
    def options(self) -> tuple[Param, ...]:
        """The parameters the CLI and magics offer as flags."""
        return tuple(p for p in self.params if not p.python_only)

    def bind(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """The planner's keywords: ``given`` checked (unknown names, missing required ones,
        deprecated spellings) and every parameter not given set to its default."""
        out: dict[str, Any] = {}
        aliases = {alias: p for p in self.params for alias in p.aliases}
        for key, value in given.items():
            if key in self.prompts.every_field or key in self._by_keyword:
                target = key
            elif key in aliases:
                target = aliases[key].keyword
                warnings.warn(f"{self.name}({key}=...) is deprecated: use {target}=", DeprecationWarning, stacklevel=4)
                if target in given:
                    raise PipatchError(f"{self.name}() got both {key}= and {target}=: pass {target}= only")
            else:
                names = ", ".join([*self.prompts.every_field, *self._by_keyword])
                raise PipatchError(f"{self.name}() got an unexpected argument {key!r}: it takes {names}")
            out[target] = value
        form = self.prompts.given(out)
        for name in form.fields:
            # With two forms, a field left None picks the other form; with one, a None given is
            # the planner's to refuse (``corrupt=None``: "the corrupt prompt must be text").
            if name not in out or (self.prompts.alternative is not None and out[name] is None):
                other = self.prompts.alternative
                either = "" if other is None else f" (or {' and '.join(f + '=' for f in other.fields)})"
                raise PipatchError(f"{self.name}() needs {name}={either}")
        for name in self.prompts.every_field:
            out.setdefault(name, None)
        for param in self.params:
            if param.keyword not in out:
                if param.required:
                    raise PipatchError(f"{self.name}() needs {param.keyword}= ({param.help})")
                out[param.keyword] = param.default
        return out

    def examples(self, keywords: Mapping[str, Any]) -> list[dict[str, Any]] | None:
        """Bound keywords of a dataset → one keyword dict per example (``None``: one example).

        A ``per_prompt`` parameter given as a list has one value per example; a parameter
        marked ``single`` is refused when set."""
        n = self.prompts.n_examples(keywords)
        if n is None:
            return None
        for param in self.params:
            if param.single and keywords[param.keyword] != param.default:
                raise PipatchError(param.single)
        per = {p.keyword: _per_example(keywords[p.keyword], n, p.keyword, self.prompts.unit)
               for p in self.params if p.per_prompt}
        fields = self.prompts.given(keywords).fields
        return [{**keywords, **{f: keywords[f][i] for f in fields}, **{k: v[i] for k, v in per.items()}}
                for i in range(n)]

    def keywords(self, given: Mapping[str, Any], prompts: Mapping[str, str | list[str]]) -> dict[str, Any]:
        """The function's keywords from a front end's parsed flags (only those given) and prompts.

        A ``per_prompt`` flag given several times must be given once per prompt."""
        n = max((len(v) if isinstance(v, list) else 1) for v in prompts.values())
        out: dict[str, Any] = dict(prompts)
        for param in self.options:
            if param.keyword not in given:
                continue
            value = given[param.keyword]
            if param.per_prompt:
                value = list(value)
                if len(value) == 1:
                    value = value[0]
                elif len(value) != n:
                    unit = self.prompts.unit
                    raise PipatchError(f"{param.flag} is given {len(value)} times for {n} {unit}(s): give it once "
                                       f"or once per {unit}")
            out[param.keyword] = value
        return out

    # -- what the function looks like ----------------------------------------------------------
    def signature(self) -> inspect.Signature:
        """``(model, prompt, *, subject, ..., on_row=None, stop=None, progress=True)``: the public function's."""
        P = inspect.Parameter
        head = [P("model", P.POSITIONAL_OR_KEYWORD, annotation=Any)]
        if self.prompts.alternative is not None:  # either form: each field optional, the planner checks
            prompts = [P(f, P.KEYWORD_ONLY, default=None, annotation="str | Sequence[str] | None")
                       for f in self.prompts.every_field]
        elif len(self.prompts.fields) == 1:
            head.append(P(self.prompts.fields[0], P.POSITIONAL_OR_KEYWORD, annotation="str | Sequence[str]"))
            prompts = []
        else:
            prompts = [P(f, P.KEYWORD_ONLY, annotation="str | Sequence[str]") for f in self.prompts.fields]
        params = [P(p.keyword, P.KEYWORD_ONLY, default=p.default, annotation=p.annotation) for p in self.params]
        tail = [P("on_row", P.KEYWORD_ONLY, default=None, annotation="OnRow | None"),
                P("stop", P.KEYWORD_ONLY, default=None, annotation=Any),
                P("progress", P.KEYWORD_ONLY, default=True, annotation=bool)]
        return inspect.Signature(head + prompts + params + tail, return_annotation="Result")

    def docstring(self) -> str:
        """The public function's numpy docstring, from the summary, the prompt form's ``doc``, the
        parameters' ``help`` (not their ``flag_help``: Python spells values its own way) and ``doc``."""
        lines = [self.summary, "", "Parameters", "----------",
                 "model", "    A loaded model (:func:`pipatch.load_model`, or an nnsight model), or anything",
                 "    ``load_model`` takes: ``None`` (the embedded default), a hub id, a local folder."]
        lines += [f"{', '.join(self.prompts.fields)} : str | Sequence[str]", f"    {self.prompts.doc}"]
        if self.prompts.alternative is not None:
            lines += [f"{', '.join(self.prompts.alternative.fields)} : str, optional",
                      f"    {self.prompts.alternative.doc}"]
        for param in self.params:
            typed = param.keyword if param.annotation is Any else f"{param.keyword} : {param.annotation}"
            extra = f"; once, or once per {self.prompts.unit} of a dataset (a list)" if param.per_prompt else ""
            lines += [typed, f"    {param.help}{extra}."]
        lines += ["on_row : callable, optional",
                  "    Called as ``on_row(result, view, row)`` after each finished row: a layer of the grid (a "
                  "circuit's: a pair's gradient pass, an edge's check, a curve's runs).",
                  "stop : threading.Event or callable, optional",
                  "    When set (or returning true) the sweep stops after the current batch.",
                  "progress : bool, default True",
                  "    Show a progress bar per stage of the run on stderr (a widget in a notebook); "
                  "``False``: none."]
        # The doc's prose before its first section (``Returns``) reads after the summary, as
        # numpy's extended summary: after the parameters it would read as one more parameter.
        prose, sections = _split_sections(inspect.cleandoc(self.doc))
        head = [self.summary, *(["", prose] if prose else [])]
        return "\n".join(head + lines[1:]) + ("\n\n" + sections if sections else "") + "\n"


def _split_sections(doc: str) -> tuple[str, str]:
    """A numpy docstring's prose before its first section (a title underlined by dashes), and the rest."""
    found = re.search(r"^\w[\w ]*\n-{3,}$", doc, flags=re.MULTILINE)
    if found is None:
        return doc.strip(), ""
    return doc[:found.start()].strip(), doc[found.start():].strip()


def _per_example(value: Any, n: int, what: str, unit: str) -> list[Any]:
    """One value per example: a list of ``n`` as is, anything else repeated ``n`` times. A list
    of token indices (a subject given by position) is one value."""
    if isinstance(value, (list, tuple)) and not (value and isinstance(value[0], int)):
        if len(value) != n:
            raise PipatchError(f"{len(value)} {what}s for {n} {unit}s: pass one {what} per {unit}, or one for all")
        return list(value)
    return [value] * n


# --------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------

#: Every registered experiment by name, in registration order (pipatch's own first).
EXPERIMENTS: dict[str, Experiment] = {}
_BY_KIND: dict[str, Experiment] = {}


def register(declaration: Experiment, *, replace: bool = False) -> Experiment:
    """Register ``declaration``: from now on the function, the CLI command, the magic (in
    shells that load the extension afterwards) and ``PatchGrid.run`` offer it, and its results
    find their title and code. Registering the same declaration again changes nothing; another
    one of a name, kind or command already taken is refused, unless ``replace`` (a new version
    of an experiment being written in a notebook) swaps it for the one of that name."""
    old = EXPERIMENTS.get(declaration.name)
    if old is declaration:
        return declaration
    if replace and old is not None:
        unregister(old.name)
    for taken, key in ((EXPERIMENTS, declaration.name), (_BY_KIND, declaration.kind),
                       ({e.command: e for e in EXPERIMENTS.values()}, declaration.command)):
        if key in taken:
            raise PipatchError(f"an experiment {key!r} is registered already: give the new one another name "
                               "(or register(..., replace=True) for a new version of it)")
    EXPERIMENTS[declaration.name] = declaration
    _BY_KIND[declaration.kind] = declaration
    return declaration


def unregister(name: str) -> None:
    """Forget the experiment called ``name`` (its results keep their data; their title falls
    back to their kind)."""
    declaration = EXPERIMENTS.pop(name, None)
    if declaration is not None and _BY_KIND.get(declaration.kind) is declaration:
        del _BY_KIND[declaration.kind]


def experiment(name: str) -> Experiment:
    """The experiment called ``name`` (its name or its command); one line listing them otherwise."""
    for entry in EXPERIMENTS.values():
        if name in (entry.name, entry.command):
            return entry
    raise PipatchError(f"unknown experiment kind {name!r}: use {', '.join(EXPERIMENTS)}")


def declared(kind: str) -> Experiment | None:
    """The experiment whose results are of ``kind`` (``Result.kind``), if registered."""
    return _BY_KIND.get(kind)
