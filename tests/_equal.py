"""One result against another within a tolerance: what the backend suites assert."""

from __future__ import annotations

import torch

from tests._tolerance import assert_recovery_close, normalized_tolerance, recovery_tolerance

ATOL = 1e-4
#: Float32 rounding grows with the value: two engines (or two ranks' all-reduce) summing in
#: another order put about 1e-4 on a log-prob near -11 (measured: 1.45e-4 on the TP=2 server).
RTOL = 2e-5


def assert_close(got: torch.Tensor, want: torch.Tensor, atol: float = ATOL, rtol: float = RTOL) -> None:
    """``|got - want| <= atol + rtol * |want|`` everywhere, NaNs in the same places."""
    assert got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    excess = ((got - want).abs() - rtol * want.abs()).nan_to_num()
    worst = int(excess.argmax())
    diff = float((got - want).flatten()[worst].abs())
    assert float(excess.flatten()[worst]) <= atol, (
        f"|Δ| {diff:.3g} at {float(want.flatten()[worst]):.4g} > {atol} + {rtol}·|value|")


def assert_same(got, want, atol: float = ATOL, backend: str = "vllm") -> None:
    """Two results of one experiment, ``got`` on ``backend`` and ``want`` on transformers: same
    axes, same raw values and baselines within ``atol`` (+ :data:`RTOL` relative), and the grid
    (normalized recovery) within what those move it by, cell by cell
    (:func:`tests._tolerance.recovery_tolerance`: a ratio's error from its parts')."""
    assert got.status == want.status == "done"
    assert (got.kind, got.tokens, got.columns, got.layers, got.views) == (
        want.kind, want.tokens, want.columns, want.layers, want.views)
    assert_close(got.clean_seeds, want.clean_seeds, atol)
    assert_close(got.corrupt_seeds, want.corrupt_seeds, atol)
    for view in want.views:
        assert_close(got.raw[view], want.raw[view], atol)
        assert_recovery_close(got.mean(view), want.mean(view), recovery_tolerance(want, atol, RTOL, view))
    assert (got.meta.get("backend"), want.meta.get("backend")) == (backend, "transformers")


def assert_same_click(got_model, want_model, pair: dict) -> None:
    """A click (resid at " is", layer 6) shows the same top-5 tokens and probabilities (1e-5)."""
    import pytest

    from pipatch._experiments._api import plan_patch

    got = plan_patch(got_model, **pair, site="resid", positions=[4]).predictor()("resid", 6, 0, k=5)
    want = plan_patch(want_model, **pair, site="resid", positions=[4]).predictor()("resid", 6, 0, k=5)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [p for _, p in got] == pytest.approx([p for _, p in want], abs=1e-5)


def assert_same_multi_token(got_model, want_model, backend: str, everything: bool = True) -> None:
    """Multi-token answers (read teacher-forced) on ``backend`` equal transformers within 1e-4:
    " New York" vs " San Francisco" (the foil diverges at its first token: two inputs per
    cell), a one-token foil, a trace's P(" New York"), path patching, a click after the prompt.
    ``everything=False`` (a backend that runs the same invoke bodies as one already checked in
    full, over another transport): the two-input patch, a one-seed trace and the click."""
    import pipatch
    from pipatch._experiments._api import plan_patch

    pair = {"clean": "The Statue of Liberty is in the city of", "corrupt": "The Golden Gate Bridge is in the city of",
            "answer": " New York", "foil": " San Francisco"}
    patches = ({"site": "resid", "positions": [3, 5, -1]}, {"site": "head", "foil": " Boston"},
               {"site": "mlp", "positions": [-1], "direction": "noise"})
    for kwargs in patches if everything else patches[:1]:
        got, want = pipatch.patch(got_model, **pair | kwargs), pipatch.patch(want_model, **pair | kwargs)
        assert got.metric == want.metric == "logprob_diff"
        assert_same(got, want, backend=backend)
    trace = {"subject": "Statue of Liberty", "answer": " New York", "seeds": 2 if everything else 1}
    got, want = pipatch.trace(got_model, pair["clean"], **trace), pipatch.trace(want_model, pair["clean"], **trace)
    assert abs(got.meta["clean_prob"] - want.meta["clean_prob"]) < 1e-5
    assert_same(got, want, backend=backend)
    if everything:
        got, want = (pipatch.path_patch(m, **pair, sender="mlp") for m in (got_model, want_model))
        assert_same(got, want, backend=backend)
    clicks = [plan_patch(m, **pair, positions=[-1]).predictor()("resid", 14, 0, k=5) for m in (got_model, want_model)]
    assert [t for t, _ in clicks[0]] == [t for t, _ in clicks[1]] and clicks[1][0][0] == " New"


