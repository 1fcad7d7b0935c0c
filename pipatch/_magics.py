"""``%%trace`` and ``%%patch``: causal tracing and activation patching from a notebook cell.

Registered by ``%load_ext pipatch`` only (never as a side effect of ``import pipatch``)::

    %%trace --subject "Eiffel Tower" --answer " Paris" -o eiffel
    The Eiffel Tower is in the city of

    %%patch --answer " Paris" --foil " Rome" --site head -o heads
    clean: The Eiffel Tower is in the city of
    corrupt: The Colosseum is in the city of

Each magic plans the sweep (its baselines run first), shows a live :class:`PatchGrid` that
fills in row by row (Stop button; a click shows the patched run's top-5 next tokens), and
binds the :class:`~pipatch.Result` to ``-o NAME`` (default ``_trace`` / ``_patch``) in the
user namespace. When the run ends the live widget is replaced by the static grid (pipatch
MIME + PNG + text), which a saved notebook shows without a kernel; the magic itself returns
``None`` so the grid is not shown twice. ``PatchGrid(NAME)`` shows a clickable grid again.

A stopped (Stop button), interrupted (Kernel ▸ Interrupt) or failed run still binds its
partial result, whose ``status`` says which; a line on stderr says so too.

A bad cell (missing ``--answer``, subject not in the prompt, no ``corrupt:`` line, prompts of
different token lengths, unknown site, ...) is refused with one ``UsageError`` line and binds
nothing: earlier variables stay as they were.

The magics run pipatch's own functions on the cell's text; they never execute user code
inside an nnsight trace.
"""

from __future__ import annotations

import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.utils.process import arg_split

from ._engine import EngineError
from ._models import PipatchError, shared_model

__all__ = ["PipatchMagics", "load_ipython_extension", "parse_patch_body"]

DEFAULT_TRACE_NAME = "_trace"
DEFAULT_PATCH_NAME = "_patch"


def _parse(magic: Any, line: str) -> Any:
    """Parse the magic's line like a shell does: ``--answer " Paris"`` gives `` Paris``.

    (IPython's ``parse_argstring`` keeps the quotes, which would make the answer 3 tokens.)
    """
    try:
        argv = arg_split(line, posix=True)
    except ValueError as error:
        raise UsageError(f"cannot split the magic's arguments: {error} (check the quotes)") from None
    args = magic.parser.parse_args(argv)
    if not str(args.out).isidentifier():
        raise UsageError(f"-o needs a variable name, got {args.out!r}")
    return args


def _scale(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"--scale must be a number or 'auto', got {text!r}") from None


def _positions(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(p) for p in text.replace(" ", "").split(",") if p]
    except ValueError:
        raise UsageError(f"--positions must be comma-separated integers such as 2,-1, got {text!r}") from None


