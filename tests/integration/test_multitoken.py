"""Multi-token answers (" New York"), read teacher-forced, against plain-PyTorch-hook references.

The reference computes a sequence's log-probability by hand: run the prompt followed by the
answer's tokens but the last, once per sequence (answer, foil), with forward hooks that write
at the prompt's positions only, and add up ``log_softmax`` of each answer token at the position
before it. pipatch must give the same numbers for every experiment (trace, patch at every site,
attribution, path patching, datasets), from Python, the magics and the command line.

Facts on the embedded model (Gemma 3 270M, float32): P(" New York" | "The Statue of Liberty is
in the city of") ≈ 0.58 and P(" San Francisco" | "The Golden Gate Bridge is in the city of") ≈
0.76, both answers two tokens, both prompts 10 tokens with <bos>.
"""

from __future__ import annotations

import json

import pytest
import torch

import pipatch
from pipatch import cli
from pipatch._experiments._api import plan_patch
from pipatch._experiments.tracing import noise_draws
from pipatch._model.cells import Metric
from pipatch._model.models import PipatchError, _get, adapter_for
from tests._reference import first, hooked, logits_of, record, site_module
from tests.conftest import COLOSSEUM, EIFFEL

LIBERTY = "The Statue of Liberty is in the city of"
GOLDEN = "The Golden Gate Bridge is in the city of"
NY, SF = " New York", " San Francisco"
PAIR = {"clean": LIBERTY, "corrupt": GOLDEN, "answer": NY, "foil": SF}
ATOL = 1e-4


# --------------------------------------------------------------------------------------------
# The reference: sequences scored by hand
# --------------------------------------------------------------------------------------------


def ids_of(model, text: str, special: bool = True) -> torch.Tensor:
    return model.tokenizer(text, return_tensors="pt", add_special_tokens=special).input_ids


def seq_logprob(model, prompt_ids: torch.Tensor, tokens: list[int], hooks=()) -> float:
    """log P(tokens | prompt) teacher-forced: one forward of prompt + tokens[:-1] under ``hooks``."""
    run = torch.cat([prompt_ids, torch.tensor([tokens[:-1]], dtype=prompt_ids.dtype)], dim=1)
    # The last len(tokens) positions are the ones read (after the prompt and each earlier token).
    logits = hooked(list(hooks), lambda: logits_of(model, run, keep=len(tokens)))[0]
    logp = logits.double().log_softmax(-1)  # float64: the true value to 1e-12
    return sum(float(logp[j, t]) for j, t in enumerate(tokens))


def reference_metric(model, prompt_ids, name: str, answer: list[int], foil: list[int] | None, hooks=()) -> float:
    a = seq_logprob(model, prompt_ids, answer, hooks)
    if name == "prob":
        return float(torch.tensor(a).exp())
    if name == "logprob":
        return a
    return a - seq_logprob(model, prompt_ids, foil, hooks)


def writer(model, site: str, layer: int, where: tuple, value: torch.Tensor):
    """A hook writing ``value`` at ``where`` (prompt positions) of ``site`` at ``layer``."""
    module = site_module(model, site, layer)
    if site == "head":
        def pre(m, args):
            z = args[0].clone()
            z[where] = value[where]
            return (z,) + tuple(args[1:])
        return module, "pre", pre

    def post(m, args, output):
        hidden = first(output).clone()
        hidden[where] = value[where]
        return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden
    return module, "post", post


@pytest.fixture(scope="module")
def tokens(model):
    return {text: ids_of(model, text, special=False)[0].tolist() for text in (NY, SF, " Paris", " Boston")}


