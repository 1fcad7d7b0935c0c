"""``%%trace``, ``%%patch``, ``%%attribute``, ``%%path_patch``: every experiment from a notebook cell.

Registered by ``%load_ext pipatch`` only (never as a side effect of ``import pipatch``), one
cell magic per entry of :data:`pipatch._experiments._registry.EXPERIMENTS`, named like its Python
function and taking the same options (``%%trace?`` lists them)::

    %%trace --subject "Eiffel Tower" --answer " Paris" -o eiffel
    The Eiffel Tower is in the city of

    %%patch --answer " Paris" --foil " Rome" --site head -o heads
    clean: The Eiffel Tower is in the city of
    corrupt: The Colosseum is in the city of

    %%path_patch --answer " Paris" --foil " Rome" --sender 12.2 -o path
    clean: The Eiffel Tower is in the city of
    corrupt: The Colosseum is in the city of

The body of ``%%trace`` is the prompt; several ``prompt: ...`` lines are a dataset, with
``--subject`` / ``--answer`` given once or once per prompt. The other magics take
``clean: ...`` / ``corrupt: ...`` lines; several pairs (in order) are a dataset.

Each magic plans the sweep (its baselines run first, under a "loading…" line), shows a live
:class:`~pipatch._notebook.live.PatchGrid` that fills in row by row (Stop button; a click shows the
patched run's top-5 next tokens), and binds the :class:`~pipatch.Result` to ``-o NAME``
(default ``_trace``, ``_patch``, ``_attribute``, ``_path_patch``) in the user namespace. When
the run ends the grid stays live and its saved copy (pipatch MIME + PNG + text) is added below
it, which a saved notebook shows without a kernel (see :mod:`pipatch._notebook.widget`); the magic
itself returns ``None`` so the grid is not shown twice. ``PatchGrid(NAME)`` shows a clickable
grid again later.

``--serve URL`` (with ``--api-key KEY``) runs the cell on a ``pipatch serve`` server; the
grid fills in here as each batch comes back.

A stopped (Stop button), interrupted (Kernel ▸ Interrupt) or failed run still binds its
partial result, whose ``status`` says which; a line on stderr says so too.

A bad cell (missing ``--answer``, subject not in the prompt, no ``corrupt:`` line, prompts of
different token lengths, unknown site, ...) is refused with one ``UsageError`` line and binds
nothing: earlier variables stay as they were.

``%compare a b`` shows ``a − b`` of two results already in the namespace
(:func:`pipatch.compare`) and binds it to ``-o NAME`` (default ``_compare``); as a cell magic
the names go on its line or in its body (IPython refuses a cell magic with an empty body)::

    %compare -o moved f32 bf16

    %%compare -o moved
    f32 bf16

Its grid toggles between a, b and a − b; ``--values raw`` subtracts the raw metric instead of
normalized recovery, ``--view mlp`` compares one view.

The magics run pipatch's own functions on the cell's text; they never execute user code
inside an nnsight trace.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.utils.process import arg_split

from ._backends import backend_for
from ._backends._load import shared_model
from ._engine import EngineError
from ._experiments._api import plan as plan_experiment
from ._experiments._registry import EXPERIMENTS, Experiment, add_options, given_options
from ._model.models import BACKENDS, PipatchError, no_progress_bar
from ._notebook.live import run_live
from ._results.compare import VALUES, compare
from ._results.result import Result

__all__ = ["load_ipython_extension", "make_compare_magic", "make_magic", "magic_parser"]


class _MagicParser(argparse.ArgumentParser):
    """argparse whose errors are one ``UsageError`` line (and ``-h`` raises nothing)."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}")

    def exit(self, status: int = 0, message: str | None = None):
        if message:
            raise UsageError(message.strip())
        raise UsageError(f"{self.prog}: see {self.prog}? for the options")


def default_name(entry: Experiment) -> str:
    """The variable a magic binds its result to without ``-o``: ``_trace``, ``_patch``, ..."""
    return f"_{entry.name}"


