"""The ``pipatch`` command: causal tracing and activation patching from a shell.

::

    pipatch trace "The Eiffel Tower is in the city of" --subject "Eiffel Tower" --answer " Paris"
    pipatch patch --clean "The Eiffel Tower is in the city of" \\
                  --corrupt "The Colosseum is in the city of" --answer " Paris" --foil " Rome"

Prints a text heatmap (tokens as columns, layers as rows) and the top cells, shows progress on
stderr, and writes ``--json`` / ``--png`` / ``--save`` (safetensors) files. Bad input prints
one line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from ._models import PipatchError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        self.exit(2, f"pipatch: error: {message} (see pipatch {self.prog.split()[-1]} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _scale(text: str):
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor 'auto'") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _positions(text: str) -> list[int]:
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pipatch", description="Causal tracing and activation patching for language models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    common = _Parser(add_help=False)
    common.add_argument("--model", default=None, help="HF id or local folder (default: embedded Gemma 3 270M)")
    common.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when torch sees a GPU, else cpu)")
    common.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16")
    common.add_argument("--batch-size", type=_positive_int, default=None, help="invokes per nnsight trace")
    common.add_argument("--json", metavar="FILE", help="write the grid and metadata as JSON")
    common.add_argument("--png", metavar="FILE", help="write a heatmap PNG")
    # dest is not "save": nnsight gives every object a .save() that would shadow it.
    common.add_argument("--save", dest="save_path", metavar="FILE", help="write the full result (safetensors)")
    common.add_argument("--quiet", action="store_true", help="no progress bar")

    t = sub.add_parser("trace", parents=[common], help="ROME causal tracing (noise the subject, restore states)")
    t.add_argument("prompt")
    t.add_argument("--subject", required=True, help="the subject's text as it appears in the prompt")
    t.add_argument("--answer", required=True, help="the expected next token, e.g. ' Paris'")
    t.add_argument("--seeds", type=_positive_int, default=10)
    t.add_argument("--scale", type=_scale, default="auto", help="noise scale in σ, or auto")
    t.add_argument("--kind", default="resid", help="resid, mlp, attn, or a comma-separated list")
    t.add_argument("--window", type=_positive_int, default=10, help="layers restored together for mlp/attn")

    p = sub.add_parser("patch", parents=[common], help="activation patching between a clean and a corrupt prompt")
    p.add_argument("--clean", required=True)
    p.add_argument("--corrupt", required=True)
    p.add_argument("--answer", required=True)
    p.add_argument("--foil", default=None)
    p.add_argument("--site", default="resid", help="resid, attn, mlp or head")
    p.add_argument("--metric", default="logit_diff", help="logit_diff, prob or logprob")
    p.add_argument("--direction", default="denoise", help="denoise, noise, zero or mean")
    p.add_argument("--positions", type=_positions, default=None, help="comma-separated, e.g. 2,-1")
    return parser


class _Progress:
    """A one-line progress bar on stderr, redrawn after each finished row."""

    def __init__(self, total_rows: int, enabled: bool):
        self.total, self.enabled, self.started = total_rows, enabled and total_rows > 0, time.perf_counter()

    def __call__(self, result, view: str, layer: int) -> None:
        if not self.enabled:
            return
        done = sum(result.rows_done.values())
        elapsed = time.perf_counter() - self.started
        eta = elapsed / done * (self.total - done) if done else 0.0
        bar = "#" * int(30 * done / self.total)
        sys.stderr.write(f"\r[{bar:<30}] {done}/{self.total} rows  {elapsed:5.1f}s  ~{eta:4.1f}s left ")
        sys.stderr.flush()
        if done >= self.total:
            sys.stderr.write("\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except PipatchError as error:
        sys.stderr.write(f"pipatch: error: {error}\n")
        return 2


def _run(args) -> int:
    import pipatch

    if args.command == "trace":
        kinds = [k.strip() for k in args.kind.split(",") if k.strip()]
        from ._protocols.tracing import _kinds

        _kinds(kinds)  # validate before the (slow) model load
    else:
        from ._engine import METRICS
        from ._protocols._inputs import SITES, check_choice
        from ._protocols.patching import DIRECTIONS

        check_choice(args.site, SITES, "site")
        check_choice(args.metric, METRICS, "metric")
        check_choice(args.direction, DIRECTIONS, "direction")
    from ._models import adapter_for, shared_model

    model = shared_model(args.model, dtype=args.dtype, device=args.device)

    n_layers = adapter_for(model).n_layers
    if args.command == "trace":
        progress = _Progress(n_layers * len(kinds), not args.quiet)
        result = pipatch.trace(
            model, args.prompt, subject=args.subject, answer=args.answer, seeds=args.seeds, scale=args.scale,
            kind=kinds, window=args.window, batch_size=args.batch_size, on_row=progress,
        )
    else:
        progress = _Progress(n_layers, not args.quiet)
        result = pipatch.patch(
            model, clean=args.clean, corrupt=args.corrupt, answer=args.answer, foil=args.foil, site=args.site,
            metric=args.metric, direction=args.direction, positions=args.positions,
            batch_size=args.batch_size, on_row=progress,
        )
    for view in result.views:
        print(result.text(view))
        print()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result.to_json(), handle, ensure_ascii=False, indent=1)
        print(f"wrote {args.json}")
    if args.png:
        from ._plot import png_bytes

        with open(args.png, "wb") as handle:
            handle.write(png_bytes(result, dpi=110))
        print(f"wrote {args.png}")
    if args.save_path:
        result.save(args.save_path)
        print(f"wrote {args.save_path}")
    return 0 if result.status == "done" else 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
