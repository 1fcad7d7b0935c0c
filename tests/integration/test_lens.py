"""The logit lens against a hand-written reference: hidden states read with plain forward
hooks, then the final norm and the unembedding applied by hand (Gemma 2's soft-cap too), on
the embedded model and on tiny random models of other families."""

from __future__ import annotations

import json

import pytest
import torch

import pipatch
from pipatch._model.models import _get, adapter_for
from tests._reference import first, hooked
from tests._tiny import tiny_model
from tests.conftest import EIFFEL

#: Where each family keeps its final norm (the module between the last block and the unembedding).
FINAL_NORMS = ("model.norm", "model.language_model.norm", "transformer.ln_f", "gpt_neox.final_layer_norm")


def final_norm(hf):
    for path in FINAL_NORMS:
        try:
            return _get(hf, path)
        except AttributeError:
            continue
    raise AssertionError(f"no final norm found in {type(hf).__name__}")


def reference_lens(model, prompt: str, answer: str, metric: str = "prob") -> torch.Tensor:
    """[layers, positions]: each block's output at each position through the final norm and the
    unembedding, by hand; P(answer's first token) there, times the model's own P of the answer's
    later tokens (teacher-forced), or its log; or (``rank``) how many logits beat the first
    token's there, or the later tokens' at the model's output, whichever is more."""
    if metric == "rank":
        return reference_rank_band(model, prompt, answer, 0.0, 0.0)[0].float()  # no tolerance: the rank itself
    answer_ids, later_rows, lens_logits, n_layers = hand_lens(model, prompt, answer)
    later = sum(float(torch.log_softmax(row.double(), -1)[token]) for row, token in zip(later_rows, answer_ids[1:]))
    rows = []
    for layer in range(n_layers):
        logprob = torch.log_softmax(lens_logits(layer), -1)[:, answer_ids[0]] + later
        rows.append(logprob.exp() if metric == "prob" else logprob)
    return torch.stack(rows).float()