def assert_same_feature_circuit_checks(other, model, options: dict, backend: str, atol: float = ATOL,
                                       curve_atol: float | str | None = None, refused: bool = True) -> tuple:
    """A feature circuit scored on transformers (``model``), checked on ``other`` (vLLM,
    served, NDIF): refused without ``scores=`` in one line naming it (where ``refused``: a
    backend without backward passes); given the scores, its
    nodes and edges are the scored ones, every exact node ablation and exact edge patch equals
    the transformers one's within ``atol``, and each point of the faithfulness curve within
    ``curve_atol`` (default ``atol``; ``"float32"`` where ``other`` computes in its own
    float32 kernels: :func:`float32_curve_tolerance`, a curve point ablating whole SAEs).
    Returns ``(scored, checked)``."""
    import pytest

    import pipatch
    from pipatch._model.models import PipatchError

    if refused:
        with pytest.raises(PipatchError, match=r"scores=result\)$") as error:
            pipatch.feature_circuit(other, **options)
        assert "\n" not in str(error.value)
    scored = pipatch.feature_circuit(model, **options)
    checked = pipatch.feature_circuit(other, **options, scores=scored)
    assert checked.status == "done" and checked.meta["backend"] == backend
    assert checked.meta["scores_from"]["backend"] == "transformers"
    for table in ("nodes", "edges"):
        mine, theirs = getattr(checked, table)(), getattr(scored, table)()
        key = ["node"] if table == "nodes" else ["upstream", "downstream"]
        assert mine[key].equals(theirs[key]) and mine["exact"].isna().equals(theirs["exact"].isna())
        assert_close(torch.tensor(mine["score"].to_numpy()), torch.tensor(theirs["score"].to_numpy()), atol)
        done = theirs["exact"].notna() & (theirs["latent"] != "metric" if table == "nodes" else True)
        want = torch.tensor(theirs["exact"][done].to_numpy())
        got = torch.tensor(mine["exact"][done].to_numpy())
        print(f"feature circuit: {len(want)} {table} checked on {backend}, max |Δ| {float((got - want).abs().max()):.2g}")
        assert len(want) == options["verify" if table == "nodes" else "verify_edges"]
        assert_close(got, want, atol)
    exact = torch.tensor(scored.nodes()["exact"].dropna().to_numpy())
    assert float(exact[1:].abs().max()) > 1e-3  # the node checks move the metric
    mine, theirs = checked.faithfulness(), scored.faithfulness()
    assert list(mine["n_nodes"]) == list(theirs["n_nodes"]) and len(theirs) >= 2
    got, want = (torch.tensor(curve[["with", "without"]].to_numpy()) for curve in (mine, theirs))
    print(f"feature circuit: {len(theirs)} curve points on {backend}, max |Δ| {float((got - want).abs().max()):.2g}")
    if curve_atol == "float32":
        curve_atol = float32_curve_tolerance(scored, options)
        print(f"feature circuit: curve tolerance {curve_atol:.2g} (float32 against float64 on transformers)")
    assert_close(got, want, atol if curve_atol is None else curve_atol)
    return scored, checked


def float32_curve_tolerance(scored, options: dict) -> float:
    """How far two float32 backends' faithfulness curves of one feature circuit may lie apart.

    A curve point ablates all of a random SAE's latents but a few (or the few alone): the
    residual is then the SAE's error term plus what is kept, the difference of two vectors
    much larger than itself, and float32 rounding grows with them, not with the point's value.
    How much, the computation says itself: the same curve on the embedded model in float64
    (``options`` as ``scored``, the float32 transformers result, was run with) is its true
    value to ~1e-12, and ``E``, the largest distance of a ``scored`` point from it, is the
    rounding float32 puts on such a point here (measured 1.5e-3 on one torch thread, 2.1e-3
    on two, at the point whose SAEs keep one latent). A backend whose float32 rounding is of
    that size is within ``E`` of the truth, so two of them within ``2E``; ``ATOL`` above it
    for the points float32 happens to get right."""
    import pipatch
    from pipatch._backends._load import load_model

    # Loaded here and dropped after (2 GB in float64), not kept beside the module's engine.
    truth = pipatch.feature_circuit(load_model(dtype=torch.float64, device="cpu"), **options, progress=False)
    got, want = (torch.tensor(r.faithfulness()[["with", "without"]].to_numpy()) for r in (scored, truth))
    return ATOL + 2 * float((got - want).abs().max())


