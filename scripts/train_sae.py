"""Train the small SAE pipatch ships for the embedded model (issue #46), with SAELens's trainer.

What it trains: a TopK SAE (2,048 latents, k = 32) on the residual stream after block 6 of the
embedded Gemma 3 270M (``model.layers.6.output``, Gemma Scope 2's spelling, so
:func:`pipatch.load_sae` maps it to layer 6's ``resid_post``).

How: this script only collects activations (a forward hook on block 6, the forward stopped
there) and hands them to SAELens 6.54's own ``SAETrainer`` as its ``DataProvider`` (an iterator
of activation batches, the seam SAELens's synthetic-data training uses). SAELens normalizes the
activations while it trains, folds that scale back into the weights at the end, and writes the
folder (``cfg.json`` + ``sae_weights.safetensors``) with ``save_inference_model``. No trainer
is written here.

The corpus is what every pipatch install has, read in a fixed order, so a rerun sees the same
tokens:

* ROME's known facts as pipatch ships them (``pipatch.known_facts()``): each record's prompt
  followed by its ``prediction`` (GPT-2 XL's continuation), one sequence per fact;
* English prose from the docstrings of the running Python's standard library (modules,
  classes, functions; tests and long tables left out), cut into 128-token sequences.

Every tenth sequence is held out. The metrics, on the held-out tokens and read back through
``pipatch.load_sae`` from the written folder: L0 (latents firing per token), explained variance
(1 − Σ‖x − x̂‖² / Σ‖x − x̄‖²) and the share of latents that never fire. The BOS position is
left out of training and metrics: its residual is an order of magnitude larger than any other
token's and the same in every sequence. The metrics go to ``metrics.json`` beside the weights.

Run it from the repository root (SAELens installed, or ``PYTHONPATH=/path/to/sae-lens``)::

    python scripts/train_sae.py                 # writes pipatch/data/sae/gemma-3-270m-res-l6-topk-2k
    python scripts/train_sae.py --out /tmp/sae --docstring-tokens 100000 --cache /tmp/acts.safetensors
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import platform
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import pipatch
from pipatch._compat.nnsight import torch_module

LAYER = 6
HOOK = f"model.layers.{LAYER}.output"
D_SAE, K = 2048, 32
SEQ = 128  # tokens per docstring sequence, BOS included
HELD_OUT_EVERY = 10
OUT = Path(__file__).resolve().parents[1] / "pipatch" / "data" / "sae" / "gemma-3-270m-res-l6-topk-2k"


# -- the corpus --------------------------------------------------------------------------------
def fact_texts() -> list[str]:
    """Each known fact's prompt and GPT-2 XL's continuation of it."""
    records = json.loads(pipatch.known_facts().read_text())
    return [record["prompt"] + record["prediction"] for record in records]


def docstrings() -> Iterator[str]:
    """The standard library's docstrings of at least 200 characters, in sorted file order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        parts = path.relative_to(stdlib).parts
        if parts[0] in ("site-packages", "test", "idlelib", "lib2to3") or "tests" in parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node, clean=False)
                if text and len(text) >= 200:
                    yield inspect.cleandoc(text)


def sequences(tokenizer, docstring_tokens: int) -> list[list[int]]:
    """Token ids of every sequence: the facts' (each with its BOS), then the docstrings' stream
    cut into :data:`SEQ`-token pieces (each with a BOS) until ``docstring_tokens`` are taken."""
    bos = tokenizer.bos_token_id
    out = [tokenizer(text).input_ids for text in fact_texts()]
    stream: list[int] = []
    for text in docstrings():
        stream += tokenizer(text + "\n\n", add_special_tokens=False).input_ids
        if len(stream) >= docstring_tokens:
            break
    stream = stream[:docstring_tokens]
    out += [[bos, *stream[i:i + SEQ - 1]] for i in range(0, len(stream), SEQ - 1)]
    return out