def test_the_embedded_facts(model, tokens):
    assert len(tokens[NY]) == 2 and len(tokens[SF]) == 2
    assert ids_of(model, LIBERTY).shape[1] == ids_of(model, GOLDEN).shape[1] == 10
    ny = pipatch.patch(model, clean=LIBERTY, corrupt=GOLDEN, answer=NY, metric="prob", positions=[-1])
    sf = pipatch.patch(model, clean=GOLDEN, corrupt=LIBERTY, answer=SF, metric="prob", positions=[-1])
    assert ny.clean == pytest.approx(0.58, abs=0.02) and sf.clean == pytest.approx(0.76, abs=0.02)
    by_hand = reference_metric(model, ids_of(model, LIBERTY), "prob", tokens[NY], None)
    assert ny.clean == pytest.approx(by_hand, abs=1e-5)
    assert ny.meta["answer_ids"] == tokens[NY] and ny.meta["answer_tokens"] == [" New", " York"]
    assert ny.meta["answer_id"] is None  # several tokens: the ids are in answer_ids


# --------------------------------------------------------------------------------------------
# Every experiment against the reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("site, direction, positions", [
    ("resid", "denoise", [2, 4, -1]),
    ("mlp", "noise", [4, -1]),
    ("attn", "denoise", [-1]),
    ("head", "denoise", None),
])
def test_patch_equals_the_reference(model, tokens, site, direction, positions):
    result = pipatch.patch(model, **PAIR, site=site, direction=direction, positions=positions)
    assert result.metric == "logprob_diff"
    clean_ids, corrupt_ids = ids_of(model, LIBERTY), ids_of(model, GOLDEN)
    base_ids, donor_ids = (corrupt_ids, clean_ids) if direction == "denoise" else (clean_ids, corrupt_ids)
    donor = record(model, site, donor_ids)
    T, a = base_ids.shape[1], adapter_for(model)
    cols = range(a.n_heads) if site == "head" else [p % T for p in positions]
    for layer in range(0, a.n_layers, 3 if site == "head" else 1):  # heads: every third layer (4 a layer)
        for j, col in enumerate(cols):
            if site == "head":
                where = (slice(None), slice(0, T), slice(col * a.head_dim, (col + 1) * a.head_dim))
            else:
                where = (slice(None), col)
            hook = writer(model, site, layer, where, donor[layer])
            want = reference_metric(model, base_ids, "logit_diff", tokens[NY], tokens[SF], [hook])
            assert float(result.raw[site][0, layer, j]) == pytest.approx(want, abs=ATOL), (layer, col)
    assert result.clean == pytest.approx(reference_metric(model, clean_ids, "logit_diff", tokens[NY], tokens[SF]),
                                         abs=ATOL)


def test_fast_and_plain_runs_agree_with_a_diverging_foil(model):
    fast = pipatch.patch(model, **PAIR, site="resid", positions=[4, -1])
    plain = pipatch.patch(model, **PAIR, site="resid", positions=[4, -1], fast=False)
    assert torch.allclose(fast.raw["resid"], plain.raw["resid"], atol=ATOL)
    # The last position's late rows restore most of it, but not all: " York" is read one position
    # later, from states that still attend to the corrupt prompt's other positions.
    assert 0.9 < float(fast.grid[-1, -1]) < 0.99


def test_trace_equals_the_reference(model, tokens):
    result = pipatch.trace(model, LIBERTY, subject="Statue of Liberty", answer=NY, seeds=1, metric="logprob")
    meta = result.meta
    ids, positions = ids_of(model, LIBERTY), meta["subject_positions"]
    a = adapter_for(model)
    noise = noise_draws(1, len(positions), a.d_model, meta["scale"], meta["sigma"])[0]
    clean = record(model, "resid", ids)
    embed = _get(model._module, a.embed)

    def corrupt(m, args, out):
        out = out.clone()
        out[:, positions] += noise.to(out.dtype)
        return out
    assert meta["clean_prob"] == pytest.approx(0.578, abs=0.01)
    for layer in range(a.n_layers):
        for pos in (1, positions[-1], ids.shape[1] - 1):  # before, at the end of and after the subject
            hooks = [(embed, "post", corrupt), writer(model, "resid", layer, (slice(None), pos), clean[layer])]
            want = reference_metric(model, ids, "logprob", tokens[NY], None, hooks)
            assert float(result.raw["resid"][0, layer, pos]) == pytest.approx(want, abs=ATOL), (layer, pos)