def parse_patch_body(cell: str) -> tuple[str, str]:
    """``clean: …`` and ``corrupt: …`` lines → ``(clean, corrupt)``.

    Blank lines and lines starting with ``#`` are ignored; the text after the colon is
    stripped of surrounding whitespace.
    """
    prompts: dict[str, str] = {}
    for number, line in enumerate(cell.splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        key, sep, value = text.partition(":")
        key = key.strip().lower()
        if not sep or key not in ("clean", "corrupt"):
            raise UsageError(f"%%patch line {number}: expected 'clean: <prompt>' or 'corrupt: <prompt>', "
                             f"got {text[:60]!r}")
        if key in prompts:
            raise UsageError(f"%%patch line {number}: a second '{key}:' line; give one clean and one corrupt prompt")
        prompts[key] = value.strip()
    for key in ("clean", "corrupt"):
        if not prompts.get(key):
            raise UsageError(f"%%patch needs a '{key}: <prompt>' line in the cell body")
    return prompts["clean"], prompts["corrupt"]


@magics_class
class PipatchMagics(Magics):
    """The ``%%trace`` and ``%%patch`` cell magics."""

    # -- shared ---------------------------------------------------------------------------
    def _model(self, name: str | None) -> Any:
        """``--model``: a variable holding a loaded model, else a hub id / local folder."""
        if name is None:
            return self._load(None)
        user_ns = self.shell.user_ns if self.shell is not None else {}
        if name.isidentifier() and name in user_ns:
            model = user_ns[name]
            if not (hasattr(model, "trace") and hasattr(model, "tokenizer")):
                raise UsageError(f"--model {name}: that variable is a {type(model).__name__}, not a loaded model "
                                 "(use pipatch.load_model(...)), or pass a hub id / folder")
            return model
        return self._load(name)

    @staticmethod
    def _load(name: str | None) -> Any:
        # transformers' "Loading weights" bar is a tqdm *widget* in a notebook: once the kernel
        # is gone the saved cell would show "Error displaying widget" above the grid.
        from transformers.utils import logging as hf_logging

        bar_was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            return shared_model(name)
        except PipatchError as error:
            raise UsageError(str(error)) from None
        finally:
            if bar_was_on:
                hf_logging.enable_progress_bar()

    def _placeholder(self) -> Any:
        """In a kernel, a line shown at once, replaced by the grid when the sweep starts."""
        if getattr(self.shell, "kernel", None) is None:
            return None
        from IPython.display import display

        return display({"text/plain": "pipatch: loading the model and running the baselines…"},
                       raw=True, display_id=True)

    def _run(self, name: str, model_arg: str | None, planner: Any) -> None:
        """Load the model, plan (baselines), run live, bind the result to ``name``."""
        from ._live import run_live

        placeholder = self._placeholder()
        try:
            model = self._model(model_arg)
            try:
                plan = planner(model)
            except PipatchError as error:
                raise UsageError(str(error)) from None
            except KeyboardInterrupt:
                raise UsageError("interrupted while running the baselines; nothing was bound") from None
        except BaseException:
            if placeholder is not None:
                placeholder.update({"text/plain": ""}, raw=True)
            raise
        try:
            result = run_live(model, plan, handle=placeholder)
        except EngineError as error:
            partial = error.partial if error.partial is not None else plan.result
            self.shell.user_ns[name] = partial
            raise UsageError(f"{error} — the partial result is bound to {name} (status {partial.status!r})") from None
        self.shell.user_ns[name] = result
        if result.status != "done":
            print(f"pipatch: {result.status}: {result.message} — the partial result is bound to {name}",
                  file=sys.stderr)

    # -- %%trace --------------------------------------------------------------------------
    @magic_arguments()
    @argument("--subject", required=True, help="the subject's text as it appears in the prompt (noised)")
    @argument("--answer", required=True, help="the expected next token, e.g. \" Paris\" (quote leading spaces)")
    @argument("--model", default=None,
              help="a variable holding a loaded model, or a hub id / local folder (default: embedded Gemma 3 270M)")
    @argument("--seeds", type=int, default=10, help="noise draws averaged over (default 10)")
    @argument("--scale", default="auto", help="noise scale in units of σ, or 'auto' (default)")
    @argument("--kind", default="resid", help="resid, mlp, attn or a comma-separated list (default resid)")
    @argument("--window", type=int, default=10, help="layers restored together for mlp / attn (default 10)")
    @argument("--metric", default="prob", help="prob (default) or logprob")
    @argument("--batch-size", type=int, default=None, help="invokes per trace (default: sized automatically)")
    @argument("--control", action="store_true", help="restore from the corrupt run itself (must give 0)")
    @argument("-o", "--out", default=DEFAULT_TRACE_NAME,
              help=f"variable to bind the Result to (default {DEFAULT_TRACE_NAME})")
    @cell_magic
    def trace(self, line: str, cell: str) -> None:
        """Causal tracing of the prompt in the cell body, with a live grid.

        The cell body is the prompt (surrounding whitespace stripped). Example::

            %%trace --subject "Eiffel Tower" --answer " Paris" -o eiffel
            The Eiffel Tower is in the city of
        """
        from ._protocols.tracing import plan_trace

        args = _parse(self.trace, line)
        prompt = cell.strip()
        if not prompt:
            raise UsageError("%%trace needs the prompt as the cell body")

        def planner(model):
            return plan_trace(model, prompt, subject=args.subject, answer=args.answer, seeds=args.seeds,
                              scale=_scale(args.scale), kind=args.kind, window=args.window, metric=args.metric,
                              control=args.control, batch_size=args.batch_size)

        self._run(args.out, args.model, planner)

    # -- %%patch --------------------------------------------------------------------------
    @magic_arguments()
    @argument("--answer", required=True, help="the clean prompt's answer token, e.g. \" Paris\"")
    @argument("--foil", default=None, help="the corrupt prompt's answer token (needed by logit_diff)")
    @argument("--site", default="resid", help="resid (default), attn, mlp or head")
    @argument("--metric", default=None,
              help="logit_diff (default with --foil), prob (default without), logprob")
    @argument("--direction", default="denoise", help="denoise (default), noise, zero or mean")
    @argument("--positions", default=None, help="positions to sweep, e.g. 2,-1 (default all)")
    @argument("--model", default=None,
              help="a variable holding a loaded model, or a hub id / local folder (default: embedded Gemma 3 270M)")
    @argument("--batch-size", type=int, default=None, help="invokes per trace (default: sized automatically)")
    @argument("-o", "--out", default=DEFAULT_PATCH_NAME,
              help=f"variable to bind the Result to (default {DEFAULT_PATCH_NAME})")
    @cell_magic
    def patch(self, line: str, cell: str) -> None:
        """Activation patching between the two prompts of the cell body, with a live grid.

        The body holds one ``clean: <prompt>`` and one ``corrupt: <prompt>`` line, of equal
        token length. Example::

            %%patch --answer " Paris" --foil " Rome" --site head -o heads
            clean: The Eiffel Tower is in the city of
            corrupt: The Colosseum is in the city of
        """
        from ._protocols.patching import plan_patch

        args = _parse(self.patch, line)
        clean, corrupt = parse_patch_body(cell)
        metric = args.metric or ("logit_diff" if args.foil is not None else "prob")
        positions = _positions(args.positions)

        def planner(model):
            return plan_patch(model, clean=clean, corrupt=corrupt, answer=args.answer, foil=args.foil,
                              site=args.site, metric=metric, direction=args.direction, positions=positions,
                              batch_size=args.batch_size)

        self._run(args.out, args.model, planner)


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext pipatch``: register ``%%trace`` and ``%%patch``."""
    ipython.register_magics(PipatchMagics)