# -- the activations ---------------------------------------------------------------------------
class _Stop(Exception):
    """Raised by the hook: nothing after block LAYER is needed."""


@torch.no_grad()
def activations(model, seqs: list[list[int]], batch: int = 16) -> torch.Tensor:
    """Block LAYER's output at every position but the BOS of every sequence ``[tokens, 640]``
    (float32), sequence by sequence in the order given."""
    hf = torch_module(model)
    taken: dict[int, torch.Tensor] = {}
    pad = model.tokenizer.pad_token_id

    def hook(module, inputs, output):
        taken[0] = output[0] if isinstance(output, tuple) else output
        raise _Stop

    handle = hf.model.layers[LAYER].register_forward_hook(hook)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # like lengths together: little padding
    rows: dict[int, torch.Tensor] = {}
    try:
        for start in range(0, len(order), batch):
            chunk = order[start:start + batch]
            width = max(len(seqs[i]) for i in chunk)
            ids = torch.full((len(chunk), width), pad)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, i in enumerate(chunk):  # padded on the right: the real tokens keep their positions
                ids[row, :len(seqs[i])] = torch.tensor(seqs[i])
                mask[row, :len(seqs[i])] = 1
            try:
                hf.model(input_ids=ids, attention_mask=mask)
            except _Stop:
                pass
            for row, i in enumerate(chunk):
                rows[i] = taken[0][row, 1:len(seqs[i])].float().clone()
    finally:
        handle.remove()
    return torch.cat([rows[i] for i in range(len(seqs))]) if rows else torch.empty(0, hf.config.hidden_size)