def assert_same_circuit_checks(other, model, pair: dict, backend: str = "vllm") -> None:
    """A circuit scored on transformers (``model``), checked on ``other`` (vLLM, served): its
    gradients refused in one line naming ``scores=``; with the scores, every checked edge's
    exact patch equals the transformers one's (senders and receivers of every kind among the
    top 30: the embeddings, heads, MLPs; q/k/v, MLP inputs, the logits), and the faithfulness
    curve, whose runs feed each receiver its own input, equals the transformers one point for
    point, with the same size at 80 %."""
    import pytest

    import pipatch
    from pipatch._model.models import PipatchError

    with pytest.raises(PipatchError) as error:
        pipatch.circuit(other, **pair, verify=0, curve=0)
    assert "\n" not in str(error.value) and "gradients" in str(error.value) and "scores=result" in str(error.value)
    options = {**pair, "method": "eap", "verify": 30, "curve": 6}
    scored = pipatch.circuit(model, **options)
    checked = pipatch.circuit(other, **options, scores=scored)
    assert checked.meta["scores_from"]["backend"] == "transformers" and checked.meta["backend"] == backend
    assert torch.allclose(checked.raw["edges"] - checked.corrupt, scored.raw["edges"] - scored.corrupt,
                          atol=1e-5, equal_nan=True)  # the scores given, on this run's corrupt baseline
    mine, theirs = checked.meta["checked"], scored.meta["checked"]
    assert [(e["sender"], e["receiver"]) for e in mine] == [(e["sender"], e["receiver"]) for e in theirs]
    got = torch.tensor([e["exact"] for e in mine])
    want = torch.tensor([e["exact"] for e in theirs])
    print(f"circuit checks on {backend}: max |Δ| {float((got - want).abs().max()):.2g}")
    assert_close(got, want, atol=ATOL * 10)
    def kind(name: str) -> str:  # "emb", "mlp12", "12.2" (a head), "14.0.q" (its query input), "logits"
        return name.rstrip("0123456789") if not name[0].isdigit() else ("head" if name.count(".") == 1 else "qkv")

    senders, receivers = {kind(e["sender"]) for e in mine}, {kind(e["receiver"]) for e in mine}
    assert senders == {"emb", "head", "mlp"} and receivers == {"qkv", "mlp", "logits"}, (senders, receivers)
    assert checked.meta["agreement"]["n"] == 30
    # No warning but the low-agreement advice (EAP on this pair agrees with exact patches at
    # about 0.7), which both backends give alike.
    advice = "the edge estimates agree poorly"
    assert not [w for w in checked.warnings if not w.startswith(advice)], checked.warnings
    assert any(w.startswith(advice) for w in checked.warnings) == any(w.startswith(advice) for w in scored.warnings)
    mine, theirs = checked.meta["faithfulness"], scored.meta["faithfulness"]
    assert theirs["size"] is not None
    assert_same_curve(mine, scored, backend)


