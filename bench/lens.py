"""The logit lens on a long prompt: its time against one plain forward of the same prompt.

The lens reads (:mod:`pipatch._programs.lens`): one forward of the prompt, every block's
output read at the positions asked for, each reading then sent through the final norm and
the unembedding. So its time is one forward plus ``layers × positions`` readings through the
unembedding; on the embedded default (Gemma 3 270M: a 262,144-token vocabulary, 640 wide) a
reading through it costs 335 MFLOPs, about what a position costs through all 18 blocks and
the unembedding in the forward. Reading every position of a 1,000-token prompt is therefore
about 18 forwards' worth of unembedding whatever the implementation (the FLOP floor printed);
the last few positions cost about one forward.

Rows, on a 1,000-token prompt (filler text before "The Eiffel Tower is in the city of"),
P(" Paris"), float32 on this machine's CPU:

* ``forward``: one plain forward (``model(ids)``, the logits at every position, as
  transformers computes them by default), and one with the last position's logits only;
* ``lens last 16``: ``pipatch.lens(..., positions=range(-16, 0))``;
* ``lens all, logit difference``: every position with ``foil=" Rome"``,
  ``metric="logit_diff"``: a logit difference reads two rows of the unembedding per reading,
  not 262k, so the whole lens stays near one forward;
* ``lens all``: every position (``pipatch.lens(...)``), P(" Paris"), with the FLOP floor of its
  unembedding (a probability needs every logit's share of the softmax).

Each is timed :data:`REPEAT` times but ``lens all`` (once), the best counting. Figures go to
``bench/results/lens.json``.

Run: ``make bench`` (or ``.venv/bin/python bench/lens.py [--tokens N] [--skip-all]``).
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pipatch  # noqa: E402
from bench.run import best, prompt_of, write_report  # noqa: E402
from pipatch._backends import backend_for  # noqa: E402

REPEAT = 2



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--skip-all", action="store_true", help="skip the lens at every position (minutes on a CPU)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "lens.json"))
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    model = pipatch.load_model(device="cpu")
    backend = backend_for(model)
    prompt, _ = prompt_of(model, args.tokens)
    ids = model.tokenizer(prompt, return_tensors="pt").input_ids
    hf, n_layers = model._module, backend.adapter.n_layers
    pipatch.lens(model, "The Eiffel Tower is in the city of", answer=" Paris")  # warm up
    forward, _ = best(lambda: hf(ids), REPEAT)
    forward_last, _ = best(lambda: hf(ids, logits_to_keep=1), REPEAT)
    last16, few = best(lambda: pipatch.lens(model, prompt, answer=" Paris", positions=list(range(-16, 0))), REPEAT)
    diff_all, _ = best(lambda: pipatch.lens(model, prompt, answer=" Paris", foil=" Rome", metric="logit_diff"),
                       REPEAT)
    vocab, d = len(model.tokenizer), backend.adapter.d_model
    report = {"machine": {"python": platform.python_version(), "torch": torch.__version__,
                          "torch_threads": torch.get_num_threads()},
              "tokens": ids.shape[1], "forward_s": forward, "forward_last_logits_s": forward_last,
              "lens_last16_s": last16, "lens_last16_x_forward": last16 / forward,
              "lens_all_logit_diff_s": diff_all, "lens_all_logit_diff_x_forward": diff_all / forward}
    lines = [f"logit lens, {ids.shape[1]} tokens, P(' Paris'), {torch.get_num_threads()} thread(s):",
             f"  one plain forward (logits at every position) {forward:7.2f} s; last position's logits only "
             f"{forward_last:7.2f} s",
             f"  lens, last 16 positions   {last16:7.2f} s = {last16 / forward:5.2f}× one forward "
             f"({n_layers} × 16 readings through the unembedding)",
             f"  lens, all {ids.shape[1]} positions, logit difference {diff_all:7.2f} s = {diff_all / forward:5.2f}× "
             f"one forward ({n_layers} × {ids.shape[1]} readings through two rows of the unembedding)"]
    if not args.skip_all:
        every, full = best(lambda: pipatch.lens(model, prompt, answer=" Paris"), repeat=1)
        floor = 2 * d * vocab * n_layers * ids.shape[1]
        report.update({"lens_all_s": every, "lens_all_x_forward": every / forward, "lens_all_unembedding_gflop": floor / 1e9})
        lines.append(f"  lens, all {ids.shape[1]} positions {every:7.2f} s = {every / forward:5.2f}× one forward "
                     f"({n_layers} × {ids.shape[1]} readings: {floor / 1e12:.1f} TFLOP of unembedding alone)")
        assert torch.allclose(full.grid[:, -16:], few.grid, atol=1e-5), "the narrowed lens must equal the full one"
    return write_report(lines, report, args.out)


if __name__ == "__main__":
    sys.exit(main())
