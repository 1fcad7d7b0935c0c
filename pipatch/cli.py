"""The ``pipatch`` command: every experiment from a shell.

One subcommand per entry of :data:`pipatch._experiments._registry.EXPERIMENTS`, with the same options as
its Python function::

    pipatch trace "The Eiffel Tower is in the city of" --subject "Eiffel Tower" --answer " Paris"
    pipatch patch --clean "The Eiffel Tower is in the city of" \\
                  --corrupt "The Colosseum is in the city of" --answer " Paris" --foil " Rome"
    pipatch attribute --clean ... --corrupt ... --answer " Paris" --foil " Rome" --site head --verify 5
    pipatch path-patch --clean ... --corrupt ... --answer " Paris" --foil " Rome" --sender 12.2
    pipatch compare f32.json bf16.json --png moved.png

``trace`` takes one prompt or several (a dataset, with ``--subject`` / ``--answer`` once or
once per prompt); the other commands take ``--clean`` / ``--corrupt``, repeated for a dataset
(paired in order). Every command prints a text heatmap (columns: tokens or heads, rows:
layers), shows progress on stderr, and writes ``--json`` (``{"kind", "model", "tokens",
"layers", "grid", "metric", "clean", "corrupt", ...}``), ``--png``, ``--save``
(safetensors) and ``--code`` (a plain nnsight script that recomputes the grid) files.
``compare A B`` reads two such files (``--json`` or ``--save``) and does the same for
``a − b`` (:func:`pipatch.compare`). Bad input prints one line on stderr, naming the command,
and exits with status 2. ``--serve URL`` runs any experiment on a server started with
``pipatch serve [MODEL]`` (see :mod:`pipatch._serving.serve`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from ._base.progress import run_with_progress
from ._engine import EngineError
from ._experiments._api import plan as plan_experiment
from ._experiments._registry import EXPERIMENTS, Experiment, add_options, given_options
from ._model.models import BACKENDS, PipatchError
from ._results.compare import VALUES, compare
from ._results.result import result_file


class _Parser(argparse.ArgumentParser):
    #: The subcommands' parsers by command name (on the top-level parser).
    commands: dict[str, argparse.ArgumentParser]

    def error(self, message: str) -> None:  # one line naming the command, not usage + message
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            # argparse reports a subcommand's unknown arguments from the top-level parser.
            owner = getattr(self, "commands", {}).get(getattr(parsed, "command", None), self)
            owner.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def _outputs() -> argparse.ArgumentParser:
    outputs = _Parser(add_help=False)
    outputs.add_argument("--json", metavar="FILE", help="write the grid and metadata as JSON")
    outputs.add_argument("--png", metavar="FILE", help="write a heatmap PNG")
    # dest is not "save": nnsight gives every object a .save() that would shadow it.
    outputs.add_argument("--save", dest="save_path", metavar="FILE", type=_result_file,
                         help="write the full result: FILE.safetensors, or FILE.json (plain JSON)")
    return outputs


def _result_file(value: str) -> str:
    """``--save``'s file, its suffix checked before anything runs (nothing computed is lost)."""
    try:
        return str(result_file(value))
    except PipatchError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _common(outputs: argparse.ArgumentParser, code: bool = True) -> argparse.ArgumentParser:
    common = _Parser(add_help=False, parents=[outputs])
    common.add_argument("--model", default=None, help="HF id or local folder (default: embedded Gemma 3 270M)")
    common.add_argument("--device", default=None,
                        help="cpu, cuda, cuda:1, ... (default: cuda when torch sees a GPU, else cpu)")
    common.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16")
    common.add_argument("--backend", default="transformers", choices=BACKENDS,
                        help="what runs the model: transformers (default) or vllm (pip install 'pipatch[vllm]')")
    common.add_argument("--tensor-parallel-size", metavar="N", default=None,
                        help="split the vLLM engine over N ranks (with --backend vllm)")
    common.add_argument("--serve", metavar="URL", default=None,
                        help="run on a `pipatch serve` server (http://host:port) instead of in this process")
    common.add_argument("--api-key", default=None, help="the server's key (with --serve; default: $PIPATCH_API_KEY)")
    common.add_argument("--remote", nargs="?", const="ndif", default=None, metavar="local",
                        help="run as requests on NDIF (key: $NDIF_API_KEY); --remote local: nnsight's offline "
                             "simulation of it")
    if code:
        common.add_argument("--code", metavar="FILE",
                            help="write a plain nnsight + transformers script that recomputes the grid (Result.code())")
    common.add_argument("--quiet", action="store_true", help="no progress bar")
    return common