def reference_rank_band(model, prompt: str, answer: str, atol: float, rtol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, high)``, [layers, positions] each: where :func:`reference_lens`'s ``rank`` may lie
    when computed from logits each within ``atol + rtol·|logit|`` of the reference's
    (:func:`tests._tolerance.rank_band`), per read token, then combined as the metric combines
    ranks (:meth:`pipatch._model.cells.Metric.combine`: the worst over the answer's tokens)."""
    from tests._tolerance import rank_band

    answer_ids, later_rows, lens_logits, n_layers = hand_lens(model, prompt, answer)
    later_low = later_high = 0  # the answer's later tokens, at the model's output
    for row, token in zip(later_rows, answer_ids[1:]):
        lo, hi = rank_band(row, torch.tensor(token), atol, rtol)
        later_low, later_high = max(later_low, int(lo)), max(later_high, int(hi))
    lows, highs = [], []
    for layer in range(n_layers):
        single = lens_logits(layer).float()
        lo, hi = rank_band(single, torch.full(single.shape[:1], answer_ids[0]), atol, rtol)
        lows.append(lo.clamp(min=later_low))
        highs.append(hi.clamp(min=later_high))
    return torch.stack(lows), torch.stack(highs)


def hand_lens(model, prompt: str, answer: str):
    """The hand reference's pieces: the answer's ids; its later tokens' logit rows at the
    model's output (teacher-forced, float32 [vocab] each); ``lens_logits(layer)``, that block's
    output at each prompt position through the final norm and the unembedding (float64,
    soft-capped where the model caps, [positions, vocab]); the number of layers."""
    hf, adapter = model._module, adapter_for(model)
    tokenizer = model.tokenizer
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    answer_ids = tokenizer(answer, add_special_tokens=False).input_ids
    blocks = _get(hf, adapter.blocks)
    states: dict[int, torch.Tensor] = {}
    hooks = [(block, "post", lambda m, args, out, i=i: states.__setitem__(i, first(out).detach().clone()))
             for i, block in enumerate(blocks)]
    run_ids = torch.cat([ids, torch.tensor([answer_ids[:-1]], dtype=ids.dtype)], 1) if len(answer_ids) > 1 else ids
    logits = hooked(hooks, lambda: hf(run_ids).logits)
    T = ids.shape[1]
    later_rows = [logits[0, T - 1 + j].float() for j in range(1, len(answer_ids))]
    norm, unembed = final_norm(hf), _get(hf, adapter.unembed)
    cap = getattr(getattr(hf.config, "text_config", None) or hf.config, "final_logit_softcapping", None)

    @torch.no_grad()
    def lens_logits(layer: int) -> torch.Tensor:
        out = unembed(norm(states[layer][0, :T])).double()  # [T, vocab]
        return torch.tanh(out / cap) * cap if cap else out

    return answer_ids, later_rows, lens_logits, len(blocks)


def test_the_lens_equals_the_hand_reference_on_the_embedded_model(model):
    r = pipatch.lens(model, EIFFEL, answer=" Paris")
    want = reference_lens(model, EIFFEL, " Paris")
    assert r.kind == "lens" and r.grid.shape == want.shape == (18, len(r.tokens))
    # Probabilities near 1 differ by float32 rounding (pipatch sums the softmax over 262k
    # logits in slices, the reference at once): 1e-5 absolute, 2e-5 relative.
    torch.testing.assert_close(r.grid, want, atol=1e-5, rtol=2e-5)
    # The last row at the last position is the model's own output, and the grid is no recovery.
    assert abs(float(r.grid[-1, -1]) - r.meta["output"]) < 1e-4 and not r.normalized
    assert abs(r.meta["output"] - 0.497) < 0.01


def assert_ranks_in_band(got: torch.Tensor, model, prompt: str, answer: str, atol: float, rtol: float) -> None:
    """``got``, a rank lens of ``prompt``, lies in :func:`reference_rank_band`: the ranks that
    logits each within ``atol + rtol·|logit|`` of the hand reference's can have. A rank counts
    logits above the answer's among 262k (Gemma 3), so a float rounding flips a token whose
    logit is that close to the answer's (1 place apart measured, the band up to 13 wide at
    1e-5). The caller's test compares the same lens's log-probabilities with this reference at
    ``atol``/``rtol``: the premise of the band, that each logit is known to about that."""
    from tests._tolerance import assert_rank_in_band

    assert got.dtype == torch.float32
    assert_rank_in_band(got, *reference_rank_band(model, prompt, answer, atol, rtol))


def test_the_rank_lens_counts_the_tokens_above_the_answer(model):
    """The rank lens against the band of ranks of logits within the tolerance at which this
    test compares the lens's log-probabilities with the same reference (``atol`` 1e-5, ``rtol``
    2e-5: the probability lens's, above; measured: up to 3.8e-5, 3.6e-6·(1 + |log-probability|))."""
    r = pipatch.lens(model, EIFFEL, answer=" Paris", metric="rank")
    assert r.metric == "rank" and float(r.grid[-1, -1]) == 0.0  # " Paris" is the model's top token
    assert float(r.grid[0].min()) > 100  # the embedding-level state names nothing like Paris
    for prompt, answer in ((EIFFEL, " Paris"), ("The Statue of Liberty is in the city of", " New York")):
        rank = r if answer == " Paris" else pipatch.lens(model, prompt, answer=answer, metric="rank")
        logprob = pipatch.lens(model, prompt, answer=answer, metric="logprob", progress=False)
        torch.testing.assert_close(logprob.grid, reference_lens(model, prompt, answer, "logprob"), atol=1e-5, rtol=2e-5)
        assert_ranks_in_band(rank.grid, model, prompt, answer, atol=1e-5, rtol=2e-5)
    with pytest.raises(pipatch.PipatchError, match="metric for the lens.*prob, logprob, rank"):
        pipatch.lens(model, EIFFEL, answer=" Paris", metric="logprob_diff")


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
@pytest.mark.parametrize("metric", ["prob", "logprob", "rank"])
def test_the_lens_equals_the_hand_reference_on_tiny_families(family, metric):
    """Three layouts (Llama's ``model.norm``, GPT-2's ``transformer.ln_f`` and tied unembedding,
    Gemma 2's soft-capped logits). A rank lies in the band of ranks of logits within 1e-5 of the
    reference's (the ``logprob`` case compares at 1e-5, ``rtol`` 0), the slow lens's within
    2e-5 (it is compared with the fast one at 1e-5)."""
    tiny = tiny_model(family)
    r = pipatch.lens(tiny, EIFFEL, answer=" Paris", metric=metric)
    slow = pipatch.lens(tiny, EIFFEL, answer=" Paris", metric=metric, fast=False)
    if metric == "rank":
        assert_ranks_in_band(r.grid, tiny, EIFFEL, " Paris", atol=1e-5, rtol=0)
        assert_ranks_in_band(slow.grid, tiny, EIFFEL, " Paris", atol=2e-5, rtol=0)
        return
    torch.testing.assert_close(r.grid, reference_lens(tiny, EIFFEL, " Paris", metric), atol=1e-5, rtol=0)
    torch.testing.assert_close(slow.grid, r.grid, atol=1e-5, rtol=0)


def test_a_multi_token_answer_is_read_teacher_forced(model):
    r = pipatch.lens(model, "The Statue of Liberty is in the city of", answer=" New York")
    assert r.meta["answer_tokens"] == [" New", " York"]
    want = reference_lens(model, "The Statue of Liberty is in the city of", " New York")
    torch.testing.assert_close(r.grid, want, atol=1e-5, rtol=0)


def test_the_lens_saves_renders_exports_and_writes_its_code(model, tmp_path):
    r = pipatch.lens(model, EIFFEL, answer=" Paris")
    back = pipatch.load_result(r.save(tmp_path / "lens.safetensors"))
    assert back.kind == "lens" and back.title == r.title and torch.equal(back.grid, r.grid)
    state = r.to_state()
    assert state["values"] == "metric" and state["baselines"] == {"output": pytest.approx(r.meta["output"])}
    assert "Logit lens" in state["title"]
    assert r.text().splitlines()[-1].split()[-2] == "prob"  # the top cells name the metric, not "recovery"
    from pipatch._results.views import png

    assert png(state)[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "lens.json").write_text(json.dumps(r.to_json()), encoding="utf-8")
    again = pipatch.load_result(tmp_path / "lens.json")
    assert again.kind == "lens" and not again.normalized and torch.allclose(again.grid, r.grid, atol=1e-7)
    same = pipatch.compare(r, r)
    assert float(same.grid.abs().max()) == 0.0 and "logit lens" in same.title


def test_a_list_of_prompts_needs_a_subject_to_name_positions(model):
    with pytest.raises(pipatch.PipatchError, match="subject"):
        pipatch.lens(model, [EIFFEL, "The Louvre is in the city of"], answer=" Paris")
    d = pipatch.lens(model, [EIFFEL, "The Louvre is in the city of"], answer=" Paris",
                     subject=["Eiffel Tower", "Louvre"])
    assert d.columns[-1] == "last" and d.n_seeds == 2
    one = pipatch.lens(model, EIFFEL, answer=" Paris")
    assert abs(float(d.raw["resid"][0, -1, -1]) - float(one.grid[-1, -1])) < 1e-6


# --------------------------------------------------------------------------------------------
# The lens reads, it does not patch: one forward per prompt, equal to the patched runs it replaced
# --------------------------------------------------------------------------------------------


class _Read(Exception):
    """Raised by :func:`patched_lens`'s hook on the unembedding's input once it has read it.

    The patched run's logits (every row, every position: most of the run's arithmetic on a
    262k vocabulary) were never used, only the unembedding's input; the run stops there, so
    what is read is the same forward's, bit for bit."""


def patched_lens(model, prompt: str, answer: str, metrics: tuple[str, ...] = ("prob",),
                 foil: str | None = None, rank_tolerance: float | None = None) -> dict[str, torch.Tensor]:
    """Per metric, [layers, positions]: the lens as pipatch computed it before it read (the old
    computation), with plain forward hooks: per layer one batched forward whose row ``p`` writes
    that layer's state at position ``p`` into the last block's output at the last prompt
    position, the unembedding's input read there (and at a multi-token answer's later
    positions), then each metric from it by pipatch's unembedding arithmetic, as the patched
    cells' was. The metrics share the patched runs (a metric reads, it does not change a run).

    With ``rank_tolerance`` ``τ`` (and ``rank`` among the metrics), also ``rank_low`` and
    ``rank_high``: the band a rank lies in when each logit is known within ``τ (1 + |logit|)``
    (:func:`tests._tolerance.rank_band` per read token, the worst over the answer's tokens as
    :meth:`~pipatch._model.cells.Metric.combine` takes it). With ``logit_diff`` and a foil, also
    ``logit_size``: ``|answer's logit| + |foil's logit|`` per cell, what the difference's
    rounding grows with."""
    from pipatch._backends._unembedding import Unembedding
    from pipatch._model.cells import Metric

    hf, adapter = model._module, adapter_for(model)
    tokenizer = model.tokenizer
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    answer_ids = tuple(tokenizer(answer, add_special_tokens=False).input_ids)
    foil_ids = None if foil is None else tuple(tokenizer(foil, add_special_tokens=False).input_ids)
    scorers = {metric: Metric(metric, answer_ids, foil_ids if metric == "logit_diff" else None) for metric in metrics}
    scorer = scorers[metrics[0]]
    run_ids, T, m = scorer.inputs(ids), ids.shape[1], scorer.n_read
    blocks = _get(hf, adapter.blocks)
    unembed = _get(hf, adapter.unembed)
    states: dict[int, torch.Tensor] = {}
    hooked([(block, "post", lambda mod, args, out, i=i: states.__setitem__(i, first(out).detach().clone()))
            for i, block in enumerate(blocks)], lambda: hf(run_ids))
    grids = {metric: torch.empty(len(blocks), T) for metric in metrics}
    band = rank_tolerance is not None and "rank" in metrics
    if band:
        from tests._tolerance import rank_band

        grids["rank_low"], grids["rank_high"] = (torch.empty(len(blocks), T) for _ in range(2))
    head = Unembedding(unembed, adapter.softcap)
    for layer in range(len(blocks)):
        read: dict[str, torch.Tensor] = {}

        def write(mod, args, out, layer=layer):
            first(out)[:, T - 1] = states[layer][0, :T]  # row p gets position p's state

        def keep(mod, args):
            read["hidden"] = args[0][:, T - 1 : T - 1 + m].detach().clone()
            raise _Read  # the patched run's own logits are never used: stop before the unembedding

        try:
            hooked([(blocks[-1], "post", write), (unembed, "pre", keep)], lambda: hf(run_ids.repeat(T, 1)))
        except _Read:
            pass
        for metric in metrics:
            grids[metric][layer] = head.metric(scorers[metric], read["hidden"][:, None])
        if "logit_diff" in metrics and foil_ids is not None:
            pair = head.logits(read["hidden"][:, :1], [answer_ids[0], foil_ids[0]])  # [T, 1, 2]
            grids.setdefault("logit_size", torch.empty(len(blocks), T))[layer] = pair.abs().sum(-1)[:, 0]
        if band:
            logits = head.logits(read["hidden"])  # [T, m, vocab]: the rank's reading, answer tokens only
            low, high = rank_band(logits, torch.tensor(answer_ids).expand(T, m), rank_tolerance, rank_tolerance)
            grids["rank_low"][layer], grids["rank_high"][layer] = low.amax(-1), high.amax(-1)
    return grids


@pytest.mark.parametrize("family", [None, "llama", "gemma2"])
@pytest.mark.parametrize("answer", [" Paris", " New York"])
def test_the_read_equals_the_patched_lens_it_replaced(family, answer, request):
    """On the embedded model and two tiny families, the one-forward lens equals the patched
    runs it replaced (the old computation, by hand), for every metric: within 1e-6 on the tiny
    families; on the embedded model within 1e-5 (its 18 layers' final norm and unembedding run
    outside the forward, batched otherwise than the patched runs were: up to 6e-6 measured).

    The rank is a count, not a value with a rounding error: it lies in the band of ranks that
    logits each within the log-probability's tolerance ``τ`` (``τ (1 + |logit|)``: the
    ``atol``/``rtol`` at which the log-probability is compared here) can have — two logits
    within ``2τ (1 + |logit|)`` of each other may swap. On the embedded model at layer 4,
    position 8, the rank differs from the patched runs' by 1 (of about 32,050: a near-tie
    among 262,144 logits)."""
    from tests._tolerance import assert_rank_in_band

    subject = request.getfixturevalue("model") if family is None else tiny_model(family)
    tolerance = 1e-5 if family is None else 1e-6
    metrics = ("prob", "logprob", "rank")
    wanted = patched_lens(subject, EIFFEL, answer, metrics, rank_tolerance=tolerance)
    for metric in metrics:
        got, want = pipatch.lens(subject, EIFFEL, answer=answer, metric=metric), wanted[metric]
        assert got.grid.shape == want.shape
        if metric == "rank":
            assert_rank_in_band(got.grid, wanted["rank_low"], wanted["rank_high"])
            continue
        torch.testing.assert_close(got.grid, want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("family", [None, "llama", "gemma2"])
def test_the_logit_difference_lens_equals_the_patched_lens(family, request):
    """A foil's lens (answer − foil logits, two rows of the unembedding per reading) equals the
    patched runs read by hand, as the other metrics do, on the embedded model and two tiny
    families (Gemma 2 soft-caps its logits: the difference is of capped logits).

    Each logit within ``τ (1 + |logit|)`` (τ the other metrics' 1e-5, 1e-6 on the tiny
    families), so their difference within ``τ (2 + |answer's| + |foil's|)``: relative to the
    logits, not to the difference, which can be small beside them (layer 0 of the embedded
    model, the last position: 2.9 between logits of about ±114, 4.6e-5 apart on one torch
    thread, 6.1e-5 on two, where a bare 1e-5 + 1e-5·|difference| failed; 0.15 of the bound)."""
    subject = request.getfixturevalue("model") if family is None else tiny_model(family)
    wanted = patched_lens(subject, EIFFEL, " Paris", ("logit_diff",), foil=" Rome")
    want, size = wanted["logit_diff"], wanted["logit_size"]
    got = pipatch.lens(subject, EIFFEL, answer=" Paris", foil=" Rome", metric="logit_diff", progress=False)
    tolerance = 1e-5 if family is None else 1e-6
    excess = (got.grid - want).abs() - tolerance * (2 + size)
    assert got.grid.shape == want.shape and float(excess.max()) <= 0, (float((got.grid - want).abs().max()), excess.max())
    assert got.metric == "logit_diff" and got.meta["foil"] == " Rome" and "vs ' Rome'" in got.title


def test_a_foil_goes_with_the_logit_difference_only(model):
    for kwargs in ({"foil": " Rome"}, {"metric": "logit_diff"}, {"foil": " Rome", "metric": "rank"}):
        with pytest.raises(pipatch.PipatchError, match="foil only for metric='logit_diff'"):
            pipatch.lens(model, EIFFEL, answer=" Paris", progress=False, **kwargs)
    with pytest.raises(pipatch.PipatchError, match="one-token answer and foil"):
        pipatch.lens(model, EIFFEL, answer=" New York", foil=" Rome", metric="logit_diff", progress=False)


def test_the_read_equals_the_patched_lens_in_float64():
    """The embedded model in float64, where the batch shapes' float32 rounding no longer hides
    the comparison: the one-forward lens equals the patched runs it replaced within 1e-6 for
    every metric (a multi-token answer, the harder path). The logits are float32 by design
    (:meth:`~pipatch._backends._unembedding.Unembedding.capped`), so a log-probability of
    magnitude ~20 is compared to its float32 resolution (``rtol``). The rank lies in the band
    of ranks of logits each within that tolerance (``1e-6 (1 + |logit|)``), as in
    :func:`test_the_read_equals_the_patched_lens_it_replaced`."""
    from pipatch._backends._load import shared_model
    from tests._tolerance import assert_rank_in_band

    subject = shared_model(dtype=torch.float64, device="cpu")
    metrics = ("prob", "logprob", "rank")
    wanted = patched_lens(subject, EIFFEL, " New York", metrics, rank_tolerance=1e-6)
    for metric in metrics:
        got = pipatch.lens(subject, EIFFEL, answer=" New York", metric=metric, progress=False)
        if metric == "rank":
            assert_rank_in_band(got.grid, wanted["rank_low"], wanted["rank_high"])
            continue
        torch.testing.assert_close(got.grid, wanted[metric], atol=1e-6, rtol=1e-6)


def long_prompt(model, n_tokens: int) -> str:
    """A prompt of at least ``n_tokens`` tokens, a fact at its end."""
    filler = "It was a bright cold day in April, and the clocks were striking thirteen. "
    text = EIFFEL
    while len(model.tokenizer(text).input_ids) < n_tokens:
        text = filler + text
    return text


def test_a_long_prompts_lens_is_one_forward(model):
    """A 1,000-token prompt's lens is one forward of the model: the backend's call log holds
    one program run (the lens read) and no patched run, and the model's forward runs once."""
    from pipatch._backends import backend_for

    backend = backend_for(model)
    prompt = long_prompt(model, 1000)
    forwards: list[int] = []
    handle = model._module.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        with backend.log.recording() as events:
            r = pipatch.lens(backend, prompt, answer=" Paris", positions=list(range(-8, 0)))
    finally:
        handle.remove()
    assert len(r.tokens) >= 1000 and r.grid.shape == (18, 8)
    assert [e["name"] for e in events if e["event"] == "program"] == ["lens"]
    assert len([e for e in events if e["event"] == "forward"]) == 1 and len(forwards) == 1
    assert not [e for e in events if e["event"] in ("trace", "packed", "patch")]
    assert abs(float(r.grid[-1, -1]) - r.meta["output"]) < 1e-5  # the lens's last layer is the output


def test_every_position_of_a_long_prompt_is_one_forward_on_a_tiny_model():
    tiny = tiny_model("llama")
    from pipatch._backends import backend_for

    backend = backend_for(tiny)
    prompt = " ".join(["the city of Paris is in France and"] * 14)
    forwards: list[int] = []
    handle = tiny._module.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        with backend.log.recording() as events:
            r = pipatch.lens(backend, prompt, answer=" Paris")
    finally:
        handle.remove()
    assert r.grid.shape == (3, len(r.tokens)) and len(r.tokens) > 100
    assert len(forwards) == 1 and [e["name"] for e in events if e["event"] == "program"] == ["lens"]
    torch.testing.assert_close(r.grid, reference_lens(tiny, prompt, " Paris"), atol=1e-5, rtol=0)


def test_positions_pick_the_lens_columns(model):
    full = pipatch.lens(model, EIFFEL, answer=" Paris")
    some = pipatch.lens(model, EIFFEL, answer=" Paris", positions=[2, -1])
    T = len(full.tokens)
    assert some.meta["positions"] == [2, T - 1] and some.columns == [full.tokens[2], full.tokens[-1]]
    assert some.tokens == full.tokens
    torch.testing.assert_close(some.grid, full.grid[:, [2, T - 1]], atol=1e-5, rtol=0)
    for bad, words in (([T], "out of range"), ([], "positions is empty")):
        with pytest.raises(pipatch.PipatchError, match=words):
            pipatch.lens(model, EIFFEL, answer=" Paris", positions=bad)
    # A click on a column read runs that state through the head, as the grid's cell did.
    plan = pipatch._experiments._api.plan_lens(model, EIFFEL, answer=" Paris", positions=[2, -1])
    (_, p), *_ = plan.predictor()("resid", 17, 1, k=1)
    assert abs(p - float(some.grid[17, 1])) < 1e-4