def magic_parser(entry: Experiment) -> argparse.ArgumentParser:
    """The argument parser of ``%%<entry.name>``: the experiment's options, ``--model`` and ``-o``."""
    parser = _MagicParser(
        prog=f"%%{entry.name}", add_help=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"{entry.summary}\n\n{entry.prompts.body_help}\n\nExample::\n\n"
                    + "\n".join(f"    {line}" for line in entry.example.splitlines()),
    )
    add_options(parser, entry)
    _add_model_arguments(parser)
    parser.add_argument("-o", "--out", default=default_name(entry),
                        help=f"variable to bind the Result to (default {default_name(entry)})")
    return parser


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Which model a magic runs on, and where: ``--model``, ``--backend``, ``--tensor-parallel-size``,
    ``--serve`` / ``--api-key`` and ``--remote`` (read back by :func:`_model_of`)."""
    parser.add_argument("--model", default=None,
                        help="a variable holding a loaded model, or a hub id / local folder "
                             "(default: the embedded Gemma 3 270M)")
    parser.add_argument("--backend", default=None, choices=BACKENDS,
                        help="what runs the model pipatch loads: transformers (default) or vllm")
    parser.add_argument("--tensor-parallel-size", metavar="N", default=None,
                        help="split the vLLM engine pipatch loads over N ranks (with --backend vllm)")
    parser.add_argument("--serve", metavar="URL", default=None,
                        help="run on a `pipatch serve` server (http://host:port); the model it serves")
    parser.add_argument("--api-key", default=None,
                        help="the server's key (with --serve; default: $PIPATCH_API_KEY)")
    parser.add_argument("--remote", nargs="?", const="ndif", default=None, metavar="local",
                        help="run as requests on NDIF (key: $NDIF_API_KEY); --remote local: nnsight's offline "
                             "simulation of it")


def _model_of(shell: Any, args: argparse.Namespace) -> Any:
    """The model :func:`_add_model_arguments`' flags name."""
    return _model(shell, args.model, args.backend, args.serve, args.api_key, args.tensor_parallel_size, args.remote)


def _parse(parser: argparse.ArgumentParser, line: str) -> argparse.Namespace:
    """Parse the magic's line like a shell does: ``--answer " Paris"`` gives `` Paris``.

    (IPython's ``parse_argstring`` keeps the quotes, which would make the answer 3 tokens.)
    """
    try:
        argv = arg_split(line, posix=True)
    except ValueError as error:
        raise UsageError(f"{parser.prog}: cannot split the arguments: {error} (check the quotes)") from None
    args = parser.parse_args(argv)
    if not str(args.out).isidentifier():
        raise UsageError(f"{parser.prog}: -o needs a variable name, got {args.out!r}")
    return args


def _model(shell: Any, name: str | None, backend: str | None = None, serve: str | None = None,
           api_key: str | None = None, ranks: str | None = None, remote: str | None = None) -> Any:
    """``--model``: a variable holding a loaded model, else a hub id / local folder (loaded
    through ``--backend``, or a client of the ``--serve`` server)."""
    if serve is not None and backend is not None:
        raise UsageError("--serve runs the model on the server, which chose its backend: drop --backend")
    if serve is not None:
        backend = "served"
    if name is None:
        return _load(None, backend, serve, api_key, ranks, remote)
    user_ns = shell.user_ns if shell is not None else {}
    if name.isidentifier() and name in user_ns:
        model = user_ns[name]
        if not (hasattr(model, "trace") and hasattr(model, "tokenizer")):
            raise UsageError(f"--model {name}: that variable is a {type(model).__name__}, not a loaded model "
                             "(use pipatch.load_model(...)), or pass a hub id / folder")
        runs_on = backend_for(model).meta()["backend"] if backend is not None else None
        if backend is not None and runs_on != backend:
            raise UsageError(f"--model {name} runs on the {runs_on} backend, not {backend}: "
                             "drop --backend / --serve, or load the model with pipatch.load_model(..., "
                             "backend= or serve=)")
        if ranks is not None:
            raise UsageError(f"--model {name} is loaded already, its engine split as it was: drop "
                             "--tensor-parallel-size, or load it with engine_args={'tensor_parallel_size': N}")
        if remote is not None:
            raise UsageError(f"--model {name} is loaded already: drop --remote, or load it with "
                             "pipatch.load_model(..., remote=True)")
        return model
    return _load(name, backend, serve, api_key, ranks, remote)