def assert_same_curve(mine: dict, scored, backend: str) -> None:
    """A circuit's faithfulness curve (``meta["faithfulness"]``) measured on ``backend`` equals
    the one of ``scored`` (the transformers circuit) point for point, with the same sizes.

    Each point is a normalized recovery: its run's metric (:func:`assert_same_circuit_runs`)
    and the baselines within ATOL + RTOL·|value|, so it is within the ratio's bound of the
    transformers point (:func:`tests._tolerance.normalized_tolerance`). The sizes (the
    bisection towards the share, the size at 80 %) are choices made on those values: alike
    where no point is within its bound of the share (asserted: a point that close could go
    either way, and the test would then say so rather than compare two valid curves)."""
    theirs = scored.meta["faithfulness"]
    clean, corrupt = scored.clean, scored.corrupt
    metrics = [r * (clean - corrupt) + corrupt for r in theirs["recovery"]]
    eps = ATOL + RTOL * max(abs(clean), abs(corrupt), *(abs(m) for m in metrics))
    within = [normalized_tolerance(m, corrupt, clean, eps) for m in metrics]
    assert all(abs(r - theirs["share"]) > t for r, t in zip(theirs["recovery"], within)), (theirs, within)
    assert mine["sizes"] == theirs["sizes"] and mine["size"] == theirs["size"]
    print(f"faithfulness curve on {backend}: max |Δ| "
          f"{max(abs(a - b) for a, b in zip(mine['recovery'], theirs['recovery'])):.2g}, size {mine['size']}")
    assert all(abs(a - b) <= t for a, b, t in zip(mine["recovery"], theirs["recovery"], within, strict=True)), (
        mine["recovery"], theirs["recovery"], within)


def assert_same_circuit_runs(other, model, pair: dict, prompts: list[str]) -> None:
    """A circuit's runs on ``other`` (vLLM, served) equal the transformers backend's, mask for
    mask: none kept (the corrupt run), the edge embeddings → logits alone, a random half of the
    graph's edges, every edge; each against the corrupt run's values and against the mean over
    ``prompts`` (mean ablation; equal token counts)."""
    from pipatch._backends import backend_for
    from pipatch._experiments.patching import pair_inputs
    from pipatch._model.graph import graph
    from pipatch._programs import CircuitRunRequest, circuit_runs

    mine, theirs = backend_for(other), backend_for(model)
    valid = graph(theirs.adapter).valid
    emb_edge = torch.zeros_like(valid)
    emb_edge[-1, 0] = True  # receivers end with the logits, senders start with the embeddings
    half = valid & (torch.rand(valid.shape, generator=torch.Generator().manual_seed(0)) < 0.5)
    masks = torch.stack([torch.zeros_like(valid), emb_edge, half, valid])
    for backend in (mine, theirs):
        assert graph(backend.adapter).valid.equal(valid)
    runs = [pair_inputs(b, pair["clean"], pair["corrupt"], pair["answer"], pair["foil"], "logit_diff")
            for b in (mine, theirs)]
    means = [[b.tokenizer(t, return_tensors="pt").input_ids for t in prompts] for b in (mine, theirs)]
    assert len({ids.shape[1] for ids in means[0]}) == 1
    for mean in (False, True):
        got, want = (circuit_runs(b, CircuitRunRequest(r.clean_ids, r.corrupt_ids, r.metric, masks, m if mean else None))
                     for b, r, m in zip((mine, theirs), runs, means))
        print(f"circuit runs ({'mean' if mean else 'corrupt'} ablation): max |Δ| {float((got - want).abs().max()):.2g}")
        assert_close(got, want)
        assert (want[2:] - want[0]).abs().min() > 1e-2  # half the edges, and all, move the metric


def attention_both_ways(view, model, adapter) -> list:
    """Inside a run of ``model`` (an nnsight trace, or a vLLM request's body), at every layer:
    ``(ungrouped, grouped)``, the circuit view's ungrouped attention
    (:meth:`~pipatch._programs.circuit.CircuitView.attention`) fed each query head's query and
    its group's key and value (every query head of a group the same input), and the layer's own
    output of its heads (``z``), each ``[1, T, H·head_dim]`` float32 on the CPU."""
    from pipatch._model.models import _get, first
    from pipatch._model.sites import QKV

    out = []
    for layer in range(adapter.n_layers):
        normed = first(_get(adapter.block(model, layer), adapter.attn_norm).output).float()
        normed = normed if normed.dim() == 3 else normed[None]  # vLLM: [T, d]
        projected = {name: view.project(layer, name, normed) for name in adapter.qkv}
        q, k, v = (torch.cat([projected[name][..., lo:hi] for name, lo, hi in
                              (adapter.qkv_columns(which, head) for head in range(adapter.n_heads))], dim=-1)
                   for which in QKV)
        out.append((view.attention(layer, q, k, v).cpu(), view.z(layer).cpu()))
    return out
