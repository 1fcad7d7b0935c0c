"""Faults, tried for real: interrupts, failing batches, out of memory, NaN, unsafe folders.

Faults are injected with ordinary PyTorch hooks on the real model (a layer that raises or
returns NaN); the model, nnsight and pipatch's engine all run for real.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import pipatch
from pipatch._engine import EngineError
from pipatch._experiments._api import plan_patch
from tests.conftest import COLOSSEUM, EIFFEL

PAIR = dict(clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome")


def _hooks(module: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


def test_interrupt_keeps_the_partial_grid_and_leaves_nothing_behind(model):
    hf = model._module
    ids = model.tokenizer(EIFFEL, return_tensors="pt").input_ids
    baseline = hf(ids).logits.clone()
    hooks_before = _hooks(hf)
    main = threading.main_thread().ident
    delay = random.uniform(0.05, 0.6)

    def on_row(result, view, layer):
        if layer == 15:  # the third row (rows run from the last layer); then interrupt at a random moment of a later batch
            threading.Timer(delay, signal.pthread_kill, (main, signal.SIGINT)).start()

    try:
        r = pipatch.trace(model, EIFFEL, subject="Eiffel Tower", answer=" Paris", seeds=10, scale=3.0,
                          sites="resid,mlp", batch_size=8, on_row=on_row)
    except KeyboardInterrupt:  # pragma: no cover - would mean the engine let it through
        pytest.fail("the interrupt escaped the engine")
    assert r.status == "interrupted" and "interrupted" in r.message
    done = r.rows_done["resid"]
    assert 3 <= done < 18 and list(r.finished_rows()) == list(range(18 - done, 18))
    assert torch.isfinite(r.raw["resid"][:, 18 - done :]).all()
    # No hook stays behind: the plain model and a clean nnsight run equal the baseline bit for bit.
    assert _hooks(hf) == hooks_before
    assert torch.equal(hf(ids).logits, baseline)
    with model.trace(ids):
        again = model.output.logits.save()
    assert torch.equal(again, baseline)


def test_a_failing_batch_is_named_and_finished_rows_are_kept(model):
    block = model._module.model.layers[5]
    calls = {"n": 0}

    def fault(module, args, output):
        if output.shape[1] > 20:
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected fault")

    handle = block.register_forward_hook(fault)
    try:
        with pytest.raises(EngineError, match=r"batch 1 of layers 8–5 \(28 cells\).*injected fault") as info:
            pipatch.patch(model, **PAIR, batch_size=28)
    finally:
        handle.remove()
    partial = info.value.partial
    # Block 5's runs longer than 20 positions: not the baselines (9), nor row 17 (its last
    # position only), but the rows from 16 down, four rows of 7 cells sharing one packed trace
    # (batch_size 28): 16-13 and 12-9 (block 5 skipped with cached values, its hook still
    # called), then 8-5, whose trace fails. Rows 17 to 9 are finished.
    assert partial.status == "failed" and partial.rows_done["resid"] == 9
    assert list(partial.finished_rows()) == list(range(9, 18)) and torch.isfinite(partial.raw["resid"][:, 9:]).all()
    assert torch.isnan(partial.raw["resid"][:, :9, 2:]).all()


def test_out_of_memory_halves_the_batch_and_changes_no_number(model):
    reference = pipatch.patch(model, **PAIR, batch_size=16)
    block = model._module.model.layers[-1]

    def small_memory(module, args, output):
        if output.shape[:2].numel() > 48:  # more positions in all than 48
            raise torch.OutOfMemoryError("out of memory (injected): tried to allocate 1 GiB")

    handle = block.register_forward_hook(small_memory)
    try:
        r = pipatch.patch(model, **PAIR, batch_size=16)
    finally:
        handle.remove()
    assert r.status == "done" and r.meta["engine"]["max_invokes"] <= 8
    assert torch.allclose(r.raw["resid"], reference.raw["resid"], atol=1e-5)


def test_nan_from_the_model_flags_the_row(model):
    block = model._module.model.layers[9].mlp  # inside the block: what the block computes

    def poison(module, args, output):
        return torch.full_like(output, float("nan"))

    plan = plan_patch(model, **PAIR)  # the baselines unpoisoned; every patched run poisoned
    handle = block.register_forward_hook(poison)
    try:
        r = plan.run()
    finally:
        handle.remove()
    # Rows up to 8 run block 9 (each cell from the layer above its row) and read its poisoned
    # output; the rows above take the base run's cached output of block 9 instead. Packed
    # traces hold rows of both kinds, and a NaN reaches every cell of its trace through
    # attention: those cells are rerun unpacked, so only the rows that ran block 9 are NaN.
    raw = r.raw["resid"][0]
    poisoned = {row for row in range(18) if torch.isnan(raw[row, 2:]).all()}
    assert poisoned == set(range(9))
    assert all(torch.isfinite(raw[row]).all() for row in set(range(18)) - poisoned)
    assert torch.allclose(raw[9:], pipatch.patch(model, **PAIR).raw["resid"][0, 9:], atol=1e-5)
    assert {row for _, row in r.meta["engine"]["nonfinite_rows"]} == poisoned
    assert any("NaN/Inf" in w for w in r.warnings)


def test_nan_in_one_fact_of_a_chain_stays_in_that_fact(model):
    """Facts run as one (a study's Chain) share packed traces: a NaN in one fact's cells
    reaches the others of its rows through attention, so those are rerun unpacked. The NaN
    rows and their warning are the poisoned fact's alone; the other fact equals its own run."""
    from pipatch._engine import Chain
    from pipatch._experiments._api import plan_trace

    facts = [(EIFFEL, "Eiffel Tower", " Paris"), (COLOSSEUM, "Colosseum", " Rome")]
    options = {"sites": "resid", "seeds": 1, "scale": 3.0}
    plans = [plan_trace(model, prompt, subject=subject, answer=answer, **options) for prompt, subject, answer in facts]
    alone = pipatch.trace(model, EIFFEL, subject="Eiffel Tower", answer=" Paris", **options)
    colosseum = model.tokenizer(" Colosseum", add_special_tokens=False).input_ids[0]
    seen: dict = {}

    def ids(module, args, kwargs):
        seen["ids"] = kwargs.get("input_ids", args[0] if args else None)

    def poison(module, args, output):  # NaN wherever the Colosseum's first token runs block 9
        rows = seen["ids"][-output.shape[0]:]  # a packed trace's block runs its last rows
        return output.masked_fill((rows == colosseum)[..., None], float("nan"))

    handles = [model._module.register_forward_pre_hook(ids, with_kwargs=True),
               model._module.model.layers[9].mlp.register_forward_hook(poison)]
    try:
        eiffel, rome = Chain(plans).run()
    finally:
        for handle in handles:
            handle.remove()
    assert eiffel.status == rome.status == "done" and eiffel.meta["engine"]["chained"] == 2
    assert torch.isnan(rome.raw["resid"]).any() and [w for w in rome.warnings if "NaN/Inf" in w]
    assert torch.isfinite(eiffel.raw["resid"]).all() and not [w for w in eiffel.warnings if "NaN/Inf" in w]
    assert torch.allclose(eiffel.raw["resid"], alone.raw["resid"], atol=2e-5, rtol=0)


def test_identical_baselines_give_nan_and_a_warning_not_huge_numbers(model):
    r = pipatch.patch(model, clean=EIFFEL, corrupt=EIFFEL, answer=" Paris", foil=" Rome", positions=[-1])
    assert torch.isnan(r.grid).all() and torch.isfinite(r.raw["resid"]).all()
    assert any("undefined" in w for w in r.warnings)


def test_prompt_longer_than_the_context_is_refused(model):
    with pytest.raises(pipatch.PipatchError, match="longer than the model's context of 32768"):
        pipatch.trace(model, "Paris " * 33000, subject="Paris", answer=" Paris", seeds=1)


def test_unknown_family_names_the_modules_it_looked_for():
    from transformers import MambaConfig, MambaForCausalLM

    from pipatch._model.models import adapter_for

    hf = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, state_size=4))
    with pytest.raises(pipatch.PipatchError, match=r"'mamba'.*looked for model\.embed_tokens.*model\.layers"):
        adapter_for(hf)


@pytest.mark.slow
def test_two_processes_converting_the_embedded_model_at_once(tmp_path):
    script = ("import pipatch, torch; m = pipatch.load_model(); "
              "ids = m.tokenizer('The Eiffel Tower is in the city of', return_tensors='pt').input_ids; "
              "p = m._module(ids).logits[0, -1].softmax(-1)[9079]; print(round(float(p), 4))")
    env = {**__import__("os").environ, "PIPATCH_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert 0.4 < float(out.strip().splitlines()[-1]) < 0.6
    folders = [f for f in tmp_path.iterdir() if not f.name.startswith(".")]
    assert len(folders) == 1 and (folders[0] / "model.safetensors").exists()
    assert (tmp_path / f".{folders[0].name}.lock").is_file()  # they took turns: one converted, one waited
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".convert-")]  # no debris
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and time.perf_counter() - started < 300