def _load(name: str | None, backend: str | None = None, serve: str | None = None, api_key: str | None = None,
          ranks: str | None = None, remote: str | None = None) -> Any:
    # transformers' progress bars (the first load's GGUF conversion too) are tqdm *widgets* in a
    # notebook: once the kernel is gone the saved cell would show "Error displaying widget".
    try:
        with no_progress_bar():
            if serve is not None:
                return shared_model(name, serve=serve, api_key=api_key or os.environ.get("PIPATCH_API_KEY"),
                                    tensor_parallel_size=ranks, remote=remote)
            return shared_model(name, backend=backend or "transformers", tensor_parallel_size=ranks, remote=remote)
    except PipatchError as error:
        raise UsageError(str(error)) from None


def _placeholder(shell: Any) -> Any:
    """In a kernel, a line shown at once, replaced by the grid when the sweep starts."""
    if getattr(shell, "kernel", None) is None:
        return None
    from IPython.display import display

    return display({"text/plain": "pipatch: loading the model and running the baselines…"},
                   raw=True, display_id=True)


def _run(shell: Any, entry: Experiment, name: str, args: argparse.Namespace, keywords: dict[str, Any]) -> None:
    """Load the model, plan (baselines), run live, bind the result to ``name``."""
    placeholder = _placeholder(shell)
    try:
        model = _model_of(shell, args)
        try:
            plan = plan_experiment(entry, model, **keywords)
        except PipatchError as error:
            raise UsageError(f"%%{entry.name}: {error}") from None
        except KeyboardInterrupt:
            raise UsageError(f"%%{entry.name}: interrupted while running the baselines; nothing was bound") from None
    except BaseException:
        if placeholder is not None:
            placeholder.update({"text/plain": ""}, raw=True)
        raise
    try:
        result = run_live(plan, handle=placeholder)
    except EngineError as error:
        partial = error.partial if error.partial is not None else plan.result
        shell.user_ns[name] = partial
        raise UsageError(f"{error} — the partial result is bound to {name} (status {partial.status!r})") from None
    shell.user_ns[name] = result
    if result.status != "done":
        print(f"pipatch: {result.status}: {result.message} — the partial result is bound to {name}", file=sys.stderr)


def make_magic(shell: Any, entry: Experiment) -> Callable[[str, str], None]:
    """The cell magic ``%%<entry.name>`` for ``shell``; its ``__doc__`` is its options' help."""
    parser = magic_parser(entry)

    def magic(line: str, cell: str) -> None:
        args = _parse(parser, line)
        try:
            prompts = entry.prompts.from_body(cell)
            keywords = entry.keywords(given_options(args, entry), prompts)
        except PipatchError as error:
            raise UsageError(f"%%{entry.name}: {error}") from None
        _run(shell, entry, args.out, args, keywords)

    magic.__name__ = magic.__qualname__ = entry.name
    magic.__doc__ = parser.format_help()
    return magic


def make_compare_magic(shell: Any) -> Callable[..., None]:
    """``%%compare [-o NAME] [--values raw] [--view VIEW] a b``: show ``a − b`` of two results
    of the user namespace (or two result files) and bind it to ``NAME``."""
    parser = _MagicParser(prog="%%compare", add_help=False, formatter_class=argparse.RawDescriptionHelpFormatter,
                          description="a − b of two results, cell by cell (pipatch.compare).\n\nExamples::\n\n"
                                      "    %compare -o moved f32 bf16\n\n    %%compare -o moved\n    f32 bf16")
    parser.add_argument("names", nargs="*", metavar="A B",
                        help="two variables holding pipatch Results (or result files): a, then b; on the line "
                             "or in the cell body")
    parser.add_argument("--values", default="recovery", choices=VALUES,
                        help="subtract normalized recovery (default) or the raw metric")
    parser.add_argument("--view", default=None, help="compare only this view (resid, mlp, attn, ...)")
    parser.add_argument("-o", "--out", default="_compare", help="variable to bind the comparison to (default _compare)")

    def magic(line: str, cell: str | None = None) -> None:
        from IPython.display import display

        args = _parse(parser, line)
        names = args.names + arg_split(cell or "", posix=True)
        if len(names) != 2:
            raise UsageError(f"%%compare: name two results, a then b (got {len(names)}: {' '.join(names) or 'none'})")
        sides = [_result_named(shell, name) for name in names]
        try:
            result = compare(*sides, values=args.values, view=args.view)
        except PipatchError as error:
            raise UsageError(f"%%compare: {error}") from None
        shell.user_ns[args.out] = result
        display(result)

    magic.__name__ = magic.__qualname__ = "compare"
    magic.__doc__ = parser.format_help()
    return magic