def test_attribution_equals_a_gradient_by_hand(model, tokens):
    result = pipatch.attribute(model, **PAIR, site="mlp", verify=3)
    a = adapter_for(model)
    clean_ids, corrupt_ids = ids_of(model, LIBERTY), ids_of(model, GOLDEN)
    T = corrupt_ids.shape[1]
    clean = record(model, "mlp", clean_ids)
    grads = [torch.zeros(T, a.d_model) for _ in range(a.n_layers)]
    acts: dict = {}
    total = 0.0
    for tokens_, sign in ((tokens[NY], 1.0), (tokens[SF], -1.0)):
        run = torch.cat([corrupt_ids, torch.tensor([tokens_[:-1]])], dim=1)
        handles = [site_module(model, "mlp", layer).register_forward_hook(
            lambda m, args, out, i=layer: acts.__setitem__(i, first(out)) or first(out).retain_grad())
            for layer in range(a.n_layers)]
        try:
            with torch.enable_grad():
                logp = logits_of_grad(model, run).log_softmax(-1)
                value = sum(logp[T - 1 + j, t] for j, t in enumerate(tokens_))
                (sign * value).backward()
        finally:
            for h in handles:
                h.remove()
        total += sign * float(value)
        for layer in range(a.n_layers):
            grads[layer] += acts[layer].grad[0, :T]
            if sign > 0:
                acts[("value", layer)] = acts[layer][0, :T].detach()
    model._module.zero_grad(set_to_none=True)
    assert result.corrupt == pytest.approx(total, abs=ATOL)
    for layer in range(a.n_layers):
        delta = (grads[layer] * (clean[layer][0] - acts[("value", layer)])).sum(-1)
        assert torch.allclose(result.raw["mlp"][0, layer], total + delta, atol=1e-3), layer
    # the verified cells are real patches: each equals the hook reference's patched run
    donor = record(model, "mlp", clean_ids)
    assert len(result.meta["verified_values"]) == 3
    for entry in result.meta["verified_values"]:
        hook = writer(model, "mlp", entry["layer"], (slice(None), entry["col"]), donor[entry["layer"]])
        want = reference_metric(model, corrupt_ids, "logit_diff", tokens[NY], tokens[SF], [hook])
        assert entry["actual"] == pytest.approx(want, abs=ATOL)


def logits_of_grad(model, ids: torch.Tensor) -> torch.Tensor:
    return model._module(ids).logits[0].float()


def test_path_patching_equals_the_reference(model, tokens):
    result = pipatch.path_patch(model, **PAIR, sender="mlp")
    a = adapter_for(model)
    clean_ids, corrupt_ids = ids_of(model, LIBERTY), ids_of(model, GOLDEN)
    base_attn, base_mlp, donor_mlp = record(model, "attn", corrupt_ids), record(model, "mlp", corrupt_ids), \
        record(model, "mlp", clean_ids)
    T = corrupt_ids.shape[1]
    prompt = (slice(None), slice(0, T))
    for sender in range(a.n_layers):
        hooks = [writer(model, "mlp", sender, prompt, donor_mlp[sender])]
        for later in range(sender + 1, a.n_layers):
            hooks += [writer(model, "attn", later, prompt, base_attn[later]),
                      writer(model, "mlp", later, prompt, base_mlp[later])]
        want = reference_metric(model, corrupt_ids, "logit_diff", tokens[NY], tokens[SF], hooks)
        assert float(result.raw[result.views[0]][0, sender, 0]) == pytest.approx(want, abs=ATOL), sender


# --------------------------------------------------------------------------------------------
# Datasets, clicks, entry points, bad input
# --------------------------------------------------------------------------------------------