def build_parser() -> argparse.ArgumentParser:
    """``pipatch COMMAND ...``, one command per experiment of the registry, and ``compare``."""
    parser = _Parser(prog="pipatch", description="Causal tracing and activation patching for language models. "
                     "`pipatch COMMAND --help` lists a command's options.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    outputs = _outputs()
    common = _common(outputs)
    parser.commands = {}
    for entry in EXPERIMENTS.values():
        command = sub.add_parser(entry.command, parents=[common], help=entry.summary, description=entry.summary)
        command.set_defaults(experiment=entry, run=_run)
        parser.commands[entry.command] = command
        form = entry.prompts
        if len(form.fields) == 1 and form.alternative is None:
            (field,) = form.fields
            command.add_argument(field, nargs="+", metavar=field.upper(),
                                 help=f"the {field} (several: a dataset, averaged over named positions)")
        else:
            for field in form.fields:
                command.add_argument(f"--{field}", action="append", required=form.alternative is None,
                                     metavar="PROMPT",
                                     help=f"the {field} prompt (repeat --{form.fields[0]} / --{form.fields[-1]} "
                                          "for a dataset, paired in order)")
            for field in form.alternative.fields if form.alternative else ():
                command.add_argument(f"--{field}", action="append", metavar="PROMPT",
                                     help=f"instead of --{' / --'.join(form.fields)}: {form.alternative.doc}")
        add_options(command, entry)
    summary = "a − b of two saved results, cell by cell (their --json or --save files)"
    command = sub.add_parser("compare", parents=[outputs], help=summary, description=summary)
    command.set_defaults(run=_run_compare)
    parser.commands["compare"] = command
    for side in ("a", "b"):
        command.add_argument(side, metavar=side.upper(), help=f"{side}: a result file (.json or .safetensors)")
    command.add_argument("--values", default="recovery", choices=VALUES,
                         help="subtract normalized recovery (default) or the raw metric")
    command.add_argument("--view", default=None, help="compare only this view (resid, mlp, attn, ...)")
    # Listed here so that `pipatch --help` names them; main() hands their arguments to their own parsers.
    for name, summary in _OWN_PARSERS.items():
        parser.commands[name] = sub.add_parser(name, help=summary, add_help=False)
    return parser


#: The commands main() parses with parsers of their own, and what each does.
_OWN_PARSERS = {
    "study": "An experiment over many facts (ROME's known_1000.json, .jsonl, .csv) into a SQLite store; "
             "rerun to resume (pipatch study --help)",
    "serve": "Start a server on a vLLM engine that --serve URL runs experiments on (pipatch serve --help)",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``pipatch`` with ``argv`` (default: the process's); returns the exit status.

    0 when the sweep finished, 130 when it was interrupted (Ctrl-C keeps the partial grid and
    still writes the files), 1 when a batch failed (the partial grid is written), 2 for bad
    input (one line on stderr).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        from ._serving.serve import main as serve

        return serve(argv[1:])
    if argv[:1] == ["study"]:
        return study_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    prog = f"{parser.prog} {args.command}"
    try:
        return args.run(args)
    except PipatchError as error:
        sys.stderr.write(f"{prog}: error: {error}\n")
        return 2
    except EngineError as error:
        sys.stderr.write(f"{prog}: failed: {error}\n")
        if error.partial is not None:
            _write(error.partial, args)
        return 1


def _run(args: argparse.Namespace) -> int:
    from ._backends._load import shared_model

    entry: Experiment = args.experiment
    # Everything that can be checked without the model is checked before loading it.
    prompts = entry.prompts.collect({field: getattr(args, field) for field in entry.prompts.every_field})
    keywords = entry.keywords(given_options(args, entry), prompts)
    api_key = args.api_key or (os.environ.get("PIPATCH_API_KEY") if args.serve else None)
    model = shared_model(args.model, dtype=args.dtype, device=args.device, backend=args.backend,
                         serve=args.serve, api_key=api_key, tensor_parallel_size=args.tensor_parallel_size,
                         remote=args.remote)
    result = run_with_progress(plan_experiment(entry, model, **keywords), entry.command, progress=not args.quiet)
    _show(result, args)
    return 0 if result.status == "done" else 130


def _run_compare(args: argparse.Namespace) -> int:
    _show(compare(args.a, args.b, values=args.values, view=args.view), args)
    return 0


def _show(result: Any, args: argparse.Namespace) -> None:
    """Print every view's text grid, then write the files asked for."""
    for view in result.views:
        print(result.text(view))
        print()
    _write(result, args)


def _write(result: Any, args: argparse.Namespace) -> None:
    if args.json:
        result.to_json(args.json)
        print(f"wrote {args.json}")
    if args.png:
        from ._results.views import png

        with open(args.png, "wb") as handle:
            handle.write(png(result.to_state(live=True), dpi=110))
        print(f"wrote {args.png}")
    if args.save_path:
        result.save(args.save_path)
        print(f"wrote {args.save_path}")
    if getattr(args, "code", None):  # experiments only (compare has no --code)
        text = result.code()
        with open(args.code, "w", encoding="utf-8") as handle:
            handle.write(text)
        print(f"wrote {args.code}")


# --------------------------------------------------------------------------------------------
# pipatch study
# --------------------------------------------------------------------------------------------


def study_parser(entry: Experiment) -> argparse.ArgumentParser:
    """``pipatch study FILE --store PATH [--experiment NAME] ...``: the study's own flags, then
    ``entry``'s options (its per-prompt ones optional: each fact gives its own)."""
    from ._studies._front import add_study_arguments

    parser = _Parser(prog="pipatch study", parents=[_common(_Parser(add_help=False), code=False)],
                     description="Run an experiment over many facts (ROME's known_1000.json, .jsonl, .csv) into a "
                                 "durable SQLite store; rerun to resume. The options below are "
                                 f"{entry.name}'s: --experiment NAME --help lists another's.")
    parser.add_argument("--csv", metavar="FILE", help="write the tidy table (Study.frame()) as CSV")
    add_study_arguments(parser, entry)
    return parser


def study_main(argv: Sequence[str]) -> int:
    """``pipatch study``: prints a progress bar (one step per fact) and the summary line. 0 when
    every fact is stored, 130 when interrupted (the store keeps the finished facts: run it again
    to resume), 2 for bad input (one line)."""
    from ._backends._load import shared_model
    from ._studies import study
    from ._studies._facts import facts_file
    from ._studies._front import probe_experiment, study_keywords

    prog = "pipatch study"
    try:
        entry = probe_experiment(list(argv))
    except PipatchError as error:
        sys.stderr.write(f"{prog}: error: {error}\n")
        return 2
    args = study_parser(entry).parse_args(list(argv))
    try:
        keywords = study_keywords(args, entry)
        facts_file(args.facts)  # before the model loads: a wrong path is one line at once
        api_key = args.api_key or (os.environ.get("PIPATCH_API_KEY") if args.serve else None)
        model = shared_model(args.model, dtype=args.dtype, device=args.device, backend=args.backend,
                             serve=args.serve, api_key=api_key, tensor_parallel_size=args.tensor_parallel_size,
                             remote=args.remote)
        try:
            found = study(model, args.facts, entry, progress=not args.quiet, **keywords)
        except KeyboardInterrupt:
            sys.stderr.write(f"{prog}: interrupted; the finished facts are in {args.store}: run again to resume\n")
            return 130
    except PipatchError as error:
        sys.stderr.write(f"{prog}: error: {error}\n")
        return 2
    for row in [row for row in found._rows() if row["status"] == "error"][:3]:
        sys.stderr.write(f"{prog}: {row['message']}\n")
    print(found.summary())
    if args.csv:
        found.to_csv(args.csv)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