def _result_named(shell: Any, name: str) -> Result | str:
    """The Result a variable holds; a name that is no identifier is a result file's path."""
    if not name.isidentifier():
        return name
    if name not in shell.user_ns:
        raise UsageError(f"%%compare: no variable {name!r}: name two Results (the -o of %%trace, say) or two result files")
    value = shell.user_ns[name]
    if not isinstance(value, Result):
        raise UsageError(f"%%compare: {name} is of type {type(value).__name__}, not a pipatch Result")
    return value


def study_magic_parser(entry: Experiment) -> argparse.ArgumentParser:
    """The parser of ``%study`` / ``%%study`` for ``entry`` (``--experiment``): the study's
    flags (:mod:`pipatch._studies._front`), ``--model`` / ``--backend`` and ``-o``."""
    from ._studies._front import add_study_arguments

    parser = _MagicParser(
        prog="%study", add_help=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run an experiment over many facts into a durable SQLite store (pipatch.study); rerun to "
                    "resume.\n\nExamples::\n\n    %study known_1000.json --store known.sqlite --sites resid,mlp,attn "
                    "-o known\n\n    %%study --store mine.sqlite -o mine\n    {\"prompt\": \"The Eiffel Tower is in "
                    "the city of\", \"subject\": \"Eiffel Tower\", \"attribute\": \"Paris\"}\n\n"
                    "The cell body of %%study is a facts file's path, or the facts as JSON lines (or a JSON list). "
                    f"The options shown are {entry.name}'s.",
    )
    add_study_arguments(parser, entry, facts_required=False)
    _add_model_arguments(parser)
    parser.add_argument("-o", "--out", default="_study", help="variable to bind the Study to (default _study)")
    return parser


def make_study_magic(shell: Any) -> Callable[..., None]:
    """``%study FILE --store PATH ... -o NAME`` and ``%%study --store PATH -o NAME`` (the body:
    a path, or JSON lines): run :func:`pipatch.study` and bind the :class:`~pipatch.Study`."""
    from ._studies import study
    from ._studies._facts import records_from_text
    from ._studies._front import probe_experiment, study_keywords

    def magic(line: str, cell: str | None = None) -> None:
        try:
            argv = arg_split(line, posix=True)
            entry = probe_experiment(argv)
        except (ValueError, PipatchError) as error:
            raise UsageError(f"%study: {error}") from None
        args = _parse(study_magic_parser(entry), line)
        try:
            keywords = study_keywords(args, entry)
            body = (cell or "").strip()
            if args.facts is not None and body:
                raise PipatchError("give the facts once: a FILE on the line, or the cell body")
            if args.facts is not None:
                facts: Any = args.facts
            elif body and "\n" not in body and not body.startswith(("{", "[")):
                facts = body  # a path
            elif body:
                facts = records_from_text(body, "the cell body")
            else:
                raise PipatchError("no facts: name a file (%study FILE --store PATH) or put them in the %%study cell")
        except PipatchError as error:
            raise UsageError(f"%study: {error}") from None
        model = _model_of(shell, args)
        try:
            found = study(model, facts, entry, show=getattr(shell, "kernel", None) is not None, **keywords)
        except PipatchError as error:
            raise UsageError(f"%study: {error}") from None
        shell.user_ns[args.out] = found
        print(f"{found.summary()} — bound to {args.out}")

    magic.__name__ = magic.__qualname__ = "study"
    magic.__doc__ = study_magic_parser(probe_experiment([])).format_help()
    return magic


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext pipatch``: register one cell magic per experiment, ``%%compare`` and ``%study``."""
    for entry in EXPERIMENTS.values():
        ipython.register_magic_function(make_magic(ipython, entry), "cell", entry.name)
    ipython.register_magic_function(make_compare_magic(ipython), "line_cell", "compare")
    ipython.register_magic_function(make_study_magic(ipython), "line_cell", "study")