def test_a_dataset_of_multi_token_pairs_equals_each_pair(model):
    swapped = {"clean": GOLDEN, "corrupt": LIBERTY, "answer": SF, "foil": NY}
    both = pipatch.patch(model, clean=[LIBERTY, GOLDEN], corrupt=[GOLDEN, LIBERTY], answer=[NY, SF], foil=[SF, NY],
                         positions=[-1])
    assert both.metric == "logprob_diff"
    last = both.columns.index("last")  # a dataset averages over named positions
    for row, pair in enumerate((PAIR, swapped)):
        one = pipatch.patch(model, **pair, positions=[-1])
        assert torch.allclose(both.raw["resid"][row, :, last], one.raw["resid"][0, :, 0], atol=1e-5)
    with pytest.raises(PipatchError, match="metric='logprob_diff'"):
        pipatch.patch(model, clean=[LIBERTY, EIFFEL], corrupt=[GOLDEN, COLOSSEUM],
                      answer=[NY, " Paris"], foil=[SF, " Rome"], positions=[-1])
    mixed = pipatch.patch(model, clean=[LIBERTY, EIFFEL], corrupt=[GOLDEN, COLOSSEUM], answer=[NY, " Paris"],
                          foil=[SF, " Rome"], positions=[-1], metric="logprob_diff")
    assert mixed.metric == "logprob_diff"
    # For one-token answers a log-prob difference is the logit difference (the softmax's normalizer cancels).
    paris = pipatch.patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome", positions=[-1])
    assert torch.allclose(mixed.raw["resid"][1, :, last], paris.raw["resid"][0, :, 0], atol=ATOL)


def test_a_click_shows_the_tokens_after_the_prompt(model):
    plan = plan_patch(model, **PAIR, positions=[-1])
    plan.run()
    top = plan.predictor()("resid", 17, 0, 0, 5)
    assert top[0][0] == " New"  # the clean last state restored: the answer's first token leads


def test_the_magic_and_the_command_line_take_multi_token_answers(model, tmp_path, capsys):
    from IPython.testing.globalipapp import get_ipython

    ip = get_ipython()
    ip.run_line_magic("load_ext", "pipatch")
    ip.user_ns["embedded"] = model
    ip.run_cell_magic("patch", '--model embedded --answer " New York" --foil " San Francisco" --positions -1 -o ny',
                      f"clean: {LIBERTY}\ncorrupt: {GOLDEN}\n")
    want = pipatch.patch(model, **PAIR, positions=[-1])
    got = ip.user_ns["ny"]
    assert got.metric == "logprob_diff" and torch.allclose(got.raw["resid"], want.raw["resid"], atol=1e-6)
    path = tmp_path / "ny.json"
    code = cli.main(["patch", "--clean", LIBERTY, "--corrupt", GOLDEN, "--answer", NY, "--foil", SF,
                     "--positions", "-1", "--json", str(path), "--quiet"])
    assert code == 0
    data = json.loads(path.read_text())
    assert data["metric"] == "logprob_diff" and data["meta"]["answer_tokens"] == [" New", " York"]
    # The same runs in this process: raw and baselines within 1e-6 (the magic's, above), so the
    # recovery within what those move it by (tests/_tolerance.py).
    from tests._tolerance import assert_recovery_close, recovery_tolerance

    assert_recovery_close(torch.tensor(data["grid"]), want.grid, recovery_tolerance(want, 1e-6))


def test_code_is_refused_in_one_line_for_multi_token_answers(model):
    result = pipatch.patch(model, **PAIR, positions=[-1])
    with pytest.raises(PipatchError, match="2 tokens") as error:
        result.code()
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("kwargs, match", [
    ({"answer": ""}, "answer is empty"),
    ({"answer": NY, "foil": None, "metric": "logprob_diff"}, "needs a foil"),
])
def test_bad_answers_are_one_line(model, kwargs, match):
    with pytest.raises(PipatchError, match=match) as error:
        pipatch.patch(model, **{**PAIR, **kwargs}, positions=[-1])
    assert "\n" not in str(error.value)


def test_a_prompt_and_answer_longer_than_the_context_is_refused(model):
    from pipatch._backends import backend_for
    from pipatch._experiments._inputs import check_run_length

    backend = backend_for(model)

    class Short:  # the check reads only the context length; the embedded model's is 32k
        context_length = 10
    with pytest.raises(PipatchError, match="11 tokens, longer than the model's context of 10"):
        check_run_length(Short(), ids_of(model, LIBERTY), Metric("prob", (1, 2)))
    check_run_length(backend, ids_of(model, LIBERTY), Metric("prob", (1, 2)))