# -- training (SAELens) ------------------------------------------------------------------------
def batches(acts: torch.Tensor, size: int, seed: int) -> Iterator[torch.Tensor]:
    """Shuffled batches of ``acts``, epoch after epoch: SAELens's ``DataProvider``."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(acts), generator=generator)
        for start in range(0, len(order) - size + 1, size):
            yield acts[order[start:start + size]]


def train(acts: torch.Tensor, epochs: float, batch: int, lr: float, seed: int):
    from sae_lens import LoggingConfig, TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig
    from sae_lens.saes.sae import SAEMetadata
    from sae_lens.training.sae_trainer import SAETrainer

    torch.manual_seed(seed)
    cfg = TopKTrainingSAEConfig(
        d_in=acts.shape[1], d_sae=D_SAE, k=K, dtype="float32", device="cpu",
        normalize_activations="expected_average_only_in",  # folded into the weights when fit() ends
        metadata=SAEMetadata(model_name="google/gemma-3-270m", hook_name=HOOK, context_size=SEQ, prepend_bos=True))
    sae = TopKTrainingSAE(cfg)
    steps = int(epochs * len(acts)) // batch
    trainer_cfg = SAETrainerConfig(
        total_training_samples=steps * batch, train_batch_size_samples=batch, lr=lr, lr_end=lr / 10,
        lr_scheduler_name="cosineannealing", lr_warm_up_steps=steps // 20, lr_decay_steps=steps // 5,
        device="cpu", dead_feature_window=max(1, steps // 10), feature_sampling_window=max(1, steps // 4),
        logger=LoggingConfig(log_to_wandb=False), n_batches_for_norm_estimate=min(100, len(acts) // batch))
    trainer = SAETrainer(cfg=trainer_cfg, sae=sae, data_provider=batches(acts, batch, seed))
    # SAELens starts b_dec at zero, and a run of a few thousand steps does not carry it to the
    # residual stream's mean (far from zero in Gemma): start it there, in the scaled units the
    # SAE trains in (the scale estimated now by SAELens's own scaler, which fit() then keeps
    # and folds into the weights at the end).
    trainer.activation_scaler.estimate_scaling_factor(acts.shape[1], batches(acts, batch, seed),
                                                      trainer_cfg.n_batches_for_norm_estimate)
    sae.b_dec.data = acts.mean(0) * trainer.activation_scaler.scaling_factor
    return trainer.fit()


# -- the metrics (through pipatch's reader of the written folder) -------------------------------
@torch.no_grad()
def metrics(folder: Path, acts: torch.Tensor) -> dict[str, float]:
    sae = pipatch.load_sae(folder)
    latents = torch.cat([sae.encode(part) for part in acts.split(4096)])
    recon = torch.cat([sae.decode(part) for part in latents.split(4096)])
    residual = (acts - recon).pow(2).sum()
    total = (acts - acts.mean(0)).pow(2).sum()
    fired = (latents > 0)
    return {"l0": round(float(fired.sum(-1).float().mean()), 3),
            "explained_variance": round(float(1 - residual / total), 4),
            "dead_share": round(float((~fired.any(0)).float().mean()), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="the SAE folder to write (default: pipatch's data)")
    parser.add_argument("--docstring-tokens", type=int, default=10_000,
                        help="tokens taken from the standard library's docstrings")
    parser.add_argument("--epochs", type=float, default=5.0, help="passes over the training tokens")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, help="a safetensors file of the activations: read if it exists, "
                        "else written (reruns with other training settings skip the model)")
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    began = time.perf_counter()
    model = pipatch.load_model()
    seqs = sequences(model.tokenizer, args.docstring_tokens)
    n_facts = len(fact_texts())
    held = [i % HELD_OUT_EVERY == 0 for i in range(len(seqs))]
    counts = [len(s) - 1 for s in seqs]  # BOS left out
    if args.cache and args.cache.exists():
        acts = load_file(str(args.cache))["acts"]
        if len(acts) != sum(counts):
            raise SystemExit(f"{args.cache} holds {len(acts)} tokens, not this corpus's {sum(counts)}: delete it")
    else:
        acts = activations(model, seqs)
        if args.cache:
            save_file({"acts": acts.contiguous()}, str(args.cache))
    owner = torch.repeat_interleave(torch.tensor(held), torch.tensor(counts))
    train_acts, test_acts = acts[~owner], acts[owner]
    collected = time.perf_counter() - began
    print(f"collected {len(acts):,} tokens ({len(train_acts):,} train, {len(test_acts):,} held out) "
          f"in {collected:.0f} s", flush=True)

    torch.set_grad_enabled(True)
    began = time.perf_counter()
    sae = train(train_acts, args.epochs, args.batch, args.lr, args.seed)
    trained = time.perf_counter() - began
    torch.set_grad_enabled(False)
    args.out.mkdir(parents=True, exist_ok=True)
    sae.save_inference_model(args.out)
    for stray in ("sparsity.safetensors",):
        (args.out / stray).unlink(missing_ok=True)

    scores = metrics(args.out, test_acts)
    import sae_lens

    fact_tokens = sum(counts[:n_facts])
    report = {
        **scores,
        "held_out_tokens": len(test_acts),
        "hook": HOOK, "architecture": "topk", "d_sae": D_SAE, "k": K,
        "corpus": {"known_facts_tokens": fact_tokens, "known_facts_sequences": n_facts,
                   "stdlib_docstring_tokens": sum(counts[n_facts:]),
                   "stdlib_docstring_sequences": len(seqs) - n_facts,
                   "python": platform.python_version(), "train_tokens": len(train_acts),
                   "note": "tokens exclude each sequence's BOS; every 10th sequence is held out"},
        "training": {"trainer": f"sae_lens {sae_lens.__version__} SAETrainer", "epochs": args.epochs,
                     "batch": args.batch, "lr": args.lr, "seed": args.seed,
                     "collect_seconds": round(collected, 1), "train_seconds": round(trained, 1),
                     "torch": torch.__version__, "threads": torch.get_num_threads()},
    }
    (args.out / "metrics.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(scores))
    print(f"wrote {args.out} (train {trained:.0f} s)")


if __name__ == "__main__":
    main()
